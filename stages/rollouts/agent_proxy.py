"""The agent proxy: an OpenAI-compatible server through which an unmodified agent samples from the
policy, every call recorded as the exact tokens the engine sampled.

One ``AgentProxy`` per process (per event loop) listens on 127.0.0.1 (a free port) and serves
each running episode under a base URL of its own, ``http://127.0.0.1:PORT/e/EPISODE/v1``:
``GET /models`` (the policy, named ``policy``), ``POST /completions``, ``POST
/chat/completions``, ``POST /responses`` (the OpenAI Agents SDK's default API) and ``POST
/messages`` (Anthropic's, for an ``anthropic`` client whose base URL is the episode's less
``/v1``) with the built-in engine's own request checks and answer layout
(``stages.engine.openai_api``, ``openai_chat``, ``openai_responses``, ``anthropic_messages``:
tools, stop strings, log-probs, streaming, usage; any model name is accepted). A request's
samples come from the episode's ``RolloutEngine`` (the generator's engines, in-flight weight
updates and all), one completion per call (``n`` > 1 is refused: an episode is one trajectory),
with the run's sampling (``temperature``, ``top_p``, ``top_k``, ``min_p``: what the learner
trains against) over the agent's, and ``max_tokens`` held to the run's ``max_new_tokens`` and
to what is left of the episode's token budget.

Calls join the episode's ``Trajectory``. The first call's prompt tokens start it; a call whose
prompt tokens begin with everything the trajectory holds (its prompt, what was sampled and what
was inserted) extends it: the tokens in between (a tool's answer, the next user turn, the chat
template's markup) are inserted (masked, never trained) and the call's completion is sampled
into it, so the trained tokens are exactly those the engine sampled. The model's tokens are
never re-tokenized: a chat call whose messages are the last call's, the answer it got and more
(the template renders that answer again, often differently: a tool call as JSON, the text
re-tokenized) continues from the model's own tokens, followed by the template's closing markup
of the answer and the new messages; a completions call whose prompt text is the last call's
prompt and answer and more continues with the tokens of the rest (``agent_calls_rejoined``).
A call that does not extend the trajectory either way (an agent that starts over, or edits the
history) is served but not trained, and counted (``agent_calls_unjoined``): a group compares
the rewards of ``group_size`` samples of one prompt, one sample per episode, so an episode's
other segments have no place in it (AReaL trains them as samples of their own). Budgets:
``max_turns`` calls and ``max_tokens`` tokens after the prompt; a call past them gets HTTP 400
and ends the episode's trajectory there.

Not here: running the agent (``openai_agent``), the engines (the generator's).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx  # the openai client's (openai_agent needs openai)
from aiohttp import web

from stages.detokenize import decoder
from stages.engine.harmony import kept_stop_ids
from stages.engine.incremental_text import IncrementalText
from stages.engine.openai_api import OpenAIError, OpenAIRoutes, refusal, route_refusal
from stages.engine.openai_chat import ChatSettings
from stages.engine.openai_responses import ResponseStore, sse_named
from stages.engine.protocol import (
    SequenceResult,
    parse_generate,
    render_result,
    token_texts,
)
from stages.engine.reasoning import reasoning_tokens
from stages.engine.streaming import Last
from stages.generator.client import SEED_EACH_SAMPLE
from stages.rollouts.api import RequestRefused, RolloutEngine
from stages.rollouts.trajectory import Trajectory

__all__ = ["AgentProxy", "Episode"]

POLICY = "policy"  # the model name /models lists
# the run's win over the agent's (a custom logit processor: the run's, on every sample)
_RUN_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "custom_logit_processor",
                 "custom_params", SEED_EACH_SAMPLE)  # fmt: skip
_UNLIMITED_CONTEXT = 1 << 30


class _RecordingChat(ChatSettings):
    """The served model's chat settings, remembering what each rendered prompt was made of
    (the messages, tools and template options), for the call that then samples from it."""

    rendered: dict[tuple[int, ...], tuple[list, Any, dict]]

    def render(self, messages: list[dict[str, Any]], tools: Any, kwargs: dict) -> list[int]:
        options = dict(kwargs)
        ids = super().render(messages, tools, kwargs)
        if options.get("add_generation_prompt", True):
            self.rendered[tuple(ids)] = ([dict(m) for m in messages], tools, options)
        return ids


@dataclass
class _Last:
    """The last call that joined the trajectory: what its prompt was made of and its answer."""

    messages: list[dict[str, Any]] | None  # a chat call's
    tools: Any
    options: dict[str, Any]
    text: str | None  # a completions call's prompt text
    output_ids: list[int]
    output_text: str  # as answered: a matched stop string cut off
    full_text: str  # every sampled token's text (the stop string kept)


class Episode:
    """One agent episode: its engine, the calls it made and the trajectory they built."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        *,
        sampling: Mapping[str, Any],
        max_calls: int,
        max_tokens: int,
        context_length: int,
        chat: ChatSettings | None,
        counters: Any,
        name: str = "",
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.sampling = dict(sampling)
        self.max_calls, self.max_tokens = max_calls, max_tokens
        self.context_length = context_length
        self.counters = counters
        self.name = name
        self.decode = decoder(tokenizer)
        self.trajectory: Trajectory | None = None
        self.calls = 0  # calls served (joined or not)
        self.unjoined = 0
        self.finish_reason = "stop"  # the trajectory's: its last joined call's, or a budget's
        self.budget_spent = False
        self._last: _Last | None = None
        if chat is not None:  # the run's settings, shared, recording this episode's prompts
            chat = chat.shared_as(_RecordingChat)
            chat.rendered = {}
        self.chat = chat
        self.routes = OpenAIRoutes(
            self.generate,
            self.stream,
            self.decode,
            served_model_name=POLICY,
            context_length=context_length,
            chat=chat,
            any_model=True,
            response_store=ResponseStore(capacity=64),  # the episode's own, for its agent
        )

    # ------------------------------------------------------------------ the routes' engine
    async def generate(self, body: Any) -> dict[str, Any]:
        """A native ``/generate`` body (what the /v1 routes made of the agent's request): one
        completion from the episode's engine, recorded, rendered as the engine renders it."""
        (inp,) = self._one(body)
        if self.calls >= self.max_calls:
            self._spent("max_turns")
            raise OpenAIError(f"this episode's budget of {self.max_calls} calls is spent")
        sampling = dict(body.get("sampling_params") or {})
        sampling.pop("n", None)
        if inp.require_reasoning:  # a thinking chat call: its grammar waits for the reasoning
            sampling["require_reasoning"] = True
            if "max_thinking_tokens" in self.sampling:  # and the run's thinking budget holds
                sampling["max_thinking_tokens"] = self.sampling["max_thinking_tokens"]
        for name in _RUN_SAMPLING:
            if name in self.sampling:
                sampling[name] = self.sampling[name]
        limit = self.sampling.get("max_new_tokens")
        wanted = sampling.get("max_new_tokens")
        if limit is not None:
            sampling["max_new_tokens"] = limit if wanted is None else min(wanted, limit)
        made_of = self.chat.rendered.pop(tuple(inp.input_ids), None) if self.chat else None
        context = self._joined(inp.input_ids, made_of, body.get("text"))
        if context is not None and self.max_tokens:
            started = self.trajectory.prompt_ids if self.trajectory is not None else context
            left = self.max_tokens - (len(context) - len(started))
            if left <= 0:
                self._spent("max_tokens")
                raise OpenAIError(f"this episode's budget of {self.max_tokens} tokens is spent")
            sampling["max_new_tokens"] = min(sampling.get("max_new_tokens") or left, left)
        self.calls += 1
        feed = context if context is not None else list(inp.input_ids)
        try:
            generation = await self.engine.generate(feed, **sampling)
        except RequestRefused as exc:  # the agent's to handle, as a server's 400 would be
            raise OpenAIError(f"the engine refused this call: {exc}") from exc
        if context is not None:
            trajectory = self.trajectory
            if trajectory is None:
                trajectory = self.trajectory = Trajectory(feed)
            elif len(feed) > len(trajectory.context):
                trajectory.inserted(feed[len(trajectory.context) :])
            trajectory.sampled(generation)
            self.finish_reason = generation.finish_reason
        ids = generation.token_ids.tolist()
        result = SequenceResult(
            rid=f"{self.name}/{self.calls}",
            prompt_tokens=len(feed),
            output_ids=ids,
            finish_reason=self._finish(inp, ids, generation.finish_reason),
            weight_version=str(int(generation.versions.max())) if len(ids) else "",
            output_token_weight_versions=[str(v) for v in generation.versions.tolist()],
            output_token_logprobs=generation.logprobs.tolist(),
            cached_tokens=generation.cached_tokens,
            reasoning_tokens=self._reasoning_tokens(inp, ids),
        )
        rendered = render_result(
            result,
            decode=self.decode,
            skip_special_tokens=inp.params.skip_special_tokens,
            return_logprob=inp.return_logprob,
            no_stop_trim=inp.params.no_stop_trim,
            token_text=token_texts(self.decode, body),
            prompt_ids=feed,
            kept_stop_ids=inp.kept_stop_ids,
        )
        if inp.return_prompt_token_ids:  # what the engine was given: the trajectory's context
            rendered["prompt_token_ids"] = list(feed)
        if context is not None:
            messages, tools, options = made_of or (None, None, {})
            text = body.get("text") if isinstance(body.get("text"), str) else None
            full = ""  # decoded after the prompt, as the answer's text is
            if self.decode is not None:
                skip = inp.params.skip_special_tokens
                full = IncrementalText.whole(feed, ids, self.decode, skip).final(ids, False)
            answer = rendered.get("text", "")
            self._last = _Last(messages, tools, options, text, ids, answer, full)
        return rendered

    def _reasoning_tokens(self, inp: Any, ids: list[int]) -> int:
        """What an engine with the rollout's ``reasoning_parser`` reports in ``meta_info``."""
        reasoning = self.chat.reasoning if self.chat is not None else None
        if reasoning is None or not inp.require_reasoning:
            return 0
        return reasoning_tokens(ids, inp.think_end or reasoning.end_ids)  # (K2's: its effort's)

    async def stream(self, body: Any) -> AsyncIterator[list[dict[str, Any]]]:
        """A streamed call: the whole answer as its one (last) chunk, once sampled."""
        yield Last([await self.generate(body)])

    # ------------------------------------------------------------------ helpers
    def _one(self, body: Any) -> list[Any]:
        if "lora_path" in body:  # the episode samples the policy, whatever model it names
            body = {k: v for k, v in body.items() if k != "lora_path"}
        inputs, _ = parse_generate(
            body,
            vocab_size=len(self.tokenizer),
            context_length=self.context_length,
            encode=self.tokenizer.encode,
            # gpt-oss's <|call|> ends a call (the engine's --tool-call-parser gpt-oss keeps it)
            kept_stop_ids=kept_stop_ids(self.tokenizer, self.chat and self.chat.tool_parser),
            # a K2 Horizon call's reasoning ends at its effort's end tag
            think_ends=self.chat.reasoning.selectable if self.chat and self.chat.reasoning else (),
        )
        if len(inputs) != 1:
            raise OpenAIError(
                "the agent proxy samples one completion per call (an episode is one trajectory): "
                "send one prompt and n = 1",
                "n",
            )
        if inputs[0].top_logprobs_num:
            raise OpenAIError(
                "the agent proxy returns the sampled tokens' log-probs only (no top log-probs)",
                "logprobs",
            )
        return inputs

    def _joined(
        self, prompt: list[int], made_of: tuple[list, Any, dict] | None, text: Any
    ) -> list[int] | None:
        """What the engine is given when the call joins the trajectory (the trajectory's own
        tokens, then the prompt's new ones); None when it does not."""
        trajectory = self.trajectory
        if trajectory is None:
            return list(prompt)
        context = trajectory.context
        if len(prompt) >= len(context) and prompt[: len(context)] == context:
            return list(prompt)
        rest = self._after_answer(prompt, made_of) if made_of else self._after_text(text)
        if rest is not None:
            self.counters["agent_calls_rejoined"] += 1
            return context + rest
        self.unjoined += 1
        self.counters["agent_calls_unjoined"] += 1
        return None

    def _after_answer(self, prompt: list[int], made_of: tuple[list, Any, dict]) -> list[int] | None:
        """A chat call whose messages are the last call's, the answer it got (re-rendered by
        the template, so its tokens may differ from the sampled ones) and more: the tokens
        after the answer (the template's closing markup of the answer, then the new
        messages), to follow the model's own tokens."""
        last, chat = self._last, self.chat
        if last is None or last.messages is None or chat is None:
            return None
        messages, tools, options = made_of
        k = len(last.messages)
        if len(messages) <= k or messages[:k] != last.messages or tools != last.tools:
            return None
        if messages[k].get("role") != "assistant" or options != last.options:
            return None
        try:
            render = super(_RecordingChat, chat).render  # not a prompt anyone samples from
            before = render(messages[:k], tools, dict(options))
            answered = render(messages[: k + 1], tools, {**options, "add_generation_prompt": False})
        except OpenAIError:
            return None
        if answered[: len(before)] != before or prompt[: len(answered)] != answered:
            return None
        answer = answered[len(before) :]
        end = last.output_ids[-1] if last.output_ids else None
        # the markup the template puts after the answer's end-of-turn token ("\n" after
        # <|im_end|>): the model's own answer ends with that token
        tail: list[int] = []
        if end is not None and end in answer:
            tail = answer[len(answer) - answer[::-1].index(end) :]
        return tail + prompt[len(answered) :]

    def _after_text(self, text: Any) -> list[int] | None:
        """A completions call whose prompt text is the last call's, the text it got (or the
        text it sampled, a stop string included) and more: the tokens of the rest, to follow
        the model's own tokens."""
        last = self._last
        if last is None or last.text is None or not isinstance(text, str):
            return None
        # the answer as sampled (an agent that puts back the stop string it was cut at), or as
        # answered; either way the model's tokens, stop string included, stay as they are
        for answer in (last.full_text, last.output_text):
            before = last.text + answer
            if text.startswith(before):
                return list(self.tokenizer.encode(text[len(before) :], add_special_tokens=False))
        return None

    def _spent(self, reason: str) -> None:
        if not self.budget_spent:
            self.budget_spent = True
            self.finish_reason = reason
            self.counters[f"agent_{reason}"] += 1

    def _finish(self, inp: Any, ids: list[int], reason: str) -> dict[str, Any]:
        """SGLang's ``finish_reason`` for a completion whose engine said ``reason``: the stop
        string it ends with (the text is cut before it), or its last token when that is a
        special or stop token (its text is left out), else no match."""
        if reason == "length":
            return {"type": "length", "length": len(ids)}
        if reason != "stop":
            return {"type": reason}
        stops = inp.params.stop or ()
        if stops and self.decode is not None:
            text = self.decode(ids, inp.params.skip_special_tokens)
            found = [(text.find(s), s) for s in stops if s in text]
            if found:
                return {"type": "stop", "matched": min(found)[1]}
        special = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        special.update(inp.params.stop_token_ids or ())
        if ids and ids[-1] in special:
            return {"type": "stop", "matched": ids[-1]}
        return {"type": "stop", "matched": None}


