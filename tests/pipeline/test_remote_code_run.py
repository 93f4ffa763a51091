"""``run.trust_remote_code`` through a real ``inflight run``: the default task on a copy of its
model whose config and model classes are the folder's own code (``auto_map``). With the key,
every stage that loads the folder runs that code (the learner's transformers load, the engine
its generator launches with SGLang's ``--trust-remote-code``) and the run trains; without it,
the run is refused at load, each key naming the folder and how to allow it, instead of a
stage failing once started (or transformers asking on a terminal nobody sees).
"""

from __future__ import annotations

import pytest

from tests.pipeline.runs import REPO, events, run_inflight
from tests.stages.tiny_model import with_own_code

STEPS = 4


def _on(model: str) -> list[str]:
    return [
        f"stages.feeder.source.tokenizer={model}",
        f"stages.generator.launch.model={model}",
        f"stages.scorer.tokenizer={model}",
        f"stages.learner.model={model}",
        f"stages.learner.eval.source.tokenizer={model}",
        f"stages.learner.steps={STEPS}",
        "stages.learner.eval.max_prompts=20",
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_model_with_its_own_code_trains_when_the_run_trusts_it(tmp_path):
    model = str(with_own_code(REPO / "configs" / "models" / "arith-tiny", tmp_path / "custom"))
    config = str(REPO / "configs" / "default.yaml")
    run_dir = tmp_path / "trusted"
    done = run_inflight(
        "run", config, *_on(model), "run.trust_remote_code=true", "--run-dir", str(run_dir),
        "-q", timeout=200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [e for e in events(run_dir, "learner.0") if e["event"] == "train_step"]
    assert len(steps) == STEPS
    launched = [e for e in events(run_dir, "generator.0") if e["event"] == "engine_launched"]
    assert launched and "--trust-remote-code" in launched[0]["options"]

    refused = run_inflight(
        "run", config, *_on(model), "--run-dir", str(tmp_path / "untrusted"), "-q", timeout=200
    )
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "set run.trust_remote_code: true" in said
    assert "stages.learner.model" in said and "Traceback" not in said
