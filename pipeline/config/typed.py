"""Build dataclass instances from plain data, checking each value against the type hints.

``build`` walks a dataclass's fields, converts each value it finds (``str``, ``int``, ``float``,
``bool``, ``Literal``, ``X | None`` and other unions, ``list[T]``, ``tuple[T, ...]``,
``dict[str, T]``, nested dataclasses, ``Path``, ``Any``), checks ``min``/``max`` field metadata,
and appends one issue per problem instead of stopping: unknown keys (with a did-you-mean), missing
required keys, wrong types (expected vs got, with the value). Defaults are not filled in here
(but for the path fields below): absent keys are left to the dataclass, so each default lives in
one place, its field.

Fields whose metadata has ``path`` (``True``, ``"model"``, ``"command"``: how the value names a
file) are passed, once converted, through the caller's ``paths`` function, which may rewrite them
(``pipeline.config.paths`` resolves them against the config file's folder) or refuse them by
raising ValueError. A non-empty string default of such a field goes through it too, marked as
not written, so the built instance says where the default points. With ``checks=True``, a field's
``check`` metadata (a function of the value, e.g. "this folder holds a model") then runs on a
non-empty string value: it returns the value to use or raises ValueError, reported at the key.
Validation asks for it; rebuilding an already validated config (an actor) does not.

``to_plain`` goes the other way (instance -> plain data), for writing a resolved config.
Nothing here knows about pipelines, stages or files.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import PurePath
from typing import Any, Literal, Union

from pipeline.config.errors import ConfigIssue
from pipeline.config.yaml_source import Locations, join_path

__all__ = ["PathHook", "build", "describe", "did_you_mean", "show", "to_plain"]

# (key path, value, the field's ``path`` metadata, whether the config wrote it) -> value to use
PathHook = Callable[[str, str, Any, bool], str]

_BAD = object()  # a value that failed to convert (its issue is already recorded)
_NONE = type(None)
_NOUNS: dict[Any, tuple[str, str]] = {
    str: ("a string", "strings"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("a boolean (true or false)", "booleans"),
    _NONE: ("null", "nulls"),
    Any: ("any value", "values"),
}


def did_you_mean(word: str, choices: Collection[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, or ``""`` when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show(value: Any) -> str:
    """A value as error messages quote it: ``'two' (str)``, ``null``, ``true (bool)``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (bool)"
    if isinstance(value, Mapping):
        return f"a mapping {_short(dict(value))}"
    if isinstance(value, list):
        return f"a list {_short(value)}"
    return f"{_short(value)} ({type(value).__name__})"


def describe(tp: Any, plural: bool = False) -> str:
    """A type in words: ``an integer``, ``a list of strings``, ``one of 'a', 'b'``."""
    if tp in _NOUNS:
        return _NOUNS[tp][plural]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        choices = ", ".join(repr(a) for a in args)
        return f"values from {choices}" if plural else f"one of {choices}"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a, plural) for a in args)
    if dataclasses.is_dataclass(tp):
        return f"mappings ({tp.__name__})" if plural else f"a mapping ({tp.__name__})"
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        item = describe(args[0], plural=True) if args else "values"
        return "lists" if plural else f"a list of {item}"
    if origin in (dict, Mapping) or tp is dict:
        value = describe(args[1], plural=True) if len(args) == 2 else "values"
        return "mappings" if plural else f"a mapping of string keys to {value}"
    if isinstance(tp, type) and issubclass(tp, PurePath):
        return "paths" if plural else "a path"
    name = getattr(tp, "__name__", repr(tp))
    return f"values of type {name}" if plural else f"a value of type {name}"


class _Ctx:
    def __init__(
        self, locations: Locations, issues: list[ConfigIssue], paths: PathHook | None = None
    ) -> None:
        self.locations = locations
        self.issues = issues
        self.paths = paths
        self.checks = False

    def scratch(self) -> _Ctx:
        """A context whose issues are kept apart (to try a union's arms)."""
        ctx = _Ctx(self.locations, [], self.paths)
        ctx.checks = self.checks
        return ctx

    def fail(self, path: str, message: str) -> object:
        self.issues.append(ConfigIssue(path, message, self.locations.at(path)))
        return _BAD


def build(
    cls: type,
    data: Any,
    path: str,
    locations: Locations | Mapping[str, str] | None,
    issues: list[ConfigIssue],
    *,
    skip: Collection[str] = (),
    also_known: Collection[str] = (),
    paths: PathHook | None = None,
    checks: bool = False,
) -> Any | None:
    """An instance of dataclass ``cls`` from the mapping ``data`` at key path ``path``.

    Every problem is appended to ``issues``. Fields listed in ``skip`` and ``init=False`` fields
    are not read. ``also_known`` are keys handled elsewhere, offered in did-you-mean hints.
    ``paths`` rewrites the values of fields marked with ``path`` metadata, and ``checks`` runs
    fields' ``check`` metadata (see the module doc).
    Returns None when the instance cannot be built; a wrong optional value is reported and its
    default used, so callers can keep checking, but must not use the result if issues grew.
    ``locations`` may also be a plain ``{path: where}`` mapping, or None when unknown.
    """
    if not isinstance(locations, Locations):
        known, locations = locations or {}, Locations()
        for key, where in known.items():
            locations.set(key, where)
    ctx = _Ctx(locations, issues, paths)
    ctx.checks = checks
    return _build(cls, data, path, ctx, skip, also_known)


