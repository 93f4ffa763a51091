"""Group requests: the generator stage in this process against a real built-in engine over HTTP.

The stage runs with a stand-in for the runtime's context (prompts from a list, rollouts into a
list, credit set by the test); the engine is a real ``inflight engine`` process. Between them, a
small aiohttp reverse proxy records every ``/generate`` body and how many samples are in flight
at the engine; told to, it refuses batched ``input_ids`` with HTTP 400 (it then stands for an
engine without batch support) or fails a request with HTTP 503 (an engine failure).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import structlog.testing
from aiohttp import web

from pipeline.ledger import LedgerReporter
from stages.generator.controller import ControllerConfig
from stages.generator.stage import Generator, GeneratorConfig, SamplingConfig
from stages.schemas import ROLLOUT_GROUP, rollouts_of
from tests.stages.engine_setup import builtin_engine
from tests.stages.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

G = 4
NEW_TOKENS = 6


# ------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A built-in engine on a tiny random model, for the whole module."""
    root = tmp_path_factory.mktemp("groups")
    model = make_tiny_model(root / "tiny", seed=0)
    with builtin_engine(model, output=root / "engine.out", stop_within=10) as url:
        yield url


# ------------------------------------------------------------------------------- the proxy
Verdict = Callable[[dict[str, Any]], "tuple[int, str] | None"]


class Proxy:
    """Forwards everything to ``upstream``; ``verdict(body)`` may answer a /generate instead."""

    def __init__(self, upstream: str, verdict: Verdict | None = None) -> None:
        self.upstream, self.verdict = upstream, verdict
        self.forwarded: list[dict[str, Any]] = []  # /generate bodies the engine got
        self.refused: list[dict[str, Any]] = []
        self.now = self.peak = 0  # samples in flight at the engine, through this proxy
        self.peers: set[tuple[str, int]] = set()  # client connections seen
        self.others: list[tuple[str, bytes]] = []  # (path, body) of every other route called

    async def __aenter__(self) -> str:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()
        await self.session.close()

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.peers.add(request.transport.get_extra_info("peername"))
        samples = 0
        if request.path != "/generate":
            self.others.append((request.path, raw))
        else:
            body = json.loads(raw)
            answer = self.verdict(body) if self.verdict else None
            if answer is not None:
                self.refused.append(body)
                status, message = answer
                return web.json_response({"error": {"message": message}}, status=status)
            self.forwarded.append(body)
            samples = len(body["input_ids"]) if isinstance(body["input_ids"][0], list) else 1
        self.now += samples
        self.peak = max(self.peak, self.now)
        try:
            async with self.session.request(
                request.method,
                self.upstream + request.path_qs,
                data=raw or None,
                headers={"Content-Type": "application/json"},
            ) as resp:
                return web.Response(
                    body=await resp.read(), status=resp.status, content_type="application/json"
                )
        finally:
            self.now -= samples


def batched(body: dict[str, Any]) -> bool:
    return isinstance(body["input_ids"][0], list)


# ---------------------------------------------------------------------- the stage, in here
class Rollouts:
    """The rollouts port: ``credit`` granted downstream, each send taking ``delay_s``."""

    def __init__(self, credit: int, delay_s: float) -> None:
        self.credit_now, self.delay_s = credit, delay_s
        self.groups: list[dict[str, Any]] = []
        self.sent: list[dict[str, Any]] = []  # the groups' samples, as rollouts

    def credit(self) -> int:
        return self.credit_now

    async def send(self, kind: str, data: dict[str, Any]) -> None:
        assert kind == "rollout_group"
        assert ROLLOUT_GROUP.check(data) == []
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.groups.append(data)
        self.sent.extend(rollouts_of(data))


class PromptList:
    """The prompts port: hands out the prompts and records which ones were acknowledged."""

    def __init__(self, prompts: list[dict[str, Any]], rollouts: Rollouts) -> None:
        self.prompts, self.rollouts = prompts, rollouts
        self.acked: list[str] = []
        self.acked_before_sent: list[str] = []

    async def __aiter__(self):
        for p in self.prompts:
            yield SimpleNamespace(data=p)

    def ack(self, msg: SimpleNamespace) -> None:
        prompt_id = msg.data["prompt_id"]
        self.acked.append(prompt_id)
        if prompt_id not in {g["prompt_id"] for g in self.rollouts.groups}:
            self.acked_before_sent.append(prompt_id)


