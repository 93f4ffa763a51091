"""The run's ledger: where every prompt fed, and every sample made of it, ended up.

Identity. The feeder gives each prompt it sends a ``uid`` (its replica and position: the same
prompt fed again after a restart has the same uid), and every message made of it carries that
uid on (``rollout_group``, ``scored_group``). A prompt of group size ``n`` is ``n`` sample slots.

Reports. Each stage replica tells the supervisor, on the control bus (topic ``ledger``), the
moment it decides something, before it acknowledges the message the decision is about (a
replica killed in between has then said too much, which the book recognizes as a duplicate,
never too little):

- ``fed``: a prompt was sent (the feeder);
- ``fates``: slots ended, as ``trained`` (in a finished optimizer step, with the step),
  ``no_signal`` (in a finished step, but its advantage was 0: the learner skipped its forward
  and backward passes, which would have added nothing to the gradient) or dropped
  for a named reason (``engine_failure``, ``incomplete_group``, ``malformed``, ``late``,
  ``stale``, ``bad_group``...);
- ``consumed``: a stage that keeps no ledger (one of your own: its class does not set
  ``keeps_ledger``) processed a message of the prompt: the prompt ends there;
- ``copies``: a second copy of work already done was recognized and dropped (a prompt fed or
  generated again after a crash); counted, and a slot without a fate in this ledger (its original
  was finished before a resume) ends as ``done_before`` unless the original's fate comes later;
- ``rollback``: the learner resumed from the checkpoint of step ``k``: what it decided after
  step ``k`` (trained, or dropped as stale) is undone (``rolled_back``, unless those samples
  come again and get a fate again);
  ``checkpoint``: steps up to ``k`` are saved, so they can no longer be rolled back;
- ``final``: the replica is ending; ``held``: the uids of messages still in its inboxes, taken
  and not yet acknowledged, or sent and not yet acknowledged downstream (in flight), and its
  transport counters (``redelivered``, ``duplicates``...). Also sent periodically without
  ``final``, for the counters of replicas that are killed.

The book (:class:`LedgerBook`, in the supervisor) keeps, per uid, which slots have a fate (the
first one counts; a later one is a duplicate). At the end, every fed prompt is either complete
(each slot has a fate), or held by a live replica (its slots without a fate are in flight), or
neither: ``unaccounted``. A message is held by someone until it is acknowledged, and it is
acknowledged only after its fate was reported, so ``unaccounted`` is 0 in a run without bugs,
whatever was killed (a stage that drops data without a report is such a bug: the run fails and
says which prompts). A feeder reports ``fed`` just after its send, so one killed in between
leaves prompts others saw but the book did not: those count as fed (``fed_reports_lost``).

Counts are per supervisor process (a resumed run keeps the earlier ledgers in
``summary.json``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["NO_SIGNAL", "TRAINED", "LedgerBook", "LedgerReporter"]

TRAINED = "trained"
NO_SIGNAL = "no_signal"  # in a step, advantage 0: no passes (learner.skip_no_signal)
_IN_STEPS = (TRAINED, NO_SIGNAL)  # fates that are not drops
ROLLED_BACK = "rolled_back"
DONE_BEFORE = "done_before"
_NONE, _FATED, _ROLLED, _COPIED = 0, 1, 2, 3  # a slot's state in the book
_PROVISIONAL = {_ROLLED: ROLLED_BACK, _COPIED: DONE_BEFORE}  # states a real fate replaces
_EXAMPLES = 10  # uids named when the ledger does not balance
_AFTER_EXIT = "after-exit:"  # sessions of what a replica's state file says it held


class LedgerReporter:
    """A replica's side: each call publishes one ``ledger`` message at once (synchronously),
    except ``fed``: the prompts a feeder sends in one turn of its event loop go as one message
    at the end of that turn (before anything that arrives later is handled there, so before
    their acknowledgements), or before any other report, whichever comes first.

    ``publish(payload)`` queues a control-bus message (``ControlClient.publish_nowait`` with the
    replica's stage, replica and session added). Messages without a uid (from producers that
    keep no ledger) are not reported.
    """

    _FED_MAX = 512  # uids in one `fed` message at most

    def __init__(self, publish: Callable[[dict[str, Any]], Any]) -> None:
        self._raw_publish = publish
        self._fed: list[str] = []

    def fed(self, uid: str) -> None:
        if not self._fed:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no event loop: nothing to wait for
                self._raw_publish({"fed": [uid]})
                return
        self._fed.append(uid)
        if len(self._fed) >= self._FED_MAX:
            self.flush()

    def flush(self) -> None:
        """Publish the ``fed`` uids not published yet."""
        if self._fed:
            uids, self._fed = self._fed, []
            self._raw_publish({"fed": uids})

    def _publish(self, payload: dict[str, Any]) -> None:
        self.flush()  # reports stay in the order they were made
        self._raw_publish(payload)

    def fates(
        self,
        slots: Iterable[tuple[str | None, int, int]],
        reason: str,
        *,
        step: int | None = None,
    ) -> None:
        """``slots``: (uid, group_size, sample_index) that ended as ``reason``."""
        rows = [[u, n, i] for u, n, i in slots if isinstance(u, str)]
        if rows:
            self._publish({"fates": rows, "reason": reason, "step": step})

    def consumed(self, uid: str | None) -> None:
        """A stage that keeps no ledger of its own processed a message of this prompt: the
        prompt ends there (its open slots count as ``consumed``)."""
        if isinstance(uid, str):
            self._publish({"consumed": uid})

    def copies(self, uid: str | None, size: Any, indexes: Iterable[Any]) -> None:
        """A copy of work done before (the same prompt, fed or made again after a crash) was
        dropped: its samples ``indexes`` of a group of ``size``."""
        rows = [i for i in indexes if isinstance(i, int)]
        if isinstance(uid, str) and isinstance(size, int) and rows:
            self._publish({"copies": rows, "uid": uid, "size": size})

    def rollback(self, step: int) -> None:
        self._publish({"rollback": step})

    def checkpoint(self, step: int) -> None:
        self._publish({"checkpoint": step})

    def report(self, held: list[str], counters: Mapping[str, int], *, final: bool) -> None:
        self._publish({"held": held, "counters": dict(counters), "final": final})


class LedgerBook:
    """The supervisor's side: takes ``ledger`` messages, balances at the end."""

    def __init__(self) -> None:
        self.slots: dict[str, bytearray | None] = {}  # fed uid -> slot states (None: no fate yet)
        self.buckets: Counter[str] = Counter()  # trained, and dropped reasons, in samples
        # the learner's fates in steps not yet saved: step -> (uid, index, reason)
        self.by_step: dict[int, list[tuple[str, int, str]]] = {}
        self.refed = 0
        self.copies = 0  # samples, recognized and dropped as copies
        self.duplicates: Counter[str] = Counter()  # fates for slots that had one, by 2nd reason
        self.duplicate_examples: list[str] = []
        # uids with fates but not (yet) reported fed: reports of different replicas may come
        # in any order (the feeder reports after its send), so only at the end is this a bug
        self.unfed: set[str] = set()
        self.sessions: dict[str, dict[str, Any]] = {}  # session -> last counters/held/final
        self.saved_step = -1

    def __bool__(self) -> bool:
        return bool(self.slots or self.unfed)

    # ------------------------------------------------------------------ taking reports
    def take(self, payload: Mapping[str, Any]) -> str | None:
        """Apply one ``ledger`` message; returns a problem (the message is ignored) or None."""
        try:
            if "fed" in payload:
                for uid in payload["fed"]:
                    self._fed(_uid(uid))
            elif "fates" in payload:
                reason, step = payload["reason"], payload.get("step")
                if not isinstance(reason, str) or not reason:
                    return "fates without a reason"
                self._fates(payload["fates"], reason, step)
            elif "consumed" in payload:
                self._consumed(_uid(payload["consumed"]), str(payload.get("stage")))
            elif "copies" in payload:
                uid, size = _uid(payload["uid"]), int(payload["size"])
                for index in payload["copies"]:
                    self._copy(uid, size, int(index))
            elif "rollback" in payload:
                self._rollback(int(payload["rollback"]))
            elif "checkpoint" in payload:
                self._saved(int(payload["checkpoint"]))
            elif "held" in payload:
                session = str(payload.get("session"))
                held = [_uid(u) for u in payload["held"]]
                counters = {str(k): int(v) for k, v in dict(payload.get("counters", {})).items()}
                self.sessions[session] = {
                    "who": f"{payload.get('stage')}.{payload.get('replica')}",
                    "held": held,
                    "counters": counters,
                    "final": bool(payload.get("final")),
                }
            else:
                return "no known entry"
        except (KeyError, TypeError, ValueError) as exc:
            return f"malformed: {exc!r}"[:200]
        return None

    def _fed(self, uid: str) -> None:
        if uid in self.unfed:
            self.unfed.discard(uid)
        elif uid in self.slots:
            self.refed += 1
        else:
            self.slots[uid] = None

    def _known(self, uid: str) -> None:
        if uid not in self.slots:
            self.slots[uid] = None
            self.unfed.add(uid)

    def _fates(self, rows: Iterable[Any], reason: str, step: Any) -> None:
        """``_fate`` for each ``[uid, size, index]`` row of a message, the common case (a new
        fate for a fed prompt) without a call per row: a learner step reports 256 rows, a
        few thousand messages a run."""
        slots, fate = self.slots, self._fate
        tracked = self.by_step.setdefault(step, []) if self._may_roll_back(step) else None
        fated = 0
        try:
            for uid, size, index in rows:
                states = slots.get(uid, False) if type(uid) is str else False
                if states is None and type(size) is int and size > 0:  # its first fate
                    states = slots[uid] = bytearray(size)
                if (
                    not states
                    or type(index) is not int
                    or not 0 <= index < len(states)
                    or states[index] != _NONE
                ):  # a duplicate, an unfed uid, a bad row: one fate at a time
                    fate(_uid(uid), int(size), int(index), reason, step)
                    continue
                states[index] = _FATED
                fated += 1
                if tracked is not None:
                    tracked.append((uid, index, reason))
        finally:  # a bad row stops the message where it is, as one fate at a time would
            if fated:
                self.buckets[reason] += fated
            if tracked is not None and not tracked:
                del self.by_step[step]

    def _may_roll_back(self, step: Any) -> bool:
        """Whether fates of ``step`` are the learner's, in a step not yet saved."""
        return isinstance(step, int) and step > self.saved_step

    def _fate(self, uid: str, size: int, index: int, reason: str, step: Any) -> None:
        self._known(uid)
        states = self.slots[uid]
        if states is None:
            states = self.slots[uid] = bytearray(max(size, 1))
        if not 0 <= index < len(states):
            raise ValueError(f"sample_index {index} outside its group of {len(states)}")
        state = states[index]
        if state == _FATED:
            self.duplicates[reason] += 1
            if len(self.duplicate_examples) < _EXAMPLES:
                self.duplicate_examples.append(f"{uid}#{index} {reason}")
            return
        if state in _PROVISIONAL:  # trained again after a rollback, or the original after a copy
            self.buckets[_PROVISIONAL[state]] -= 1
        states[index] = _FATED
        self.buckets[reason] += 1
        if self._may_roll_back(step):  # the learner's
            self.by_step.setdefault(step, []).append((uid, index, reason))

    def _copy(self, uid: str, size: int, index: int) -> None:
        """A copy dropped: counted; and a slot with no fate in this ledger (its original was
        finished by an earlier process of the run, before a resume) ends as ``done_before``
        unless the original's own fate comes later."""
        self.copies += 1
        self._known(uid)
        states = self.slots[uid]
        if states is None:
            states = self.slots[uid] = bytearray(max(size, 1))
        if 0 <= index < len(states) and states[index] == _NONE:
            states[index] = _COPIED
            self.buckets[DONE_BEFORE] += 1

    def _consumed(self, uid: str, stage: str) -> None:
        self._known(uid)
        states = self.slots[uid]
        if states is None:  # no slots known: the prompt is one unit
            self.slots[uid] = bytearray([_FATED])
            self.buckets[f"consumed_by_{stage}"] += 1
            return
        for i, state in enumerate(states):
            if state != _FATED:
                states[i] = _FATED
                self.buckets[f"consumed_by_{stage}"] += 1

    def _rollback(self, step: int) -> None:
        for s in [s for s in self.by_step if s > step]:
            for uid, index, reason in self.by_step.pop(s):
                states = self.slots[uid]
                assert states is not None
                if states[index] != _FATED:
                    continue
                states[index] = _ROLLED
                self.buckets[reason] -= 1
                self.buckets[ROLLED_BACK] += 1

    def _saved(self, step: int) -> None:
        self.saved_step = max(self.saved_step, step)
        for s in [s for s in self.by_step if s <= step]:
            del self.by_step[s]

    def custody_after_exit(self, who: str, held: list[str]) -> str:
        """What a replica that did not end cleanly still holds, as its own state on disk says
        (a stage's ``held_after_exit``); returns the session name to balance with."""
        session = f"{_AFTER_EXIT}{who}"
        self.sessions[session] = {"who": who, "held": held, "counters": {}, "final": True}
        return session

    # ------------------------------------------------------------------ balancing
    def missing_finals(self, sessions: Iterable[str]) -> list[str]:
        """Of ``sessions`` (that ended cleanly), those whose final report has not arrived."""
        return [s for s in sessions if not self.sessions.get(s, {}).get("final")]

    def balance(
        self, live_sessions: Iterable[str] | None = None, died: Iterable[str] = ()
    ) -> dict[str, Any]:
        """The ledger now. ``live_sessions``: the sessions whose ``held`` counts (those that
        ended cleanly, at the end; None: every session's latest report, for a running view).
        ``died``: the replicas (``stage.replica``) a process of which did not end cleanly (down
        at the end, or restarted). A feeder's ``fed`` report goes out after its send, so one
        SIGKILLed in between has fed prompts the book never heard of: a uid of such a feeder (its
        name before the ``:``) that has fates or that a live replica holds was fed all the same
        (``fed_reports_lost``)."""
        wanted = None if live_sessions is None else set(live_sessions)
        held: set[str] = set()
        held_live: set[str] = set()  # held by replicas' own reports: certainly fed
        counters: Counter[str] = Counter()
        for session, entry in self.sessions.items():
            counters.update(entry["counters"])
            if wanted is None or session in wanted:
                held.update(entry["held"])
                if not session.startswith(_AFTER_EXIT):  # a state file's: maybe never fed
                    held_live.update(entry["held"])
        lost_with = set(died)
        unfed = {u for u in self.unfed if _feeder_of(u) not in lost_with}
        lost = len(self.unfed) - len(unfed)
        if lost_with:
            unreported = [u for u in held_live - self.slots.keys() if _feeder_of(u) in lost_with]
            lost += len(unreported)
        else:
            unreported = []
        in_flight = complete = 0
        prompts_in_flight = len(unreported)
        missing: list[tuple[str, int]] = []  # (uid, slots without a fate; -1: every slot)
        for uid, states in self.slots.items():
            if uid in unfed:
                continue
            open_slots = -1 if states is None else states.count(_NONE)
            if open_slots == 0:
                complete += 1
            elif uid in held:
                if states is None:
                    prompts_in_flight += 1
                else:
                    in_flight += open_slots
            else:
                missing.append((uid, open_slots))
        dropped = {k: v for k, v in sorted(self.buckets.items()) if k not in _IN_STEPS and v}
        ledger: dict[str, Any] = {
            "prompts_fed": len(self.slots) - len(unfed) + len(unreported),
            **({"fed_reports_lost": lost} if lost else {}),
            "prompts_refed": self.refed,
            "prompts_complete": complete,
            "prompts_in_flight_at_end": prompts_in_flight,
            "samples": {
                TRAINED: self.buckets[TRAINED],
                NO_SIGNAL: self.buckets[NO_SIGNAL],
                "dropped": dropped,
                "in_flight_at_end": in_flight,
            },
            "copies_dropped": self.copies,
            "duplicate_fates": dict(self.duplicates),
            **({"duplicate_examples": self.duplicate_examples} if self.duplicate_examples else {}),
            "transport": {k: v for k, v in sorted(counters.items()) if v},
            # prompts: fed, neither complete nor held; or with fates but never fed
            "unaccounted": len(missing) + len(unfed),
        }
        if missing or unfed:
            ledger["unaccounted_detail"] = {
                "prompts_without_every_fate": len(missing),
                "samples_without_a_fate": sum(n for _, n in missing if n > 0),
                "prompts_without_any_fate": sum(1 for _, n in missing if n < 0),
                "prompts_never_fed_with_fates": len(unfed),
                "examples": [u for u, _ in missing[:_EXAMPLES]]
                + list(unfed)[: max(0, _EXAMPLES - len(missing))],
            }
        return ledger

    def running(self) -> dict[str, Any]:
        """A cheap view for the periodic ``ledger`` event."""
        pending = sum(1 for s in self.slots.values() if s is None or _NONE in s)
        dropped = sum(v for k, v in self.buckets.items() if k not in _IN_STEPS)
        return {
            "prompts_fed": len(self.slots) - len(self.unfed),
            "prompts_open": pending,
            "trained": self.buckets[TRAINED],
            "no_signal": self.buckets[NO_SIGNAL],
            "dropped": dropped,
            "copies_dropped": self.copies,
            "duplicate_fates": sum(self.duplicates.values()),
        }


def _feeder_of(uid: str) -> str:
    """The replica that fed ``uid`` (a feeder's uids are ``stage.replica:position``)."""
    return uid.rpartition(":")[0]


def _uid(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"uid should be a str, got {type(value).__name__}")
    return value
