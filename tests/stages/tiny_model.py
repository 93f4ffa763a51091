"""A tiny random Qwen2-style causal LM with a word-level tokenizer, saved to a directory.

``make_tiny_model(path)`` writes ``config.json``, the weights and a ``PreTrainedTokenizerFast``
(words ``w0``..``wN`` split on whitespace, plus ``<pad>``, ``<eos>``, ``<unk>``) so that tests
can load it with ``AutoModelForCausalLM`` / ``AutoTokenizer`` without any download. The same
seed gives the same weights. Nothing here is meant to be a good language model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

__all__ = [
    "BYTE_CHARS",
    "EOS_ID",
    "make_byte_model",
    "make_gpt_oss_model",
    "make_mlp_reward",
    "make_tiny_classifier",
    "make_tiny_model",
    "make_tiny_moe_model",
    "make_tiny_phi3_model",
    "make_tiny_qwen3_5_model",
    "spread_weights",
    "tiny_config",
    "with_tiny_words",
]

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


def tiny_config(
    *,
    vocab: int = 128,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    tie_word_embeddings: bool = False,
    max_positions: int = 512,
) -> Qwen2Config:
    """The configuration ``make_tiny_model`` saves for these sizes."""
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=None,
    )


def make_tiny_model(
    path: Path, *, seed: int = 0, with_tokenizer: bool = True, **sizes: Any
) -> Path:
    """Save a random Qwen2 model of ``tiny_config(**sizes)`` (and a tokenizer of its vocabulary)
    under ``path``; returns ``path``."""
    config = tiny_config(**sizes)
    path = _save_random(AutoModelForCausalLM, config, path, seed)
    if with_tokenizer:
        _tokenizer(config.vocab_size).save_pretrained(path)
    return path


def make_tiny_moe_model(
    path: Path,
    *,
    seed: int = 0,
    dense_layers: tuple[int, ...] = (1,),
    hidden: int = 32,
    layers: int = 3,
    experts: int = 8,
    tokenizer_from: Path | None = None,
) -> Path:
    """A random Qwen3-MoE (``Qwen3MoeForCausalLM``; by default tiny: 3 layers of 8 experts, 2
    a token, the layers ``dense_layers`` a plain MLP, as Qwen3-MoE's ``mlp_only_layers``)
    with ``make_tiny_model``'s tokenizer (128 words), or with the tokenizer (and generation
    config) of the model at ``tokenizer_from``, whose vocabulary it then takes."""
    from transformers import Qwen3MoeConfig

    vocab = 128
    if tokenizer_from is not None:
        vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, num_experts=experts, num_experts_per_tok=2,
        mlp_only_layers=list(dense_layers), max_position_embeddings=512, pad_token_id=PAD_ID,
        eos_token_id=EOS_ID, bos_token_id=None,
    )  # fmt: skip
    path = _save_random(AutoModelForCausalLM, config, path, seed)
    if tokenizer_from is None:
        _tokenizer(config.vocab_size).save_pretrained(path)
        return path
    return copy_tokenizer(tokenizer_from, path)


def copy_tokenizer(source: Path, path: Path) -> Path:
    """The tokenizer (and generation config) of the model folder ``source`` put in ``path``,
    beside a model of its vocabulary; returns ``path``."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def make_tiny_classifier(
    path: Path, *, seed: int = 0, labels: tuple[str, ...] = ("reward",), **sizes: Any
) -> Path:
    """Save a random ``Qwen2ForSequenceClassification`` (a reward model with one label, or a
    classifier of ``labels``) of ``tiny_config(**sizes)`` and its tokenizer, whose chat template
    writes each message as ``ROLE: CONTENT`` words; returns ``path``."""
    config = tiny_config(**sizes)
    config.architectures = ["Qwen2ForSequenceClassification"]
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {name: i for i, name in enumerate(labels)}
    path = _save_random(AutoModelForSequenceClassification, config, path, seed)
    tokenizer = _tokenizer(config.vocab_size)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} <eos> {% endfor %}"
    )
    tokenizer.save_pretrained(path)
    return path


def _save_random(auto: Any, config: Qwen2Config, path: Path, seed: int) -> Path:
    """A model of ``config`` (``auto``: its transformers auto class) with seeded random weights,
    saved under ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=torch.float32)
    # Random init is near-uniform; wider weights make greedy choices far from ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


def _tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    words = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<unk>": UNK_ID}
    words.update({f"w{i}": i for i in range(3, vocab)})
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def make_arith_model(path: Path, *, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    """A random tiny Qwen2 with the arithmetic task's character tokenizer (16 tokens)."""
    from stages.feeder.arithmetic import EOS_ID as ARITH_EOS
    from stages.feeder.arithmetic import PAD_ID as ARITH_PAD
    from stages.feeder.arithmetic import make_tokenizer

    path = Path(path)
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        pad_token_id=ARITH_PAD,
        eos_token_id=ARITH_EOS,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


