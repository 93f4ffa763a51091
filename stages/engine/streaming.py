"""Streaming answers (``stream: true``): the output of each sample as it is sampled.

As SGLang 0.5 streams ``/generate`` (``http_server.serve_generate_request``,
``TokenizerManager._handle_batch_output`` and ``_wait_one_response`` at the default, without
``--incremental-streaming-output``): the answer is ``text/event-stream``, one ``data: {json}``
event per chunk and ``data: [DONE]`` after the last. Every chunk holds a sample's whole output
so far: ``text``, ``output_ids`` and ``meta_info`` with SGLang's fields (``id``,
``finish_reason`` null until the sample's last chunk, ``prompt_tokens``, ``completion_tokens``
and ``cached_tokens`` (and ``cached_tokens_details``) so far, ``weight_version``, with
``--enable-metrics`` the scheduler's time stats, with ``return_logprob`` the log-probs so far,
with ``return_hidden_states`` the hidden states so far; per-token versions only in the last). A
batch or ``n`` > 1 adds ``index`` to each chunk: the sample's place in the non-streamed answer's
list. Chunks that pile up while the client reads are merged into the newest (SGLang drains its
queue the same way); the sample's last chunk is its whole answer. ``text`` is decoded as
SGLang's detokenizer decodes it (``incremental_text``): after the prompt's last tokens, a few
tokens a chunk, and new text that cannot settle yet (an incomplete character) shows only its
printable part.

The scheduler hands a streamed request one batch of events per model pass
(``Scheduler.submit_async(..., stream=...)``): the results of its samples that finished in it
and the tokens of those that go on, written as one piece. A sample's tokens come once its
chunk is due, after every token or, with a stream interval k
(``sampling_params.stream_interval``, else the server's ``--stream-interval``), after the
first and whenever k more are unsent, and not while the sample's text may be ending in one of
its stop strings, as SGLang decides. A client that goes away mid-stream aborts the samples
still running (their slots are freed at the next step) and is counted by the server.
This module knows nothing of HTTP routes; ``write_events`` writes any chunk iterator as events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from stages.engine.aborts import tokenizer_answer
from stages.engine.chunk_stream import ChunkStream, Last
from stages.engine.flat_logprobs import flat_fields
from stages.engine.incremental_stream import Deltas
from stages.engine.incremental_text import IncrementalText
from stages.engine.protocol import (
    GenerateInput,
    SequenceResult,
    add_hidden,
    answer_version,
    cached_tokens_details,
    hidden_answer,
    parse_generate,
    render_sample,
    result_text,
    step_entries,
    token_texts,
)
from stages.engine.reasoning import ReasoningCount
from stages.engine.request_log import entry

__all__ = [
    "Last",
    "Progress",
    "parse_body",
    "stream_generate",
    "write_events",
]  # Last: chunk_stream's


class Progress:
    """One sample's output so far (before its final result arrives)."""

    __slots__ = (
        "cached",
        "detok",
        "entries",
        "finish",
        "flat_input",
        "hidden",
        "hidden_mode",
        "ids",
        "index",
        "input_entries",
        "input_lps",
        "input_picked",
        "input_picked_entries",
        "input_top_entries",
        "input_tops",
        "listed",
        "logprobs",
        "mask_ids",
        "mask_mode",
        "mask_values",
        "out",
        "picked",
        "picked_entries",
        "prompt_ids",
        "prompt_tokens",
        "reasoning",
        "retractions",
        "return_logprob",
        "rid",
        "routed",
        "text",
        "time_stats",
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
        picked: list | None = None,
        index: int = 0,
        listed: bool = False,
        return_logprob: bool = False,
        token_text: Callable[[int], str] | None = None,
        detok: IncrementalText | None = None,
        reasoning: ReasoningCount | None = None,
        prompt_ids: list[int] | None = None,
        mask_mode: str | None = None,
        flat_input: tuple[int, bool] | None = None,
        hidden_mode: str | None = None,
    ) -> None:
        self.rid = rid
        # its final hidden states so far (return_hidden_states "full", or "last": the newest)
        self.hidden_mode = hidden_mode
        self.hidden: list[Any] | None = [] if hidden_mode else None
        # the prompt's top log-probs as flat arrays (return_flat_raw_top_logprobs): (k, b64)
        self.flat_input = flat_input
        self.prompt_ids = prompt_ids  # in every chunk (return_prompt_token_ids), else None
        self.reasoning = reasoning  # counts its reasoning tokens (require_reasoning)
        self.listed = listed  # its chunks carry ``index`` (a batch or n > 1)
        self.return_logprob = return_logprob
        self.detok = detok  # its text, decoded as SGLang's detokenizer does (None: no tokenizer)
        self.index = index  # the sample's place in the request's answer
        self.token_text = token_text  # each token's own text (return_text_in_logprobs)
        self.prompt_tokens = prompt_tokens
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.version = ""  # the weight version of its newest token
        self.retractions = 0  # how many times a pause retracted it so far
        self.time_stats: dict[str, Any] | None = None  # the scheduler's (--enable-metrics)
        self.tops: list[list[tuple[float, int]]] | None = tops  # with top_logprobs_num
        # the log-prob entries so far, built once per token (each chunk shares the lists: a
        # chunk is encoded before the next token is added)
        self.entries: list[list[Any]] = []
        self.top_entries: list[list[list[Any]]] = []
        # with token_ids_logprob: those tokens' log-probs at each step, and their entries
        self.picked: list[list[tuple[float, int]]] | None = picked
        self.picked_entries: list[Any] = []
        self.input_picked: list[list[tuple[float, int]] | None] | None = None
        self.input_picked_entries: list[Any] | None = None
        self.cached = 0
        # the prompt's log-probs (logprob_start_len), in every chunk as SGLang's cumulative ones
        self.input_lps: list[tuple[float | None, int]] | None = None
        self.input_tops: list[list[tuple[float, int]] | None] | None = None
        self.input_entries: list[list[Any]] | None = None
        self.input_top_entries: list[Any] | None = None
        self.text = ""  # the text so far (SGLang's: what may still change is held back)
        self.finish: dict[str, Any] | None = None  # the finish reason, once it is the last
        self.routed: str | None = None  # its routed experts, in its last (return_routed_experts)
        self.out: dict[str, Any] | None = None  # its chunk (``chunk``), once built
        # return_sampling_mask: each token's support and its log-prob(s), "selected" or
        # "support" (sampling_logprobs_mode); None: not asked
        self.mask_mode = mask_mode
        self.mask_ids: list[list[int]] = []
        self.mask_values: list[Any] = []

    def last(self, result: SequenceResult, inp: Any, decode: Callable[..., str] | None) -> Progress:
        """This sample, finished as ``result`` (of its request ``inp``): its whole output,
        ``text`` as the answer without streaming has it, and ``finish``."""
        self.ids, self.version, self.cached = (
            result.output_ids,
            answer_version(result),
            result.cached_tokens,
        )
        self.logprobs = result.output_token_logprobs or []
        if self.tops is not None:
            self.tops = result.output_top_logprobs or []
        if self.picked is not None:
            self.picked = result.output_token_ids_logprobs or []
        params = inp.params
        if decode is not None:
            self.text = result_text(
                result,
                decode,
                params.skip_special_tokens,
                params.no_stop_trim,
                state=self.detok,
                kept=inp.kept_stop_ids,
            )
        if self.hidden is not None:  # the last step's too, which came with the result
            found = result.extra.get("hidden_states")
            if self.hidden_mode == "last":  # the answer's is the newest vector itself
                self.hidden = [] if found is None else [found]
            else:
                self.hidden = list(found or [])
        self.finish = result.finish_reason
        self.routed = result.extra.get("routed_experts") if result.extra else None
        return self

    def hidden_states(self) -> Any:
        """``meta_info.hidden_states`` so far (``protocol.hidden_answer``)."""
        return hidden_answer(self.hidden, self.hidden_mode)

    def chunk(self) -> dict:
        """The sample's chunk before its last: ``text`` (with a tokenizer) and SGLang's fields
        of ``meta_info`` so far. It is the same dict each time, brought up to date (as the
        lists in it are): a chunk is encoded before the sample's next one is built."""
        out = self.out
        if out is None:
            return self._first_chunk()
        meta = out["meta_info"]
        meta.pop("response_sent_to_client_ts", None)  # the first chunk's only
        if self.detok is not None:
            out["text"] = self.text
        if self.reasoning is not None:
            meta["reasoning_tokens"] = self.reasoning.update(self.ids)
        meta["completion_tokens"] = len(self.ids)
        if meta["cached_tokens"] != self.cached:  # (set by the prefill: rarely changes)
            meta["cached_tokens"] = self.cached
            meta["cached_tokens_details"] = cached_tokens_details(self.cached)
        meta["weight_version"] = self.version
        meta["num_retractions"] = self.retractions
        if self.time_stats is not None:
            meta.update(self.time_stats)
        if self.return_logprob:
            self._add_entries()
            meta["output_token_logprobs_length"] = len(self.entries)
        if self.mask_mode is not None:
            meta["output_token_sampling_mask_length"] = len(self.mask_ids)
        if self.hidden is not None:
            hidden = self.hidden_states()
            if hidden is not None:  # "last" before any: left out, as SGLang leaves it
                meta["hidden_states"] = hidden
        return out

    def _first_chunk(self) -> dict:
        token_text = self.token_text
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": None,
            "prompt_tokens": self.prompt_tokens,
            "weight_version": self.version,
            "num_retractions": self.retractions,
        }
        if self.time_stats is not None:  # the scheduler's, as SGLang's follow num_retractions
            meta.update(self.time_stats)
        if self.return_logprob:
            self._add_entries()
            meta["input_token_logprobs"] = self._input_entries(token_text)
            meta["output_token_logprobs"] = self.entries
            meta["output_token_logprobs_length"] = len(self.entries)
            if self.tops is not None:
                flat = self.flat_input
                fields = (
                    None
                    if flat is None
                    else flat_fields("input", self.input_tops or [], flat[0], flat[1], self.rid)
                )
                if fields is None:
                    meta["input_top_logprobs"] = self.input_top_entries
                else:  # in every chunk, as SGLang's (built once: the prompt's do not change)
                    meta.update(fields)
                meta["output_top_logprobs"] = self.top_entries
            if self.picked is not None:
                self.input_picked_entries = step_entries(self.input_picked or (), token_text)
                meta["input_token_ids_logprobs"] = self.input_picked_entries
                meta["output_token_ids_logprobs"] = self.picked_entries
        if self.mask_mode is not None:  # SGLang's sampling supports so far (the lists grow)
            meta["output_token_sampling_mask"] = self.mask_ids
            meta["output_token_sampling_logprobs"] = self.mask_values
            meta["output_token_sampling_mask_length"] = len(self.mask_ids)
        # the counts after them, as SGLang's meta_info has them (_handle_batch_output)
        reasoning = 0 if self.reasoning is None else self.reasoning.update(self.ids)
        meta["reasoning_tokens"] = reasoning
        meta["completion_tokens"] = len(self.ids)
        meta["cached_tokens"] = self.cached
        meta["cached_tokens_details"] = cached_tokens_details(self.cached)
        hidden = self.hidden_states()
        if hidden is not None:  # after the log-probs and the counts, as SGLang's
            meta["hidden_states"] = hidden
        meta["response_sent_to_client_ts"] = time.time()  # SGLang's, in the first chunk only
        out: dict[str, Any] = (
            {"output_ids": self.ids, "meta_info": meta}
            if self.detok is None
            else {"text": self.text, "output_ids": self.ids, "meta_info": meta}
        )
        if self.prompt_ids is not None:  # after meta_info, as SGLang adds them
            out["prompt_token_ids"] = self.prompt_ids
        if self.listed:
            out["index"] = self.index
        self.out = out
        return out

    def _add_entries(self) -> None:
        """The log-prob entries (top ones, those of ``token_ids_logprob``) of the tokens
        added since the last chunk."""
        ids, logprobs, entries, token_text = self.ids, self.logprobs, self.entries, self.token_text
        done = len(entries)
        if token_text is None and done == len(ids) - 1:  # the usual case: one new token
            entries.append([logprobs[done], ids[done], None])
        else:
            for tok, lp in zip(ids[done:], logprobs[done:], strict=True):
                entries.append([lp, tok, None if token_text is None else token_text(tok)])
        if self.tops is not None:
            text_of = (lambda tok: None) if token_text is None else token_text
            for step in self.tops[len(self.top_entries) :]:
                self.top_entries.append([[lp, tok, text_of(tok)] for lp, tok in step])
        if self.picked is not None:
            self.picked_entries += step_entries(self.picked[len(self.picked_entries) :], token_text)

    def _input_entries(self, token_text: Callable[[int], str] | None) -> list[list[Any]]:
        """The prompt's log-prob entries (and top entries), built once."""
        if not self.input_lps and not self.input_tops:  # no logprob_start_len: none
            self.input_entries, self.input_top_entries = [], []
            return self.input_entries
        text = (lambda tok: None) if token_text is None else token_text
        self.input_entries = [[lp, tok, text(tok)] for lp, tok in self.input_lps or ()]
        self.input_top_entries = [
            None if step is None else [[lp, tok, text(tok)] for lp, tok in step]
            for step in self.input_tops or ()
        ]
        return self.input_entries