def prompts(count: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt_id": f"p{i}",
            "input_ids": [1 + (7 * i + j) % 60 for j in range(6)],
            "meta": {"i": i},
            "uid": f"feeder.0:{i}",
        }
        for i in range(count)
    ]


async def generate(
    tmp_path: Path,
    engines: list[str],
    count: int,
    *,
    target: int = 8,
    credit: int = 1000,
    send_delay_s: float = 0.0,
    mode: str = "async",
    version: int = 0,
    pace: dict[str, int] | None = None,
    engine_versions: dict[str, int] | None = None,
    prompt_list: list[dict[str, Any]] | None = None,
    **options: Any,
) -> SimpleNamespace:
    """Run the generator stage over ``count`` prompts; returns what it did and said.
    ``pace``: the learner's last ``topics.PACE`` report (none by default); ``engine_versions``:
    what the weight publisher announced each engine holds (``topics.VERSION``);
    ``prompt_list``: the prompts (default: ``prompts(count)``)."""
    config = GeneratorConfig(
        engines=engines,
        group_size=G,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True),
        controller=ControllerConfig(
            start=target, min_in_flight=target, max_in_flight=target, interval_s=0.1
        ),
        retry_backoff_s=0.1,
        **{"outbox": 8, **options},
    )
    log = structlog.testing.CapturingLogger()
    metrics: list[dict[str, Any]] = []
    ledger: list[dict[str, Any]] = []

    async def publish(topic: str, payload: dict[str, Any]) -> None:
        pass

    batches: list[tuple[int, int]] = []  # (samples started, in flight) when a sync batch ended

    async def wait_for_version(at_least: int) -> int:
        if mode == "async":  # no learner publishes in these runs
            await asyncio.Event().wait()
        batches.append((stage.counts["started"], sum(stage.in_flight.values())))
        return at_least  # the learner trained on the batch at once

    rollouts = Rollouts(credit, send_delay_s)
    ctx = SimpleNamespace(
        stage="generator",
        replica=0,
        run_dir=tmp_path / "run-groups",
        mode=mode,
        version=version,
        log=log,
        inputs={"prompts": PromptList(prompt_list or prompts(count), rollouts)},
        outputs={"rollouts": rollouts},
        metrics=lambda **values: metrics.append(values),
        ledger=LedgerReporter(ledger.append),
        publish=publish,
        wait_for_version=wait_for_version,
        engine_versions=dict(engine_versions or {}),
    )
    stage = Generator(config, ctx)
    peak: dict[str, int] = {}
    start = stage._start

    def start_and_watch(work: Any, engine: str, size: int) -> None:
        start(work, engine, size)
        peak[engine] = max(peak.get(engine, 0), stage.in_flight[engine])
        peak["all"] = max(peak.get("all", 0), sum(stage.in_flight.values()))
        peak["not_done"] = max(peak.get("not_done", 0), stage._unacked)

    if pace:
        ctx.learner_pace = dict(pace)
    stage._start = start_and_watch
    await stage.setup()
    try:
        await stage.run()
    finally:
        await stage.close()
    events = [{"event": c.args[0], **c.kwargs} for c in log.calls]
    (done,) = [e for e in events if e["event"] == "generator_done"]
    assert done["in_flight"] == 0, done  # every slot taken was given back
    return SimpleNamespace(
        rollouts=ctx.outputs["rollouts"].sent,
        groups=ctx.outputs["rollouts"].groups,
        events=events,
        named=lambda name: [e for e in events if e["event"] == name],
        done=done,
        metrics=metrics,
        ledger=ledger,
        peak=peak,
        batches=batches,
        run_id=ctx.run_dir.name,
        acked=ctx.inputs["prompts"].acked,
        acked_before_sent=ctx.inputs["prompts"].acked_before_sent,
    )


