"""The generator stage: prompts in, one ``rollout_group`` per prompt out.

For every prompt it asks an engine for ``group_size`` (G) samples, and emits them together as one
``rollout_group`` (per sample: token ids, sampler log-prob and policy version per token), once
every sample is in or dropped: one message per group, not per sample. To a scorer that takes
``rollout_batch`` (the built-in one), the single-turn groups finished together go as one such
message instead (their columns: ``stages.rollout_batch``), within the scorer's credit, which
counts groups. By default the G
samples travel as one ``/generate`` request (``group_requests``: G copies of the prompt in
``input_ids``, one ``rid`` per sample, a form SGLang and the built-in engine both serve) to the
engine with the fewest samples in flight among those with room for the group; with
``group_requests: false`` every sample is its own request, each to the least-loaded engine. To
an engine in the generator's own process (``launch.in_process``), the groups of the prompts
waiting in the inbox that the gates let start together go in one request (up to 16 groups: one
check of the body, one timer), each group still emitted as soon as its own samples are done.

How many samples are in flight is the controller's call (``controller.py``): downstream credit and
the staleness bound gate new starts, measured throughput sets each engine's target; each decision
is logged. Everything counts samples, not requests or messages (downstream credit is in groups,
so the room it gives is credit x G): a group request holds G samples of its
engine's in-flight count and starts only when all G fit under the credit and the engine's target
(or, when the bound is below G, alone when nothing else is in flight there, so that it can never
deadlock). In sync mode (``run.mode: sync``) exactly ``sync_batch`` samples start per version.

An engine that refuses a group request (a 4xx, or an answer that is not one result per sample)
gets the same group again at once as per-sample requests; if one of those succeeds, the engine is
remembered as unable to serve groups (per engine), the stage warns once
(``group_requests_unsupported``, with the URL and the engine's error) and counts it
(``engines_without_group_requests``; ``group_fallbacks`` counts the groups re-sent per sample).
If the per-sample requests are refused too, the prompt itself was bad: see below.

Engines are either attached (``engines: [URL, ...]``) or started by the stage (``launch:``), and
the same client serves SGLang and the built-in engine. An engine that fails a request (connection
lost, 5xx, timeout), or does not answer ``/health`` at start, is taken out of use and probed on
``/health`` every ``retry_backoff_s * 2**(k-1)`` s (capped; ``k`` counts its failures since it
last served a request) until it answers again (a launched engine is restarted by the launcher
meanwhile). The failed request (a whole group, or one sample) is re-routed at once to another
live engine, or waits for one to come back, up to ``max_retries`` times; after that, or on a 4xx
to a per-sample request (a bad request), its samples are dropped, each counted and logged
(``sample_dropped``), and the stage goes on. If every launched engine is given up, the stage
fails (the supervisor's restart policy takes over). Every request carries the run's engine API
key (``stages.engine.auth``); an engine that refuses it fails the stage at start.

Rollouts (``rollout:``, ``stages.rollouts``): the default, ``single_turn``, is the path above.
Any other rollout (tool calls, a multi-turn environment, a function of your own) runs one episode
per sample (``episodes.py``): it holds one in-flight sample of its engine from its first turn to
its end, its turns stay on that engine (its prefix cache), and the group is emitted once every
episode has ended or was dropped (``engine_failure``, or ``rollout_error`` when the rollout
raised: counted, logged). Samples then carry ``loss_mask`` (inserted tokens are not trained) and
``rollout`` (turns, tool calls, the environment's reward). Not here: weight updates (the
publisher talks to the engines), aborting requests.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from pipeline import topics
from pipeline.stage import Port, StageContext
from stages import rollout_batch
from stages.engine.auth import engine_api_key
from stages.engine.custom_logits import SHIPPED, sglang_string
from stages.generator.client import (
    SEED_EACH_SAMPLE,
    Completion,
    EngineClient,
    EngineError,
    InProcessClient,
    make_session,
)
from stages.generator.controller import ControllerConfig, Decision, InFlightController
from stages.generator.episodes import (
    EpisodeEngine,
    check_trajectory,
    sample_fields,
)
from stages.generator.launcher import EngineLauncher, LaunchConfig
from stages.generator.session_closer import SessionCloser
from stages.rollouts.api import EngineUnavailable, EnvError, RolloutConfig
from stages.schemas import PROMPT, ROLLOUT_BATCH, ROLLOUT_GROUP
from stages.weights.adapter_names import adapter_for
from stages.workers import PoolBroken
from transport.message import Message

if TYPE_CHECKING:  # aiohttp is imported where it is used: `inflight run` validates configs
    import aiohttp  # without it (0.25 s of the supervisor's start-up)

__all__ = ["Generator", "SamplingConfig"]

_BACKOFF_CAP_S = 10.0
# while the gates are shut, the longest _slot waits before it looks at them again unwoken
_LOOK_AGAIN_S = 0.25
# groups at most in one request to an engine in this process (``Generator._groups``)
_GROUPS_PER_REQUEST = 16
# connections per engine beyond its most samples in flight (health probes, spare)
_SPARE_CONNECTIONS = 4
# at close, how long the last episodes' session closes may take (rollout.hold_kv)
CLOSE_FLUSH_S = 2.0


@dataclass
class SamplingConfig:
    """SGLang's sampling parameters (same names and defaults), as sent with every request."""

    temperature: float = field(default=1.0, metadata={"min": 0.0})
    top_p: float = field(default=1.0, metadata={"min": 0.0, "max": 1.0})
    top_k: int = -1
    min_p: float = field(default=0.0, metadata={"min": 0.0, "max": 1.0})
    max_new_tokens: int = field(default=128, metadata={"min": 1})
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # SGLang's penalties (the engine's log-probs are then of the penalized distribution: the
    # learner's importance ratios correct for it as for any sampler/learner mismatch)
    repetition_penalty: float = field(
        default=1.0, metadata={"min": 0.0, "max": 2.0, "doc": "(0, 2]; 1 is none"}
    )
    frequency_penalty: float = field(default=0.0, metadata={"min": -2.0, "max": 2.0})
    presence_penalty: float = field(default=0.0, metadata={"min": -2.0, "max": 2.0})
    min_new_tokens: int = field(default=0, metadata={"min": 0})
    max_thinking_tokens: int | None = field(
        default=None,
        metadata={
            "doc": "thinking budget of a reasoning model's samples (SGLang's request field): "
            "once a sample has thought this many tokens its reasoning's end is forced; the "
            "requests then say require_reasoning, and the engines need --reasoning-parser and "
            "--enable-strict-thinking (launch.extra_args)"
        },
    )
    custom_logit_processor: str | None = field(
        default=None,
        metadata={
            "doc": "a custom logit processor run on every sample's logits (SGLang's request "
            "field): one SGLang ships, by name (DisallowedTokensLogitsProcessor, "
            "Qwen3ThinkingBudgetLogitProcessor...), or the string a class's to_str() writes; "
            "the engines need --enable-custom-logit-processor (launch.extra_args)"
        },
    )
    custom_params: dict[str, Any] | None = field(
        default=None,
        metadata={"doc": "what the processor reads of each request (token_ids, thinking_budget)"},
    )
    seed: int | None = field(
        default=None,
        metadata={
            "doc": "each sample draws with a seed of its own (SGLang's sampling_seed, made of "
            "this and the sample's rid): needed with engines started with "
            "--enable-deterministic-inference, where samples without one all draw with seed "
            "42 and a group's come out alike (0 when launch.extra_args has the flag or an "
            "attached engine's /server_info says enable_deterministic_inference)"
        },
    )

    def __post_init__(self) -> None:  # as the engines check them (SGLang's SamplingParams)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be at most max_new_tokens "
                f"({self.max_new_tokens})"
            )
        processor = self.custom_logit_processor
        if processor is not None and processor not in SHIPPED and not processor.startswith("{"):
            raise ValueError(
                f"custom_logit_processor {processor!r}: one of SGLang's shipped processors "
                f"({', '.join(SHIPPED)}) or the JSON string a CustomLogitProcessor's to_str() "
                "writes"
            )

    def as_params(self) -> dict[str, Any]:
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        # sent only when set: the same requests as before for a config without them
        for f in fields(self):
            if f.name in _OPTIONAL_SAMPLING and getattr(self, f.name) != f.default:
                params[f.name] = getattr(self, f.name)
        if self.max_thinking_tokens is not None:  # request fields (the client lifts them)
            params["require_reasoning"] = True
            params["max_thinking_tokens"] = self.max_thinking_tokens
        processor = self.custom_logit_processor
        if processor is not None:  # a request field too
            shipped = processor in SHIPPED
            params["custom_logit_processor"] = sglang_string(processor) if shipped else processor
        if self.custom_params is not None:
            params["custom_params"] = dict(self.custom_params)
        if self.seed is not None:  # each sample's seed is made of it (client._generate_body)
            params[SEED_EACH_SAMPLE] = self.seed
        return params


