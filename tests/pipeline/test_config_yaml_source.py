"""Reading pipeline YAML: file-level problems, key locations, overrides, dumping."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipeline.config.errors import ConfigError, ConfigIssue
from pipeline.config.yaml_source import Locations, apply_overrides, dump_yaml, load_yaml


def write(tmp_path: Path, text: str, name: str = "pipeline.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def only_issue(exc: pytest.ExceptionInfo[ConfigError]) -> ConfigIssue:
    assert len(exc.value.issues) == 1, exc.value.issues
    return exc.value.issues[0]


def test_locations_map_every_key_path_to_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        run:
          name: demo   # line 2
        stages:
          square:
            use: power
            inputs:
              numbers: [numbers.out, other.out]
    """,
    )
    data, loc, issues = load_yaml(path)
    assert issues == []
    assert data["stages"]["square"]["inputs"]["numbers"] == ["numbers.out", "other.out"]
    assert loc.at("run.name") == f"{path}:2"
    assert loc.at("stages.square.use") == f"{path}:5"
    assert loc.at("stages.square.inputs.numbers[1]") == f"{path}:7"
    # A key that was never written reports at its nearest written ancestor.
    assert loc.at("stages.square.replicas") == f"{path}:4"
    assert loc.at("transport.inbox") == str(path)


def test_missing_file_suggests_a_sibling(tmp_path: Path) -> None:
    write(tmp_path, "stages: {}\n", "pipeline.yaml")
    with pytest.raises(ConfigError) as exc:
        load_yaml(tmp_path / "pipline.yaml")
    issue = only_issue(exc)
    assert issue.where == str(tmp_path / "pipline.yaml")
    assert "no such file" in issue.message and "pipeline.yaml" in issue.message


def test_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_yaml(tmp_path)
    assert "is a directory" in only_issue(exc).message


def test_unreadable_file_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "run: {}\n")

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # chmod does not stop root
    with pytest.raises(ConfigError) as exc:
        load_yaml(path)
    assert "cannot read the file: Permission denied" in only_issue(exc).message


