"""``/v1/decisions`` held to SGLang 0.5.23's own code (``entrypoints/openai/protocol.py``'s
``DecisionRequest``; ``serving_decisions.py``'s ``render_question``, ``_encode_labels`` and
``_build_answer``, read from its source: the module itself imports the whole chat route):
random bodies are accepted or refused alike, every accepted question renders to the same
prompt text, labels encode to the same ids (or are refused alike) on real tokenizers, and the
answers are built alike from the same probabilities.

Runs where SGLang's source is importable (``test_engine_sglang_shapes.py``'s docstring says how);
skipped elsewhere.
"""

from __future__ import annotations

import ast
import json
import math
import random
import string
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
msgspec: Any = pytest.importorskip("msgspec")  # serving_decisions' QuestionView is its Struct

from stages.engine import openai_decisions as ours  # noqa: E402
from tests.stages.tiny_model import make_tagged_byte_model  # noqa: E402

_FUNCTIONS = (
    "render_text", "_decision_view", "default_labels", "render_question", "label_context",
    "label_token_id", "_encode_labels", "label_mass", "_build_answer",
)  # fmt: skip


def _sglang_functions() -> dict[str, Any]:
    """serving_decisions.py's pure functions (and its QuestionView), compiled from its source."""
    source = Path(protocol.__file__).with_name("serving_decisions.py")
    tree = ast.parse(source.read_text())
    wanted = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
        and (node.name in _FUNCTIONS or node.name == "QuestionView")
    ]
    assert len(wanted) == len(_FUNCTIONS) + 1
    names: dict[str, Any] = {"json": json, "math": math, "string": string, "msgspec": msgspec,
                             "Any": Any, "Dict": dict, "List": list, "Optional": Any,
                             "Tuple": tuple, "__name__": "serving_decisions"}  # fmt: skip
    names.update({k: getattr(protocol, k) for k in dir(protocol) if k.startswith("Decision")})
    names["is_blank_decision_text"] = protocol.is_blank_decision_text
    exec(compile(ast.Module(wanted, []), str(source), "exec"), names)
    return names


sglang = _sglang_functions()


def _text(rng: random.Random) -> Any:
    if rng.random() < 0.92:
        return rng.choice(["Is it?", "a\nb", "ü ok", {"k": [1, "x"]}, [1, 2], "Ünïcode ✓"])
    return rng.choice(["", " ", [], {}, 3, None, "  tabs\t"])


def _question(rng: random.Random, i: int) -> Any:
    kind = rng.choice(["choice", "score", "yes_no", "choice", "score", "yes_no", "other"])
    qid = f"q{i}" if rng.random() < 0.9 else rng.choice([" ", "q0", 5])
    question: dict[str, Any] = {"id": qid, "type": kind}
    if rng.random() < 0.95:
        question["question"] = _text(rng)
    if kind == "choice" or rng.random() < 0.05:
        names = ["red", "Red", "blue", "a b", "x\ny", "", "green", "ü"]
        question["options"] = [
            {
                "name": rng.choice(names),
                **({"description": _text(rng)} if rng.random() < 0.5 else {}),
            }
            for _ in range(rng.choice([1, 2, 3, 5, 27]))
        ]
    if kind == "score" or rng.random() < 0.05:
        question["levels"] = [_text(rng) for _ in range(rng.choice([2, 3, 4, 1, 11]))]
    if kind == "yes_no":
        for side in ("yes", "no"):
            if rng.random() < 0.5:
                question[side] = _text(rng)
    if rng.random() < 0.03:
        question["extra"] = 1
    return question


def _body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "questions": [_question(rng, i) for i in range(rng.choice([0, 1, 2, 3]))]
    }
    if rng.random() < 0.95:
        body["input"] = _text(rng)
    for key, values in (("temperature", [1.0, 0.5, 0, -1, "2", float("inf"), 3]),
                        ("prompt_format_version", [1, 2, None, "1"]),
                        ("return_prompt_token_ids", [True, False, "yes", 1]),
                        ("chat_template_kwargs", [{}, {"a": 1}, [], None]),
                        ("images", [[], ["data:x"], [{"url": "u"}], [{"nope": 1}]]),
                        ("model", ["m", "m:lora", 3]), ("bogus", [1])):  # fmt: skip
        if rng.random() < 0.1:
            body[key] = rng.choice(values)
    return body


