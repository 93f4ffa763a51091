"""A chat template rendered as ``tokenizer.apply_chat_template(..., tokenize=False)`` renders
it, at a fraction of its cost.

``apply_chat_template`` spends more than half of its time around the template itself: it
converts message objects to dicts, copies every message, tool and keyword into plain JSON
types (a sandbox measure against rich objects such as images), and looks up the tokenizer's
special tokens, on every call. A request's messages here were parsed from JSON and are plain
already, so ``TemplateRenderer`` does only what changes the rendered text, with transformers'
own parts: the template compiled by transformers (its sandboxed environment, ``tojson``,
``raise_exception``, ``strftime_now``, the ``generation`` tag), each message without its
``None`` fields where this transformers drops them (``_normalize_chat_messages``, 5.2x; 5.19,
which SGLang 0.5.23 pins, passes them on), reasoning under every name templates read it
by (transformers' ``_alias_reasoning_fields``, where this transformers has it), and the
special tokens and keywords as the template's variables. Measured on arith-tiny's pass-through
template: 23 us a call through ``apply_chat_template``, 10 us here.

Where transformers lacks the parts it uses (another version), or a message is not a plain
dict, it calls ``apply_chat_template`` itself; ``tests/stages/test_engine_chat_template.py``
holds the two to the same text over the shipped templates and every kind of message.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["TemplateRenderer"]

try:  # transformers' own parts (private names: checked once, else apply_chat_template)
    from transformers.utils.chat_template_utils import _compile_jinja_template as _compile
except ImportError:  # pragma: no cover - another transformers
    _compile = None
try:
    from transformers.utils.chat_template_utils import _alias_reasoning_fields as _alias
except ImportError:  # pragma: no cover - a transformers that passes reasoning as it is
    _alias = None
try:  # a transformers that drops a message's None fields (5.2x); 5.19, SGLang 0.5.23's pin,
    # hands them to the template as they are (a qwen-like template writes "None")
    from transformers.utils.chat_template_utils import _normalize_chat_messages  # noqa: F401

    _DROPS_NONE = True
except ImportError:  # pragma: no cover - an older transformers
    _DROPS_NONE = False


def _reserved(tokenizer: Any) -> frozenset[str]:
    """The keywords a template cannot take as its own variables: ``apply_chat_template``'s
    parameters and the template's fixed ones (a request's ``chat_template_kwargs`` naming one
    gets ``apply_chat_template``'s own error)."""
    names = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    return frozenset(names | {"messages", "documents", "conversations"})


class TemplateRenderer:
    """``render(messages, tools, template, add_generation_prompt, kwargs)``: the text of a
    conversation through ``tokenizer``'s chat template (``template``: another one, as
    ``apply_chat_template``'s ``chat_template``). Raises what the template raises, and what
    ``apply_chat_template`` raises for a tokenizer without a template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.fast = _compile is not None and hasattr(tokenizer, "get_chat_template")
        # the special tokens (bos_token, eos_token, ...) every render passes the template
        self.special = dict(tokenizer.special_tokens_map) if self.fast else {}
        self.reserved = _reserved(tokenizer) if self.fast else frozenset()

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str | None,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> str:
        plain = self.fast and all(type(m) is dict for m in messages)
        if not plain or (kwargs and not self.reserved.isdisjoint(kwargs)):
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        if not messages:  # apply_chat_template's own refusal
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        compiled = _compile(self.tokenizer.get_chat_template(template, tools))
        chat = messages
        if _DROPS_NONE:
            chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if _alias is not None:
            chat = _alias(chat)
        return compiled.render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special, **kwargs},  # the request's keywords over the special tokens
        )
