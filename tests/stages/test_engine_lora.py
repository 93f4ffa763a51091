"""LoRA adapters applied per request, unmerged (SGLang's /load_lora_adapter and lora_path):
each row computes what peft's merged model computes; base rows and rows of other adapters in
the same batch are untouched; bad folders and names are refused with what and where."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from stages.engine.loader import load_model
from stages.engine.lora_adapters import AdapterError
from stages.engine.protocol import GenerateInput, SamplingParams
from stages.engine.scheduler import Scheduler
from stages.engine.server import build_app
from tests.stages.tiny_model import (
    make_gpt_oss_model,
    make_tiny_gemma3_model,
    make_tiny_model,
    make_tiny_moe_model,
    make_tiny_phi3_model,
    with_tiny_words,
)

PROMPTS = [[5, 9, 14, 3], [7, 7, 20, 31, 40, 2], [11, 12]]
NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora_engine") / "m", seed=3)


def _adapter(model_dir, folder, *, seed, targets, rank=4, alpha=8.0, rslora=False):
    """A peft adapter with random A and B (B is zero at init), saved; returns its merged
    model, the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora)
    peft = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft.save_pretrained(folder)
    return peft.merge_and_unload().eval()


def _greedy(model, prompts, lora=None):
    sched = Scheduler(model, max_running=8, prefix_cache_tokens=0)
    inputs = [
        GenerateInput(
            f"r{i}-{lora}",
            p,
            SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True),
            True,
            lora=lora[i] if isinstance(lora, list) else lora,
        )
        for i, p in enumerate(prompts)
    ]
    return sched, inputs


def _run(sched, inputs):
    future = sched.submit_many(inputs)
    sched.run_until_idle()
    return [(r.output_ids, r.output_token_logprobs) for r in future.result(timeout=5)]


def _same(got, want):
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids
        assert torch.allclose(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-4)


@pytest.mark.timeout(120)
def test_rows_of_two_adapters_and_the_base_in_one_batch_match_merged_models(model_dir, tmp_path):
    merged_a = _adapter(model_dir, tmp_path / "a", seed=1, targets="all-linear")
    merged_b = _adapter(
        model_dir, tmp_path / "b", seed=2, targets=["q_proj", "v_proj", "down_proj"], rslora=True
    )
    base = load_model(str(model_dir), device="cpu").model
    want_a = _run(*_greedy(merged_a, PROMPTS))
    want_b = _run(*_greedy(merged_b, PROMPTS))
    want_base = _run(*_greedy(base, PROMPTS))
    assert want_a != want_base and want_b != want_base  # the adapters change the greedy text

    sched, _ = _greedy(base, [])
    assert sched.forward_path == "fast"
    loads = [sched.load_adapter(n, str(tmp_path / n)) for n in ("a", "b")]
    sched.run_until_idle()  # no scheduler thread here: this runs its commands
    assert [f.result(timeout=5) for f in loads] == [None, None]
    assert sched.adapter_names() == {"a", "b"}
    # every row on one adapter (the whole-batch path), then all three kinds mixed
    _, inputs = _greedy(base, PROMPTS, "a")
    _same(_run(sched, inputs), want_a)
    mixed = [("a", 0), (None, 1), ("b", 2), ("b", 0), (None, 2), ("a", 1)]
    _, inputs = _greedy(base, [PROMPTS[i] for _, i in mixed], [name for name, _ in mixed])
    got = _run(sched, inputs)
    want = {"a": want_a, "b": want_b, None: want_base}
    _same(got, [want[name][i] for name, i in mixed])
    # the base weights were never touched
    fresh = load_model(str(model_dir), device="cpu").model
    pairs = zip(base.parameters(), fresh.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)
    unloads = [sched.unload_adapter("a"), sched.unload_adapter("a")]
    sched.run_until_idle()
    assert [f.result(timeout=5) for f in unloads] == [True, False]
    assert sched.adapter_names() == {"b"}


