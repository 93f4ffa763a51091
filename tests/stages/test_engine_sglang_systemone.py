"""``/v1/systemone`` held to SGLang 0.5.23's own code: its request models
(``entrypoints/systemone/protocol.py``), its route as ``http_server.py`` declares it (the
``validate_json_request`` dependency and the validation handler, compiled from its source, in a
FastAPI app of their own), and ``systemone/serving.py``'s views, labels, legend check, answers
and confidences (read from its source: the module itself imports the whole server):

- random bodies, raw bytes and content types are answered alike: the same 422 detail list (or
  400), or taken with the same values;
- every accepted request renders the same prompt text and labels (two-letter ones past 26
  options on a tokenizer that has them) or is refused in the same words;
- the answers and confidences are built alike from the same probabilities.

Runs where SGLang's source is importable (``test_engine_sglang_shapes.py``'s docstring says how)
and FastAPI's test client is installed; skipped elsewhere.
"""

from __future__ import annotations
import __future__

import ast
import json
import math
import random
import string
from http import HTTPStatus
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
so_protocol: Any = pytest.importorskip("sglang.srt.entrypoints.systemone.protocol")
msgspec: Any = pytest.importorskip("msgspec")  # serving_decisions' QuestionView is its Struct
fastapi: Any = pytest.importorskip("fastapi")
pytest.importorskip("httpx")  # FastAPI's test client

import orjson  # noqa: E402
from fastapi.encoders import jsonable_encoder  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import ORJSONResponse  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from stages.engine import systemone as ours  # noqa: E402
from stages.engine.openai_chat import ChatSettings  # noqa: E402
from tests.stages.tiny_model import make_tagged_byte_model  # noqa: E402

# SGLang's ORJSONResponse, which this FastAPI deprecates
pytestmark = pytest.mark.filterwarnings("ignore:ORJSONResponse is deprecated")
SOURCE = Path(protocol.__file__).parents[1]  # srt/entrypoints
PAIRS = tuple(a + b for a in "AB" for b in string.ascii_uppercase)[:31]  # AA .. BE
TEMPLATE = (
    "{% for m in messages %}<user>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<asst>Answer: {% endif %}"
)


