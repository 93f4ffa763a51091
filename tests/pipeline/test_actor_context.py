"""ActorContext: what a replica learns from the control bus (versions, engine announcements)."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.actor import ActorContext

_SPEC = {"stage": "learner", "replica": 0, "replicas": 1, "run_dir": ".", "seed": 0, "restarts": 0}


@pytest.mark.timeout(10)
def test_waiting_on_the_live_engines_dict_wakes_on_a_new_announcement():
    async def main():
        ctx = ActorContext(_SPEC, log=None, control=None)
        # callers pass ctx.engines itself: the wait must compare against a copy of it
        waiter = asyncio.create_task(ctx.wait_for_engines(ctx.engines))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        announcement = {"stage": "generator", "replica": 0, "urls": ["http://x"], "epoch": 0}
        await ctx.set_engines(announcement)
        seen = await asyncio.wait_for(waiter, 2)
        assert seen == {"generator.0": announcement}
        # the same announcement again is no change; a new epoch is
        again = asyncio.create_task(ctx.wait_for_engines(ctx.engines))
        await ctx.set_engines(dict(announcement))
        await asyncio.sleep(0.05)
        assert not again.done()
        await ctx.set_engines({**announcement, "epoch": 1})
        assert (await asyncio.wait_for(again, 2))["generator.0"]["epoch"] == 1

    asyncio.run(main())


def test_the_learners_pace_report_is_kept_when_well_formed_and_not_older():
    ctx = ActorContext(_SPEC, log=None, control=None)
    pace = {"batch": 32, "every": 1, "max_lag": 2, "origins": 1, "version": 5}
    ctx.set_pace({"rank": 0, **pace})
    assert ctx.learner_pace == {**pace, "hungry": False}
    ctx.set_pace({"rank": 0, **pace, "hungry": True})  # it waits for samples now
    assert ctx.learner_pace["hungry"] is True
    ctx.set_pace({"rank": 1, **{**pace, "version": 4}})  # a rank one step behind
    assert ctx.learner_pace["version"] == 5
    ctx.set_pace({"rank": 0, **{**pace, "version": 6, "origins": 2}})
    assert ctx.learner_pace["version"] == 6 and ctx.learner_pace["origins"] == 2
    for bad in ({**pace, "batch": "32", "version": 7}, {**pace, "every": None, "version": 7}):
        ctx.set_pace(bad)  # garbage changes nothing
    assert ctx.learner_pace["version"] == 6 and ctx.learner_pace["batch"] == 32


def test_a_learner_that_restarted_from_an_older_checkpoint_is_heard_from_there():
    # trained to version 8, killed, resumed from the checkpoint of version 6: its reports are
    # older than what was heard, and must count (kept back, the generators' queue gate stayed
    # shut on the old pace while the learner waited for samples)
    ctx = ActorContext(_SPEC, log=None, control=None)
    pace = {"batch": 16, "every": 1, "max_lag": 2, "origins": 1}
    ctx.set_pace({"rank": 0, "session": "a", **pace, "version": 8})
    ctx.set_pace({"rank": 0, "session": "a", **pace, "version": 6})  # a late one: kept back
    assert ctx.learner_pace["version"] == 8
    ctx.set_pace({"rank": 0, "session": "b", **pace, "version": 6, "hungry": True})
    assert ctx.learner_pace["version"] == 6 and ctx.learner_pace["hungry"] is True
    assert ctx.pace_heard[0] == 6
    ctx.set_pace({"rank": 0, "session": "b", **pace, "version": 7})
    assert ctx.learner_pace["version"] == 7 and ctx.pace_heard[0] == 7


def test_a_version_announcement_records_which_engines_loaded_it():
    async def main():
        ctx = ActorContext(_SPEC, log=None, control=None)
        await ctx.set_version(3, ["http://a", "http://b"])
        await ctx.set_version(2, ["http://a"])  # an older announcement, late: no step back
        await ctx.set_version(4, ["http://b", 7, None])  # garbage entries are skipped
        await ctx.set_version(5, "http://a")  # not a list: only the version counts
        assert ctx.version == 5
        assert ctx.engine_versions == {"http://a": 3, "http://b": 4}

    asyncio.run(main())


def test_a_stage_hears_of_each_version_announcement_and_pace_report_taken_in():
    """``on_control``: called after each announcement and each pace report kept (what a
    generator's gates read), not for a malformed or older report."""

    async def main():
        ctx = ActorContext(_SPEC, log=None, control=None)
        heard: list[tuple[int, dict]] = []
        ctx.on_control(lambda: heard.append((ctx.version, dict(ctx.learner_pace))))
        await ctx.set_version(3, ["http://a"])
        pace = {"batch": 32, "every": 1, "max_lag": 1, "origins": 1, "version": 3}
        ctx.set_pace({"rank": 0, **pace})
        ctx.set_pace({"rank": 0, **pace, "version": 2})  # older: not kept, nothing to hear
        ctx.set_pace({"rank": 0, **pace, "batch": None, "version": 4})  # malformed: the same
        assert heard == [(3, {}), (3, {**pace, "hungry": False})]

    asyncio.run(main())


@pytest.mark.timeout(10)
def test_a_learner_rank_waits_until_its_own_pace_report_comes_back():
    """``wait_for_pace(rank, version)``: done once that rank's report at that version or later
    was taken in; another rank's, or an older one, does not end the wait."""

    async def main():
        ctx = ActorContext(_SPEC, log=None, control=None)
        pace = {"batch": 32, "every": 1, "max_lag": 1, "origins": 1}
        waiting = asyncio.ensure_future(ctx.wait_for_pace(0, 5))
        ctx.set_pace({"rank": 1, **pace, "version": 5})  # another rank's
        ctx.set_pace({"rank": 0, **pace, "version": 4})  # this rank's, one step before
        await asyncio.sleep(0.05)
        assert not waiting.done()
        ctx.set_pace({"rank": 0, **pace, "version": 5})
        await asyncio.wait_for(waiting, 2)
        await asyncio.wait_for(ctx.wait_for_pace(0, 3), 2)  # heard already: at once

    asyncio.run(main())


_SIGTERM_IN_THE_WINDOW = """
import asyncio, os, signal
from pipeline.actor import _ignore_shutdown_signals, _run_loop

def signalled_after(change):
    def changed(sig, *args):
        done = change(sig, *args)
        os.kill(os.getpid(), sig)
        return done
    return changed

async def main():
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: None)
    # the supervisor's SIGTERM lands right after each change the loop makes to its handlers
    for name in ("add_signal_handler", "remove_signal_handler"):
        setattr(loop, name, signalled_after(getattr(loop, name)))
    _ignore_shutdown_signals(loop)
    os.kill(os.getpid(), signal.SIGTERM)  # later ones too are ignored
    await asyncio.sleep(0.05)
    return 0

raise SystemExit(_run_loop(main()))
"""


@pytest.mark.timeout(60)
def test_a_sigterm_while_a_finished_replica_drops_its_handlers_does_not_kill_it():
    """A stage that asked to stop gets the supervisor's SIGTERM as it ends: between the loop's
    handler going and SIGTERM being ignored it must not die of the default action (exit -15,
    and its final ledger report lost)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SIGTERM_IN_THE_WINDOW], timeout=50)
    assert done.returncode == 0


def test_only_a_stage_that_reads_the_learners_pace_receives_it():
    """The learners' pace reports (one a learner step) go to the generators, whose queue gate
    reads them, and to the learners, which hear their own back before they acknowledge a
    step; not to every replica on the bus. Every replica gets versions and the rest."""
    from pipeline import topics
    from pipeline.actor import control_topics
    from stages.feeder.stage import Feeder
    from stages.generator.stage import Generator
    from stages.learner.stage import Learner
    from stages.scorer.stage import Scorer

    assert topics.PACE in control_topics(Generator)
    assert topics.PACE in control_topics(Learner)
    for cls in (Feeder, Scorer, None):
        subscribed = control_topics(cls)
        assert {topics.VERSION, topics.SHUTDOWN, topics.ENGINES} <= set(subscribed)
        # a SUB socket takes prefixes: none of them may let the pace in either
        assert not any(topics.PACE.startswith(t) for t in subscribed), cls
