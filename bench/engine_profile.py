"""Where a decode step of the built-in engine goes: the model's own forward vs everything else.

Run (each prints one JSON line on stdout; on an otherwise idle machine):

    python bench/engine_profile.py step [--model arith|bench22m|moe|gpt-oss|phi3|glm4|pythia|
        gpt2|deepseek]
        [--forward fast|transformers] [--repetition-penalty R] [--frequency-penalty F]
        [--strict-thinking BUDGET]
    python bench/engine_profile.py http [--group-form batch|n|single|openai] [--stream]
        [--seconds 20] [--py-spy]
    python bench/engine_profile.py compare [--forms n,n-stream,openai,openai-stream,...]
        [--rounds 8] [--seconds 4] [--stream-interval 1] [--pin] [--against DIR] [--device cuda]
        [--event-loop-turns]

``step`` drives ``stages.engine.scheduler.Scheduler`` in this process (no HTTP) and compares,
per decode step at a batch of ``--batch`` rows:

- ``forward_ms``: a plain Hugging Face forward of one new token per row over a ``DynamicCache``
  of the same context lengths (no padding, nothing else), timed alone with the same threads;
- ``engine_forward_ms``: the engine's own decode pass (``LlamaForward.decode``, what a step
  runs instead of ``model(...)`` with ``--forward fast``, the default) on the same batch;
- ``steady_step_ms``: the engine's whole decode step on a full batch (building inputs, masks,
  cache bookkeeping, sampling with ``temperature`` 1, log-probs, finish checks, retiring the
  rows at the end), contexts from the prompt length up to prompt + ``--new-tokens``;
- ``rl_step_ms``: the RL-like workload of the default config, continuous: groups of 4 identical
  prompts, ``max_new_tokens`` 5 with EOS on, new groups admitted as rows finish: wall time per
  decode step with admission (the prefill forward included) and retirement, and the mean batch.

``--model arith`` is ``configs/models/arith-tiny`` (248K parameters, arithmetic prompts of 4-6
tokens, 1 thread as the default config runs it); ``bench22m`` is ``bench/engine.py``'s random
22M-parameter model (prompts of 32 tokens, 2 threads). ``--pyinstrument`` prints a profile of
the steady loop to stderr. ``--repetition-penalty`` and ``--frequency-penalty`` put SGLang's
penalties on every row (``stages.engine.penalties``: what they cost a step).
``--strict-thinking BUDGET`` has every row think under ``--enable-strict-thinking`` (four
excluded tags, an end tag no row draws by chance) with that ``max_thinking_tokens`` (-1: none,
so every step filters the excluded tags of every row; a budget: the end forced when it is
spent): what the filter costs a step. ``--model moe`` is arith-tiny's tokenizer on a random
Qwen3-MoE (hidden 128, 6 layers of 16 experts, 2 a token, one dense; on the engine's passes
its experts run by transformers' module); with ``--routed-experts`` every row asks for its
routed experts (the scheduler's ``--enable-return-routed-experts``): what capturing them costs
a step. ``--model gpt-oss`` is arith-tiny's tokenizer on a random gpt-oss (hidden 128, 6 layers
alternating a sliding window of 8 and full attention, 16 experts, attention sinks); ``phi3`` and
``glm4`` on random models of those families (hidden 128, 6 layers; Phi-3's own fused projections
with Phi-4-mini's three quarters of each head rotated; GLM-4's four norms a layer and its
neighbouring dimensions rotated, half of each head); ``pythia`` and ``gpt2`` on a random GPT-NeoX
and GPT-2 (hidden 128, 6 layers); ``deepseek`` on a random DeepSeek-V3 (hidden
128, 6 layers of multi-head latent attention, 16 experts and a shared one).

``http`` starts ``inflight engine`` on arith-tiny (``--model mid``: its tokenizer on a 6-layer,
384-wide model; ``OMP_NUM_THREADS=1``, ``--max-running 64``)
and keeps ``--in-flight`` samples in flight as the default config does, in requests of one
group of 4 (``batch``: four identical ``input_ids``; ``n``: ``sampling_params.n`` 4;
``openai``: the same as ``n`` through ``/v1/completions``, ``logprobs: 0``) or one request per
sample (``single``); ``--stream`` asks for each as server-sent events (a chunk per token, or
after the first and every ``--stream-interval`` tokens). It
reports the engine process's CPU split between its threads
(``/proc``: the event-loop thread, which serves HTTP, vs the scheduler thread) and, with
``--py-spy``, the same split from ``py-spy record --threads`` samples plus the hottest frames of
the event-loop thread.

``compare``'s forms are those of ``http`` (``-stream`` streamed), plus ``chat`` (``n`` through
``/v1/chat/completions``, the prompt's text as the user's message, which the engine's
pass-through ``--chat-template`` turns back into the same ids) and ``responses`` (one sample a
request through ``/v1/responses``, as ``single`` is through ``/generate``; output log-probs
unless streamed, where SGLang refuses them) and ``messages`` (the same through Anthropic's
``/v1/messages``, which has no log-probs). ``FORM+log`` is FORM with the engine's request log
on (``POST /configure_logging``: SGLang's ``--log-requests`` at its default level 2, text, to
the engine's stdout, here ``/dev/null``) for its phases only: what logging every request costs.

``compare`` starts one such server and takes the request forms of ``--forms`` in turn, in short
phases (``--seconds``), ``--rounds`` times, the order reversed every other round: the engine's
CPU per sample of each, and each over the first's of the same round (the median of those paired
ratios is what to read: this machine's speed drifts by tens of percent within minutes, so runs
of one form after another cannot be compared to a few percent). Each form's event-loop thread
per sample (HTTP and streaming, where the forms differ) and tokens per decode step (how full the
steps were) come with it, and every phase's figures go to stderr. ``loop_extra_over_<first>``:
each form's event-loop CPU per sample over the first's, as a share of the first's whole CPU per
sample (paired by round; what the route adds, without the scheduler thread's drift). ``--pin``
puts the engine on core 0 and the client on core 1. ``--against DIR`` starts a second server from
another checkout (``git worktree add DIR COMMIT``) and sends the forms named ``FORM@base`` there,
in the same rounds: an A/B of two commits under the same drift (only one server is driven at a
time). At the default 64 samples in flight (``--max-running`` 64) the steps are not full, and
how full they are depends on how fast this client, on the same cores, turns its requests
around, which streaming changes (``tokens_per_step`` says); ``--in-flight 128`` keeps every
step full, so that the forms are compared on the same steps.

It does not measure GPU timings or text (tokenizer) requests.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache  # noqa: E402

from bench._engines import free_port, wait_health  # noqa: E402
from stages.engine.identity import ENGINE_ID_ENV, new_engine_id  # noqa: E402
from stages.hf import cache_argument  # noqa: E402

ARITH = ROOT / "configs" / "models" / "arith-tiny"


def _arith_prompts(count: int, seed: int = 0) -> list[list[int]]:
    from stages.feeder.arithmetic import ArithmeticConfig, make_tokenizer, problems

    tok = make_tokenizer()
    texts = [p.text for p in problems(ArithmeticConfig(), "train")]
    rng = random.Random(seed)
    return [tok.encode(rng.choice(texts)) for _ in range(count)]


# random models of other families on arith-tiny's tokenizer: hidden 128, 6 layers
_FAMILIES = {
    # a sliding window of 8 alternating with full attention, 16 experts (2 a token), sinks
    "gpt-oss": lambda vocab: AutoConfig.for_model(
        "gpt_oss", vocab_size=vocab, hidden_size=128, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=16,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"] * 3,
    ),
    # Phi-4-mini's layout: its own fused projections, three quarters of each head rotated
    "phi3": lambda vocab: AutoConfig.for_model(
        "phi3", vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, partial_rotary_factor=0.75,
        max_position_embeddings=4096,
    ),
    # GLM-4's: four norms a layer, neighbouring dimensions rotated, half of each head
    "glm4": lambda vocab: AutoConfig.for_model(
        "glm4", vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
    ),
    # Pythia's (GPT-NeoX): each head's q, k, v together, a quarter rotated, parallel residuals
    "pythia": lambda vocab: AutoConfig.for_model(
        "gpt_neox", vocab_size=vocab, hidden_size=128, intermediate_size=512,
        num_hidden_layers=6, num_attention_heads=8, rotary_pct=0.25,
        max_position_embeddings=4096,
    ),
    # GPT-2's: learned positions, Conv1D projections
    "gpt2": lambda vocab: AutoConfig.for_model(
        "gpt2", vocab_size=vocab, n_embd=128, n_inner=512, n_layer=6, n_head=8,
        n_positions=4096,
    ),
    # DeepSeek-V3's: multi-head latent attention (q through a rank of 48, latents of 64), 16
    # experts (2 a token) and a shared one after a dense first layer
    "deepseek": lambda vocab: AutoConfig.for_model(
        "deepseek_v3", vocab_size=vocab, hidden_size=128, intermediate_size=256,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=48,
        kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=64,
        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=4096,
    ),
}  # fmt: skip


def _random_family(name: str, path: Path) -> Path:
    """arith-tiny's tokenizer on a random model of ``_FAMILIES[name]``."""
    from tests.stages.tiny_model import copy_tokenizer

    arith = json.loads((ARITH / "config.json").read_text())
    config = _FAMILIES[name](arith["vocab_size"])
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):  # arith-tiny's ids, not theirs
        setattr(config, key, arith.get(key))
    torch.manual_seed(0)
    attn = "eager" if name == "gpt-oss" else "sdpa"  # (transformers has no sdpa for gpt-oss)
    AutoModelForCausalLM.from_config(config, attn_implementation=attn).save_pretrained(path)
    return copy_tokenizer(ARITH, path)


