"""pipeline.heap: what a replica does to the garbage collector once it has set up."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from pipeline import heap


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)
    heap._holds, heap._oldest = 0, None


def test_settle_freezes_what_setup_left_and_spaces_young_collections(restored_gc: None) -> None:
    kept = [{"loaded": i} for i in range(1000)]  # what a stage's setup holds on to
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    heap.settle()
    assert gc.get_freeze_count() >= len(kept)  # full collections no longer walk them
    assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD


def test_settle_collects_cycles_before_freezing(restored_gc: None) -> None:
    class Node:
        pass

    gc.collect()
    gc.unfreeze()
    a, b = Node(), Node()
    a.other, b.other = b, a  # garbage only a collection frees
    del a, b
    heap.settle()
    assert not any(isinstance(obj, Node) for obj in gc.get_objects())
    # frozen objects are invisible to get_objects; unfreeze and look again
    gc.unfreeze()
    assert not any(isinstance(obj, Node) for obj in gc.get_objects())


def test_inflight_gc_default_keeps_pythons_settings(
    restored_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFLIGHT_GC", "default")
    gc.unfreeze()
    before = gc.get_threshold()
    heap.settle()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before


def test_resettle_frees_cycles_that_became_garbage_while_frozen(restored_gc: None) -> None:
    class Held:  # what a replica holds: cycles (tasks, stages and their back-references)
        pass

    gc.unfreeze()
    a, b = Held(), Held()
    a.other, b.other = b, a
    heap.settle()  # the replica set up: its objects are frozen
    del a, b  # it crashed: its objects are garbage, but frozen ones are never collected
    gc.collect()
    gc.unfreeze()
    assert any(isinstance(obj, Held) for obj in gc.get_objects())
    gc.freeze()
    heap.resettle()  # what the host does when a replica fails
    gc.unfreeze()
    assert not any(isinstance(obj, Held) for obj in gc.get_objects())


def test_no_full_collections_while_replicas_set_up(restored_gc: None) -> None:
    full: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.set_threshold(700, 10, 10)  # Python's defaults
    gc.callbacks.append(count)
    try:
        heap.hold()  # two replicas of one process set up (the shared process's)
        heap.hold()
        loaded = [[i] for i in range(300_000)]  # a library's worth of containers
        assert full == []  # with Python's settings: several full collections
        heap.settle()  # the first is up: the second still holds
        assert gc.get_threshold()[2] > 10
        more = [[i] for i in range(100_000)]
        assert full == []
        heap.settle()  # all up: full collections come back, young ones spaced out
        assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, 10, 10)
        assert gc.get_freeze_count() >= len(loaded) + len(more)
    finally:
        gc.callbacks.remove(count)


def test_a_failed_setup_releases_its_hold(restored_gc: None) -> None:
    gc.set_threshold(700, 10, 10)
    heap.hold()
    assert gc.get_threshold()[2] > 10
    heap.release()  # setup raised: nothing frozen, Python's full collections back
    assert gc.get_threshold()[2] == 10


def test_without_hold_the_defaults_are_full_collections_as_python(restored_gc: None) -> None:
    gc.set_threshold(700, 10, 10)
    full: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(count)
    try:
        loaded = [[i] for i in range(300_000)]
    finally:
        gc.callbacks.remove(count)
    assert len(loaded) and full  # what the hold saves
