"""``/v1/decisions`` on a real built-in engine (``stages.engine.openai_decisions``), as SGLang
0.5.23 serves it: every question's answer equals what transformers gives for the same prompt
(the chat template's rendering of the question, the labels' log-probs at the answer position),
and what SGLang refuses is refused in its words, the engine serving on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from transformers import AutoTokenizer

from stages.engine.openai_api import OpenAIError
from stages.engine.openai_chat import ChatSettings
from stages.engine.openai_decisions import (
    DecisionRequest,
    View,
    decisions_request,
    render_question,
)
from tests.stages.engine_setup import builtin_engine, load_reference
from tests.stages.tiny_model import make_tagged_byte_model

PRINTABLE = "".join(chr(c) for c in range(32, 127)) + "\n"
TEMPLATE = (
    "{% for m in messages %}<user>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Answer: {% endif %}"
)
QUESTIONS = [
    {"id": "true", "type": "yes_no", "question": "Is the statement correct?", "no": "it is not"},
    {"id": "color", "type": "choice", "question": "Which color?",
     "options": [{"name": "red"}, {"name": "blue", "description": "like the sky"},
                 {"name": "green"}]},
    {"id": "how", "type": "score", "question": "How true?", "levels": ["no", "half", "fully"]},
]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("decisions")
    return make_tagged_byte_model(root / "m", ("yes", "no", "<user>"), chars=PRINTABLE)


@pytest.fixture(scope="module")
def url(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    with builtin_engine(model, "--chat-template", str(template)) as engine:
        yield engine


def _decide(url: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(url + "/v1/decisions", json=body, timeout=60)


@torch.no_grad()
def _expected(model: Path, question: dict, text: str, temperature: float) -> dict[str, Any]:
    """transformers' answer: the template's prompt, each label's log-prob after it."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    from stages.engine.openai_decisions import DecisionRequest

    parsed = DecisionRequest.model_validate({"input": text, "questions": [question]})
    view = View.of(parsed.questions[0])
    content = render_question(text, view)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], chat_template=TEMPLATE, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    labels = [
        tokenizer.encode(prompt + label, add_special_tokens=False)[-1] for label in view.labels
    ]
    logits = load_reference(model)(torch.tensor([ids])).logits[0, -1].double()
    logprobs = torch.log_softmax(logits, -1)[labels]
    probabilities = torch.softmax(logprobs / temperature, -1).tolist()
    return {
        "ids": ids,
        "labels": labels,
        "probabilities": dict(zip(view.names, probabilities, strict=True)),
        "label_mass": float(logprobs.exp().sum()),
        "names": view.names,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_answers_are_the_labels_probabilities_as_transformers_gives_them(
    url: str, model: Path, temperature: float
) -> None:
    text = "The sky is green."
    body = {"input": text, "questions": QUESTIONS, "temperature": temperature,
            "return_prompt_token_ids": True, "model": "judge"}  # fmt: skip
    answer = _decide(url, body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert (got["object"], got["model"], got["prompt_format_version"]) == ("decisions", "judge", 1)
    assert list(got["answers"]) == ["true", "color", "how"]
    prompt_tokens = 0
    for question in QUESTIONS:
        want = _expected(model, question, text, temperature)
        mine = got["answers"][question["id"]]
        assert mine["type"] == question["type"]
        assert (mine["prompt_token_ids"], mine["label_token_ids"]) == (want["ids"], want["labels"])
        assert list(mine["probabilities"]) == want["names"]
        for name, p in want["probabilities"].items():
            assert mine["probabilities"][name] == pytest.approx(p, abs=1e-5)
        assert mine["label_mass"] == pytest.approx(want["label_mass"], rel=1e-4)
        probabilities = [mine["probabilities"][n] for n in want["names"]]
        if question["type"] == "choice":
            assert mine["choice"] == want["names"][probabilities.index(max(probabilities))]
        if question["type"] == "score":
            expected = math.fsum(i * p for i, p in enumerate(probabilities))
            assert mine["score"] == pytest.approx(expected)
        prompt_tokens += len(want["ids"])
    assert got["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                            "completion_tokens": 0, "reasoning_tokens": 0}  # fmt: skip
    plain = _decide(url, {"input": text, "questions": QUESTIONS[:1]}).json()
    assert "prompt_token_ids" not in plain["answers"]["true"] and plain["model"] == "default"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"questions": QUESTIONS}, "input: Field required"),
        ({"input": "x", "questions": []}, "questions: List should have at least 1 item"),
        ({"input": "x", "questions": QUESTIONS, "top_k": 1},
         "top_k: Extra inputs are not permitted"),
        ({"input": " ", "questions": QUESTIONS}, "input: Value error, must not be blank"),
        ({"input": "x", "questions": [QUESTIONS[0], QUESTIONS[0]]},
         "question id 'true' repeats another question"),
        ({"input": "x", "questions": [{**QUESTIONS[1], "options": [{"name": "a"},
                                                                    {"name": "A "}]}]},
         "question 'color': option name 'A ' repeats another option"),
        ({"input": "x", "questions": QUESTIONS, "temperature": 0},
         "temperature: Input should be greater than 0"),
        ({"input": "x", "questions": QUESTIONS, "prompt_format_version": 2},
         "prompt_format_version 2 is not served, this server uses version 1"),
        ({"input": "x", "questions": QUESTIONS, "images": ["data:image/png;base64,AA=="]},
         "images require a model served with multimodal input"),
        ({"input": "x", "questions": QUESTIONS, "model": "judge:adapter"},
         "model names the LoRA adapter 'adapter', which /v1/decisions does not support"),
        ({"input": "x" * 5000, "questions": QUESTIONS},
         "question 'true': the prompt has"),
    ],
)  # fmt: skip
def test_what_sglang_refuses_is_refused_in_its_words(
    url: str, body: dict[str, Any], words: str
) -> None:
    answer = _decide(url, body)
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["message"]
    if "the prompt has" in words:  # a ValueError after _validate_request: its "BadRequest"
        assert answer.json()["type"] == "BadRequest"  # (serving_base.handle_request)
    assert _decide(url, {"input": "x", "questions": QUESTIONS[:1]}).status_code == 200