def _compiled(path: Path, wanted: dict[str, str | None], names: dict[str, Any]) -> dict:
    """The named functions, classes and assignments of SGLang's module at ``path`` (``wanted``:
    name -> the class holding it, None for the module's own), compiled into ``names``."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        inner = node.body if isinstance(node, ast.ClassDef) else []
        for item in [node, *inner]:
            name = getattr(item, "name", None)
            if isinstance(item, ast.Assign):
                name = getattr(item.targets[0], "id", None)
            if name in wanted and wanted[name] == (node.name if item is not node else None):
                found.append(item)
    assert len(found) == len(wanted), [getattr(n, "name", None) for n in found]
    names.setdefault("__name__", path.stem)
    # their annotations as strings, as the module's own ``from __future__ import annotations``
    flags = __future__.annotations.compiler_flag
    exec(compile(ast.Module(found, []), str(path), "exec", flags=flags, dont_inherit=True), names)
    return names


def _typing() -> dict[str, Any]:
    return {"Any": Any, "Dict": dict, "List": list, "Optional": Any, "Tuple": tuple,
            "Iterator": Any, "math": math, "json": json, "string": string, "orjson": orjson,
            "msgspec": msgspec, "ORJSONResponse": ORJSONResponse}  # fmt: skip


def _sglang_serving() -> dict[str, Any]:
    """serving_decisions.py's rendering and label functions, then systemone/serving.py's views,
    answers, confidences and the methods that label and encode questions."""
    names = _typing()
    names["is_blank_decision_text"] = protocol.is_blank_decision_text
    decisions = {n: None for n in ("QuestionView", "render_text", "default_labels",
                                   "render_question", "label_context", "label_token_id",
                                   "_encode_labels", "label_mass")}  # fmt: skip
    _compiled(SOURCE / "openai" / "serving_decisions.py", decisions, names)
    names.update({k: getattr(so_protocol, k) for k in dir(so_protocol) if k.startswith("System")})
    serving = {
        n: None
        for n in (
            "_PAIR_LABELS",
            "_view",
            "_answer",
            "_legend",
            "_check_legend",
            "_normalized",
            "_choice_confidence",
            "_score_confidence",
        )
    }
    serving.update(_pair_labels="SystemOneServing",
                   _encoded_systemone_questions="SystemOneServing")  # fmt: skip
    return _compiled(SOURCE / "systemone" / "serving.py", serving, names)


sglang = _sglang_serving()


def _sglang_app() -> Any:
    """SGLang's route: its dependency and validation handler compiled from ``http_server.py``,
    the route's body model its ``SystemOneRequest``; the route answers the values it took."""
    names = {"Request": fastapi.Request, "RequestValidationError": RequestValidationError,
             "HTTPStatus": HTTPStatus, "ORJSONResponse": ORJSONResponse,
             "jsonable_encoder": jsonable_encoder, "ErrorResponse": protocol.ErrorResponse,
             "__name__": "http_server"}  # fmt: skip
    path = SOURCE / "http_server.py"
    tree = ast.parse(path.read_text())
    handler = next(
        node
        for node in tree.body
        if isinstance(node, ast.AsyncFunctionDef)
        and node.name == "validation_exception_handler"
        and "RequestValidationError" in ast.unparse(node.args)
    )
    handler.decorator_list = []
    _compiled(path, {"validate_json_request": None}, names)
    exec(compile(ast.Module([handler], []), str(path), "exec"), names)
    app = fastapi.FastAPI()
    app.add_exception_handler(RequestValidationError, names["validation_exception_handler"])

    async def systemone_decisions(request: Any, raw_request: Any) -> Any:
        return {"taken": request.model_dump()}

    # the route's own signature (this module's annotations are strings FastAPI cannot resolve)
    systemone_decisions.__annotations__ = {
        "request": so_protocol.SystemOneRequest,
        "raw_request": fastapi.Request,
    }
    app.post("/v1/systemone", dependencies=[fastapi.Depends(names["validate_json_request"])])(
        systemone_decisions
    )
    return app


# ---- bodies ------------------------------------------------------------------------------------


def _text(rng: random.Random) -> Any:
    if rng.random() < 0.85:
        return rng.choice(["Is it?", "a\nb", "ü ok", {"k": [1, "x"]}, [1, 2], "Ünïcode ✓"])
    return rng.choice(["", " ", [], {}, 3, None, "  tabs\t", 2.5, True])


def _question(rng: random.Random) -> Any:
    kind = rng.choice(["noul", "choice", "score", "noul", "choice", "score", "yes_no", None])
    question: dict[str, Any] = {} if kind is None else {"type": kind}
    if rng.random() < 0.7:
        question["instructions"] = _text(rng)
    if kind == "noul" and rng.random() < 0.7:
        sides = {side: _text(rng) for side in ("true", "false") if rng.random() < 0.6}
        if rng.random() < 0.05:
            sides["maybe"] = "x"
        question["criteria"] = rng.choice([sides, sides, None, "x", []])
    if kind == "choice" or (kind is not None and rng.random() < 0.05):
        names = ["red", "Red", "blue", "a b", "x\ny", "", "green", "ü", " ", "c\u2028"]
        count = rng.choice([0, 1, 2, 3, 5, 27, 256])
        options = {
            (rng.choice(names) if rng.random() < 0.3 else f"o{i}"): _text(rng) for i in range(count)
        }
        question["criteria"] = rng.choice([options, options, options, [], "x"])
    if kind == "score" or (kind is not None and rng.random() < 0.05):
        levels = [_text(rng) for _ in range(rng.choice([0, 1, 2, 3, 10, 11]))]
        question["criteria"] = rng.choice([levels, levels, levels, {}, "x"])
    if rng.random() < 0.03:
        question["extra"] = 1
    return rng.choice([question] * 19 + [3])


