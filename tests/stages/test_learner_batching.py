"""Micro-batching, padding, completion log-probs; no-grad memory is set by the micro-batch."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stages.learner.batching import (
    collate,
    completion_logprobs,
    micro_batches,
    no_grad_logprobs,
    pad_right,
)
from tests.numerics import assert_close, forward_terms
from tests.stages.learner_setup import one_torch_thread, tiny_policy

pytestmark = pytest.mark.numerics  # rerun on every CPU kernel by .ci/run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    yield from one_torch_thread()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_policy()


PROMPTS = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]]
COMPLETIONS = [[20, 21], [22, 23, 24, 25], [26], []]


def _reference(model, prompt, completion, temperature=1.0):
    """Log-probs and entropies from a plain full log_softmax over one unpadded sequence."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0] / temperature
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) + len(completion) - 1]
    token = logp.gather(-1, torch.tensor(completion, dtype=torch.long)[:, None]).squeeze(-1)
    return token, -(logp.exp() * logp).sum(-1)


# ---- micro_batches ------------------------------------------------------------------------


def test_micro_batches_by_count_keep_order():
    assert micro_batches([5] * 5, 2) == [[0, 1], [2, 3], [4]]
    assert micro_batches([5] * 3, 8) == [[0, 1, 2]]
    assert micro_batches([], 4) == []


def test_micro_batches_by_padded_tokens():
    # Padded tokens = samples * longest: [4, 4] = 8; adding 9 would make 27 > 20.
    assert micro_batches([4, 4, 9, 2, 2, 30, 1], 8, max_tokens=20) == [
        [0, 1],
        [2, 3],  # 2 * 9 = 18
        [4],  # 2 + 30 would be 60
        [5],  # longer than the budget on its own: alone, not dropped
        [6],
    ]
    for mb in micro_batches([3, 1, 7, 7, 2, 9, 9, 9], 3, max_tokens=18):
        assert mb and len(mb) <= 3
        assert len(mb) == 1 or len(mb) * max([3, 1, 7, 7, 2, 9, 9, 9][i] for i in mb) <= 18


def test_micro_batches_reject_bad_bounds():
    with pytest.raises(ValueError, match="size"):
        micro_batches([1], 0)
    with pytest.raises(ValueError, match="max_tokens"):
        micro_batches([1], 1, max_tokens=0)


# ---- collate ------------------------------------------------------------------------------


def test_collate_right_pads():
    batch = collate(PROMPTS[:3], COMPLETIONS[:3], pad_id=0)
    assert batch.input_ids.tolist() == [
        [5, 6, 7, 20, 21, 0],
        [8, 9, 22, 23, 24, 25],
        [10, 26, 0, 0, 0, 0],
    ]
    assert batch.attention_mask.tolist() == [[1] * 5 + [0], [1] * 6, [1] * 2 + [0] * 4]
    assert batch.completion_ids.tolist() == [[20, 21, 0, 0], [22, 23, 24, 25], [26, 0, 0, 0]]
    assert batch.completion_mask.sum(-1).tolist() == [2, 4, 1]
    assert batch.logit_index[1].tolist() == [1, 2, 3, 4]
    assert batch.to("cpu").input_ids.equal(batch.input_ids)
    with pytest.raises(ValueError, match="empty prompt"):
        collate([[1], []], [[2], [3]], pad_id=0)


def test_pad_right():
    out = pad_right([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], width=3, fill=-1.0)
    assert out.tolist() == [[1.0, 2.0, -1.0], [3.0, -1.0, -1.0]]


# ---- log-probs ----------------------------------------------------------------------------


