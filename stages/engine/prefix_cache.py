"""Prefix reuse across requests: radix trees over token ids whose nodes hold keys and values.

When a request finishes, the scheduler inserts its sequence (the prompt and every output token
whose KV was computed: all but the last sampled one) with that KV; a long prompt goes in at its
prefill already, as a prefix only (``served`` false), as SGLang's ``cache_unfinished_req`` puts
it there. A new request's context is matched (longest prefix: one walk along its tokens, a dict
look-up per node and one list comparison per edge, whatever the number of entries), and only
the rest of it is prefilled, on top of the matched KV. This is what SGLang's radix cache does
for a multi-turn episode: turn k+1 = turn k's input + output + a few inserted tokens prefills
about the inserted tokens only. A prompt scored for its log-probs is inserted too, as a prefix
only, and takes live KV only (``live_only``): a teacher's group computes its prompt once.

Storage. Each node holds the KV of its edge's tokens: one tensor per slot-store group of
``kv_batch.BatchKV`` (token axis -2), its own copy, never a view of slot storage or of another
node, so the tokens a node counts are the memory it holds. A prefix shared by several sequences
(the samples of one prompt, a system prompt) is held once per tree; inserting a sequence that
leaves an edge midway splits that node (both halves copied, so the old tensor is freed).

Bound. At most ``max_tokens`` tokens are held in all. Eviction is least recently used, leaves
first: ``_order`` lists every node of every tree oldest first, and a match or an insert
refreshes the nodes it used deepest first, so a node is always newer than everything below it
and the oldest node is always a leaf. Eviction pops from the front: O(1) a node.

Weight versions (the policy). KV is labelled as tokens are: with the weight version live when
it was computed (``Stamp``; a partly loaded weight set counts as the version before it, exactly
as for the per-token versions). A sequence's KV depends on all of it, so a finished sequence is
labelled with the *oldest* version in its KV, and each label has its own tree: the same tokens
computed under different versions never share a node, so a path through a tree is always KV
that one lineage of requests really had (a stale prefix and a fresh continuation are never
spliced). Then:

- KV of the live version (its tree) is reused for any prefix of a new request: it is what the
  request would compute itself.
- KV of an older version is reused only by a request that *continues* a whole sequence the
  engine served (its context is that sequence and more: the next turn of an episode), up to the
  end of that sequence (``terminal`` nodes). This is PipelineRL's rule for a sequence that runs
  across an update (it keeps its stale KV and goes on): a multi-turn episode is one sequence
  with pauses. A request that merely shares part of a stale sequence (a new sample of a prompt
  seen before the update) is prefilled by the live weights, as it would be without a cache. The
  response names the version the reused KV was computed with, and the continued sequence goes
  back into the older tree (its KV is that old).
- Trees more than ``max_age`` versions older than the live one are dropped (``age_out``, at
  every version change). Reused stale KV is never older than the oldest sampled token of the
  same episode (turn 1's prompt KV and its first token come from the same version), which the
  learner bounds with ``max_lag``: ``max_age`` bounds how long stale entries hold memory, and
  its default follows the default ``max_lag``.

Namespaces. A request may name one (SGLang's ``extra_key`` and ``cache_salt``, its
``RadixKey``): each (version, namespace) has its own tree, and a request matches only the
trees of its own namespace (the default one: none named), so tenants that salt their requests
never reuse, or time, each other's prefixes.

Sessions (SGLang 0.5.23's ``--enable-session-radix-cache``, its ``UnifiedSessionRefTracker``). A
sequence inserted for a session (``insert(..., session=...)``) tags the node it ends on; every
node on the path from a tag to its root is *held* (``held`` counts the tags at and below it) and
is evicted only once no unheld node is left: ``_held`` lists held nodes oldest first as
``_order`` lists the others, each with the same newer-than-below rule, so the oldest of either
is a leaf of it. A session's next turn continues its earlier one: its tag moves down to the new
end, so the session holds each node once per branch it has. ``release(session)`` (its close)
drops its tags, and nodes no longer held go back to ``_order`` as the newest. A held leaf
evicted all the same (nothing else left) hands its tags to its parent.

Linear-attention states (``states``; Qwen3.5's, Mamba's: a state a row that sums up all of
it, ``kv_batch``). Such a model's prefix is usable only where its states were kept: an insert
with ``state`` keeps a copy on the node the sequence ends on (a split leaves it on the lower
half, which still ends there), and ``match(states=True)`` cuts the path after its deepest whole
node that has one, returning them in ``Match.state``, as SGLang's Mamba radix cache does. They
are bounded by count (``max_states``, which ``room_for_states`` changes: SGLang's
``--max-mamba-cache-size`` less the rows running) or by bytes (``state_ratio`` of the bytes of
``max_tokens`` tokens of KV: SGLang's ``--mamba-full-memory-ratio``), the least recently
matched or inserted dropped first (the node and its KV stay, to be passed through); a node that
goes takes its state with it.

Two sequences of one label that share tokens share their KV (first writer wins), even when an
update landed at different points of those tokens in each (it takes identical outputs; the
difference is where a v/v+1 switch sits). Weights loaded with no version change keep the cache
as they keep the per-token versions (the publisher labels every update; a client that sends
neither a version nor ``flush_cache: false`` flushes). Not here: pinning (the scheduler copies
matched KV into its slots at once, on the one thread that owns the trees, so nothing is evicted
from under a user), merging nodes after eviction, a bound in bytes (``stats()`` reports them).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Match", "PrefixCache", "Stamp"]


@dataclass(frozen=True, slots=True)
class Stamp:
    """The weights some KV was computed with: ``index`` counts version changes (the scheduler
    advances it), ``version`` is the label."""

    index: int
    version: str


@dataclass(slots=True)
class Match:
    """A context's longest usable cached prefix: ``length`` tokens whose KV is ``pieces`` (one
    list of per-store tensors per node, in order), computed under ``stamp`` (None: no match)."""

    length: int = 0
    pieces: list[list[torch.Tensor]] = field(default_factory=list)
    stamp: Stamp | None = None
    # with ``match(states=True)``: the linear-attention states after the prefix (None: none)
    state: list[torch.Tensor] | None = None


class _Node:
    __slots__ = (
        "children",
        "held",
        "kv",
        "namespace",
        "parent",
        "sessions",
        "stamp",
        "state",
        "terminal",
        "tokens",
    )

    def __init__(
        self,
        tokens: list[int],
        kv: list[torch.Tensor],
        stamp: Stamp,
        parent: _Node | None,
        namespace: Any = None,
    ) -> None:
        self.tokens = tokens  # this edge's token ids (a list: compared with list slices)
        self.kv = kv
        self.stamp = stamp  # its tree's
        self.namespace = namespace  # its tree's (a root's is read)
        self.parent = parent  # None: a tree's root
        self.children: dict[int, _Node] = {}  # keyed by the child's first token
        self.terminal = False  # a whole served sequence ends with this node
        self.held = 0  # session tags at and below it (>0: in PrefixCache._held)
        self.sessions: set[str] | None = None  # the sessions whose tags are on it
        # a linear-attention model's states after this node's last token (None: none kept)
        self.state: list[torch.Tensor] | None = None


class PrefixCache:
    """The trees, one per version label; every method runs on the scheduler thread
    (``stats`` may be read from anywhere)."""

    def __init__(
        self,
        max_tokens: int,
        max_age: int,
        *,
        states: bool = False,
        max_states: int | None = None,
        state_ratio: float | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {max_age}")
        self.max_tokens = max_tokens
        self.max_age = max_age
        # linear-attention states (``insert(state=...)``) kept: at most ``max_states`` of them
        # (None: any number) in at most ``state_ratio`` times the bytes of ``max_tokens`` tokens
        # of KV (None: any), the least recently used dropped first
        self.states = states
        self.max_states = max_states
        self.state_ratio = state_ratio
        self._states: collections.OrderedDict[_Node, None] = collections.OrderedDict()
        self.state_bytes = 0
        self.state_evictions = 0
        # (stamp index, namespace) -> root: the requests of one namespace (SGLang's extra_key
        # and cache_salt; None: the default one) share prefixes with each other only
        self._trees: dict[tuple[int, Any], _Node] = {}
        self.live_index = 0  # as of the last age_out
        self._order: collections.OrderedDict[_Node, None] = collections.OrderedDict()
        # nodes a session holds (see the module's docstring), oldest first; and each
        # session's tagged nodes
        self._held: collections.OrderedDict[_Node, None] = collections.OrderedDict()
        self._leaves: dict[str, set[_Node]] = {}
        self.held_tokens = 0
        self.tokens = 0
        self.sequences = 0  # terminal nodes held
        self.bytes_per_token = 0
        self.lookups = self.hits = self.hit_tokens = self.stale_hits = 0
        self.evictions = self.evicted_tokens = 0
        self.aged_out_tokens = self.flushed_tokens = 0

    # ---- matching ----------------------------------------------------------------------------

    def match(
        self,
        tokens: list[int],
        limit: int,
        live: Stamp,
        namespace: Any = None,
        *,
        live_only: bool = False,
        record: bool = True,
        states: bool = False,
    ) -> Match:
        """The longest usable cached prefix of ``tokens`` in ``namespace``, at most ``limit``
        tokens long (see the module docstring for which KV is usable; ``live_only``: the live
        version's alone, as prompt scoring takes it); its nodes become the most recently
        used. ``record`` false: a look only (no counter, no node refreshed). ``states``: a
        linear-attention model's, whose prefix must end where a state was kept (the end of a
        sequence or a context inserted with one), given in ``Match.state``."""
        self.lookups += record
        best: list[tuple[_Node, int]] = []
        length = 0
        for (index, space), root in self._trees.items():
            if space != namespace or (live_only and index != live.index):
                continue
            path = _walk(root, tokens, limit)
            if index != live.index:  # older KV: up to the end of a sequence it continues
                path = _continued(path, len(tokens))
            if states:
                path = _stated(path)
            reach = sum(k for _, k in path)
            if reach > length or (reach == length and index == live.index):
                best, length = path, reach
        if not length:
            return Match()
        end = best[-1][0].state if states else None
        if not record:
            return Match(length, [], best[0][0].stamp, end)
        for node, _ in reversed(best):  # deepest first: parents stay newer than children
            self._touch(node)
        if end is not None:
            self._states.move_to_end(best[-1][0])
        stamp = best[0][0].stamp
        self.hits += 1
        self.hit_tokens += length
        self.stale_hits += stamp.index != live.index
        pieces = [n.kv if k == len(n.tokens) else [t[..., :k, :] for t in n.kv] for n, k in best]
        return Match(length, pieces, stamp, end)

    # ---- inserting ---------------------------------------------------------------------------

    def insert(
        self,
        tokens: list[int],
        kv_of: Callable[[int, int], list[torch.Tensor]],
        stamp: Stamp,
        namespace: Any = None,
        *,
        served: bool = True,
        session: str | None = None,
        state: list[torch.Tensor] | None = None,
    ) -> int:
        """Hold ``tokens`` (a whole served sequence whose oldest KV is ``stamp``'s) in the tree
        of ``stamp``; ``kv_of(a, b)`` gives the KV of its tokens ``a..b-1`` (views; copied
        here). Only the part not held yet is copied; a sequence longer than the bound is held up
        to the bound (and then is not a whole sequence); one too old to be reused (it ran across
        more than ``max_age`` versions) is not held. ``namespace``: the tree's, with the
        stamp's (only requests of the same namespace match it). ``served`` false: a prompt
        being scored or generated from, held as a prefix only, not a whole sequence (no
        episode continues it, so its KV is never reused once stale). ``session``: the sequence
        is that session's, held for it until ``release`` (the module's docstring). ``state``: a
        linear-attention model's states after the last of ``tokens`` (copied; kept within
        ``max_states`` and ``state_ratio``, the least recently used dropped first). Returns the
        tokens newly held."""
        if self.live_index - stamp.index > self.max_age:
            return 0
        whole = len(tokens) <= self.max_tokens
        if not whole:
            tokens = tokens[: self.max_tokens]
        root = self._trees.get((stamp.index, namespace))
        if root is None:
            root = self._trees[(stamp.index, namespace)] = _Node([], [], stamp, None, namespace)
        node, depth, added = root, 0, 0
        touched: list[_Node] = []
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                kv = [t.clone() for t in kv_of(depth, len(tokens))]
                child = _Node(tokens[depth:], kv, stamp, node)
                node.children[tokens[depth]] = child
                self._order[child] = None
                added = len(child.tokens)
                self.tokens += added
                if not self.bytes_per_token:
                    self.bytes_per_token = sum(t.nbytes for t in kv) // added
            else:
                k = _common(child.tokens, tokens, depth, len(tokens))
                if k < len(child.tokens):
                    child = self._split(child, k)
            touched.append(child)
            node, depth = child, depth + len(child.tokens)
        if served and whole and node is not root and not node.terminal:
            node.terminal = True
            self.sequences += 1
        for n in reversed(touched):
            self._touch(n)
        if session is not None and node is not root:
            self._hold(session, node)
        if state is not None and whole and node is not root and self.states:
            self._keep_state(node, state)
        self._evict()
        return added

    def _keep_state(self, node: _Node, state: list[torch.Tensor]) -> None:
        if node.state is None:  # (the same tokens' states: the first writer's, as the KV)
            node.state = [t.clone() for t in state]
            self.state_bytes += _nbytes(node.state)
        self._states[node] = None
        self._states.move_to_end(node)
        self._bound_states()

    def room_for_states(self, count: int) -> None:
        """Keep at most ``count`` states from now on (dropping the least recently used now)."""
        self.max_states = max(count, 0)
        self._bound_states()

    def max_state_bytes(self) -> int | None:
        """The bytes the states may take (None: no bound, or no KV seen yet to measure it)."""
        if self.state_ratio is None or not self.bytes_per_token:
            return None
        return int(self.state_ratio * self.max_tokens * self.bytes_per_token)

    def _bound_states(self) -> None:
        count, limit = self.max_states, self.max_state_bytes()
        while self._states and (
            (count is not None and len(self._states) > count)
            or (limit is not None and self.state_bytes > limit)
        ):
            oldest, _ = self._states.popitem(last=False)
            self.state_bytes -= _nbytes(oldest.state or ())
            oldest.state = None
            self.state_evictions += 1

    def _drop_state(self, node: _Node) -> None:
        if node.state is not None:
            self.state_bytes -= _nbytes(node.state)
            node.state = None
            del self._states[node]

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first ``k`` tokens; returns the new upper half."""
        parent = node.parent
        assert parent is not None
        kv = [t[..., :k, :].clone() for t in node.kv]
        upper = _Node(node.tokens[:k], kv, node.stamp, parent)
        node.tokens = node.tokens[k:]
        node.kv = [t[..., k:, :].clone() for t in node.kv]
        node.parent = upper
        upper.children[node.tokens[0]] = node
        parent.children[upper.tokens[0]] = upper
        upper.held = node.held  # on the path of the same tags
        # newer than `node`, below it (its tokens were counted as `node`'s)
        (self._held if upper.held else self._order)[upper] = None
        return upper

    # ---- sessions ----------------------------------------------------------------------------

    def _touch(self, node: _Node) -> None:
        """``node`` becomes the newest of its list."""
        (self._held if node.held else self._order).move_to_end(node)

    def _hold(self, session: str, end: _Node) -> None:
        """Tag ``end`` for ``session``: the nodes from it up to the session's tag above it
        (none: up to the root) are held once more; that tag moves down to ``end``."""
        tagged = self._leaves.setdefault(session, set())
        if end in tagged:
            return
        above = end.parent
        while above is not None and above not in tagged:
            above = above.parent
        node: _Node | None = end
        path: list[_Node] = []
        while node is not None and node.parent is not None:  # up to the root, deepest first
            path.append(node)
            node = node.parent
        for n in path:
            if n is above:
                break
            self._add_held(n, 1)
        for n in path:  # parents newer than children again, in each list
            self._touch(n)
        if above is not None:
            self._untag(above, session)
        self._tag(end, session)

    def release(self, session: str) -> int:
        """Drop ``session``'s tags (its close): what it alone held may be evicted as anything
        else; returns the nodes it had tagged."""
        tagged = self._leaves.pop(session, set())
        for end in tagged:
            if end.sessions is not None:
                end.sessions.discard(session)
                if not end.sessions:
                    end.sessions = None
            self._unhold_path(end)
        return len(tagged)

    def _tag(self, node: _Node, session: str) -> None:
        if node.sessions is None:
            node.sessions = set()
        node.sessions.add(session)
        self._leaves.setdefault(session, set()).add(node)

    def _untag(self, node: _Node, session: str) -> None:
        if node.sessions is not None:
            node.sessions.discard(session)
            if not node.sessions:
                node.sessions = None
        tagged = self._leaves.get(session)
        if tagged is not None:
            tagged.discard(node)

    def _add_held(self, node: _Node, k: int) -> None:
        """``node.held`` += ``k``; moved between the lists as it becomes (un)held."""
        before = node.held
        node.held += k
        if not before and node.held:
            del self._order[node]
            self._held[node] = None
            self.held_tokens += len(node.tokens)
        elif before and not node.held:
            del self._held[node]
            self._order[node] = None  # the newest (its children in the list are older)
            self.held_tokens -= len(node.tokens)

    def _unhold_path(self, node: _Node | None) -> None:
        """One tag fewer on ``node`` and each node above it."""
        while node is not None and node.parent is not None:
            self._add_held(node, -1)
            node = node.parent

    def _hand_up(self, node: _Node) -> None:
        """``node``, a held leaf, is being evicted: its tags go to its parent (or, where the
        parent is the root or has that session's tag already, are dropped)."""
        parent = node.parent
        for session in list(node.sessions or ()):
            self._untag(node, session)
            tagged = self._leaves.get(session)
            if parent is None or parent.parent is None or (tagged and parent in tagged):
                self._unhold_path(parent)
            else:
                self._tag(parent, session)
            if tagged is not None and not tagged:
                del self._leaves[session]
        self.held_tokens -= len(node.tokens) if node.held else 0
        node.held = 0

    # ---- dropping ----------------------------------------------------------------------------

    def _evict(self) -> None:
        while self.tokens > self.max_tokens:
            if self._order:
                node, _ = self._order.popitem(last=False)  # the oldest: always a leaf
            else:  # only held nodes left: the oldest of them
                node, _ = self._held.popitem(last=False)
                self._hand_up(node)
            self.evictions += 1
            self.evicted_tokens += len(node.tokens)
            parent = node.parent
            self._detach(node)
            if parent is not None and parent.parent is None and not parent.children:
                del self._trees[(parent.stamp.index, parent.namespace)]  # an empty tree

    def age_out(self, live_index: int) -> int:
        """Drop the trees more than ``max_age`` versions older than ``live_index``; returns
        the tokens dropped."""
        before = self.tokens
        self.live_index = live_index
        for key in [k for k in self._trees if live_index - k[0] > self.max_age]:
            root = self._trees.pop(key)
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                self._forget(node)
                self.tokens -= len(node.tokens)
                self.sequences -= node.terminal
        dropped = before - self.tokens
        self.aged_out_tokens += dropped
        return dropped

    def flush(self) -> int:
        """Drop everything; returns the tokens dropped."""
        dropped = self.tokens
        self._trees.clear()
        self._order.clear()
        self._held.clear()
        self._leaves.clear()
        self._states.clear()
        self.tokens = self.sequences = self.held_tokens = self.state_bytes = 0
        self.flushed_tokens += dropped
        return dropped

    def _forget(self, node: _Node) -> None:
        """Out of the lists and the sessions' tags (its whole tree is going)."""
        self._drop_state(node)
        if node.held:
            del self._held[node]
            self.held_tokens -= len(node.tokens)
        else:
            del self._order[node]
        for session in node.sessions or ():
            tagged = self._leaves.get(session)
            if tagged is not None:
                tagged.discard(node)
                if not tagged:
                    del self._leaves[session]

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        if parent is not None:
            del parent.children[node.tokens[0]]
        self.tokens -= len(node.tokens)
        self.sequences -= node.terminal
        self._drop_state(node)
        node.kv, node.parent = [], None

    # ---- metrics -----------------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        return {
            "max_tokens": self.max_tokens,
            "max_age": self.max_age,
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_rate": round(self.hits / self.lookups, 4) if self.lookups else 0.0,
            "hit_tokens": self.hit_tokens,
            "stale_hits": self.stale_hits,  # of an older version, by a continuation
            "evictions": self.evictions,
            "evicted_tokens": self.evicted_tokens,
            "aged_out_tokens": self.aged_out_tokens,
            "flushed_tokens": self.flushed_tokens,
            "versions": len({index for index, _ in self._trees}),
            "nodes": len(self._order) + len(self._held),
            "sequences": self.sequences,
            "sessions": len(self._leaves),  # holding KV (--enable-session-radix-cache)
            "session_held_tokens": self.held_tokens,
            "tokens": self.tokens,
            "bytes": self.tokens * self.bytes_per_token,
            **(
                {
                    "states": len(self._states),
                    "state_bytes": self.state_bytes,
                    "state_evictions": self.state_evictions,
                    "max_states": self.max_states,
                    "max_state_bytes": self.max_state_bytes(),
                }
                if self.states
                else {}
            ),
        }

    def nodes(self) -> list[tuple[list[int], list[torch.Tensor], Stamp]]:
        """(tokens, kv, stamp) of every node, oldest first, those sessions hold last (for tests
        and debugging)."""
        return [(n.tokens, n.kv, n.stamp) for n in (*self._order, *self._held)]


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


