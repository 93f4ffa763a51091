"""Every pipeline file shipped in configs/ validates, exactly as `inflight validate` sees it."""

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