def _as_merged(model_dir, folder, targets):
    """A scheduler on the engine's passes of ``model_dir`` with an adapter of ``targets``
    (saved to ``folder``) loaded as ``a``, once its rows have answered as peft's merged model
    (which answers otherwise than the base)."""
    merged = _adapter(model_dir, folder, seed=1, targets=targets)
    base = load_model(str(model_dir), device="cpu").model
    want = _run(*_greedy(merged, PROMPTS))
    assert want != _run(*_greedy(base, PROMPTS))
    sched, inputs = _greedy(base, PROMPTS, "a")
    assert sched.forward_path == "fast", sched.forward_path_why
    sched.load_adapter("a", str(folder))
    _same(_run(sched, inputs), want)
    return sched


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_a_mixture_of_experts_takes_adapters_on_its_attention_and_dense_layers(kind, tmp_path):
    """Qwen3-MoE and gpt-oss (its sliding window, attention sinks) on the engine's passes, their
    experts by their own modules: an adapter of the attention computes what the merged model
    does; the MLP projections of Qwen3-MoE's dense layer take one too; those of a layer of
    experts, and peft's adapters of the experts' fused weights, are refused, naming the layer
    or the key."""
    if kind == "gpt_oss":
        moe = make_gpt_oss_model(tmp_path / "moe", window=3)
    else:
        moe = make_tiny_moe_model(tmp_path / "moe", seed=4, dense_layers=(1,))
    sched = _as_merged(moe, tmp_path / "a", ["q_proj", "o_proj"])
    if kind == "gpt_oss":
        return
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())

    def mlp(layer: int) -> dict[str, torch.Tensor]:
        at = f"base_model.model.model.layers.{layer}.mlp.gate_proj"
        return {f"{at}.lora_A.weight": torch.ones(4, 32), f"{at}.lora_B.weight": torch.ones(64, 4)}

    sched.load_adapter_from("dense", config, lambda: mlp(1))
    with pytest.raises(AdapterError, match="layer 0's MLP is a mixture of experts"):
        sched.load_adapter_from("b", config, lambda: mlp(0))
    _adapter(moe, tmp_path / "experts", seed=1, targets=["down_proj"])
    with pytest.raises(AdapterError, match=r"layers\.0\.mlp\.experts\.lora_A\.weight: not a"):
        sched.load_adapter("c", str(tmp_path / "experts"))


@pytest.mark.timeout(120)
def test_a_gemma3_adapter_computes_what_its_merged_model_does(tmp_path):
    """Gemma 3 on the engine's passes (its four norms, its scaled embedding, a sliding layer):
    an adapter of every projection, applied unmerged, as peft's merged model."""
    _as_merged(make_tiny_gemma3_model(tmp_path / "gemma", window=3), tmp_path / "a", "all-linear")


@pytest.mark.timeout(120)
def test_a_phi3_adapter_of_its_own_fused_projections_computes_what_its_merged_model_does(
    model_dir, tmp_path
):
    """Phi-3 (its own qkv_proj and gate_up_proj, half of each head rotated, a sliding window)
    on the engine's passes: an adapter of every projection as peft's merged model; one of q_proj,
    which its layers do not have, refused naming it, as is its adapter on a Qwen2."""
    phi3 = make_tiny_phi3_model(tmp_path / "phi3", window=3)
    sched = _as_merged(phi3, tmp_path / "a", "all-linear")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    at = "base_model.model.model.layers.1.self_attn"
    split = {f"{at}.q_proj.lora_A.weight": torch.ones(4, 32)}
    split[f"{at}.q_proj.lora_B.weight"] = torch.ones(32, 4)
    with pytest.raises(AdapterError, match=r"layers\.1\.self_attn\.q_proj: the model's layer"):
        sched.load_adapter_from("split", config, lambda: split)
    qwen = Scheduler(load_model(str(model_dir), device="cpu").model, max_running=4)
    with pytest.raises(AdapterError, match=r"layers\.0\.mlp\.gate_up_proj: the model.s"):
        qwen.load_adapter("fused", str(tmp_path / "a"))


