"""Building typed dataclasses from plain data: conversions, bounds and every message."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from pipeline.config.errors import ConfigIssue
from pipeline.config.typed import build, describe, to_plain
from pipeline.config.yaml_source import Locations


@dataclass
class Inner:
    size: int = 1
    name: str = "x"


@dataclass
class Sample:
    count: int = field(default=1, metadata={"min": 1, "max": 10, "doc": "how many"})
    rate: float = 0.5
    flag: bool = False
    mode: Literal["fast", "exact"] = "exact"
    limit: int | None = None
    tags: list[str] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)
    source: str | list[str] = "a"
    inner: Inner = field(default_factory=Inner)
    pair: tuple[int, str] = (0, "")
    many: tuple[int, ...] = ()
    where: Path = Path(".")
    extra: Any = None
    derived: int = field(default=0, init=False)


@dataclass
class Required:
    model: str = field(metadata={"doc": "model name"})
    size: int = 1


def run(cls: type, data: Any, **kw: Any) -> tuple[Any, list[ConfigIssue]]:
    loc = Locations("f.yaml")
    loc.set("cfg", "f.yaml:1")
    for i, key in enumerate(data if isinstance(data, dict) else (), start=2):
        loc.set(f"cfg.{key}", f"f.yaml:{i}")
    issues: list[ConfigIssue] = []
    return build(cls, data, "cfg", loc, issues, **kw), issues


def messages(issues: list[ConfigIssue]) -> list[tuple[str, str]]:
    return [(i.path, i.message) for i in issues]


def test_valid_data_converts_every_supported_type() -> None:
    obj, issues = run(
        Sample,
        {
            "count": 3,
            "rate": 2,
            "flag": True,
            "mode": "fast",
            "limit": 5,
            "tags": ["a", "b"],
            "weights": {"x": 1},
            "source": ["s1", "s2"],
            "inner": {"size": 4},
            "pair": [1, "b"],
            "many": [1, 2, 3],
            "where": "out/dir",
            "extra": {"any": [1]},
        },
    )
    assert issues == []
    assert obj == Sample(
        count=3,
        rate=2.0,
        flag=True,
        mode="fast",
        limit=5,
        tags=["a", "b"],
        weights={"x": 1.0},
        source=["s1", "s2"],
        inner=Inner(size=4),
        pair=(1, "b"),
        many=(1, 2, 3),
        where=Path("out/dir"),
        extra={"any": [1]},
    )
    assert isinstance(obj.rate, float) and isinstance(obj.weights["x"], float)


def test_absent_keys_keep_the_dataclass_defaults() -> None:
    obj, issues = run(Sample, {})
    assert issues == [] and obj == Sample()


@pytest.mark.parametrize(
    ("data", "path", "message"),
    [
        ({"count": "two"}, "cfg.count", "expected an integer, got 'two' (str)"),
        ({"count": True}, "cfg.count", "expected an integer, got true (bool)"),
        ({"count": 2.0}, "cfg.count", "expected an integer, got 2.0 (float); write 2"),
        ({"count": 0}, "cfg.count", "must be at least 1, got 0 (how many)"),
        ({"count": 11}, "cfg.count", "must be at most 10, got 11 (how many)"),
        ({"rate": "fast"}, "cfg.rate", "expected a number, got 'fast' (str)"),
        ({"rate": False}, "cfg.rate", "expected a number, got false (bool)"),
        ({"flag": "true"}, "cfg.flag", "expected a boolean (true or false), got 'true' (str)"),
        (
            {"mode": "fats"},
            "cfg.mode",
            "expected one of 'fast', 'exact', got 'fats' (str); did you mean 'fast'?",
        ),
        ({"mode": 1}, "cfg.mode", "expected one of 'fast', 'exact', got 1 (int)"),
        ({"limit": "x"}, "cfg.limit", "expected an integer or null, got 'x' (str)"),
        ({"tags": "a"}, "cfg.tags", "expected a list of strings, got 'a' (str)"),
        (
            {"tags": ["a", 2]},
            "cfg.tags[1]",
            "expected a string, got 2 (int) (quote the value if you meant text)",
        ),
        ({"weights": {"x": "heavy"}}, "cfg.weights.x", "expected a number, got 'heavy' (str)"),
        (
            {"weights": [1]},
            "cfg.weights",
            "expected a mapping of string keys to numbers, got a list [1]",
        ),
        ({"source": 3}, "cfg.source", "expected a string or a list of strings, got 3 (int)"),
        ({"source": ["a", None]}, "cfg.source[1]", "expected a string, got null"),
        ({"inner": {"size": "big"}}, "cfg.inner.size", "expected an integer, got 'big' (str)"),
        ({"inner": {"sise": 2}}, "cfg.inner.sise", "unknown key 'sise'; did you mean 'size'?"),
        ({"inner": None}, "cfg.inner", "expected a mapping (Inner: size, name), got null"),
        ({"pair": [1]}, "cfg.pair", "expected a list of 2 items, got a list [1]"),
        ({"many": [1, "x"]}, "cfg.many[1]", "expected an integer, got 'x' (str)"),
        ({"where": 3}, "cfg.where", "expected a path (string), got 3 (int)"),
        ({"cuont": 3}, "cfg.cuont", "unknown key 'cuont'; did you mean 'count'?"),
        (
            {"derived": 3},
            "cfg.derived",
            "unknown key 'derived'; valid keys: count, rate, flag, "
            "mode, limit, tags, weights, source, inner, pair, many, where, extra",
        ),
    ],
)
def test_each_mistake_names_path_and_what_was_expected(data: dict, path: str, message: str) -> None:
    _, issues = run(Sample, data)
    assert messages(issues) == [(path, message)]


def test_issue_reports_where_the_key_was_written() -> None:
    _, issues = run(Sample, {"flag": True, "count": "x"})
    assert issues[0].where == "f.yaml:3"


def test_all_mistakes_are_collected() -> None:
    obj, issues = run(
        Sample, {"count": "x", "rate": "y", "mode": "z", "nope": 1, "inner": {"size": "w"}}
    )
    assert sorted(i.path for i in issues) == [
        "cfg.count",
        "cfg.inner.size",
        "cfg.mode",
        "cfg.nope",
        "cfg.rate",
    ]
    assert obj == Sample()  # built with defaults standing in, so callers can keep checking


def test_missing_required_key_is_reported_with_its_doc() -> None:
    obj, issues = run(Required, {"size": 2})
    assert obj is None
    assert messages(issues) == [("cfg.model", "missing required key 'model' (model name)")]
    assert issues[0].where == "f.yaml:1"  # the mapping that lacks it


def test_plain_mapping_or_no_locations_are_accepted() -> None:
    issues: list[ConfigIssue] = []
    build(Inner, {"size": "x"}, "cfg", {"cfg.size": "f.yaml:7"}, issues)
    build(Inner, {"size": "x"}, "cfg", None, issues)
    assert [(i.path, i.where) for i in issues] == [("cfg.size", "f.yaml:7"), ("cfg.size", "")]


def test_not_a_mapping() -> None:
    obj, issues = run(Inner, ["size"])
    assert obj is None
    assert messages(issues) == [
        ("cfg", "expected a mapping (Inner: size, name), got a list ['size']")
    ]


def test_skip_and_also_known() -> None:
    _, issues = run(
        Inner, {"options": 1, "replica": 2}, skip=("name",), also_known=("replicas", "use")
    )
    assert messages(issues) == [
        ("cfg.options", "unknown key 'options'; valid keys: size, replicas, use"),
        ("cfg.replica", "unknown key 'replica'; did you mean 'replicas'?"),
    ]


@dataclass
class Checked:
    low: int = 0
    high: int = 1

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("low must not exceed high")
        if self.low == self.high == 3:
            raise ValueError("the pair (3, 3) is reserved")


def test_post_init_errors_become_issues_unless_caused_by_a_stand_in_default() -> None:
    obj, issues = run(Checked, {"low": 5, "high": 2})
    assert obj is None
    # at the first written key the message names, so the issue has that key's line
    assert messages(issues) == [("cfg.low", "invalid Checked: low must not exceed high")]
    _, issues = run(Checked, {"high": -1})
    assert messages(issues) == [("cfg.high", "invalid Checked: low must not exceed high")]
    _, issues = run(Checked, {"low": 5, "high": "x"})  # default high=1 stands in: no extra noise
    assert [i.path for i in issues] == ["cfg.high"]
    _, issues = run(Checked, {"low": 3, "high": 3})  # names no key: the section itself
    assert messages(issues) == [("cfg", "invalid Checked: the pair (3, 3) is reserved")]


@dataclass
class Unsupported:
    thing: complex = 0j


def test_unsupported_field_type_is_reported() -> None:
    _, issues = run(Unsupported, {"thing": 1})
    assert "cannot hold a value of type" in issues[0].message


def test_to_plain_inverts_build() -> None:
    obj = Sample(pair=(1, "b"), many=(2,), where=Path("x"), inner=Inner(size=3))
    plain = to_plain(obj)
    assert "derived" not in plain
    assert plain["pair"] == [1, "b"] and plain["where"] == "x" and plain["inner"]["size"] == 3
    again, issues = run(Sample, plain)
    assert issues == [] and again == obj


def test_describe() -> None:
    assert describe(dict[str, list[int]]) == "a mapping of string keys to lists"
    assert describe(list[Inner]) == "a list of mappings (Inner)"
    assert describe(Literal["a"] | None) == "one of 'a' or null"


@dataclass
class WithOptionalSection:
    inner: Inner | None = None


def test_mistakes_inside_an_optional_section_are_reported() -> None:
    # An `X | None` section whose content is wrong must not be built with defaults in silence.
    _obj, issues = run(WithOptionalSection, {"inner": {"size": "w", "nmae": "y"}})
    assert sorted(i.path for i in issues) == ["cfg.inner.nmae", "cfg.inner.size"]


# --- path and check hooks ----------------------------------------------------------------------


def _pinned(value: str) -> str:
    if value.startswith("bad"):
        raise ValueError(f"{value}: no such model")
    return value + "@pinned"


@dataclass
class Files:
    root: str = field(default="runs", metadata={"path": True})
    model: str = field(default="", metadata={"path": "model", "check": _pinned})
    inputs: list[str] = field(default_factory=list, metadata={"path": True})
    nested: Files | None = None


def test_path_fields_go_through_the_hook_defaults_marked_unwritten() -> None:
    seen = []

    def hook(key: str, value: str, kind: Any, written: bool) -> str:
        seen.append((key, value, kind, written))
        if value == "refuse":
            raise ValueError("refused here")
        return f"/base/{value}"

    issues: list[ConfigIssue] = []
    data = {"model": "m", "inputs": ["a", "b"], "nested": {"root": "r", "model": ""}}
    got = build(Files, data, "s", {"s.model": "f.yaml:3"}, issues, paths=hook)
    assert issues == []
    assert got.root == "/base/runs" and got.model == "/base/m"  # no check without checks=True
    assert got.inputs == ["/base/a", "/base/b"]
    assert got.nested.root == "/base/r" and got.nested.model == ""  # empty: unset, untouched
    assert ("s.root", "runs", True, False) in seen  # the default, not written
    assert ("s.inputs[1]", "b", True, True) in seen and ("s.model", "m", "model", True) in seen
    build(Files, {"root": "refuse"}, "s", {"s.root": "f.yaml:4"}, issues, paths=hook)
    assert issues == [ConfigIssue("s.root", "refused here", "f.yaml:4")]


def test_check_metadata_runs_when_asked_and_reports_at_the_key() -> None:
    issues: list[ConfigIssue] = []
    got = build(Files, {"model": "m"}, "s", {}, issues, checks=True)
    assert issues == [] and got.model == "m@pinned"
    assert build(Files, {"model": "bad"}, "s", {"s.model": "f.yaml:2"}, issues, checks=True)
    assert issues == [ConfigIssue("s.model", "bad: no such model", "f.yaml:2")]