# the characters of make_byte_model's tokenizer (no whitespace: a constrained JSON cannot pad)
BYTE_CHARS = '{}[]":,.-+0123456789abcdefghijklmnopqrstuvwxyz'
_BYTE_WORDS = ("true", "false", "null")  # whole tokens as well


def make_byte_model(
    path: Path, *, seed: int = 0, chars: str = BYTE_CHARS, words: tuple[str, ...] = (), **sizes: Any
) -> Path:
    """A random tiny Qwen2 with a byte-level BPE tokenizer (GPT-2's byte alphabet, as Qwen's
    and Llama 3's): ``<pad>``, ``<eos>``, each of ``chars`` (one of several bytes: each byte
    too, merged into it), a few words and ``words`` (whole tokens, as Qwen's ``<tool_call>``).
    Its text is its tokens' texts joined, so grammars can constrain it."""
    path = Path(path)
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID}
    merges = []
    for ch in chars:
        symbols = level.pre_tokenize_str(ch)[0][0]
        if len(symbols) == 1:
            vocab[symbols] = len(vocab)
            continue
        for byte in symbols:  # a character of several bytes: each byte, then merged
            vocab.setdefault(byte, len(vocab))
        for end in range(2, len(symbols) + 1):
            merges.append((symbols[: end - 1], symbols[end - 1]))
            vocab.setdefault(symbols[:end], len(vocab))
    for word in words:
        vocab.setdefault("".join(level.pre_tokenize_str(word)[0][0]), len(vocab))
    for word in _BYTE_WORDS:
        for end in range(2, len(word) + 1):
            merges.append((word[: end - 1], word[end - 1]))
            vocab.setdefault(word[:end], len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = level
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    make_tiny_model(path, seed=seed, with_tokenizer=False, vocab=len(vocab), **sizes)
    tokenizer.save_pretrained(path)
    return path


def make_tagged_byte_model(
    path: Path, tags: tuple[str, ...], *, seed: int = 4, chars: str = BYTE_CHARS + "\n"
) -> Path:
    """A byte-level model (``make_byte_model``, newlines too) whose ``tags`` are whole tokens,
    added as Qwen3's ``<think>`` and ``<tool_call>`` are (not special): the only way to write
    them, so that text holds each whole."""
    from transformers import AutoTokenizer

    model = make_byte_model(path, seed=seed, chars=chars, words=tags)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(list(tags))  # already in the vocabulary: now read whole in text
    tokenizer.save_pretrained(model)
    return model


HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                  "<|call|>", "<|return|>")  # fmt: skip
# a chat template that writes each message as Harmony does, and opens the assistant's
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def make_tiny_gemma3_model(path: Path, *, window: int = 3, seed: int = 5) -> Path:
    """A random tiny Gemma 3 text model (``Gemma3ForCausalLM``, ``gemma3_text``: a sliding
    layer of ``window``, then a full one, each with its rotary table) with ``make_tiny_model``'s
    tokenizer (128 words)."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        pad_token_id=PAD_ID,
    )  # fmt: skip
    return with_tiny_words(path, config, seed)


def make_tiny_phi3_model(path: Path, *, window: int = 3, seed: int = 6) -> Path:
    """A random tiny Phi-3 (``Phi3ForCausalLM``: its own fused ``qkv_proj`` and
    ``gate_up_proj``), with Phi-4-mini's partial rotary embedding (half of each head) and a
    sliding window of ``window`` on every layer, and ``make_tiny_model``'s tokenizer."""
    from transformers import Phi3Config

    config = Phi3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5,
        sliding_window=window, max_position_embeddings=512, pad_token_id=PAD_ID,
        eos_token_id=EOS_ID, bos_token_id=None,
    )  # fmt: skip
    return with_tiny_words(path, config, seed)


def qwen3_5_config(vocab_size: int = 128) -> Any:
    """A tiny Qwen3.5 text model's config: three gated-delta-net (linear-attention) layers,
    then a full-attention one, as Qwen3.5 and Qwen3-Next alternate them."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=512,
        layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=PAD_ID,
        eos_token_id=EOS_ID, bos_token_id=None,
    )  # fmt: skip


def make_tiny_qwen3_5_model(path: Path, *, seed: int = 7) -> Path:
    """A random tiny Qwen3.5 text model (``qwen3_5_config``, weights spread by
    ``spread_weights`` so that greedy answers vary) with ``make_tiny_model``'s tokenizer."""
    return with_tiny_words(path, qwen3_5_config(), seed, spread=True)