def assert_every_sample_once(out: SimpleNamespace, count: int) -> None:
    keys = [(r["group_id"], r["sample_index"]) for r in out.rollouts]
    assert len(keys) == len(set(keys)) == G * count
    assert sorted(r["meta"]["i"] for r in out.rollouts) == sorted(list(range(count)) * G)
    assert out.done["emitted"] == out.done["started"] == G * count and out.done["dropped"] == 0
    # each prompt acknowledged once, after its group went on
    assert sorted(out.acked) == sorted(f"p{i}" for i in range(count))
    assert out.acked_before_sent == []


# ------------------------------------------------------------------------------- the tests
@pytest.mark.timeout(60)
async def test_one_request_per_group_gives_g_rollouts_with_their_own_rids(tmp_path, engine):
    count = 6
    proxy = Proxy(engine)
    async with proxy as url:
        out = await generate(tmp_path, [url], count)
    assert_every_sample_once(out, count)
    # one request per group: G copies of the prompt, one sampling_params, one rid per sample
    assert len(proxy.forwarded) == count and out.done["requests"] == count
    by_prompt = {p["prompt_id"]: p for p in prompts(count)}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in out.rollouts:
        groups.setdefault(r["group_id"], []).append(r)
    rids_sent = {tuple(b["rid"]) for b in proxy.forwarded}
    for body in proxy.forwarded:
        assert body["return_logprob"] is True and isinstance(body["sampling_params"], dict)
        assert body["sampling_params"]["max_new_tokens"] == NEW_TOKENS
        assert len(body["input_ids"]) == G and all(
            row == body["input_ids"][0] for row in body["input_ids"]
        )
    for group_id, members in groups.items():
        assert sorted(r["sample_index"] for r in members) == list(range(G))
        prompt = by_prompt[members[0]["prompt_id"]]
        assert group_id.startswith(prompt["prompt_id"] + "/")
        assert tuple(f"{out.run_id}/{group_id}/{i}" for i in range(G)) in rids_sent
        for r in members:
            assert r["prompt_ids"].tolist() == prompt["input_ids"] and r["meta"] == prompt["meta"]
            assert r["group_size"] == G and r["engine"] == url and r["run_id"] == out.run_id
            n = len(r["completion_ids"])
            assert n == NEW_TOKENS == len(r["sampler_logprobs"]) == len(r["versions"])
            assert r["completion_ids"].dtype.name == "int32"
            assert r["sampler_logprobs"].dtype.name == "float32"
            assert (r["sampler_logprobs"] <= 0).all() and r["versions"].tolist() == [0] * n
            assert r["finish_reason"] == "length"
            assert set(r["timings"]) == {"queued_s", "generate_s"}
    # the engine answered each rid with its own sample, in request order
    assert out.done["tokens"] == G * count * NEW_TOKENS


@pytest.mark.timeout(60)
@pytest.mark.parametrize("group_requests", [True, False])
async def test_samples_in_flight_never_exceed_the_target(tmp_path, engine, group_requests):
    count, target = 12, 6  # not a multiple of G: a second group does not fit
    proxy = Proxy(engine)
    async with proxy as url:
        out = await generate(tmp_path, [url], count, target=target, group_requests=group_requests)
    assert_every_sample_once(out, count)
    # filled with as many whole groups (or samples) as fit the target ...
    assert out.peak[url] == (G if group_requests else target)
    assert proxy.peak <= target  # ... and never beyond, as the engine saw it
    # keep-alive: connections are reused, never more than requests at once (+ /health at start)
    assert len(proxy.peers) <= target + 1
    assert out.done["requests"] == (count if group_requests else G * count)
    assert all(batched(b) == group_requests for b in proxy.forwarded)


@pytest.mark.timeout(60)
async def test_a_target_below_the_group_size_runs_one_group_at_a_time(tmp_path, engine):
    count = 5
    proxy = Proxy(engine)
    async with proxy as url:
        out = await generate(tmp_path, [url], count, target=2)
    assert_every_sample_once(out, count)  # no deadlock
    assert out.peak[url] == G and proxy.peak == G


