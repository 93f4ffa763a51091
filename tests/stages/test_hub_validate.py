"""`inflight validate` (``load_pipeline``) checks every model and tokenizer a pipeline names
before anything starts: a missing folder, a folder without a config or tokenizer, an unknown Hub
id or revision is an issue at its key with its ``file:line``; a good Hub id is pinned to its
commit in the resolved config. Offline, with the repos written into a Hub-layout cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_pipeline
from pipeline.registry import resolve
from stages.feeder.arithmetic import make_tokenizer
from tests.stages.hub_cache import offline, save_to_hub_cache
from tests.stages.tiny_model import make_tiny_model

MAIN = "d" * 40

PIPELINE = """\
stages:
  feeder:
    use: feeder
    source: {{kind: arithmetic, tokenizer: {feeder_tok}}}
  generator:
    use: generator
    inputs: {{prompts: feeder.prompts}}
    launch: {{kind: builtin, model: {engine_model}}}
  scorer:
    use: scorer
    inputs: {{rollouts: generator.rollouts}}
    rewards: [{{fn: exact_match}}]
    tokenizer: {scorer_tok}
  learner:
    use: learner
    inputs: {{groups: scorer.groups}}
    model: {learner_model}
"""


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = offline(monkeypatch, tmp_path / "hf")
    model = make_tiny_model(tmp_path / "tiny", vocab=32)
    save_to_hub_cache(model, cache, "org/tiny", MAIN)
    make_tokenizer().save_pretrained(tmp_path / "tok")
    save_to_hub_cache(tmp_path / "tok", cache, "org/tok", MAIN)
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "README.md").write_text("hi")
    return cache


def load(tmp_path: Path, **values: str):
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.format(**values))
    return load_pipeline(path, resolve=lambda name: resolve("stage", name))


def test_hub_ids_are_valid_and_pinned_to_their_commit(hub: Path, tmp_path: Path) -> None:
    loaded = load(
        tmp_path,
        feeder_tok="org/tok",
        engine_model="org/tiny@main",
        scorer_tok=str(tmp_path / "tiny"),
        learner_model="org/tiny",
    )
    stages = loaded.config.stages
    assert stages["learner"].options.model == f"org/tiny@{MAIN}"
    assert stages["generator"].options.launch.model == f"org/tiny@{MAIN}"
    assert stages["feeder"].options.source.tokenizer == f"org/tok@{MAIN}"
    assert stages["scorer"].options.tokenizer == str(tmp_path / "tiny")  # a folder: as given
    assert loaded.resolved()["stages"]["learner"]["model"] == f"org/tiny@{MAIN}"


def test_every_bad_model_is_reported_at_its_key_and_line(hub: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(
            tmp_path,
            feeder_tok="org/tiny@v2",  # a revision the cache does not have
            engine_model="./missing-model",  # a path that does not exist
            scorer_tok="not-a-model",  # a folder without tokenizer files
            learner_model="org/nope",  # an id that is not cached (offline)
        )
    issues = {i.path: i for i in info.value.issues}
    file = str(tmp_path / "pipeline.yaml")
    expected = {
        "stages.feeder.source.tokenizer": (4, "not at revision 'v2'"),
        "stages.generator.launch.model": (8, "no folder /"),
        "stages.scorer.tokenizer": (13, "no tokenizer files"),
        "stages.learner.model": (17, "'org/nope': not in the cache"),
    }
    assert set(issues) == set(expected)
    for key, (line, text) in expected.items():
        assert issues[key].where.startswith(f"{file}:{line}"), issues[key]
        assert text in issues[key].message, issues[key]