def _settings(model: Path, template: str) -> ChatSettings:
    tokenizer = AutoTokenizer.from_pretrained(model)
    settings = ChatSettings.of(tokenizer, model, chat_template=template)
    assert settings is not None
    return settings


def test_reasoning_is_turned_off_and_a_template_that_always_reasons_is_refused(
    model: Path,
) -> None:
    """The template's toggle (Qwen3's enable_thinking) is set false, and may not be set on; a
    template that always opens the reasoning is refused; a label that is not one token after
    the prompt refuses the model (a tokenizer without capital letters)."""
    qwen3_like = (
        "{% for m in messages %}<user>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}{% if enable_thinking is defined and enable_thinking is "
        "false %}<think>\n\n</think>\n\n{% endif %}Answer: {% endif %}"
    )
    settings = _settings(model, qwen3_like)
    body = {"input": "x", "questions": QUESTIONS[:1], "return_prompt_token_ids": True}
    native, _ = decisions_request(body, settings, 4096, "m")
    prompt = settings.tokenizer.decode(native["input_ids"][0])
    assert prompt.endswith("<think>\n\n</think>\n\nAnswer: ")
    with pytest.raises(OpenAIError, match="sets 'enable_thinking' to True, but decisions need"):
        decisions_request({**body, "chat_template_kwargs": {"enable_thinking": True}},
                          settings, 4096, "m")  # fmt: skip
    always = "{% for m in messages %}<|im_start|>assistant\\n<think>\\n{% endfor %}"
    with pytest.raises(OpenAIError, match="chat templates that always reason"):
        decisions_request(body, _settings(model, always), 4096, "m")
    lower = make_tagged_byte_model(model.parent / "lower", ("yes", "no"), chars="abcdeflnrstu :\n")
    choice = {"input": "a", "questions": [QUESTIONS[1]]}
    with pytest.raises(OpenAIError, match="the answer label 'A' is not one distinct token"):
        decisions_request(choice, _settings(lower, TEMPLATE), 4096, "m")


