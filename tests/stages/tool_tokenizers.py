"""Tokenizers for the tool tests, built here (never downloaded): one token per character, plus
added tokens, and a small Qwen-like chat template with tools support."""

from __future__ import annotations

import string
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Hermes / Qwen style: tools listed in a system turn, consecutive tool answers in one user turn
QWEN_LIKE = """{%- if tools %}<|im_start|>system
You can call these tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}<|im_start|>user{% endif %}

<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# renders how many messages there are at the top: every appended message rewrites the start
NOT_APPEND_ONLY = "{{ messages | length }} messages{% if tools %} with tools{% endif %}\n" + (
    QWEN_LIKE
)


def char_tokenizer(
    chars: str,
    *,
    special: Sequence[str] = (),
    added: Sequence[str] = (),
    template: str | None = None,
) -> PreTrainedTokenizerFast:
    """``<pad>`` 0, ``<eos>`` 1, one token per character of ``chars``, then ``special`` (special
    added tokens) and ``added`` (plain added tokens)."""
    vocab = {"<pad>": 0, "<eos>": 1}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    if special:
        tok.add_special_tokens({"additional_special_tokens": list(special)})
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if template is not None:
        tok.chat_template = template
    return tok


def calc_tokenizer() -> PreTrainedTokenizerFast:
    """Like the calculator example's model: single characters, the four tags single tokens."""
    return char_tokenizer("0123456789+-*=calc()", added=TAGS)


def plain_tokenizer() -> PreTrainedTokenizerFast:
    """Printable characters only: ``</tool_call>`` is twelve tokens."""
    return char_tokenizer(string.printable)


def chat_tokenizer(template: str = QWEN_LIKE) -> PreTrainedTokenizerFast:
    """Printable characters, ``<|im_start|>`` / ``<|im_end|>`` special, the tags added tokens."""
    return char_tokenizer(
        string.printable, special=["<|im_start|>", "<|im_end|>"], added=TAGS, template=template
    )