def _load(name: str, tmp: Path) -> tuple[torch.nn.Module, int, Any]:
    """(model, threads, prompt maker) for ``arith`` or ``bench22m``."""
    if name in ("arith", "moe", *_FAMILIES):
        path, threads = ARITH, 1
        if name == "moe":  # arith-tiny's tokenizer on a small mixture of experts
            from tests.stages.tiny_model import make_tiny_moe_model

            path = make_tiny_moe_model(
                tmp / "moe", hidden=128, layers=6, experts=16, tokenizer_from=ARITH
            )
        if name in _FAMILIES:
            path = _random_family(name, tmp / name)

        def prompts(count: int, seed: int) -> list[list[int]]:
            return _arith_prompts(count, seed)
    else:
        from bench._engines import make_model

        path, threads = tmp / "bench22m", 2
        make_model(path)

        def prompts(count: int, seed: int) -> list[list[int]]:
            gen = torch.Generator().manual_seed(seed)
            return torch.randint(2, 32000, (count, 32), generator=gen).tolist()

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, threads, prompts


def _median_spread(values: list[float], digits: int = 3) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


@torch.inference_mode()
def _forward_ms(model: torch.nn.Module, batch: int, contexts: list[int], reps: int) -> float:
    """Median ms of one plain HF decode forward (batch x 1 token) over caches of ``contexts``."""
    times = []
    name = cache_argument(model.forward) or "past_key_values"  # transformers renamed it
    # a sliding layer's cache cannot be cropped back: a fresh prefill before each rep
    sliding = "sliding_attention" in (getattr(model.config, "layer_types", None) or ())
    for ctx in contexts:
        ids = torch.randint(2, model.config.vocab_size, (batch, ctx + 1))
        cache = None
        for _ in range(reps):
            if cache is None or sliding:
                cache = DynamicCache(config=model.config)
                model(input_ids=ids[:, :ctx], **{name: cache}, use_cache=True)
            start = time.perf_counter()
            model(input_ids=ids[:, ctx:], **{name: cache}, use_cache=True)
            times.append(time.perf_counter() - start)
            if not sliding:
                cache.crop(-1)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def _engine_forward_ms(model: torch.nn.Module, batch: int, contexts: list[int], reps: int) -> float:
    """Median ms of the engine's own decode forward (``LlamaForward.decode``, nothing else of a
    step) over a slot cache of ``batch`` rows at each of ``contexts``."""
    from stages.engine.kv_batch import BatchKV
    from stages.engine.llama_forward import LlamaForward

    fast = LlamaForward(model)
    times = []
    for ctx in contexts:
        ids = torch.randint(2, model.config.vocab_size, (batch, ctx))
        mask = torch.ones_like(ids)
        positions = torch.arange(ctx).expand(batch, ctx)
        cache, logits = fast.prefill(ids, mask, positions)
        kv = BatchKV(batch, "bool4d", device=ids.device)
        kv.admit(cache, ids, torch.full((batch,), ctx), None)
        kv.set_pending(0, batch, logits.argmax(-1), torch.zeros(batch))
        inputs = kv.decode_inputs()
        for _ in range(reps):
            start = time.perf_counter()
            fast.decode(*inputs, kv)  # the same pending column each time: the context stays
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _penalties(args: argparse.Namespace) -> dict[str, float]:
    """``--repetition-penalty`` and ``--frequency-penalty`` for every row, when given."""
    given = {
        "repetition_penalty": args.repetition_penalty,
        "frequency_penalty": args.frequency_penalty,
    }
    return {k: v for k, v in given.items() if v is not None}


