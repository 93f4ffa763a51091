"""Set-up shared by the built-in engine's tests: the reference models the scheduler is checked
against, and a real engine server process on a free loopback port.

Plain functions: a test module's fixtures call them (no conftest, no plugin).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.engine.identity import ENGINE_ID_ENV, answered_by_another, new_engine_id
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


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy ``n`` tokens after ``prompt`` (a reference the engine must match)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def experts_routing(reference: torch.nn.Module, ids: Sequence[int]) -> dict[int, torch.Tensor]:
    """transformers' routing of ``ids`` in one pass of a mixture-of-experts ``reference``: the
    ``top_k_index`` ``[len(ids), k]`` each layer's experts module was called with, by layer
    (layers without experts absent)."""
    taken: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(
            lambda _m, args, i=i: taken.__setitem__(i, args[1].clone())
        )
        for i, layer in enumerate(reference.model.layers)
        if hasattr(layer.mlp, "experts")
    ]
    try:
        reference(torch.tensor([list(ids)]))
    finally:
        for hook in hooks:
            hook.remove()
    return taken


def post_json(url: str, body: dict) -> Any:
    """The JSON answer of ``POST url`` with ``body`` (an HTTP error raises)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@torch.no_grad()
def classifier_reference(model_dir: Path, prompt: list[int]) -> tuple[list[float], float]:
    """transformers' outputs of the classification model at ``model_dir`` for ``prompt`` alone,
    and the scale of their rounding: the largest sum of ``|weight * hidden|`` the head adds up
    (a dot product's rounding grows with its terms, not with its result, which may cancel)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    hidden = model.base_model(torch.tensor([prompt])).last_hidden_state[0, -1]
    scale = float((model.score.weight.abs() @ hidden.abs()).max())
    return model.score(hidden).tolist(), scale


def two_tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny models of the same shape with different weights (seeds 1 and 2): the weights
    before and after an update."""
    root = tmp_path_factory.mktemp("models")
    return make_tiny_model(root / "a", seed=1), make_tiny_model(root / "b", seed=2)


def sglang_text(
    tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int], skip: bool = True
) -> str:
    """The text SGLang 0.5 gives ``output_ids`` (under 50 tokens, so no commit on the way):
    decoded after the prompt's last 5 tokens, less those tokens' own text
    (``DetokenizerManager.handle_batch_token_id_out`` over the window that
    ``Req.init_incremental_detokenize`` starts, ``INIT_INCREMENTAL_DETOKENIZATION_OFFSET``)."""
    context = list(prompt_ids[-5:])
    before = tokenizer.decode(context, skip_special_tokens=skip)
    return tokenizer.decode(context + list(output_ids), skip_special_tokens=skip)[len(before) :]


def run_with_retraction(scheduler: Any, steps: int, retract: bool) -> None:
    """``steps`` decode steps, then (with ``retract``) a retraction of everything running and
    the resume that re-admits it, then the scheduler run until idle."""
    for _ in range(steps):
        scheduler.step()
    if retract:
        scheduler.pause("retract")
        scheduler.step()
        scheduler.resume()
    scheduler.run_until_idle()


def pass_through_template(folder: Path) -> Path:
    """A chat template that renders the messages' contents alone, each followed by a space,
    written to ``folder``: for a test that sends chat requests to a tiny model and reads no
    format; returns its path (the engine's ``--chat-template``)."""
    template = folder / "chat_template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    return template


def free_port() -> int:
    return rendezvous_port()  # below the ephemeral range: not taken before it is bound


# the device the engines tests start run on (``tests.cuda_engines`` makes it "cuda"): where a
# test computes what an engine's device-dependent answer must be (a weight digest)
ENGINE_DEVICE = "cpu"


def engine_command(model: Path | str, *more: str) -> list[str]:
    """``inflight engine --model MODEL MORE`` as this interpreter runs it."""
    return [sys.executable, "-m", "pipeline.cli", "engine", "--model", str(model), *more]


class EngineProcess:
    """A built-in engine server process on ``model`` (``flags`` added to its command line; one
    torch thread and ``env`` added to this process's environment), on a free loopback port.

    Its stdout and stderr go to ``output`` (else nowhere); ``tail`` says where to read what it
    said when it fails (default: ``output``). Started at once; ``wait_up`` waits for it."""

    def __init__(
        self,
        model: Path | str,
        *flags: str,
        env: Mapping[str, str] | None = None,
        output: Path | None = None,
        tail: Path | None = None,
    ) -> None:
        self._argv = engine_command(model, *flags)
        self._env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        self._output = output
        self._tail = tail if tail is not None else output
        self._spawn()

    def _spawn(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_id = new_engine_id()
        out = open(self._output, "ab") if self._output is not None else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [*self._argv, "--port", str(self.port)],
                cwd=ROOT,
                env={**self._env, ENGINE_ID_ENV: self.engine_id},
                stdout=out,
                stderr=subprocess.DEVNULL if self._output is None else subprocess.STDOUT,
            )
        finally:
            if self._output is not None:
                out.close()

    def tail(self) -> str:
        path = self._tail
        return path.read_text()[-3000:] if path is not None and path.exists() else "(no output)"

    def wait_up(self, within: float = 60) -> str:
        """Its URL once its ``/health`` answers 200; fails the test after ``within`` seconds or
        when it exits. A port some other engine took before this one bound it (the other's
        ``/health`` names another id) is left for a new one, up to twice."""
        deadline = time.monotonic() + within
        for _ in range(3):
            taken = False
            while True:
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                        taken = answered_by_another(resp.headers, self.engine_id)
                        if resp.status == 200 and not taken:
                            return self.url
                except urllib.error.HTTPError as exc:
                    taken = answered_by_another(exc.headers, self.engine_id)
                except OSError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if not (taken and self.proc.poll() is not None and time.monotonic() < deadline):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.stop(5)
                pytest.fail(f"engine did not come up on {self.url}:\n{self.tail()}")
            self._spawn()
        pytest.fail(f"no free port for the engine:\n{self.tail()}")

    def stop(self, within: float = 15) -> int:
        """Terminate it; its exit code (``subprocess.TimeoutExpired`` after ``within``
        seconds, and then it is killed)."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=within)
        finally:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def builtin_engine(
    model: Path,
    *flags: str,
    env: Mapping[str, str] | None = None,
    output: Path | None = None,
    up_within: float = 60,
    stop_within: float = 15,
) -> Iterator[str]:
    """An ``EngineProcess``'s URL once it answers (the test fails after ``up_within`` seconds),
    terminated, then killed, on the way out."""
    engine = EngineProcess(model, *flags, env=env, output=output)
    try:
        yield engine.wait_up(up_within)
    finally:
        engine.stop(stop_within)


def recorded_calls(client: Any) -> list[tuple[str, Any]]:
    """The paths and bodies of an ``EngineClient``'s calls from now on, as they go out."""
    sent: list[tuple[str, Any]] = []
    call = client._call

    async def recorded(method: str, path: str, payload: Any = None, **kw: Any) -> Any:
        sent.append((path, payload))
        return await call(method, path, payload, **kw)

    client._call = recorded
    return sent
