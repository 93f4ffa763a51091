"""``/v1/systemone`` on a real built-in engine (``stages.engine.systemone``), as SGLang 0.5.23
serves it on a model without a Clef, Kev or decision head: every question's answer (``noul``,
``choice`` with one letter, two-letter labels past 26 options, ``score``) equals what
transformers gives for the prompt written out here (the chat template's rendering of the
question, the labels' log-probs at the answer position), with the confidences computed here;
what SGLang refuses is refused with its status, shape and words, the engine serving on.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from transformers import AutoTokenizer

from stages.engine import systemone
from stages.engine.openai_chat import ChatSettings
from tests.stages.engine_setup import builtin_engine, load_reference
from tests.stages.tiny_model import make_byte_model

PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"
PAIRS = tuple(a + b for a in "AB" for b in string.ascii_uppercase)[:31]  # AA .. BE: 31 labels
# an added token (<asst>) between the message and the answer position: what two-letter labels
# need (SGLang's _pair_labels), as Qwen's <|im_start|> before "assistant\n"
TEMPLATE = (
    "{% for m in messages %}<user>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<asst>Answer: {% endif %}"
)
STATE = "The sky is green."
MANY = {f"opt{i}": (f"option number {i}" if i % 2 else None) for i in range(27)}
QUESTIONS = {
    "true": {"type": "noul", "instructions": "Is the sky green?",
             "criteria": {"true": "it is", "false": {"not": "so"}}},
    "plain": {"type": "noul", "criteria": {"false": "it is not"}},
    "color": {"type": "choice", "instructions": "Which color?",
              "criteria": {"red": None, "blue": "like the sky", "green": ["grass"]}},
    "only": {"type": "choice", "criteria": {"it": "the one"}},
    "how": {"type": "score", "instructions": {"how": "true"},
            "criteria": ["no", {"half": 1}, "fully"]},
    "one": {"type": "score", "criteria": ["all"]},
    "many": {"type": "choice", "instructions": "Which one?", "criteria": MANY},
}  # fmt: skip
# each question's user message, written out as SGLang's render_question writes it
MESSAGES = {
    "true": f"{STATE}\n\nIs the following true? Is the sky green?\nyes: it is\n"
    'no: {"not":"so"}\nAnswer with yes or no only.',
    "plain": f"{STATE}\n\nIs the following true?\nno: it is not\nAnswer with yes or no only.",
    "color": f"{STATE}\n\nQuestion: Which color?\nA: red\nB: blue - like the sky\n"
    'C: green - ["grass"]\nAnswer with the letter of one option only.',
    "only": f"{STATE}\n\nA: it - the one\nAnswer with the letter of one option only.",
    "how": f'{STATE}\n\nQuestion: {{"how":"true"}}\n0: no\n1: {{"half":1}}\n2: fully\n'
    "Answer with the number of one level only.",
    "one": f"{STATE}\n\n0: all\nAnswer with the number of one level only.",
    "many": f"{STATE}\n\nQuestion: Which one?\n"
    + "".join(
        f"{label}: {name} - {detail}\n" if detail else f"{label}: {name}\n"
        for label, (name, detail) in zip(PAIRS, MANY.items(), strict=False)
    )
    + "Answer with the letter of one option only.",
}
LABELS = {"true": ["yes", "no"], "plain": ["yes", "no"], "color": ["A", "B", "C"], "only": ["A"],
          "how": ["0", "1", "2"], "one": ["0"], "many": list(PAIRS[:27])}  # fmt: skip
NAMES = {"true": ["yes", "no"], "plain": ["yes", "no"], "color": ["red", "blue", "green"],
         "only": ["it"], "how": ["0", "1", "2"], "one": ["0"], "many": list(MANY)}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level model whose tags and two-letter labels are whole (added) tokens
    (``make_tagged_byte_model``'s), with room for 27 options: 2048 positions."""
    root = tmp_path_factory.mktemp("systemone")
    tags = ["yes", "no", "<user>", "<asst>", *PAIRS]
    path = make_byte_model(root / "m", seed=4, chars=PRINTABLE, words=tuple(tags),
                           max_positions=2048)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(tags)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def url(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    flags = ("--chat-template", str(template), "--served-model-name", "judge")
    with builtin_engine(model, *flags) as engine:
        yield engine


def _ask(url: str, body: Any, **kwargs: Any) -> requests.Response:
    return requests.post(url + "/v1/systemone", json=body, timeout=60, **kwargs)


@torch.no_grad()
def _expected(model: Path, message: str, labels: list[str]) -> tuple[list[int], list[float]]:
    """transformers' prompt ids and the labels' log-probs (float64) after them."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], chat_template=TEMPLATE, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    label_ids = []
    for label in labels:
        after = tokenizer.encode(prompt + label, add_special_tokens=False)
        assert after[:-1] == ids  # one token each
        label_ids.append(after[-1])
    assert len(set(label_ids)) == len(labels)
    logits = load_reference(model)(torch.tensor([ids])).logits[0, -1].double()
    return ids, torch.log_softmax(logits, -1)[label_ids].tolist()


def _confidences(p: list[float]) -> tuple[float, float]:
    """(choice, score) confidence of scored probabilities, as the System One API defines them:
    the top option's lead over a uniform guess, scaled to 0-1; one less the expected distance
    from the top level over that of a uniform distribution, at least 0."""
    n, q = len(p), [x / sum(p) for x in p]
    if n == 1:
        return 1.0, 1.0
    choice = min(1.0, max(0.0, (max(q) - 1 / n) / (1 - 1 / n)))
    top = max(range(n), key=lambda i: (q[i], -i))
    uniform = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return choice, max(0.0, 1 - sum(x * abs(i - top) for i, x in enumerate(q)) / uniform)


@pytest.mark.timeout(180)
def test_answers_are_the_labels_probabilities_as_transformers_gives_them(
    url: str, model: Path
) -> None:
    body = {"state": STATE, "model": "whatever", "questions": QUESTIONS, "extra": "ignored"}
    answer = _ask(url, body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert list(got) == ["model", "answers", "usage"] and got["model"] == "judge"
    assert list(got["answers"]) == list(QUESTIONS)
    prompt_tokens = 0
    for question_id, question in QUESTIONS.items():
        ids, logprobs = _expected(model, MESSAGES[question_id], LABELS[question_id])
        prompt_tokens += len(ids)
        top = max(logprobs)
        weights = [math.exp(lp - top) for lp in logprobs]
        p = [w / sum(weights) for w in weights]
        mine = got["answers"][question_id]
        assert mine["x_label_mass"] == pytest.approx(sum(map(math.exp, logprobs)), rel=1e-4)
        if question["type"] == "noul":
            assert list(mine) == ["type", "noul", "x_label_mass"] and mine["type"] == "noul"
            assert mine["noul"] == pytest.approx(p[0], abs=1e-5)
            continue
        names = NAMES[question_id]
        assert list(mine["probabilities"]) == names
        for name, want in zip(names, p, strict=True):
            assert mine["probabilities"][name] == pytest.approx(want, abs=1e-5)
        scored = [mine["probabilities"][name] for name in names]
        choice, score = _confidences(scored)
        if question["type"] == "choice":
            assert list(mine) == ["type", "choice", "confidence", "probabilities", "x_label_mass"]
            assert mine["choice"] == names[scored.index(max(scored))]
            assert mine["confidence"] == pytest.approx(choice, abs=1e-12)
        else:
            assert list(mine) == ["type", "score", "confidence", "legend", "probabilities",
                                  "x_label_mass"]  # fmt: skip
            assert mine["score"] == pytest.approx(sum(i * x for i, x in enumerate(scored)))
            assert mine["confidence"] == pytest.approx(score, abs=1e-12)
            assert mine["legend"] == dict(zip(names, question["criteria"], strict=True))
    assert got["usage"] == {"input_tokens": prompt_tokens, "output_tokens": 0}
    info = requests.get(url + "/server_info", timeout=30).json()  # the ignored key, counted
    assert info["ignored_fields"]["POST /v1/systemone extra"] == 1


# each refusal as SGLang 0.5.23 answers it: (body, status, what the answer holds); 422s are
# FastAPI's detail list (http_server.py:653, the input echo left out), 400s its ErrorResponse
NOUL = {"q": {"type": "noul", "instructions": "ok?"}}
BODY = {"state": "x", "model": "m", "questions": NOUL}
REFUSED = [
    # systemone/protocol.py:37, a question's unknown keys (extra="forbid")
    ({**BODY, "questions": {"q": {**NOUL["q"], "instruction": "typo"}}}, 422,
     {"type": "extra_forbidden", "loc": ["body", "questions", "q", "noul", "instruction"],
      "msg": "Extra inputs are not permitted"}),
    # systemone/protocol.py:43, the noul criteria's
    ({**BODY, "questions": {"q": {**NOUL["q"], "criteria": {"maybe": "x"}}}}, 422,
     {"type": "extra_forbidden", "loc": ["body", "questions", "q", "noul", "criteria", "maybe"],
      "msg": "Extra inputs are not permitted"}),
    # systemone/protocol.py:97, model required
    ({"state": "x", "questions": NOUL}, 422,
     {"type": "missing", "loc": ["body", "model"], "msg": "Field required"}),
    # systemone/protocol.py:99, one question at least
    ({**BODY, "questions": {}}, 422,
     {"type": "too_short", "loc": ["body", "questions"],
      "msg": "Dictionary should have at least 1 item after validation, not 0",
      "ctx": {"field_type": "Dictionary", "min_length": 1, "actual_length": 0}}),
    # systemone/protocol.py:60, a noul question with nothing to decide on
    ({**BODY, "questions": {"q": {"type": "noul", "criteria": {"true": " "}}}}, 422,
     {"type": "value_error", "loc": ["body", "questions", "q", "noul"],
      "msg": "Value error, a noul question needs instructions or a true or false description "
             "to decide on", "ctx": {"error": {}}}),
    # systemone/protocol.py:70, at most MAX_CHOICE_OPTIONS (255) options
    ({**BODY, "questions": {"q": {"type": "choice",
                                  "criteria": {f"o{i}": None for i in range(256)}}}}, 422,
     {"type": "too_long", "loc": ["body", "questions", "q", "choice", "criteria"],
      "msg": "Dictionary should have at most 255 items after validation, not more",
      "ctx": {"field_type": "Dictionary", "max_length": 255, "actual_length": None}}),
    # openai/protocol.py:1550 check_option_names, from systemone/protocol.py:77
    ({**BODY, "questions": {"q": {"type": "choice", "criteria": {"a": None, "A ": None}}}}, 422,
     {"type": "value_error", "loc": ["body", "questions", "q", "choice", "criteria"],
      "msg": "Value error, option name 'A ' repeats another option", "ctx": {"error": {}}}),
    # systemone/protocol.py:83, at most MAX_SCORE_LEVELS (10) levels
    ({**BODY, "questions": {"q": {"type": "score", "criteria": ["l"] * 11}}}, 422,
     {"type": "too_long", "loc": ["body", "questions", "q", "score", "criteria"],
      "msg": "List should have at most 10 items after validation, not 11",
      "ctx": {"field_type": "List", "max_length": 10, "actual_length": 11}}),
    # openai/protocol.py:1546 RequiredDecisionText, a blank level
    ({**BODY, "questions": {"q": {"type": "score", "criteria": ["l", ""]}}}, 422,
     {"type": "value_error", "loc": ["body", "questions", "q", "score", "criteria", 1],
      "msg": "Value error, must not be blank", "ctx": {"error": {}}}),
    # systemone/protocol.py:86, the question types
    ({**BODY, "questions": {"q": {"type": "yes_no", "question": "ok?"}}}, 422,
     {"type": "union_tag_invalid", "loc": ["body", "questions", "q"],
      "msg": "Input tag 'yes_no' found using 'type' does not match any of the expected tags: "
             "'noul', 'choice', 'score'",
      "ctx": {"discriminator": "'type'", "tag": "yes_no",
              "expected_tags": "'noul', 'choice', 'score'"}}),
    # systemone/protocol.py:113, /v1/decisions' fields refused by name
    ({**BODY, "temperature": 0.5}, 422,
     {"type": "value_error", "loc": ["body", "temperature"],
      "msg": "Value error, temperature is not part of this API, use /v1/decisions for it",
      "ctx": {"error": {}}}),
    # openai/serving_decisions.py:201 (_validate_images): a text-only model
    ({**BODY, "images": ["data:image/png;base64,AA=="]}, 400,
     {"object": "error", "message": "/v1/systemone images require a model served with "
      "multimodal input, and some vision models need --enable-multimodal",
      "type": "BadRequestError", "param": None, "code": 400}),
    # openai/serving_decisions.py:189 (_validate_server): an adapter named in model
    ({**BODY, "model": "judge:adapter"}, 400,
     {"object": "error", "message": "model names the LoRA adapter 'adapter', which "
      "/v1/systemone does not support", "type": "BadRequestError", "param": None, "code": 400}),
    # systemone/serving.py:323: more options than two-letter labels (31 with this tokenizer)
    ({**BODY, "questions": {"q": {"type": "choice",
                                  "criteria": {f"o{i}": None for i in range(32)}}}}, 400,
     {"object": "error", "message": "question 'q': it has 32 options, but the served "
      "tokenizer and chat template can label at most 31", "type": "BadRequest", "param": None,
      "code": 400}),
    # systemone/serving.py:557 (_check_legend): a level orjson cannot write
    ({**BODY, "questions": {"q": {"type": "score", "criteria": ["l", [2**64]]}}}, 400,
     {"object": "error", "message": "question 'q': a level cannot be returned in the legend: "
      "Integer exceeds 64-bit range", "type": "BadRequest", "param": None, "code": 400}),
    # openai/serving_decisions.py:351 (_encode_question): a prompt past the context
    ({**BODY, "state": "x" * 3000}, 400,
     {"object": "error", "message": "question 'q': the prompt has 3061 tokens, which does not "
      "fit the context length of 2048 tokens", "type": "BadRequest", "param": None,
      "code": 400}),
]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("body", "status", "want"), REFUSED)
def test_what_sglang_refuses_is_refused_with_its_status_and_words(
    url: str, body: dict[str, Any], status: int, want: dict[str, Any]
) -> None:
    answer = _ask(url, body)
    assert answer.status_code == status, answer.text
    assert answer.json() == (want if status == 400 else {"detail": [want]})
    assert _ask(url, BODY).status_code == 200  # serving on


@pytest.mark.timeout(120)
def test_bodies_sglangs_route_does_not_read_are_refused_as_fastapi_refuses_them(
    url: str,
) -> None:
    """http_server.py:695 (validate_json_request) and FastAPI's reading of the body."""
    media = {"loc": ["header", "content-type"],
             "msg": "Unsupported Media Type: Only 'application/json' is allowed",
             "type": "value_error"}  # fmt: skip
    post = url + "/v1/systemone"
    answer = requests.post(post, data=b'{"state": "x"}', headers={"Content-Type": "text/plain"})
    assert (answer.status_code, answer.json()) == (422, {"detail": [media]})
    answer = requests.post(post, data=b'{"state": ', headers={"Content-Type": "application/json"})
    invalid = {"type": "json_invalid", "loc": ["body", 10], "msg": "JSON decode error",
               "ctx": {"error": "Expecting value"}}  # fmt: skip
    assert (answer.status_code, answer.json()) == (422, {"detail": [invalid]})
    answer = requests.post(post, data=b"", headers={"Content-Type": "application/json"})
    missing = {"type": "missing", "loc": ["body"], "msg": "Field required"}
    assert (answer.status_code, answer.json()) == (422, {"detail": [missing]})
    answer = requests.post(post, data=b"\xff\xfe{", headers={"Content-Type": "application/json"})
    unreadable = {"detail": "There was an error parsing the body"}  # not text: a 400 there
    assert (answer.status_code, answer.json()) == (400, unreadable)


def _settings(model: Path, template: str) -> ChatSettings:
    settings = ChatSettings.of(AutoTokenizer.from_pretrained(model), model, chat_template=template)
    assert settings is not None
    return settings


@pytest.mark.timeout(120)
def test_two_letter_labels_and_reasoning_are_refused_where_sglang_refuses_them(
    model: Path,
) -> None:
    """Past 26 options: a template whose last added token is before the message, a tokenizer
    with no added tokens (systemone/serving.py:373, :390); the template's reasoning toggle
    (Qwen3's enable_thinking) set false and not to be set on, a template that always reasons
    (openai/serving_decisions.py:220, :226)."""
    many = {"state": "x", "model": "m", "questions": {"q": {"type": "choice", "criteria": MANY}}}
    request = systemone.SystemOneRequest.model_validate(many)
    native, options = systemone.systemone_request(request, _settings(model, TEMPLATE), 4096, "m")
    assert options["views"][0].labels == list(PAIRS[:27])
    ending = _settings(model, TEMPLATE.replace("<asst>", ""))
    with pytest.raises(systemone.Refused, match="needs an added token between the message"):
        systemone.systemone_request(request, ending, 4096, "m")
    bare = _settings(model, TEMPLATE)
    bare.tokenizer.get_added_vocab = dict  # a tokenizer that reports no added tokens
    with pytest.raises(systemone.Refused, match="the served tokenizer reports none") as refused:
        systemone.systemone_request(request, bare, 4096, "m")
    assert refused.value.kind == "BadRequest"
    qwen3_like = TEMPLATE.replace(
        "<asst>", "<asst>{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% endif %}",
    )  # fmt: skip
    request = systemone.SystemOneRequest.model_validate(BODY)
    native, _ = systemone.systemone_request(request, _settings(model, qwen3_like), 4096, "m")
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.decode(native["input_ids"][0]).endswith("</think>\n\nAnswer: ")
    on = systemone.SystemOneRequest.model_validate(
        {**BODY, "chat_template_kwargs": {"enable_thinking": True}}
    )
    with pytest.raises(systemone.Refused, match="sets 'enable_thinking' to True, but") as refused:
        systemone.systemone_request(on, _settings(model, qwen3_like), 4096, "m")
    assert refused.value.kind == "BadRequestError"
    always = "{% for m in messages %}<|im_start|>assistant\\n<think>\\n{% endfor %}"
    with pytest.raises(systemone.Refused, match="/v1/systemone does not support chat templates"):
        systemone.systemone_request(request, _settings(model, always), 4096, "m")
