"""The ledger's book: every fed prompt ends complete, held (in flight), or unaccounted."""

from __future__ import annotations

from pipeline.ledger import LedgerBook, LedgerReporter


def book_and_reporter() -> tuple[LedgerBook, LedgerReporter]:
    book = LedgerBook()

    def publish(payload: dict) -> None:
        assert book.take({"stage": "s", "replica": 0, **payload}) is None

    return book, LedgerReporter(publish)


def final(book: LedgerBook, session: str, held: list[str]) -> None:
    report = {"stage": "s", "replica": 0, "session": session, "final": True}
    assert book.take({**report, "held": held, "counters": {"redelivered": 2}}) is None


def test_a_run_without_losses_balances():
    book, ledger = book_and_reporter()
    for i in range(3):
        ledger.fed(f"f.0:{i}")
    ledger.fates([("f.0:0", 4, 0), ("f.0:0", 4, 1)], "engine_failure")
    ledger.fates([("f.0:0", 4, 2), ("f.0:1", 4, 0)], "trained", step=1)
    ledger.fates([("f.0:0", 4, 3)], "no_signal", step=1)  # in the step, without passes
    ledger.fates([("f.0:1", 4, i) for i in (1, 2)], "stale")
    # at the end f.0:1 (one slot open) and f.0:2 (no fate yet) are held by a live replica
    final(book, "a", ["f.0:1", "f.0:2"])
    out = book.balance(["a"])
    assert out["unaccounted"] == 0 and "unaccounted_detail" not in out
    assert out["prompts_fed"] == 3 and out["prompts_complete"] == 1
    assert out["prompts_in_flight_at_end"] == 1
    assert out["samples"] == {
        "trained": 2,
        "no_signal": 1,  # not a drop
        "dropped": {"engine_failure": 2, "stale": 2},
        "in_flight_at_end": 1,
    }
    assert out["transport"] == {"redelivered": 2}


def test_a_prompt_nobody_holds_or_finished_is_unaccounted_and_named():
    book, ledger = book_and_reporter()
    ledger.fed("f.0:0")
    ledger.fed("f.0:1")
    ledger.fates([("f.0:0", 2, 0)], "trained", step=1)  # slot 1 went missing
    ledger.fates([("f.0:9", 2, 0)], "trained", step=1)  # never fed
    final(book, "a", [])
    out = book.balance(["a"])
    assert out["unaccounted"] == 3
    detail = out["unaccounted_detail"]
    assert detail["samples_without_a_fate"] == 1
    assert detail["prompts_without_any_fate"] == 1
    assert detail["prompts_never_fed_with_fates"] == 1
    assert set(detail["examples"]) == {"f.0:0", "f.0:1", "f.0:9"}


def test_only_the_held_of_sessions_that_ended_cleanly_counts():
    book, ledger = book_and_reporter()
    ledger.fed("f.0:0")
    final(book, "killed", ["f.0:0"])
    assert book.balance(["live"])["unaccounted"] == 1
    assert book.balance(["killed"])["unaccounted"] == 0


def test_a_second_fate_is_a_duplicate_and_copies_are_counted_apart():
    book, ledger = book_and_reporter()
    ledger.fed("f.0:0")
    ledger.fed("f.0:0")  # fed again after a feeder restart
    ledger.fates([("f.0:0", 1, 0)], "trained", step=1)
    ledger.fates([("f.0:0", 1, 0)], "trained", step=2)  # a copy trained by another rank
    ledger.copies("f.0:0", 1, [0])
    out = book.balance([])
    assert out["unaccounted"] == 0 and out["samples"]["trained"] == 1
    assert out["prompts_refed"] == 1 and out["duplicate_fates"] == {"trained": 1}
    assert out["copies_dropped"] == 1


def test_a_learner_rollback_moves_unsaved_steps_out_of_trained_until_trained_again():
    book, ledger = book_and_reporter()
    for i in range(4):
        ledger.fed(f"f.0:{i}")
    for step in (1, 2, 3, 4):
        ledger.fates([(f"f.0:{step - 1}", 1, 0)], "trained", step=step)
        if step == 2:
            ledger.checkpoint(2)
    ledger.rollback(2)  # the learner resumed from step 2: steps 3 and 4 are gone
    out = book.balance([])
    assert out["samples"]["trained"] == 2
    assert out["samples"]["dropped"] == {"rolled_back": 2}
    assert out["unaccounted"] == 0
    ledger.fates([("f.0:3", 1, 0)], "trained", step=3)  # it came again and trained again
    out = book.balance([])
    assert out["samples"]["trained"] == 3 and out["samples"]["dropped"] == {"rolled_back": 1}
    assert out["duplicate_fates"] == {}