@pytest.mark.timeout(120)
def test_an_adapter_of_an_mlp_without_a_gate_computes_what_its_merged_model_does(tmp_path):
    """Arcee's MLP (up, ReLU², down; no gate) on the engine's passes: an adapter of every
    projection as peft's merged model."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "arcee", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
        eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    _as_merged(with_tiny_words(tmp_path / "arcee", config, 7), tmp_path / "a", "all-linear")


@pytest.mark.timeout(120)
def test_latent_attention_takes_adapters_of_its_output_projection(tmp_path):
    """DeepSeek-V3's layout (multi-head latent attention, V2-Lite's one q projection, experts
    after a dense layer) on the engine's passes: an adapter of o_proj as peft's merged model;
    one of q_proj refused, naming the layer."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=128, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=1, topk_group=1, pad_token_id=0, eos_token_id=1,
        bos_token_id=None,
    )  # fmt: skip
    model = with_tiny_words(tmp_path / "deepseek", config, 8)
    sched = _as_merged(model, tmp_path / "a", ["o_proj"])
    adapter = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    at = "base_model.model.model.layers.1.self_attn.q_proj"
    q = {f"{at}.lora_A.weight": torch.ones(4, 32), f"{at}.lora_B.weight": torch.ones(48, 4)}
    with pytest.raises(AdapterError, match="layer 1's attention is multi-head latent attention"):
        sched.load_adapter_from("q", adapter, lambda: q)