class AgentProxy:
    """The process's proxy server: ``open(episode)`` gives an episode its base URL."""

    _shared: dict[asyncio.AbstractEventLoop, AgentProxy] = {}

    def __init__(self) -> None:
        self.episodes: dict[str, Episode] = {}
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._http: Any = None  # httpx.AsyncClient of the openai clients (http_client)

    def http_client(self) -> Any:
        """The ``httpx.AsyncClient`` of this process's agents' ``openai`` clients: their calls
        to ``/completions`` and ``/chat/completions`` are answered in the process, without a
        socket or HTTP parsing (the same answers, from the same routes; 2 ms a call less than
        through the loopback and httpx's pool); anything else goes to the server."""
        if self._http is None:
            fallback = httpx.AsyncHTTPTransport(retries=0)
            self._http = httpx.AsyncClient(
                transport=_InProcess(self, fallback), timeout=httpx.Timeout(None), trust_env=False
            )
        return self._http

    @classmethod
    async def shared(cls) -> AgentProxy:
        """The running loop's proxy, started on first use."""
        loop = asyncio.get_running_loop()
        proxy = cls._shared.get(loop)
        if proxy is None:
            proxy = cls._shared[loop] = cls()
            await proxy.start()
        return proxy

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        base = "/e/{episode}/v1"
        app.router.add_get(base + "/models", self._route("models"))
        app.router.add_get(base + "/models/{model:.+}", self._route("model"))
        app.router.add_post(base + "/completions", self._route("completions"))
        app.router.add_post(base + "/chat/completions", self._route("chat_completions"))
        app.router.add_post(base + "/responses", self._route("responses"))
        # Anthropic's Messages API: an ``anthropic`` client's base URL is the episode's less /v1
        app.router.add_post(base + "/messages", self._route("messages"))
        app.router.add_post(base + "/messages/count_tokens", self._route("count_tokens"))
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        # every episode in flight may connect at once (a generator keeps hundreds)
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def open(self, episode: Episode) -> str:
        """Serve ``episode``; returns its base URL (for ``openai.AsyncOpenAI(base_url=...)``)."""
        key = f"{next(self._ids)}"
        episode.name = episode.name or key
        self.episodes[key] = episode
        return f"http://127.0.0.1:{self.port}/e/{key}/v1"

    def close(self, url: str) -> None:
        """Stop serving the episode at ``url``: its later calls get 404."""
        self.episodes.pop(url.rstrip("/").split("/")[-2], None)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        if self._runner is not None:
            await self._runner.cleanup()
        for loop, proxy in list(self._shared.items()):
            if proxy is self:
                del self._shared[loop]

    def _route(self, handler: str) -> Any:
        async def serve(request: web.Request) -> web.StreamResponse:
            episode = self.episodes.get(request.match_info["episode"])
            if episode is None:
                return web.json_response(_not_found(), status=404)
            return await getattr(episode.routes, handler)(request)

        return serve


