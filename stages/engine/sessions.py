"""SGLang's sessions on the built-in engine: ``/open_session``, ``/close_session`` and
``/generate``'s ``session_params``, as SGLang 0.5.23 keeps them
(``session/session_controller.py``, non-streaming sessions; ``managers/scheduler.py``
``handle_generate_request``; ``tokenizer_control_mixin.open_session``).

A session is a tree of the requests sent in it, by ``rid``. A request whose ``session_params``
name a session continues one of them (``rid``) or none:

- its prompt is that request's prompt and output (without the output, with
  ``drop_previous_output``), cut to ``offset`` tokens when one is given, then its own ids (a
  leading BOS taken off); with no ``rid``, its own ids alone;
- ``replace``: the request named (and everything sent after it in its branch) is aborted where
  it still runs, and its branch cut; with no ``rid``, every request of the session;
- it joins the tree under the request it continues, whatever its own end (an abort included).

A session that does not exist, a ``rid`` the session does not hold, a request that continues one
still running, or an empty prompt after all that: 400 in SGLang's words. Streaming sessions
(``streaming: true``) are refused as SGLang refuses them without ``--enable-streaming-session``;
the prefix cache reuses the KV of a session's earlier turns as it does any request's.

Different on purpose: SGLang 0.5.23's ``replace`` without a ``rid`` deletes from the session's
dictionary while iterating over it, which raises in its scheduler; here it clears the session.
A ``session_params`` key SGLang's ``SessionParams`` does not have, or a field of the wrong type,
is a 400 naming it (SGLang fails later, with a 500). One prompt, one sample a request: a batch
or ``n`` > 1 with a session is refused (400). A streamed request refused here gets the 400
too, where SGLang streams one abort chunk with it. A replaced request still running adds its
prompt alone to the new one's (its output is not known yet).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

__all__ = ["Recording", "SessionError", "Sessions"]

log = structlog.get_logger("stages.engine.sessions")

# SessionParams' fields and the types a request may give them (None: the field unset)
_PARAMS: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "rid": (str,),
    "offset": (int,),
    "replace": (bool,),
    "drop_previous_output": (bool,),
}


class SessionError(ValueError):
    """A session request that SGLang answers with 400 and this message."""


@dataclass(eq=False)
class _Node:
    """A request sent in a session: its prompt, its output once it ended, its children."""

    rid: str
    input_ids: list[int]
    parent: _Node | None = None
    children: list[_Node] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    previous: _Node | None = None  # the session's node of the same rid it took the place of

    def __post_init__(self) -> None:
        if self.parent is not None:
            self.parent.children.append(self)


@dataclass(eq=False)
class _Session:
    session_id: str
    capacity_of_str_len: int
    timeout: float | None
    last_active: float = field(default_factory=time.monotonic)
    nodes: dict[str, _Node] = field(default_factory=dict)


class Sessions:
    """The sessions of one engine. ``abort(rids)``: the scheduler's abort of running requests
    (what ``replace`` cuts)."""

    def __init__(self, abort: Callable[[list[str]], Any]) -> None:
        self._abort = abort
        self._sessions: dict[str, _Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    # -- /open_session and /close_session ---------------------------------------------------
    def open(self, body: dict[str, Any]) -> str:
        """The id of a new session (``OpenSessionReqInput``: ``capacity_of_str_len``,
        ``session_id``, ``streaming``, ``timeout``); SessionError in SGLang's words."""
        self._reap()
        if body.get("streaming"):
            raise SessionError(
                "Streaming sessions are disabled. Please relaunch with --enable-streaming-session."
            )
        session_id = body.get("session_id")
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif session_id in self._sessions:
            log.warning("session_exists", session_id=session_id[:100])
            raise SessionError(
                "Failed to open the session. Check if a session with the same id is still open."
            )
        self._sessions[session_id] = _Session(
            session_id, body["capacity_of_str_len"], body.get("timeout")
        )
        log.info("session_opened", session_id=session_id[:100], active=len(self._sessions))
        return session_id

    def close(self, session_id: str) -> None:
        """Close it (one that does not exist: logged, as SGLang logs it)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            log.warning("session_not_found", session_id=session_id[:100])
            return
        running = [n.rid for n in session.nodes.values() if not n.finished]
        if running:  # SGLang's non-streaming close leaves them to end; nothing more joins
            log.info("session_closed_running", session_id=session_id[:100], running=len(running))
        log.info("session_closed", session_id=session_id[:100], active=len(self._sessions))

    # -- /generate ----------------------------------------------------------------------------
    def request(
        self, body: Any, scheduler: Any, encode: Callable[[str], list[int]] | None, bos: int | None
    ) -> tuple[Any, Any]:
        """A ``/generate`` body and the scheduler to serve it with: as they are without a
        session; with one, the body's prompt the session's (its ``input_ids``, its ``rid`` set)
        and a scheduler whose submission records the request's output in the session. Raises
        SessionError (400) and RequestError (a malformed body)."""
        if not isinstance(body, dict) or "session_params" not in body:
            return body, scheduler
        params = check_params(body["session_params"])
        body = {**body, "session_params": None}
        if params.get("id") is None:
            return body, scheduler
        sampling = body.get("sampling_params")
        n = sampling.get("n", 1) if isinstance(sampling, dict) else 1
        if n not in (None, 1) or _batched(body):
            raise SessionError(
                "session_params: a session request takes one prompt and one sample (n 1)"
            )
        ids = body.get("input_ids")
        if ids is None and isinstance(body.get("text"), str):
            if encode is None:
                raise SessionError("text: this model has no tokenizer: send input_ids")
            ids = encode(body["text"])
        if not isinstance(ids, list):
            raise SessionError("input_ids: a session request gives one prompt, as ids or text")
        rid = body.get("rid")
        if not isinstance(rid, str):
            rid = uuid.uuid4().hex
        prompt, node = self.prompt(params, ids, rid, bos)
        body.pop("text", None)
        body.update(input_ids=prompt, rid=rid)
        return body, Recording(scheduler, self, node)

    def prompt(
        self, params: dict[str, Any], input_ids: list[int], rid: str, bos: int | None
    ) -> tuple[list[int], _Node]:
        """The prompt of a request of session ``params["id"]`` and its node in the session's
        tree, which ``ended`` completes; SessionError for what SGLang aborts with 400."""
        session_id = params["id"]
        self._reap()
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(f"Invalid request: session id {session_id} does not exist")
        nodes, rid_of = session.nodes, params.get("rid")
        last: _Node | None = None
        if params.get("replace"):
            if rid_of is None:
                for node in list(nodes.values()):
                    if node.rid in nodes:
                        self._clear(node, nodes)
            elif rid_of not in nodes:
                raise SessionError("Invalid request session id")
            else:
                last = nodes[rid_of]
                if not last.finished:
                    self._abort([last.rid])
                for child in last.children:
                    self._clear(child, nodes)
                last.children = []
        elif rid_of is not None:
            if rid_of not in nodes:
                raise SessionError("Invalid request session id")
            last = nodes[rid_of]
            if not last.finished:
                log.warning("session_append_to_running", rid=rid_of[:100])
                raise SessionError(
                    "Session request is appending to a request that hasn't finished."
                )
        ids = list(input_ids)
        if last is not None:
            if ids and bos is not None and ids[0] == bos:
                ids = ids[1:]
            history = list(last.input_ids)
            if not params.get("drop_previous_output"):
                history += last.output_ids
            offset = params.get("offset")
            ids = (history[:offset] if offset else history) + ids
        if not ids:
            raise SessionError(
                "A session request must contain input tokens after restoring history."
            )
        session.last_active = time.monotonic()
        node = _Node(rid, ids, parent=last, previous=nodes.get(rid))
        nodes[rid] = node
        return ids, node

    def forget(self, node: _Node) -> None:
        """``node``'s request was refused before it ran: out of its session's tree."""
        for session in self._sessions.values():
            if session.nodes.get(node.rid) is node:
                if node.previous is None:
                    del session.nodes[node.rid]
                else:  # a rid sent again, refused (one in flight): the earlier one stays
                    session.nodes[node.rid] = node.previous
        if node.parent is not None and node in node.parent.children:
            node.parent.children.remove(node)

    @staticmethod
    def ended(node: _Node, output_ids: list[int]) -> None:
        """The request of ``node`` ended with ``output_ids`` (however it ended)."""
        node.output_ids, node.finished = list(output_ids), True

    def _clear(self, node: _Node, nodes: dict[str, _Node]) -> None:
        """``node`` and the requests after it out of the session, those still running
        aborted (``SessionReqNode.clear``)."""
        for child in node.children:
            self._clear(child, nodes)
        if not node.finished:
            self._abort([node.rid])
        if nodes.get(node.rid) is node:
            del nodes[node.rid]

    def _reap(self) -> None:
        """Close the sessions idle past their ``timeout`` (SGLang's ``maybe_reap``)."""
        now = time.monotonic()
        for session_id, session in list(self._sessions.items()):
            if session.timeout is not None and now - session.last_active > session.timeout:
                log.info("session_timed_out", session_id=session_id[:100])
                self.close(session_id)


def check_params(params: Any) -> dict[str, Any]:
    """``session_params`` as ``SessionParams`` takes them: an object of its fields (None:
    none); SessionError naming what it does not take."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise SessionError("session_params: expected an object of SessionParams' fields")
    for key, value in params.items():
        if key not in _PARAMS:
            raise SessionError(f"session_params.{key}: SessionParams has no such field")
        wanted = _PARAMS[key]
        bad_int = isinstance(value, bool) and int in wanted and bool not in wanted
        if value is not None and (not isinstance(value, wanted) or bad_int):
            raise SessionError(f"session_params.{key}: expected {wanted[0].__name__} or null")
    return params


def _batched(body: dict[str, Any]) -> bool:
    ids, text = body.get("input_ids"), body.get("text")
    return isinstance(text, list) or (
        isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    )


class Recording:
    """A scheduler whose next submission (one request's) records its output in its session
    node when it ends; everything else is the scheduler's."""

    def __init__(self, scheduler: Any, sessions: Sessions, node: _Node) -> None:
        self._scheduler, self._sessions, self._node = scheduler, sessions, node
        self.submitted = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def submit_async(self, inputs: Any, stream: Any = None) -> Any:
        future = self._scheduler.submit_async(inputs, stream=stream)
        self.submitted = True
        future.add_done_callback(self._ended)
        return future

    def _ended(self, future: Any) -> None:
        results = None if future.cancelled() or future.exception() else future.result()
        self._sessions.ended(self._node, results[0].output_ids if results else [])

    def refused(self) -> None:
        """The request was refused before it was submitted: its node goes."""
        if not self.submitted:
            self._sessions.forget(self._node)