def _thinking(args: argparse.Namespace, vocab: int) -> tuple[Any, dict[str, Any]]:
    """``--strict-thinking``: the scheduler's filter and each input's fields (none: no
    thinking)."""
    if args.strict_thinking is None:
        return None, {}
    from stages.engine.strict_thinking import StrictThinking

    strict = StrictThinking(end=(vocab - 1,), excluded=(vocab - 2, vocab - 3, vocab - 4, 2))
    return strict, {"require_reasoning": True, "max_thinking_tokens": args.strict_thinking}


def _routes(args: argparse.Namespace) -> dict[str, Any]:
    """``--routed-experts``: each input's field that asks for its routed experts."""
    return {"routed_experts": 0} if args.routed_experts else {}


def _step_bench(args: argparse.Namespace) -> dict[str, Any]:
    from stages.engine.protocol import GenerateInput, SamplingParams
    from stages.engine.scheduler import Scheduler

    with tempfile.TemporaryDirectory() as tmp:
        model, threads, make_prompts = _load(args.model, Path(tmp))
    threads = args.threads or threads
    torch.set_num_threads(threads)
    eos = frozenset({model.config.eos_token_id or 1})
    new_tokens = args.new_tokens or (6 if args.model != "bench22m" else 32)

    # -- the model alone, and the engine on a full batch of equal lengths, interleaved -------
    # Each round times the plain forward and then one engine round, so that both see the same
    # machine (a shared host drifts by tens of percent over minutes).
    prompts = make_prompts(args.batch, 1)
    plen = round(statistics.mean(len(p) for p in prompts))
    contexts = list(range(plen, plen + new_tokens - 1))
    _forward_ms(model, args.batch, contexts[:1], 3)  # warm up
    strict, thinking = _thinking(args, model.config.vocab_size)
    sched = Scheduler(
        model,
        max_running=args.batch,
        eos_token_ids=eos,
        seed=0,
        fast_forward=args.forward == "fast",
        strict_thinking=strict,
        routed_experts=args.routed_experts,
    )
    fast = sched.forward_path == "fast"
    params = SamplingParams(
        temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, **_penalties(args)
    )
    forward_ms, steady_ms, ratios, round_ms, own_ms = [], [], [], [], []
    profiler = None
    if args.pyinstrument:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
    for r in range(args.rounds + 1):
        forward = _forward_ms(model, args.batch, contexts, args.reps)
        own = _engine_forward_ms(model, args.batch, contexts, args.reps) if fast else forward
        prompts = make_prompts(args.batch, 100 + r)
        futures = [
            sched.submit(GenerateInput(f"s{r}-{i}", p, params, True, **thinking, **_routes(args)))
            for i, p in enumerate(prompts)
        ]
        if profiler is not None and r == 1:
            profiler.start()
        start = time.perf_counter()
        sched.step()  # admission: prefill + first token
        steps = []
        while sched.counts()["num_running_reqs"]:
            t0 = time.perf_counter()
            sched.step()
            steps.append(time.perf_counter() - t0)
        total = time.perf_counter() - start
        assert all(f.done() for f in futures)
        if r > 0:  # round 0 warms up
            step = 1000 * statistics.median(steps)
            forward_ms.append(forward)
            own_ms.append(own)
            steady_ms.append(step)
            ratios.append(step / forward)
            round_ms.append(1000 * total / new_tokens)
    if profiler is not None:
        profiler.stop()
        print(profiler.output_text(unicode=False, color=False), file=sys.stderr)

    # -- the engine, RL-like continuous workload -----------------------------------------------
    rl = _rl_workload(model, make_prompts, args, eos)
    return {
        "bench": "engine_step_vs_forward",
        "model": args.model,
        "strict_thinking": args.strict_thinking,
        "routed_experts": args.routed_experts,
        "params": sum(p.numel() for p in model.parameters()),
        "threads": threads,
        "batch": args.batch,
        "engine_forward": sched.forward_path,
        "contexts": [contexts[0], contexts[-1] + 1],
        "forward_ms": _median_spread(forward_ms),
        "engine_forward_ms": _median_spread(own_ms),
        "steady_step_ms": _median_spread(steady_ms),
        "ratio_step_vs_forward": _median_spread(ratios),
        "ratio_step_vs_engine_forward": _median_spread(
            [s / o for s, o in zip(steady_ms, own_ms, strict=True)]
        ),
        "steady_ms_per_step_with_prefill": _median_spread(round_ms),
        **rl,
    }