def _terms(model) -> int:
    """The rule's terms (tests/numerics.py) for a log-prob of these samples."""
    longest = max(len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True))
    return forward_terms(model.config, longest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_match_full_log_softmax(model, temperature, dtype):
    model = copy.deepcopy(model).to(dtype)  # the same weights; float64 keeps float64 log-probs
    batch = collate(PROMPTS, COMPLETIONS, pad_id=0)
    with torch.no_grad():
        logp, entropy = completion_logprobs(
            model, batch, with_entropy=True, temperature=temperature
        )
        assert logp.dtype == entropy.dtype == dtype
        for i, (prompt, completion) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
            n = len(completion)
            if n:
                token, ent = _reference(model, prompt, completion, temperature)
                assert_close(logp[i, :n], token, terms=_terms(model))
                assert_close(entropy[i, :n], ent, terms=_terms(model))
            assert (logp[i, n:] == 0).all() and (entropy[i, n:] == 0).all()
    with pytest.raises(ValueError, match="temperature"):
        completion_logprobs(model, batch, temperature=0.0)


class _Plain(torch.nn.Module):
    """A causal LM whose forward takes only the two tensors (no cache, no ``logits_to_keep``)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.inner(input_ids, attention_mask).logits)


def test_completion_logprobs_without_logits_to_keep(model):
    batch = collate(PROMPTS, COMPLETIONS, pad_id=0)
    with torch.no_grad():
        expected, _ = completion_logprobs(model, batch)
        got, entropy = completion_logprobs(_Plain(model), batch)
    assert_close(got, expected, terms=_terms(model))
    assert entropy is None


def test_completion_logprobs_carry_grad(model):
    batch = collate(PROMPTS[:2], COMPLETIONS[:2], pad_id=0)
    logp, entropy = completion_logprobs(model, batch, with_entropy=True)
    assert logp.requires_grad and not entropy.requires_grad  # entropy is a metric by default
    logp.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    _, entropy = completion_logprobs(model, batch, with_entropy=True, entropy_grad=True)
    assert entropy.requires_grad


def test_no_grad_logprobs_per_sample(model):
    logps, entropies = no_grad_logprobs(
        model, PROMPTS, COMPLETIONS, pad_id=0, micro_batch=2, max_tokens=8, with_entropy=True
    )
    assert [t.shape[0] for t in logps] == [len(c) for c in COMPLETIONS]
    assert [t.shape[0] for t in entropies] == [len(c) for c in COMPLETIONS]
    assert not any(t.requires_grad for t in logps)
    with torch.no_grad():
        for i, (prompt, completion) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
            if completion:
                token, ent = _reference(model, prompt, completion)
                assert_close(logps[i], token, terms=_terms(model))
                assert_close(entropies[i], ent, terms=_terms(model))
    plain = no_grad_logprobs(model, PROMPTS, COMPLETIONS, pad_id=0, micro_batch=1)
    assert isinstance(plain, list)
    for a, b in zip(plain, logps, strict=True):
        assert_close(a, b, terms=_terms(model))


# ---- memory -------------------------------------------------------------------------------

_MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    from stages.learner.batching import no_grad_logprobs

    torch.set_num_threads(1)
    # Logits dominate: vocab 8192 x 256 positions is 8 MiB a sample; the rest is tiny.
    config = Qwen2Config(
        vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)

    def data(n, p=16, c=240):
        prompts = [torch.randint(3, 8192, (p,), generator=g).tolist() for _ in range(n)]
        return prompts, [torch.randint(3, 8192, (c,), generator=g).tolist() for _ in range(n)]

    def peak_mib():
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the parent (pytest,
        # large after many tests), while VmHWM belongs to this process image alone
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    small, big = data(2), data(8)
    no_grad_logprobs(model, *data(2, 4, 4), pad_id=0, micro_batch=2)  # one-time lazy set-up
    base = peak_mib()
    # the high-water mark only rises, so each figure is the peak of its run or an earlier one: the
    # 8-sample run at micro_batch 2 must not raise the peak that 2 samples set.
    out = {}
    for name, prompts_completions, mb in [("one", small, 2), ("four", big, 2), ("whole", big, 8)]:
        no_grad_logprobs(model, *prompts_completions, pad_id=0, micro_batch=mb)
        out[name] = peak_mib() - base
    print(json.dumps(out))
    """
)


@pytest.mark.timeout(60)
def test_no_grad_peak_memory_is_set_by_micro_batch_not_batch():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        # Big buffers come from mmap and go back to the OS when freed: RSS tracks live tensors.
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert peaks["one"] > 8, peaks  # the probe measures something: ~2 samples' logits
    assert peaks["four"] <= 1.15 * peaks["one"] + 2, peaks  # 4x the batch, same micro-batch
    assert peaks["whole"] >= 2.5 * peaks["one"], peaks  # one pass over the batch does grow


# ---- prompts shared by a group's samples --------------------------------------------------

# groups of samples with one prompt each, prompts of three lengths, an empty completion
SHARED_PROMPTS = [[5, 6, 7]] * 3 + [[8, 9]] * 2 + [[10, 11, 12, 13]] + [[5, 6, 7]]
SHARED_COMPLETIONS = [[20, 21], [22], [], [23, 24, 25], [26], [27, 28], [29, 30, 31, 32]]