def _walk(root: _Node, tokens: list[int], limit: int) -> list[tuple[_Node, int]]:
    """The nodes along ``tokens[:limit]`` from ``root``, each with how many of its tokens
    matched (all but maybe the last's)."""
    path: list[tuple[_Node, int]] = []
    node, depth = root, 0
    while depth < limit:
        child = node.children.get(tokens[depth])
        if child is None:
            break
        k = _common(child.tokens, tokens, depth, limit)
        path.append((child, k))
        if k < len(child.tokens):
            break
        node, depth = child, depth + k
    return path


def _continued(path: list[tuple[_Node, int]], total: int) -> list[tuple[_Node, int]]:
    """``path`` cut after its deepest whole sequence that a context of ``total`` tokens
    continues (goes on after)."""
    depth, cut = 0, 0
    for i, (node, k) in enumerate(path):
        depth += k
        if k == len(node.tokens) and node.terminal and depth < total:
            cut = i + 1
    return path[:cut]


def _stated(path: list[tuple[_Node, int]]) -> list[tuple[_Node, int]]:
    """``path`` cut after its deepest whole node that keeps a state (a linear-attention
    model's prefix can only end there)."""
    cut = 0
    for i, (node, k) in enumerate(path):
        if k == len(node.tokens) and node.state is not None:
            cut = i + 1
    return path[:cut]


def _common(edge: list[int], tokens: Sequence[int], depth: int, limit: int) -> int:
    """How many leading tokens of ``edge`` equal ``tokens[depth:limit]``."""
    n = min(len(edge), limit - depth)
    if edge[:n] == tokens[depth : depth + n]:  # the usual case: one comparison in C
        return n
    for i in range(n):
        if edge[i] != tokens[depth + i]:
            return i
    return n