def _build(
    cls: type, data: Any, path: str, ctx: _Ctx, skip: Collection[str], also_known: Collection[str]
) -> Any | None:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in skip}
    if not isinstance(data, Mapping):
        keys = ", ".join(fields) or "no keys"
        ctx.fail(path, f"expected a mapping ({cls.__name__}: {keys}), got {show(data)}")
        return None
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # a plugin's annotations that do not evaluate: report, go on
        ctx.fail(path, f"cannot read the type hints of {cls.__module__}.{cls.__qualname__}: {exc}")
        return None
    issues_before = len(ctx.issues)
    for key in data:
        if key not in fields:
            known = [*fields, *also_known]
            hint = did_you_mean(str(key), known) or f"; valid keys: {', '.join(known)}"
            ctx.fail(join_path(path, str(key)), f"unknown key {key!r}{hint}")
    kwargs: dict[str, Any] = {}
    complete = True
    for name, field in fields.items():
        sub = join_path(path, name)
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        if name not in data:
            if required:
                doc = field.metadata.get("doc")
                ctx.fail(sub, f"missing required key {name!r}" + (f" ({doc})" if doc else ""))
                complete = False
            elif field.metadata.get("path") and ctx.paths and isinstance(field.default, str):
                value = _resolve_paths(field.default, field.metadata["path"], sub, ctx, False)
                if value is not _BAD:
                    kwargs[name] = value
            continue
        value = _convert(hints[name], data[name], sub, ctx)
        if value is not _BAD:
            value = _check_bounds(field, value, sub, ctx)
        if value is not _BAD and field.metadata.get("path") and ctx.paths is not None:
            value = _resolve_paths(value, field.metadata["path"], sub, ctx)
        if value is not _BAD and ctx.checks and callable(field.metadata.get("check")):
            value = _run_check(field.metadata["check"], value, sub, ctx)
        if value is _BAD:
            complete = complete and not required
        else:
            kwargs[name] = value
    if not complete:
        return None
    try:
        return cls(**kwargs)
    except Exception as exc:  # the Config's own __post_init__ checks: plugin code
        if len(ctx.issues) == issues_before:  # else a default stand-in may have caused it
            ctx.fail(_named_key(str(exc), data, path), f"invalid {cls.__name__}: {exc}")
        return None


def _named_key(message: str, data: Mapping[str, Any], path: str) -> str:
    """The key path of the first key of ``data`` that ``message`` names (so the issue points at
    its line), else ``path``: a Config's own check usually names what to change first."""
    found = [
        (m.start(), key)
        for key in data
        if isinstance(key, str) and (m := re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message))
    ]
    return join_path(path, min(found)[1]) if found else path


def _check_bounds(field: dataclasses.Field, value: Any, path: str, ctx: _Ctx) -> Any:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return value
    doc = field.metadata.get("doc")
    about = f" ({doc})" if doc else ""
    low, high = field.metadata.get("min"), field.metadata.get("max")
    if low is not None and value < low:
        return ctx.fail(path, f"must be at least {low}, got {value}{about}")
    if high is not None and value > high:
        return ctx.fail(path, f"must be at most {high}, got {value}{about}")
    return value


def _resolve_paths(value: Any, kind: Any, path: str, ctx: _Ctx, written: bool = True) -> Any:
    """``value`` (a path, or a list of them) through ``ctx.paths``; empty strings stay unset."""
    assert ctx.paths is not None
    if isinstance(value, list):
        items = [_resolve_paths(v, kind, f"{path}[{i}]", ctx) for i, v in enumerate(value)]
        return _BAD if any(v is _BAD for v in items) else items
    if not isinstance(value, (str, PurePath)) or not str(value):
        return value
    try:
        resolved = ctx.paths(path, str(value), kind, written)
    except ValueError as exc:
        return ctx.fail(path, str(exc))
    return type(value)(resolved) if isinstance(value, PurePath) else resolved


def _run_check(check: Callable[[str], Any], value: Any, path: str, ctx: _Ctx) -> Any:
    if not isinstance(value, str) or not value:
        return value
    try:
        return check(value)
    except ValueError as exc:
        return ctx.fail(path, str(exc))


