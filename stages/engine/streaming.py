"""Streaming answers (``stream: true``): the output of each sample as it is sampled.

As SGLang 0.5 streams ``/generate`` (``http_server.serve_generate_request``,
``TokenizerManager._handle_batch_output`` and ``_wait_one_response`` at the default, without
``--incremental-streaming-output``): the answer is ``text/event-stream``, one ``data: {json}``
event per chunk and ``data: [DONE]`` after the last. Every chunk holds a sample's whole output so
far: ``text``, ``output_ids`` and ``meta_info`` with SGLang's fields (``id``, ``finish_reason``
null until the sample's last chunk, ``prompt_tokens``, ``completion_tokens`` and
``cached_tokens`` so far, ``weight_version``, and with ``return_logprob`` the log-probs so far;
per-token versions only in the last). A batch or ``n`` > 1 adds ``index`` to each chunk: the
sample's place in the non-streamed answer's list. Chunks that pile up while the client reads are
merged into the newest (SGLang drains its queue the same way); the sample's last chunk is its
whole answer, exactly what the non-streamed request returns. ``text`` holds back a trailing
incomplete character (``\\ufffd``) until the token that completes it arrives.

The scheduler hands over each step's tokens of streamed requests in one batch per asyncio loop
(``Scheduler.submit_async(..., stream=...)``): a sample's tokens once its chunk is due, after
every token or, with a stream interval k (``sampling_params.stream_interval``, else the
server's ``--stream-interval``), after the first and whenever k more are unsent, and not while
the sample's text may be ending in one of its stop strings, as SGLang decides. A
client that goes away mid-stream aborts the samples still running (their slots are freed at the
next step) and is counted by the server.
This module knows nothing of HTTP routes; ``write_events`` writes any chunk iterator as events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from stages.engine.protocol import SequenceResult, parse_generate, render_sample, token_texts

__all__ = ["Last", "Progress", "stream_generate", "write_events"]


class Last(list):
    """A stream's last batch of chunks: ``write_events`` sends it with ``data: [DONE]`` and the
    end of the response in one write. Iterators that transform batches pass the mark on."""


class _Events:
    """A streamed request's events as the scheduler hands them over (on the loop's thread):
    lighter than an ``asyncio.Queue`` (no loop lookups, one future per wait)."""

    def __init__(self) -> None:
        self.items: list[tuple[int, Any]] = []
        self.waiter: asyncio.Future[None] | None = None

    def add(self, events: list[tuple[int, Any]]) -> None:
        self.items += events
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[tuple[int, Any]]:
        """Everything that arrived since the last call (waits for something)."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        items, self.items = self.items, []
        return items