def test_malformed_reports_are_refused_with_a_reason():
    book = LedgerBook()
    assert book.take({"fed": [3]}) is not None
    assert book.take({"fates": [["u", 1, 0]], "reason": ""}) is not None
    assert book.take({"fates": [["u"]], "reason": "x"}) is not None
    assert book.take({"what": 1}) == "no known entry"
    book.take({"fed": ["u"]})
    assert "outside" in book.take({"fates": [["u", 2, 5]], "reason": "trained"})


def test_reports_of_different_replicas_may_come_in_any_order():
    book, ledger = book_and_reporter()
    ledger.consumed("f.0:0")  # the consumer's report came before the feeder's
    ledger.fates([("f.0:1", 1, 0)], "trained", step=1)
    assert book.balance([])["unaccounted"] == 2
    ledger.fed("f.0:0")
    ledger.fed("f.0:1")
    out = book.balance([])
    assert out["unaccounted"] == 0 and out["prompts_fed"] == 2 and out["prompts_refed"] == 0
    assert out["samples"]["dropped"] == {"consumed_by_s": 1}


def test_a_copy_of_work_finished_before_a_resume_ends_its_slots_until_the_original_comes():
    book, ledger = book_and_reporter()
    ledger.fed("f.0:0")  # fed again after a resume: its original was trained before it
    ledger.copies("f.0:0", 2, [0, 1])
    out = book.balance([])
    assert out["unaccounted"] == 0 and out["samples"]["dropped"] == {"done_before": 2}
    ledger.fed("f.0:1")
    ledger.copies("f.0:1", 2, [0, 1])  # the copy came first; the original trains after it
    ledger.fates([("f.0:1", 2, 0), ("f.0:1", 2, 1)], "trained", step=3)
    out = book.balance([])
    assert out["samples"]["trained"] == 2 and out["samples"]["dropped"] == {"done_before": 2}
    assert out["copies_dropped"] == 4 and out["duplicate_fates"] == {}


def test_a_feeder_that_did_not_end_cleanly_holds_what_its_state_file_says(tmp_path):
    """``Feeder.held_after_exit``: positions next..reserved not acknowledged, as uids."""
    import json

    from stages.feeder.stage import Feeder

    assert Feeder.held_after_exit(tmp_path, "feed", 1) is None  # no state file: nothing known
    (tmp_path / "state").mkdir()
    state = {"for": {}, "next": 3, "acked_above": [5], "reserved": 7}
    (tmp_path / "state" / "feed.1.json").write_text(json.dumps(state))
    held = Feeder.held_after_exit(tmp_path, "feed", 1)
    assert held == ["feed.1:3", "feed.1:4", "feed.1:6"]
    book, ledger = book_and_reporter()
    for p in range(7):
        ledger.fed(f"feed.1:{p}")
    ledger.fates([(f"feed.1:{p}", 1, 0) for p in (0, 1, 2, 5)], "trained", step=1)
    assert book.balance([])["unaccounted"] == 3
    out = book.balance([book.custody_after_exit("feeder.1", held)])
    assert out["unaccounted"] == 0 and out["prompts_in_flight_at_end"] == 3


