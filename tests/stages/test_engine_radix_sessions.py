"""Sessions that hold their KV in the built-in engine's prefix cache (SGLang 0.5.23's
``--enable-session-radix-cache``, ``mem_cache/unified_cache/session_ref_tracker.py`` and
``scheduler.py`` ``handle_generate_request``, ``open_session`` and ``close_session``): the tree
on its own (held nodes evicted last, a next turn's tag moving down, close), under random
operations against its invariants; the generations (``radix_sessions``); the scheduler driven by
hand; then a real server (``session_id`` on ``/generate`` and the ``/v1`` routes, with and
without the flag)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from stages.engine.prefix_cache import PrefixCache, Stamp, _Node
from stages.engine.protocol import GenerateInput, SamplingParams, SequenceResult
from stages.engine.radix_sessions import CLOSED_REMEMBERED, RadixSessions
from stages.engine.scheduler import Scheduler
from tests.stages.engine_setup import builtin_engine, load_reference
from tests.stages.tiny_model import make_tiny_model

LIVE = Stamp(0, "0")


def _kv_of(values: list[int]) -> Any:
    def kv_of(a: int, b: int) -> list[torch.Tensor]:
        return [torch.tensor(values[a:b], dtype=torch.float32)[None, None, :, None]]

    return kv_of


def _insert(cache: PrefixCache, seq: list[int], session: str | None = None, stamp: Stamp = LIVE):
    return cache.insert(seq, _kv_of(seq), stamp, session=session)


def _nodes(cache: PrefixCache) -> list[_Node]:
    found: list[_Node] = []
    stack = list(cache._trees.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is not None:
            found.append(node)
    return found


def _check(cache: PrefixCache) -> None:
    """The tree's bookkeeping: each node's ``held`` is the session tags at and below it; held
    nodes are in ``_held``, the others in ``_order``, each list with every parent newer than
    its children; the sessions' tag index and the token counts agree."""
    nodes = _nodes(cache)
    assert set(nodes) == set(cache._order) | set(cache._held)
    assert not set(cache._order) & set(cache._held)
    tags: dict[_Node, int] = {}

    def below(node: _Node) -> int:
        if node not in tags:
            tags[node] = len(node.sessions or ()) + sum(below(c) for c in node.children.values())
        return tags[node]

    for node in nodes:
        assert node.held == below(node), (node.tokens, node.held, below(node))
        assert (node in cache._held) == (node.held > 0)
    for order in (cache._order, cache._held):
        rank = {node: i for i, node in enumerate(order)}
        for node in order:
            parent = node.parent
            if parent is not None and parent in rank:
                assert rank[parent] > rank[node], "a parent older than its child"
    index = {(s, n) for s, ns in cache._leaves.items() for n in ns}
    assert index == {(s, n) for n in nodes for s in n.sessions or ()}
    assert all(cache._leaves.values()), "an empty tag set kept"
    assert cache.tokens == sum(len(n.tokens) for n in nodes) <= cache.max_tokens
    assert cache.held_tokens == sum(len(n.tokens) for n in cache._held)


@pytest.mark.timeout(10)
def test_a_sessions_sequence_is_evicted_only_once_nothing_else_is_left() -> None:
    cache = PrefixCache(max_tokens=20, max_age=2)
    episode = [1, 2, 3, 4, 5, 6, 7, 8]
    _insert(cache, episode, "s")
    for k in range(6):  # 6 x 4 tokens of others, newer: without the session, the episode goes
        _insert(cache, [100 + 10 * k + i for i in range(4)])
        _check(cache)
    assert cache.match([*episode, 9], 8, LIVE).length == 8
    stats = cache.stats()
    assert stats["sessions"] == 1 and stats["session_held_tokens"] == 8
    assert stats["tokens"] == 20 and stats["evictions"] == 3

    assert cache.release("s") == 1 and cache.release("s") == 0
    _check(cache)
    assert cache.stats()["session_held_tokens"] == 0 and cache.stats()["sessions"] == 0
    for k in range(6):  # now the least recently used, as anything else
        _insert(cache, [200 + 10 * k + i for i in range(4)])
    assert cache.match([*episode, 9], 8, LIVE).length == 0


