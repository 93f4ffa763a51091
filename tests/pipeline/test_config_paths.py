"""Paths in a config: relative to the file that wrote them, or to the working directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline.config import ConfigError, dump_yaml, load_pipeline
from pipeline.config.paths import looks_like_hub_id
from pipeline.registry import resolve as registry_resolve

REPO = Path(__file__).resolve().parents[2]


class Reader:
    @dataclass
    class Config:
        data: str = field(default="", metadata={"path": True})
        model: str = field(default="", metadata={"path": "model"})
        files: list[str] = field(default_factory=list, metadata={"path": True})
        python: str = field(default="", metadata={"path": "command"})
        name: str = "not a path"


def resolve(name: str) -> type:
    if name != "reader":
        raise LookupError(f"no stage named {name!r}")
    return Reader


def write(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pipeline.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def options(path: Path, *overrides: str):
    loaded = load_pipeline(path, overrides, resolve=resolve)
    return loaded, loaded.config.stages["r"].options


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory: not the config's folder."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_file_paths_resolve_against_the_files_folder(tmp_path: Path, elsewhere: Path) -> None:
    (tmp_path / "conf" / "models" / "tiny").mkdir(parents=True)
    path = write(
        tmp_path / "conf",
        """\
        stages:
          r:
            use: reader
            data: data/train.jsonl
            model: models/tiny
            files: [a.txt, ../b.txt, /abs/c.txt, ~/d.txt]
            python: venv/bin/python
            name: data/train.jsonl
        """,
    )
    _, got = options(path)
    conf = tmp_path / "conf"
    assert got.data == str(conf / "data/train.jsonl")  # need not exist
    assert got.model == str(conf / "models/tiny")
    assert got.files == [
        str(conf / "a.txt"),
        str(tmp_path / "b.txt"),
        "/abs/c.txt",
        os.path.expanduser("~/d.txt"),
    ]
    assert got.python == str(conf / "venv/bin/python")
    assert got.name == "data/train.jsonl"  # no path metadata: as written


def test_override_paths_resolve_against_the_working_directory(
    tmp_path: Path, elsewhere: Path
) -> None:
    (elsewhere / "mine").mkdir()
    path = write(tmp_path / "conf", "stages:\n  r: {use: reader, data: x.jsonl}\n")
    _, got = options(
        path, "stages.r.data=y.jsonl", "stages.r={use: reader, model: mine, files: [z]}"
    )
    assert got.data == ""  # the later override replaced the whole stage entry
    assert got.model == str(elsewhere / "mine")
    assert got.files == [str(elsewhere / "z")]
    _, got = options(path, "stages.r.data=y.jsonl")
    assert got.data == str(elsewhere / "y.jsonl")


def test_a_model_that_is_no_local_folder_stays_a_hub_id(tmp_path: Path, elsewhere: Path) -> None:
    path = write(
        tmp_path / "conf",
        """\
        stages:
          r: {use: reader, model: Qwen/Qwen2.5-0.5B@main, python: python3}
        """,
    )
    _, got = options(path)
    assert got.model == "Qwen/Qwen2.5-0.5B@main"
    assert got.python == "python3"  # a bare program name is looked up on PATH
    # what cannot be a Hub id is a path, reported in full by whoever finds it missing
    _, got = options(path, "stages.r.model=./gone")
    assert got.model == str(elsewhere / "gone")
    _, got = options(path, "stages.r.model=a/b/c")
    assert got.model == str(elsewhere / "a/b/c")


@pytest.mark.parametrize(
    ("value", "hub"),
    [
        ("gpt2", True),
        ("Qwen/Qwen2.5-0.5B", True),
        ("org/name@v1.0", True),
        ("org/name@refs/pr/1", True),
        ("./models/x", False),
        ("../x", False),
        ("/abs/x", False),
        ("~/x", False),
        ("a/b/c", False),
        ("org/name@", False),
        ("org/..", False),
    ],
)
def test_hub_id_shape(value: str, hub: bool) -> None:
    assert looks_like_hub_id(value) is hub


def test_a_path_written_for_the_old_rule_is_refused_with_the_fix(
    tmp_path: Path, elsewhere: Path
) -> None:
    (elsewhere / "models" / "tiny").mkdir(parents=True)
    path = write(
        elsewhere / "configs",
        """\
        stages:
          r:
            use: reader
            model: models/tiny
        """,
    )
    with pytest.raises(ConfigError) as exc:
        options(path)
    (issue,) = exc.value.issues
    assert issue.path == "stages.r.model"
    assert issue.where == f"{path}:4"
    assert "relative to the file's folder: write '../models/tiny'" in issue.message
    # the same text typed as an override is relative to the working directory: fine
    _, got = options(path, "stages.r.model=models/tiny")
    assert got.model == str(elsewhere / "models" / "tiny")


def test_defaults_stay_relative_to_the_working_directory(tmp_path: Path, elsewhere: Path) -> None:
    path = write(tmp_path / "conf", "stages:\n  r: {use: reader}\n")
    loaded, got = options(path)
    assert loaded.config.run.runs_root == str(elsewhere / "runs")
    assert got.data == "" and got.model == ""  # unset stays unset
    written = write(tmp_path / "conf2", "run: {runs_root: out}\nstages:\n  r: {use: reader}\n")
    assert options(written)[0].config.run.runs_root == str(tmp_path / "conf2" / "out")


def test_the_resolved_config_means_the_same_from_anywhere(tmp_path: Path, elsewhere: Path) -> None:
    path = write(
        tmp_path / "conf",
        "stages:\n  r: {use: reader, data: d.jsonl, files: [f]}\n",
    )
    loaded, _ = options(path)
    kept = tmp_path / "run" / "config.yaml"
    kept.parent.mkdir()
    kept.write_text(dump_yaml(loaded.resolved()))
    again = load_pipeline(kept, resolve=resolve)
    assert again.config == loaded.config


def _shipped(name: str) -> dict:
    loaded = load_pipeline(
        REPO / "configs" / name, resolve=lambda use: registry_resolve("stage", use)
    )
    return {n: s.options for n, s in loaded.config.stages.items()}


@pytest.mark.parametrize("name", ["default.yaml", "longtail.yaml"])
def test_shipped_configs_find_their_model_from_any_directory(
    name: str, elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for cwd in (elsewhere, REPO):
        monkeypatch.chdir(cwd)
        stages = _shipped(name)
        model = Path(stages["learner"].model)
        assert (model / "config.json").is_file(), model
        assert model.parent == REPO / "configs" / "models"
        assert stages["generator"].launch.model == str(model)
        assert stages["scorer"].tokenizer == str(model)
        assert stages["feeder"].source.tokenizer == str(model)
        assert stages["learner"].eval.source.tokenizer == str(model)


@pytest.mark.timeout(60)
def test_inflight_validate_from_another_directory(tmp_path: Path) -> None:
    config = REPO / "configs" / "default.yaml"
    for cwd in (tmp_path, REPO):
        result = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "validate", str(config)],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=50,
        )
        assert result.returncode == 0, result.stderr
        assert "valid (4 stages" in result.stdout
