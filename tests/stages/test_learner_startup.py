"""The learner compiles no DeepSpeed C++ op it does not need, and says so before any it does.

A learner start in a fresh process with an empty ``TORCH_EXTENSIONS_DIR`` must build nothing
(DeepSpeed's communication backend would otherwise JIT-compile ``deepspeed_shm_comm``, about a
minute on a laptop, for an op training never calls) and must not probe every op either. A build
that does happen is announced with a warning naming the op, why and where it is cached, before
the compiler starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from tests.stages.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]

_START = r"""
import json, sys
import structlog
from structlog.testing import capture_logs
from stages.learner.config import LearnerConfig
from stages.learner.trainer import Trainer

with capture_logs() as logs:
    trainer = Trainer(LearnerConfig(model=sys.argv[1]), structlog.get_logger())
    trainer.setup()
import deepspeed.ops
table = dict(vars(deepspeed.ops)["__compatible_ops__"])
mlflow_at_start = "mlflow" in sys.modules
import importlib.util
installed = importlib.util.find_spec("mlflow") is not None
trainer.close()
print(json.dumps({"events": [e["event"] for e in logs], "probed": table,
                  "mlflow_at_start": mlflow_at_start, "mlflow_installed": installed}))
"""


@pytest.mark.timeout(120)
def test_a_learner_start_compiles_nothing(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model")
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, "-c", _START, str(model)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(extensions.iterdir()) == []  # nothing built, nothing cached
    assert "deepspeed_ready" in out["events"]
    assert "deepspeed_op_build" not in out["events"]
    # shm marked off, and no probe of every op (compiler subprocesses) ran
    assert out["probed"] == {"deepspeed_shm_comm": False}
    # DeepSpeed's autotuner did not import mlflow (2 s), which still imports when asked for
    assert out["mlflow_at_start"] is False and out["mlflow_installed"] is True


def test_the_compatibility_table_probes_one_op_when_asked() -> None:
    from stages.learner.trainer import _OpCompatibility

    table = _OpCompatibility()
    table["deepspeed_shm_comm"] = False
    assert table.get("deepspeed_shm_comm", True) is False
    assert table.get("no_such_op") is False
    assert isinstance(table.get("cpu_adam"), bool)  # probed now, with DeepSpeed's own probe
    assert set(table) == {"deepspeed_shm_comm", "no_such_op", "cpu_adam"}


def test_an_op_build_is_announced_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deepspeed.ops.op_builder.builder import OpBuilder

    from stages.learner.trainer import announce_deepspeed_op_builds

    class Unbuildable(OpBuilder):  # fails in DeepSpeed's jit_load before any compiler runs
        NAME = "cpu_adam"

        def __init__(self) -> None:
            super().__init__(name=self.NAME)

        def absolute_name(self) -> str:
            return "tests.unbuildable"

        def sources(self) -> list[str]:
            return []

        def is_compatible(self, verbose: bool = False) -> bool:
            return False

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    announce_deepspeed_op_builds()
    announce_deepspeed_op_builds()  # idempotent: one warning per build, not two
    with structlog.testing.capture_logs() as logs, pytest.raises(RuntimeError, match="JIT"):
        Unbuildable().jit_load()
    builds = [e for e in logs if e["event"] == "deepspeed_op_build"]
    assert len(builds) == 1
    assert builds[0]["log_level"] == "warning"
    assert builds[0]["op"] == "cpu_adam"
    assert "ZeRO-Offload" in builds[0]["why"]
    assert builds[0]["cache"] == str(tmp_path / "cpu_adam")
    assert builds[0]["cached"] is False


def test_extension_dir_is_torch_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.cpp_extension import _get_build_directory, get_default_build_root

    from stages.learner.trainer import extension_dir

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert str(extension_dir("some_op")) == _get_build_directory("some_op", verbose=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    default = extension_dir("some_op")  # per user and machine, shared by every venv
    assert default.parent.parent == Path(get_default_build_root())
    assert default.parent.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}")