def parse_body(loaded: Any, scheduler: Any, body: Any) -> tuple[list[GenerateInput], bool]:
    """A ``/generate`` body checked as the route checks it (``protocol.parse_generate``
    with this engine's model, adapters and settings): its sequences and whether it was a
    batch."""
    return parse_generate(
        body,
        vocab_size=loaded.vocab_size,
        context_length=loaded.context_length,
        encode=loaded.tokenizer.encode if loaded.tokenizer is not None else None,
        adapters=scheduler.adapter_names() if scheduler.lora else None,
        mask_cap=scheduler.sampling_mask_max_tokens,
        hidden_cap=scheduler.hidden_states_mode,
        strict_thinking=scheduler.strict_thinking is not None,
        kept_stop_ids=loaded.kept_stop_ids,
        custom_logits=scheduler.logit_processors is not None,
        routed_experts=scheduler.routed_experts,
        think_ends=scheduler.think_ends,
        prefix_cache=scheduler.prefix_cache_on,
        embed_width=loaded.embed_width,
        vision=loaded.vision,
        auto_truncate=scheduler.auto_truncate,
    )


def stream_generate(
    loaded: Any,
    scheduler: Any,
    decode: Callable[[list[int], bool], str] | None,
    body: dict[str, Any],
    *,
    progress: bool = False,
    tokenizer_aborts: bool = False,
    headers: Any = None,
    incremental: bool = False,
) -> ChunkStream:
    """The chunks of a streamed ``/generate`` (``body`` has ``stream: true``), in batches: the
    chunks that became ready together (one per sample that moved on). The request is checked
    and queued at once.

    With ``progress``, a sample's chunks are its ``Progress`` itself (``text`` so far, ``ids``,
    ``logprobs``, ``tops``, ``index``...; valid until the next batch is built) rather than
    the native chunk made of it, its last with ``finish`` set (``Progress.last``): for a caller
    that renders chunks of its own (``/v1/completions``), so that nothing is built twice.
    ``tokenizer_aborts``: the last chunk of a sample aborted while it waited has the fewer
    fields SGLang's tokenizer answers it with (``aborts.tokenizer_answer``: ``/generate``'s
    own stream; the ``/v1`` routes read the others).

    Raises RequestError (a malformed body); a rid in flight (ValueError) and a grammar that
    does not compile (RequestError, once the grammar worker has tried it) are raised with the
    first batch. Closed early (the client went away), the stream aborts the samples that are
    still running. With the server's request log active, the request is logged once checked
    and each sample with its last chunk (``headers``: the HTTP request's). ``incremental``
    (``--incremental-streaming-output``): each native chunk holds what is new since the
    sample's last (``stages.engine.incremental_stream``).
    """
    inputs, listed = parse_body(loaded, scheduler, body)
    requests = scheduler.request_log
    logged = entry(requests, body, (inp.rid for inp in inputs), listed, headers)
    token_text = token_texts(decode, body)
    think_end, think_start = scheduler.think_end, scheduler.think_start
    moving = [
        Progress(
            inp.rid,
            len(inp.input_ids),
            tops=[] if inp.top_logprobs_num else None,
            picked=None if inp.token_ids_logprob is None else [],
            index=index,
            listed=listed,
            return_logprob=inp.return_logprob,
            token_text=token_text,
            detok=None
            if decode is None
            else IncrementalText(inp.input_ids, decode, inp.params.skip_special_tokens),
            reasoning=_reasoning_count(
                inp.require_reasoning, inp.think_end or think_end, think_start
            ),
            prompt_ids=list(inp.input_ids) if inp.return_prompt_token_ids else None,
            mask_mode=inp.sampling_mask,
            flat_input=(inp.top_logprobs_num, inp.flat_tops.b64)
            if inp.flat_tops is not None and inp.flat_tops.input
            else None,
            hidden_mode=inp.hidden_states,
        )
        for index, inp in enumerate(inputs)
    ]
    finals: dict[int, SequenceResult] = {}
    deltas = Deltas(len(inputs)) if incremental and not progress else None

    def build(events: list[tuple[int, Any]]) -> list[Any]:
        touched: dict[int, None] = {}
        for index, payload in events:  # all that piled up
            if type(payload) is tuple:  # a token: (id, log-prob, version, top, cached...)
                p = moving[index]
                token, logprob, p.version, top, p.cached, p.input_lps, p.input_tops, picked = (
                    payload[:8]
                )
                p.ids.append(token)
                p.logprobs.append(logprob)
                if top is not None and p.tops is not None:
                    p.tops.append(top)
                if picked is not None and p.picked is not None:
                    p.picked.append(picked)
                    p.input_picked = payload[8]
                p.retractions, p.time_stats = payload[10], payload[11]
                if payload[12] and p.hidden is not None:
                    add_hidden(p.hidden, payload[12], p.hidden_mode)
                if p.mask_mode is not None and payload[9] is not None:
                    ids, lps, selected = payload[9]
                    p.mask_ids.append(ids)
                    p.mask_values.append(lps if p.mask_mode == "support" else selected)
            elif isinstance(payload, SequenceResult):
                finals[index] = payload
            else:
                raise payload
            touched[index] = None
        batch: list[Any] = []  # one chunk per sample that moved on
        for index in touched:
            p = moving[index]
            final = finals.get(index) if finals else None
            if final is None:  # it goes on
                if p.detok is not None:
                    p.text = p.detok.update(p.ids)
                if deltas is not None:
                    batch.append(deltas(index, p.chunk()))
                else:
                    batch.append(p if progress else p.chunk())
                continue
            if progress:  # the whole answer, as the request without stream
                if logged is not None:  # the native answer, only for the log
                    answer = render_sample(inputs[index], final, decode, token_text)
                    requests.finished(logged, index, answer)
                batch.append(p.last(final, inputs[index], decode))
                continue
            # SGLang stamps the time a stream's first chunk is sent at, and no other
            chunk = render_sample(
                inputs[index], final, decode, token_text, p.detok, sent=p.out is None
            )
            if logged is not None:
                requests.finished(logged, index, chunk)
            if tokenizer_aborts:
                chunk = tokenizer_answer(chunk)
            if listed:
                chunk["index"] = index
            batch.append(chunk if deltas is None else deltas(index, chunk))
        return Last(batch) if len(finals) == len(inputs) else batch

    def abort() -> None:
        if logged is not None:
            requests.ended(logged)
        running = [inp.rid for i, inp in enumerate(inputs) if i not in finals]
        if running:
            scheduler.abort_many(running, "the client went away mid-stream")

    stream = ChunkStream(build, abort)
    future = scheduler.submit_async(inputs, stream=stream.add)
    # the failure (if any) also comes as an event; the future must not warn that nobody read it
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return stream


