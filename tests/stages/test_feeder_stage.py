"""The feeder stage: seeded order per epoch, disjoint shards per replica, ``max_prompts``, and a
real pipeline run (two feeder replicas into a sink that records what arrives, from whom)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog.testing

from pipeline.ledger import LedgerReporter
from stages.feeder.arithmetic import ArithmeticConfig, make_tokenizer
from stages.feeder.sources import SourceConfig, SourceError, load_prompts
from stages.feeder.stage import Feeder, FeederConfig, feed_order
from tests.pipeline.runs import events, run_inflight

GOOD = 22  # good rows in the test file
BAD = {"invalid_json": 1, "missing_answer": 1, "empty_prompt": 1}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("feeder")
    make_tokenizer().save_pretrained(root / "tok")
    rows = [json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i}) for i in range(GOOD)]
    rows[3:3] = ["{oops", json.dumps({"prompt": "1="}), json.dumps({"prompt": "", "answer": 0})]
    path = root / "sums.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return SimpleNamespace(path=str(path), tok=str(root / "tok"))


def source(data: SimpleNamespace) -> SourceConfig:
    return SourceConfig(kind="jsonl", path=data.path, tokenizer=data.tok)


class FakeOutput:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    async def send(self, kind: str, payload: dict) -> int:
        self.sent.append((kind, payload))
        return len(self.sent)  # its seq


def fake_ctx(replica: int = 0, replicas: int = 1, run_seed: int = 1234) -> SimpleNamespace:
    log = structlog.testing.CapturingLogger()
    metrics: list[dict] = []
    reports: list[dict] = []
    return SimpleNamespace(
        stage="feeder",
        replica=replica,
        replicas=replicas,
        seed=run_seed + replica,  # the run seed: must not change the order
        log=log,
        outputs={"prompts": FakeOutput()},
        metrics=lambda **values: metrics.append(values),
        metric_calls=metrics,
        ledger_reports=reports,
        ledger=LedgerReporter(reports.append),
    )


async def feed(
    config: FeederConfig, replica: int = 0, replicas: int = 1, run_seed: int = 1234
) -> SimpleNamespace:
    ctx = fake_ctx(replica, replicas, run_seed)
    stage = Feeder(config, ctx)
    await stage.setup()
    await stage.run()
    await stage.close()
    ctx.ids = [payload["prompt_id"] for _, payload in ctx.outputs["prompts"].sent]
    ctx.events = lambda name: [c.kwargs for c in ctx.log.calls if c.args[0] == name]
    return ctx


def test_feed_order_is_a_seeded_permutation_of_a_disjoint_shard():
    shards = [feed_order(50, 0, seed=3, shuffle=True, replica=r, replicas=3) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(50))
    assert all(i % 3 == r for r, s in enumerate(shards) for i in s)
    again = feed_order(50, 0, seed=3, shuffle=True, replica=1, replicas=3)
    assert again == shards[1]
    assert feed_order(50, 1, seed=3, shuffle=True, replica=1, replicas=3) != shards[1]
    assert feed_order(50, 0, seed=4, shuffle=True, replica=1, replicas=3) != shards[1]
    assert feed_order(50, 7, seed=3, shuffle=False, replica=1, replicas=3) == list(range(1, 50, 3))


async def test_epochs_send_every_prompt_once_each_in_a_new_order(data):
    config = FeederConfig(source=source(data), epochs=3, seed=9)
    ctx = await feed(config)
    epochs = [ctx.ids[i * GOOD : (i + 1) * GOOD] for i in range(3)]
    assert len(ctx.ids) == 3 * GOOD
    assert all(sorted(e) == sorted(epochs[0]) and len(set(e)) == GOOD for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert [e["epoch"] for e in ctx.events("epoch_done")] == [0, 1, 2]
    assert ctx.events("feeder_done")[0] == {"reason": "epochs", "sent": 3 * GOOD, "epochs_done": 3}
    assert ctx.metric_calls[-1] == {
        "sent": 3 * GOOD,
        "epoch": 3,
        "bad": 3,
        "prompts": GOOD,
        "processed_below": 0,  # nothing acknowledges here (no channel)
    }
    assert all(kind == "prompt" for kind, _ in ctx.outputs["prompts"].sent)
    # the same options give the same order, whatever the run seed
    assert (await feed(config, run_seed=99)).ids == ctx.ids
    unshuffled = await feed(FeederConfig(source=source(data), epochs=2, shuffle=False))
    loaded = load_prompts(source(data), "train")
    assert unshuffled.ids == [p["prompt_id"] for p in loaded.prompts] * 2


async def test_max_prompts_is_split_between_replicas_and_ends_endless_epochs(data):
    config = FeederConfig(source=source(data), epochs=0, max_prompts=51)
    replicas = [await feed(config, r, 2) for r in range(2)]
    assert [len(r.ids) for r in replicas] == [26, 25]
    for r in replicas:
        assert r.events("feeder_done")[0]["reason"] == "max_prompts"
        shard = len(set(r.ids))
        assert shard == GOOD // 2 and Counter(r.ids).most_common(1)[0][1] == 3  # 3rd epoch begun
    assert not set(replicas[0].ids) & set(replicas[1].ids)
    # a cap at an epoch boundary ends there, after that epoch's epoch_done
    exact = await feed(FeederConfig(source=source(data), epochs=0, max_prompts=GOOD))
    assert len(exact.ids) == GOOD and len(exact.events("epoch_done")) == 1


async def test_more_replicas_than_prompts_leaves_some_with_nothing(tmp_path, data):
    path = tmp_path / "two.jsonl"
    path.write_text('{"prompt": "1=", "answer": 1}\n{"prompt": "2=", "answer": 2}\n')
    config = FeederConfig(source=SourceConfig(kind="jsonl", path=str(path), tokenizer=data.tok))
    ctx = await feed(config, replica=2, replicas=3)
    assert ctx.ids == [] and ctx.events("feeder_empty_shard")


async def test_an_unusable_source_fails_setup(tmp_path, data):
    missing = SourceConfig(kind="jsonl", path=str(tmp_path / "none.jsonl"), tokenizer=data.tok)
    with pytest.raises(SourceError, match=r"none\.jsonl: not found"):
        await Feeder(FeederConfig(source=missing), fake_ctx()).setup()


async def test_a_lazy_source_skips_and_counts_what_turns_out_unusable_when_fed(tmp_path):
    tok = make_tokenizer()
    tok.chat_template = "{{ messages[0]['content'] }}{% if add_generation_prompt %}={% endif %}"
    tok.save_pretrained(tmp_path / "chat")
    arith = ArithmeticConfig(ops="+", max_operand=12, eval_fraction=0.0)
    options = dict(arithmetic=arith, tokenizer=str(tmp_path / "chat"), chat_template=True)
    everything = load_prompts(SourceConfig(**options), "train").prompts
    limit = max(len(p["input_ids"]) for p in everything) - 1  # the longest ones are refused
    usable = {p["prompt_id"] for p in everything if len(p["input_ids"]) <= limit}
    assert 0 < len(usable) < len(everything)
    config = FeederConfig(source=SourceConfig(**options, max_prompt_tokens=limit), epochs=2)
    ctx = fake_ctx()
    stage = Feeder(config, ctx)
    await stage.setup()
    assert type(stage.prompts).__name__ == "LazyPrompts"  # nothing rendered up front
    await stage.run()
    sent = [payload["prompt_id"] for _, payload in ctx.outputs["prompts"].sent]
    assert Counter(sent) == dict.fromkeys(usable, 2)
    assert ctx.metric_calls[-1]["bad"] == 2 * (len(everything) - len(usable))
    # a skipped prompt is done with (never held for the ledger); the sent ones are not acked
    assert len(stage.acked_above) == 2 * (len(everything) - len(usable))
    assert {stage._uid(p) for p in stage.acked_above}.isdisjoint(stage.held_uids())
    # a whole pass of unusable prompts ends the feed instead of spinning
    stage = Feeder(config, fake_ctx())
    await stage.setup()
    stage.prompts = [None] * len(stage.prompts)
    assert await stage._feed() == "no_usable_prompts"


# ------------------------------------------------------------------------------ real pipeline
def _run_config(tmp_path: Path, data: SimpleNamespace) -> Path:
    path = tmp_path / "feed.yaml"
    source = f'{{kind: jsonl, path: "{data.path}", tokenizer: "{data.tok}"}}'
    path.write_text(
        f"""