@pytest.mark.timeout(60)
async def test_samples_in_flight_never_exceed_the_downstream_room(tmp_path, engine):
    # no credit downstream, an outbox of 1 group and a slow consumer: the room is the outbox's
    # free slot (G samples), so one group at a time, and only once the previous one has left
    count = 4
    proxy = Proxy(engine)
    async with proxy as url:
        out = await generate(tmp_path, [url], count, credit=0, send_delay_s=0.02, outbox=1)
    assert_every_sample_once(out, count)
    assert out.peak["all"] <= G and proxy.peak <= G
    # one message per group, each with its G samples in index order
    assert len(out.groups) == count
    assert all([x["sample_index"] for x in g["samples"]] == list(range(G)) for g in out.groups)
    closed = [e for e in out.named("inflight_decision") if e["reason"] == "credit_gate"]
    assert closed and closed[0]["value"] is False and closed[0]["size"] == G


@pytest.mark.timeout(60)
async def test_engine_without_batch_support_gets_per_sample_requests(tmp_path, engine):
    count = 10

    def no_batches(body: dict[str, Any]) -> tuple[int, str] | None:
        if batched(body):
            return 400, "input_ids: expected a list of token ids (no batches here)"
        return None

    proxy = Proxy(engine, no_batches)
    async with proxy as url:
        out = await generate(tmp_path, [url], count)
    assert_every_sample_once(out, count)  # nothing lost, nothing twice
    warned = out.named("group_requests_unsupported")
    assert len(warned) == 1, warned
    assert warned[0]["url"] == url and warned[0]["status"] == 400
    assert "no batches here" in warned[0]["error"]
    # each refused group was sent again per sample; after the first, no group went there
    assert out.done["group_fallbacks"] == len(proxy.refused) >= 1
    assert out.done["engines_without_group_requests"] == 1
    assert len(proxy.forwarded) == G * count and not any(batched(b) for b in proxy.forwarded)
    assert out.done["requests"] == len(proxy.refused) + G * count
    assert not out.named("sample_dropped") and not out.named("sample_retry")
    # the count is in the periodic metrics too
    assert any(m.get("engines_without_group_requests") == 1 for m in out.metrics)


@pytest.mark.timeout(60)
async def test_a_bad_prompt_is_dropped_without_blaming_the_engine(tmp_path, engine):
    count = 3

    def bad_second_prompt(body: dict[str, Any]) -> tuple[int, str] | None:
        rid = body["rid"][0] if batched(body) else body["rid"]
        return (400, "input_ids[0][5]: token id out of range") if "/p1/" in rid else None

    proxy = Proxy(engine, bad_second_prompt)
    async with proxy as url:
        out = await generate(tmp_path, [url], count)
    dropped = out.named("sample_dropped")
    assert len(dropped) == G and all("/p1/" in e["rid"] and e["attempts"] == 1 for e in dropped)
    assert out.done["dropped"] == G and out.done["emitted"] == G * (count - 1)
    # dropped (and counted) is processed too: every prompt is acknowledged once
    assert sorted(out.acked) == ["p0", "p1", "p2"] and out.acked_before_sent == ["p1"]
    # in the ledger, each of its samples (slots), as dropped for an engine failure
    slots = [["feeder.0:1", G, i] for i in range(G)]
    assert out.ledger == [{"fates": slots, "reason": "engine_failure", "step": None}]
    assert all(g["uid"] == f"feeder.0:{g['prompt_id'][1:]}" for g in out.groups)
    # the group was refused, and so was every sample of it: the prompt, not the engine
    assert not out.named("group_requests_unsupported")
    assert out.done["engines_without_group_requests"] == 0
    assert sum(batched(b) for b in proxy.forwarded) == count - 1