async def write_events(
    request: web.Request,
    chunks: AsyncIterator[list[Any]],
    encode: Callable[[Any], bytes],
    *,
    on_disconnect: Callable[[], None],
    events: Callable[[list[Any], Callable[[Any], bytes]], bytes] | None = None,
    done: bytes = b"data: [DONE]\n\n",
    content_type: str = "text/event-stream",
) -> web.StreamResponse:
    """Answer ``request`` with ``chunks`` (batches of them: one write each) as server-sent
    events, then ``done`` (``data: [DONE]``; with a ``Last`` batch, in the same write).
    ``events(batch, encode)``: a batch's bytes (default: a ``data:`` line per chunk).

    The first batch is awaited before anything is sent, so that a request refused by the
    generator's checks raises here and can still be answered with an error status. After it,
    a ``ChunkStream``'s batches are pushed straight to the connection as the scheduler hands
    them over, while it takes them (``_pushed``). A client that goes away ends the stream
    (``on_disconnect`` is called; closing ``chunks`` aborts what it was generating).
    """
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await chunks.aclose()
        raise
    response = _EventStream(headers={"Content-Type": content_type, "Cache-Control": "no-cache"})
    framed = _events if events is None else events
    try:
        await response.prepare(request)
        tail = b""
        if isinstance(first, Last):
            tail = framed(first, encode)
        elif first is not None:
            if first:  # an empty chunk would end a chunked response
                await response.write(framed(first, encode))  # with the headers
            else:  # nothing to send yet (an Anthropic stream waits for content): the headers
                _send_headers(response)  # go now, before anything is pushed past aiohttp
            tail = await _write_rest(request, response, chunks, encode, framed)
        # the last events, the end marker and the end of the response: one write
        await response.write_eof(tail + done)
    except ConnectionResetError:  # the client went away: nobody to answer
        on_disconnect()
    except asyncio.CancelledError:
        on_disconnect()
        raise
    finally:
        await chunks.aclose()  # aborts what is still running
    return response