class Progress:
    """One sample's output so far (before its final result arrives)."""

    __slots__ = (
        "cached",
        "entries",
        "ids",
        "index",
        "input_entries",
        "input_lps",
        "input_top_entries",
        "input_tops",
        "logprobs",
        "prompt_tokens",
        "rid",
        "text",
        "token_text",
        "top_entries",
        "tops",
        "version",
    )

    def __init__(
        self,
        rid: str,
        prompt_tokens: int,
        tops: list | None = None,
        *,
        index: int = 0,
        token_text: Callable[[int], str] | None = None,
    ) -> None:
        self.rid = rid
        self.index = index  # the sample's place in the request's answer
        self.token_text = token_text  # each token's own text (return_text_in_logprobs)
        self.prompt_tokens = prompt_tokens
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.version = ""  # the weight version of its newest token
        self.tops: list[list[tuple[float, int]]] | None = tops  # with top_logprobs_num
        # the log-prob entries so far, built once per token (each chunk shares the lists: a
        # chunk is encoded before the next token is added)
        self.entries: list[list[Any]] = []
        self.top_entries: list[list[list[Any]]] = []
        self.cached = 0
        # the prompt's log-probs (logprob_start_len), in every chunk as SGLang's cumulative ones
        self.input_lps: list[tuple[float | None, int]] | None = None
        self.input_tops: list[list[tuple[float, int]] | None] | None = None
        self.input_entries: list[list[Any]] | None = None
        self.input_top_entries: list[Any] | None = None
        self.text = ""  # the text sent last (a trailing incomplete character held back)

    def chunk(
        self, return_logprob: bool, token_text: Callable[[int], str] | None, text: str | None
    ) -> dict:
        """The sample's chunk before its last: ``text`` (when not None) and SGLang's fields
        of ``meta_info`` so far."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids),
            "cached_tokens": self.cached,
            "weight_version": self.version,
        }
        if return_logprob:
            entries, ids, logprobs = self.entries, self.ids, self.logprobs
            for i in range(len(entries), len(ids)):  # the tokens added since the last chunk
                tok = ids[i]
                entries.append([logprobs[i], tok, None if token_text is None else token_text(tok)])
            if self.input_entries is None:
                self._input_entries(token_text)
            meta["input_token_logprobs"] = self.input_entries
            meta["output_token_logprobs"] = entries
            meta["output_token_logprobs_length"] = len(entries)
            if self.tops is not None:
                text_of = (lambda tok: None) if token_text is None else token_text
                for step in self.tops[len(self.top_entries) :]:
                    self.top_entries.append([[lp, tok, text_of(tok)] for lp, tok in step])
                meta["input_top_logprobs"] = self.input_top_entries
                meta["output_top_logprobs"] = self.top_entries
        if text is None:
            return {"output_ids": self.ids, "meta_info": meta}
        return {"text": text, "output_ids": self.ids, "meta_info": meta}

    def _input_entries(self, token_text: Callable[[int], str] | None) -> None:
        """The prompt's log-prob entries (and top entries), built once."""
        text = (lambda tok: None) if token_text is None else token_text
        self.input_entries = [[lp, tok, text(tok)] for lp, tok in self.input_lps or ()]
        self.input_top_entries = [
            None if step is None else [[lp, tok, text(tok)] for lp, tok in step]
            for step in self.input_tops or ()
        ]


async def stream_generate(
    loaded: Any,
    scheduler: Any,
    decode: Callable[[list[int], bool], str] | None,
    body: dict[str, Any],
    *,
    progress: bool = False,
) -> AsyncIterator[list[Any]]:
    """The chunks of a streamed ``/generate`` (``body`` has ``stream: true``), in batches: the
    chunks that became ready together (one per sample that moved on).

    With ``progress``, a sample's chunks before its last are its ``Progress`` itself (``text``
    so far, ``ids``, ``logprobs``, ``tops``, ``index``...; valid until the next batch is asked
    for) rather than the native chunk made of it: for a caller that renders chunks of its own
    (``/v1/completions``), so that nothing is built twice. Its last chunk is native either way.

    Raises RequestError (a malformed body) or ValueError (a rid in flight) before the first
    chunk; closed early (the client went away), it aborts the samples that are still running.
    """
    inputs, listed = parse_generate(
        body,
        vocab_size=loaded.vocab_size,
        context_length=loaded.context_length,
        encode=loaded.tokenizer.encode if loaded.tokenizer is not None else None,
        adapters=scheduler.adapter_names(),
    )
    events_in = _Events()
    future = scheduler.submit_async(inputs, stream=events_in.add)
    # the failure (if any) also comes as an event; the future must not warn that nobody read it
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    token_text = token_texts(decode, body)
    moving = [
        Progress(
            inp.rid,
            len(inp.input_ids),
            tops=[] if inp.top_logprobs_num else None,
            index=index,
            token_text=token_text,
        )
        for index, inp in enumerate(inputs)
    ]
    finals: dict[int, SequenceResult] = {}
    skips = [inp.params.skip_special_tokens for inp in inputs]
    try:
        while len(finals) < len(inputs):
            touched: dict[int, None] = {}
            for index, payload in await events_in.take():  # all that piled up
                if type(payload) is tuple:  # a token: (id, log-prob, version, top, cached...)
                    p = moving[index]
                    token, logprob, p.version, top, p.cached, p.input_lps, p.input_tops = payload
                    p.ids.append(token)
                    p.logprobs.append(logprob)
                    if top is not None and p.tops is not None:
                        p.tops.append(top)
                elif isinstance(payload, SequenceResult):
                    finals[index] = payload
                else:
                    raise payload
                touched[index] = None
            batch: list[Any] = []  # one chunk per sample that moved on
            for index in touched:
                final = finals.get(index)
                if final is not None:  # the whole answer, as the request without stream
                    chunk = render_sample(inputs[index], final, decode, token_text)
                else:
                    p = moving[index]
                    if decode is not None:
                        text = decode(p.ids, skips[index])
                        if not text.endswith("\ufffd"):  # else a character is still incomplete
                            p.text = text
                    if progress:
                        batch.append(p)
                        continue
                    chunk = p.chunk(
                        inputs[index].return_logprob,
                        token_text,
                        None if decode is None else p.text,
                    )
                if listed:
                    chunk["index"] = index
                batch.append(chunk)
            yield Last(batch) if len(finals) == len(inputs) else batch
    finally:
        running = [inp.rid for i, inp in enumerate(inputs) if i not in finals]
        if running:
            scheduler.abort_many(running, "the client went away mid-stream")