def test_gpt_neox_on_the_engines_passes_refuses_adapters_naming_the_key():
    """Pythia (GPT-NeoX) runs on the engine's passes, whose adapters cover Llama's module
    names only: peft's adapter of its query_key_value is refused, naming the key."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt_neox", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4,
    )  # fmt: skip
    sched = Scheduler(AutoModelForCausalLM.from_config(config).eval(), max_running=2)
    assert sched.forward_path == "fast", sched.forward_path_why
    key = "base_model.model.gpt_neox.layers.0.attention.query_key_value.lora_A.weight"
    with pytest.raises(AdapterError, match=f"{key}: not a LoRA weight"):
        sched.load_adapter_from("x", {"r": 2}, lambda: {key: torch.ones(2, 32)})


def test_folders_that_do_not_fit_are_refused_with_what_and_where(model_dir, tmp_path):
    base = load_model(str(model_dir), device="cpu").model
    sched = Scheduler(base, max_running=4)
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        sched.load_adapter("x", str(tmp_path))
    _adapter(model_dir, tmp_path / "ok", seed=1, targets=["q_proj"], rank=2)
    config = json.loads((tmp_path / "ok" / "adapter_config.json").read_text())
    (tmp_path / "bad_rank").mkdir()
    (tmp_path / "bad_rank" / "adapter_config.json").write_text(json.dumps({**config, "r": 3}))
    (tmp_path / "bad_rank" / "adapter_model.safetensors").write_bytes(
        (tmp_path / "ok" / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match=r"q_proj.lora_A: shape \[2, 32\], want \[3, 32\]"):
        sched.load_adapter("x", str(tmp_path / "bad_rank"))
    other = make_tiny_model(tmp_path / "wide", seed=0, hidden=48, with_tokenizer=False)
    _adapter(other, tmp_path / "wide_adapter", seed=1, targets=["q_proj"], rank=2)
    with pytest.raises(AdapterError, match="want"):
        sched.load_adapter("x", str(tmp_path / "wide_adapter"))
    sched.load_adapter("ok", str(tmp_path / "ok"))
    sched.run_until_idle()
    with pytest.raises(AdapterError, match="already loaded"):
        sched.load_adapter("ok", str(tmp_path / "ok"))


@pytest.mark.timeout(60)
def test_the_routes_answer_as_sglang_and_requests_name_loaded_adapters_only(model_dir, tmp_path):
    _adapter(model_dir, tmp_path / "a", seed=1, targets="all-linear")
    loaded = load_model(str(model_dir), device="cpu")
    sched = Scheduler(loaded.model, max_running=4)
    sched.start()

    async def main():
        client = TestClient(TestServer(build_app(loaded, sched)))
        await client.start_server()
        try:
            body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3}}
            r = await client.post("/generate", json={**body, "lora_path": "a"})
            assert r.status == 400
            assert "no LoRA adapter 'a' is loaded" in (await r.json())["error"]["message"]
            r = await client.post(
                "/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "a")}
            )
            assert r.status == 200, await r.text()
            assert await r.json() == {
                "success": True,
                "error_message": None,
                "loaded_adapters": {"a": str(tmp_path / "a")},
            }
            r = await client.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": "/x"})
            answer = await r.json()
            assert r.status == 400 and answer["success"] is False
            assert "no adapter_config.json" in answer["error_message"]
            assert answer["loaded_adapters"] == {"a": str(tmp_path / "a")}
            r = await client.post("/generate", json={**body, "lora_path": "a"})
            assert r.status == 200 and len((await r.json())["output_ids"]) == 3
            batch = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 2}}
            r = await client.post("/generate", json={**batch, "lora_path": ["a", None]})
            assert r.status == 400 and "lora_path" in (await r.json())["error"]["message"]
            r = await client.post("/generate", json={**batch, "lora_path": ["a", None, "a"]})
            assert r.status == 200 and len(await r.json()) == 3
            r = await client.post("/unload_lora_adapter", json={"lora_name": "a"})
            assert r.status == 200 and (await r.json())["loaded_adapters"] == {}
            r = await client.post("/unload_lora_adapter", json={"lora_name": "a"})
            assert r.status == 400 and "no adapter 'a'" in (await r.json())["error_message"]
            r = await client.post("/generate", json={**body, "lora_path": "a"})
            assert r.status == 400
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        sched.stop()


@pytest.mark.timeout(120)
def test_the_openai_routes_take_the_adapter_from_model_or_lora_path_as_sglang(model_dir, tmp_path):
    """SGLang's OpenAIServingBase._resolve_lora_path: ``model: "BASE:ADAPTER"`` names the
    adapter (before ``lora_path``), else the request's ``lora_path``; /v1/models lists the
    loaded adapters (its available_models). Greedy answers equal /generate's with the adapter."""
    _adapter(model_dir, tmp_path / "a", seed=1, targets="all-linear")
    loaded = load_model(str(model_dir), device="cpu")
    sched = Scheduler(loaded.model, max_running=4)
    sched.start()
    template = "{% for m in messages %}w7 {{ m.content }} w10 {% endfor %}w8 "

    async def main():
        client = TestClient(TestServer(build_app(loaded, sched, chat_template=template)))
        await client.start_server()
        try:
            r = await client.post(
                "/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "a")}
            )
            assert r.status == 200, await r.text()
            cards = (await (await client.get("/v1/models")).json())["data"]
            assert [c["id"] for c in cards] == [str(model_dir), "a"]
            assert cards[1]["root"] == str(tmp_path / "a")
            assert cards[1]["parent"] == str(model_dir) and cards[1]["max_model_len"] is None

            greedy = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
            native = {"input_ids": PROMPTS[0], "sampling_params": greedy}
            adapted = await (
                await client.post("/generate", json={**native, "lora_path": "a"})
            ).json()
            base = await (await client.post("/generate", json=native)).json()
            assert adapted["output_ids"] != base["output_ids"]  # the adapter changes the answer

            v1 = {
                "prompt": PROMPTS[0],
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            for extra in (
                {"model": "tiny:a"},
                {"model": " tiny : a "},  # stripped, as SGLang does
                {"model": "tiny", "lora_path": "a"},
                {"model": "tiny:a", "lora_path": "nope"},  # model first
            ):
                r = await client.post("/v1/completions", json={**v1, **extra})
                assert r.status == 200, (extra, await r.text())
                answer = await r.json()
                assert answer["choices"][0]["token_ids"] == adapted["output_ids"], extra
                assert answer["model"] == extra["model"]
            for extra in ({"model": "tiny"}, {"model": "tiny:"}, {"model": "x", "lora_path": ""}):
                r = await client.post("/v1/completions", json={**v1, **extra})
                assert (await r.json())["choices"][0]["token_ids"] == base["output_ids"], extra

            chat = {"messages": [{"role": "user", "content": "w5 w9"}], "max_tokens": 3}
            r = await client.post("/v1/chat/completions", json={**chat, "model": "tiny:a"})
            assert r.status == 200, await r.text()
            for route, body in (("/v1/completions", v1), ("/v1/chat/completions", chat)):
                for stream in (False, True):
                    r = await client.post(
                        route, json={**body, "model": "tiny:zz", "stream": stream}
                    )
                    assert r.status == 400, (route, stream)
                    error = await r.json()
                    assert error["param"] == "model", (route, stream, error)
                    assert "model: no LoRA adapter 'zz' is loaded" in error["message"]
                r = await client.post(route, json={**body, "model": "tiny", "lora_path": "zz"})
                assert r.status == 400 and (await r.json())["param"] == "lora_path"
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        sched.stop()