def _rl_workload(
    model: torch.nn.Module, make_prompts: Any, args: argparse.Namespace, eos: frozenset[int]
) -> dict[str, Any]:
    from stages.engine.protocol import GenerateInput, SamplingParams
    from stages.engine.scheduler import Scheduler

    group = 4
    strict, thinking = _thinking(args, model.config.vocab_size)
    sched = Scheduler(
        model,
        max_running=args.batch,
        eos_token_ids=eos,
        seed=0,
        fast_forward=args.forward == "fast",
        strict_thinking=strict,
        routed_experts=args.routed_experts,
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=5, **_penalties(args))
    pool = make_prompts(512, 7)
    submitted = 0

    live: list[Any] = []

    def top_up_fast() -> None:
        nonlocal submitted, live
        live = [f for f in live if not f.done()]
        while len(live) < 2 * args.batch:
            prompt = pool[(submitted // group) % len(pool)]
            for k in range(group):
                inp = GenerateInput(
                    f"rl{submitted}-{k}", prompt, params, True, **thinking, **_routes(args)
                )
                live.append(sched.submit(inp))
            submitted += 1

    # Time spent inside the model's passes (decode and prefill), to split the step.
    inside: dict[str, Any] = {"s": 0.0, "prefills": 0, "decode_rows": 0, "decodes": 0}

    def timed(pass_: Any, ids_of: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = pass_(*a, **kw)
            inside["s"] += time.perf_counter() - t0
            rows, width = ids_of(a, kw).shape
            if width == 1 and inside["count"]:
                inside["decodes"] += 1
                inside["decode_rows"] += rows
            elif inside["count"]:
                inside["prefills"] += 1
            return out

        return run

    fast = sched._fast  # the engine's own passes, when the model takes them
    if fast is not None:
        fast.decode = timed(fast.decode, lambda a, kw: a[0])
        fast.prefill = timed(fast.prefill, lambda a, kw: a[0])
    else:
        model.forward = timed(model.forward, lambda a, kw: kw["input_ids"])
    per_round, tokens_per_round, model_share, model_ms = [], [], [], []
    try:
        for r in range(args.rl_rounds + 1):
            top_up_fast()
            inside.update(s=0.0, count=r > 0)
            steps0, tokens0 = sched.steps, sched.tokens_generated
            start = time.perf_counter()
            for _ in range(args.rl_steps):
                sched.step()
                top_up_fast()
            elapsed = time.perf_counter() - start
            if r > 0:
                steps = max(1, sched.steps - steps0)
                per_round.append(1000 * elapsed / steps)
                model_ms.append(1000 * inside["s"] / steps)
                model_share.append(inside["s"] / elapsed)
                tokens_per_round.append((sched.tokens_generated - tokens0) / elapsed)
        sched.abort(None, abort_all=True)
        sched.run_until_idle()
    finally:
        if fast is None:
            del model.forward
    return {
        "rl_step_ms": _median_spread(per_round),
        "rl_model_ms_per_step": _median_spread(model_ms),
        "rl_model_share": _median_spread(model_share),
        "rl_mean_decode_batch": round(inside["decode_rows"] / max(1, inside["decodes"]), 1),
        "rl_prefills_per_step": round(inside["prefills"] / max(1, inside["decodes"]), 2),
        "rl_tokens_per_s": _median_spread(tokens_per_round),
    }


# ---- http --------------------------------------------------------------------------------------


def _thread_cpu(pid: int) -> dict[int, float]:
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _process_cpu(pid: int) -> tuple[float, float]:
    """The process's user and system (kernel) CPU seconds so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def _ctx_switches(pid: int) -> dict[int, int]:
    """Context switches (voluntary + not) of each thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                text = f.read()
        except OSError:
            continue
        out[int(tid)] = sum(
            int(line.split()[1]) for line in text.splitlines() if "ctxt_switches" in line
        )
    return out


def _thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name, from ``py-spy dump``."""
    text = subprocess.run(
        ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    names = {}
    for line in text.splitlines():
        if line.startswith("Thread "):
            parts = line.split()
            tid = int(parts[1], 0)
            name = line.split('"')[1] if '"' in line else "?"
            names[tid] = name
    return names


def _classify(stack: str) -> str:
    if "engine/scheduler.py" in stack and ("_loop" in stack or "step" in stack):
        return "scheduler"
    if "_run_loop" in stack or "run_forever" in stack or "_serve" in stack or "uvloop" in stack:
        return "http"
    if "engine/server.py" in stack or "aiohttp" in stack or "asyncio" in stack:
        return "http"
    return "other"


async def _drive(
    url: str,
    form: str,
    in_flight: int,
    seconds: float,
    group: int,
    stream: bool = False,
    new_tokens: int = 5,
) -> dict:
    import aiohttp

    prompts = _arith_prompts(4096, 3)
    texts: list[str] = []
    served = ""
    if form in ("chat", "responses", "messages"):  # text prompts (the template passes them on)
        from stages.feeder.arithmetic import make_tokenizer

        tok = make_tokenizer()
        texts = [tok.decode(p) for p in prompts]
        served = _served_model(url)  # /v1/responses checks the name
    counter = 0
    samples = 0
    errors = 0
    requests = 0
    stop_at = time.monotonic() + seconds
    params = {"temperature": 1.0, "max_new_tokens": new_tokens}

    def body() -> tuple[bytes, int]:
        nonlocal counter
        counter += 1
        prompt = prompts[counter % len(prompts)]
        if form == "single":
            b = {"input_ids": prompt, "sampling_params": params, "rid": f"r{counter}"}
            n = 1
        elif form == "batch":
            b = {
                "input_ids": [prompt] * group,
                "sampling_params": params,
                "rid": [f"r{counter}-{k}" for k in range(group)],
            }
            n = group
        elif form == "openai":  # the same samples through /v1/completions
            b = {"model": "default", "prompt": prompt, "n": group, "temperature": 1.0,
                 "max_tokens": new_tokens, "logprobs": 0, "stream": stream}  # fmt: skip
            return json.dumps(b).encode(), group
        elif form == "chat":  # through /v1/chat/completions
            text = texts[counter % len(texts)]
            b = {"model": "default", "messages": [{"role": "user", "content": text}], "n": group,
                 "temperature": 1.0, "max_tokens": new_tokens, "logprobs": True,
                 "stream": stream}  # fmt: skip
            return json.dumps(b).encode(), group
        elif form == "messages":  # Anthropic's: one sample a request, no log-probs in the API
            text = texts[counter % len(texts)]
            b = {"model": served, "max_tokens": new_tokens, "temperature": 1.0, "stream": stream,
                 "messages": [{"role": "user", "content": text}]}  # fmt: skip
            return json.dumps(b).encode(), 1
        elif form == "responses":  # one sample a request (the API has no n); log-probs unless
            text = texts[counter % len(texts)]  # streamed (SGLang refuses them there)
            b = {"model": served, "input": text, "temperature": 1.0, "stream": stream,
                 "max_output_tokens": new_tokens + 2}  # fmt: skip
            if not stream:
                b["include"] = ["message.output_text.logprobs"]
            return json.dumps(b).encode(), 1
        else:
            b = {"input_ids": prompt, "sampling_params": {**params, "n": group}}
            n = group
        b["return_logprob"] = True
        b["stream"] = stream
        return json.dumps(b).encode(), n

    path = {"openai": "/v1/completions", "chat": "/v1/chat/completions"}.get(form, "/generate")
    path = {"responses": "/v1/responses", "messages": "/v1/messages"}.get(form, path)

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600),
        headers={"Content-Type": "application/json"},
        connector=aiohttp.TCPConnector(limit=0),
    ) as session:

        async def worker() -> None:
            nonlocal samples, errors, requests
            while time.monotonic() < stop_at:
                data, _ = body()
                async with session.post(url + path, data=data) as r:
                    if r.status != 200:
                        errors += 1
                        continue
                    raw = await r.read()
                    if stream:  # a sample counts at its last chunk
                        requests += 1
                        samples += _finished_in(raw)
                        continue
                out = json.loads(raw)
                requests += 1
                if isinstance(out, dict) and "choices" in out:
                    out = out["choices"]
                samples += len(out) if isinstance(out, list) else 1

        per_request = 1 if form in ("single", "responses", "messages") else group
        await asyncio.gather(*(worker() for _ in range(in_flight // per_request)))
    return {"samples": samples, "errors": errors, "requests": requests}


def _mid_model(path: Path) -> Path:
    """arith-tiny's tokenizer on a model of ``bench/_engines.py``'s shape (hidden 384, 6 layers,
    about 10M parameters with this vocabulary): a token that costs the model work a stream's
    bookkeeping can be weighed against."""
    import shutil

    from bench._engines import make_model

    vocab = json.loads((ARITH / "config.json").read_text())["vocab_size"]
    make_model(path, vocab=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ARITH / name, path / name)
    return path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _server_info(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/get_server_info", timeout=5) as resp:
        return json.loads(resp.read())


def _finished_in(events: bytes) -> int:
    """How many samples a streamed answer (native or /v1) finished: the chunks whose
    ``finish_reason`` is set, found in the bytes as the server writes them (compact JSON)
    rather than by parsing each chunk. The client shares this machine's two cores with the
    engine: parsing every chunk slowed it enough to turn its requests around later and leave
    the engine's steps less full (fewer tokens per step, so each sample carried more of a
    step's fixed cost), which made streaming look dearer to the engine than it is."""
    ended = events.count(b'"finish_reason":{') + events.count(b'"finish_reason":"')
    return (
        ended
        + events.count(b"event: response.completed")
        + events.count(b"event: response.incomplete")
        + events.count(b"event: message_stop")
    )


def _served_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _in_scratch(bench: Callable[[argparse.Namespace, Path], dict[str, Any]]) -> Any:
    """``bench(args, tmp)`` with a temporary folder (the engine's log, py-spy's samples, the mid
    model), removed when it is done."""

    def run(args: argparse.Namespace) -> dict[str, Any]:
        tmp = Path(tempfile.mkdtemp(prefix="engine-http-"))
        try:
            return bench(args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return run


def _serve(args: argparse.Namespace, tmp: Path, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """``inflight engine`` on the model asked for, answering /health (the code of the checkout
    at ``root``)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = ARITH if args.model == "arith" else _mid_model(tmp / "mid")
    engine_id = new_engine_id()
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", ENGINE_ID_ENV: engine_id}
    pinned = getattr(args, "pin", False)
    proc = subprocess.Popen(
        [
            *(["taskset", "-c", "0"] if pinned else []),
            sys.executable,
            "-m",
            "stages.engine.server",
            "--model",
            str(model),
            "--port",
            str(port),
            "--max-running",
            "64",
            "--stream-interval",
            str(args.stream_interval),
            *(
                ["--event-loop-turns"]
                if getattr(args, "event_loop_turns", False) and root == ROOT
                else []
            ),
            "--device",
            getattr(args, "device", "cpu"),
            "--log-file",
            str(tmp / f"engine-{port}.log"),
            "--chat-template",  # the message's text as the prompt: the same ids as /generate's
            str(
                _write(
                    tmp / "passthrough.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}"
                )
            ),
        ],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_health(url, proc, engine_id=engine_id)
    except BaseException:
        proc.terminate()
        proc.wait(30)
        raise
    return proc, url


def _http_bench_in(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    proc, url = _serve(args, tmp)
    try:
        drive = (args.group_form, args.in_flight)
        asyncio.run(_drive(url, *drive, 2.0, 4, args.stream, args.new_tokens))  # warm up
        names = _thread_names(proc.pid)
        spy = None
        raw = tmp / "spy.txt"
        if args.py_spy:
            spy = subprocess.Popen(  # --native cannot sample without pausing the process
                [
                    "py-spy", "record", "--pid", str(proc.pid), "-r", "200", "--threads",
                    "--format", "raw", "-o", str(raw), "-d", str(int(args.seconds)),
                    *(["--native"] if args.native else ["--nonblocking"]),
                    *(["--gil"] if args.gil_only else []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        before = _server_info(url)
        cpu0, ctx0 = _thread_cpu(proc.pid), _ctx_switches(proc.pid)
        wall0 = time.perf_counter()
        driven = asyncio.run(_drive(url, *drive, args.seconds, 4, args.stream, args.new_tokens))
        wall = time.perf_counter() - wall0
        cpu1, ctx1 = _thread_cpu(proc.pid), _ctx_switches(proc.pid)
        info = _server_info(url)
        if spy is not None:
            spy.wait(120)
    finally:
        proc.terminate()
        proc.wait(30)

    by_name: dict[str, float] = collections.Counter()
    for tid, t in cpu1.items():
        name = "event_loop" if tid == proc.pid else names.get(tid, "other")
        by_name[name] += t - cpu0.get(tid, 0.0)
    total = sum(by_name.values())
    steps = info["decode_steps"] - before["decode_steps"]
    steps_tokens = info["tokens_generated"] - before["tokens_generated"]
    result: dict[str, Any] = {
        "bench": "engine_http_share",
        "model": args.model,
        "new_tokens": args.new_tokens,
        "group_form": args.group_form,
        "stream": args.stream,
        "stream_interval": args.stream_interval,
        "in_flight_samples": args.in_flight,
        "seconds": round(wall, 1),
        "samples_per_s": round(driven["samples"] / wall, 1),
        "errors": driven["errors"],
        "decode_steps": info.get("decode_steps"),
        "engine_cpu_s": round(total, 2),
        "engine_cpu_us_per_sample": round(1e6 * total / max(1, driven["samples"]), 1),
        "engine_cpu_util": round(total / wall, 2),
        # how full the scheduler's steps were (tokens sampled per decode step, a sample's first,
        # sampled at its prefill, included): a client that turns its requests around more
        # slowly (a stream's reader) leaves fewer rows per step, and every sample then carries
        # more of each step's fixed cost, though the engine does no more work for it
        "tokens_per_step": round(steps_tokens / max(1, steps), 1),
        "scheduler_cpu_us_per_step": round(
            1e6 * by_name.get("engine-scheduler", 0.0) / max(1, steps), 1
        ),
        "cpu_share_by_thread": {k: round(v / total, 3) for k, v in sorted(by_name.items())},
        "http_share_proc": round(by_name.get("event_loop", 0.0) / total, 3),
        "event_loop_cpu_us_per_request": round(
            1e6 * by_name.get("event_loop", 0.0) / max(1, driven["requests"]), 1
        ),
        "event_loop_ctx_switches_per_request": round(
            (ctx1.get(proc.pid, 0) - ctx0.get(proc.pid, 0)) / max(1, driven["requests"]), 1
        ),
        # the scheduler thread's context switches a decode step: each is a wait for the GIL
        # (or for work), which the event loop thread's load makes more frequent
        "scheduler_ctx_switches_per_step": round(
            sum(
                ctx1.get(tid, 0) - ctx0.get(tid, 0)
                for tid, name in names.items()
                if name == "engine-scheduler"
            )
            / max(1, steps),
            2,
        ),
    }
    if spy is not None and raw.exists():
        result.update(_spy_summary(raw))
        if args.keep_raw:
            args.keep_raw.write_bytes(raw.read_bytes())
    return result


_FORMS = {  # compare's variants: (group form, stream)
    "n": ("n", False),
    "n-stream": ("n", True),
    "openai": ("openai", False),
    "openai-stream": ("openai", True),
    "batch": ("batch", False),
    "batch-stream": ("batch", True),
    "single": ("single", False),
    "single-stream": ("single", True),
    "chat": ("chat", False),
    "chat-stream": ("chat", True),
    "responses": ("responses", False),
    "responses-stream": ("responses", True),
    "messages": ("messages", False),
    "messages-stream": ("messages", True),
}


def _form(form: str) -> tuple[str, bool, str]:
    """A compare form's parts: ``NAME[+log][@base]`` -> (NAME, logged, "" or "base")."""
    head, _, where = form.partition("@")
    name, _, modifier = head.partition("+")
    return (name if modifier in ("", "log") else head), modifier == "log", where


def _configure_logging(url: str, on: bool) -> None:
    """Turn the engine's request log on (SGLang's default level 2, text, to its stdout) or
    off, through ``/configure_logging``."""
    body = json.dumps({"log_requests": on, "log_requests_level": 2}).encode()
    request = urllib.request.Request(
        url + "/configure_logging", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def _compare_in(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The engine's CPU per sample for each of ``--forms`` on one server, in short phases taken
    in turn (the order reversed every other round): this machine's speed drifts by tens of
    percent within minutes, and only variants measured side by side can be compared. Each
    variant's cost is also given over the first's in the same round, and the median of those
    paired ratios is the figure to read."""
    forms = args.forms.split(",")
    unknown = [f for f in forms if _form(f)[0] not in _FORMS]
    if unknown:
        raise SystemExit(f"--forms: unknown {unknown}; known: {sorted(_FORMS)}")
    if any(f.endswith("@base") for f in forms) != bool(args.against):
        raise SystemExit("--forms: name forms FORM@base with --against, and only then")
    servers = {"": _serve(args, tmp)}
    if args.against:
        servers["base"] = _serve(args, tmp, args.against.resolve())
    if args.pin:
        os.sched_setaffinity(0, {1})
    per: dict[str, list[float]] = {f: [] for f in forms}
    kernel: dict[str, list[float]] = {f: [] for f in forms}  # its share of the CPU
    loop_cpu: dict[str, list[float]] = {f: [] for f in forms}  # the event-loop thread's
    rows: dict[str, list[float]] = {f: [] for f in forms}  # tokens sampled per decode step
    try:
        for form in forms:  # each route's first requests (imports, caches) before measuring
            name, _, where = _form(form)
            kind, stream = _FORMS[name]
            url = servers[where][1]
            asyncio.run(_drive(url, kind, args.in_flight, 1.5, 4, stream, args.new_tokens))
        for r in range(args.rounds):
            for form in forms if r % 2 == 0 else forms[::-1]:
                name, logged, where = _form(form)
                kind, stream = _FORMS[name]
                proc, url = servers[where]
                if logged:
                    _configure_logging(url, True)
                info0, threads0 = _server_info(url), _thread_cpu(proc.pid)
                user0, system0 = _process_cpu(proc.pid)
                driven = asyncio.run(
                    _drive(url, kind, args.in_flight, args.seconds, 4, stream, args.new_tokens)
                )
                user1, system1 = _process_cpu(proc.pid)
                info1, threads1 = _server_info(url), _thread_cpu(proc.pid)
                if logged:
                    _configure_logging(url, False)
                cpu = user1 - user0 + system1 - system0
                samples = max(1, driven["samples"])
                per[form].append(1e6 * cpu / samples)
                kernel[form].append((system1 - system0) / max(cpu, 1e-9))
                loop = threads1.get(proc.pid, 0.0) - threads0.get(proc.pid, 0.0)
                loop_cpu[form].append(1e6 * loop / samples)
                steps = max(1, info1["decode_steps"] - info0["decode_steps"])
                rows[form].append((info1["tokens_generated"] - info0["tokens_generated"]) / steps)
                print(  # each phase, for a look at the spread (stdout keeps the one JSON line)
                    f"round {r} {form}: {per[form][-1]:.1f} us a sample, event loop "
                    f"{loop_cpu[form][-1]:.1f}, {rows[form][-1]:.1f} tokens a step",
                    file=sys.stderr,
                )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)

    first = forms[0]
    return {
        "bench": "engine_http_compare",
        "model": args.model,
        "new_tokens": args.new_tokens,
        "stream_interval": args.stream_interval,
        "in_flight_samples": args.in_flight,
        "rounds": args.rounds,
        "seconds_per_phase": args.seconds,
        "pinned": args.pin,
        "against": str(args.against) if args.against else None,
        "engine_cpu_us_per_sample": {f: _median_spread(per[f], 1) for f in forms},
        "kernel_share": {f: round(statistics.median(kernel[f]), 3) for f in forms},
        # the event-loop thread (HTTP, streaming) per sample, and how full the steps were: a
        # client that turns requests around more slowly leaves fewer rows a step, and each
        # sample then carries more of a step's fixed cost though the engine does no more for it
        "event_loop_us_per_sample": {f: _median_spread(loop_cpu[f], 1) for f in forms},
        "tokens_per_step": {f: _median_spread(rows[f], 1) for f in forms},
        f"over_{first}": {
            f: _median_spread([a / b for a, b in zip(per[f], per[first], strict=True)])
            for f in forms[1:]
        },
        # the event loop's extra per sample over the first form's, as a share of the first's
        # whole CPU per sample, paired by round: where the routes differ, without the drift of
        # the scheduler thread (the same work in every form, ±15% from phase to phase here)
        f"loop_extra_over_{first}": {
            f: _median_spread(
                [
                    (loop - base_loop) / base
                    for loop, base_loop, base in zip(
                        loop_cpu[f], loop_cpu[first], per[first], strict=True
                    )
                ]
            )
            for f in forms[1:]
        },
    }


def _spy_summary(raw: Path) -> dict[str, Any]:
    kinds: dict[str, int] = collections.Counter()
    http_frames: dict[str, int] = collections.Counter()
    sched_frames: dict[str, int] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        kind = _classify(stack)
        kinds[kind] += n
        frames = stack.split(";")
        leafish = [f for f in frames if "site-packages" not in f and "/lib/python" not in f]
        key = (leafish[-1] if leafish else frames[-1]).strip()
        if kind == "http":
            http_frames[key] += n
        elif kind == "scheduler":
            sched_frames[key] += n
    total = sum(kinds.values()) or 1
    return {
        "py_spy_samples": total,
        "http_share_py_spy": round(kinds["http"] / total, 3),
        "py_spy_share": {k: round(v / total, 3) for k, v in sorted(kinds.items())},
        "py_spy_top_http": [[k, v] for k, v in http_frames.most_common(8)],
        "py_spy_top_scheduler": [[k, v] for k, v in sched_frames.most_common(8)],
    }


def main() -> int:
    import structlog

    # the scheduler's own events (the step bench runs it in this process) go to stderr: stdout
    # is the one JSON line
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    step = sub.add_parser("step", help="decode step vs the model's own forward, in process")
    step.add_argument("--model", choices=["arith", "bench22m", "moe", *_FAMILIES], default="arith")
    step.add_argument(
        "--routed-experts",
        action="store_true",
        help="every row asks for its routed experts (--enable-return-routed-experts; moe)",
    )
    step.add_argument("--batch", type=int, default=64)
    step.add_argument("--new-tokens", type=int, default=0, help="0: 6 (arith) or 32 (bench22m)")
    step.add_argument("--threads", type=int, default=0, help="0: 1 (arith) or 2 (bench22m)")
    step.add_argument("--rounds", type=int, default=30)
    step.add_argument("--reps", type=int, default=5, help="forward timings per context a round")
    step.add_argument("--rl-rounds", type=int, default=5)
    step.add_argument("--rl-steps", type=int, default=60)
    step.add_argument("--pyinstrument", action="store_true")
    step.add_argument("--repetition-penalty", type=float, help="on every row (SGLang's)")
    step.add_argument("--frequency-penalty", type=float, help="on every row (SGLang's)")
    step.add_argument(
        "--strict-thinking",
        type=int,
        metavar="BUDGET",
        help="every row thinks under --enable-strict-thinking with this budget (-1: none)",
    )
    step.add_argument(
        "--forward",
        choices=["fast", "transformers"],
        default="fast",
        help="the engine's passes: its own (LlamaForward) or model(...)",
    )
    http = sub.add_parser("http", help="engine CPU on HTTP vs scheduler, over a real server")
    http.add_argument(
        "--group-form",
        choices=["batch", "n", "single", "openai", "chat", "responses", "messages"],
        default="batch",
    )
    http.add_argument("--in-flight", type=int, default=64)
    http.add_argument("--stream", action="store_true", help="stream: true (server-sent events)")
    http.add_argument(
        "--stream-interval", type=int, default=1, help="the engine's --stream-interval (SGLang's)"
    )
    http.add_argument(
        "--model",
        choices=["arith", "mid"],
        default="arith",
        help="arith-tiny (248K parameters), or its tokenizer on a 6-layer, 384-wide model",
    )
    http.add_argument("--new-tokens", type=int, default=5, help="max_new_tokens of a sample")
    http.add_argument("--seconds", type=float, default=20)
    http.add_argument("--py-spy", action="store_true")
    http.add_argument("--native", action="store_true", help="py-spy --native (C frames)")
    http.add_argument("--gil-only", action="store_true", help="py-spy --gil: GIL holders only")
    http.add_argument("--keep-raw", type=Path, help="copy py-spy's raw samples here")
    http.add_argument(
        "--event-loop-turns", action="store_true", help="the engine's --event-loop-turns"
    )
    compare = sub.add_parser(
        "compare", help="engine CPU per sample of several request forms, side by side"
    )
    compare.add_argument(
        "--forms",
        default="n,n-stream,openai,openai-stream",
        help=f"comma-separated, the first the reference; of {', '.join(_FORMS)} (FORM@base: "
        "on the --against server)",
    )
    compare.add_argument(
        "--against",
        type=Path,
        help="a checkout of other code (git worktree add DIR COMMIT): a second server runs it, "
        "and forms named FORM@base are sent there, in the same rounds",
    )
    compare.add_argument("--rounds", type=int, default=8)
    compare.add_argument("--seconds", type=float, default=4, help="each variant's phase")
    compare.add_argument("--in-flight", type=int, default=64)
    compare.add_argument("--stream-interval", type=int, default=1)
    compare.add_argument("--model", choices=["arith", "mid"], default="arith")
    compare.add_argument("--new-tokens", type=int, default=5)
    compare.add_argument("--device", default="cpu", help="the engine's --device (cuda: a GPU)")
    compare.add_argument(
        "--event-loop-turns",
        action="store_true",
        help="the engine's --event-loop-turns, on the first server only (not --against's): with "
        "--against a checkout of the same code, an A/B of the flag",
    )
    compare.add_argument(
        "--pin",
        action="store_true",
        help="the engine on core 0 and this client on core 1 (else they share both)",
    )
    args = parser.parse_args()
    benches = {
        "step": _step_bench,
        "http": _in_scratch(_http_bench_in),
        "compare": _in_scratch(_compare_in),
    }
    result = benches[args.what](args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