def spread_weights(model: torch.nn.Module, std: float = 0.3) -> torch.nn.Module:
    """``model``'s matrices drawn again from N(0, std): transformers' initialization (0.02)
    makes a tiny model's greedy answers one token repeated, which hides a wrong state."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, std)
    return model


def with_tiny_words(path: Path, config: Any, seed: int, *, spread: bool = False) -> Path:
    """A random model of ``config`` (transformers' own initialization; ``spread``: with
    ``spread_weights``) saved under ``path`` with ``make_tiny_model``'s tokenizer (128
    words)."""
    make_tiny_model(path, vocab=128, seed=seed)  # its tokenizer; the weights are replaced
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spread:
        spread_weights(model)
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(path)
    return path


def make_gpt_oss_model(
    path: Path, *, seed: int = 4, chars: str = BYTE_CHARS + " _=\n", window: int | None = None
) -> Path:
    """A random tiny gpt-oss (``GptOssForCausalLM``, ``model_type`` ``gpt_oss``) on a
    byte-level tokenizer (``make_byte_model``'s) with Harmony's tokens as special tokens, a chat
    template that writes Harmony's messages, and gpt-oss's stop tokens (``<|return|>``,
    ``<|call|>``, its end of text) in ``generation_config.json``; full-attention layers, or
    with ``window`` a sliding-window layer of that window first, as gpt-oss alternates them."""
    import json

    from transformers import AutoTokenizer, GptOssConfig

    path = make_byte_model(path, seed=seed, chars=chars)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    tokenizer.chat_template = HARMONY_TEMPLATE
    config = GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=4096, pad_token_id=PAD_ID,
        eos_token_id=EOS_ID, tie_word_embeddings=False, sliding_window=window or 128,
        layer_types=["sliding_attention" if window else "full_attention", "full_attention"],
    )  # fmt: skip
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    _save_random(AutoModelForCausalLM, config, path, seed)
    tokenizer.save_pretrained(path)
    stops = [EOS_ID, *tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return path


# a model folder's own code (auto_map): subclasses of Qwen2's config and model
_CONFIG_CODE = """from transformers import Qwen2Config


class TinyCustomConfig(Qwen2Config):
    model_type = "tiny_custom"
"""
_MODEL_CODE = """from transformers import Qwen2ForCausalLM

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(Qwen2ForCausalLM):
    config_class = TinyCustomConfig
"""


def with_own_code(model_dir: Path, dest: Path) -> Path:
    """A copy of the Qwen2 folder ``model_dir`` at ``dest`` whose config and model classes are
    its own code (``auto_map``: subclasses in ``configuration_tiny.py`` and ``modeling_tiny.py``,
    the same weights), as MiniCPM's or InternLM's folders ship theirs; returns ``dest``."""
    shutil.copytree(model_dir, dest)
    (dest / "configuration_tiny.py").write_text(_CONFIG_CODE)
    (dest / "modeling_tiny.py").write_text(_MODEL_CODE)
    config = json.loads((dest / "config.json").read_text())
    config.update(
        model_type="tiny_custom",
        architectures=["TinyCustomForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
        },
    )
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def make_mlp_reward(path: Path, architecture: str, seed: int) -> Path:
    """A tiny checkpoint of ``architecture`` (``Qwen2ForRewardModel`` or
    ``Qwen3ForRewardModel``): a base model's tensors under ``model.``, the head's under
    ``score.0.`` and ``score.2.``, a causal LM head's ``lm_head.weight`` too; its config's
    ``auto_map`` names modeling code that is not there (the engine must not need it)."""
    path.mkdir(parents=True, exist_ok=True)
    qwen2 = tiny_config()
    if architecture == "Qwen3ForRewardModel":
        config = Qwen3Config(**{k: v for k, v in qwen2.to_dict().items() if k != "model_type"})
    else:
        config = qwen2
    config.architectures = [architecture]
    torch.manual_seed(seed)
    base = AutoModel.from_config(config, dtype=torch.float32)
    hidden = config.hidden_size
    tensors = {f"model.{k}": v.detach().clone() for k, v in base.state_dict().items()}
    for k in list(tensors):
        if tensors[k].dim() > 1:
            tensors[k] = torch.randn_like(tensors[k]) * 0.3  # wide: rewards far apart
    tensors["score.0.weight"] = torch.randn(hidden, hidden) * 0.3
    tensors["score.0.bias"] = torch.randn(hidden) * 0.1
    tensors["score.2.weight"] = torch.randn(1, hidden) * 0.3
    tensors["score.2.bias"] = torch.randn(1) * 0.1
    tensors["lm_head.weight"] = torch.randn(config.vocab_size, hidden)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    raw = config.to_dict()
    raw["auto_map"] = {
        "AutoConfig": "configuration_rm.RMConfig",
        "AutoModel": f"modeling_rm.{architecture}",
    }
    (path / "config.json").write_text(json.dumps(raw))
    _tokenizer(config.vocab_size).save_pretrained(path)
    return path
