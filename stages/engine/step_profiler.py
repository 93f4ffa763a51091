"""SGLang's ``/start_profile`` and ``/stop_profile`` on the built-in engine: a torch profiler
around the scheduler's steps, its trace written as SGLang writes it.

As SGLang 0.5.23 profiles (``scheduler_components/profiler_manager.py``,
``tokenizer_control_mixin.start_profile``): ``activities`` ``CPU`` and ``GPU`` (the default
both; ``GPU`` only where the engine runs on CUDA), ``MEM`` (CUDA's allocator history, a
``.pickle`` snapshot) and ``CUDA_PROFILER`` (``cudaProfilerStart``, for Nsight) on CUDA only;
``with_stack`` and ``record_shapes`` on unless false (or ``SGLANG_PROFILE_WITH_STACK`` /
``SGLANG_PROFILE_RECORD_SHAPES`` say false); ``start_step``: from that decode step on;
``num_steps``: stop by itself after that many, else at ``/stop_profile``. The trace is
``OUTPUT_DIR/[PREFIX-]PROFILE_ID-TP-0.trace.json.gz`` (``output_dir`` else
``SGLANG_TORCH_PROFILER_DIR`` else ``/tmp``; ``profile_id`` else the start's Unix time), a
Chrome trace (``chrome://tracing``, Perfetto). A second start while one runs, or a stop with
none running: ``ProfileError`` with SGLang's words (a profile still waiting for its
``start_step`` is not running: a start replaces it, a stop is refused and leaves it armed).
Steps here are the scheduler's decode steps (a prefill pass runs inside the step that admits
it).

The profiler starts, stops and writes on the scheduler thread (``Scheduler.start_profile``),
between two steps, so that it sees the model's passes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

__all__ = ["ACTIVITIES", "ProfileError", "ProfileRequest", "StepProfiler", "profile_request"]

log = structlog.get_logger("stages.engine.step_profiler")

ACTIVITIES = ("CPU", "GPU", "MEM", "CUDA_PROFILER")
_CUDA_ONLY = ("MEM", "CUDA_PROFILER")


class ProfileError(ValueError):
    """A profile that cannot start or stop: SGLang's message."""


@dataclass
class ProfileRequest:
    """What ``/start_profile`` asked for, checked."""

    output_dir: Path = field(
        default_factory=lambda: Path(os.getenv("SGLANG_TORCH_PROFILER_DIR", "/tmp"))
    )
    activities: tuple[str, ...] = ("CPU", "GPU")
    start_step: int | None = None
    num_steps: int | None = None
    with_stack: bool = True
    record_shapes: bool = True
    profile_id: str = ""
    profile_prefix: str = ""


