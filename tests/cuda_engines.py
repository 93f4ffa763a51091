"""A pytest plugin for a machine with a GPU: every engine a test starts runs on CUDA.

    pytest -p tests.cuda_engines tests/stages/test_engine_server.py ...

It adds ``--device cuda`` to ``tests.stages.engine_setup.engine_command``, which every test
that starts ``inflight engine`` goes through, and sets ``engine_setup.ENGINE_DEVICE`` for the
tests that compute a device's own answer (a weight's digest is of its bytes on a CPU and of its
32-bit words on a GPU). (``INFLIGHT_SGLANG_BACKEND=gloo`` for
``test_generator_sglang.py``'s weight-group test on one GPU: NCCL cannot join two processes on
one device.)"""

from __future__ import annotations

from pathlib import Path

import tests.stages.engine_setup as engine_setup

_command = engine_setup.engine_command


def _on_cuda(model: Path | str, *more: str) -> list[str]:
    return _command(model, *more, "--device", "cuda")


engine_setup.engine_command = _on_cuda
engine_setup.ENGINE_DEVICE = "cuda"