def _shape_matches(tp: Any, value: Any) -> bool:
    """Whether ``value`` is plainly meant as ``tp`` (so ``tp``'s detailed issues are the best)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) or origin in (dict, Mapping) or tp is dict:
        return isinstance(value, Mapping)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        return isinstance(value, list)
    if origin is Literal:
        return any(type(value) is type(a) for a in typing.get_args(tp))
    return False


def _convert(tp: Any, value: Any, path: str, ctx: _Ctx) -> Any:
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        hint = (
            did_you_mean(value, [a for a in args if isinstance(a, str)])
            if isinstance(value, str)
            else ""
        )
        return ctx.fail(path, f"expected {describe(tp)}, got {show(value)}{hint}")
    if origin in (Union, types.UnionType):
        return _convert_union(tp, args, value, path, ctx)
    if dataclasses.is_dataclass(tp):
        built = _build(tp, value, path, ctx, (), ())
        return _BAD if built is None else built
    if origin in (list, Sequence) or tp is list or (origin is tuple and args[-1:] == (...,)):
        return _convert_list(tp, args[:1], value, path, ctx)
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(args):
            return ctx.fail(path, f"expected a list of {len(args)} items, got {show(value)}")
        items = [
            _convert(t, v, f"{path}[{i}]", ctx)
            for i, (t, v) in enumerate(zip(args, value, strict=True))
        ]
        return _BAD if any(v is _BAD for v in items) else tuple(items)
    if origin in (dict, Mapping) or tp is dict:
        return _convert_dict(tp, args, value, path, ctx)
    return _convert_scalar(tp, value, path, ctx)


def _convert_union(tp: Any, args: tuple, value: Any, path: str, ctx: _Ctx) -> Any:
    if value is None and _NONE in args:
        return None
    failures = []
    for arm in (a for a in args if a is not _NONE):
        scratch = ctx.scratch()
        converted = _convert(arm, value, path, scratch)
        if converted is not _BAD and not scratch.issues:
            return converted
        failures.append((arm, scratch.issues))
    for arm, arm_issues in failures:
        if _shape_matches(arm, value):
            ctx.issues.extend(arm_issues)  # the arm the value was plainly meant for says most
            return _BAD
    return ctx.fail(path, f"expected {describe(tp)}, got {show(value)}")


def _convert_list(tp: Any, item_type: tuple, value: Any, path: str, ctx: _Ctx) -> Any:
    if not isinstance(value, list):
        return ctx.fail(path, f"expected {describe(tp)}, got {show(value)}")
    item_tp = item_type[0] if item_type else Any
    items = [_convert(item_tp, v, f"{path}[{i}]", ctx) for i, v in enumerate(value)]
    if any(v is _BAD for v in items):
        return _BAD
    return tuple(items) if typing.get_origin(tp) is tuple or tp is tuple else items


def _convert_dict(tp: Any, args: tuple, value: Any, path: str, ctx: _Ctx) -> Any:
    if not isinstance(value, Mapping):
        return ctx.fail(path, f"expected {describe(tp)}, got {show(value)}")
    key_tp, value_tp = args if len(args) == 2 else (Any, Any)
    out, ok = {}, True
    for key, item in value.items():
        sub = join_path(path, str(key))
        if _convert(key_tp, key, sub, _Ctx(ctx.locations, [])) is _BAD:
            ctx.fail(sub, f"key {key!r} should be {describe(key_tp)}")
            ok = False
            continue
        converted = _convert(value_tp, item, sub, ctx)
        ok = ok and converted is not _BAD
        out[key] = converted
    return out if ok else _BAD


def _convert_scalar(tp: Any, value: Any, path: str, ctx: _Ctx) -> Any:
    got = show(value)
    if tp is _NONE:
        return value if value is None else ctx.fail(path, f"expected null, got {got}")
    if tp is bool:
        return (
            value
            if isinstance(value, bool)
            else ctx.fail(path, f"expected a boolean (true or false), got {got}")
        )
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        hint = f"; write {int(value)}" if isinstance(value, float) and value.is_integer() else ""
        return ctx.fail(path, f"expected an integer, got {got}{hint}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return ctx.fail(path, f"expected a number, got {got}")
    if tp is str:
        if isinstance(value, str):
            return value
        hint = (
            " (quote the value if you meant text)" if isinstance(value, (int, float, bool)) else ""
        )
        return ctx.fail(path, f"expected a string, got {got}{hint}")
    if isinstance(tp, type) and issubclass(tp, PurePath):
        return (
            tp(value)
            if isinstance(value, str)
            else ctx.fail(path, f"expected a path (string), got {got}")
        )
    return ctx.fail(
        path,
        f"the config cannot hold a value of type {tp!r}: use str, int, float, "
        "bool, Literal, list, dict, a dataclass or a union of them",
    )


def to_plain(value: Any, skip: Collection[str] = ()) -> Any:
    """Plain data (dicts, lists, scalars) from a built instance: the inverse of ``build``.

    ``skip`` names fields of the top-level dataclass to leave out.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init and f.name not in skip
        }
    if isinstance(value, Mapping):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    if isinstance(value, PurePath):
        return str(value)
    return value
