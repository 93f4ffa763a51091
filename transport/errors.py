"""The transport's error taxonomy.

Closed-by-you, end-of-stream and a bad message are different situations and get different
exceptions: ``ChannelClosed`` means this side called ``aclose()``; ``EndOfStream`` means every
expected producer said it was finished and the inbox is drained (a normal ending, not a failure);
``DecodeError`` means one message could not be understood (the channel counts it, logs it and
keeps running). Nothing here does I/O.
"""

from __future__ import annotations

__all__ = ["ChannelClosed", "DecodeError", "EndOfStream", "TransportError"]


class TransportError(Exception):
    """Base of every error the transport raises on purpose."""


class ChannelClosed(TransportError):
    """The channel was closed by this side (``aclose()``); it cannot be used any more."""


class EndOfStream(TransportError):
    """Every expected producer has sent end-of-stream and the inbox is drained."""


class DecodeError(TransportError):
    """A message could not be decoded or does not match its schema.

    ``reason`` is a short snake_case tag that metrics count by (``bad_header``, ``not_msgpack``,
    ``missing_kind``, ``frame_count``, ``frame_size``, ``bad_dtype``, ``unknown_kind``,
    ``bad_version``, ``invalid_fields``, ``bad_control``); ``detail`` says what exactly was wrong.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
