"""An HTTP client for inference engines that speak SGLang's API (SGLang or ``inflight engine``).

One client per engine URL, sharing one aiohttp session (``make_session``: keep-alive connections,
a connection limit above anything the generator keeps in flight). It turns a ``/generate``
response into a :class:`Completion` (token ids, sampler log-probs, per-token policy versions,
finish reason) and sorts failures into retryable ones (connection lost, timeouts, 5xx: the
generator re-routes the request to another engine) and final ones (4xx, or an answer that is not
what was asked for: the request itself is bad, or the engine does not support it).

Two request forms, both SGLang's own (``GenerateReqInput``): ``generate`` asks for one sample;
``generate_group`` asks for a prompt's G samples in one request, ``input_ids`` being G copies of
the prompt and ``rid`` one id per sample (SGLang keeps a list of rids as given, so each sample can
still be aborted by its own id; ``sampling_params.n`` would make SGLang invent the ids), and the
answer is a list of G results in request order.

Per-token versions, from the cheapest field an engine reports: ``meta_info.weight_versions``
(SGLang's spans ``[{version, start, end}]`` over output tokens), else
``meta_info.output_token_weight_versions`` (one per token), else ``meta_info.weight_version`` (the
version when the request finished) for every token, which overstates freshness only for
sequences that spanned an update. JSON goes through orjson when it is installed (about 5x faster
to parse than the standard library), else the standard library.

With an API key every request carries ``Authorization: Bearer KEY`` (SGLang's ``--api-key``);
an engine that answers 401 or 403 raises :class:`EngineAuthError` (final: another try with the
same key cannot succeed), and ``check_key`` asks once, at start, so that a wrong key (or an
engine serving a reward or embedding model) fails the stage instead of dropping every sample.
Not here: launching engines (``launcher``) and choosing one (``stage``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.engine import auth
from stages.rollout_batch import Finished, version_array, version_of

if TYPE_CHECKING:  # imported where it is used: the supervisor loads this module for its
    import aiohttp  # config without it (0.25 s of start-up)

try:  # optional: a faster JSON codec; the standard library is the fallback
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None

__all__ = [
    "JSON_CODEC",
    "Completion",
    "EngineAuthError",
    "EngineClient",
    "EngineError",
    "InProcessClient",
    "completion_of",
    "make_session",
]


def _std_dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


_dumps: Callable[[Any], bytes] = _std_dumps
_loads: Callable[[bytes], Any] = json.loads
_DECODE_ERRORS: tuple[type[Exception], ...] = (ValueError,)
JSON_CODEC = "json"
if orjson is not None:
    _dumps, _loads, _DECODE_ERRORS = orjson.dumps, orjson.loads, (orjson.JSONDecodeError,)
    JSON_CODEC = "orjson"

_JSON_HEADERS = {"Content-Type": "application/json"}


class EngineError(Exception):
    """A failed engine call; ``retryable`` says whether another try (or engine) may succeed."""

    def __init__(self, url: str, message: str, *, retryable: bool, status: int | None = None):
        super().__init__(f"{url}: {message}")
        self.url, self.retryable, self.status = url, retryable, status


class EngineAuthError(EngineError, auth.EngineAuthError):
    """The engine refused the API key (401/403); final. Also a ``stages.engine.auth`` one."""

    def __init__(self, url: str, status: int, *, sent: bool, what: str = "") -> None:
        auth.EngineAuthError.__init__(self, url, status, sent=sent, what=what)
        self.retryable = False


@dataclass
class Completion:
    output_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32, one per output token
    versions: np.ndarray  # int32, one per output token
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    meta: dict[str, Any]


def make_session(max_connections: int) -> aiohttp.ClientSession:
    """A session whose keep-alive pool never throttles the generator.

    aiohttp's default connector allows 100 connections per session; a generator with more
    requests in flight would then queue them silently inside aiohttp, behind its own in-flight
    accounting. ``max_connections`` must be above what the caller keeps in flight.
    """
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections))


def _token_list(ids: Sequence[int] | np.ndarray) -> list[int]:
    """Token ids as plain ints (a prompt may arrive as a numpy array; JSON needs Python ints)."""
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)


# GenerateReqInput fields that a rollout's engine call may carry among its sampling
# parameters (RolloutEngine.generate's keywords): they go at the request's top level (the
# engine's protocol.REQUEST_LEVEL_FIELDS, which this module does not import at start-up)
REQUEST_FIELDS = ("require_reasoning", "max_thinking_tokens", "custom_logit_processor")


# among sampling parameters: a base from which each sample's sampling_seed is made
# (SamplingConfig.seed), never sent as such
SEED_EACH_SAMPLE = "seed_each_sample"


def _generate_body(input_ids: Any, sampling_params: Mapping[str, Any], rid: Any) -> dict:
    """A ``/generate`` body: one prompt and rid, or lists of them; log-probs always asked;
    ``REQUEST_FIELDS`` among ``sampling_params`` lifted to the top level; with
    ``SEED_EACH_SAMPLE``, each sample's ``sampling_seed`` made of it and its rid (a list of
    sampling parameters for a list of rids, as SGLang takes them)."""
    sampling = dict(sampling_params)
    body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True, "rid": rid}
    for name in REQUEST_FIELDS:
        if name in sampling:
            body[name] = sampling.pop(name)
    base = sampling.pop(SEED_EACH_SAMPLE, None)
    if base is not None:
        if isinstance(rid, list):
            body["sampling_params"] = [
                {**sampling, "sampling_seed": sample_seed(base, one)} for one in rid
            ]
        else:
            sampling["sampling_seed"] = sample_seed(base, rid)
    return body


def sample_seed(base: int, rid: str) -> int:
    """A sample's ``sampling_seed``: made of ``base`` and its ``rid`` (in [0, 2**63))."""
    digest = hashlib.blake2b(f"{base}:{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _token_versions(meta: Mapping[str, Any], n: int) -> np.ndarray:
    spans = meta.get("weight_versions")
    if spans:
        versions = np.empty(n, dtype=np.int32)
        end = 0
        for span in spans:
            start, stop = span["start"], span["end"]
            if start != end or stop < start:
                raise ValueError(f"weight_versions spans do not tile the output: {spans!r}")
            versions[start:stop] = version_of(span["version"])
            end = stop
        if end != n:
            raise ValueError(f"weight_versions spans cover {end} of {n} output tokens")
        return versions
    per_token = meta.get("output_token_weight_versions")
    if per_token is not None:
        return version_array(per_token)
    return np.full(n, version_of(meta.get("weight_version")), dtype=np.int32)


def parse_completion(body: Mapping[str, Any], url: str = "") -> Completion:
    """A ``/generate`` response (one prompt) as a Completion; EngineError if malformed."""
    try:
        output_ids = np.asarray(body["output_ids"], dtype=np.int32)
        if output_ids.ndim != 1:
            raise ValueError(f"output_ids has shape {output_ids.shape}")
        meta = body["meta_info"]
        pairs = meta.get("output_token_logprobs") or ()
        # [[logprob, token_id, text], ...]: the first column, taken by zip in C
        logprobs = np.asarray(next(zip(*pairs, strict=True)) if pairs else (), dtype=np.float32)
        finish = _finish_type(meta.get("finish_reason") or {})
        version = version_of(meta.get("weight_version"))
        versions = _token_versions(meta, len(output_ids))
    except (KeyError, TypeError, IndexError, ValueError, AttributeError, StopIteration) as exc:
        raise EngineError(url, f"malformed /generate response: {exc!r}", retryable=False) from exc
    hint = " (asked with return_logprob=true?)"
    _check_aligned(url, "/generate returned", output_ids, logprobs, versions, hint)
    return Completion(output_ids, logprobs, versions, finish, version, meta)


def _check_aligned(
    url: str, who: str, output_ids: Any, logprobs: Any, versions: Any, hint: str = ""
) -> None:
    """EngineError unless there is one log-prob and one version per output token."""
    if not (len(logprobs) == len(output_ids) == len(versions)):
        raise EngineError(
            url,
            f"{who} {len(output_ids)} tokens, {len(logprobs)} log-probs and "
            f"{len(versions)} versions{hint}",
            retryable=False,
        )


def _finish_type(reason: Any) -> str:
    """``finish_reason.type`` ("stop", "length", "abort"), or the reason as text."""
    if type(reason) is dict or isinstance(reason, Mapping):  # (a dict: no ABC check)
        return reason.get("type", "unknown")
    return str(reason)


class EngineClient:
    """Calls one engine. ``timeout_s`` bounds every call; generation calls may take long."""

    def __init__(
        self,
        url: str,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ):
        import aiohttp

        self.url = url.rstrip("/")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._has_key = bool(api_key)
        self._info_path = "/model_info"  # or /get_model_info: see model_info()
        self._headers = auth.auth_headers(api_key) or None
        self._json_headers = {**_JSON_HEADERS, **auth.auth_headers(api_key)}
        # asked at each request: the LoRA adapter to name and the version it is ((None, 0):
        # the base model), or None when the run's engines take no adapters (see `_adapted`)
        self.adapter: Callable[[], tuple[str | None, int] | None] | None = None
        # whether the engine takes /close_sessions (a built-in one); SGLang's 404 turns it off
        self._batch_closes = True

    async def _call(
        self, method: str, path: str, payload: Any = None, *, timeout_s: float | None = None
    ) -> Any:
        import aiohttp

        timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        data = None if payload is None else _dumps(payload)
        try:
            async with self.session.request(
                method,
                self.url + path,
                data=data,
                headers=self._json_headers if data is not None else self._headers,
                timeout=timeout,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise EngineError(self.url, f"{method} {path} failed: {exc!r}", retryable=True) from exc
        if status in (401, 403):
            raise EngineAuthError(self.url, status, sent=self._has_key, what=f"{method} {path}")
        if status >= 400:
            text = raw[:500].decode(errors="replace")
            raise EngineError(
                self.url,
                f"{method} {path} answered {status}: {text}",
                retryable=status >= 500,
                status=status,
            )
        if not raw:
            return None
        try:
            return _loads(raw)
        except _DECODE_ERRORS as exc:
            raise EngineError(
                self.url, f"{path} returned non-JSON: {raw[:200]!r}", retryable=False
            ) from exc

    async def generate(
        self,
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Mapping[str, Any],
        *,
        rid: str,
        session: str | None = None,
    ) -> Completion:
        """One sample of ``input_ids``; ``session``: the session it belongs to (SGLang's
        ``session_id``: an engine with ``--enable-session-radix-cache`` keeps its KV for it)."""
        body = _generate_body(_token_list(input_ids), sampling_params, rid)
        if session is not None:
            body["session_id"] = session
        pinned = self._adapted(body)
        (completion,) = await self._generate(body, [rid], listed=False)
        return _pinned(completion, pinned)

    async def generate_group(
        self,
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Mapping[str, Any],
        *,
        rids: Sequence[str],
    ) -> list[Completion]:
        """``len(rids)`` samples of ``input_ids`` in one request, in the order of ``rids``.

        A non-retryable EngineError means the engine refused the request or answered something
        other than one result per rid: an engine without batch support, or a bad prompt.
        """
        ids = _token_list(input_ids)
        return await self.generate_batch([ids] * len(rids), sampling_params, rids=rids)

    async def generate_batch(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        sampling_params: Mapping[str, Any],
        *,
        rids: Sequence[str],
    ) -> list[Completion]:
        """One sample of each prompt in one request (SGLang's batched ``input_ids``), in order.

        Errors as ``generate_group``.
        """
        body = _generate_body([_token_list(ids) for ids in prompts], sampling_params, list(rids))
        pinned = self._adapted(body)
        return [_pinned(c, pinned) for c in await self._generate(body, rids, listed=True)]

    def _adapted(self, body: dict[str, Any]) -> int | None:
        """Name the adapter of the policy version this engine serves (``publish.lora_transport:
        files``) in ``body``; returns that version, which every token of the answer is (an
        adapter is fixed for a request's whole life), or None when requests name none."""
        found = self.adapter() if self.adapter is not None else None
        if found is None:
            return None
        name, version = found
        if name is not None:
            body["lora_path"] = name
        return version

    async def _generate(
        self, request: dict[str, Any], rids: Sequence[str], *, listed: bool
    ) -> list[Completion]:
        """POST ``request`` to ``/generate``; its answer (a list when ``listed``) checked and
        read as one Completion per rid, in order."""
        body = await self._call("POST", "/generate", request)
        if not listed:
            if not isinstance(body, Mapping):
                raise EngineError(
                    self.url, f"/generate returned {type(body).__name__}", retryable=False
                )
            return [parse_completion(body, self.url)]
        if not isinstance(body, list) or len(body) != len(rids):
            got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
            raise EngineError(
                self.url,
                f"/generate with {len(rids)} input_ids returned {got} (expected a list of "
                f"{len(rids)} results)",
                retryable=False,
            )
        completions = []
        for rid, item in zip(rids, body, strict=True):
            if not isinstance(item, Mapping):
                raise EngineError(
                    self.url,
                    f"/generate result for {rid} is {type(item).__name__}",
                    retryable=False,
                )
            completion = parse_completion(item, self.url)
            answered = completion.meta.get("id")
            if answered is not None and answered != rid:
                raise EngineError(
                    self.url,
                    f"/generate answered request {answered!r} where {rid!r} was expected "
                    "(results out of request order)",
                    retryable=False,
                )
            completions.append(completion)
        return completions

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether ``/health`` answers 200 within ``timeout_s`` (not the generation timeout)."""
        try:
            await self._call("GET", "/health", timeout_s=timeout_s)
        except EngineError:
            return False
        return True

    async def check_key(self, timeout_s: float = 5.0) -> None:
        """Raise EngineAuthError if the engine refuses this client's key (asked on a route that
        needs one), and a final EngineError if it serves a model that does not generate (a
        reward or embedding model: ``/model_info``'s ``is_generation`` false); any other
        failure is left to the requests that follow."""
        try:
            info = await self.model_info(timeout_s=timeout_s)
        except EngineAuthError:
            raise
        except EngineError:
            return
        if isinstance(info, dict) and info.get("is_generation") is False:
            raise EngineError(
                self.url,
                f"{self._info_path} says is_generation: false: it serves a reward or embedding "
                "model (SGLang's --is-embedding), which does not generate; the generator needs "
                "an engine serving the policy",
                retryable=False,
            )

    async def deterministic(self, timeout_s: float = 5.0) -> bool:
        """Whether the engine was started with ``--enable-deterministic-inference``
        (``/server_info``, SGLang's and the built-in engine's; False when it does not say)."""
        try:
            info = await self._call("GET", "/server_info", timeout_s=timeout_s)
        except EngineError:
            return False
        return isinstance(info, dict) and info.get("enable_deterministic_inference") is True

    async def model_info(self, timeout_s: float | None = None) -> dict[str, Any]:
        """SGLang's ``/model_info`` (``/get_model_info`` on a server that has only that name, as
        SGLang 0.5.5 has; 0.5.23 has both and logs a deprecation warning at every call of the
        old one)."""
        try:
            return await self._call("GET", self._info_path, timeout_s=timeout_s)
        except EngineError as exc:
            if exc.status != 404 or self._info_path == "/get_model_info":
                raise
        self._info_path = "/get_model_info"
        return await self._call("GET", self._info_path, timeout_s=timeout_s)

    async def weight_version(self, timeout_s: float = 5.0) -> int:
        """The policy version the engine generates with (SGLang: ``/model_info``)."""
        info = await self.model_info(timeout_s=timeout_s)
        try:
            return version_of(info["weight_version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(
                self.url, f"{self._info_path} has no integer weight_version: {exc}", retryable=False
            ) from exc

    async def pause(self, mode: str = "in_place") -> None:
        """Pause generation; in-flight updates must never use ``abort`` (SGLang's default)."""
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def abort(self, rid: str) -> None:
        await self._call("POST", "/abort_request", {"rid": rid})

    async def close_session(self, session: str) -> None:
        """SGLang's ``/close_session``: what the engine held for ``session`` may go."""
        await self._call("POST", "/close_session", {"session_id": session})

    async def close_sessions(self, sessions: list[str]) -> int:
        """``close_session`` of each of ``sessions``: in one request to a built-in engine
        (``/close_sessions``), one each to an engine without that route (SGLang's 404, then
        remembered). How many of them failed (the engine gone: what it held went with it)."""
        if self._batch_closes:
            try:
                await self._call("POST", "/close_sessions", {"session_ids": sessions})
                return 0
            except EngineError as exc:
                if exc.status not in (404, 405):
                    return len(sessions)
                self._batch_closes = False
        failed = 0
        for session in sessions:
            try:
                await self.close_session(session)
            except EngineError:
                failed += 1
        return failed


_timeout = getattr(asyncio, "timeout", None)  # Python 3.11+


class InProcessClient(EngineClient):
    """An EngineClient for a built-in engine in this process (``stages.engine.in_process``):
    ``/generate`` bodies go to its scheduler directly (checked as the route checks them) and
    its results become Completions without SGLang's JSON layout in between; every other route,
    rare and cheap, still goes over HTTP to the same engine."""

    def __init__(self, url: str, session: aiohttp.ClientSession, engine: Any, **kwargs: Any):
        super().__init__(url, session, **kwargs)
        self.engine = engine

    @contextlib.contextmanager
    def _as_the_route_answers(self) -> Iterator[None]:
        """The engine's refusals as EngineErrors, as its ``/generate`` route answers them."""
        from stages.engine.protocol import RequestError

        try:
            yield
        except (RequestError, ValueError) as exc:  # what the route answers with 400
            raise EngineError(
                self.url, f"/generate answered 400: {exc}", retryable=False, status=400
            ) from exc
        except RuntimeError as exc:  # the scheduler stopped (stopping, or its thread died)
            raise EngineError(self.url, f"/generate failed: {exc!r}", retryable=True) from exc

    async def _generate(
        self, request: dict[str, Any], rids: Sequence[str], *, listed: bool
    ) -> list[Completion]:
        try:
            with self._as_the_route_answers():
                if _timeout is not None:  # no task of its own per request, as wait_for makes
                    async with _timeout(self.timeout.total):
                        results = await self.engine.results(request)
                else:
                    results = await asyncio.wait_for(
                        self.engine.results(request), self.timeout.total
                    )
        except asyncio.TimeoutError as exc:  # cancelled on time-out: its rows were aborted
            raise EngineError(self.url, "/generate timed out", retryable=True) from exc
        return [completion_of(result, self.url) for result in results]

    async def close_sessions(self, sessions: list[str]) -> int:
        """As the route closes them, on the scheduler directly where it can (episodes'
        sessions: ``InProcessEngine.release_sessions``), the rest over HTTP."""
        released, rest = self.engine.release_sessions(sessions)
        if released is not None:
            await asyncio.wrap_future(released)
        return await super().close_sessions(rest) if rest else 0

    def submit_groups(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        sampling_params: Mapping[str, Any],
        rids: Sequence[Sequence[str]],
    ) -> tuple[list[asyncio.Future], int | None]:
        """Several groups in one request: ``len(rids[i])`` samples of ``prompts[i]``, checked
        as the ``/generate`` body that lists them would be (``InProcessEngine.submit_groups``);
        one future per group, resolving with the engine's results in the order of its rids
        (``finished`` reads them) as soon as that group is done. Also returns the adapter
        version every token is pinned to (``_adapted``).

        EngineError (400) if the engine refuses them, (retryable) if it has stopped.
        """
        adapter: dict[str, Any] = {}
        pinned = self._adapted(adapter)
        with self._as_the_route_answers():
            futures = self.engine.submit_groups(
                [_token_list(p) for p in prompts],
                sampling_params,
                rids,
                adapter.get("lora_path"),
            )
        return futures, pinned

    def finished(
        self, results: Sequence[Any], pinned: int | None, engine: str, timings: tuple[float, float]
    ) -> tuple[Finished, int]:
        """A group's results (``submit_groups``) as the ``Finished`` columns its rollout group
        carries (what ``completions`` gives, without an object or an array per sample; served
        by ``engine``, ``timings`` its ``queued_s`` and ``generate_s``), and the newest policy
        version among them. EngineError (not retryable) if a result does not
        have one log-prob and one version per token."""
        ids, logprobs, versions, finish = [], [], [], []
        newest, read = 0, None  # a group's samples mostly carry one version: read it once
        for result in results:
            out, lps = result.output_ids, result.output_token_logprobs or ()
            per_token = result.output_token_weight_versions
            if pinned is not None:  # every token of the adapter its request named
                per_token = [pinned] * len(out)
            if not len(out) == len(lps) == len(per_token):
                _check_aligned(self.url, "the engine gave", out, lps, per_token)  # raises
            ids.append(out)
            logprobs.append(lps)
            versions.append(per_token)
            reason = result.finish_reason
            typed = type(reason) is dict  # what the scheduler gives: no call for it
            finish.append(reason.get("type", "unknown") if typed else _finish_type(reason or {}))
            if result.weight_version != read:
                read = result.weight_version
                newest = max(newest, version_of(read))
        if pinned is not None:
            newest = pinned
        return Finished(ids, logprobs, versions, finish, engine, *timings), newest

    def abort(self, rids: Iterable[str]) -> None:
        self.engine.abort(rids)

    async def weight_version(self, timeout_s: float = 5.0) -> int:
        """What ``/model_info`` would say, read from the scheduler: the generator asks twice a
        second while its lag gate is shut, each a request this process would serve itself."""
        scheduler = self.engine.scheduler
        if scheduler is None or not self.engine.alive:
            return await super().weight_version(timeout_s)  # the route says what is wrong
        return version_of(scheduler.weight_version)


def _pinned(completion: Completion, version: int | None) -> Completion:
    """``completion`` with every token of ``version`` (the adapter its request named)."""
    if version is not None:
        completion.versions = np.full(len(completion.output_ids), version, dtype=np.int32)
        completion.weight_version = version
    return completion


def completion_of(result: Any, url: str = "") -> Completion:
    """A scheduler's ``SequenceResult`` as the Completion its ``/generate`` answer would give
    (``parse_completion``), with the answer's ``meta_info`` fields but the per-token lists."""
    versions = version_array(result.output_token_weight_versions)  # as parse_completion reads them
    output_ids = np.asarray(result.output_ids, dtype=np.int32)
    logprobs = np.asarray(result.output_token_logprobs or (), dtype=np.float32)
    _check_aligned(url, "the engine gave", output_ids, logprobs, versions)
    reason = result.finish_reason or {}
    meta = {
        "id": result.rid,
        "finish_reason": reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": result.cached_tokens,
        "cached_weight_version": result.cached_weight_version,
        "weight_version": result.weight_version,
        "e2e_latency": result.e2e_latency,
        **result.extra,
    }
    finish = _finish_type(reason)
    return Completion(
        output_ids, logprobs, versions, finish, version_of(result.weight_version), meta
    )
