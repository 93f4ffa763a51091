"""Property tests of the codec: every valid message round-trips; no mutation of its frames makes
``decode`` fail with anything but DecodeError, and every structural mutation is rejected."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from transport import DecodeError, Message, Schema, decode, encode

DTYPES = ["bool", "int8", "int32", "int64", "uint8", "uint64", "float16", "float32", "float64"]

arrays = st.sampled_from(DTYPES).flatmap(
    lambda dtype: hnp.arrays(
        np.dtype(dtype),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    )
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars | arrays,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.builds(
    lambda kind, version, data: Message(kind, data, version=version),
    st.text(min_size=1, max_size=12),
    st.integers(min_value=0, max_value=2**31),
    st.dictionaries(st.text(max_size=8), values, max_size=5),
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, float):
        return isinstance(b, float) and (a == b or (a != a and b != b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b and type(a) is type(b)


def _wire(msg: Message) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]  # what arrives: plain buffers, not the senders' memory


@SETTINGS
@given(messages)
def test_every_valid_message_round_trips(msg: Message) -> None:
    back = decode(_wire(msg))
    assert back.kind == msg.kind and back.version == msg.version
    assert _same(msg.data, back.data)


@SETTINGS
@given(messages, st.data())
def test_a_mutated_message_is_decoded_or_refused_never_a_crash(msg: Message, data) -> None:
    frames = _wire(msg)
    i = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[i])
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "replace"]))
    if how == "flip" and frame:
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        frame = frame[: data.draw(st.integers(0, max(0, len(frame) - 1)))]
    elif how == "extend":
        frame += data.draw(st.binary(min_size=1, max_size=8))
    else:
        frame = bytearray(data.draw(st.binary(max_size=64)))
    frames[i] = bytes(frame)
    schema = Schema(msg.kind, msg.version, {k: "any" for k in msg.data})
    try:
        back = decode(frames, {msg.kind: schema})
    except DecodeError as exc:
        assert exc.reason and exc.detail
        return
    # taken: it must still be a well-formed message of the declared schema
    assert back.kind == msg.kind and schema.check(back.data) == []


@SETTINGS
@given(messages.filter(lambda m: len(encode(m)) > 1), st.data())
def test_structural_mutations_are_always_refused(msg: Message, data) -> None:
    frames = _wire(msg)
    how = data.draw(st.sampled_from(["drop", "add", "shorten_array"]))
    if how == "drop":
        del frames[data.draw(st.integers(1, len(frames) - 1))]
    elif how == "add":
        frames.append(data.draw(st.binary(max_size=16)))
    else:
        nonempty = [i for i in range(1, len(frames)) if frames[i]]
        if not nonempty:
            frames.append(b"x")  # falls back to "add"
        else:
            i = data.draw(st.sampled_from(nonempty))
            frames[i] = frames[i][:-1]
    with pytest.raises(DecodeError):
        decode(frames)