run: {{name: feed, metrics_every_s: 0.5}}
stages:
  feeder:
    use: "stages.feeder.stage:Feeder"
    replicas: 2
    restart: {{policy: never}}
    source: {source}
    epochs: 2
    seed: 5
  sink:
    use: "tests.stages_for_tests:PromptSink"
    inputs: {{prompts: feeder.prompts}}
"""
    )
    return path


@pytest.mark.timeout(120)
def test_feeders_in_a_pipeline(tmp_path, data):
    run_dir = tmp_path / "run"
    result = run_inflight(
        "run", str(_run_config(tmp_path, data)), "--run-dir", str(run_dir), timeout=110
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    seen = json.loads((run_dir / "prompts_seen.json").read_text())
    by_sender: dict[str, list[str]] = {}
    for entry in seen:
        by_sender.setdefault(entry["sender"], []).append(entry["prompt_id"])
    assert set(by_sender) == {"feeder.0", "feeder.1"}

    every = [p["prompt_id"] for p in load_prompts(source(data), "train").prompts]
    assert len(every) == GOOD
    shards = []
    for replica in (0, 1):
        got = by_sender[f"feeder.{replica}"]
        half = len(got) // 2
        first, second = got[:half], got[half:]
        # every prompt of the shard once per epoch, in a different order each epoch...
        assert len(got) == 2 * half and sorted(first) == sorted(second)
        assert len(set(first)) == half and first != second
        # ...and exactly the seeded order, whichever process computes it
        expected = [
            every[i]
            for epoch in (0, 1)
            for i in feed_order(GOOD, epoch, seed=5, shuffle=True, replica=replica, replicas=2)
        ]
        assert got == expected
        shards.append(set(first))
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(every)

    prompt = next(e for e in seen if e["prompt_id"] == every[0])
    assert prompt["input_ids"] == make_tokenizer()("0+0=")["input_ids"]
    assert prompt["meta"] == {"task": "sums", "text": "0+0=", "answer": "0"}

    for name in ("feeder.0", "feeder.1"):
        log = events(run_dir, name)
        loaded = [e for e in log if e["event"] == "prompts_loaded"]
        assert loaded and loaded[0]["bad"] == BAD and loaded[0]["prompts"] == GOOD
        bad_rows = sorted((e["row"], e["reason"]) for e in log if e["event"] == "bad_row")
        assert bad_rows == [(4, "invalid_json"), (5, "missing_answer"), (6, "empty_prompt")]
        assert all(e["file"] == data.path for e in log if e["event"] == "bad_row")
    feeder0 = events(run_dir, "feeder.0")
    assert [e["epoch"] for e in feeder0 if e["event"] == "epoch_done"] == [0, 1]
    sent = [e["sent"] for e in feeder0 if e["event"] == "metrics" and "sent" in e]
    assert sent and sent[-1] == 2 * len(shards[0])


@pytest.mark.timeout(120)
def test_a_killed_feeder_continues_where_it_was_and_feeds_again_only_the_unprocessed(
    tmp_path, data
):
    import os
    import signal

    from tests.pipeline.runs import kill_tree, spawned_pids, start_inflight, wait_for

    count, inbox = 200, 8
    path = tmp_path / "feed-kill.yaml"
    path.write_text(
        f"""