def _body(rng: random.Random) -> Any:
    body: dict[str, Any] = {}
    if rng.random() < 0.95:
        body["state"] = _text(rng)
    if rng.random() < 0.95:
        body["model"] = rng.choice(["m"] * 6 + ["m:lora", 3, None])
    if rng.random() < 0.4:  # questions it takes, the rest of the body as random
        body["questions"] = {f"q{i}": _question_body(rng) for i in range(rng.choice([1, 2]))}
    elif rng.random() < 0.95:
        count = rng.choice([0, 1, 2, 3])
        body["questions"] = rng.choice(
            [{f"q{i}": _question(rng) for i in range(count)}] * 9 + [[], "x"]
        )
    for key, values in (("images", [[], ["data:x"], [{"url": "u", "detail": "default"}],
                                    [{"nope": 1}], [3], "x", [{"url": "u", "detail": "mid"}]]),
                        ("chat_template_kwargs", [{}, {"a": 1}, [], None]),
                        ("temperature", [1.0, None, 0]), ("prompt_format_version", [1, None]),
                        ("return_prompt_token_ids", [True, None, False]),
                        ("bogus", [1])):  # fmt: skip
        if rng.random() < 0.08:
            body[key] = rng.choice(values)
    return rng.choice([body] * 49 + [[body], None, "x"])


def _ours(raw: bytes, content_type: str | None) -> tuple[int, Any]:
    answer = ours.parse_body(raw, content_type)
    if isinstance(answer, ours.SystemOneRequest):
        return 200, {"taken": answer.model_dump()}
    return answer.status, json.loads(answer.body)


@pytest.mark.timeout(300)
def test_bodies_are_answered_as_sglangs_route_answers_them() -> None:
    client = TestClient(_sglang_app())
    rng = random.Random(11)
    taken = refused = 0
    cases: list[tuple[bytes, str | None]] = [
        (raw, kind)
        for raw in (b"", b"{", b"[1]", b"null", b'"x"', b"\xff\xfe{", b'{"a":1,}', b"NaN",
                    b"[" * 3000 + b"]" * 3000, b'{"state": "x", "model": "m"}', b"{} x")
        for kind in (None, "", "application/json", "text/plain", "application/vnd.x+json",
                     "Application/JSON; charset=utf-8", "application/json ; x")
    ]  # fmt: skip
    cases += [(json.dumps(_body(rng)).encode(), "application/json") for _ in range(3000)]
    for raw, kind in cases:
        headers = {} if kind is None else {"content-type": kind}
        theirs = client.post("/v1/systemone", content=raw, headers=headers)
        mine = _ours(raw, kind)
        assert mine == (theirs.status_code, theirs.json()), (raw[:300], kind)
        taken += mine[0] == 200
        refused += mine[0] == 422
    assert taken > 250 and refused > 1500  # of 3,077


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """One with two-letter labels (added) and an added token before the answer position, one
    with that token and no pairs, one whose template ends in plain text."""
    root = tmp_path_factory.mktemp("systemone")
    printable = "".join(chr(c) for c in range(32, 127)) + "\n"
    tags = ("yes", "no", "<user>", "<asst>")
    paired = make_tagged_byte_model(root / "paired", (*tags, *PAIRS), chars=printable)
    plain = make_tagged_byte_model(root / "plain", tags, chars=printable)
    loaded = [AutoTokenizer.from_pretrained(paired), AutoTokenizer.from_pretrained(plain)]
    return [(tokenizer, template) for tokenizer in loaded
            for template in (TEMPLATE, TEMPLATE.replace("<asst>", ""))]  # fmt: skip


