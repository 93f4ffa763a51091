"""Overrides that index and append to lists, and remove list items, with their locations."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_pipeline
from pipeline.config.yaml_source import apply_overrides, load_yaml

TEXT = """\
    stages:
      s:
        use: scorer
        rewards:
          - {fn: exact_match}
          - {fn: length, weight: 0.5}
        tags: [a, b, c]
"""


@pytest.fixture
def loaded(tmp_path: Path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(textwrap.dedent(TEXT))
    data, loc, issues = load_yaml(path)
    assert issues == []
    return path, data, loc


def rewards(data: dict) -> list:
    return data["stages"]["s"]["rewards"]


@pytest.mark.parametrize(
    "text", ["stages.s.rewards.0.fn=math_verify", "stages.s.rewards[0].fn=math_verify"]
)
def test_a_number_indexes_a_list(loaded, text: str) -> None:
    path, data, loc = loaded
    assert apply_overrides(data, loc, [text]) == []
    assert rewards(data)[0] == {"fn": "math_verify"}
    assert loc.at("stages.s.rewards[0].fn") == f"override {text!r}"
    assert loc.at("stages.s.rewards[1].fn") == f"{path}:6"  # the others keep their lines


def test_a_whole_item_and_a_scalar_item_can_be_replaced(loaded) -> None:
    _, data, loc = loaded
    overrides = ["stages.s.rewards.1={fn: f, weight: 2}", "stages.s.tags.2=z"]
    assert apply_overrides(data, loc, overrides) == []
    assert rewards(data)[1] == {"fn": "f", "weight": 2}
    assert data["stages"]["s"]["tags"] == ["a", "b", "z"]
    assert loc.at("stages.s.rewards[1].weight") == f"override {overrides[0]!r}"


@pytest.mark.parametrize(
    "text",
    [
        "stages.s.rewards+={fn: math_verify}",
        "stages.s.rewards.+={fn: math_verify}",
        "stages.s.rewards[+]={fn: math_verify}",
        "stages.s.rewards += {fn: math_verify}",
    ],
)
def test_plus_equals_appends(loaded, text: str) -> None:
    _, data, loc = loaded
    assert apply_overrides(data, loc, [text]) == []
    assert [r["fn"] for r in rewards(data)] == ["exact_match", "length", "math_verify"]
    assert loc.at("stages.s.rewards[2].fn") == f"override {text!r}"


def test_appending_to_an_absent_key_makes_a_list(loaded) -> None:
    _, data, loc = loaded
    assert apply_overrides(data, loc, ["stages.s.extra+=x", "stages.s.extra+=[1, 2]"]) == []
    assert data["stages"]["s"]["extra"] == ["x", [1, 2]]
    assert apply_overrides(data, loc, ["stages.s.rewards.0.more+=1"]) == []
    assert rewards(data)[0]["more"] == [1]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (
            "stages.s.rewards.5.fn=x",
            "index 5 is out of range: stages.s.rewards has 2 items (indexes 0 to 1); "
            "append with stages.s.rewards+=VALUE",
        ),
        ("stages.s.tags.3=x", "stages.s.tags has 3 items (indexes 0 to 2)"),
        ("stages.s.rewards.first.fn=x", "stages.s.rewards is a list: index it with a number"),
        ("stages.s.use+=x", "cannot append to 'stages.s.use': it is 'scorer' (str), not a list"),
        ("stages.s.tags.0.x=1", "cannot set a key inside 'stages.s.tags[0]': it is 'a' (str)"),
        ("stages.s.rewards[x]=1", "dotted path with no empty parts"),
    ],
)
def test_bad_indexes_name_the_key_and_the_length(loaded, text: str, words: str) -> None:
    _, data, loc = loaded
    before = repr(data)
    issues = apply_overrides(data, loc, [text])
    assert len(issues) == 1, issues
    assert issues[0].where == f"override {text!r}"
    assert words in issues[0].message
    assert repr(data) == before


def test_an_empty_list_says_so(loaded) -> None:
    _, data, loc = loaded
    issues = apply_overrides(data, loc, ["stages.s.tags=[]", "stages.s.tags.0=x"])
    assert len(issues) == 1
    assert "stages.s.tags is an empty list" in issues[0].message


def test_tilde_removes_a_list_item_and_later_items_keep_their_lines(loaded) -> None:
    path, data, loc = loaded
    assert loc.at("stages.s.rewards[1].weight") == f"{path}:6"
    assert apply_overrides(data, loc, ["~stages.s.rewards.0"]) == []
    assert rewards(data) == [{"fn": "length", "weight": 0.5}]
    assert loc.at("stages.s.rewards[0].weight") == f"{path}:6"  # moved up, same line
    issues = apply_overrides(data, loc, ["~stages.s.rewards.1", "~stages.s.nothing.0"])
    assert [i.message.split(":")[0] for i in issues] == [
        "index 1 is out of range",
        "nothing to remove",
    ]


# --- through the loader: issues land at the override ------------------------------------------


@dataclass
class Spec:
    fn: str
    weight: float = 1.0


class Scorer:
    @dataclass
    class Config:
        rewards: list[Spec] = field(default_factory=list)
        tags: list[str] = field(default_factory=list)


def test_loaded_config_reports_a_bad_appended_item_at_its_override(loaded) -> None:
    path, _, _ = loaded
    load = lambda *o: load_pipeline(path, o, resolve=lambda _: Scorer)  # noqa: E731
    good = load("stages.s.rewards.0.weight=3", "stages.s.rewards+={fn: g}")
    assert [(r.fn, r.weight) for r in good.config.stages["s"].options.rewards] == [
        ("exact_match", 3),
        ("length", 0.5),
        ("g", 1.0),
    ]
    text = "stages.s.rewards+={fn: g, wieght: 2}"
    with pytest.raises(ConfigError) as exc:
        load(text)
    (issue,) = exc.value.issues
    assert issue.path == "stages.s.rewards[2].wieght"
    assert issue.where == f"override {text!r}"
    assert "did you mean 'weight'" in issue.message
