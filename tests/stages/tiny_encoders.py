"""Tiny encoders (BERT, XLM-R) with tokenizers of their own, saved as checkpoints the engine
serves: a cross-encoder (``*ForSequenceClassification`` with one label) or an embedder
(``BertModel``), seeded random weights wide enough that scores lie far apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    BertConfig,
    BertTokenizerFast,
    PreTrainedTokenizerFast,
    XLMRobertaConfig,
)

WORDS = [f"w{i}" for i in range(5, 60)]  # the words both vocabularies have


def _widen(model: torch.nn.Module, seed: int) -> None:
    """Wider random weights than the initializer's (scores far apart, no ties)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)


def make_bert(
    path: Path, architecture: str, *, seed: int = 0, words: int = len(WORDS), **config: Any
) -> Path:
    """A tiny BERT (``BertForSequenceClassification`` with one label, or ``BertModel``) and its
    WordPiece tokenizer (``words`` words, ``w5`` on), saved under ``path``; ``config``: the
    ``BertConfig``'s fields over the tiny sizes."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(5, 5 + words))]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64, "max_position_embeddings": 64, **config}  # fmt: skip
    cfg = BertConfig(vocab_size=len(vocab), num_labels=1, architectures=[architecture], **sizes)
    auto = AutoModel if architecture == "BertModel" else AutoModelForSequenceClassification
    model = auto.from_config(cfg)
    _widen(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_xlmr(path: Path, *, seed: int = 0, **config: Any) -> Path:
    """A tiny ``XLMRobertaForSequenceClassification`` (one label; padding index 1, so its
    positions start at 2) with a tokenizer that frames pairs as XLM-R's does (``<s> A </s></s>
    B </s>``, every token type 0)."""
    path.mkdir(parents=True, exist_ok=True)
    specials = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab = {**specials, **{w: i + 4 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B:0 </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>",
    )  # fmt: skip
    cfg = XLMRobertaConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=66, num_labels=1, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, type_vocab_size=1,
        architectures=["XLMRobertaForSequenceClassification"], **config,
    )  # fmt: skip
    model = AutoModelForSequenceClassification.from_config(cfg)
    _widen(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
