"""SGLang's own frontend language (``sgl.function`` programs on ``sgl.RuntimeEndpoint``) against
the built-in engine: the client SGLang ships for its native API (``lang/backend/
runtime_endpoint.py``) generates, selects among choices by prompt log-probs, constrains with a
regex and a type, streams, forks and batches on it as on a SGLang server.

(``select``'s other ``choices_method``s, ``greedy_token_selection`` and
``unconditional_likelihood_normalized``, fail against a SGLang 0.5.23 server itself: the first
input log-prob at a ``logprob_start_len`` is null there, and ``-1`` returns none; the engine
answers both as that server does, so they fail here alike.)

Skipped unless SGLang's ``sglang.lang`` imports (SGLang's own environment with Inflight
installed, or its wheel's source: ``test_engine_sglang_shapes.py``'s docstring says how).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

sgl: Any = pytest.importorskip("sglang")
pytest.importorskip("sglang.lang.backend.runtime_endpoint")

from tests.stages.engine_setup import builtin_engine  # noqa: E402
from tests.stages.tiny_model import make_byte_model  # noqa: E402


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_byte_model(tmp_path_factory.mktemp("frontend") / "model")
    with builtin_engine(model) as url:
        endpoint = sgl.RuntimeEndpoint(url)
        assert endpoint.model_info["is_generation"] is True
        yield endpoint


@pytest.mark.timeout(120)
def test_programs_run_on_the_engine(backend: Any) -> None:
    @sgl.function
    def answer(s: Any, question: str) -> None:
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=8, temperature=0, stop="\n")

    state = answer.run(question="what is 2+2?", backend=backend)
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 8 and "\n" not in state["answer"]
    again = answer.run(question="what is 2+2?", backend=backend)
    assert again["answer"] == state["answer"]  # greedy
    streamed = answer.run(question="what is 2+2?", stream=True, backend=backend)
    assert "".join(streamed.text_iter("answer")) == state["answer"]
    batch = answer.run_batch([{"question": "a"}, {"question": "b"}], backend=backend)
    assert len(batch) == 2 and all(isinstance(b["answer"], str) for b in batch)

    @sgl.function
    def pick(s: Any) -> None:
        s += "The color is"
        s += sgl.select("color", choices=[" red", " blue", " green"])

    picked = pick.run(backend=backend)
    scores = picked.get_meta_info("color")["normalized_prompt_logprobs"]
    best = [" red", " blue", " green"][max(range(3), key=scores.__getitem__)]
    assert picked["color"] == best  # the choice with the highest mean prompt log-prob

    @sgl.function
    def typed(s: Any) -> None:
        s += "Number: "
        s += sgl.gen("digits", max_tokens=6, regex=r"[0-9]+")
        s += " int: "
        s += sgl.gen("integer", max_tokens=5, dtype=int)

    numbers = typed.run(backend=backend)
    assert numbers["digits"].isdigit()
    assert numbers["integer"].lstrip("-").isdigit()

    @sgl.function
    def forked(s: Any) -> None:
        s += "Ideas:"
        branches = s.fork(3)
        branches += sgl.gen("idea", max_tokens=4, temperature=1.0)
        branches.join()

    assert forked.run(backend=backend).text().startswith("Ideas:")

    @sgl.function
    def scored(s: Any) -> None:
        s += "Hello"
        s += sgl.gen("g", max_tokens=3, return_logprob=True, top_logprobs_num=2,
                     return_text_in_logprobs=True, logprob_start_len=0)  # fmt: skip

    meta = scored.run(backend=backend).get_meta_info("g")
    assert len(meta["output_token_logprobs"]) == 3 and len(meta["output_top_logprobs"][0]) == 2
    assert meta["input_token_logprobs"][0][0] is None  # the prompt's first token has none