def _sglang_encoded(tokenizer: Any, template: str, request: Any) -> list[Any]:
    """``SystemOneServing._encoded_systemone_questions`` on a server whose chat template is
    ``template`` (reasoning off: none to turn off) and whose ``_encode_question`` renders it and
    checks the labels with ``_encode_labels``."""

    def apply(content: Any, kwargs: dict, system: Any = None) -> str:
        messages = [{"role": "user", "content": content}]
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, **kwargs)  # fmt: skip

    added = {i: token for token, i in tokenizer.get_added_vocab().items()}

    def encode(content: str, labels: list[str], chat_template_kwargs: dict, images: Any) -> Any:
        prompt = apply(content, chat_template_kwargs)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        return ids, sglang["_encode_labels"](tokenizer, prompt, ids, labels, added)

    server = SimpleNamespace(
        added_tokens=added,
        tokenizer_manager=SimpleNamespace(tokenizer=tokenizer),
        _apply_chat_template=apply,
        _chat_template_kwargs=lambda kwargs: dict(kwargs),
        _encode_question=encode,
    )
    server._pair_labels = lambda kwargs: sglang["_pair_labels"](server, kwargs)
    views = [sglang["_view"](question) for question in request.questions.values()]
    return list(sglang["_encoded_systemone_questions"](server, request, views))


def _fine(rng: random.Random) -> Any:
    """A text SGLang's models take where a blank or null one is allowed."""
    return rng.choice(["Is it?", "a\nb", "ü ok", {"k": [1, "x"]}, [1, 2], "", " ", [], {}, None])


def _question_body(rng: random.Random) -> dict[str, Any]:
    """A question SGLang's models take."""
    kind = rng.choice(["noul", "choice", "score"])
    question: dict[str, Any] = {"type": kind}
    if kind == "noul":
        question["instructions"] = rng.choice(["Is it?", {"k": 1}, ["q"], "ü?"])
        if rng.random() < 0.5:
            question["criteria"] = {"true": _fine(rng), "false": _fine(rng)}
    elif rng.random() < 0.8:
        question["instructions"] = _fine(rng)
    if kind == "choice":
        count = rng.choice([1, 2, 3, 26, 27, 31, 32])
        question["criteria"] = {f"o{i}": _fine(rng) for i in range(count)}
    if kind == "score":
        levels = [rng.choice(["low", {"x": 1}, [2], "Ünï"] * 5 + [{"n": 2**70}, [2**63]])
                  for _ in range(rng.choice([1, 3, 10]))]  # fmt: skip
        question["criteria"] = levels
    return question


@pytest.mark.timeout(300)
def test_prompts_and_labels_are_sglangs_or_refused_alike(tmp_path: Path, tokenizers: list) -> None:
    rng = random.Random(13)
    agreed = refused = pairs = 0
    for _ in range(200):
        tokenizer, template = rng.choice(tokenizers[:1] * 3 + tokenizers)  # pairs: the first
        settings = ChatSettings.of(tokenizer, tmp_path, chat_template=template)
        questions = {f"q{i}": _question_body(rng) for i in range(rng.choice([1, 2, 3]))}
        body = {"state": _fine(rng) or "", "model": "m", "questions": questions}
        theirs_request = so_protocol.SystemOneRequest.model_validate(body)
        mine_request = ours.SystemOneRequest.model_validate(body)
        try:
            want = _sglang_encoded(tokenizer, template, theirs_request)
        except ValueError as exc:
            with pytest.raises(ours.Refused) as mine:
                ours.systemone_request(mine_request, settings, 1 << 20, "m")
            assert (str(mine.value), mine.value.kind) == (str(exc), "BadRequest")
            refused += 1
            continue
        native, options = ours.systemone_request(mine_request, settings, 1 << 20, "m")
        assert list(zip(native["input_ids"], native["token_ids_logprob"], strict=True)) == want
        pairs += any(len(view.labels[0]) == 2 for view in options["views"])
        agreed += 1
    assert agreed > 40 and refused > 20 and pairs > 5


