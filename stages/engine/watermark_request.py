"""A request's ``watermark`` as SGLang 0.5.23 checks it on a server that does not watermark.

SGLang 0.5.23 can watermark text (Aaronson-Gumbel, ``--enable-watermark``); a request may ask
for it with ``watermark: {enabled, key, context_window}``, at the top of a ``/generate`` body
(one, or one per prompt of a batch), inside ``sampling_params``, or on the ``/v1`` routes. The
built-in engine does not watermark, as SGLang does not without its flag, so what it serves is
what such a SGLang server serves: no ``watermark``, or one that turns it off
(``{enabled: false}``). The rest is refused in SGLang's words
(``sampling/watermarking/core.py``: ``normalize_watermark_request``, then
``resolve_watermark_request`` with the server's defaults; ``config.parse_watermark_key``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_watermark"]

_FIELDS = frozenset({"enabled", "key", "context_window"})
_SERVER_CONTEXT_WINDOW = 4  # SGLang's watermark_context_window default


def check_watermark(value: Any) -> str | None:
    """Why SGLang 0.5.23 refuses ``value`` on a server without ``--enable-watermark`` (None:
    it serves the request, unwatermarked)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return "watermark must be an object"
    if set(value) - _FIELDS:
        return "watermark contains unknown fields"
    enabled, key, window = value.get("enabled"), value.get("key"), value.get("context_window")
    if enabled is not None and type(enabled) is not bool:
        return "watermark enabled must be a boolean"
    if key is not None:
        why = _key_error(key)
        if why is not None:
            return why
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            return "watermark context_window must be a positive integer"
        if window > _SERVER_CONTEXT_WINDOW:
            return (
                "request watermark context_window cannot exceed the server's watermark "
                "context_window"
            )
    if enabled is False:
        if key is not None:
            return "request watermark key cannot be combined with enabled=false"
        return None
    if enabled is not True and key is None:
        return "request watermark must set enabled or key"
    return "request watermarking requires the server to enable --enable-watermark"


def _key_error(key: Any) -> str | None:
    if not isinstance(key, str):
        return "watermark key must be a hex string"
    digits = key[2:] if key.lower().startswith("0x") else key
    if not 1 <= len(digits) <= 16:
        return "watermark key must contain 1 to 16 hex digits"
    if any(c not in "0123456789abcdefABCDEF" for c in digits):
        return "watermark key must contain only hex digits"
    return None
