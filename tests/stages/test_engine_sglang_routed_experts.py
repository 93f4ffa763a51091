"""Routed experts held to SGLang 0.5.23's source: the refusals of ``routed_experts_start_len``
are its scheduler's own f-strings (``Scheduler.handle_generate_request``), evaluated here on
the same values; ``sglext`` has its fields in ``SglExt``'s order, as SGLang writes it.

Runs where SGLang's source is importable (``test_engine_sglang_shapes.py``'s docstring says how);
skipped elsewhere.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

protocol: Any = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")

from stages.engine.openai_api import response_sglext  # noqa: E402
from stages.engine.routed_experts import start_error  # noqa: E402


def _scheduler_messages() -> list[ast.JoinedStr]:
    """The f-strings of the ``if recv_req.return_routed_experts:`` block of SGLang's
    ``managers/scheduler.py``, in their order (below 0, then past the prompt)."""
    spec = importlib.util.find_spec("sglang.srt.managers")
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations)), "scheduler.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "recv_req.return_routed_experts":
            found = [n for n in ast.walk(node) if isinstance(n, ast.JoinedStr)]
            assert len(found) == 2
            return found
    raise AssertionError("SGLang's scheduler checks no routed_experts_start_len")


@pytest.mark.parametrize(("start", "prompt"), [(-1, 3), (-7, 0), (4, 3), (513, 512)])
def test_the_refusals_are_sglangs_own_words(start: int, prompt: int) -> None:
    low, high = _scheduler_messages()
    names = {
        "recv_req": SimpleNamespace(routed_experts_start_len=start),
        "req": SimpleNamespace(origin_input_ids=[0] * prompt),
    }

    def render(message: ast.JoinedStr) -> str:
        return eval(compile(ast.Expression(message), "scheduler.py", "eval"), {}, names)

    # SGLang's second check overrides the first (none can hold both)
    want = render(high) if start > prompt else render(low)
    assert start_error(start, prompt) == want


def test_a_start_within_the_prompt_is_taken() -> None:
    assert start_error(0, 0) is None and start_error(3, 3) is None


def test_sglext_has_sglangs_field_order() -> None:
    first = {"routed_experts": "AAAA", "cached_tokens_details": {"device": 4, "host": 0}}
    options = {"routed_experts": True, "return_cached_tokens_details": True}
    ours = response_sglext(first, options)
    theirs = protocol.SglExt(
        routed_experts="AAAA", cached_tokens_details=protocol.CachedTokensDetails(device=4, host=0)
    ).model_dump()
    assert list(ours) == list(theirs)
    assert ours["routed_experts"] == theirs["routed_experts"]