class StepProfiler:
    """One profile at a time; ``tick`` after every decode step (cheap while none is armed)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.request: ProfileRequest | None = None  # armed: started, or waiting for its step
        self._profiler: Any = None
        self._begun = self._mem = self._cuda_profiler = False
        self._stop_at: int | None = None

    @property
    def armed(self) -> bool:
        return self.request is not None

    def start(self, request: ProfileRequest, steps: int) -> None:
        """Arm ``request`` (``steps``: the decode steps run so far); it starts now unless it
        waits for ``start_step``."""
        if self._begun:  # one waiting for its start_step is replaced, as SGLang's is
            raise ProfileError("Profiling is already in progress. Call /stop_profile first.")
        cuda = self.device.type == "cuda"
        for name in request.activities:
            if name in _CUDA_ONLY and not cuda:
                raise ProfileError(f"activities: {name} needs the engine on a CUDA device")
        first = steps if request.start_step is None else max(request.start_step, steps + 1)
        self._stop_at = None if request.num_steps is None else first + request.num_steps
        self.request = request
        if request.start_step is None or first <= steps:
            self._begin()

    def tick(self, steps: int) -> str | None:
        """After a decode step: start a profile waiting for this step, or end one whose
        ``num_steps`` ran (its trace's path)."""
        request = self.request
        if request is None:
            return None
        if not self._begun:
            if request.start_step is not None and steps >= request.start_step:
                self._begin()
            return None
        if self._stop_at is not None and steps >= self._stop_at:
            return self.stop()
        return None

    def stop(self) -> str:
        """End the profile and write its trace; the trace's path (none written: "")."""
        request = self.request
        if request is None or not self._begun:  # one waiting for its step stays armed
            raise ProfileError("Profiling is not in progress. Call /start_profile first.")
        self.request, self._begun = None, False
        request.output_dir.mkdir(parents=True, exist_ok=True)
        prefix = f"{request.profile_prefix}-" if request.profile_prefix else ""
        path = ""
        if self._profiler is not None:
            self._profiler.stop()
            path = str(request.output_dir / f"{prefix}{request.profile_id}-TP-0.trace.json.gz")
            self._profiler.export_chrome_trace(path)
            self._profiler = None
        if self._mem:
            name = f"{prefix}{time.time()}-TP-0-memory.pickle"
            torch.cuda.memory._dump_snapshot(str(request.output_dir / name))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._mem = False
        if self._cuda_profiler:
            torch.cuda.cudart().cudaProfilerStop()
            self._cuda_profiler = False
        log.info("profile_written", path=path or str(request.output_dir))
        return path

    def _begin(self) -> None:
        request = self.request
        assert request is not None
        self._begun = True
        kinds = [torch.profiler.ProfilerActivity.CPU] if "CPU" in request.activities else []
        if "GPU" in request.activities and self.device.type == "cuda":
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        if kinds:
            self._profiler = torch.profiler.profile(
                activities=kinds,
                with_stack=request.with_stack,
                record_shapes=request.record_shapes,
            )
            self._profiler.start()
        if "MEM" in request.activities:
            torch.cuda.memory._record_memory_history()
            self._mem = True
        if "CUDA_PROFILER" in request.activities:
            torch.cuda.cudart().cudaProfilerStart()
            self._cuda_profiler = True
        log.info("profile_started", output_dir=str(request.output_dir), id=request.profile_id)


def profile_request(body: dict[str, Any]) -> ProfileRequest:
    """``/start_profile``'s body (SGLang's ``ProfileReq``) checked: ProfileError naming the
    field for a value of the wrong type or one this engine cannot honour."""

    def typed(name: str, kind: type) -> Any:
        value = body.get(name)
        wrong = not isinstance(value, kind) or isinstance(value, bool) != (kind is bool)
        if value is not None and wrong:
            raise ProfileError(f"{name}: expected {kind.__name__}, got {value!r}")
        return value

    activities = body.get("activities")
    if activities is not None:
        if not isinstance(activities, list) or not all(isinstance(a, str) for a in activities):
            raise ProfileError(f"activities: expected a list of {list(ACTIVITIES)}")
        unknown = [a for a in activities if a not in ACTIVITIES]
        if unknown:
            raise ProfileError(f"activities: {unknown[0]!r} is not one of {list(ACTIVITIES)}")
    for name in ("start_step", "num_steps"):
        value = typed(name, int)
        if value is not None and value < (0 if name == "start_step" else 1):
            raise ProfileError(f"{name}: must be >= {0 if name == 'start_step' else 1}")
    for name in ("profile_by_stage", "detailed_annotations"):  # SGLang's, not here
        if typed(name, bool):
            raise ProfileError(f"{name}: not supported by the built-in engine")
    if body.get("profile_stages") is not None:
        raise ProfileError("profile_stages: not supported by the built-in engine")
    typed("merge_profiles", bool)  # one rank: nothing to merge
    request = ProfileRequest(
        activities=tuple(activities) if activities else ("CPU", "GPU"),
        start_step=typed("start_step", int) or None,
        num_steps=typed("num_steps", int),
        with_stack=typed("with_stack", bool) is not False
        and os.getenv("SGLANG_PROFILE_WITH_STACK", "true").lower() not in ("0", "false"),
        record_shapes=typed("record_shapes", bool) is not False
        and os.getenv("SGLANG_PROFILE_RECORD_SHAPES", "true").lower() not in ("0", "false"),
        profile_id=typed("profile_id", str) or str(time.time()),
        profile_prefix=typed("profile_prefix", str) or "",
    )
    output_dir = typed("output_dir", str)
    if output_dir:
        request.output_dir = Path(output_dir).expanduser()
    return request
