"""What ``inflight run`` does before it starts the stages: it reads the installed entry points
once, and it checks a pipeline without importing what only running stages need."""

from __future__ import annotations

import sys

from pipeline import registry
from tests.pipeline.runs import REPO, python_lines


def test_entry_points_are_read_once_per_search_path(monkeypatch) -> None:
    calls = []
    read = registry.entry_points

    def counted():
        calls.append(1)
        return read()

    monkeypatch.setattr(registry, "entry_points", counted)
    registry._installed.cache_clear()
    try:
        for name in ("feeder", "generator", "scorer", "learner"):
            assert registry.resolve("stage", name).__name__.lower() == name
        assert len(calls) == 1
        monkeypatch.setattr(sys, "path", [*sys.path, str(REPO / "no-such-folder")])
        registry.resolve("stage", "feeder")  # a folder more: read again (a plugin may be there)
        assert len(calls) == 2
    finally:
        registry._installed.cache_clear()


def test_checking_the_default_pipeline_imports_no_http_client_or_torch() -> None:
    code = (
        "import sys\n"
        "from pipeline.cli import main\n"
        "assert main(['validate', 'configs/default.yaml']) == 0\n"
        "print(sorted(m for m in ('aiohttp', 'torch', 'transformers') if m in sys.modules))\n"
    )
    assert python_lines(code)[-1] == "[]"


def test_a_stage_process_does_not_import_the_pipeline_loader() -> None:
    """A stage process builds its section from its spec: the loader, its checks and the
    trackers stay out of it; the names of ``pipeline.config`` still resolve when asked for."""
    code = (
        "import sys\n"
        "import pipeline.host, pipeline.actor\n"
        "print(sorted(m for m in ('pipeline.config.loader', 'pipeline.tracking') "
        "if m in sys.modules))\n"
        "from pipeline.config import STAGE_KEYS, ConfigError, dump_yaml, load_pipeline\n"
        "print(callable(load_pipeline) and callable(dump_yaml) and 'use' in STAGE_KEYS)\n"
    )
    assert python_lines(code)[-2:] == ["[]", "True"]