async def _write_rest(
    request: web.Request,
    response: web.StreamResponse,
    chunks: AsyncIterator[list[Any]],
    encode: Callable[[Any], bytes],
    framed: Callable[[list[Any], Callable[[Any], bytes]], bytes],
) -> bytes:
    """Write the batches after the first; the events of the last come back, unwritten."""
    direct = _chunked_transport(request, response)  # None: every write through aiohttp
    pushable = direct is not None and isinstance(chunks, ChunkStream)
    while True:
        if pushable and not _behind(direct):
            batch = await _pushed(chunks, direct, encode, framed)  # type: ignore[arg-type]
        else:
            batch = await anext(chunks, None)
            if batch is None:
                return b""
        if isinstance(batch, Last):
            return framed(batch, encode)
        if not batch:
            continue
        data = framed(batch, encode)
        if direct is not None and not _behind(direct):
            direct.write(b"%x\r\n%b\r\n" % (len(data), data))  # one chunk, framed
        else:  # a client that reads slowly (aiohttp waits for it) or went away (raises)
            await response.write(data)


def _reasoning_count(
    required: bool, end: tuple[int, ...], start: tuple[int, ...]
) -> ReasoningCount | None:
    """What counts a streamed answer's reasoning tokens (None: it has none): a request that
    requires reasoning counts to the end tag, another only where the model opens its
    reasoning itself (``start``; ``Req.update_self_opened_reasoning_tokens``)."""
    if not end or not (required or start):
        return None
    return ReasoningCount(end) if required else ReasoningCount(end, start)


