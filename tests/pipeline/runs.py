"""Helpers for tests that start ``inflight`` the way a user does: as a command, in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def python_lines(code: str, timeout: float = 120) -> list[str]:
    """What ``python -c CODE`` prints in a fresh interpreter at the repo root, line by line
    (what a process imports, seen from outside); fails the test if it exits non-zero."""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


def inflight_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *args]


def run_inflight(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``inflight ARGS`` to completion from the repo root; the timeout is a hard limit."""
    return subprocess.run(
        inflight_cmd(*args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def run_to_summary(config: str, run_dir: Path, *overrides: str, timeout: float) -> dict:
    """Run ``inflight run CONFIG OVERRIDES --run-dir RUN_DIR -q`` to completion (it must exit 0,
    else the test fails with its output's tails) and return the run's ``summary.json``."""
    result = run_inflight(
        "run", config, *overrides, "--run-dir", str(run_dir), "-q", timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def start_inflight(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        inflight_cmd(*args),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def events(run_dir: Path, name: str = "*") -> list[dict]:
    """Every JSON event of the run's log files matching ``name`` (a glob like ``power.*``).

    The files may still be written: a last line without its newline is one whose ``write`` this
    read caught half done, and is left for the next read (as ``LogTail`` does). Any other line that
    is not JSON fails the test."""
    found = []
    for path in sorted((run_dir / "logs").glob(f"{name}.jsonl")):
        try:
            text = path.read_text()
        except FileNotFoundError:  # removed between glob and read
            continue
        for line in text[: text.rfind("\n") + 1].splitlines():
            if line.strip():
                found.append(json.loads(line))
    return found


def wait_for(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    *,
    proc: subprocess.Popen | None = None,
    run_dir: Path | None = None,
) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``.

    With ``proc``, a run that exits first fails the test at once with its output's tail; with
    ``run_dir``, the failure says what each replica logged last (where a run got stuck)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(
                f"the run exited ({proc.returncode}) before {what}: {out[-3000:]}"
                + (run_state(run_dir) if run_dir else "")
            )
        time.sleep(0.05)
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what}" + (run_state(run_dir) if run_dir else "")
    )


def run_state(run_dir: Path, last: int = 12) -> str:
    """The supervisor's last events and each replica's last one: where a stuck run stands."""
    lines = []
    for path in sorted((run_dir / "logs").glob("*.jsonl")):
        found = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        keep = found[-last:] if path.stem == "supervisor" else found[-1:]
        for e in keep:
            extra = {k: v for k, v in e.items() if k in ("replica_name", "reason", "error", "code")}
            lines.append(f"{path.stem} {e.get('ts', '')} {e.get('event')} {extra}"[:400])
    return "\n  where the run stood:\n  " + "\n  ".join(lines or ["(no logs yet)"])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def spawned_pids(run_dir: Path) -> list[int]:
    return [e["pid"] for e in events(run_dir, "supervisor") if e["event"] == "replica_spawned"]


def kill_tree(proc: subprocess.Popen, pids: Sequence[int] = ()) -> None:
    """Clean up after a failed test: the supervisor and any replica it started."""
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for_four(run_dir: Path) -> None:
    """Until the example pipeline's four replicas have started."""
    wait_for(
        lambda: sum(e["event"] == "replica_started" for e in events(run_dir, "*.[0-9]")) == 4,
        timeout=45,
        what="all four replicas to start",
    )


def start_endless_example(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """The example pipeline with (practically) endless input, once all four replicas run."""
    proc = start_inflight(
        "run",
        "configs/example.yaml",
        "stages.numbers.count=100000000",
        "stages.power.delay_s=0.005",
        *overrides,
        "--run-dir",
        str(run_dir),
    )
    try:
        wait_for_four(run_dir)
    except BaseException:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
        raise
    return proc