def test_fed_reports_a_killed_feeder_never_sent_are_recovered_from_what_others_saw():
    """A feeder SIGKILLed between its send and its ``fed`` report: the prompts it sent are
    trained or held downstream all the same. Uids of that feeder (and only of a replica a
    process of which died) count as fed; the rest of its state file's positions (never sent) do
    not."""
    book, ledger = book_and_reporter()
    ledger.fed("feed.0:0")  # the only report that got out
    ledger.fates([("feed.0:0", 1, 0), ("feed.0:1", 1, 0)], "trained", step=1)
    final(book, "gen", ["feed.0:2", "feed.0:3"])  # the generator's inbox at the end
    after_exit = book.custody_after_exit("feed.0", [f"feed.0:{p}" for p in range(2, 40)])
    strict = book.balance(["gen", after_exit])  # as if the feeder had ended cleanly
    assert strict["unaccounted"] == 1 and strict["prompts_fed"] == 1, strict
    out = book.balance(["gen", after_exit], died=["feed.0"])
    assert out["unaccounted"] == 0, out
    assert out["prompts_fed"] == 4 and out["fed_reports_lost"] == 3, out
    assert out["prompts_complete"] == 2 and out["prompts_in_flight_at_end"] == 2, out
    # another replica's death excuses nothing of this feeder's
    other = book.balance(["gen", after_exit], died=["scorer.0"])
    assert other["unaccounted"] == 1 and "fed_reports_lost" not in other, other


def test_prompts_fed_in_one_loop_turn_go_as_one_report_before_any_other():
    import asyncio

    sent: list[dict] = []
    ledger = LedgerReporter(sent.append)

    async def feed() -> None:
        for i in range(3):
            ledger.fed(f"f.0:{i}")
        assert sent == []  # not yet: the turn is not over
        await asyncio.sleep(0)
        assert sent == [{"fed": ["f.0:0", "f.0:1", "f.0:2"]}]
        ledger.fed("f.0:3")
        ledger.fates([("f.0:3", 2, 0)], "trained", step=1)  # a later report: fed goes first
        assert sent[1:] == [
            {"fed": ["f.0:3"]},
            {"fates": [["f.0:3", 2, 0]], "reason": "trained", "step": 1},
        ]
        for i in range(LedgerReporter._FED_MAX):  # a long turn: bounded messages
            ledger.fed(f"g.0:{i}")
        assert len(sent) == 4 and len(sent[3]["fed"]) == LedgerReporter._FED_MAX
        ledger.fed("g.0:x")
        await asyncio.sleep(0)
        assert sent[4] == {"fed": ["g.0:x"]}

    asyncio.run(asyncio.wait_for(feed(), timeout=10))
    ledger.fed("h.0:0")  # outside an event loop: at once
    assert sent[-1] == {"fed": ["h.0:0"]}


def test_a_message_of_fates_is_taken_as_its_rows_one_at_a_time():
    """``take`` applies a message's rows without a call each where it can; the book comes out
    exactly as one ``_fate`` per row leaves it, whatever the rows (duplicates, unfed uids,
    rollbacks and copies between them, a bad row part-way)."""
    import random

    rng = random.Random(7)
    uids = [f"f.0:{i}" for i in range(30)]
    fast, slow = LedgerBook(), LedgerBook()
    for turn in range(400):
        kind = rng.random()
        if kind < 0.2:
            payload = {"fed": rng.sample(uids, 3)}
        elif kind < 0.25:
            payload = {"rollback": rng.randrange(0, 12)}
        elif kind < 0.3:
            payload = {"checkpoint": rng.randrange(0, 12)}
        elif kind < 0.35:
            payload = {"copies": [rng.randrange(4)], "uid": rng.choice(uids), "size": 4}
        else:
            rows = [[rng.choice(uids), 4, rng.randrange(4)] for _ in range(rng.randint(1, 9))]
            if rng.random() < 0.05:  # a bad row part-way: what came before it stays taken
                rows.insert(rng.randrange(len(rows)), [rng.choice(uids), 4, 9])
            reason = rng.choice(["trained", "no_signal", "stale"])
            payload = {"fates": rows, "reason": reason, "step": rng.choice([None, turn // 30])}
        problem = fast.take(payload)
        if "fates" in payload:  # the reference: one fate at a time
            try:
                for uid, size, index in payload["fates"]:
                    slow._fate(uid, size, index, payload["reason"], payload["step"])
                expected = None
            except ValueError as exc:
                expected = f"malformed: {exc!r}"[:200]
            assert problem == expected
        else:
            assert slow.take(payload) is None and problem is None
        assert fast.slots == slow.slots and fast.buckets == slow.buckets
        assert fast.by_step == slow.by_step and fast.duplicates == slow.duplicates
        assert fast.unfed == slow.unfed
    assert sum(fast.buckets.values()) > 100  # it did take fates