_OPTIONAL_SAMPLING = frozenset(
    {"min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_new_tokens"}
)


@dataclass
class GeneratorConfig:
    engines: list[str] = field(
        default_factory=list, metadata={"doc": "URLs of running engines to attach to"}
    )
    launch: LaunchConfig | None = field(
        default=None, metadata={"doc": "start engines instead of attaching to URLs"}
    )
    group_size: int = field(default=4, metadata={"min": 1, "doc": "samples per prompt (G)"})
    group_requests: bool = field(
        default=True,
        metadata={
            "doc": "ask for a prompt's group_size samples in one /generate request (batched "
            "input_ids, one rid per sample); false: one request per sample. An engine that "
            "refuses group requests gets per-sample requests (warned once, counted)"
        },
    )
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(
        default_factory=RolloutConfig,
        metadata={"doc": "how a prompt becomes a trajectory (stages.rollouts)"},
    )
    max_lag: int = field(
        default=4, metadata={"min": 0, "doc": "start samples only within this many versions"}
    )
    outbox: int = field(
        default=8, metadata={"min": 1, "doc": "finished groups held while waiting for credit"}
    )
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    request_timeout_s: float = field(default=600.0, metadata={"min": 1.0})
    max_retries: int = field(
        default=3,
        metadata={
            "min": 0,
            "doc": "re-routings of a request (group or sample) after engine failures",
        },
    )
    retry_backoff_s: float = field(
        default=0.5,
        metadata={"min": 0.0, "doc": "first /health probe period of a failed engine (doubles)"},
    )
    sync_batch: int = field(
        default=0,
        metadata={
            "min": 0,
            "doc": "run.mode sync: samples per policy version (the learner's batch_size, a "
            "multiple of group_size); the next batch starts once they are all out and a new "
            "version is live",
        },
    )

    def __post_init__(self) -> None:
        if bool(self.engines) == (self.launch is not None):
            raise ValueError("give exactly one of `engines` (URLs to attach to) or `launch`")
        if self.sync_batch % self.group_size:
            raise ValueError(
                f"sync_batch ({self.sync_batch}) must be a multiple of group_size "
                f"({self.group_size}): a sync batch is made of whole groups"
            )
        deterministic = "--enable-deterministic-inference"
        if self.launch is not None and deterministic in self.launch.extra_args:
            if self.sampling.seed is None:  # else a group's samples would all be the same
                self.sampling.seed = 0
        flag = "--enable-custom-logit-processor"
        launched = self.launch is not None and flag not in self.launch.extra_args
        if self.sampling.custom_logit_processor is not None and launched:
            raise ValueError(  # else every request is refused, every sample dropped
                f"sampling.custom_logit_processor needs engines started with {flag}: add it "
                "to launch.extra_args"
            )


class _Served(NamedTuple):
    """A sample an engine answered, with when."""

    engine: str
    completion: Completion
    done: float  # time.monotonic()


class _Collecting:
    """A group whose samples are requested one by one: what came back so far (each sample as
    its ``rollout_group`` map), and why the others were dropped."""

    __slots__ = ("dropped", "left", "samples")

    def __init__(self, size: int) -> None:
        self.left = size
        self.samples: list[dict[str, Any]] = []
        self.dropped: dict[int, str] = {}  # sample index -> ledger reason