def _pushed(
    chunks: ChunkStream,
    transport: Any,
    encode: Callable[[Any], bytes],
    framed: Callable[[list[Any], Callable[[Any], bytes]], bytes],
) -> Any:
    """Push ``chunks`` straight to ``transport`` while it takes them: a future of the first
    batch that may not go there (the last one, or any while the client is behind), or of the
    exception that building one raised."""
    done = asyncio.get_running_loop().create_future()

    def sink(batch: list[Any]) -> None:
        if type(batch) is list and not _behind(transport):
            if batch:
                data = framed(batch, encode)
                transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return
        chunks.push(None)
        if not done.done():
            done.set_result(batch)

    def failed(exc: BaseException) -> None:
        if not done.done():
            done.set_exception(exc)

    chunks.push(sink, failed)
    return done


def _behind(transport: Any) -> bool:
    """Whether the connection has bytes waiting (a client that reads slowly) or is closing (a
    client that went away): then aiohttp's write, which waits for the client or raises."""
    return bool(transport.get_write_buffer_size() or transport.is_closing())


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
    if getattr(writer, "_headers_buf", None):  # the headers not out yet: aiohttp sends them
        return None
    return transport


def _send_headers(response: web.StreamResponse) -> None:
    """Send a prepared stream's headers now (aiohttp's ``StreamWriter.send_headers``)."""
    send = getattr(getattr(response, "_payload_writer", None), "send_headers", None)
    if send is not None:
        send()


def _events(batch: list[Any], encode: Callable[[Any], bytes]) -> bytes:
    if not batch:
        return b""
    return b"data: " + b"\n\ndata: ".join(map(encode, batch)) + b"\n\n"
