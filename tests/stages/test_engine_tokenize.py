"""``/v1/tokenize`` and ``/v1/detokenize`` (and their unversioned names) on a real built-in engine,
checked against SGLang 0.5.23's ``serving_tokenize.py`` / ``protocol.py`` (``TokenizeRequest``,
``DetokenizeRequest``) and against the engine's own ``/v1/chat/completions``, whose prompt the
tokenized messages must be."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from stages.engine.tokenize_routes import TokenizeRoutes
from stages.light_tokenizer import transformers_tokenizer
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_tiny_model

BOS = 3  # the tokenizer adds it in front of each text it encodes with special tokens
MODEL_MAX_LENGTH = 300  # the tokenizer's; the model's context is 512
# word-level, as the tokenizer is; each switch a template reads shows as a word
TEMPLATE = (
    "{%- if tools %}w5 {% for t in tools %}w{{ 20 + loop.index }} {% endfor %}w6 {% endif %}"
    "{%- if enable_thinking %}w30 {% endif %}"
    "{%- if reasoning_effort == 'high' %}w31 {% endif %}"
    "{%- if flavour %}w{{ flavour }} {% endif %}"
    "{%- for m in messages %}"
    "{% if m.role == 'user' %}w7 {% elif m.role == 'assistant' %}w8 {% else %}w9 {% endif %}"
    "{{ m.content }} w10 {% endfor %}"
    "{%- if add_generation_prompt %}w8 {% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
HELLO = [{"role": "user", "content": "w11 w12 w13"}]
ERROR_KEYS = {"object", "message", "type", "param", "code"}


def _bos_tokenizer() -> PreTrainedTokenizerFast:
    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "<bos>": BOS}
    words.update({f"w{i}": i for i in range(4, 128)})
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", model_max_length=MODEL_MAX_LENGTH,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(
        tmp_path_factory.mktemp("tokenize") / "model", seed=4, with_tokenizer=False
    )
    _bos_tokenizer().save_pretrained(path)
    (path.parent / "template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    with builtin_engine(
        model_dir, "--chat-template", str(model_dir.parent / "template.jinja")
    ) as u:
        yield u


def _post(url: str, path: str, body: Any) -> tuple[int, Any]:
    resp = requests.post(url + path, json=body, timeout=30)
    return resp.status_code, resp.json()


def _ok(url: str, path: str, body: Any) -> Any:
    status, answer = _post(url, path, body)
    assert status == 200, answer
    return answer


def _refused(url: str) -> dict[str, int]:
    return requests.get(url + "/get_server_info", timeout=10).json()["refused_requests"]


@pytest.mark.timeout(60)
def test_a_prompt_is_encoded_with_or_without_special_tokens(url: str) -> None:
    # serving_tokenize.py:58-73: tokenizer.encode(prompt, add_special_tokens=...) (default
    # true), a list of strings one row each; max_model_len: the tokenizer's model_max_length
    one = _ok(url, "/v1/tokenize", {"prompt": "w10 w11", "model": "any name"})
    assert one == {"tokens": [BOS, 10, 11], "count": 3, "max_model_len": MODEL_MAX_LENGTH}
    bare = _ok(url, "/v1/tokenize", {"prompt": "w10 w11", "add_special_tokens": False})
    assert (bare["tokens"], bare["count"]) == ([10, 11], 2)
    rows = _ok(url, "/tokenize", {"prompt": ["w10", "w11 w12", ""]})
    assert rows["tokens"] == [[BOS, 10], [BOS, 11, 12], [BOS]] and rows["count"] == [2, 3, 1]
    assert _ok(url, "/tokenize", {"prompt": []})["tokens"] == []


@pytest.mark.timeout(30)
def test_max_model_len_is_the_context_length_when_the_tokenizer_sets_no_limit(
    model_dir: Path,
) -> None:
    # serving_tokenize.py:47-52: transformers' "no limit" (int(1e30)) is no 64-bit integer
    tokenizer = transformers_tokenizer(model_dir)
    loaded = _Loaded(tokenizer, vocab_size=128, context_length=512)
    assert TokenizeRoutes(loaded, None).tokenized({"prompt": "w9"})["max_model_len"] == 300
    tokenizer.model_max_length = int(1e30)
    assert TokenizeRoutes(loaded, None).tokenized({"prompt": "w9"})["max_model_len"] == 512


class _Loaded:
    def __init__(self, tokenizer: Any, vocab_size: int, context_length: int) -> None:
        self.tokenizer, self.vocab_size, self.context_length = tokenizer, vocab_size, context_length


@pytest.mark.timeout(60)
def test_messages_tokenize_to_the_prompt_of_a_chat_request_with_them(url: str) -> None:
    cases = [
        ({"messages": HELLO}, [7, 11, 12, 13, 10, 8]),
        ({"messages": HELLO, "tools": TOOLS}, [5, 21, 6, 7, 11, 12, 13, 10, 8]),
        ({"messages": HELLO, "tools": TOOLS, "tool_choice": "none"}, [7, 11, 12, 13, 10, 8]),
        # reasoning_effort: the template's thinking switches (SGLang's normalize_reasoning_inputs)
        # and reasoning_effort itself; chat_template_kwargs as given
        (
            {
                "messages": HELLO,
                "reasoning_effort": "high",
                "chat_template_kwargs": {"flavour": 44},
            },
            [30, 31, 44, 7, 11, 12, 13, 10, 8],
        ),
        # continue_final_message: the last assistant message left open
        (
            {
                "messages": [*HELLO, {"role": "assistant", "content": "w40 w41"}],
                "continue_final_message": True,
            },
            [7, 11, 12, 13, 10, 8, 40, 41],
        ),
        # serving_chat._handle_last_assistant_message: a last assistant message is sent as
        # the user's (w7, not w8) unless it is continued
        (
            {"messages": [*HELLO, {"role": "assistant", "content": "w40 w41"}]},
            [7, 11, 12, 13, 10, 7, 40, 41, 10, 8],
        ),
        # add_special_tokens does not apply to messages without add_generation_prompt
        ({"messages": HELLO, "add_special_tokens": True}, [7, 11, 12, 13, 10, 8]),
    ]
    for body, ids in cases:
        answer = _ok(url, "/v1/tokenize", body)
        assert answer == {"tokens": ids, "count": len(ids), "max_model_len": MODEL_MAX_LENGTH}
        chat_body = {k: v for k, v in body.items() if k != "add_special_tokens"}
        chat = _ok(url, "/v1/chat/completions", {**chat_body, "max_tokens": 1})
        assert chat["usage"]["prompt_tokens"] == len(ids), body
    # the same prompt, token for token: a greedy chat answer is /generate's on these ids
    body = {"messages": HELLO, "reasoning_effort": "high", "chat_template_kwargs": {"flavour": 44}}
    ids = _ok(url, "/tokenize", body)["tokens"]
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    chat = _ok(url, "/v1/chat/completions", {**body, **greedy})
    native = _ok(
        url,
        "/generate",
        {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                               "ignore_eos": True}},
    )  # fmt: skip
    assert chat["choices"][0]["message"]["content"] == native["text"]
    assert chat["usage"]["completion_tokens"] == len(native["output_ids"]) == 8


@pytest.mark.timeout(60)
def test_add_generation_prompt_renders_the_messages_as_given(url: str) -> None:
    # protocol.py TokenizeRequest.to_chat_completion_request: the flag goes to the template,
    # and the text is encoded with special tokens only when add_special_tokens is set true
    def tokens(**more: Any) -> list[int]:
        return _ok(url, "/v1/tokenize", {"messages": HELLO, **more})["tokens"]

    assert tokens(add_generation_prompt=False) == [7, 11, 12, 13, 10]
    assert tokens(add_generation_prompt=True) == [7, 11, 12, 13, 10, 8]
    assert tokens(add_generation_prompt=False, add_special_tokens=True) == [BOS, 7, 11, 12, 13, 10]
    assert tokens(add_generation_prompt=True, add_special_tokens=False) == [7, 11, 12, 13, 10, 8]
    # serving_tokenize.py:108-115: continuing the last message needs the assistant turn open
    opened = [*HELLO, {"role": "assistant", "content": "w40"}]
    body = {"messages": opened, "continue_final_message": True}
    assert _ok(url, "/v1/tokenize", {**body, "add_generation_prompt": True})["tokens"] == [
        7, 11, 12, 13, 10, 8, 40,
    ]  # fmt: skip
    status, answer = _post(url, "/v1/tokenize", {**body, "add_generation_prompt": False})
    assert status == 400 and answer["param"] == "add_generation_prompt"
    assert answer["message"].startswith("continue_final_message needs add_generation_prompt")
    # with the flag given and nothing continued, a last assistant message stays the assistant's
    assert _ok(url, "/v1/tokenize", {"messages": opened, "add_generation_prompt": False})[
        "tokens"
    ] == [7, 11, 12, 13, 10, 8, 40, 10]
    # a chat request's chat_template_kwargs cannot carry it: SGLang passes the template its
    # own (serving_chat._render_and_encode_chat_template), whose TypeError is a 400
    bad = {"messages": HELLO, "chat_template_kwargs": {"add_generation_prompt": False}}
    status, answer = _post(url, "/v1/chat/completions", bad)
    assert status == 400 and "add_generation_prompt" in answer["message"]


@pytest.mark.timeout(60)
def test_detokenize_gives_back_the_text_of_ids_and_of_lists_of_them(url: str) -> None:
    # serving_tokenize.py:159-191: a list -> a string, a list of lists -> strings, [] -> "";
    # skip_special_tokens (default true) drops the BOS
    ids = _ok(url, "/v1/tokenize", {"prompt": "w10 w11 w12"})["tokens"]
    assert _ok(url, "/v1/detokenize", {"tokens": ids}) == {"text": "w10 w11 w12"}
    kept = _ok(url, "/detokenize", {"tokens": ids, "skip_special_tokens": False})
    assert kept == {"text": "<bos> w10 w11 w12"}
    rows = _ok(url, "/v1/tokenize", {"prompt": ["w20 w21", "w22"]})["tokens"]
    assert _ok(url, "/v1/detokenize", {"tokens": rows}) == {"text": ["w20 w21", "w22"]}
    assert _ok(url, "/v1/detokenize", {"tokens": [[], [BOS]]}) == {"text": ["", ""]}
    assert _ok(url, "/v1/detokenize", {"tokens": []}) == {"text": ""}
    # the model's last id, which the engine may generate, decodes
    assert _ok(url, "/v1/detokenize", {"tokens": [127]}) == {"text": "w127"}


@pytest.mark.timeout(60)
def test_bad_requests_get_sglangs_error_and_are_counted_and_the_engine_serves_on(
    url: str,
) -> None:
    before = _refused(url)
    # (body, what the message names, param): param "Bad Request" where SGLang's request model
    # refuses the body (its RequestValidationError handler: type "Bad Request", param null)
    tokenize_cases = [
        ({}, "Exactly one of", None),  # TokenizeRequest.validate_tokenize_input
        ({"prompt": "w10", "messages": HELLO}, "Exactly one of", None),  # both
        ({"prompt": 5}, "prompt.list[str]: Input should be a valid list", None),
        ({"prompt": ["w10", 3]}, "prompt.list[str].1: Input should be a valid string", None),
        ({"prompt": "w10", "add_special_tokens": "maybe"}, "add_special_tokens: ", None),
        ({"prompt": "w10", "model": 3}, "model: Input should be a valid string", None),
        ({"prompt": "w10", "tools": ["f"]}, "tools.0: Input should be a valid dict", None),
        ({"prompt": "w10", "reasoning_effort": "hard"}, "reasoning_effort.literal", None),
        ({"messages": []}, "Messages cannot be empty", "messages"),  # the chat route's checks
        ({"messages": HELLO, "tool_choice": "required"}, "Tools cannot be empty", "tool_choice"),
        ({"messages": HELLO, "add_generation_prompt": "maybe"}, "add_generation_prompt", None),
        ({"messages": HELLO, "n": None}, "n: Input should be a valid integer", "chat"),
        ([1, 2], "Input should be a valid dictionary", None),
    ]
    detokenize_cases = [
        ({}, "tokens: Field required", None),
        ({"tokens": [1, "w2"]}, "tokens.list[int].1: Input should be a valid integer", None),
        ({"tokens": [1, [2]]}, "tokens.list[list[int]].0: Input should be a valid list", None),
        ({"tokens": [128]}, "token id 128 is outside the vocabulary", "tokens"),
        ({"tokens": [[4], [-1]]}, "token id -1 is outside", "tokens"),
        ({"tokens": [4], "skip_special_tokens": "no way"}, "skip_special_tokens", None),
    ]
    for path, cases in (("/v1/tokenize", tokenize_cases), ("/v1/detokenize", detokenize_cases)):
        for body, words, param in cases:
            status, answer = _post(url, path, body)
            assert status == 400 and set(answer) == ERROR_KEYS, (body, answer)
            assert words in answer["message"] and answer["code"] == 400, (body, answer)
            # a chat request's own fields: SGLang's to_chat_completion_request, a ValueError
            kind = "BadRequestError" if param else "Bad Request"
            assert answer["object"] == "error" and answer["type"] == kind, (body, answer)
            assert answer["param"] == (None if param == "chat" else param), (body, answer)
    # pydantic's lax mode, as SGLang's models read: "no" and 0 are false, "0" too; ids as numbers
    lax = {"prompt": "w10", "add_special_tokens": "no", "continue_final_message": 0}
    assert _ok(url, "/v1/tokenize", lax)["tokens"] == [10]
    lax = {"tokens": [True, 10.0], "skip_special_tokens": "0"}  # true is 1: EOS
    assert _ok(url, "/v1/detokenize", lax) == {"text": "<eos> w10"}
    status, answer = _post(url, "/v1/detokenize", {"tokens": [[4], [-1]]})
    assert answer["message"] == "tokens[1][0]: token id -1 is outside the vocabulary [0, 128)"
    # validate_json_request: JSON only
    plain = requests.post(url + "/tokenize", data="w10", timeout=10)
    assert plain.status_code == 400 and plain.json()["type"] == "Bad Request"
    assert plain.json()["message"].startswith("header.content-type: Unsupported Media Type")
    after = _refused(url)
    for key, more in (
        ("POST /v1/tokenize 400", len(tokenize_cases)),
        ("POST /v1/detokenize 400", len(detokenize_cases) + 1),
        ("POST /tokenize 400", 1),
    ):
        assert after.get(key, 0) - before.get(key, 0) == more, (key, after)
    assert _ok(url, "/v1/tokenize", {"prompt": "w10"})["tokens"] == [BOS, 10]
    out = _ok(url, "/generate", {"input_ids": [BOS, 10], "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["completion_tokens"] >= 1


@pytest.mark.timeout(60)
def test_a_model_without_a_tokenizer_is_told_which_route_needs_one(tmp_path: Path) -> None:
    bare = make_tiny_model(tmp_path / "bare", with_tokenizer=False)
    with builtin_engine(bare) as bare_url:
        for path, body in (("/v1/tokenize", {"prompt": "w1"}), ("/detokenize", {"tokens": [1]})):
            status, answer = _post(bare_url, path, body)
            assert status == 400 and answer["object"] == "error", answer
            assert path in answer["message"] and "no tokenizer" in answer["message"]