async def write_events(
    request: web.Request,
    chunks: AsyncIterator[list[Any]],
    encode: Callable[[Any], bytes],
    *,
    on_disconnect: Callable[[], None],
) -> web.StreamResponse:
    """Answer ``request`` with ``chunks`` (batches of them: one write each) as server-sent
    events, then ``data: [DONE]`` (with a ``Last`` batch, in the same write).

    The first batch is awaited before anything is sent, so that a request refused by the
    generator's checks raises here and can still be answered with an error status. A client
    that goes away ends the stream (``on_disconnect`` is called; closing ``chunks`` aborts
    what it was generating).
    """
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await chunks.aclose()
        raise
    response = _EventStream(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(request)
        tail = b""
        if isinstance(first, Last):
            tail = _events(first, encode)
        elif first is not None:
            direct = None  # the connection, once chunks may go straight to it
            if first:  # an empty chunk would end a chunked response
                await response.write(_events(first, encode))  # with the headers
                direct = _chunked_transport(request, response)
            async for batch in chunks:
                if isinstance(batch, Last):
                    tail = _events(batch, encode)
                    break
                if not batch:
                    continue
                data = _events(batch, encode)
                if direct is not None and not (
                    direct.get_write_buffer_size() or direct.is_closing()
                ):
                    direct.write(b"%x\r\n%b\r\n" % (len(data), data))  # one chunk, framed
                else:  # a client that reads slowly (aiohttp waits for it) or went away (raises)
                    await response.write(data)
                    direct = _chunked_transport(request, response)
        # the last events, the end marker and the end of the response: one write
        await response.write_eof(tail + b"data: [DONE]\n\n")
    except ConnectionResetError:  # the client went away: nobody to answer
        on_disconnect()
    except asyncio.CancelledError:
        on_disconnect()
        raise
    finally:
        await chunks.aclose()  # aborts what is still running
    return response


class _EventStream(web.StreamResponse):
    """A stream whose headers go out with its first events, in one write (as aiohttp's
    ``Response`` sends its headers with its body): the first batch is ready when it starts."""

    _send_headers_immediately = False


def _chunked_transport(request: web.Request, response: web.StreamResponse) -> Any:
    """The connection under ``response`` (its headers sent) if a chunk of its body may be
    written straight to it: chunked (HTTP/1.1) and not compressed. aiohttp's ``write``
    costs about 7 us of Python a call over the transport's own, and a stream makes one a step;
    while the connection has bytes waiting (a client that reads slowly) or is closing (a client
    that went away), the caller goes through aiohttp's, which waits for the client once they
    pile up, or raises."""
    writer = getattr(response, "_payload_writer", None)  # aiohttp's StreamWriter
    transport = request.transport
    if getattr(writer, "chunked", False) is not True or response.compression:
        return None
    return transport


def _events(batch: list[Any], encode: Callable[[Any], bytes]) -> bytes:
    if not batch:
        return b""
    return b"data: " + b"\n\ndata: ".join(map(encode, batch)) + b"\n\n"
