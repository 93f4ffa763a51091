"""``stages.hf``: the ``transformers`` names Inflight uses, resolved once for every thread; the
image processors only when a vision model asks for them (their import took 1.3 s of every
engine's start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.stages.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]

_TEXT_ENGINE = r"""
import sys
import stages.engine.server
from stages.engine.loader import load_model
loaded = load_model(sys.argv[1])
assert loaded.vision is None
print("transformers.image_processing_utils" in sys.modules)
"""


def _last_word(code: str, *args: str) -> str:
    """What ``python -c code args`` (a process of its own) printed last; it must succeed."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()[-1]


def test_a_text_models_engine_does_not_import_the_image_processors(tmp_path: Path) -> None:
    assert _last_word(_TEXT_ENGINE, str(make_tiny_model(tmp_path / "m"))) == "False"


_RACE = r"""
import sys, threading
import stages.hf

barrier = threading.Barrier(4)
seen = []

def resolve():
    barrier.wait()
    from stages.hf import AutoImageProcessor
    seen.append(AutoImageProcessor)

threads = [threading.Thread(target=resolve) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
import transformers
assert len(seen) == 4 and all(s is transformers.AutoImageProcessor for s in seen), seen
print(stages.hf.AutoImageProcessor.__name__)
"""


def test_the_image_processor_is_resolved_once_by_threads_that_ask_at_once() -> None:
    assert _last_word(_RACE) == "AutoImageProcessor"


def test_an_unknown_name_is_an_attribute_error() -> None:
    import stages.hf

    with pytest.raises(AttributeError, match="AutoNothing"):
        stages.hf.AutoNothing  # noqa: B018