def _views(rng: random.Random) -> list[tuple[Any, Any]]:
    body = {"state": "s", "model": "m",
            "questions": {"n": {"type": "noul", "instructions": "q"},
                          "c": {"type": "choice", "criteria": {n: None for n in "xyz"}},
                          "one": {"type": "choice", "criteria": {"only": "it"}},
                          "s": {"type": "score", "criteria": ["a", {"b": 1}, "c", "d"]},
                          "s1": {"type": "score", "criteria": ["a"]}}}  # fmt: skip
    theirs = so_protocol.SystemOneRequest.model_validate(body).questions
    mine = ours.SystemOneRequest.model_validate(body).questions
    return [(sglang["_view"](theirs[k]), ours.view_of(mine[k])) for k in theirs]


@pytest.mark.timeout(120)
def test_answers_and_confidences_are_built_as_sglangs() -> None:
    rng = random.Random(17)
    views = _views(rng)
    for _ in range(2000):
        theirs_view, mine_view = rng.choice(views)
        count = len(mine_view.names)
        weights = [rng.choice([0.0, 1.0, rng.random(), 1e-300]) for _ in range(count)]
        total = sum(weights)
        probabilities = [w / total for w in weights] if total and rng.random() < 0.8 else weights
        if rng.random() < 0.02:
            probabilities[0] = math.nan
        mass = rng.choice([0.0, 1.0, rng.random(), math.inf])
        try:
            want = sglang["_answer"](theirs_view, probabilities, mass, "q").model_dump()
        except RuntimeError as exc:
            with pytest.raises(RuntimeError) as mine:
                ours.answer_of(mine_view, probabilities, mass, "q")
            assert str(mine.value) == str(exc)
            continue
        got = ours.answer_of(mine_view, probabilities, mass, "q")
        assert json.dumps(got) == json.dumps(want)  # the same keys in the same order
        q = sglang["_normalized"](probabilities)
        assert ours.normalized(probabilities) == q
        assert ours.choice_confidence(q) == sglang["_choice_confidence"](q)
        assert ours.score_confidence(q) == sglang["_score_confidence"](q)


@pytest.mark.timeout(60)
def test_legends_are_refused_as_sglang_refuses_them() -> None:
    deep: Any = "x"
    for _ in range(260):
        deep = [deep]
    for levels in (["a", [2**63 - 1]], ["a", [2**64]], [{"k": -(2**63) - 1}], [deep], ["a", [1.5]]):
        body = {
            "state": "s",
            "model": "m",
            "questions": {"q": {"type": "score", "criteria": levels}},
        }
        theirs = so_protocol.SystemOneRequest.model_validate(body).questions["q"]
        mine = ours.SystemOneRequest.model_validate(body).questions["q"]
        try:
            sglang["_check_legend"]("q", sglang["_view"](theirs))
        except ValueError as exc:
            with pytest.raises(ValueError) as refused:
                ours._check_legend("q", ours.view_of(mine))
            assert str(refused.value) == str(exc)
        else:
            ours._check_legend("q", ours.view_of(mine))


@pytest.mark.timeout(60)
def test_the_request_has_sglangs_fields_in_order() -> None:
    for name in ("SystemOneRequest", "SystemOneNoulQuestion", "SystemOneChoiceQuestion",
                 "SystemOneScoreQuestion", "SystemOneNoulCriteria"):  # fmt: skip
        theirs, mine = getattr(so_protocol, name), getattr(ours, name)
        assert list(mine.model_fields) == list(theirs.model_fields)
        for field, info in theirs.model_fields.items():
            assert mine.model_fields[field].is_required() == info.is_required()
        assert mine.model_config.get("extra") == theirs.model_config.get("extra")
    assert ours.PAIR_LABELS == sglang["_PAIR_LABELS"]