def test_bodies_are_taken_or_refused_as_sglangs_model_takes_them() -> None:
    rng = random.Random(3)
    taken = 0
    for _ in range(3000):
        body = _body(rng)
        try:
            theirs = protocol.DecisionRequest.model_validate(body)
        except Exception:
            theirs = None
        try:
            mine = ours.DecisionRequest.model_validate(body)
        except Exception:
            mine = None
        assert (theirs is None) == (mine is None), body
        if theirs is None:
            continue
        taken += 1
        assert mine is not None
        text = sglang["render_text"](theirs.input)
        assert ours.as_text(mine.input) == text
        for their_q, my_q in zip(theirs.questions, mine.questions, strict=True):
            view = sglang["_decision_view"](their_q)
            labels = sglang["default_labels"](view)
            mine_view = ours.View.of(my_q)
            assert mine_view.labels == labels
            assert ours.render_question(text, mine_view) == sglang["render_question"](
                text=text, view=view, labels=labels
            )
    assert taken > 200  # of 3,000: the rest refused alike


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    root = tmp_path_factory.mktemp("decisions")
    printable = "".join(chr(c) for c in range(32, 127)) + "\n"
    tagged = make_tagged_byte_model(root / "tagged", ("yes", "no", "<user>"), chars=printable)
    plain = make_tagged_byte_model(root / "plain", ("<s>",), chars="abcdeflnrstu \n:")
    return [AutoTokenizer.from_pretrained(tagged), AutoTokenizer.from_pretrained(plain)]


def test_labels_encode_as_sglangs_or_are_refused_alike(tokenizers: list[Any]) -> None:
    rng = random.Random(5)
    pieces = ["<user>", "Answer: ", "yes", "no", " ", "\n", "abc", "a:", "<s>", "Ünï"]
    label_sets = [["A", "B", "C"], ["yes", "no"], ["0", "1", "2"], ["a", "a"], ["ab", "c"]]
    agreed = refused = 0
    for _ in range(600):
        tokenizer = rng.choice(tokenizers)
        prompt = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        labels = rng.choice(label_sets)
        added = {i: token for token, i in tokenizer.get_added_vocab().items()}
        try:
            want = sglang["_encode_labels"](tokenizer=tokenizer, prompt=prompt, prompt_ids=ids,
                                            labels=labels, added_tokens=added)  # fmt: skip
        except ValueError as exc:
            with pytest.raises(ValueError) as mine:
                ours._label_ids(tokenizer, prompt, ids, labels)
            assert str(mine.value) == str(exc)
            refused += 1
            continue
        assert ours._label_ids(tokenizer, prompt, ids, labels) == want
        agreed += 1
    assert agreed > 100 and refused > 100


def test_answers_are_built_as_sglangs() -> None:
    rng = random.Random(7)
    bodies = [
        {"type": "choice", "id": "c", "question": "q", "options": [{"name": n} for n in "xyz"]},
        {"type": "score", "id": "s", "question": "q", "levels": ["a", "b", "c", "d"]},
        {"type": "yes_no", "id": "y", "question": "q"},
    ]
    for _ in range(300):
        raw = rng.choice(bodies)
        count = {"choice": 3, "score": 4, "yes_no": 2}[raw["type"]]
        weights = [rng.choice([0.0, 1.0, rng.random()]) or 1e-9 for _ in range(count)]
        probabilities = [w / sum(weights) for w in weights]
        logprobs = [rng.choice([-math.inf, -30.0, math.log(rng.random() + 1e-12)])
                    for _ in range(count)]  # fmt: skip
        theirs = protocol.DecisionRequest.model_validate({"input": "i", "questions": [raw]})
        question = theirs.questions[0]
        view = sglang["_decision_view"](question)
        want = sglang["_build_answer"](
            question=question, view=view, probabilities=probabilities, token_logprobs=logprobs
        )
        mine = ours.DecisionRequest.model_validate({"input": "i", "questions": [raw]})
        assert ours.answer_of(mine.questions[0], probabilities, logprobs) == want.model_dump(
            exclude_none=True
        )
