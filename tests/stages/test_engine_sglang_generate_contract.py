"""``/generate``'s two checks before its route (``stages.engine.generate_contract``) against
SGLang 0.5.23's own: its JSON contract gate (``sglang/api/v1/api_types.py``'s
``GenerateRequest`` decoder, which ``api_contract.generate_contract_error`` runs) on random
bodies, word for word; and ``GenerateReqInput``'s field types (``managers/io_struct.py``, read
from its source: the module itself needs SGLang's whole environment) as pydantic reads them.

Skipped unless SGLang's API types import (``test_engine_sglang_shapes.py``'s docstring says
how; they need ``msgspec``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import random
import typing
from pathlib import Path
from typing import Any

import pytest

api_types: Any = pytest.importorskip("sglang.api.v1.api_types")

from stages.engine import generate_contract  # noqa: E402

SCALARS = [None, True, False, 0, 1, -1, 2.0, 2.5, "x", "1", "", 2**70]
OWN = ("image_data", "video_data", "audio_data", "kv_hints")  # media, KV hints: the route's
TOP = [f for f in api_types.GenerateRequest.__struct_fields__ if f not in OWN]
SAMPLING = list(api_types.SamplingParams.__struct_fields__)


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 2 or roll < 0.5:
        return rng.choice(SCALARS)
    if roll < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = rng.sample([*SAMPLING, "bogus", "enabled", "key", "prefix", "image_mode"], 2)
    return {k: _value(rng, depth + 1) for k in keys}


def _body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"text": "hi"}
    for key in rng.sample([*TOP, "bogus"], rng.randint(1, 3)):
        body[key] = _value(rng)
    if rng.random() < 0.6:  # sampling parameters, mostly well-formed, some not
        params = {
            k: rng.choice([*SCALARS, [], ["x"], [1], {"1": 2.0}]) for k in rng.sample(SAMPLING, 3)
        }
        body["sampling_params"] = params if rng.random() < 0.7 else [params, _value(rng)]
    return body


def _theirs(body: Any) -> str | None:
    try:
        api_types.GenerateRequest.from_json_value(body)
    except api_types.JsonContractError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_the_contract_gate_answers_as_sglangs_word_for_word() -> None:
    rng = random.Random(0)
    refused = 0
    for _ in range(20000):
        body = _body(rng)
        want = _theirs(body)
        assert generate_contract.contract_error(body) == want, body
        refused += want is not None
    assert refused > 5000 and 20000 - refused > 500  # both answers well represented


TYPING = {n: getattr(typing, n) for n in ("Any", "Dict", "List", "Literal", "Optional", "Union")}


def _io_struct_fields(name: str, names: dict[str, Any]) -> dict[str, tuple[Any, bool]]:
    """A class of SGLang's ``managers/io_struct.py`` (read from its source: the module itself
    needs SGLang's whole environment): each field's annotation, evaluated with ``names``, and
    whether it is required (no default)."""
    spec = importlib.util.find_spec("sglang")
    source = Path(spec.origin).parent / "srt" / "managers" / "io_struct.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    fields = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            code = compile(ast.Expression(node.annotation), "io_struct", "eval")
            fields[node.target.id] = (eval(code, names), node.value is None)
    return fields


def _sglang_generate_fields() -> dict[str, Any]:
    """``GenerateReqInput``'s fields and annotations, evaluated with the names it uses (its
    media and KV-hint classes as plain dictionaries)."""
    from pydantic import PlainValidator
    from sglang.srt.utils.field_validators import validate_optional_list_i64_1d_2d

    names = {
        **TYPING, "Annotated": typing.Annotated, "PlainValidator": PlainValidator,
        "validate_optional_list_i64_1d_2d": validate_optional_list_i64_1d_2d,
        "MultimodalDataInputFormat": Any, "KvHintsEnvelope": dict, "Modality": str,
        "SamplingLogprobsMode": typing.Literal["selected", "support"],
        "ReturnHiddenStatesMode": bool | typing.Literal["last"],
    }  # fmt: skip
    return {n: t for n, (t, _) in _io_struct_fields("GenerateReqInput", names).items()}


def test_the_field_types_are_generate_req_inputs() -> None:
    theirs = _sglang_generate_fields()
    assert list(generate_contract.GenerateFields.__annotations__) == list(theirs)
    from pydantic import TypeAdapter

    model = dataclasses.make_dataclass(
        "GenerateReqInput", [(n, t, dataclasses.field(default=None)) for n, t in theirs.items()]
    )
    adapter = TypeAdapter(model)
    values = [*SCALARS, [], ["x"], [1], [1.0], [True], [[1]], [[1, "x"]], [None], {}, {"a": 1},
              {"a": "x"}, "last", "support", [1, [2]], [[1.5]], [2**70]]  # fmt: skip
    differences = []
    for name in theirs:
        if name in ("image_data", "video_data", "audio_data", "kv_hints"):
            continue
        for value in values:
            try:
                took = adapter.validate_python({name: value}) is not None
            except ValueError:
                took = False
            try:
                generate_contract.checked_generate({name: value})
                ours = True
            except ValueError:
                ours = False
            if took != ours:
                differences.append((name, value, took))
    assert not differences, differences


def test_the_encode_fields_are_embedding_req_inputs() -> None:
    """``/encode`` and ``/classify``: ``EmbeddingReqInput``, a dataclass as pydantic reads it."""
    from pydantic import TypeAdapter

    from stages.engine import control_fields

    names = {**TYPING, "MultimodalDataInputFormat": Any}
    theirs = {n: t for n, (t, _) in _io_struct_fields("EmbeddingReqInput", names).items()}
    assert list(control_fields.EncodeFields.__annotations__) == list(theirs)
    model = dataclasses.make_dataclass(
        "EmbeddingReqInput", [(n, t, dataclasses.field(default=None)) for n, t in theirs.items()]
    )
    adapter = TypeAdapter(model)
    values = [*SCALARS, [], ["x"], [1], [1.0], [True], [[1]], [["x"]], [[1, "x"]], [None], {},
              {"a": 1}, [{"a": 1}], [[[1.5]]], [[1.5]], ["1"]]  # fmt: skip
    refused = object()
    for name in theirs:
        for value in values:
            try:
                took = getattr(adapter.validate_python({name: value}), name)
            except ValueError:
                took = refused
            try:
                mine = control_fields.ENCODE({name: value})[name]
            except ValueError:
                mine = refused
            assert (took is refused) == (mine is refused), (name, value)
            assert took is refused or repr(took) == repr(mine), (name, value)


CONTROL = {  # SGLang's request struct -> this engine's fields (stages.engine.control_fields)
    "PauseGenerationReqInput": "PauseFields",
    "ContinueGenerationReqInput": "ContinueFields",
    "AbortReq": "AbortFields",
    "UpdateWeightVersionReqInput": "UpdateVersionFields",
    "SlowDownReqInput": "SlowDownFields",
    "InitWeightsUpdateGroupReqInput": "InitGroupFields",
    "UpdateWeightsFromDistributedReqInput": "UpdateDistributedFields",
    "DestroyWeightsUpdateGroupReqInput": "DestroyGroupFields",
    "BeginWeightUpdateReqInput": "BeginUpdateFields",
    "EndWeightUpdateReqInput": "EndUpdateFields",
    "UpdateWeightsFromTensorReqInput": "UpdateTensorFields",
    "UpdateWeightFromDiskReqInput": "UpdateDiskFields",
    "UpdateWeightsFromIPCReqInput": "UpdateIpcFields",
    "GetWeightsByNameReqInput": "WeightsByNameFields",
    "ReleaseMemoryOccupationReqInput": "MemoryFields",
    "ResumeMemoryOccupationReqInput": "MemoryFields",
    "CheckWeightsReqInput": "CheckWeightsFields",
    "LoadLoRAAdapterReqInput": "LoadLoraFields",
    "UnloadLoRAAdapterReqInput": "UnloadLoraFields",
    "LoadLoRAAdapterFromTensorsReqInput": "LoadLoraTensorsFields",
    "ProfileReq": "ProfileFields",
    "ParseFunctionCallReq": "ParseFunctionCallFields",
    "SeparateReasoningReqInput": "SeparateReasoningFields",
    "OpenSessionReqInput": "OpenSessionFields",
    "CloseSessionReqInput": "CloseSessionFields",
    "ConfigureLoggingReq": "ConfigureLoggingFields",
    "SetInternalStateReq": "SetInternalStateFields",
}


def _io_struct_class(name: str, names: dict[str, Any]) -> Any:
    """A class of ``io_struct.py`` defined from its source in ``names`` (an enum, or a struct
    whose pydantic schema is ``msgspec_struct_pydantic_core_schema``'s)."""
    spec = importlib.util.find_spec("sglang")
    source = Path(spec.origin).parent / "srt" / "managers" / "io_struct.py"
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    exec(compile(ast.Module([cls], []), "io_struct", "exec", dont_inherit=True), names)
    return names[name]


def _struct_fields(name: str, names: dict[str, Any]) -> dict[str, Any]:
    """A msgspec struct's fields as ``msgspec_struct_pydantic_core_schema`` hands them to
    pydantic: ``BaseReq``'s first, then its own; ``(annotation, required)`` each."""
    return {**_io_struct_fields("BaseReq", names), **_io_struct_fields(name, names)}


def test_the_control_routes_fields_are_sglangs_structs() -> None:
    import enum

    import msgspec
    from pydantic import TypeAdapter
    from sglang.srt.utils.msgspec_utils import Base64Bytes, msgspec_struct_pydantic_core_schema
    from typing_extensions import NotRequired, Required, TypedDict

    from stages.engine import control_fields

    names = {
        **TYPING, "Annotated": typing.Annotated, "Base64Bytes": Base64Bytes, "Enum": enum.Enum,
        "FinishReasonDict": dict[str, str | int | list[int] | None], "WeightVersionSpans": Any,
        "msgspec": msgspec, "msgspec_struct_pydantic_core_schema":
        msgspec_struct_pydantic_core_schema,
    }  # fmt: skip
    for name in ("ProfileReqType", "Function", "Tool"):
        _io_struct_class(name, names)
    values = [*SCALARS, [], ["x"], [1], [[1]], [[1, "x"]], {}, {"a": 1}, "abort", "in_place",
              "draft", 0.5, "0.5", "aGk=", ["aGk="], ["!!"], [["aGk="]], {"a": "x"},
              [{"function": {"name": "f"}}], [{"function": {"name": 1}}], [{"type": "f"}],
              [{"function": {}, "type": 2}], [{"function": {"parameters": []}}]]  # fmt: skip
    for theirs_name, ours_name in CONTROL.items():
        fields = _struct_fields(theirs_name, names)
        theirs = TypedDict(  # type: ignore[misc]
            theirs_name,
            {n: (Required[t] if req else NotRequired[t]) for n, (t, req) in fields.items()},
        )
        ours = getattr(control_fields, ours_name)
        assert list(ours.__annotations__) == list(fields), theirs_name
        adapter, check = TypeAdapter(theirs), control_fields.Checker(ours)
        required = {n: "x" if t is str else 1 for n, (t, req) in fields.items() if req}
        for name in fields:
            for value in values:
                body = {**required, name: value}
                try:
                    took = adapter.validate_python(body)
                except ValueError:
                    took = None
                try:
                    mine = check(dict(body))
                except ValueError:
                    mine = None
                assert (took is None) == (mine is None), (theirs_name, name, value)
                if took is not None and name != "tools":  # tools: Tool structs there
                    assert repr(took[name]) == repr(mine[name]), (theirs_name, name, value)
