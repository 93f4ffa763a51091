"""Rewards computed behind HTTP: a reward server (``url``), a reward model served by an engine
(``reward_model``: its ``/classify``) or a generative judge served by an engine (``judge``),
called from the scorer's event loop (no worker process: the server does the work;
``RewardRunner`` gathers them with the functions).

A reward server, protocol ``inflight`` (the default), gets ``POST url`` with a JSON object of
lists aligned per sample: every keyword list a reward function gets (``prompts``,
``completions``, ``completion_ids``, ``finish_reason``, the prompt's meta keys such as
``answer``...), plus the fields of OpenRLHF's remote reward model, ``query`` (prompt text +
completion text) and ``labels`` (``answer``, ``""`` where there is none), unless meta keys of
those names come first. It answers ``{"rewards": [...]}`` (OpenRLHF's answer; ``{"scores":
[...]}`` or a bare list work too), a number or null (nothing, as a function's ``None``) per
sample. Protocol ``slime`` is slime's ``--rm-url``: one sample a request, ``{"prompt",
"response", "label"}`` in, a number out.

A judge fills ``template`` with each sample's values, has the engine answer it (``/generate``, a
batch of prompts a request, or ``/v1/chat/completions``, one a request), searches the answer with
``parse`` and scores the group's text (through ``map`` when given).

A reward model's samples go to the engine's ``/classify`` as ids of each conversation (prompt
messages, then the completion as the assistant's turn) rendered by the model's own chat
template at ``/v1/tokenize`` (``input: chat``), as ``template`` filled (``input: text``), or as
a cross-encoder's ``[query, document]`` pairs, ``pair``'s templates filled (``input: pair``,
SGLang's ``is_cross_encoder_request``); the reward is the ``label``-th output of each answer's
``embedding``, or the number a one-label cross-encoder answers.

Each reward has one connection pool, at most ``concurrency`` calls in flight (across the
scorer's concurrent scoring calls), ``timeout_s`` per call, and ``retries`` more tries with
doubling waits after a connection error, a time-out or HTTP 5xx/429 (a 4xx is final). A call
that still fails, or whose answer is unusable (not JSON, the wrong shape or length), fails its
samples; a value that is not a finite number, or a judge's answer the rule cannot read, fails
its sample. A failed sample gets reward 0 with an ``error`` in its ``reward_info``, as when a
reward function fails; failures are counted by kind (``failed_<kind>``: samples) and the first
of each kind is logged (``reward_failed``).

``HttpCaller`` is that machinery without the protocols (the connection pool, the bound, the
time limit, the retries, the failures by kind): the teacher of on-policy distillation
(``teacher.py``) calls its engine through one too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from stages.scorer.runner import EngineSite, Outcome, checked_values
from stages.scorer.spec import JudgeSpec, RewardModelSpec, RewardSpec

if TYPE_CHECKING:
    from stages.generator.launcher import LaunchConfig

__all__ = ["HttpCaller", "HttpFailure", "RemoteReward", "quoted"]

_MAX_BACKOFF_S = 30.0
_SHOWN = 200  # characters of an answer quoted in an error


class HttpFailure(Exception):
    """A call's samples failed: ``kind`` (``timeout``, ``http_error``...) and why; ``refused``:
    the server answered 4xx (the request itself was refused)."""

    def __init__(self, kind: str, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.kind, self.message, self.refused = kind, message, refused


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} cannot be written as JSON")


def quoted(data: Any) -> str:
    """``data`` (an answer's bytes, or any value) for an error message, cut to a few lines."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else repr(data)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _values(values: Any, n: int) -> tuple[list[float | None], dict[int, tuple[str, str]]]:
    """A server's values, checked as a function's are: unusable as a whole raises."""
    checked = checked_values(values, n)
    if isinstance(checked, str):
        raise HttpFailure("bad_response", checked)
    out, bad = checked
    return out, {i: ("bad_value", why) for i, why in bad.items()}


# ---------------------------------------------------------------------------------- protocols
class _Protocol(ABC):
    """How a reward's samples become calls: ``path`` on its URL, at most ``size`` samples a
    call (None: all), ``request`` the body of a part (awaiting set-up calls through ``http``
    where it needs them), ``values`` the samples' values in the answer."""

    path = ""
    size: int | None = None
    split_refused = False  # a refused call's samples are tried one a call

    @abstractmethod
    async def request(self, part: Mapping[str, list], http: HttpCaller, base: str) -> Any: ...

    @abstractmethod
    def values(self, reply: Any, n: int) -> tuple[list[float | None], dict]: ...


class _OneCall(_Protocol):
    """A protocol whose part is one call with nothing before it: ``body`` makes it."""

    @abstractmethod
    def body(self, part: Mapping[str, list]) -> Any: ...

    async def request(self, part: Mapping[str, list], http: HttpCaller, base: str) -> Any:
        return self.body(part)


class _Lists(_OneCall):
    """Protocol ``inflight``: lists of samples in, ``{"rewards": [...]}`` out."""

    path = ""

    def __init__(self, spec: RewardSpec) -> None:
        self.size = spec.batch_size

    def body(self, part: Mapping[str, list]) -> Any:
        body = dict(part)
        texts = part.get("trajectories") or part["completions"]
        body.setdefault("query", [p + c for p, c in zip(part["prompts"], texts, strict=True)])
        answers = part.get("answer") or [None] * len(texts)
        body.setdefault("labels", ["" if a is None else a for a in answers])
        return body

    def values(self, reply: Any, n: int) -> tuple[list[float | None], dict]:
        if isinstance(reply, Mapping):
            key = next((k for k in ("rewards", "scores") if k in reply), None)
            if key is None:
                raise HttpFailure(
                    "bad_response", f"no 'rewards' in the answer (keys: {list(reply)})"
                )
            reply = reply[key]
        return _values(reply, n)


class _Slime(_OneCall):
    """Protocol ``slime`` (slime's ``--rm-url``): one sample a request, a number out."""

    path = ""
    size = 1

    def __init__(self, spec: RewardSpec) -> None:
        pass

    def body(self, part: Mapping[str, list]) -> Any:
        answer = (part.get("answer") or [None])[0]
        return {"prompt": part["prompts"][0], "response": part["completions"][0], "label": answer}

    def values(self, reply: Any, n: int) -> tuple[list[float | None], dict]:
        return _values([reply], n)


class _Judge(_OneCall):
    """A generative judge on an engine's ``/generate`` or ``/v1/chat/completions``, or asked
    ``question`` on its ``/v1/decisions`` (the reward: the candidates' values weighed by their
    probabilities)."""

    def __init__(self, spec: RewardSpec) -> None:
        assert spec.judge is not None
        self.judge: JudgeSpec = spec.judge
        self.rule = re.compile(self.judge.parse)
        route = self.judge.route
        self.path = {"chat": "/v1/chat/completions", "decisions": "/v1/decisions"}.get(
            route, "/generate"
        )
        self.size = spec.batch_size if route == "generate" else 1
        self.worth: dict[str, float] = {}
        if route == "decisions":
            from stages.engine.openai_decisions import values_of

            assert self.judge.question is not None
            self.worth = values_of(self.judge.question, self.judge.map)

    def body(self, part: Mapping[str, list]) -> Any:
        n = len(part["completions"])
        prompts = [_filled(self.judge.template, part, i, "judge_template") for i in range(n)]
        judge = self.judge
        if judge.route == "decisions":
            return {"model": judge.model, "input": prompts[0],
                    "questions": [{**(judge.question or {}), "id": "q"}]}  # fmt: skip
        if judge.route == "generate":
            params = {"max_new_tokens": judge.max_new_tokens, "temperature": judge.temperature}
            return {"text": prompts, "sampling_params": params}
        system = [{"role": "system", "content": judge.system}] if judge.system else []
        return {
            "model": judge.model,
            "messages": [*system, {"role": "user", "content": prompts[0]}],
            "max_tokens": judge.max_new_tokens,
            "temperature": judge.temperature,
        }

    def values(self, reply: Any, n: int) -> tuple[list[float | None], dict]:
        if self.judge.route == "decisions":
            return [self._expected(reply)], {}
        texts = self._texts(reply, n)
        values: list[float | None] = [None] * n
        bad: dict[int, tuple[str, str]] = {}
        for i, text in enumerate(texts):
            score = self._score(text)
            if score is None:
                bad[i] = ("judge_unparsed", f"parse found no score in {quoted(text)}")
            else:
                values[i] = score
        return values, bad

    def _expected(self, reply: Any) -> float:
        """The candidates' values weighed by the probabilities ``/v1/decisions`` answered."""
        try:
            probabilities = reply["answers"]["q"]["probabilities"]
            return math.fsum(p * self.worth[name] for name, p in probabilities.items())
        except (KeyError, TypeError) as exc:
            raise HttpFailure(
                "bad_response", f"not the engine's decision ({exc!r}): {quoted(reply)}"
            ) from None

    def _texts(self, reply: Any, n: int) -> list[str]:
        try:
            if self.judge.route == "chat":
                texts = [reply["choices"][0]["message"]["content"]]
            else:
                texts = [item["text"] for item in reply]
        except (KeyError, IndexError, TypeError) as exc:
            raise HttpFailure(
                "bad_response", f"not the engine's answer ({exc!r}): {quoted(reply)}"
            ) from None
        if len(texts) != n or not all(isinstance(t, str) for t in texts):
            raise HttpFailure(
                "bad_response", f"{len(texts)} texts for {n} prompts: {quoted(reply)}"
            )
        return texts

    def _score(self, text: str) -> float | None:
        found = self.rule.search(text)
        if found is None or found.group(1) is None:
            return None
        word = found.group(1).strip()
        if self.judge.map:
            return self.judge.map.get(word)
        try:
            score = float(word)
        except ValueError:
            return None
        return score if math.isfinite(score) else None


class _RewardModel(_Protocol):
    """A reward model on an engine's ``/classify`` (SGLang's reward-model route): input
    ``chat`` renders each sample's conversation with the model's own template
    (``/v1/tokenize``, one call a sample) and sends the ids; ``text`` sends ``template``
    filled; ``pair`` sends ``pair``'s two templates filled as a cross-encoder's text pairs.
    The reward is the ``label``-th output of each answer's ``embedding`` (a one-label
    cross-encoder's number)."""

    path = "/classify"
    split_refused = True  # the engine refuses a whole batch for one prompt past its context

    def __init__(self, spec: RewardSpec) -> None:
        assert spec.reward_model is not None
        self.model: RewardModelSpec = spec.reward_model
        self.size = spec.batch_size

    async def request(self, part: Mapping[str, list], http: HttpCaller, base: str) -> Any:
        n = len(part["completions"])
        if self.model.input == "text":
            return {
                "text": [_filled(self.model.template, part, i, "rm_template") for i in range(n)]
            }
        if self.model.input == "pair":  # a cross-encoder's [query, document] pairs
            pairs = [
                [_filled(t, part, i, "rm_template") for t in self.model.pair] for i in range(n)
            ]
            return {"text": pairs, "is_cross_encoder_request": True}
        calls = [http.post(f"{base}/v1/tokenize", self._tokenize(part, i)) for i in range(n)]
        answers = await asyncio.gather(*calls)
        ids = []
        for answer in answers:
            tokens = answer.get("tokens") if isinstance(answer, Mapping) else None
            if not isinstance(tokens, list) or not tokens:
                raise HttpFailure("bad_response", f"/v1/tokenize answered {quoted(answer)}")
            ids.append(tokens)
        return {"input_ids": ids}

    def _tokenize(self, part: Mapping[str, list], i: int) -> dict[str, Any]:
        messages = (part.get("messages") or [None] * (i + 1))[i]
        if not isinstance(messages, list):  # a prompt without its conversation: the user's
            messages = [{"role": "user", "content": part["prompts"][i]}]
        turn = {"role": "assistant", "content": part["completions"][i]}
        return {"messages": [*messages, turn], "add_generation_prompt": False}

    def values(self, reply: Any, n: int) -> tuple[list[float | None], dict]:
        label = self.model.label
        try:  # (a one-label cross-encoder answers a number: its output 0)
            values = [_output(item["embedding"], label) for item in reply]
        except (KeyError, IndexError, TypeError) as exc:
            raise HttpFailure(
                "bad_response", f"no output {label} in the answer ({exc!r}): {quoted(reply)}"
            ) from None
        return _values(values, n)


def _output(embedding: Any, label: int) -> Any:
    """A reward model's output ``label``: of its list, or its one number (label 0)."""
    if isinstance(embedding, int | float) and not isinstance(embedding, bool) and label == 0:
        return embedding
    return embedding[label]


def _filled(template: str, part: Mapping[str, list], i: int, kind: str) -> str:
    """``template`` filled with sample ``i``'s values (``{prompt}``, ``{completion}``...);
    HttpFailure of ``kind`` when it cannot be."""
    row = {key: values[i] for key, values in part.items()}
    row["prompt"], row["completion"] = part["prompts"][i], part["completions"][i]
    try:
        return template.format_map(row)
    except KeyError as exc:
        known = ", ".join(sorted(row))
        raise HttpFailure(
            kind, f"the template names {exc}, which the samples lack ({known})"
        ) from None
    except (IndexError, AttributeError, TypeError, ValueError) as exc:
        raise HttpFailure(kind, f"{type(exc).__name__}: {exc}") from None


def _launcher(
    launch: LaunchConfig, name: str, log: Any, site: EngineSite | None
) -> tuple[Any, dict[str, str]]:
    """The launcher of a reward model's own engine (SGLang told ``--is-embedding``; the
    built-in engine sees a reward model by itself) and the headers its calls carry."""
    from stages.engine.auth import auth_headers
    from stages.generator.launcher import EngineLauncher

    if site is None:
        raise ValueError(
            f"reward {name}: reward_model.launch starts an engine with the scorer only (the "
            "learner's eval.rewards take a url)"
        )
    if launch.kind == "sglang" and "--is-embedding" not in launch.extra_args:
        launch = dataclasses.replace(launch, extra_args=[*launch.extra_args, "--is-embedding"])
    launcher = EngineLauncher(
        launch,
        name=f"{site.name}.{name.replace(':', '-').replace('/', '-')}",
        log_dir=site.log_dir,
        log=log,
        log_level=site.log_level,
        api_key=site.api_key,
    )
    return launcher, auth_headers(site.api_key)


# ---------------------------------------------------------------------------------- the calls
class HttpCaller:
    """One server's connection pool: JSON calls with a time limit per call, retries with
    doubling waits of what may pass, at most ``concurrency`` calls in flight; failed samples
    counted by kind and the first failure of each kind logged.

    ``options`` has ``timeout_s``, ``retries``, ``backoff_s``, ``concurrency`` and ``headers``
    (a ``RewardSpec``, a ``TeacherSpec``). A failure is logged as ``event`` with the
    key-values of ``who`` (which reward, which teacher). ``start()`` makes the pool (on the
    running loop), ``aclose()`` closes it. ``counts``: ``calls`` (HTTP calls made, without
    retries), ``errors`` and ``timeouts`` (calls that failed for good, or whose answer had bad
    values), ``retries``; ``failed``: failed samples by kind.
    """

    def __init__(
        self,
        options: Any,
        log: Any,
        *,
        event: str,
        who: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.options, self.log, self.event, self.who = options, log, event, dict(who)
        self.headers = {**(headers or {}), **options.headers}  # the options' own come last
        self.counts = {"calls": 0, "errors": 0, "timeouts": 0, "retries": 0, "split": 0}
        self.failed: dict[str, int] = {}
        self._logged: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = asyncio.Semaphore(options.concurrency)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.options.concurrency),
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=self.options.timeout_s),
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(self, url: str, body: Any) -> Any:
        """The JSON answer to ``body`` (sent as JSON), retrying what may pass; raises
        ``HttpFailure`` (``bad_request`` when ``body`` cannot be written as JSON)."""
        try:
            data = json.dumps(body, default=_jsonable, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise HttpFailure("bad_request", f"the samples cannot be sent as JSON: {exc}") from None
        return await self._post(url, data)

    async def get(self, url: str) -> tuple[int, Any]:
        """``(status, JSON answer or None)`` of one GET, without retries (set-up probes)."""
        assert self._session is not None, "start() first"
        try:
            async with self._session.get(url) as response:
                status, answer = response.status, await response.read()
        except asyncio.TimeoutError:
            raise HttpFailure("timeout", f"no answer within {self.options.timeout_s} s") from None
        except aiohttp.ClientError as exc:
            raise HttpFailure("unreachable", f"{type(exc).__name__}: {exc}") from None
        try:
            return status, json.loads(answer)
        except ValueError:
            return status, None

    async def _post(self, url: str, data: bytes) -> Any:
        assert self._session is not None, "start() first"
        options = self.options
        self.counts["calls"] += 1
        failure = HttpFailure("timeout", "never tried")
        for attempt in range(options.retries + 1):
            if attempt:
                self.counts["retries"] += 1
                await asyncio.sleep(min(options.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            try:
                async with (
                    self._in_flight,
                    self._session.post(
                        url, data=data, headers={"Content-Type": "application/json"}
                    ) as response,
                ):
                    status, answer = response.status, await response.read()
            except asyncio.TimeoutError:
                failure = HttpFailure("timeout", f"no answer within {options.timeout_s} s")
                continue
            except aiohttp.ClientError as exc:
                failure = HttpFailure("unreachable", f"{type(exc).__name__}: {exc}")
                continue
            if status == 429 or status >= 500:
                failure = HttpFailure("http_error", f"HTTP {status}: {quoted(answer)}")
                continue
            if not 200 <= status < 300:
                raise HttpFailure("http_error", f"HTTP {status}: {quoted(answer)}", refused=True)
            try:
                return json.loads(answer)
            except ValueError:
                raise HttpFailure("bad_response", f"not JSON: {quoted(answer)}") from None
        if options.retries:
            failure.message += f" ({options.retries + 1} tries)"
        raise failure

    def failed_call(self, failure: HttpFailure, samples: int, context: Mapping[str, Any]) -> None:
        """A call failed as a whole: count it and its ``samples``."""
        self.counts["timeouts" if failure.kind == "timeout" else "errors"] += 1
        self.note(failure.kind, failure.message, samples, context)

    def bad_values(self, bad: Mapping[int, tuple[str, str]], context: Mapping[str, Any]) -> None:
        """A call answered, but some samples' values are unusable (sample -> (kind, why))."""
        if not bad:
            return
        self.counts["errors"] += 1
        for kind in dict.fromkeys(kind for kind, _ in bad.values()):
            mine = [why for k, why in bad.values() if k == kind]
            self.note(kind, mine[0], len(mine), context)

    def note(self, kind: str, message: str, samples: int, context: Mapping[str, Any]) -> None:
        """Count ``samples`` failed of ``kind``; log the first failure of each kind."""
        self.failed[kind] = self.failed.get(kind, 0) + samples
        if kind in self._logged:
            return
        self._logged.add(kind)
        self.log.warning(
            self.event,
            **self.who,
            kind=kind,
            error=message,
            completions=samples,
            later=f"counted in failed_{kind}, not logged again",
            **context,
        )


# ---------------------------------------------------------------------------------- the reward
class RemoteReward:
    """One ``url``, ``reward_model`` or ``judge`` reward: ``score`` a scoring call's keyword
    lists.

    ``start()`` starts its engine (``reward_model.launch``, with ``site``) and makes its
    connection pool (on the running loop), ``aclose()`` closes both; ``counts`` and ``failed``
    are its ``HttpCaller``'s.
    """

    def __init__(self, spec: RewardSpec, log: Any, site: EngineSite | None = None) -> None:
        self.spec, self.name = spec, spec.name
        self.protocol: _Protocol
        self.launcher: Any = None  # stages.generator.launcher.EngineLauncher
        headers: dict[str, str] = {}
        if spec.judge is not None:
            self.protocol, base = _Judge(spec), spec.judge.url.rstrip("/")
        elif spec.reward_model is not None:
            self.protocol, base = _RewardModel(spec), (spec.reward_model.url or "").rstrip("/")
            if spec.reward_model.launch is not None:
                self.launcher, headers = _launcher(spec.reward_model.launch, spec.name, log, site)
        else:
            self.protocol = {"inflight": _Lists, "slime": _Slime}[spec.protocol](spec)
            base = str(spec.url)
        self.base, self.url = base, f"{base}{self.protocol.path}"
        self.log = log
        self.http = HttpCaller(
            spec, log, event="reward_failed", who={"fn": self.name}, headers=headers
        )
        self.counts, self.failed = self.http.counts, self.http.failed

    async def start(self) -> None:
        if self.launcher is not None:
            self.base = (await self.launcher.start())[0].rstrip("/")
            self.url = f"{self.base}{self.protocol.path}"
            self.log.info("reward_engine_ready", fn=self.name, url=self.base)
        await self.http.start()

    async def aclose(self) -> None:
        await self.http.aclose()
        if self.launcher is not None:
            await self.launcher.close()

    async def score(self, kwargs: Mapping[str, Any], n: int, context: Mapping[str, Any]) -> Outcome:
        """Each sample's value (None: nothing, or failed) and the failed ones' problems."""
        size = self.protocol.size or n
        spans = [(lo, min(n, lo + size)) for lo in range(0, n, size)]
        parts = await asyncio.gather(*(self._call(kwargs, lo, hi, context) for lo, hi in spans))
        values: list[float | None] = [None] * n
        bad: dict[int, str] = {}
        for (lo, hi), (part_values, part_bad) in zip(spans, parts, strict=True):
            values[lo:hi] = part_values
            bad.update((lo + i, f"{kind}: {why}") for i, (kind, why) in part_bad.items())
        return Outcome(values, bad)

    async def _call(
        self, kwargs: Mapping[str, Any], lo: int, hi: int, context: Mapping[str, Any]
    ) -> tuple[list[float | None], dict[int, tuple[str, str]]]:
        part = {key: values[lo:hi] for key, values in kwargs.items() if isinstance(values, list)}
        n = hi - lo
        try:
            body = await self.protocol.request(part, self.http, self.base)
            values, bad = self.protocol.values(await self.http.post(self.url, body), n)
        except HttpFailure as failure:
            if failure.refused and n > 1 and self.protocol.split_refused:
                return await self._one_by_one(kwargs, lo, hi, context, failure)
            self.http.failed_call(failure, n, context)
            return [None] * n, {i: (failure.kind, failure.message) for i in range(n)}
        self.http.bad_values(bad, context)
        return values, bad

    async def _one_by_one(
        self,
        kwargs: Mapping[str, Any],
        lo: int,
        hi: int,
        context: Mapping[str, Any],
        refusal: HttpFailure,
    ) -> tuple[list[float | None], dict[int, tuple[str, str]]]:
        """Samples ``lo:hi`` a call each, after their call was refused: one sample the server
        refuses (a conversation past the model's context) fails alone. Counted as ``split``;
        the first one logged."""
        self.http.counts["split"] += 1
        if self.http.counts["split"] == 1:
            self.log.warning(
                "reward_call_split",
                fn=self.name,
                samples=hi - lo,
                error=refusal.message,
                later="counted in http_split_calls, not logged again",
                **context,
            )
        calls = [self._call(kwargs, i, i + 1, context) for i in range(lo, hi)]
        parts = await asyncio.gather(*calls)
        values = [part_values[0] for part_values, _ in parts]
        bad = {i: part_bad[0] for i, (_, part_bad) in enumerate(parts) if part_bad}
        return values, bad