def test_binary_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_bytes(b"run:\n  name: \xff\xfe\n")
    with pytest.raises(ConfigError) as exc:
        load_yaml(path)
    assert "not a UTF-8 text file" in only_issue(exc).message


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   # and another\n"])
def test_empty_file_is_reported(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_yaml(path)
    issue = only_issue(exc)
    assert issue.where == str(path)
    assert "the file is empty (or holds only comments)" in issue.message


def test_tab_indentation_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  name: x\nstages:\n\tsquare:\n\t  use: power\n")
    with pytest.raises(ConfigError) as exc:
        load_yaml(path)
    wheres = [i.where for i in exc.value.issues]
    assert wheres == [f"{path}:4:1", f"{path}:5:1"]
    assert all("tab" in i.message and "spaces" in i.message for i in exc.value.issues)


@pytest.mark.parametrize(
    ("text", "where", "words"),
    [
        ("run:\n  name: a: b\n", "2:10", "quote a value that contains ': '"),
        ("run:\n  name: x\n seed: 2\n", "3:2", "indentation does not line up"),
        ("run:\n  name: 'x\n", "3:1", "unclosed quote"),
        ("stages: {a: {use: x}\n", "2:1", "'{' mapping is not closed"),
        ("run: {}\n---\nstages: {}\n", "2:1", "more than one YAML document"),
    ],
)
def test_malformed_yaml_gives_line_column_and_plain_words(
    tmp_path: Path, text: str, where: str, words: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_yaml(path)
    issue = only_issue(exc)
    assert issue.where == f"{path}:{where}"
    assert issue.message.startswith("invalid YAML: ")
    assert words in issue.message
    assert "(parser: " in issue.message  # the parser's own words stay available


def test_top_level_list_is_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "- run\n- stages\n")
    with pytest.raises(ConfigError) as exc:
        load_yaml(path)
    issue = only_issue(exc)
    assert issue.where == f"{path}:1"
    assert issue.message == (
        "the top level must be a mapping of sections (run, transport, stages), got a list"
    )


def test_duplicate_keys_report_both_lines(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        stages:
          square:
            use: power
            replicas: 2
            replicas: 3
          square:
            use: other
    """,
    )
    _, _, issues = load_yaml(path)
    assert [(i.path, i.where) for i in issues] == [
        ("stages.square.replicas", f"{path}:5"),
        ("stages.square", f"{path}:6"),
    ]
    assert "first at line 4, again at line 5" in issues[0].message
    assert "first at line 2, again at line 6" in issues[1].message


def test_non_string_keys_are_reported(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        stages:
          1: {use: power}
          on: {use: power}
          ok: {use: power}
    """,
    )
    data, _, issues = load_yaml(path)
    assert list(data["stages"]) == ["ok"]
    assert [(i.path, i.where) for i in issues] == [
        ("stages.1", f"{path}:2"),
        ("stages.on", f"{path}:3"),
    ]
    assert "key '1' is read by YAML as 1 (int), not a string: quote it" in issues[0].message
    assert "key 'on' is read by YAML as True (bool)" in issues[1].message


def test_tags_that_build_objects_are_rejected(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        run:
          name: !!python/object/apply:os.system ["echo hi"]
          seed: !!binary aGk=
    """,
    )
    data, _, issues = load_yaml(path)
    assert data["run"] == {"name": None, "seed": None}
    assert [(i.path, i.where) for i in issues] == [
        ("run.name", f"{path}:2"),
        ("run.seed", f"{path}:3"),
    ]
    assert "unsupported YAML tag '!!python/object/apply:os.system'" in issues[0].message


def test_value_types_follow_yaml_with_two_fixes(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        a: 1e-3        # YAML 1.2 float, PyYAML 1.1 would say str
        b: 2024-01-01  # stays a string, no datetime object
        c: 1.5
        d: yes
        e: ~
        f: "12"
    """,
    )
    data, _, _ = load_yaml(path)
    assert data == {"a": 0.001, "b": "2024-01-01", "c": 1.5, "d": True, "e": None, "f": "12"}


def test_merge_keys_merge_and_own_keys_win(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        defaults: &d
          replicas: 2
          inbox: 8
        stages:
          a:
            <<: *d
            inbox: 4
    """,
    )
    data, loc, issues = load_yaml(path)
    assert issues == []
    assert data["stages"]["a"] == {"replicas": 2, "inbox": 4}
    assert loc.at("stages.a.inbox") == f"{path}:7"
    assert loc.at("stages.a.replicas") == f"{path}:2"  # where the merged value was written


def test_recursive_alias_is_reported_not_followed(tmp_path: Path) -> None:
    path = write(tmp_path, "loop: &a [1, *a]\n")
    data, _, issues = load_yaml(path)
    assert data == {"loop": [1, None]}
    assert [(i.path, i.where) for i in issues] == [("loop[1]", f"{path}:1")]


# --- overrides ---------------------------------------------------------------------------------


def loaded(tmp_path: Path) -> tuple[dict, Locations]:
    path = write(
        tmp_path,
        """\
        run:
          name: demo
        stages:
          square:
            use: power
            replicas: 1
    """,
    )
    data, loc, _ = load_yaml(path)
    return data, loc


def test_overrides_set_convert_and_create(tmp_path: Path) -> None:
    data, loc = loaded(tmp_path)
    issues = apply_overrides(
        data,
        loc,
        [
            "stages.square.replicas=2",
            "run.name=foo",
            "stages.sum.inputs={values: square.out}",
            "transport.host = 10.0.0.1",
            "run.seed=",
        ],
    )
    assert issues == []
    assert data["stages"]["square"]["replicas"] == 2
    assert data["run"]["name"] == "foo"
    assert data["run"]["seed"] is None
    assert data["stages"]["sum"] == {"inputs": {"values": "square.out"}}
    assert data["transport"] == {"host": "10.0.0.1"}
    assert loc.at("stages.square.replicas") == "override 'stages.square.replicas=2'"
    assert loc.at("stages.sum.inputs.values") == "override 'stages.sum.inputs={values: square.out}'"
    assert loc.at("stages.sum.use") == "override 'stages.sum.inputs={values: square.out}'"
    assert loc.at("stages.square.use").endswith(":5")  # untouched keys keep their line


def test_override_replacing_a_mapping_forgets_its_old_lines(tmp_path: Path) -> None:
    data, loc = loaded(tmp_path)
    assert apply_overrides(data, loc, ["stages.square={use: other}"]) == []
    assert data["stages"]["square"] == {"use": "other"}
    assert loc.at("stages.square.replicas") == "override 'stages.square={use: other}'"


@pytest.mark.parametrize(
    ("text", "path", "words"),
    [
        ("stages.square.replicas", "", "must look like KEY=VALUE"),
        ("=3", "", "dotted path with no empty parts"),
        ("stages..replicas=3", "stages..replicas", "dotted path with no empty parts"),
        ("run.name=[a, b", "run.name", "the value is not valid YAML"),
        ("run.name=a: b", "run.name", "block YAML collection"),
        ("run.name.first=x", "run.name.first", "'run.name': it is 'demo' (str), not a mapping"),
        ("run.x=!!python/name:os.system", "run.x", "unsupported YAML tag"),
    ],
)
def test_bad_overrides_are_reported_at_the_override(
    tmp_path: Path, text: str, path: str, words: str
) -> None:
    data, loc = loaded(tmp_path)
    before = repr(data)
    issues = apply_overrides(data, loc, [text])
    assert len(issues) == 1, issues
    assert issues[0].where == f"override {text!r}"
    assert issues[0].path == path
    assert words in issues[0].message
    assert repr(data) == before


def test_all_bad_overrides_are_reported(tmp_path: Path) -> None:
    data, loc = loaded(tmp_path)
    issues = apply_overrides(data, loc, ["a", "run.seed=3", "b=[", "run.name.x=1"])
    assert [i.where for i in issues] == [
        "override 'a'",
        "override 'b=['",
        "override 'run.name.x=1'",
    ]
    assert data["run"]["seed"] == 3


def test_tilde_removes_a_key(tmp_path: Path) -> None:
    data, loc = loaded(tmp_path)
    assert apply_overrides(data, loc, ["~stages.square.replicas", "~ run"]) == []
    assert data == {"stages": {"square": {"use": "power"}}}
    assert loc.at("stages.square.replicas").endswith(":4")  # now reports at its stage
    issues = apply_overrides(data, loc, ["~stages.square.nothing", "~stages..x", "~run.name=x"])
    assert [(i.path, i.where) for i in issues] == [
        ("stages.square.nothing", "override '~stages.square.nothing'"),
        ("stages..x", "override '~stages..x'"),
        ("run.name=x", "override '~run.name=x'"),
    ]
    assert "nothing to remove" in issues[0].message


# --- dumping -----------------------------------------------------------------------------------


def test_dump_quotes_strings_that_would_read_back_as_other_types(tmp_path: Path) -> None:
    data = {
        "a": "1e-3",
        "b": "yes",
        "c": "12",
        "d": None,
        "e": 1e-10,
        "f": [1, "x: y"],
        "g": {},
        "h": "2024-01-01",
        "i": "ünï",
    }
    path = tmp_path / "out.yaml"
    path.write_text(dump_yaml(data))
    assert load_yaml(path)[0] == data