class Generator:
    Config = GeneratorConfig
    shares_process = True  # its work is on its event loop or threads: it may share a process
    keeps_ledger = True  # reports where its samples end (pipeline.ledger)
    reads_pace = True  # the learners' pace bounds what it starts (the queue gate)
    # a prompt is processed once the scorer has processed its group (or all of it was dropped,
    # counted)
    inputs = {"prompts": Port(PROMPT, ack="manual")}
    # the groups ready at once go as one rollout_batch to a scorer that takes it
    outputs = {"rollouts": Port(ROLLOUT_GROUP, if_accepted=(ROLLOUT_BATCH,))}

    def __init__(self, config: GeneratorConfig, ctx: StageContext) -> None:
        self.config, self.ctx, self.log = config, ctx, ctx.log
        self.run_id = ctx.run_dir.name
        self.launcher: EngineLauncher | None = None
        self.session: aiohttp.ClientSession | None = None
        self.in_flight: dict[str, int] = {}  # samples, per engine
        # per engine: the policy version it serves (from completions, or asked); a restarted
        # engine serves its initial weights again until the publisher has caught it up
        self.versions: dict[str, int] = {}
        self._engine_restarts: dict[str, int] = {}
        # per engine: announcements (topics.VERSION) up to this version predate its restart
        self._announced_before_restart: dict[str, int] = {}
        self._versions_asked = 0.0  # monotonic time of the last /get_model_info round
        self.params = config.sampling.as_params()
        self.counts = {
            "started": 0,
            "emitted": 0,  # samples
            "groups_emitted": 0,
            "dropped": 0,
            "retried": 0,
            "tokens": 0,
            "requests": 0,  # /generate requests sent (a group request is one)
            "group_fallbacks": 0,  # group requests refused, then sent again per sample
            # episodes' session closes (rollout.hold_kv): the requests that carried them (many
            # a request: SessionCloser), and those an engine could not close
            "session_close_requests": 0,
            "session_close_failures": 0,
        }
        # engines found unable to serve group requests -> the error that showed it
        self.no_groups: dict[str, str] = {}
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        # a prompt stays unacknowledged until the scorer has acknowledged its group: were this
        # replica and the scorer both to die, the feeder would feed it again
        # group's send seq -> its prompt and how many samples it carries
        # sent, not yet acknowledged by the scorer: seq -> each group's prompt and samples
        self._awaiting_ack: dict[int, list[tuple[Message, int]]] = {}
        self._acked_early: set[int] = set()  # acknowledged before send_many returned
        # samples started and not yet acknowledged from downstream: in flight, queued, or
        # waiting to be trained (with chained acknowledgements, the scorer acknowledges a
        # group once the learner is done with it)
        self._unacked = 0
        self._chained = False
        self.rollouts: Any = None  # stages.rollouts.runtime.RolloutRuntime (not single_turn)
        self._fatal: BaseException | None = None  # raised by the next _slot (fails the stage)
        self._closing = False  # close() began: episodes cut short are not failures
        # finished episodes' sessions closed on their engines, many to a request (hold_kv)
        self.closer = SessionCloser(lambda engine: self.clients.get(engine), counts=self.counts)
        self._episode_errors = 0
        self._origin = f"{ctx.stage}.{ctx.replica}:{getattr(ctx, 'session', '')}"

    async def setup(self) -> None:
        rollouts = self.ctx.outputs["rollouts"]
        if hasattr(rollouts, "on_ack"):
            rollouts.on_ack(self._group_acked)
            self._chained = True
        # what opens the gates wakes _slot: credit downstream, the learners' pace, versions
        # (results, acknowledgements, the outbox and the controller set _changed themselves)
        if hasattr(rollouts, "on_credit"):
            rollouts.on_credit(self._changed.set)
        if hasattr(self.ctx, "on_control"):
            self.ctx.on_control(self._changed.set)
        urls = list(self.config.engines)
        api_key = engine_api_key(self.ctx)  # the run's; every engine, launched or attached
        if self.config.launch is not None:
            self.launcher = EngineLauncher(
                self.config.launch,
                name=f"{self.ctx.stage}.{self.ctx.replica}",
                log_dir=getattr(self.ctx, "log_dir", self.ctx.run_dir / "logs"),
                log=self.log,
                log_level=getattr(self.ctx, "log_level", "info"),
                api_key=api_key,
                session_kv=self.config.rollout.hold_kv,
                lora=True,  # a LoRA learner's adapters come by name (publish.lora_transport)
            )
            urls = await self.launcher.start()
        # an engine never holds more than max(target, group_size) samples, each at most one
        # connection: the pool must never be what limits them
        most = max(self.config.controller.max_in_flight, self.config.group_size)
        self.session = make_session(len(urls) * (most + _SPARE_CONNECTIONS))
        local = self.launcher.in_process_engines() if self.launcher is not None else {}
        options = {"timeout_s": self.config.request_timeout_s, "api_key": api_key}
        self.clients = {
            url: InProcessClient(url, self.session, local[url], **options)
            if url in local
            else EngineClient(url, self.session, **options)
            for url in urls
        }
        for url, client in self.clients.items():  # publish.lora_transport files: lora_path
            client.adapter = functools.partial(self._adapter_of, url)
        self.in_flight = dict.fromkeys(urls, 0)
        self.versions = dict.fromkeys(urls, 0)
        self.down: dict[str, asyncio.Task] = {}  # engines out of use -> their health probe
        self.failures = dict.fromkeys(urls, 0)  # failures since the engine last served a request
        self.controller = InFlightController(urls, self.config.controller)
        # finished groups and the prompt message each answers (acknowledged once it is sent)
        self.outbox: asyncio.Queue[tuple[dict[str, Any], Message]] = asyncio.Queue(
            self.config.outbox
        )
        # an attached engine may be down already: requests go only to those that answer
        health = await asyncio.gather(*(c.healthy() for c in self.clients.values()))
        for url, ok in zip(urls, health, strict=True):
            if not ok:
                self._mark_down(url, "no answer to /health at start")
        # /health needs no key: a refused key fails here (EngineAuthError), not sample by sample;
        # so does an engine that serves a reward or embedding model
        live = [c for url, c in self.clients.items() if url not in self.down]
        await asyncio.gather(*(c.check_key() for c in live))
        if SEED_EACH_SAMPLE not in self.params:  # attached engines: are they deterministic?
            said = await asyncio.gather(*(c.deterministic() for c in live))
            if any(said):  # without seeds of their own a group's samples would be alike
                self.params[SEED_EACH_SAMPLE] = 0
                self.log.info("sample_seeds_on", why="an engine is deterministic")
        self._epoch = -1
        await self._announce_engines()
        if not self.config.rollout.single_turn:
            from stages.rollouts.runtime import RolloutRuntime

            launch = self.config.launch
            self.rollouts = await RolloutRuntime.start(
                self.config.rollout,
                log=self.log,
                default_tokenizer=launch.model if launch is not None else "",
            )

    async def _announce_engines(self) -> None:
        """Tell the weight publisher which engines to update (again when one was restarted)."""
        epoch = self.launcher.restarts if self.launcher is not None else 0
        if epoch != self._epoch and self.launcher is not None:
            for url, restarts in self.launcher.restarts_by_url().items():
                if restarts != self._engine_restarts.get(url, 0) and url in self.versions:
                    self.log.info(
                        "engine_version_reset",
                        url=url,
                        was=self.versions[url],
                        now=0,
                        reason="engine restarted: its version is asked once it is up (the "
                        "checkpoint's, or a sibling's: launch.restart_from_peer)",
                    )
                    self.versions[url] = 0
                    self._announced_before_restart[url] = self._announced(url)
                self._engine_restarts[url] = restarts
        if epoch != self._epoch:
            self._epoch = epoch
            await self.ctx.publish(topics.ENGINES, {"urls": list(self.clients), "epoch": epoch})

    # ---------------------------------------------------------------- engines
    def _mark_down(self, engine: str, error: str) -> None:
        """Take ``engine`` out of use until its health probe finds it answering again."""
        if engine in self.down:
            return  # already out: requests that were in flight there fail one by one
        self.failures[engine] += 1
        period = self.config.retry_backoff_s * 2 ** (self.failures[engine] - 1)
        period = min(max(period, 0.05), _BACKOFF_CAP_S)
        self.log.warning(
            "engine_down",
            url=engine,
            failures=self.failures[engine],
            probe_every_s=period,
            error=error,
        )
        self.down[engine] = asyncio.create_task(self._probe(engine, period))

    async def _probe(self, engine: str, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            if await self.clients[engine].healthy(timeout_s=max(period, 1.0)):
                break
        del self.down[engine]
        # it may have been restarted meanwhile (by us or by whoever runs it): ask what it serves
        try:
            version: int | None = await self.clients[engine].weight_version()
        except EngineError:
            version = None  # it will be asked again while it lags behind
        self.log.info("engine_up", url=engine, weight_version=version, was=self.versions[engine])
        self.versions[engine] = version if version is not None else 0
        self._announced_before_restart[engine] = self._announced(engine)
        self._changed.set()

    def _groups_unsupported(self, engine: str, error: EngineError) -> None:
        if engine in self.no_groups:
            return
        self.no_groups[engine] = str(error)
        self.log.warning(
            "group_requests_unsupported",
            url=engine,
            status=error.status,
            error=str(error),
            fallback="one request per sample to this engine from now on",
        )

    def _adapter_of(self, engine: str) -> tuple[str | None, int] | None:
        """The LoRA adapter a request to ``engine`` names: the one of the version it serves."""
        names = getattr(self.ctx, "lora_names", None) or {}
        return adapter_for(names, self.versions.get(engine, 0))

    # ---------------------------------------------------------------- decisions
    @property
    def engine_version(self) -> int:
        """The newest policy version an engine in use serves."""
        live = [v for url, v in self.versions.items() if url not in self.down]
        return max(live, default=0)

    def _announced(self, engine: str) -> int:
        versions = getattr(self.ctx, "engine_versions", None) or {}
        return versions.get(engine.rstrip("/"), -1)

    def _take_announced_versions(self) -> None:
        """Learn from the weight publisher's announcements which version each engine loaded.

        Completions carry the version too, but none arrive while the queue gate holds starts
        back: without this the gate would go on counting the engines as behind (and hold back
        more) until it next asks them.
        """
        for url, known in self.versions.items():
            announced = self._announced(url)
            if announced > known and announced > self._announced_before_restart.get(url, -1):
                self.versions[url] = announced

    async def _watch_versions(self) -> None:
        """Look at the gates again as soon as a new version is announced."""
        version = self.ctx.version
        while True:
            version = await self.ctx.wait_for_version(version + 1)
            self._changed.set()

    def _lagging(self, engine: str) -> bool:
        return self.ctx.version - self.versions[engine] > self.config.max_lag

    async def _ask_engine_versions(self) -> None:
        """Learn the engines' policy versions by asking them (at most twice a second).

        Completions carry them, but the lag gate closes exactly when none are coming: a learner
        that published several versions while everything in flight was generated before them
        would otherwise wait for fresh samples that the gate never lets start. The same holds
        for an engine that was restarted and has just been caught up by the publisher.
        """
        now = time.monotonic()
        if now - self._versions_asked < 0.5:
            return
        self._versions_asked = now
        live = [url for url in self.clients if url not in self.down]
        answers = await asyncio.gather(
            *(self.clients[u].weight_version() for u in live), return_exceptions=True
        )
        for url, version in zip(live, answers, strict=True):
            if isinstance(version, int) and version != self.versions[url]:
                self.log.info("engine_version_asked", url=url, was=self.versions[url], now=version)
                self.versions[url] = version

    def _log_decisions(self, decisions: list[Decision]) -> None:
        for d in decisions:
            # the credit gate opens and shuts with every batch the scorer takes (thousands a
            # run): debug; the controller's targets and the lag gate are worth an info line
            log = self.log.debug if d.reason == "credit_gate" else self.log.info
            log("inflight_decision", scope=d.scope, value=d.value, reason=d.reason, **d.detail)

    def _pick_engine(self, size: int) -> str | None:
        """The live engine with the fewest samples in flight among those ``size`` more fit."""
        open_engines = []
        for url, n in self.in_flight.items():
            if url in self.down:
                continue
            if self._lagging(url):  # restarted, not caught up yet: it would serve stale samples
                continue
            if not self.controller.fits(url, n, size):
                self.controller.record_blocked(url)
                continue
            open_engines.append(url)
        return min(open_engines, key=lambda u: self.in_flight[u]) if open_engines else None

    def _open(self, size: int) -> tuple[str | None, int | None]:
        """The engine ``size`` more samples may start on now (None: the gates are shut, or no
        engine has room), and the learner's budget (``_learner_room``)."""
        groups = self.ctx.outputs["rollouts"].credit() + (self.outbox.maxsize - self.outbox.qsize())
        self._take_announced_versions()
        version = max(self.engine_version, 0)
        newest = max(self.ctx.version, version)
        ahead, budget = self._learner_room(version)
        may_start, changes = self.controller.gates(
            in_flight=sum(self.in_flight.values()),
            room=groups * self.config.group_size,
            version=version,
            newest=newest,
            max_lag=self.config.max_lag,
            size=size,
            ahead=ahead,
            budget=budget,
        )
        self._log_decisions(changes)
        return (self._pick_engine(size) if may_start else None), budget

    async def _slot(self, size: int) -> str:
        """Wait until the gates let ``size`` samples start and an engine has room for them."""
        while True:
            if self.launcher is not None and self.launcher.all_given_up:
                raise RuntimeError("every engine this generator launched died for good")
            if self._fatal is not None:
                raise self._fatal
            engine, budget = self._open(size)
            if engine is not None:
                return engine
            idle = not any(self.in_flight.values())  # no answer will say where engines are
            if any(self._lagging(u) for u in self.versions if u not in self.down) or (
                idle and budget is not None
            ):
                await self._ask_engine_versions()
            self._changed.clear()
            # Whatever opens a gate sets _changed: results, acknowledgements, the outbox,
            # credit downstream, the learners' pace, versions, the controller's decisions. The
            # timeout is a safety net, not a poll (looking every 50 ms was 45% of this
            # process's CPU while the gates were shut). The room a learner step's
            # acknowledgements free is not taken at the version before it: the learner
            # acknowledges a step once its pace report has come back over the bus.
            # (asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation
            # that races its timeout, and this loop would then outlive a shutdown.)
            waiter = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait([waiter], timeout=_LOOK_AGAIN_S)
            finally:
                waiter.cancel()

    def _learner_room(self, version: int) -> tuple[int | None, int | None]:
        """This generator's samples the learner is not done with yet, and how many of them it
        may hold so that a sample started now, at the engines' ``version``, is still within
        ``max_lag`` when the learner takes it: the versions left, plus the batch it is
        training (and one more while a rank of several waits for samples), times
        ``publish.every`` batches, shared among the generators feeding it (``topics.PACE``;
        (None, None) before the learner's first report)."""
        pace = getattr(self.ctx, "learner_pace", None)
        if not pace or self.ctx.mode != "async":
            return None, None
        # the learner's own version runs ahead of the published one while it publishes
        lag = max(pace["version"], self.ctx.version) - version
        batches = max(0, pace["max_lag"] - lag + 1) * pace["every"]
        # a rank waits for samples while another holds more than its share: one batch more
        batches += 1 if pace.get("hungry") else 0
        # a share rounded up, to whole groups: the generators' shares together fill the
        # batches (rounded down, three of them would hold 3 x 4 of a batch of 16, and wait)
        share = -(-batches * pace["batch"] // max(1, pace["origins"]))
        return self._unacked, -(-share // self.config.group_size) * self.config.group_size

    # ------------------------------------------------------------------- work
    async def run(self) -> None:
        workers = [
            asyncio.create_task(self._emit(), name="emit"),
            asyncio.create_task(self._decide(), name="decide"),
        ]
        if self.ctx.mode == "async":
            workers.append(asyncio.create_task(self._watch_versions(), name="versions"))
        size = self.config.group_size
        grouped = self.config.group_requests and size > 1 and self.rollouts is None
        try:
            if self.ctx.mode == "sync" and self.config.sync_batch < 1:
                raise ValueError(
                    "run.mode is sync: set the generator's sync_batch to the learner's batch_size"
                )
            batch_started, batch_version = 0, self.ctx.version
            async for msg in self.ctx.inputs["prompts"]:
                if self.ctx.mode == "sync" and batch_started >= self.config.sync_batch:
                    batch_version = await self._next_sync_batch(batch_version)
                    batch_started = 0
                batch_started += size
                prompt = msg.data
                group_id = f"{prompt['prompt_id']}/{secrets.token_hex(3)}"
                if grouped:
                    engine = await self._slot(size)
                    if self._batching(engine):
                        batch = self._more_groups([(msg, group_id)], engine, size)
                        self._spawn(self._groups(batch, engine, time.monotonic()))
                        continue
                    self._start(self._group(msg, group_id, engine, time.monotonic()), engine, size)
                    continue
                collecting = _Collecting(size)
                for index in range(size):
                    engine = await self._slot(1)
                    if self.rollouts is not None:
                        work = self._episode(msg, group_id, index, engine, collecting)
                    else:
                        work = self._sample(msg, group_id, index, engine, collecting)
                    self._start(work, engine, 1)
            if self._tasks:
                await asyncio.gather(*list(self._tasks))
            await self.outbox.join()
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        self._metrics()  # the last figures, however short the run
        self.log.info(
            "generator_done",
            in_flight=sum(self.in_flight.values()),
            engines_without_group_requests=len(self.no_groups),
            **self.counts,
        )

    async def _next_sync_batch(self, version: int) -> int:
        """Sync mode: wait until the last batch is out and trained on (a newer version)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks))
        await self.outbox.join()
        self.log.info("sync_batch_done", version=version)
        return await self.ctx.wait_for_version(version + 1)

    def _start(self, work: Any, engine: str, size: int) -> None:
        """Run ``work`` (a coroutine) holding ``size`` samples of ``engine``'s in-flight count."""
        self._hold(engine, size)
        self._spawn(work)

    def _hold(self, engine: str, size: int) -> None:
        self.in_flight[engine] += size
        self.counts["started"] += size
        self._unacked += size

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _batching(self, engine: str) -> bool:
        """Whether groups for ``engine`` go several to a request: an engine in this process
        (a request costs its checks and bookkeeping, not a round trip), in async mode (a sync
        batch counts its prompts one by one), unless each sample has a seed of its own (a
        request's body gives each its sampling parameters)."""
        return (
            self.ctx.mode == "async"
            and SEED_EACH_SAMPLE not in self.params
            and engine not in self.no_groups
            and isinstance(self.clients[engine], InProcessClient)
        )

    def _more_groups(
        self, batch: list[tuple[Message, str]], engine: str, size: int
    ) -> list[tuple[Message, str]]:
        """``batch`` (its first group's slot just granted) and the prompts waiting in the
        inbox whose groups the gates let start on ``engine`` now, each held as ``_start``
        holds one; no more than ``_GROUPS_PER_REQUEST``."""
        self._hold(engine, size)
        prompts = self.ctx.inputs["prompts"]
        waiting = getattr(prompts, "waiting", None)
        if waiting is None:
            return batch
        if len(self.in_flight) == 1:  # the gates looked at once for all of them
            for _ in range(min(_GROUPS_PER_REQUEST - len(batch), waiting(), self._more(size))):
                msg = prompts.take()
                batch.append((msg, f"{msg.data['prompt_id']}/{secrets.token_hex(3)}"))
                self._hold(engine, size)
            return batch
        while (  # several engines: another may become the one with the fewest in flight
            len(batch) < _GROUPS_PER_REQUEST and waiting() > 0 and self._open(size)[0] == engine
        ):
            msg = prompts.take()
            batch.append((msg, f"{msg.data['prompt_id']}/{secrets.token_hex(3)}"))
            self._hold(engine, size)
        return batch

    def _more(self, size: int) -> int:
        """How many more groups of ``size`` the gates let start now on the one engine, where
        samples are already in flight and not done with (a group was just held): what calling
        ``_open`` again after each one held would find, without a gate opening or shutting."""
        (engine,) = self.in_flight
        self._take_announced_versions()
        if engine in self.down or self._lagging(engine):
            return 0
        version = max(self.engine_version, 0)
        if max(self.ctx.version, version) - version > self.config.max_lag:
            return 0  # the lag gate
        room = self.ctx.outputs["rollouts"].credit() + (self.outbox.maxsize - self.outbox.qsize())
        more = (room * size - sum(self.in_flight.values())) // size  # the credit gate
        ahead, budget = self._learner_room(version)
        if ahead is not None and budget is not None:
            more = min(more, (budget - ahead) // size)  # the queue gate
        fits = (self.controller.target(engine) - self.in_flight[engine]) // size
        if fits < more:
            self.controller.record_blocked(engine)  # held back by the engine's target
        return max(0, min(more, fits))

    def _rid(self, group_id: str, index: int) -> str:
        return f"{self.run_id}/{group_id}/{index}"

    async def _group(
        self, msg: Message, group_id: str, engine: str, queued: float, attempt: int = 0
    ) -> None:
        started = time.monotonic()
        served = await self._request_group(msg.data, group_id, engine, attempt)
        got = [
            _completion_fields(i, s, queued, started) for i, s in enumerate(served) if s is not None
        ]
        await self._put(msg, group_id, got)

    async def _groups(self, batch: list[tuple[Message, str]], engine: str, queued: float) -> None:
        """Several groups in one request to an engine in this process (``_more_groups``); each
        goes on as soon as its own samples are done. A group the request fails for goes on as
        ``_group`` would have: refused, it is asked for again on its own (a bad prompt fails
        the whole request, and then only its own group); the engine stopped or the request
        timed out, the engine is taken out of use and the group retried elsewhere."""
        started = time.monotonic()
        size = self.config.group_size
        client = self.clients[engine]
        assert isinstance(client, InProcessClient)
        rids = [[self._rid(group_id, i) for i in range(size)] for _, group_id in batch]
        self.counts["requests"] += 1
        try:
            futures, pinned = client.submit_groups(
                [msg.data["input_ids"] for msg, _ in batch], self.params, rids
            )
        except EngineError as exc:
            for msg, group_id in batch:
                self._spawn(self._group_again(msg, group_id, engine, queued, exc))
            return
        which = {future: i for i, future in enumerate(futures)}
        pending = set(futures)
        # each future says when it is done (asyncio.wait would hook and unhook every pending
        # one each time a few of them finish)
        finished: list[asyncio.Future] = []
        wake: list[asyncio.Future] = []  # the one this task awaits, while it awaits

        def on_done(future: asyncio.Future) -> None:
            finished.append(future)
            if wake and not wake[0].done():
                wake[0].set_result(None)

        for future in futures:
            future.add_done_callback(on_done)
        deadline = time.monotonic() + client.timeout.total
        try:
            while pending:
                if not finished:
                    wake.append(asyncio.get_running_loop().create_future())
                    try:
                        await asyncio.wait(wake, timeout=max(0.0, deadline - time.monotonic()))
                    finally:
                        wake.pop().cancel()
                    if not finished:
                        break  # timed out: what is left goes again, below
                done, finished[:] = finished[:], []
                pending.difference_update(done)
                for future in sorted(done, key=which.__getitem__):
                    msg, group_id = batch[which[future]]
                    timings = (round(started - queued, 6), round(time.monotonic() - started, 6))
                    try:
                        got, newest = client.finished(future.result(), pinned, engine, timings)
                    except EngineError as exc:  # an answer that does not add up
                        self._spawn(self._group_again(msg, group_id, engine, queued, exc))
                        continue
                    except (RuntimeError, ValueError) as exc:  # as _generate reads them
                        error = EngineError(
                            engine,
                            f"/generate failed: {exc!r}",
                            retryable=isinstance(exc, RuntimeError),
                        )
                        self._spawn(self._group_again(msg, group_id, engine, queued, error))
                        continue
                    self._release(engine, size)
                    self.failures[engine] = 0
                    self.controller.record_tokens(engine, got.tokens)
                    self.versions[engine] = max(self.versions[engine], newest)
                    await self._put(msg, group_id, got)
        finally:
            if pending:  # timed out, or this task was cancelled: their rows are aborted
                client.abort([rid for f in pending for rid in rids[which[f]]])
                for future in pending:
                    future.cancel()
        timed_out = EngineError(engine, "/generate timed out", retryable=True)
        for future in sorted(pending, key=which.__getitem__):
            msg, group_id = batch[which[future]]
            self._spawn(self._group_again(msg, group_id, engine, queued, timed_out))

    async def _group_again(
        self, msg: Message, group_id: str, engine: str, queued: float, error: EngineError
    ) -> None:
        """A group of a several-group request that failed with ``error``, as ``_request_group``
        goes on after its first attempt: refused, it is sent again on its own to the same
        engine (where it is refused again only if its own prompt is bad); otherwise the engine
        is taken out of use and the group retried on another (or on it once it is back)."""
        if error.retryable:
            rids = [self._rid(group_id, i) for i in range(self.config.group_size)]
            rerouted = await self._reroute(rids, engine, 0, error)
            if rerouted is None:
                await self._put(msg, group_id, [])  # dropped: in the ledger as such
                return
            engine = rerouted
        await self._group(msg, group_id, engine, queued, attempt=1 if error.retryable else 0)

    async def _sample(
        self,
        msg: Message,
        group_id: str,
        index: int,
        engine: str,
        collecting: _Collecting,
    ) -> None:
        queued = started = time.monotonic()  # the slot was waited for before this started
        got = await self._request_one(msg.data, self._rid(group_id, index), engine, attempt=0)
        if got is not None:
            collecting.samples.append(_completion_fields(index, got, queued, started))
        await self._collected(msg, group_id, collecting)

    async def _episode(
        self,
        msg: Message,
        group_id: str,
        index: int,
        engine: str,
        collecting: _Collecting,
    ) -> None:
        """One sample made by the rollout plugin; holds one sample of its engine until it ends."""
        queued = started = time.monotonic()
        hold_kv = self.config.rollout.hold_kv
        handle = EpisodeEngine(self, engine, self._rid(group_id, index), hold_kv=hold_kv)
        rollouts = self.rollouts
        ctx = rollouts.context(sampling=self.params, sample_index=index, group_id=group_id)
        try:
            trajectory = check_trajectory(await rollouts.rollout(msg.data, handle, ctx))
        except EngineUnavailable as exc:
            self._dropped([handle.rid], handle.engine, exc, handle.calls)
            collecting.dropped[index] = "engine_failure"
        except PoolBroken as exc:  # no episode can be played any more: the stage fails
            self._fatal = exc
            collecting.dropped[index] = "env_error"
        except EnvError as exc:  # before its first turn: nothing to train on
            self._episode_failed(handle.rid, exc)
            collecting.dropped[index] = "env_error"
        except Exception as exc:  # a rollout's bug (or a timeout in it): this sample only
            self._episode_failed(handle.rid, exc)
            collecting.dropped[index] = "rollout_error"
        else:
            rollouts.counters["episodes"] += 1
            rollouts.counters["turns"] += trajectory.turns
            collecting.samples.append(
                sample_fields(
                    index,
                    trajectory,
                    group_prompt=msg.data["input_ids"],
                    engine=handle,
                    queued=queued,
                    started=started,
                )
            )
        finally:
            self._release(handle.engine, 1)
            if handle.holding and not self._closing:  # its engines may let its KV go
                for engine in handle.holding:
                    self.closer.close(engine, handle.rid)
        await self._collected(msg, group_id, collecting)

    async def _collected(self, msg: Message, group_id: str, collecting: _Collecting) -> None:
        collecting.left -= 1
        if self._closing:
            # Closing: nothing more goes out (its prompt is in flight at the end). A sample
            # can get here after its task was cancelled: Python 3.11's wait_for returns an
            # agent's result that finished as it was cancelled, and the outbox would then
            # wait for room forever.
            return
        if collecting.left == 0:
            samples = sorted(collecting.samples, key=lambda s: s["sample_index"])
            await self._put(msg, group_id, samples, dropped=collecting.dropped)

    def _episode_failed(self, rid: str, exc: BaseException) -> None:
        if self._closing:
            return
        self._episode_errors += 1
        self.counts["dropped"] += 1
        if self._episode_errors & (self._episode_errors - 1) == 0:  # 1st, 2nd, 4th, 8th...
            self.log.warning(
                "rollout_failed",
                rid=rid,
                error=f"{type(exc).__name__}: {exc}",
                failures=self._episode_errors,
                exc_info=exc,
            )

    async def _request_group(
        self, prompt: dict[str, Any], group_id: str, engine: str, attempt: int = 0
    ) -> list[_Served | None]:
        """The group's samples (None for a dropped one); holds ``group_size`` samples of
        ``engine`` and releases them. A whole-group failure is re-routed whole (``attempt``:
        the retries it had before)."""
        size = self.config.group_size
        rids = [self._rid(group_id, index) for index in range(size)]
        while engine not in self.no_groups:
            self.counts["requests"] += 1
            try:
                completions = await self.clients[engine].generate_group(
                    prompt["input_ids"], self.params, rids=rids
                )
            except EngineError as exc:
                if not exc.retryable:
                    return await self._fall_back(prompt, rids, engine, exc, attempt)
                rerouted = await self._reroute(rids, engine, attempt, exc)
                if rerouted is None:
                    return [None] * size
                engine, attempt = rerouted, attempt + 1
                continue
            self._release(engine, size)
            self._served(engine, completions)
            done = time.monotonic()
            return [_Served(engine, c, done) for c in completions]
        # known to take per-sample requests only: the samples share the slots the group holds
        return list(
            await asyncio.gather(*(self._request_one(prompt, r, engine, attempt) for r in rids))
        )

    async def _reroute(
        self, rids: list[str], engine: str, attempt: int, error: EngineError
    ) -> str | None:
        """A group request failed at ``engine`` (retryable ``error``) after ``attempt``
        retries: the engine is taken out of use and the group's samples released there; the
        engine that holds them now for the next attempt (a live one, or one that came back:
        the probes' capped backoff), or None once the retries are spent (dropped, counted)."""
        size = len(rids)
        self._release(engine, size)
        self._mark_down(engine, str(error))
        if attempt >= self.config.max_retries:
            self._dropped(rids, engine, error, attempt + 1)
            return None
        self._retrying(rids, engine, attempt + 1, error)
        engine = await self._slot(size)
        self.in_flight[engine] += size
        return engine

    async def _fall_back(
        self,
        prompt: dict[str, Any],
        rids: list[str],
        engine: str,
        error: EngineError,
        attempt: int,
    ) -> list[_Served | None]:
        """A refused group request, sent again at once as per-sample requests to ``engine``.

        If one of them succeeds there, the engine cannot serve groups (remembered, warned once);
        if they are all refused too, the request itself was bad (each sample dropped, counted).
        """
        self.counts["group_fallbacks"] += 1
        served = await asyncio.gather(
            *(self._request_one(prompt, r, engine, attempt) for r in rids)
        )
        if any(s is not None and s.engine == engine for s in served):
            self._groups_unsupported(engine, error)
        return list(served)

    async def _request_one(
        self, prompt: dict[str, Any], rid: str, engine: str, attempt: int
    ) -> _Served | None:
        """One sample (None when dropped); holds one sample of ``engine`` and releases it."""
        while True:
            self.counts["requests"] += 1
            try:
                completion = await self.clients[engine].generate(
                    prompt["input_ids"], self.params, rid=rid
                )
                break
            except EngineError as exc:
                self._release(engine, 1)
                if exc.retryable:
                    self._mark_down(engine, str(exc))
                if not exc.retryable or attempt >= self.config.max_retries:
                    self._dropped([rid], engine, exc, attempt + 1)
                    return None
                attempt += 1
                self._retrying([rid], engine, attempt, exc)
                engine = await self._slot(1)
                self.in_flight[engine] += 1
        self._release(engine, 1)
        self._served(engine, [completion])
        return _Served(engine, completion, time.monotonic())

    def _served(self, engine: str, completions: list[Completion]) -> None:
        self.failures[engine] = 0
        self.controller.record_tokens(engine, sum(len(c.output_ids) for c in completions))
        for c in completions:
            self.versions[engine] = max(self.versions[engine], c.weight_version)

    def _retrying(self, rids: list[str], engine: str, attempt: int, error: EngineError) -> None:
        self.counts["retried"] += len(rids)
        for rid in rids:
            self.log.warning(
                "sample_retry", rid=rid, engine=engine, attempt=attempt, error=str(error)
            )

    def _dropped(self, rids: list[str], engine: str, error: EngineError, attempts: int) -> None:
        self.counts["dropped"] += len(rids)
        for rid in rids:
            self.log.warning(
                "sample_dropped", rid=rid, engine=engine, error=str(error), attempts=attempts
            )

    def _release(self, engine: str, size: int) -> None:
        self.in_flight[engine] -= size
        self._changed.set()

    async def _put(
        self,
        msg: Message,
        group_id: str,
        samples: list[dict[str, Any]] | rollout_batch.Finished,
        dropped: dict[int, str] | None = None,
    ) -> None:
        """Queue the group for sending: ``samples`` are the sample maps of the samples that were
        not dropped, in index order (or all of them, ``Finished`` as the engine gave them);
        nothing is sent when all were dropped. The dropped ones go in the ledger now (as
        ``engine_failure`` unless ``dropped`` names another reason), before the prompt can be
        acknowledged. The prompt's message is acknowledged once the scorer has acknowledged its
        group (``_emit``, ``_group_acked``)."""
        prompt = msg.data
        size = self.config.group_size
        if len(samples) < size:  # some were dropped: in the ledger now, each by its reason
            kept = {s["sample_index"] for s in samples}
            reasons = dropped or {}
            for reason in sorted({reasons.get(i, "engine_failure") for i in range(size)}):
                self.ctx.ledger.fates(
                    (
                        (prompt.get("uid"), size, i)
                        for i in range(size)
                        if i not in kept and reasons.get(i, "engine_failure") == reason
                    ),
                    reason,
                )
            self._unacked -= size - len(samples)
            self._changed.set()
        if not samples:
            self.ctx.inputs["prompts"].ack(msg)  # all dropped (and counted): processed
            return
        item = (
            {
                "run_id": self.run_id,
                "prompt_id": prompt["prompt_id"],
                "group_id": group_id,
                "group_size": self.config.group_size,
                "prompt_ids": np.asarray(prompt["input_ids"], dtype=np.int32),
                "samples": samples,
                "meta": prompt.get("meta"),
                "uid": prompt.get("uid"),
                # the learner counts the generators that feed it (``topics.PACE``)
                "origin": self._origin,
            },
            msg,
        )
        await self.outbox.put(item)

    async def _emit(self) -> None:
        """Send finished groups to the scorers: what waits in the outbox goes as one
        ``rollout_batch`` where the scorers take it (single-turn groups), else in one
        ``send_many`` of ``rollout_group`` messages (one batch to a scorer in another process)."""
        rollouts = self.ctx.outputs["rollouts"]
        many = hasattr(rollouts, "send_many")
        columns = getattr(rollouts, "sends", None) is not None and rollouts.sends(
            ROLLOUT_BATCH.kind
        )
        while True:
            waiting = [await self.outbox.get()]
            try:
                # no more than the scorers have credit for (in groups): the rest stays counted
                # in the outbox (the credit gate's room downstream); a batch goes to one
                # scorer, so no more than the one with the most has room for. With none, wait
                # for some first: the groups that finish meanwhile go in the same batch.
                room = rollouts.room() if columns else rollouts.credit()
                if columns and room <= 0 and hasattr(rollouts, "wait_for_room"):
                    room = await rollouts.wait_for_room()
                while many and not self.outbox.empty() and len(waiting) < room:
                    waiting.append(self.outbox.get_nowait())
                items = [item for item, _ in waiting]
                samples = sum(len(item["samples"]) for item in items)
                tokens = sum(_tokens(item["samples"]) for item in items)
                single_turn = self.rollouts is None  # no trajectories: every group fits
                if columns and (single_turn or all(rollout_batch.fits(i) for i in items)):
                    batch = rollout_batch.pack(
                        items, self.run_id, self.config.group_size, self._origin
                    )
                    sent = [await rollouts.send(ROLLOUT_BATCH.kind, batch)]
                    entries = [[(msg, len(item["samples"])) for item, msg in waiting]]
                elif many:
                    items = [_with_maps(item) for item in items]
                    sent = await rollouts.send_many(ROLLOUT_GROUP.kind, items)
                    entries = [[(msg, len(item["samples"]))] for item, msg in waiting]
                else:
                    sent = [await rollouts.send(ROLLOUT_GROUP.kind, _with_maps(items[0]))]
                    entries = [[(waiting[0][1], len(items[0]["samples"]))]]
                for seq, entry in zip(sent, entries, strict=True):
                    if isinstance(seq, int) and self._chained and seq not in self._acked_early:
                        self._awaiting_ack[seq] = entry  # acked once the scorer is done
                    else:
                        self._acked_early.discard(seq)
                        self._prompts_done(entry)
                self.counts["groups_emitted"] += len(items)
                self.counts["emitted"] += samples
                self.counts["tokens"] += tokens
            finally:
                for _ in waiting:
                    self.outbox.task_done()
                self._changed.set()

    def _group_acked(self, seq: int) -> None:
        entry = self._awaiting_ack.pop(seq, None)
        if entry is None:  # one of a send_many, acknowledged before it returned
            self._acked_early.add(seq)
            return
        self._prompts_done(entry)

    def _prompts_done(self, entry: list[tuple[Message, int]]) -> None:
        """The scorer is done with these groups: their prompts are processed."""
        prompts = self.ctx.inputs["prompts"]
        for msg, size in entry:
            prompts.ack(msg)
            self._unacked -= size
        self._changed.set()  # the queue gate has room again

    async def _decide(self) -> None:
        interval = self.config.controller.interval_s
        while True:
            await asyncio.sleep(interval)
            await self._announce_engines()
            self._log_decisions(self.controller.decide(time.monotonic()))
            self._changed.set()  # the engines' targets may have moved
            self._metrics()

    def _metrics(self) -> None:
        rollout = (
            {f"rollout_{k}": v for k, v in self.rollouts.stats().items()}
            if self.rollouts is not None
            else {}
        )
        self.ctx.metrics(
            in_flight=sum(self.in_flight.values()),
            targets={u: self.controller.target(u) for u in self.in_flight},
            engines_down=len(self.down),
            engines_without_group_requests=len(self.no_groups),
            engine_version=self.engine_version,
            not_done=self._unacked,  # samples the learner is not done with (the queue gate)
            **self.counts,
            **rollout,
        )

    async def close(self) -> None:
        self._closing = True
        try:  # the last episodes' sessions: an engine that outlives the run lets their KV go
            await asyncio.wait_for(self.closer.flush(), CLOSE_FLUSH_S)
        except asyncio.TimeoutError:
            self.closer.cancel()
        if self.rollouts is not None:
            self.rollouts.close_soon()
        tasks = [*self._tasks, *getattr(self, "down", {}).values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.rollouts is not None:
            await self.rollouts.aclose()
        if self.launcher is not None:
            await self.launcher.close()
        if self.session is not None:
            await self.session.close()


def _completion_fields(
    index: int, served: _Served, queued: float, started: float
) -> dict[str, Any]:
    """A single completion as a ``rollout_group`` sample (every token sampled: no mask)."""
    return {
        "sample_index": index,
        "completion_ids": served.completion.output_ids,
        "sampler_logprobs": served.completion.logprobs,
        "versions": served.completion.versions,
        "finish_reason": served.completion.finish_reason,
        "engine": served.engine,
        "timings": {
            "queued_s": round(started - queued, 6),
            "generate_s": round(served.done - started, 6),
        },
    }


def _tokens(samples: list[dict[str, Any]] | rollout_batch.Finished) -> int:
    if isinstance(samples, rollout_batch.Finished):
        return samples.tokens
    return sum(len(x["completion_ids"]) for x in samples)


def _with_maps(item: dict[str, Any]) -> dict[str, Any]:
    """A group as a ``rollout_group`` map: its samples as maps (made if ``Finished``)."""
    if isinstance(item["samples"], rollout_batch.Finished):
        return {**item, "samples": item["samples"].maps()}
    return item