run: {{name: feedkill, metrics_every_s: 0.5}}
transport: {{inbox: {inbox}}}
stages:
  feeder:
    use: "stages.feeder.stage:Feeder"
    restart: {{policy: on-failure, backoff_s: 0.1}}
    source: {{kind: arithmetic, tokenizer: "{data.tok}"}}
    epochs: 1
    max_prompts: {count}
    seed: 3
  sink:
    use: "tests.stages_for_tests:PromptSink"
    inputs: {{prompts: feeder.prompts}}
    delay_s: 0.02
"""
    )
    run_dir = tmp_path / "run"
    state = run_dir / "state" / "feeder.0.json"
    proc = start_inflight("run", str(path), "--run-dir", str(run_dir))
    try:
        wait_for(
            lambda: state.exists() and json.loads(state.read_text())["next"] >= 60,
            60,
            "the feeder to have 60 prompts processed",
        )
        spawned = [e for e in events(run_dir, "supervisor") if e["event"] == "replica_spawned"]
        os.kill(next(e["pid"] for e in spawned if e["replica_name"] == "feeder.0"), signal.SIGKILL)
        output, _ = proc.communicate(timeout=90)
    finally:
        kill_tree(proc, spawned_pids(run_dir) if run_dir.exists() else ())
    assert proc.returncode == 0, output[-3000:]
    (resumed,) = [e for e in events(run_dir, "feeder.0") if e["event"] == "feeder_resumed"]
    assert resumed["next"] >= 60
    seen = Counter(e["prompt_id"] for e in json.loads((run_dir / "prompts_seen.json").read_text()))
    expected = [p["prompt_id"] for p in load_prompts(
        SourceConfig(kind="arithmetic", tokenizer=data.tok), "train").prompts]  # fmt: skip
    order = feed_order(len(expected), 0, seed=3, shuffle=True)[:count]
    assert set(seen) == {expected[i] for i in order}  # every prompt, none from elsewhere
    # fed again: only what was sent and not yet acknowledged when the feeder died (what sat in
    # the sink's inbox, or in its hand); a feeder that started over would repeat >= 60
    again = sum(n - 1 for n in seen.values())
    assert again <= inbox + 2, seen.most_common(5)
    done = json.loads(state.read_text())
    assert done["next"] == count and done["acked_above"] == []