@pytest.mark.timeout(60)
async def test_a_failed_group_request_is_rerouted_whole(tmp_path, engine):
    count = 4
    failed: list[dict[str, Any]] = []

    def fail_first(body: dict[str, Any]) -> tuple[int, str] | None:
        if not failed:
            failed.append(body)
            return 503, "engine overloaded"
        return None

    flaky, steady = Proxy(engine, fail_first), Proxy(engine)
    async with flaky as flaky_url, steady as steady_url:
        out = await generate(tmp_path, [flaky_url, steady_url], count, max_retries=2)
    assert_every_sample_once(out, count)
    (body,) = failed
    assert batched(body)
    rids = body["rid"]
    retries = out.named("sample_retry")
    assert sorted(e["rid"] for e in retries) == sorted(rids)
    assert {(e["engine"], e["attempt"]) for e in retries} == {(flaky_url, 1)}
    assert "503" in retries[0]["error"]
    assert out.done["retried"] == G
    # the whole group went on as one request to the other engine
    assert [b["rid"] for b in steady.forwarded if b["rid"] == rids] == [rids]
    group_id = rids[0].split("/", 1)[1].rsplit("/", 1)[0]
    assert {r["engine"] for r in out.rollouts if r["group_id"] == group_id} == {steady_url}
    assert [e["url"] for e in out.named("engine_down")] == [flaky_url]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("group_requests", [True, False])
async def test_sync_mode_starts_exactly_sync_batch_samples_per_version(
    tmp_path, engine, group_requests
):
    count = 7  # 28 samples: batches of 8, 8, 8, then 4 when the prompts run out
    async with Proxy(engine) as url:
        out = await generate(
            tmp_path, [url], count, mode="sync", sync_batch=8, group_requests=group_requests
        )
    assert_every_sample_once(out, count)
    # each batch was whole, and all out, before the next version was awaited
    assert out.batches == [(8, 0), (16, 0), (24, 0)]


def test_sync_batch_must_be_whole_groups():
    with pytest.raises(
        ValueError, match=r"sync_batch \(10\) must be a multiple of group_size \(4\)"
    ):
        GeneratorConfig(engines=["http://e"], group_size=4, sync_batch=10)


