"""What the benches that drive a built-in engine share: a random ~22M-parameter Qwen2-style model
and the engine started as a real server process on a free loopback port.

Import it as ``bench._engines`` once the repository root is on ``sys.path`` (the benches put it
there when run as scripts). It does not measure anything itself.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from stages.engine.identity import ENGINE_ID_ENV, answered_by_another, new_engine_id

ROOT = Path(__file__).resolve().parents[1]
# DeepSpeed (which transformers loads when it is installed) says on stdout which accelerator it
# picked unless it is told; a bench prints exactly one JSON line there
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def make_model(
    path: Path,
    *,
    vocab: int = 32000,
    max_positions: int = 2048,
    hidden: int = 384,
    layers: int = 6,
    tied: bool = True,
    family: str = "qwen2",
) -> int:
    """Save a random Qwen2-style model under ``path`` (by default hidden 384, 6 layers, 6 heads,
    2 KV heads, tied embeddings; a head per 64 of ``hidden``, a KV head per 3 or 4 heads, an
    MLP of about 2.7x; seeded); returns its parameter count. ``family="qwen3_5"``: Qwen3.5's
    layout on the same sizes, three gated-delta-net (linear-attention) layers for each
    full-attention one (a key head per 192 of ``hidden``, two value heads a key head, 64
    wide). ``family="qwen3_moe"``: Qwen3-MoE's layout on the same sizes, every layer's MLP 8
    experts of a quarter of the MLP's width, 2 a token. ``family="deepseek_v3"``: DeepSeek-V3's
    layout on the same sizes, multi-head latent attention (a latent of a third of ``hidden``, one
    q projection) and, after a dense first layer, 8 routed experts (2 a token) and a shared one."""
    heads = max(1, hidden // 64)
    kv_heads = heads // 3 if heads % 3 == 0 else heads // 4 if heads % 4 == 0 else heads
    make = Qwen2Config
    extra: dict[str, Any] = {}
    if family == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        make = Qwen3_5TextConfig
        linear_heads = max(1, hidden // 192)
        extra = {
            "head_dim": 64,
            "linear_num_key_heads": linear_heads,
            "linear_num_value_heads": 2 * linear_heads,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "layer_types": [
                "full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)
            ],
        }
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        make = Qwen3MoeConfig
        extra = {
            "head_dim": 64,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": hidden * 2 // 3,
        }
    elif family == "deepseek_v3":
        from transformers import DeepseekV3Config

        make = DeepseekV3Config
        extra = {
            "q_lora_rank": None,  # (V2-Lite's and Moonlight's one q projection)
            "kv_lora_rank": hidden // 3,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": hidden * 2 // 3,
        }
        kv_heads = heads  # (latent attention: one latent for every head)
    elif family != "qwen2":
        raise ValueError(
            f"family: 'qwen2', 'qwen3_5', 'qwen3_moe' or 'deepseek_v3', got {family!r}"
        )
    config = make(
        **extra,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of a bench's paired rounds, as its JSON line reports them."""
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(
    url: str, proc: subprocess.Popen[bytes], timeout: float = 120, engine_id: str | None = None
) -> None:
    """Return once ``url/health`` answers 200 (from the engine started with ``engine_id`` in
    its ``INFLIGHT_ENGINE_ID``, when given: another process's engine that took the port is
    not taken for it, ``stages/engine/identity.py``); raise if ``proc`` exits first or time
    runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("engine exited before it was healthy (its port may be taken)")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200 and not (
                    engine_id and answered_by_another(resp.headers, engine_id)
                ):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("engine did not become healthy")


@contextmanager
def engine_server(
    model: Path,
    *flags: str,
    module: Sequence[str] = ("stages.engine.server",),
    env: Mapping[str, str] | None = None,
    output: IO[bytes] | None = None,
    root: Path = ROOT,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``python -m MODULE --model MODEL --port PORT FLAGS`` from the repository root (or
    ``root``: another checkout's, to compare its code) and yield its URL and process once it
    is healthy; terminate it on the way out.

    ``env`` is added to this process's environment (with the root on ``PYTHONPATH``); the
    engine's stdout and stderr go to ``output``, else nowhere.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", *module, "--model", str(model), "--port", str(port), *flags]
    engine_id = new_engine_id()
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), **(env or {}), ENGINE_ID_ENV: engine_id},
        stdout=subprocess.DEVNULL if output is None else output,
        stderr=subprocess.DEVNULL if output is None else subprocess.STDOUT,
    )
    try:
        wait_health(url, proc, engine_id=engine_id)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(30)