@pytest.mark.timeout(10)
def test_a_next_turn_moves_the_sessions_tag_down_and_sessions_share_a_prefix() -> None:
    cache = PrefixCache(max_tokens=100, max_age=2)
    turn1 = [1, 2, 3, 4]
    turn2 = [*turn1, 5, 6, 7]
    _insert(cache, turn1, "a")
    _insert(cache, turn2, "a")  # continues turn 1: held once, tagged at its end only
    _check(cache)
    (end,) = cache._leaves["a"]
    assert end.tokens == [5, 6, 7] and end.parent is not None and end.parent.held == 1
    _insert(cache, [1, 2, 3, 9, 9], "b")  # splits turn 1's node: [1, 2, 3] held by both
    _check(cache)
    shared = cache._trees[(0, None)].children[1]
    assert shared.tokens == [1, 2, 3] and shared.held == 2
    _insert(cache, [1, 2, 8], "a")  # a second branch of "a": its own tag
    _check(cache)
    assert len(cache._leaves["a"]) == 2 and shared.held == 2  # split again: [1, 2] and [3]
    assert cache._trees[(0, None)].children[1].held == 3
    cache.release("a")
    _check(cache)
    assert cache.stats()["session_held_tokens"] == 5  # b's [1, 2], [3] and [9, 9]
    cache.release("b")
    _check(cache)
    assert not cache._held and cache.held_tokens == 0


@pytest.mark.timeout(10)
def test_held_leaves_go_oldest_first_when_only_held_ones_are_left() -> None:
    cache = PrefixCache(max_tokens=10, max_age=2)
    _insert(cache, [1, 2, 3, 4, 5, 6], "s1")
    _insert(cache, [1, 2, 3, 7, 8, 9], "s2")
    assert _insert(cache, [20, 21, 22]) == 3  # unheld, and the only thing that can go: it goes
    _check(cache)
    assert cache.match([20, 21, 22, 23], 3, LIVE).length == 0
    cache.max_tokens = 7
    _insert(cache, [30, 31], "s3")  # 11 > 7: held leaves go, the oldest first
    _check(cache)
    assert cache.match([1, 2, 3, 4, 5, 6, 0], 6, LIVE).length == 3  # s1's end went...
    assert cache.match([1, 2, 3, 7, 8, 9, 0], 6, LIVE).length == 3  # ...and s2's
    assert cache.match([30, 31, 0], 2, LIVE).length == 2
    # their tags were handed up: [1, 2, 3] is held by s1 and s2 now
    shared = cache._trees[(0, None)].children[1]
    assert shared.sessions == {"s1", "s2"} and shared.held == 2
    cache.release("s1")
    cache.release("s2")
    _check(cache)
    assert cache.stats()["session_held_tokens"] == 2  # s3's


@pytest.mark.timeout(30)
def test_random_operations_keep_the_bookkeeping_exact() -> None:
    rng = random.Random(7)
    for trial in range(30):
        cache = PrefixCache(max_tokens=rng.choice([12, 30, 60]), max_age=1)
        version = 0
        for _ in range(120):
            op = rng.random()
            stamp = Stamp(version - rng.choice([0, 0, 1]), str(version))
            if op < 0.5:
                length = rng.randint(1, 14)
                seq = [rng.randint(1, 4) for _ in range(length)]
                session = rng.choice([None, None, "a", "b", "c"])
                cache.insert(seq, _kv_of(seq), stamp, session=session)
            elif op < 0.7:
                seq = [rng.randint(1, 4) for _ in range(rng.randint(1, 14))]
                cache.match(seq, len(seq) - 1, Stamp(version, str(version)))
            elif op < 0.85:
                cache.release(rng.choice("abc"))
            elif op < 0.97:
                version += 1
                cache.age_out(version)
            else:
                cache.flush()
            _check(cache)
        for session in "abc":
            cache.release(session)
        _check(cache)
        assert not cache._held, f"trial {trial}: held after every session closed"


@pytest.mark.timeout(10)
def test_generations_keep_requests_from_before_a_close_out() -> None:
    sessions = RadixSessions()
    first = sessions.ensure("s")
    assert sessions.ensure("s") == first == sessions.current("s")
    assert sessions.close("s") and not sessions.close("s")  # closed once
    assert sessions.current("s") is None
    again = sessions.ensure("s")  # a request after the close opens it again
    assert again != first and sessions.current("s") == again
    reopened = sessions.open("s")  # /open_session: a new generation
    assert reopened not in (first, again)
    for k in range(CLOSED_REMEMBERED + 1):
        sessions.close(f"x{k}")
    assert sessions.close("x0")  # forgotten by now: closed again (nothing held, as SGLang)


