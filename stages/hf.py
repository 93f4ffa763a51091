"""The ``transformers`` names Inflight uses, resolved once, by whichever thread comes first.

``transformers`` is a lazy module that is not safe to resolve from two threads at once, and
stages that share a process (``pipeline.host``) load tokenizers and models in threads of their
own at the same moment ("cannot import name 'AutoModelForCausalLM' from 'transformers'").
Importing this module resolves them all in its body, which Python runs once while every other
thread importing it waits. Import these names from here, not from ``transformers``.
"""

from __future__ import annotations

import transformers

AutoConfig = transformers.AutoConfig
AutoModel = transformers.AutoModel
AutoModelForCausalLM = transformers.AutoModelForCausalLM
AutoModelForSequenceClassification = transformers.AutoModelForSequenceClassification
AutoTokenizer = transformers.AutoTokenizer
DynamicCache = transformers.DynamicCache
PreTrainedTokenizerBase = transformers.PreTrainedTokenizerBase
PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast

__all__ = [
    "AutoConfig",
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForSequenceClassification",
    "AutoTokenizer",
    "DynamicCache",
    "PreTrainedTokenizerBase",
    "PreTrainedTokenizerFast",
]
