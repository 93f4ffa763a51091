"""A streamed request's chunks, pulled by a task or pushed to a writer as the scheduler hands
them over.

The scheduler hands a streamed request its new tokens once per step (``ChunkStream.add``, on
the request's loop). A ``ChunkStream`` turns each hand-over into a batch of chunks with its
``build`` function (``streaming.stream_generate``'s: one chunk per sample that moved on) and
then through each transform ``map``ped on it (the ``/v1`` routes' layouts,
``openai_api.CompletionChunks`` and ``openai_chat.ChatChunks``). A ``Last`` batch ends it.

Two ways to consume it:

- pulled, ``async for batch in stream``: the consumer's task wakes up for each batch (what a
  caller in the same process, such as the agent proxy, does);
- pushed, ``push(sink, failed)``: each batch is built in the hand-over itself and given to
  ``sink`` there, so that no task is woken, no future made and no generator resumed per step.
  A server that writes events straight to a connection takes this path
  (``streaming.write_events``); a push ends with ``push(None)``, and whatever the scheduler
  hands over then waits for the next pull.

A transform is a callable from a batch to a list of chunks with an ``end()`` method (the chunks
to add after the last batch, such as a usage chunk); ``mapped`` applies one to a
``ChunkStream`` or to any async iterator of batches. A transform that sets ``ended`` (a
``/v1`` stream that met an abort with an error status and sent its error event) ends the
stream there: that batch is its last, with the ``end()`` of each transform, and what is still
being generated is aborted when the stream is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

__all__ = ["ChunkStream", "Last", "Transform", "mapped"]


class Last(list):
    """A stream's last batch of chunks: ``write_events`` sends it with ``data: [DONE]`` and the
    end of the response in one write. Transforms pass the mark on."""


class Transform(Protocol):
    """Chunks of one layout to chunks of another, batch by batch."""

    def __call__(self, batch: list[Any]) -> list[Any]: ...

    def end(self) -> list[Any]:
        """The chunks that follow the last batch's."""
        ...


class ChunkStream:
    """The batches of chunks of one streamed request (see the module's docstring).

    ``build(events)`` makes a batch (a ``Last`` one at the end) of the events of one hand-over
    (or of several that piled up while nobody pulled); ``abort()`` stops what is still being
    generated, once, when the stream is closed before its end."""

    def __init__(
        self, build: Callable[[list[tuple[int, Any]]], list[Any]], abort: Callable[[], None]
    ) -> None:
        self._build = build
        self._abort: Callable[[], None] | None = abort
        self._transforms: list[Transform] = []
        self._pending: list[tuple[int, Any]] = []  # handed over, not pulled yet
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[list[Any]], None] | None = None
        self._failed: Callable[[BaseException], None] | None = None
        self._ended = False

    def map(self, transform: Transform) -> ChunkStream:
        """This stream with its batches through ``transform`` (after those mapped before)."""
        self._transforms.append(transform)
        return self

    # -- the scheduler's side ------------------------------------------------------------------
    def add(self, events: list[tuple[int, Any]]) -> None:
        """The events of one hand-over (called on the loop, in order)."""
        if self._sink is None:
            self._pending += events
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        try:
            self._sink(self._next(events))
        except BaseException as exc:  # a failure handed over, or a sink's: the pusher's to raise
            failed = self._failed
            self._sink = self._failed = None
            if failed is None:
                raise
            failed(exc)

    # -- the consumer's side -------------------------------------------------------------------
    def push(
        self,
        sink: Callable[[list[Any]], None] | None,
        failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        """From now on, build each batch as it is handed over and call ``sink(batch)`` with it
        (what piled up first, at once); an exception building one (or sinking it) ends the push
        and goes to ``failed``. ``push(None)``: back to pulling."""
        self._sink, self._failed = sink, failed
        if sink is not None and self._pending:
            events, self._pending = self._pending, []
            self.add(events)

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> list[Any]:
        if self._ended:
            raise StopAsyncIteration
        while not self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        events, self._pending = self._pending, []
        return self._next(events)

    async def aclose(self) -> None:
        """Stop: abort the samples still running (nothing more is handed over)."""
        self._sink = self._failed = None
        self._ended = True
        abort, self._abort = self._abort, None
        if abort is not None:
            abort()

    def _next(self, events: list[tuple[int, Any]]) -> list[Any]:
        batch = self._build(events)
        last = isinstance(batch, Last)
        for transform in self._transforms:
            batch = transform(batch)
            if last or _ended(transform):
                last = True
                batch = batch + transform.end()
        if last:
            self._ended = True
            return Last(batch)
        return batch


def mapped(chunks: AsyncIterator[list[Any]], transform: Transform) -> AsyncIterator[list[Any]]:
    """``chunks`` (a ``ChunkStream`` or any async iterator of batches) through ``transform``."""
    if isinstance(chunks, ChunkStream):
        return chunks.map(transform)
    return _mapped(chunks, transform)


async def _mapped(
    chunks: AsyncIterator[list[Any]], transform: Transform
) -> AsyncIterator[list[Any]]:
    try:
        async for batch in chunks:
            out = transform(batch)
            if isinstance(batch, Last) or _ended(transform):
                yield Last(out + transform.end())
                return
            yield out
    finally:  # ended early (or closed): the source's samples still running are aborted
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    end = transform.end()
    if end:
        yield Last(end)


def _ended(transform: Transform) -> bool:
    """Whether ``transform`` ended its stream early (its ``ended``)."""
    return getattr(transform, "ended", False)