def test_collate_lists_each_distinct_prompt_once():
    batch = collate(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0, share_prompts=True)
    assert batch.prompts.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [10, 11, 12, 13]]
    assert batch.prompt_lengths.tolist() == [3, 2, 4]
    assert batch.prompt_of.tolist() == [0, 0, 0, 1, 1, 2, 0]
    plain = collate(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0)
    assert plain.prompts is None and batch.input_ids.equal(plain.input_ids)
    # nothing to share: no prompts
    assert collate(PROMPTS, COMPLETIONS, pad_id=0, share_prompts=True).prompts is None
    assert batch.to("cpu").prompt_of.tolist() == batch.prompt_of.tolist()


def _logprobs_and_grads(model, batch, temperature=0.7):
    model = copy.deepcopy(model)
    logp, entropy = completion_logprobs(model, batch, with_entropy=True, temperature=temperature)
    (logp * torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_shared_prompts_give_the_log_probs_and_gradients_of_whole_rows(model, dtype):
    """Each distinct prompt run once, its keys and values given to each of its samples: the
    same log-probs, entropies and weight gradients as running every row whole. (The norms of
    transformers' Qwen2 compute in float32 whatever the model's dtype: gradients, summed over
    differently shaped batches, are compared at float32's rule.)"""
    from stages.learner import batching
    from tests.numerics import backward_terms

    model = copy.deepcopy(model).to(dtype)
    whole = collate(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0)
    shared = collate(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0, share_prompts=True)
    seen: list = []
    run = batching._shared_prompt_logits
    batching._shared_prompt_logits = lambda m, b: seen.append(r := run(m, b)) or r
    try:
        expected = _logprobs_and_grads(model, whole)
        got = _logprobs_and_grads(model, shared)
    finally:
        batching._shared_prompt_logits = run
    assert len(seen) == 1 and seen[0] is not None  # the shared path ran, once
    longest = max(len(p) + len(c) for p, c in zip(SHARED_PROMPTS, SHARED_COMPLETIONS, strict=True))
    terms = forward_terms(model.config, longest)
    assert_close(got[0], expected[0], terms=terms, dtype=torch.float32)
    assert_close(got[1], expected[1], terms=terms, dtype=torch.float32)
    tokens = sum(len(p) + len(c) for p, c in zip(SHARED_PROMPTS, SHARED_COMPLETIONS, strict=True))
    assert got[2].keys() == expected[2].keys()
    for name, grad in expected[2].items():
        assert_close(
            got[2][name],
            grad,
            terms=backward_terms(model.config, longest, tokens),
            dtype=torch.float32,
            msg=name,
        )


def test_a_lora_model_shares_prompts_too(model):
    """peft's model takes the cache and positions through to the base model: the shared path
    runs, and the adapters' gradients equal those of whole rows."""
    from peft import LoraConfig, get_peft_model

    from stages.learner import batching
    from tests.numerics import backward_terms

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], bias="none")
    torch.manual_seed(0)
    lora = get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():  # B starts at 0: give the adapters something to do
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    assert {"cache", "position_ids", "logits_to_keep"} <= batching._forward_names(lora)
    whole = collate(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0)
    shared = collate(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0, share_prompts=True)
    expected = _logprobs_and_grads(lora, whole)
    got = _logprobs_and_grads(lora, shared)
    assert batching._shared_prompt_logits(lora, shared) is not None
    longest = max(len(p) + len(c) for p, c in zip(SHARED_PROMPTS, SHARED_COMPLETIONS, strict=True))
    tokens = sum(len(p) + len(c) for p, c in zip(SHARED_PROMPTS, SHARED_COMPLETIONS, strict=True))
    assert_close(got[0], expected[0], terms=forward_terms(model.config, longest))
    assert expected[2] and got[2].keys() == expected[2].keys()
    assert all("lora_" in name for name in got[2])
    for name, grad in expected[2].items():
        assert_close(
            got[2][name], grad, terms=backward_terms(model.config, longest, tokens), msg=name
        )


def test_shared_prompts_fall_back_to_whole_rows_where_the_cache_cannot_be_shared(model):
    """A model without a cache argument, and one whose cache is not plain keys and values (a
    sliding window): the rows run whole, with the same results."""
    from transformers import AutoModelForCausalLM

    from stages.learner import batching

    config = copy.deepcopy(model.config)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 2, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    sliding = AutoModelForCausalLM.from_config(config).eval()
    sliding.load_state_dict(model.state_dict())
    shared = collate(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0, share_prompts=True)
    whole = collate(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0)
    with torch.no_grad():
        for m in (_Plain(model), sliding):
            assert batching._shared_prompt_logits(m, shared) is None
            got, _ = completion_logprobs(m, shared)
            expected, _ = completion_logprobs(m, whole)
            assert got.equal(expected)
    assert batching._SHARING[sliding] is False and batching._SHARING.get(model) is not False