def _set_engine_version(url: str, version: int) -> None:
    body = json.dumps({"new_version": str(version), "abort_all_requests": False}).encode()
    request = urllib.request.Request(
        url + "/update_weight_version", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200


@pytest.mark.timeout(60)
async def test_lag_gate_learns_the_engine_version_when_nothing_is_in_flight(tmp_path, engine):
    # The learner published versions 1-5 while everything in flight predated them: no
    # completion will tell the generator the engine moved on, so it must ask.
    await asyncio.to_thread(_set_engine_version, engine, 5)
    try:
        out = await asyncio.wait_for(generate(tmp_path, [engine], 3, version=5, max_lag=1), 30)
    finally:
        await asyncio.to_thread(_set_engine_version, engine, 0)
    assert_every_sample_once(out, 3)
    assert all(r["versions"].tolist() == [5] * NEW_TOKENS for r in out.rollouts)
    assert out.named("engine_version_asked")[0]["now"] == 5


@pytest.mark.timeout(60)
async def test_samples_the_learner_is_not_done_with_stay_within_its_pace(tmp_path, engine):
    """With room everywhere (a big target, all the credit), the samples the learner is not done
    with (here: in flight and in the outbox; the stand-in port acknowledges on send) stay
    within (max_lag - lag + 1) x every x batch."""
    count = 20
    # learner version 1, engines at 0: (max_lag 2 - lag 1 + 1) x every 1 x batch 8 = 16
    pace = {"batch": 8, "every": 1, "max_lag": 2, "origins": 1, "version": 1}
    out = await generate(tmp_path, [engine], count, target=40, send_delay_s=0.01, pace=pace)
    assert_every_sample_once(out, count)
    assert out.peak["not_done"] <= 16 and out.peak["all"] <= 16  # the target alone: 40
    closed = [e for e in out.named("inflight_decision") if e["reason"] == "queue_gate"]
    assert closed and closed[0]["value"] is False and closed[0]["budget"] == 16
    assert all(e["ahead"] + e["size"] > 16 for e in closed if e["value"] is False)
    assert {g["origin"] for g in out.groups} == {"generator.0:"}
    # two generators share the learner's batch: half each
    out = await generate(tmp_path, [engine], 6, target=40, pace={**pace, "origins": 2})
    assert out.peak["not_done"] <= 8


@pytest.mark.timeout(60)
async def test_no_queue_gate_without_a_pace_and_a_batch_more_for_a_hungry_learner(tmp_path, engine):
    out = await generate(tmp_path, [engine], 12, target=40)
    assert out.peak["not_done"] > 16
    assert not [e for e in out.named("inflight_decision") if e["reason"] == "queue_gate"]
    # a learner rank that waits for samples (several ranks: one may starve while another holds
    # more than its share) lets one batch more through: (2 - 1 + 1 + 1) x 8
    pace = {"batch": 8, "every": 1, "max_lag": 2, "origins": 1, "version": 1, "hungry": True}
    out = await generate(tmp_path, [engine], 12, target=40, send_delay_s=0.01, pace=pace)
    assert 16 < out.peak["not_done"] <= 24


@pytest.mark.timeout(60)
async def test_the_queue_gate_counts_versions_the_publisher_announced_as_loaded(tmp_path, engine):
    """The learner is at version 1 and the publisher announced that the engine loaded it: the
    gate must count the engine as current from the start, (max_lag 2 - lag 0 + 1) x batch 8 =
    24, not wait for a completion (none comes while the gate holds starts back) or ask."""
    pace = {"batch": 8, "every": 1, "max_lag": 2, "origins": 1, "version": 1}
    await asyncio.to_thread(_set_engine_version, engine, 1)
    try:
        out = await generate(
            tmp_path,
            [engine],
            12,
            target=40,
            send_delay_s=0.01,
            pace=pace,
            version=1,
            engine_versions={engine: 1},
        )
    finally:
        await asyncio.to_thread(_set_engine_version, engine, 0)
    assert_every_sample_once(out, 12)
    closed = [e for e in out.named("inflight_decision") if e["reason"] == "queue_gate"]
    assert closed and closed[0]["value"] is False and closed[0]["budget"] == 24
    assert 16 < out.peak["not_done"] <= 24
    assert not out.named("engine_version_asked")


def test_announcements_from_before_an_engine_restart_are_not_believed(tmp_path):
    """A restarted engine serves its initial weights: the announcement of the version it held
    before (re-read every time the gates are looked at) must not count it as current again;
    the next announcement (the publisher caught it up) does."""
    config = GeneratorConfig(engines=["http://a"], group_size=G)
    ctx = SimpleNamespace(
        stage="generator",
        replica=0,
        run_dir=tmp_path / "run",
        mode="async",
        version=7,
        log=structlog.testing.CapturingLogger(),
        engine_versions={"http://a": 7},
    )
    stage = Generator(config, ctx)
    stage.versions = {"http://a": 3}
    stage._take_announced_versions()
    assert stage.versions == {"http://a": 7}
    # restarted: the generator resets what it knows (as _announce_engines does)
    stage.versions["http://a"] = 0
    stage._announced_before_restart["http://a"] = stage._announced("http://a")
    stage._take_announced_versions()
    assert stage.versions == {"http://a": 0}
    ctx.engine_versions["http://a"] = 8  # caught up by the publisher
    stage._take_announced_versions()
    assert stage.versions == {"http://a": 8}


class _Credit:
    def __init__(self, credit: int) -> None:
        self.value = credit

    def credit(self) -> int:
        return self.value


class _Waiting:
    """An inbox of prompts that are all there already (``waiting``/``take``)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def waiting(self) -> int:
        return self.left

    def take(self) -> Any:
        self.left -= 1
        return SimpleNamespace(data={"prompt_id": f"p{self.left}"})


def _gated_stage(tmp_path: Path, state: dict[str, Any]) -> Generator:
    """A generator whose gates see ``state`` (no engine behind it: only its decisions run)."""
    url = "http://a"
    config = GeneratorConfig(
        engines=[url],
        group_size=state["size"],
        max_lag=1,
        outbox=4,
        controller=ControllerConfig(start=state["target"], max_in_flight=256),
    )
    ctx = SimpleNamespace(
        stage="generator",
        replica=0,
        run_dir=tmp_path / "run",
        mode="async",
        version=state["version"],
        log=structlog.testing.CapturingLogger(),
        engine_versions={},
        learner_pace=state["pace"],
        inputs={"prompts": _Waiting(state["waiting"])},
        outputs={"rollouts": _Credit(state["credit"])},
    )
    stage = Generator(config, ctx)
    from stages.generator.controller import InFlightController

    stage.controller = InFlightController([url], config.controller)
    stage.in_flight, stage.versions, stage.down = {url: state["in_flight"]}, {url: 3}, {}
    stage._unacked = state["unacked"]
    stage.outbox = asyncio.Queue(config.outbox)
    for _ in range(state["queued"]):
        stage.outbox.put_nowait(None)
    return stage


@pytest.mark.parametrize("seed", range(60))
def test_the_groups_a_request_takes_are_those_the_gates_let_start_one_by_one(tmp_path, seed):
    """``_more_groups`` looks at the gates once for all the prompts waiting (one engine): it
    takes as many as calling ``_open`` again after each one held would let start, whichever
    gate (credit, queue, lag, the engine's target) or the prompts waiting bound them."""
    import random

    rng = random.Random(seed)
    size = rng.choice([1, 2, 4])
    state = {
        "size": size,
        "target": rng.choice([size, 16, 40, 256]),
        "in_flight": rng.choice([0, 4, 12]),
        "unacked": rng.choice([0, 8, 40]),
        "credit": rng.choice([0, 2, 6, 64]),
        "queued": rng.randint(0, 4),
        "waiting": rng.choice([1, 6, 30]),
        "version": rng.choice([3, 3, 3, 5]),
        "pace": rng.choice(
            [{}]
            + [
                {"version": 3, "max_lag": 1, "every": 1, "batch": batch, "origins": 1}
                for batch in (16, 32, 48)
            ]
        ),
    }
    batched = _gated_stage(tmp_path, state)
    got = batched._more_groups([("first", "g")], "http://a", size)
    one_by_one = _gated_stage(tmp_path, state)  # the gates looked at after each group held
    one_by_one._hold("http://a", size)
    prompts, want = one_by_one.ctx.inputs["prompts"], 1
    while want < 16 and prompts.waiting() > 0 and one_by_one._open(size)[0] == "http://a":
        prompts.take()
        one_by_one._hold("http://a", size)
        want += 1
    assert len(got) == want, state
    assert batched.in_flight["http://a"] == one_by_one.in_flight["http://a"]
    assert batched._unacked == one_by_one._unacked


_OPEN = {
    "size": 4,
    "target": 256,
    "in_flight": 0,
    "unacked": 0,
    "credit": 64,
    "queued": 0,
    "waiting": 30,
    "version": 3,
    "pace": {},
}


@pytest.mark.parametrize(
    ("change", "groups"),
    [
        ({}, 16),  # no more than a request takes
        ({"waiting": 3}, 4),  # the prompts waiting
        ({"credit": 2}, 6),  # credit 2 + 4 free outbox slots: 6 groups downstream
        ({"target": 16, "in_flight": 4}, 3),  # the engine's target: 4 + 3 x 4 samples
        ({"unacked": 8, "pace": {"version": 3, "max_lag": 1, "every": 1, "batch": 16}}, 6),
        ({"version": 5}, 1),  # the lag gate: nothing more
    ],
)
def test_each_gate_bounds_the_groups_of_one_request(tmp_path, change, groups):
    """The queue gate: 2 batches of 16 samples, 8 + 4 taken: (32 - 12) / 4 = 5 groups more."""
    # (the first group's slot was granted before: 1 + what the gates let start)
    state = {**_OPEN, **change}
    if state["pace"]:
        state["pace"] = {"origins": 1, **state["pace"]}
    stage = _gated_stage(tmp_path, state)
    assert len(stage._more_groups([("first", "g")], "http://a", state["size"])) == groups


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("batch", [16, 24, 48])
def test_the_generators_shares_of_the_budget_fill_the_learners_batch(tmp_path, size, batch):
    """With one batch to go before the lag gate (the learner a version ahead of the engines),
    the generators feeding the learner may together hold at least its batch, however many
    they are: else each holds its share, the learner waits for the rest, and nothing moves."""
    for origins in range(1, 6):
        pace = {"version": 4, "max_lag": 1, "every": 1, "batch": batch, "origins": origins}
        stage = _gated_stage(tmp_path, {**_OPEN, "size": size, "waiting": 1_000, "pace": pace})
        while stage._open(size)[0] is not None:
            stage._hold("http://a", size)
        assert origins * stage._unacked >= batch, (origins, stage._unacked)
        # and not much more: a share rounded up to whole groups
        assert stage._unacked < -(-batch // origins) + size, (origins, stage._unacked)


class _FullScorers:
    """A rollouts port whose scorers take ``rollout_batch`` and have no room until the test
    frees some (``wait_for_room``, as ``transport.Sender`` has it)."""

    def __init__(self) -> None:
        self.space = 0
        self.asked, self.freed = asyncio.Event(), asyncio.Event()
        self.batches: list[list[str]] = []

    def sends(self, kind: str) -> bool:
        return kind == "rollout_batch"

    def room(self) -> int:
        return self.space

    def credit(self) -> int:
        return self.space

    async def wait_for_room(self) -> int:
        self.asked.set()
        await self.freed.wait()
        return self.space

    async def send(self, kind: str, data: dict[str, Any]) -> None:
        assert kind == "rollout_batch"
        self.batches.append(list(data["group_id"]))

    async def send_many(self, kind: str, items: list[dict[str, Any]]) -> list[None]:
        raise AssertionError("single-turn groups go as one rollout_batch")


@pytest.mark.timeout(30)
async def test_groups_that_finish_while_the_scorers_have_no_room_go_in_one_batch(tmp_path):
    """With no room at the scorers, the generator waits for some before it cuts a batch: the
    groups that finished meanwhile go together, not the first alone and the rest behind it."""
    from tests.stages.test_rollout_batch import _finished, _group

    stage = _gated_stage(tmp_path, _OPEN)
    scorers = stage.ctx.outputs["rollouts"] = _FullScorers()
    acked: list[str] = []
    stage.ctx.inputs["prompts"] = SimpleNamespace(ack=lambda msg: acked.append(msg.data))
    emitting = asyncio.ensure_future(stage._emit())
    try:
        names = "abc"
        for name in names:
            group = _finished(_group(name, [0, 1, 2, 3]))
            await stage.outbox.put((group, SimpleNamespace(data=name)))
            await asyncio.wait_for(scorers.asked.wait(), 5)  # the first: it waits for room
        assert scorers.batches == [] and stage.outbox.qsize() == 2
        scorers.space = 3
        scorers.freed.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if scorers.batches:
                break
        assert scorers.batches == [["a/1", "b/1", "c/1"]]
        assert acked == list(names)  # not chained: each prompt acknowledged once sent
    finally:
        emitting.cancel()
        await asyncio.gather(emitting, return_exceptions=True)


@pytest.mark.timeout(30)
async def test_a_shut_queue_gate_opens_as_soon_as_the_learner_is_done_with_samples(
    tmp_path, monkeypatch
):
    """``_slot`` waits for what opens a gate, not for a timer: the acknowledgement that
    frees the queue gate's room wakes it (the timer is only a safety net)."""
    import stages.generator.stage as generator_stage

    monkeypatch.setattr(generator_stage, "_LOOK_AGAIN_S", 30.0)
    pace = {"version": 3, "max_lag": 1, "every": 1, "batch": 16, "origins": 1}
    stage = _gated_stage(tmp_path, {**_OPEN, "unacked": 32, "in_flight": 4, "pace": pace})
    stage.ctx.inputs["prompts"] = SimpleNamespace(ack=lambda msg: None)
    slot = asyncio.ensure_future(stage._slot(4))
    await asyncio.sleep(0.1)
    assert not slot.done()  # the queue gate is shut: 2 batches of 16 held
    stage._prompts_done([(SimpleNamespace(data="p"), 4)])  # a group's prompt is done with
    assert await asyncio.wait_for(slot, 1) == "http://a"
