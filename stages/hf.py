"""The ``transformers`` names Inflight uses, resolved once, by whichever thread comes first.

``transformers`` is a lazy module that is not safe to resolve from two threads at once, and
stages that share a process (``pipeline.host``) load tokenizers and models in threads of their
own at the same moment ("cannot import name 'AutoModelForCausalLM' from 'transformers'").
Importing this module resolves them all in its body, which Python runs once while every other
thread importing it waits. Import these names from here, not from ``transformers``.

``AutoImageProcessor`` alone is resolved when first imported from here (under a lock): its
import takes 1.3 s, which only an engine serving a vision model needs.
"""

from __future__ import annotations

import inspect
import threading
from typing import TYPE_CHECKING, Any

import transformers

if TYPE_CHECKING:
    from transformers import AutoImageProcessor

AutoConfig = transformers.AutoConfig
AutoModel = transformers.AutoModel
AutoModelForCausalLM = transformers.AutoModelForCausalLM
AutoModelForImageTextToText = transformers.AutoModelForImageTextToText
AutoModelForSequenceClassification = transformers.AutoModelForSequenceClassification
AutoTokenizer = transformers.AutoTokenizer
DynamicCache = transformers.DynamicCache
PretrainedConfig = transformers.PretrainedConfig
PreTrainedTokenizerBase = transformers.PreTrainedTokenizerBase
PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast

__all__ = [
    "CACHE_NAMES",
    "AutoConfig",
    "AutoImageProcessor",
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForImageTextToText",
    "AutoModelForSequenceClassification",
    "AutoTokenizer",
    "DynamicCache",
    "PreTrainedTokenizerBase",
    "PreTrainedTokenizerFast",
    "PretrainedConfig",
    "cache_argument",
    "output_cache",
]

_LAZY = ("AutoImageProcessor",)
_lazy_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _lazy_lock:
        value = globals().get(name)
        if value is None:
            value = globals()[name] = getattr(transformers, name)
    return value


# a model forward's keys-and-values argument: "cache" from transformers 5.2x on, where
# "past_key_values" still works with a warning until its removal (5.40)
CACHE_NAMES = ("cache", "past_key_values")


def cache_argument(forward: Any) -> str | None:
    """The name ``forward`` takes its cache by (None: neither name)."""
    try:
        names = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return next((n for n in CACHE_NAMES if n in names), None)


def output_cache(out: Any) -> Any:
    """A forward's returned cache, under either name (None: none)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)
