"""Set-up shared by the built-in engine's tests: the reference models the scheduler is checked
against, and a real engine server process on a free loopback port.

Plain functions: a test module's fixtures call them (no conftest, no plugin).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.stages.tiny_model import make_tiny_model
from transport.address import rendezvous_port

ROOT = Path(__file__).resolve().parents[2]


def load_reference(path: Path, attn: str = "sdpa") -> torch.nn.Module:
    """The saved model in float32 and eval mode, without an EOS (``generate`` runs its full
    length), as the reference the engine's outputs are compared with."""
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn
    ).eval()
    model.generation_config.eos_token_id = None
    return model


def two_tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny models of the same shape with different weights (seeds 1 and 2): the weights
    before and after an update."""
    root = tmp_path_factory.mktemp("models")
    return make_tiny_model(root / "a", seed=1), make_tiny_model(root / "b", seed=2)


def free_port() -> int:
    return rendezvous_port()  # below the ephemeral range: not taken before it is bound


def engine_command(model: Path, *more: str) -> list[str]:
    """``inflight engine --model MODEL MORE`` as this interpreter runs it."""
    return [sys.executable, "-m", "pipeline.cli", "engine", "--model", str(model), *more]


@contextmanager
def builtin_engine(
    model: Path,
    *flags: str,
    env: Mapping[str, str] | None = None,
    output: Path | None = None,
    up_within: float = 60,
    stop_within: float = 15,
) -> Iterator[str]:
    """A built-in engine server on ``model`` (one torch thread, ``env`` added to this process's
    environment), listening on a free loopback port: yields its URL once ``/health`` answers 200,
    or fails the test after ``up_within`` seconds (with the tail of ``output``, where its stdout
    and stderr go; else nowhere). Terminated, then killed, on the way out."""
    port = free_port()
    out = open(output, "wb") if output is not None else subprocess.DEVNULL
    proc = subprocess.Popen(
        engine_command(model, "--port", str(port), *flags),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=out,
        stderr=subprocess.DEVNULL if output is None else subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + up_within
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "" if output is None else f": {output.read_text()[-2000:]}"
                pytest.fail(f"engine did not come up{tail}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_within)
        finally:
            proc.kill()
            if output is not None:
                out.close()
