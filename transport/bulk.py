"""Sealed bulk frames: large arrays of a CURVE channel travel beside it, AES-GCM sealed.

CurveZMQ encrypts every frame with XSalsa20-Poly1305 as one unit, inside libzmq's I/O thread,
with two full-size copies of the frame on each side. For a 64 MB tensor that is about a third of
plain throughput (``python bench/transport.py --curve``). So a CURVE channel sends frames of
``BULK_MIN_BYTES`` or more another way, the way TLS does: the key exchange and everything small
stay on the CURVE socket, and the bulk bytes are sealed with AES-256-GCM (AES-NI, several GB/s a
core) under a key that only the CURVE channel carries.

- The consumer binds a second, plain socket (PULL, its port announced in its CREDIT, which
  travels over CURVE) next to its inbox.
- For each message with large frames the producer draws a fresh 256-bit key and a 128-bit token,
  seals each large frame in ``CHUNK_BYTES`` pieces (nonce = frame index and piece index; the
  token is the associated data) and sends ``[token, piece, piece, ...]`` on the bulk socket. The
  DATA message on the CURVE socket carries an empty frame in each sealed frame's place and, in its
  header, the descriptor ``{"token", "key", "frames": [[index, size], ...]}``.
- The consumer pairs the two by token, opens every piece into the array's final buffer (the one
  pass that also assembles it) and decodes the message as if the frames had come whole.

What this keeps: only a holder of the CURVE channel learns a message's key, so a peer without the
run's keys can neither read bulk pieces nor forge them (a tampered, truncated, reordered or
replayed piece fails its tag or its count: ``bulk_forged``). A key seals one message only, so a
nonce never repeats under a key. What reaches the bulk port without a matching DATA is dropped
after a while, bounded in bytes, and counted (``bulk_unclaimed``); a DATA whose pieces never come
is dropped and counted (``bulk_missing``). Small messages never take this path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from transport.errors import DecodeError

__all__ = ["BULK_MIN_BYTES", "CHUNK_BYTES", "MAX_PIECE_BYTES", "open_sealed", "seal"]

BULK_MIN_BYTES = 1 << 20  # frames this large or larger leave the CURVE socket
CHUNK_BYTES = 1 << 20  # sealed piece size: stays in cache, pipelines across the two processes
TAG_BYTES = 16
TOKEN_BYTES = 16
KEY_BYTES = 32
MAX_PIECE_BYTES = CHUNK_BYTES + TAG_BYTES  # the bulk socket refuses larger frames


def worth_sealing(frames: Sequence[Any]) -> bool:
    """Whether a message has a frame big enough for the bulk path (frame 0 is its header)."""
    return any(memoryview(f).nbytes >= BULK_MIN_BYTES for f in frames[1:])


def _nonce(index: int, piece: int) -> bytes:
    return index.to_bytes(4, "big") + piece.to_bytes(8, "big")


def seal(frames: Sequence[Any]) -> tuple[list[Any], dict[str, Any], list[bytes]]:
    """Split ``frames`` (encoded message frames) into what goes on the CURVE socket and what
    goes on the bulk socket: ``(frames with empty placeholders, descriptor, bulk parts)``."""
    key, token = os.urandom(KEY_BYTES), os.urandom(TOKEN_BYTES)
    aead = AESGCM(key)
    kept: list[Any] = list(frames)
    parts: list[bytes] = [token]
    sealed: list[list[int]] = []
    for index in range(1, len(frames)):
        view = memoryview(frames[index]).cast("B")
        if view.nbytes < BULK_MIN_BYTES:
            continue
        for piece, start in enumerate(range(0, view.nbytes, CHUNK_BYTES)):
            parts.append(
                aead.encrypt(_nonce(index, piece), view[start : start + CHUNK_BYTES], token)
            )
        sealed.append([index, view.nbytes])
        kept[index] = b""
    return kept, {"token": token, "key": key, "frames": sealed}, parts


def descriptor_token(descriptor: Any) -> bytes:
    """The token a DATA header's ``bulk`` descriptor names; DecodeError if it is malformed."""
    if not isinstance(descriptor, Mapping):
        raise DecodeError("bulk_forged", "the bulk descriptor is not a map")
    token, key, sealed = descriptor.get("token"), descriptor.get("key"), descriptor.get("frames")
    if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
        raise DecodeError("bulk_forged", "the bulk descriptor has no 16-byte token")
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise DecodeError("bulk_forged", "the bulk descriptor has no 32-byte key")
    if not isinstance(sealed, list) or not sealed:
        raise DecodeError("bulk_forged", "the bulk descriptor names no frames")
    return token


def open_sealed(descriptor: Mapping[str, Any], frames: Sequence[Any], parts: Sequence[Any]) -> list:
    """The message's frames with each sealed frame opened from ``parts`` (the bulk message
    after its token), each into one fresh buffer. DecodeError (``bulk_forged``) when anything
    does not add up: a placeholder that is not empty, a piece missing, extra or altered."""
    token = descriptor_token(descriptor)
    aead = AESGCM(descriptor["key"])
    opened: list[Any] = list(frames)
    at = 0
    for entry in descriptor["frames"]:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            raise DecodeError("bulk_forged", f"bad sealed-frame entry {entry!r}"[:200])
        index, size = entry
        if not 1 <= index < len(frames) or _buffer(frames[index]).nbytes != 0:
            raise DecodeError("bulk_forged", f"sealed frame {index} has no empty placeholder")
        pieces = -(-size // CHUNK_BYTES)
        if size < BULK_MIN_BYTES or at + pieces > len(parts):
            raise DecodeError("bulk_forged", f"sealed frame {index}: pieces missing")
        out = np.empty(size, dtype=np.uint8)
        view = memoryview(out)
        for piece in range(pieces):
            start = piece * CHUNK_BYTES
            part = _buffer(parts[at + piece])
            if part.nbytes != min(CHUNK_BYTES, size - start) + TAG_BYTES:
                raise DecodeError("bulk_forged", f"sealed frame {index}: piece {piece} size")
            try:
                aead.decrypt_into(
                    _nonce(index, piece), part, token, view[start : start + part.nbytes - TAG_BYTES]
                )
            except InvalidTag:
                raise DecodeError(
                    "bulk_forged", f"sealed frame {index}: piece {piece} fails its tag"
                ) from None
        at += pieces
        opened[index] = view
    if at != len(parts):
        raise DecodeError("bulk_forged", f"{len(parts) - at} bulk pieces more than sealed")
    return opened


def _buffer(part: Any) -> memoryview:
    buf = getattr(part, "buffer", None)  # zmq.Frame
    return buf if buf is not None else memoryview(part)
