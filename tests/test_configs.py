"""Every pipeline file shipped in configs/ validates, exactly as `inflight validate` sees it."""

import dataclasses
from pathlib import Path

import pytest

from pipeline.config import load_pipeline
from pipeline.registry import resolve

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS, "configs/ holds no pipeline file"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    loaded = load_pipeline(path, resolve=lambda name: resolve("stage", name))
    assert loaded.config.stages
    for name, cls in loaded.stage_classes.items():
        assert isinstance(cls, type), name


def _model_paths(options, path):
    """(key path, value) of every non-empty field marked as a model folder or Hub id."""
    if not dataclasses.is_dataclass(options):
        return
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        # a source's `dataset` is resolved as models are (a folder or a Hub id) but is a dataset,
        # or a reasoning-gym dataset's name: no model folder to find
        if f.metadata.get("path") == "model" and value and f.name != "dataset":
            yield f"{path}.{f.name}", value
        yield from _model_paths(value, f"{path}.{f.name}")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_models_are_found_from_any_directory(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository root: paths are relative to the file
    loaded = load_pipeline(path, resolve=lambda name: resolve("stage", name))
    for name, section in loaded.config.stages.items():
        for key, value in _model_paths(section.options, f"stages.{name}"):
            assert (Path(value) / "config.json").is_file(), f"{path.name}: {key}: {value}"
