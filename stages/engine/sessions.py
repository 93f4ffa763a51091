"""SGLang's sessions on the built-in engine: ``/open_session``, ``/close_session`` and
``/generate``'s ``session_params`` (which ``/v1/completions`` and ``/v1/chat/completions`` pass
on, as SGLang's ``serving_completions`` and ``serving_chat``), as SGLang 0.5.23 keeps them
(``session/session_controller.py``, non-streaming sessions; ``managers/scheduler.py``
``handle_generate_request``; ``tokenizer_control_mixin.open_session``).

A session is a tree of the requests sent in it, by ``rid``. A request whose ``session_params``
name a session continues one of them (``rid``) or none:

- its prompt is that request's prompt and output (without the output, with
  ``drop_previous_output``), cut to ``offset`` tokens when one is given, then its own ids (a
  leading BOS taken off); with no ``rid``, its own ids alone;
- ``replace``: the request named (and everything sent after it in its branch) is aborted where
  it still runs, and its branch cut; with no ``rid``, every request of the session;
- it joins the tree under the request it continues, whatever its own end (an abort included);
- on a vision model its images are those of the history it keeps, then its own (``image_data``).

A session that does not exist, a ``rid`` the session does not hold, a request that continues one
still running, or an empty prompt after all that: 400 in SGLang's words.

A streaming session (``streaming: true``, with the engine's ``--enable-streaming-session``,
else refused as SGLang refuses it) runs one turn at a time, each appended to the last turn that
ended well (``rid`` not read); an aborted turn leaves it as it was; ``replace``,
``drop_previous_output`` and ``offset`` are refused there, in SGLang's words, and a close while a
turn runs waits for its end. The prefix cache reuses the KV of a session's earlier turns as it
does any request's (SGLang keeps a streaming session's in a slot of its own).

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

from stages.engine.images import image_lists

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
    session: _Session | None = None  # a streaming session's turn (committed when it ends well)
    # its prompt's images (``image_data`` items, in order): its history's, then its own
    images: list[Any] = field(default_factory=list)

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
    streaming: bool = False  # one turn at a time, each appended to the last that ended well
    inflight: bool = False  # a streaming session's turn runs
    closing: bool = False  # closed while its turn ran: it goes when the turn ends


class Sessions:
    """The sessions of one engine. ``abort(rids)``: the scheduler's abort of running requests
    (what ``replace`` cuts)."""

    def __init__(self, abort: Callable[[list[str]], Any], *, streaming: bool = False) -> None:
        self._abort = abort
        self._streaming = streaming  # --enable-streaming-session
        self._sessions: dict[str, _Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    # -- /open_session and /close_session ---------------------------------------------------
    def open(self, body: dict[str, Any]) -> str:
        """The id of a new session (``OpenSessionReqInput``: ``capacity_of_str_len``,
        ``session_id``, ``streaming``, ``timeout``); SessionError in SGLang's words."""
        self._reap()
        streaming = bool(body.get("streaming"))
        if streaming and not self._streaming:
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
            session_id, body["capacity_of_str_len"], body.get("timeout"), streaming=streaming
        )
        log.info("session_opened", session_id=session_id[:100], active=len(self._sessions))
        return session_id

    def close(self, session_id: str) -> None:
        """Close it (one that does not exist: logged, as SGLang logs it)."""
        session = self._sessions.get(session_id)
        if session is None:
            log.warning("session_not_found", session_id=session_id[:100])
            return
        if session.inflight:  # SGLang defers it until the turn ends
            session.closing = True
            log.info("session_close_deferred", session_id=session_id[:100])
            return
        del self._sessions[session_id]
        running = [n.rid for n in session.nodes.values() if not n.finished]
        if running:  # SGLang's non-streaming close leaves them to end; nothing more joins
            log.info("session_closed_running", session_id=session_id[:100], running=len(running))
        log.info("session_closed", session_id=session_id[:100], active=len(self._sessions))

    # -- /generate ----------------------------------------------------------------------------
    def request(
        self,
        body: Any,
        scheduler: Any,
        encode: Callable[[str], list[int]] | None,
        bos: int | None,
        image_spans: Callable[[list[int]], list[tuple[int, int]]] | None = None,
    ) -> tuple[Any, Any]:
        """A ``/generate`` body and the scheduler to serve it with: as they are without a
        session; with one, the body's prompt the session's (its ``input_ids``, its ``rid`` set)
        and a scheduler whose submission records the request's output in the session. Raises
        SessionError (400) and RequestError (a malformed body). A request of a non-streaming
        session carries the session's id on as ``session_id`` (with the server's
        ``--enable-session-radix-cache`` its KV is held for the session, as SGLang's).

        On a vision model (``image_spans(ids)``: where ``ids`` hold an image, its first and
        last index), a request's images are its history's, as far as its ``offset`` keeps
        them, then its own (``image_data``), as SGLang's session carries a request's
        ``multimodal_inputs`` on; its history is the ids the model ran (its images' pads
        expanded). An ``offset`` that ends inside an image is a SessionError."""
        if not isinstance(body, dict):
            return body, scheduler
        if body.get("session_id") is not None and body.get("session_params") is not None:
            raise SessionError("session_id and session_params cannot both be set.")  # SGLang's
        if "session_params" not in body:
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
        own = None if image_spans is None else image_lists(body.get("image_data"), 1, False)[0]
        prompt, node = self.prompt(params, ids, rid, bos, own, image_spans)
        body.pop("text", None)
        body.update(input_ids=prompt, rid=rid)
        if node.images:
            body["image_data"] = node.images
        if node.session is None:  # not a streaming session's turn (SGLang holds none for those)
            body["session_id"] = params["id"]
        return body, Recording(scheduler, self, node)

    def prompt(
        self,
        params: dict[str, Any],
        input_ids: list[int],
        rid: str,
        bos: int | None,
        images: list[Any] | None = None,
        image_spans: Callable[[list[int]], list[tuple[int, int]]] | None = None,
    ) -> tuple[list[int], _Node]:
        """The prompt of a request of session ``params["id"]`` and its node in the session's
        tree, which ``ended`` completes; SessionError for what SGLang aborts with 400.
        ``images``: the request's own (``request``), after those of its history that it
        keeps."""
        session_id = params["id"]
        self._reap()
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(f"Invalid request: session id {session_id} does not exist")
        if session.closing:
            raise SessionError(f"Invalid request: close was requested for session {session_id}")
        nodes, rid_of = session.nodes, params.get("rid")
        last: _Node | None = None
        if session.streaming:
            last = _streaming_turn(session, params)
        elif params.get("replace"):
            if rid_of is None:
                for node in list(nodes.values()):
                    if nodes.get(node.rid) is node:  # not cleared as a descendant yet
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
        kept: list[Any] = []
        if last is not None:
            if ids and bos is not None and ids[0] == bos:
                ids = ids[1:]
            history = list(last.input_ids)
            if not params.get("drop_previous_output"):
                history += last.output_ids
            offset = params.get("offset")
            kept = last.images
            if offset and kept and image_spans is not None:
                cut = len(history[:offset])
                spans = image_spans(history)
                inside = [k for k, (first, end) in enumerate(spans) if first < cut <= end]
                if inside:
                    raise SessionError(
                        f"session_params.offset: {offset} ends inside image {inside[0]} of the "
                        f"session's history (its tokens {spans[inside[0]][0]} to "
                        f"{spans[inside[0]][1]})"
                    )
                kept = kept[: sum(end < cut for _, end in spans)]
            if offset:
                history = history[:offset]
            ids = history + ids
        kept = kept + (images or [])
        if not ids:
            raise SessionError(
                "A session request must contain input tokens after restoring history."
            )
        session.last_active = time.monotonic()
        if session.streaming:  # the session's turn, committed when it ends well
            session.inflight = True
            return ids, _Node(rid, ids, session=session, images=kept)
        node = _Node(rid, ids, parent=last, previous=nodes.get(rid), images=kept)
        nodes[rid] = node
        return ids, node

    def forget(self, node: _Node) -> None:
        """``node``'s request was refused before it ran: out of its session's tree (a streaming
        session's turn: the session free for the next)."""
        if node.session is not None:
            self.ended(node, [], aborted=True)
            return
        for session in self._sessions.values():
            if session.nodes.get(node.rid) is node:
                if node.previous is None:
                    del session.nodes[node.rid]
                else:  # a rid sent again, refused (one in flight): the earlier one stays
                    session.nodes[node.rid] = node.previous
        if node.parent is not None and node in node.parent.children:
            node.parent.children.remove(node)

    def ended(self, node: _Node, output_ids: list[int], aborted: bool = False) -> None:
        """The request of ``node`` ended with ``output_ids`` (``aborted``: ended so); a
        streaming session's turn that ended well becomes the one the next appends to, an aborted
        one leaves the session as it was (SGLang's ``finish_req`` and ``abort_req``)."""
        node.output_ids, node.finished = list(output_ids), True
        session = node.session
        if session is None:
            return
        session.inflight = False
        if not aborted:
            session.nodes = {node.rid: node}
        if session.closing:
            session.closing = False
            self.close(session.session_id)

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