@pytest.mark.timeout(120)
async def test_a_judge_reward_asks_its_question_of_the_engines_decisions(url: str) -> None:
    """``rewards: [{judge: {route: decisions, question: ...}}]``: each sample's template filled
    as the input, the reward the candidates' values weighed by the probabilities the route
    answers (P(yes); the expected level, or the map's values)."""
    from stages.scorer.runner import RewardRunner
    from stages.scorer.spec import JudgeSpec, RewardSpec

    template = "{completion} is {answer}"
    yes_no = {"type": "yes_no", "question": "Is the answer right?"}
    score = {"type": "score", "question": "How right?", "levels": ["no", "half", "fully"]}
    worth = {"0": -1.0, "2": 5.0}  # "1" keeps its number
    specs = [
        RewardSpec(name="right", judge=JudgeSpec(url=url, template=template, route="decisions",
                                                 question=yes_no)),
        RewardSpec(name="how", weight=0.5, judge=JudgeSpec(
            url=url, template=template, route="decisions", question=score, map=worth)),
    ]  # fmt: skip
    kwargs = {"prompts": ["p", "p"], "completions": ["2+2=4", "3+3=7"], "answer": ["4", "6"]}
    async with RewardRunner(specs) as runner:
        scored = await runner.score(kwargs)
        stats = runner.stats()
    for i, (reward, info) in enumerate(scored):
        text = template.format(completion=kwargs["completions"][i], answer=kwargs["answer"][i])
        both = [{"id": "a", **yes_no}, {"id": "b", **score}]
        asked = _decide(url, {"input": text, "questions": both}).json()
        p_yes = asked["answers"]["a"]["probabilities"]["yes"]
        levels = asked["answers"]["b"]["probabilities"]
        expected = -1.0 * levels["0"] + 1.0 * levels["1"] + 5.0 * levels["2"]
        assert info["right"] == pytest.approx(p_yes, abs=1e-5)  # prefilled alone, or with b
        assert info["how"] == pytest.approx(expected, abs=1e-5)
        assert reward == pytest.approx(p_yes + 0.5 * expected, abs=1e-5)
    assert stats["calls"] == 4  # one sample a request
    with pytest.raises(ValueError, match="map needs a value for each option"):
        JudgeSpec(url=url, template=template, route="decisions", question=QUESTIONS[1])
    with pytest.raises(ValueError, match=r"question: questions.0.yes_no.question: Field required"):
        JudgeSpec(url=url, template=template, route="decisions", question={"type": "yes_no"})
    with pytest.raises(ValueError, match="route generate needs parse"):
        JudgeSpec(url=url, template=template)


def test_an_image_is_read_as_sglangs_decision_image() -> None:
    """``DecisionImage`` (SGLang 0.5.23's ``protocol.py``): a url alone becomes the chat
    route's image part, whose ``detail`` ``"default"`` is ``"auto"`` and whose ``content_hash``
    is a ``sha256:`` digest, lower-cased (``multimodal/cache/identity.parse_content_hash``); an
    error names the part by SGLang's class."""
    from pydantic import ValidationError

    question = [{"id": "a", "type": "yes_no", "question": "q?"}]
    digest = "sha256:" + "AB" * 32
    images = ["data:x", {"url": "x", "detail": "default", "content_hash": digest}]
    read = DecisionRequest.model_validate({"input": "x", "questions": question, "images": images})
    assert [(i.url, i.detail, i.content_hash) for i in read.images] == [  # type: ignore[union-attr]
        ("data:x", "auto", None),
        ("x", "auto", digest.lower()),
    ]
    bad = {"url": "x", "content_hash": "md5:1"}
    with pytest.raises(ValidationError) as refused:
        DecisionRequest.model_validate({"input": "x", "questions": question, "images": [bad]})
    first = refused.value.errors()[0]
    assert first["loc"] == ("images", 0, "ChatCompletionMessageContentImageURL", "content_hash")
    assert "content_hash must use the form 'sha256:<64 hex digits>'" in first["msg"]
