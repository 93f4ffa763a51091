"""``--preferred-sampling-params``: sampling parameters a request gets where it names none, as
SGLang 0.5.23 merges them (``TokenizerManager._create_tokenized_object``:
``{**preferred, **obj.sampling_params}``) and reports them (``/model_info``).

A native ``/generate`` request (and a generator's in-process one) takes every key it leaves
out. The OpenAI-compatible routes set most keys themselves, even to None where the request
says nothing, and SGLang's merge lets those win: ``/v1/completions`` and ``/v1/chat/
completions`` (and ``/v1/messages``, built on chat) take only the keys their builders leave
out (``openai_api.ROUTE_KEYS``), ``/v1/responses`` also those it omits when unset, Ollama's
routes all but ``max_new_tokens``. The scoring routes sample nothing, so nothing is merged there.

The value is checked at start, where SGLang checks it only when each request is parsed:
keys and values as a request's ``sampling_params`` (its words for ``watermark``), and no ``n``,
since the samples a request asks for are its own (SGLang expands ``n`` before the merge).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any


def parse(text: str) -> dict[str, Any]:
    """The flag's value (argparse's type): a JSON object, without ``watermark`` (SGLang's
    words) or an ``n`` other than 1."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    if "watermark" in value:
        raise argparse.ArgumentTypeError(
            "watermark is not supported in --preferred-sampling-params"
        )
    if value.get("n", 1) not in (1, None):
        raise argparse.ArgumentTypeError(
            f"n={value['n']!r}: the samples a request asks for are its own (give n in the request)"
        )
    return value


def merged(sampling: Any, preferred: Mapping[str, Any], kept: frozenset[str]) -> Any:
    """A body's ``sampling_params`` with ``preferred``'s keys (those not in ``kept``) where it
    has none; a list, entry by entry. Anything else is left for the route's parser to
    refuse."""
    under = {k: v for k, v in preferred.items() if k not in kept}
    if not under:
        return sampling
    if sampling is None:
        return dict(under)
    if isinstance(sampling, dict):
        return {**under, **sampling}
    if isinstance(sampling, list):
        return [{**under, **entry} if isinstance(entry, dict) else entry for entry in sampling]
    return sampling


def with_preferred(
    body: Any, preferred: Mapping[str, Any] | None, kept: frozenset[str] = frozenset()
) -> Any:
    """``body`` (a native ``/generate`` body) with ``preferred`` merged under its
    ``sampling_params`` (``merged``); the caller's body is left as it was."""
    if not preferred or not isinstance(body, dict):
        return body
    sampling = merged(body.get("sampling_params"), preferred, kept)
    if sampling is body.get("sampling_params"):
        return body
    return {**body, "sampling_params": sampling}
