"""``bench/stream_chunks.py`` drives the routes' streaming code with a stand-in scheduler, which
has to expose what the routes read of the real one: a field the routes start reading breaks the
bench, not the tests (it did, unnoticed, for five fields). One short run keeps them together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_stream_bench_runs_every_form_through_the_routes() -> None:
    done = subprocess.run(
        [sys.executable, "bench/stream_chunks.py", "--repeats", "1", "--rounds", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    forms = result["cpu_us_per_request"]
    assert set(forms) == {
        "generate",
        "generate-stream",
        "completions",
        "completions-stream",
        "chat",
        "chat-stream",
    }
    assert all(form["median"] > 0 for form in forms.values())
