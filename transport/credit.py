"""The credit protocol shared by :class:`~transport.receiver.Receiver` and
:class:`~transport.sender.Sender`: bounded, credit-based message streams over ZeroMQ.

Why credit: a producer that runs ahead of its consumer would otherwise fill socket buffers with
tensors until memory runs out, and the lag between generation and training (the staleness the
whole pipeline is built to bound) would grow without limit. So every input port has a bounded
inbox, and a producer may send only what the consumer has granted it room for. ZeroMQ's
high-water marks stay in place only as a safety net.

Shape: the consumer side (:class:`Receiver`) binds a ROUTER at its inbox address; each producer
side (:class:`Sender`) connects one DEALER per consumer replica, with routing id
``IDENTITY/SESSION`` (``IDENTITY`` is ``stage.replica``, ``SESSION`` random per Sender).

Protocol. Every message on that socket pair is ``[tag, msgpack map, *codec frames]``:

=========  ========  ==========================================================================
tag        way       map
=========  ========  ==========================================================================
``H``      p -> c    HELLO/PING ``{identity, session, to, epoch, sent}``: at start, then every
                     ``heartbeat_s``. ``to``/``epoch`` name the credit stream the producer holds
                     (None before any), ``sent`` how many DATA it sent in it.
``D``      p -> c    DATA ``{to, epoch, seq[, w][, bulk]}``, then the codec frames of one
                     message (``w``: its weight where not 1; ``bulk``: on CURVE, which frames
                     come sealed on the bulk port). A batch (``Sender.send_many``) has ``seqs:
                     [seq, ...]`` instead of ``seq`` (and ``ws``, the weights, where one is not
                     1) and the frames of ``codec.encode_batch``: one message per seq, each
                     credited, acknowledged, deduplicated and refused on its own.
``E``      p -> c    EOS ``{identity, session, to, epoch, sent}``: no more messages from it.
``C``      c -> p    CREDIT ``{session, epoch, grant, granted, consumed, eos, reach}``:
                     ``grant`` new units; ``granted`` the total granted in this stream;
                     ``consumed`` the units of DATA received in it; ``eos`` true when
                     acknowledging an EOS; ``reach`` the credit the producer is sure to hold
                     in time (see "Weight"); ``bulk_port`` (CURVE over tcp only) where sealed
                     large frames go (``transport.bulk``).
``X``      c -> p    CLOSE ``{session}``: the consumer is going away.
``A``      c -> p    ACK ``{session, acked: [seq, ...]}``: these DATA were processed.
=========  ========  ==========================================================================

Delivery (at least once). Every DATA carries ``seq``, numbered per producer session. The
producer keeps each message until the consumer acknowledges it, and when a consumer comes back
with a new session (it restarted: whatever it held, in its inbox or being processed, is gone)
sends the ones it had sent there again, to whichever consumer has credit. A message is
acknowledged when the application has processed it: by default when ``recv()`` hands it out
(``ack="on_take"``: what sat in the inbox survives the consumer), or when the application calls
``Receiver.ack(msg)`` (``ack="manual"``: a stage that holds messages while it works on them,
acking only once the result has gone on). ACKs are coalesced, one per producer per event-loop
turn. The consumer drops a DATA whose (producer session, seq) it has already taken (counted,
and acknowledged again), remembering the last ``dedup_window`` of them. The producer holds at
most ``max_unacked`` messages and ``max_unacked_bytes``; beyond either it lets go of the oldest,
counted (``unacked_dropped``) and logged: never held forever, never dropped silently.

A credit stream is one (consumer ``session``, ``epoch``) pair; the consumer opens a new epoch
each time it (re)admits a producer. The producer's credit on a stream is ``granted - sent``, so
a lost or duplicated CREDIT heals with the next one (the consumer answers every PING with one).
When the stream changes (consumer restarted, or it reclaimed our credit) the producer's credit
resets to the new grant. DATA sent on a stale stream (it was queued while the consumer
restarted) is still accepted and counted ``uncredited``: data sent in good faith is never
dropped. A PING tells the consumer how many DATA were sent on the current stream; ZeroMQ keeps
order on a connection, so any shortfall was lost and its credit is written off.

Weight. Credit, capacity and depth count units of weight, not messages. A message weighs what
its schema says (``Schema.weight``: a message that carries a batch of groups weighs its number
of groups), 1 by default, so an inbox of 64 holds 64 groups however they are packed; the
receiver weighs what it takes in from its own schema, whatever the header said. A message goes
when its producer's credit covers its weight, or, heavier than the consumer will ever grant
that producer at once, when the producer holds its ``reach`` (its share less the quarter share
the consumer tops up at a time, plus one): it then overdraws, and the consumer counts the
overdraft as granted when it arrives. So the inbox exceeds its capacity only by what a message
weighs beyond a producer's reach, as the generator lets an oversized group start alone.

Consumer: invariant ``depth + credit outstanding <= capacity`` (uncredited arrivals and
overdrafts aside).
Free slots go round-robin to producers, each capped at ``max(1, capacity // n)`` where ``n``
counts live producers and expected ones not yet heard from (credit is never revoked, so the
first producer to arrive must not take the whole inbox; a producer that hoards its share while
idle still keeps it until it sends or is reclaimed). Grants are coalesced (one pass per
event-loop turn, and a producer that still holds credit is topped up only once a quarter of its
share is missing), but a producer with no credit left gets a slot as soon as one is free;
while the inbox still holds a quarter share of messages, free slots are granted only once a
quarter share of them is free (a consumer that takes messages one by one would otherwise answer
each with a CREDIT, and its producer would send one message at a time).
A producer silent for ``peer_timeout_s`` is dropped and its credit reclaimed. Rejected messages
(see ``codec.decode``) are counted per reason, logged, and their slot granted again.

Producer: ``send`` waits until some live consumer has granted credit, then sends to the one
with the most credit (ties round-robin). A consumer is live while it has answered within
``peer_timeout_s`` (it answers every PING, so a live one answers every ``heartbeat_s``).
``aclose()`` stops the PINGs, sends EOS to every consumer and waits (at most ``timeout_s``) for
each to acknowledge it, except those that said CLOSE; the acknowledgement also proves every
DATA before it arrived (a consumer confirms an EOS only once the DATA held for sealed frames
are in), so the sockets can then close with linger 0.

Not here: delivery across a *producer's* crash (what it held unacknowledged is gone with it;
its own upstream redelivers the inputs when it acknowledges only after its outputs were, see
``ack="manual"``), encryption and authentication (``transport.security``, ``transport.bulk``),
and the wiring of ports to addresses (``pipeline.actor``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgpack

from transport.message import Schema

HELLO, DATA, EOS, CREDIT, CLOSE, ACK = b"H", b"D", b"E", b"C", b"X", b"A"

# The ROUTER gets this long to flush CLOSE frames when it closes; everything else lingers 0.
CLOSE_LINGER_MS = 100
# Messages the receiver takes from its socket before it yields to the event loop.
DRAIN_BATCH = 256
# Producer-side high-water marks: it sends only with credit, so these are never reached by DATA.
SENDER_HWM = 10_000


def schema_map(schemas: Sequence[Schema], where: str) -> dict[str, Schema]:
    by_kind: dict[str, Schema] = {}
    for schema in schemas:
        if schema.kind in by_kind:
            raise ValueError(f"{where}: kind {schema.kind!r} is declared twice")
        by_kind[schema.kind] = schema
    return by_kind


def unpack_map(frame: Any) -> dict[str, Any] | None:
    """The msgpack map in a control frame, or None if it is not one."""
    try:
        value = msgpack.unpackb(frame, raw=False)
    except Exception:  # any msgpack failure means "malformed"; the caller counts and logs it
        return None
    return value if isinstance(value, dict) else None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def settled(fut: asyncio.Future) -> asyncio.Future:
    """Wait for a pyzmq future without letting a socket close pass for our own cancellation.

    Closing a socket cancels its pending futures, which would surface in the awaiting task as a
    CancelledError it never asked for. Here a cancel of the *task* still propagates (and the
    operation is cancelled with it), while a future cancelled by the close is returned as is.
    """
    if not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            fut.cancel()
            raise
    return fut


def sparse(count: int) -> bool:
    """Whether the ``count``-th occurrence of something is logged: the 1st, 2nd, 4th, 8th ...
    (a flood of one kind of trouble stays visible without flooding the log)."""
    return count > 0 and count & (count - 1) == 0