# ---- the scheduler ---------------------------------------------------------------------------


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _run(scheduler: Scheduler, *inputs: GenerateInput) -> list[SequenceResult]:
    future = scheduler.submit_many(list(inputs))
    scheduler.run_until_idle()
    return future.result(timeout=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "m", vocab=128, seed=3)


@pytest.mark.timeout(60)
def test_a_session_keeps_its_episode_through_others_traffic(model_dir: Path) -> None:
    model = load_reference(model_dir)

    def episode(scheduler: Scheduler, session: str | None) -> int:
        """Turn 1, then 8 other prompts (40 tokens: more than the cache holds besides the
        episode), then turn 2: how many of turn 2's tokens came from the cache."""
        prompt = [5, 6, 7, 8, 9, 10]
        (one,) = _run(scheduler, GenerateInput("t1", prompt, _greedy(4), True, session_id=session))
        for k in range(8):
            _run(scheduler, GenerateInput(f"o{k}", [20 + k, 30, 31, 32], _greedy(2), True))
        turn2 = [*prompt, *one.output_ids, 50, 51]
        (two,) = _run(scheduler, GenerateInput("t2", turn2, _greedy(2), True, session_id=session))
        return two.cached_tokens

    holding = Scheduler(model, max_running=4, prefix_cache_tokens=30, session_radix_cache=True)
    assert episode(holding, "ep") == 9  # the prompt and 3 of its 4 tokens: all it had computed
    assert holding.prefix_cache_stats()["sessions"] == 1
    plain = Scheduler(model, max_running=4, prefix_cache_tokens=30)
    assert episode(plain, "ep") == 0  # without the flag the id changes nothing
    assert episode(Scheduler(model, max_running=4, prefix_cache_tokens=30,
                             session_radix_cache=True), None) == 0  # fmt: skip

    # a close lets go of it; a request queued before the close holds nothing after it
    released = holding.release_radix_session("ep")  # run at the next step
    holding.run_until_idle()
    assert released.result(timeout=0) == 1 and holding.prefix_cache_stats()["sessions"] == 0
    late = holding.submit(GenerateInput("late", [60, 61, 62], _greedy(3), True, session_id="z"))
    holding.step()  # queued (generation 1 of "z") and running
    holding.release_radix_session("z")
    holding.run_until_idle()
    assert late.result(timeout=0).output_ids and holding.prefix_cache_stats()["sessions"] == 0
    aborted = holding.submit(GenerateInput("ab", [70, 71, 72], _greedy(30), True, session_id="y"))
    holding.step()
    holding.abort("ab")
    holding.run_until_idle()
    assert aborted.result(timeout=0).finish_reason["type"] == "abort"
    assert holding.prefix_cache_stats()["sessions"] == 0  # an aborted request holds nothing


@pytest.mark.timeout(30)
def test_the_flag_with_the_cache_off_holds_nothing(model_dir: Path) -> None:
    """As SGLang 0.5.23's disabled radix cache takes the flag and returns before any hold."""
    scheduler = Scheduler(
        load_reference(model_dir), prefix_cache_tokens=0, session_radix_cache=True
    )
    (out,) = _run(scheduler, GenerateInput("a", [3, 4, 5], _greedy(3), True, session_id="s"))
    assert len(out.output_ids) == 3 and scheduler.session_radix_cache
    released = scheduler.release_radix_session("s")
    scheduler.run_until_idle()
    assert released.result(timeout=0) == 0


# ---- a real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def holding_url(model_dir: Path) -> Iterator[str]:
    flags = ("--enable-session-radix-cache", "--prefix-cache-tokens", "40", "--max-running", "4")
    with builtin_engine(model_dir, *flags) as url:
        yield url