def _streaming_turn(session: _Session, params: dict[str, Any]) -> _Node | None:
    """The turn a streaming session's next request appends to (None: its first); its rid is
    not read. SessionError for what SGLang refuses in one."""
    if session.inflight:
        raise SessionError("Streaming session already has an active request.")
    for key, what in (("replace", "replace"), ("drop_previous_output", "drop_previous_output")):
        if params.get(key):
            raise SessionError(f"Streaming sessions do not support {what}.")
    if params.get("offset"):
        raise SessionError("Streaming sessions do not support offset.")
    return next(iter(session.nodes.values()), None)


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
        if inputs and inputs[0].images is not None:  # the ids it runs: its pads expanded
            self._node.input_ids = list(inputs[0].input_ids)
        future = self._scheduler.submit_async(inputs, stream=stream)
        self.submitted = True
        future.add_done_callback(self._ended)
        return future

    def _ended(self, future: Any) -> None:
        results = None if future.cancelled() or future.exception() else future.result()
        if not results:
            self._sessions.ended(self._node, [], aborted=True)
            return
        reason = results[0].finish_reason or {}
        self._sessions.ended(self._node, results[0].output_ids, reason.get("type") == "abort")

    def refused(self) -> None:
        """The request was refused before it was submitted: its node goes."""
        if not self.submitted:
            self._sessions.forget(self._node)