def context_length_of(tokenizer: Any) -> int:
    """The model's context (``max_position_embeddings`` of the tokenizer's model folder)."""
    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return _UNLIMITED_CONTEXT
    return int(config.get("max_position_embeddings") or _UNLIMITED_CONTEXT)


def _not_found() -> dict[str, Any]:
    return {
        "error": {
            "message": "no such episode (it has ended)",
            "type": "invalid_request_error",
            "param": None,
            "code": 404,
        }
    }


class _InProcess(httpx.AsyncBaseTransport):
    """An httpx transport that answers the proxy's completion routes in the process."""

    _ROUTES = {"completions": "completions", "chat/completions": "chat", "responses": "responses"}
    _ROUTES["messages"] = "messages"

    def __init__(self, proxy: AgentProxy, fallback: Any) -> None:
        self.proxy, self.fallback = proxy, fallback

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.split("/", 4)  # "", "e", EPISODE, "v1", route
        route = self._ROUTES.get(parts[4]) if len(parts) == 5 and parts[1] == "e" else None
        if request.method != "POST" or route is None:
            return await self.fallback.handle_async_request(request)
        episode = self.proxy.episodes.get(parts[2])
        if episode is None:
            return httpx.Response(404, json=_not_found())
        try:
            body = json.loads(await request.aread())
        except ValueError as exc:
            message = f"the request body is not JSON: {exc}"
            return httpx.Response(400, json=refusal(OpenAIError(message)))
        reply = await episode.routes.reply(route, body)
        if reply.chunks is None:
            return httpx.Response(reply.status, json=reply.body)
        try:  # a request refused before its first event still gets an error status
            first = await anext(reply.chunks)
        except ValueError as exc:  # OpenAIError, RequestError, a rid in flight
            await reply.chunks.aclose()
            return httpx.Response(400, json=route_refusal(route, exc))
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=_EventStream(first, reply.chunks, named=route in ("responses", "messages")),
        )

    async def aclose(self) -> None:
        await self.fallback.aclose()


class _EventStream(httpx.AsyncByteStream):
    """Server-sent events of a streamed reply, as an httpx response stream."""

    def __init__(
        self, first: list[Any], chunks: AsyncIterator[list[Any]], *, named: bool = False
    ) -> None:
        self.first, self.chunks = first, chunks
        self.named = named  # the Responses and Messages routes': ``event:`` lines, no [DONE]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        batch: list[Any] | None = self.first
        while batch is not None:
            if batch and self.named:
                yield sse_named(batch, lambda c: json.dumps(c).encode())
            elif batch:
                yield b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in batch)
            batch = await anext(self.chunks, None)
        if not self.named:
            yield b"data: [DONE]\n\n"

    async def aclose(self) -> None:
        await self.chunks.aclose()