def _generate(url: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(url + "/generate", json=body, timeout=30)


GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def _traffic(url: str, seed: int) -> None:
    """10 other prompts of 8 tokens: more than the cache holds."""
    prompts = [[seed + k, 40, 41, 42, 43, 44, 45, 46] for k in range(10)]
    assert _generate(url, {"input_ids": prompts, "sampling_params": GREEDY}).status_code == 200


@pytest.mark.timeout(120)
def test_server_holds_a_sessions_kv_until_it_is_closed(holding_url: str) -> None:
    url = holding_url
    info = requests.get(url + "/server_info", timeout=30).json()
    assert info["enable_session_radix_cache"] is True
    prompt = [3, 4, 5, 6, 7, 8, 9]
    one = _generate(url, {"input_ids": prompt, "sampling_params": GREEDY, "session_id": "ep1"})
    assert one.status_code == 200, one.text
    _traffic(url, 60)
    turn2 = prompt + one.json()["output_ids"] + [20, 21]
    two = _generate(url, {"input_ids": turn2, "sampling_params": GREEDY, "session_id": "ep1"})
    assert two.json()["meta_info"]["cached_tokens"] == len(prompt) + 3
    stats = requests.get(url + "/server_info", timeout=30).json()["prefix_cache"]
    assert stats["sessions"] == 1 and stats["session_held_tokens"] >= len(turn2)

    closed = requests.post(url + "/close_session", json={"session_id": "ep1"}, timeout=30)
    assert closed.status_code == 200 and closed.text == ""
    _traffic(url, 80)
    turn3 = turn2 + two.json()["output_ids"] + [22]
    three = _generate(url, {"input_ids": turn3, "sampling_params": GREEDY, "session_id": "ep9"})
    assert three.json()["meta_info"]["cached_tokens"] == 0  # evicted once let go

    # /open_session's sessions: their requests hold their KV too, until their close
    sid = requests.post(url + "/open_session", json={"capacity_of_str_len": 1000}, timeout=30)
    sid = sid.json()
    prompt = [9, 8, 7, 6, 5]
    first = _generate(url, {"input_ids": prompt, "sampling_params": GREEDY,
                            "session_params": {"id": sid}, "rid": "s1"}).json()  # fmt: skip
    _traffic(url, 100)
    nxt = _generate(url, {"input_ids": [30, 31], "sampling_params": GREEDY,
                          "session_params": {"id": sid, "rid": "s1"}}).json()  # fmt: skip
    assert nxt["meta_info"]["cached_tokens"] == len(prompt) + 3, first
    assert requests.post(url + "/close_session", json={"session_id": sid}, timeout=30).ok
    stats = requests.get(url + "/server_info", timeout=30).json()["prefix_cache"]
    assert stats["sessions"] == 1  # ep9's


@pytest.mark.timeout(120)
def test_session_id_on_the_openai_routes_and_the_refusals(holding_url: str) -> None:
    url = holding_url
    body = {"model": "default", "prompt": [3, 4, 5, 6, 7, 8], "max_tokens": 3,
            "temperature": 0, "session_id": "v1-ep"}  # fmt: skip
    assert requests.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    stats = requests.get(url + "/server_info", timeout=30).json()["prefix_cache"]
    assert stats["sessions"] >= 1
    requests.post(url + "/close_session", json={"session_id": "v1-ep"}, timeout=30)

    both = _generate(url, {"input_ids": [3, 4], "sampling_params": GREEDY, "session_id": "x",
                           "session_params": {"id": "x"}})  # fmt: skip
    assert both.status_code == 400  # SGLang's GenerateReqInput.normalize_batch_and_arguments
    assert both.json() == {
        "error": {"message": "session_id and session_params cannot both be set."}
    }
    wrong = _generate(url, {"input_ids": [3, 4], "sampling_params": GREEDY, "session_id": 7})
    assert wrong.status_code == 400 and "session_id" in wrong.text


@pytest.mark.timeout(120)
def test_without_the_flag_session_id_is_taken_and_changes_nothing(model_dir: Path) -> None:
    with builtin_engine(model_dir, "--max-running", "4") as url:
        body = {"input_ids": [3, 4, 5], "sampling_params": GREEDY, "session_id": "any"}
        answer = _generate(url, body)
        assert answer.status_code == 200, answer.text
        info = requests.get(url + "/server_info", timeout=30).json()
        assert info["enable_session_radix_cache"] is False
        assert info["prefix_cache"]["sessions"] == 0
        assert requests.post(url + "/close_session", json={"session_id": "any"}, timeout=30).ok
