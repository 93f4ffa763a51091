"""The weight routes of the built-in engine: SGLang's weight-update group
(``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``), its update session (``/begin_weight_update``,
``/end_weight_update``), ``/update_weights_from_tensor`` (``stages.engine.tensor_payloads``),
``/update_weights_from_disk``, ``/update_weight_version``, ``/get_weights_by_name`` and
``/weights_checker`` (``stages.engine.weight_checker``); ``/update_weights_from_ipc`` is refused
(``update_from_ipc``). On a generating engine's scheduler, or a pooling engine's thread
(``stages.engine.pooling_weights``).

Answers are SGLang's: ``{"success", "message"}``, HTTP 400 on failure.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from aiohttp import web

from pipeline.processes import name_thread
from stages.engine.checkpoint_files import CheckpointError, read_weights, weight_files
from stages.engine.control_fields import (
    BEGIN_UPDATE,
    CHECK_WEIGHTS,
    DESTROY_GROUP,
    END_UPDATE,
    INIT_GROUP,
    INIT_SEND_GROUP,
    SEND_WEIGHTS,
    UPDATE_DISK,
    UPDATE_DISTRIBUTED,
    UPDATE_IPC,
    UPDATE_TENSOR,
    UPDATE_VERSION,
    WEIGHTS_BY_NAME,
    typed_body,
)
from stages.engine.memory_offload import MemoryStateError
from stages.engine.model_weights import WeightLoadError, update_names
from stages.engine.remote_instance import SendGroups
from stages.engine.request_body import (
    bad_request,
    failure,
    json_response,
)
from stages.engine.scheduler import Scheduler
from stages.engine.tensor_payloads import LOAD_FORMATS, PayloadError, named_tensors
from stages.engine.weight_checker import WeightChecker, WeightCheckError
from stages.weights.daemon_thread import in_daemon_thread

__all__ = ["WeightRoutes", "check_weights"]

log = structlog.get_logger("stages.engine.weight_routes")

# how long a send to a remote instance waits for an open weight-update session to end
SESSION_WAIT_S = 60.0


class WeightRoutes:
    """The weight routes: tensors arrive through ``stages.weights.receiver``, or are read from
    a checkpoint folder (``update_from_disk``).

    Receiving runs in a worker thread of its own (named ``engine-weights`` for the operating
    system, as the scheduler's is ``engine``) so decoding goes on while the bytes arrive; the
    tensors are then loaded by the scheduler at its next step boundary, and the HTTP answer
    comes only once they are in the model. Updates are serialized: they must match the publisher's
    broadcasts one for one. Joining a group waits in a daemon thread of its own
    (``engine-weight-join``), so a join whose publisher died never holds up the next one.
    """

    def __init__(self, scheduler: Scheduler, model_path: str) -> None:
        self.scheduler = scheduler
        self.model_path = model_path  # /model_info's: the last checkpoint loaded from disk
        self.receivers: dict[str, Any] = {}
        self._joining: dict[str, object] = {}  # group -> its latest pending join's ticket
        self._stopping = asyncio.Event()  # set when the server shuts down (stop_joining)
        self.lock = asyncio.Lock()
        self.session: str | None = None  # an open update session's selector (begin ... end)
        self._no_session = asyncio.Event()  # set while none is open
        self._no_session.set()
        self.checker = WeightChecker()  # /weights_checker: used on the scheduler thread
        self._thread = ThreadPoolExecutor(1, initializer=name_thread, initargs=("engine-weights",))
        # remote-instance weight sends (remote_instance): groups, and their own thread
        self._send_groups: SendGroups | None = None
        self._remote_thread: ThreadPoolExecutor | None = None

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def init_group(self, request: web.Request) -> web.Response:
        body = await typed_body(request, INIT_GROUP)
        if isinstance(body, web.Response):
            return body
        address, port = body["master_address"], body["master_port"]
        rank_offset, world_size = body["rank_offset"], body["world_size"]
        # InitWeightsUpdateGroupReqInput's defaults
        group = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if group in self.receivers:
            return failure(f"group_name: group {group!r} is already initialized")
        from stages.weights.receiver import WeightReceiver  # torch.distributed: only when used

        receiver = WeightReceiver()
        rank = rank_offset + 0  # this engine is tp_rank 0 of its own (single-rank) model group
        # A join waits in a thread of its own, outside the lock: one whose host died (a learner
        # killed mid-join) retries the dead store for its whole timeout, and must hold up
        # neither updates nor the next join. A newer join of the same group supersedes it.
        ticket = object()
        if group in self._joining:
            log.warning("weights_group_join_superseded", group=group)
        self._joining[group] = ticket
        log.info("weights_group_joining", group=group, rank=rank, master=f"{address}:{port}")
        joined = in_daemon_thread(
            lambda: receiver.init_group(address, port, rank, world_size, group, backend),
            name="engine-weight-join",
            discard=lambda _: receiver.destroy(),
        )
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((joined, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not joined.done():  # the engine stops
                return failure("init_weights_update_group failed: the engine is shutting down")
            joined.result()
        except Exception as exc:
            log.exception("weights_group_init_failed", group=group, error=repr(exc))
            return failure(f"init_weights_update_group failed: {exc}")
        finally:
            stopping.cancel()
            joined.cancel()  # (if still waiting: its group, should it form, is let go)
            current = self._joining.get(group) is ticket
            if current:
                del self._joining[group]
        if not current or group in self.receivers:
            receiver.destroy()
            return failure(
                f"group_name: a newer request joined group {group!r} while this one waited"
            )
        self.receivers[group] = receiver
        log.info(
            "weights_group_ready",
            group=group,
            rank=rank,
            world_size=world_size,
            backend=backend,
            master=f"{address}:{port}",
        )
        return web.json_response({"success": True, "message": "Succeeded to initialize group."})

    async def begin(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's ``/begin_weight_update``: open the session that distributed updates
        load in (there it restores weights packed for inference; here there is nothing to
        restore). ``selector``: ``target``, ``draft`` or ``all`` (this engine has no draft)."""
        body = await typed_body(request, BEGIN_UPDATE)
        if isinstance(body, web.Response):
            return body
        selector = body.get("selector", "all")
        if self.session is not None:
            return failure(
                "a weight-update session is already open; call end_weight_update() first"
            )
        self.session = selector
        self._no_session.clear()
        if self.scheduler.turns is not None:  # the session's exchanges wait for no step
            self.scheduler.turns.suspend()
        return web.json_response({"success": True, "message": "Success"})

    async def end(self, request: web.Request) -> web.Response:
        """``/end_weight_update``: close the session (the buckets are already in the model)."""
        body = await typed_body(request, END_UPDATE)
        if isinstance(body, web.Response):
            return body
        if self.session is None:
            return failure("no weight-update session is open; call begin_weight_update() first")
        async with self.lock:  # after the updates still loading
            ended, self.session = self.session is not None, None
            self._no_session.set()
        if ended and self.scheduler.turns is not None:  # (once, whoever else ended it)
            self.scheduler.turns.resume()
        return web.json_response({"success": True, "message": "Success"})

    async def update(self, request: web.Request) -> web.Response:
        body = await typed_body(request, UPDATE_DISTRIBUTED)
        if isinstance(body, web.Response):
            return body
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        group = body.get("group_name", "weight_update_group")
        version = body.get("weight_version")
        load_format = body.get("load_format")
        flush = body.get("flush_cache", True)  # SGLang's defaults
        abort_all = body.get("abort_all_requests", False)
        # selector and torch_empty_cache: one model here, no draft; no CUDA cache on CPU
        if not len(names) == len(dtypes) == len(shapes):
            return failure("names: names, dtypes and shapes differ in length")
        base = body.get("base_version")  # Inflight's: a delta update's base (see below)
        if base is not None and not isinstance(base, (str, int)):
            return failure(f"base_version: expected a string, got {base!r}")
        if self.session is None:  # SGLang 0.5.23 refuses it outside a session, receiving nothing
            return failure(
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        receiver = self.receivers.get(group)
        if receiver is None:
            return failure(
                f"group_name: no weight update group {group!r}: call /init_weights_update_group "
                "first"
            )
        if abort_all:
            await asyncio.wrap_future(self.scheduler.abort(None, abort_all=True))
        # flush_cache empties the prefix cache only: the running rows keep their KV cache on
        # purpose (in-flight updates).
        try:
            async with self.lock:
                tensors = await self._in_thread(
                    receiver.receive, names, dtypes, shapes, load_format
                )
                # received in any case (the collective stays in step), applied only on top of
                # the version the delta was computed against; the publisher then sends in full
                held = self.scheduler.weight_version
                if base is not None and str(base) != held:
                    return failure(
                        f"update_weights_from_distributed: a delta against version {base}, but "
                        f"this engine holds version {held}: send the full weights"
                    )
                await asyncio.wrap_future(self.scheduler.apply_weights(tensors, version))
                if flush:
                    await asyncio.wrap_future(self.scheduler.flush_prefix_cache())
        except MemoryStateError as exc:  # received, not loaded: the weights are released
            return failure(f"update_weights_from_distributed failed: {exc}")
        except Exception as exc:
            log.exception("weights_update_failed", group=group, error=repr(exc))
            return failure(f"update_weights_from_distributed failed: {exc}")
        return web.json_response(
            {"success": True, "message": f"Succeeded to update {len(names)} parameter(s)."}
        )

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's ``/update_weights_from_tensor`` (``UpdateWeightsFromTensorReqInput``):
        tensors the caller holds in memory this process can map (CUDA IPC on a GPU, shared
        memory on CPU), one base64 payload per tensor-parallel rank in
        ``serialized_named_tensors`` (this engine reads the first), laid out as ``load_format``
        says (null, ``direct`` or ``flattened_bucket``: ``tensor_payloads``). Inside a
        ``/begin_weight_update`` session only, as there. The tensors are copied into the model
        at the scheduler's next step boundary, serialized with the other updates, before the
        answer: the caller may free them once it has it. ``abort_all_requests`` (false) aborts
        everything first; ``flush_cache`` (true) then empties the prefix cache;
        ``weight_version`` is live with the weights, and the message says so in SGLang's words.
        ``selector`` and ``torch_empty_cache`` are checked and change nothing (no draft model, no
        CUDA cache to empty here). Answers ``{success, message}``, 400 on failure, a payload
        that cannot be read included (what and where)."""
        body = await typed_body(request, UPDATE_TENSOR)
        if isinstance(body, web.Response):
            return body
        payloads = body["serialized_named_tensors"]  # bytes: the struct decodes the base64
        if not payloads:
            return failure("serialized_named_tensors: expected a payload per rank")
        data = payloads[0]
        load_format = body.get("load_format")
        flush = body.get("flush_cache", True)
        abort_all = body.get("abort_all_requests", False)
        version = body.get("weight_version")
        if load_format not in LOAD_FORMATS:  # SGLang's custom loaders are code it imports
            return failure(f"Unknown load_format={load_format}")
        if self.session is None:  # SGLang 0.5.23 refuses it outside a session, loading nothing
            return failure(
                "update_weights_from_tensor must run between begin_weight_update() and "
                "end_weight_update()"
            )
        if abort_all:
            await asyncio.wrap_future(self.scheduler.abort(None, abort_all=True))
        async with self.lock:
            try:
                tensors = await self._in_thread(named_tensors, data, load_format)
                await asyncio.wrap_future(self.scheduler.apply_weights(tensors, version))
                del tensors  # the sender's memory: no reference kept past the answer
            except PayloadError as exc:
                return failure(str(exc))
            except (WeightLoadError, MemoryStateError) as exc:
                return failure(f"update_weights_from_tensor failed: {exc}")
            except Exception as exc:
                log.exception("weights_from_tensor_failed", error=repr(exc))
                return failure(f"update_weights_from_tensor failed: {exc}")
            if flush:
                await asyncio.wrap_future(self.scheduler.flush_prefix_cache())
        message = "Success"
        if version is not None:
            message += f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": message})

    async def update_from_ipc(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's ``/update_weights_from_ipc`` (``UpdateWeightsFromIPCReqInput``:
        ``zmq_handles``, ``flush_cache``, ``weight_version``, ``torch_empty_cache``), the
        checkpoint-engine integration: SGLang's worker connects to the ZeroMQ socket named for
        its device's UUID and maps the CUDA IPC buffers checkpoint-engine's parameter server
        sends there (``checkpoint_engine/checkpoint_engine_worker.py``). This engine has no
        such worker (its CPU sharing is ``/update_weights_from_tensor``'s), so the update fails
        as SGLang's fails without the ``checkpoint-engine`` package: after the body's checks,
        400 ``{success: false, message: "IPC weight update failed: ..."}``, nothing loaded and
        the weight version left as it was (``weight_updater.update_weights_from_ipc``)."""
        body = await typed_body(request, UPDATE_IPC)
        if isinstance(body, web.Response):
            return body
        return failure(
            "IPC weight update failed: this engine does not take checkpoint-engine's IPC "
            "updates (CUDA IPC buffers per device); send the weights with "
            "/update_weights_from_distributed, /update_weights_from_tensor or "
            "/update_weights_from_disk"
        )

    async def init_send_group(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's ``/init_weights_send_group_for_remote_instance``
        (``InitWeightsSendGroupForRemoteInstanceReqInput``; ``weight_exporter.py``): host the
        group a new engine takes this one's weights through (``stages.engine.remote_instance``).
        Blocks until the other rank has joined; on a thread of its own, so weight updates and
        decoding go on meanwhile. Answers ``{success, message}``, 400 on failure."""
        body = await typed_body(request, INIT_SEND_GROUP)
        if isinstance(body, web.Response):
            return body
        ok, message = await self._remote(
            self._senders().init,
            body["master_address"],
            body["ports"],
            body["group_rank"],
            body["world_size"],
            body.get("group_name", "weight_send_group"),
            body.get("backend", "nccl"),
        )
        return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)

    async def send_weights(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's ``/send_weights_to_remote_instance``
        (``SendWeightsToRemoteInstanceReqInput``): broadcast every parameter through the group
        ``init_send_group`` made, in ``named_parameters`` order, then destroy it. The weights
        are read on a worker thread while decoding goes on; weight updates wait for it (they
        would change what is being sent) and so does a release of the weights. Answers
        ``{success, message, weight_version}`` (the version sent: Inflight's; SGLang answers
        the first two), 400 on failure."""
        body = await typed_body(request, SEND_WEIGHTS)
        if isinstance(body, web.Response):
            return body
        senders = self._senders()
        name, why = senders.known(body["ports"], body.get("group_name", "weight_send_group"))
        if name is None:
            return web.json_response({"success": False, "message": why}, status=400)
        try:
            async with self._between_sessions():
                try:
                    tensors = await asyncio.wrap_future(
                        self.scheduler.lend_weights("send_weights_to_remote_instance")
                    )
                except MemoryStateError as exc:
                    await self._remote(senders.drop, name)  # the new engine's receive fails
                    return web.json_response({"success": False, "message": str(exc)}, status=400)
                try:
                    version = self.scheduler.weight_version
                    ok, message = await self._remote(
                        senders.send, name, body["master_address"], tensors
                    )
                finally:
                    del tensors
                    self.scheduler.return_weights()
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            await self._remote(senders.drop, name)
            message = (
                f"Failed to send weights: a weight-update session stayed open for "
                f"{SESSION_WAIT_S:.0f} s (/begin_weight_update without /end_weight_update); the "
                "weights are sent between updates, never in the middle of one"
            )
            return web.json_response({"success": False, "message": message}, status=400)
        answer = {"success": ok, "message": message, "weight_version": version}
        return web.json_response(answer, status=200 if ok else 400)

    @contextlib.asynccontextmanager
    async def _between_sessions(self) -> AsyncIterator[None]:
        """Hold the update lock while no update session is open: every bucket of an update
        is in, or none is (a send between two buckets would send a mix of two versions under
        the older one's name). A session begun meanwhile waits for the lock to load. Raises
        TimeoutError when a session stays open ``SESSION_WAIT_S`` seconds."""
        while True:
            await asyncio.wait_for(self._no_session.wait(), SESSION_WAIT_S)
            async with self.lock:
                if self.session is None:
                    yield
                    return

    def _senders(self) -> SendGroups:
        if self._send_groups is None:
            device = next(self.scheduler.model.parameters()).device
            self._send_groups = SendGroups(device)
        return self._send_groups

    async def _remote(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the remote-instance thread (its collectives wait for another
        engine: updates, on the weights thread, do not wait behind them)."""
        if self._remote_thread is None:
            self._remote_thread = ThreadPoolExecutor(
                1, initializer=name_thread, initargs=("engine-remote",)
            )
        return await asyncio.get_running_loop().run_in_executor(self._remote_thread, fn, *args)

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await typed_body(request, DESTROY_GROUP)
        if isinstance(body, web.Response):
            return body
        group = body.get("group_name", "weight_update_group")
        receiver = self.receivers.pop(group, None)
        if receiver is None:
            return failure(f"group_name: no weight update group {group!r}")
        await self._in_thread(receiver.destroy)
        return web.json_response({"success": True, "message": "Succeeded to destroy group."})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        """SGLang's ``/update_weights_from_disk``: the weights of the checkpoint folder (or Hub
        repo) ``model_path``, read on the weights thread (``checkpoint_files``; ``load_format``
        null, ``auto``, ``safetensors`` or ``pt``), loaded by the scheduler between two decode
        steps as ``update_weights_from_distributed`` buckets are, and serialized with them:
        requests in flight go on with the new weights. SGLang 0.5.23 instead waits, unless
        generation is paused, for the requests in flight to end (the writer side of its
        ``model_update_lock``) and holds new ones back meanwhile; paused (``mode: in_place``)
        it loads at once, which is what this engine does between two steps.

        ``abort_all_requests`` (false) aborts everything first; ``weight_version`` is live once
        the weights are, and the message says so in SGLang's words; ``flush_cache`` (true) then
        empties the prefix cache (never refused here; SGLang fails the update when requests
        still run). ``is_async``, ``torch_empty_cache``, ``keep_pause``,
        ``recapture_cuda_graph``, ``token_step`` and ``manifest`` are type-checked and have no
        effect (no CUDA graphs or asynchronous loads here); unknown fields are ignored, as there.

        Answers ``{success, message, num_paused_requests: 0}``, 400 on failure (a body its
        struct cannot read: SGLang's validation answer, ``control_fields``). Every name and
        shape is checked before anything is written, so a checkpoint that does not fit leaves
        the model as it was (SGLang writes what fits, then reloads the old checkpoint to roll
        back). Tensors the model has no parameter of are skipped, as SGLang's model loaders
        skip them; a checkpoint with none it has is refused. After a success ``/model_info``'s
        ``model_path`` is ``model_path``; its ``served_model_name``, which SGLang moves too,
        stays (the ``/v1`` routes answer under it).
        """
        body = await typed_body(request, UPDATE_DISK)
        if isinstance(body, web.Response):
            return body
        path = body["model_path"]
        if not path.strip():
            return _from_disk(False, "model_path: expected a checkpoint folder or Hub repo id")
        load_format = body.get("load_format")
        abort_all = body.get("abort_all_requests", False)
        version = body.get("weight_version")
        flush = body.get("flush_cache", True)
        if abort_all:  # before waiting for other updates, as SGLang aborts before its lock
            await asyncio.wrap_future(self.scheduler.abort(None, abort_all=True))
        names = update_names(self.scheduler.model)
        async with self.lock:
            try:
                files = await self._in_thread(weight_files, path, load_format)
            except CheckpointError as exc:  # SGLang's words for a checkpoint it cannot find
                return _from_disk(False, f"Failed to get weights iterator: {exc}.")
            try:
                tensors, skipped = await self._in_thread(read_weights, files, names)
                await asyncio.wrap_future(self.scheduler.apply_weights(tensors, version))
            except (CheckpointError, WeightLoadError, MemoryStateError) as exc:
                return _from_disk(False, f"Failed to update weights: {exc}.")
            except Exception as exc:
                log.exception("weights_from_disk_failed", path=path, error=repr(exc))
                return _from_disk(False, f"Failed to update weights: {exc}.")
            if flush:
                await asyncio.wrap_future(self.scheduler.flush_prefix_cache())
        self.model_path = path
        log.info(
            "weights_loaded_from_disk",
            path=path,
            files=len(files),
            tensors=len(tensors),
            skipped=len(skipped),
            first_skipped=skipped[:4],
            weight_version=self.scheduler.weight_version,
        )
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return _from_disk(True, message)

    async def update_version(self, request: web.Request) -> web.Response:
        """SGLang's ``/update_weight_version``: ``new_version``, and ``abort_all_requests``
        (SGLang's default true: what runs is aborted first; a publisher says false)."""
        body = await typed_body(request, UPDATE_VERSION)
        if isinstance(body, web.Response):
            return body
        version = body["new_version"]
        if body.get("abort_all_requests", True):
            await asyncio.wrap_future(self.scheduler.abort(None, abort_all=True))
        await asyncio.wrap_future(self.scheduler.set_weight_version(version))
        return web.json_response(
            {
                "success": True,
                "message": f"Weight version updated to {version}",
                "new_version": str(version),
            }
        )

    async def weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``GET|POST /get_weights_by_name``: ``{name, truncate_size: 100}`` answers
        the parameter's first ``truncate_size`` rows (of a 1-D one, values) in float32 as a
        JSON list, as its model classes do (``weight.cpu().to(torch.float32).numpy().tolist()
        [:truncate_size]``); a name the model has no parameter of gets 400 ``{"error":
        {"message": "Get parameter by name failed"}}``, as there. Names are the checkpoint's
        (SGLang takes its fused ``qkv_proj`` and ``gate_up_proj`` names too). The scheduler
        reads it between two steps, so never in the middle of a weight update."""
        body = await typed_body(request, WEIGHTS_BY_NAME)
        if isinstance(body, web.Response):
            return body
        name, rows = body["name"], body.get("truncate_size", 100)
        try:
            found = await asyncio.wrap_future(self.scheduler.parameter_rows(name, rows))
        except MemoryStateError as exc:
            return bad_request(str(exc))
        if found is None:
            return bad_request("Get parameter by name failed")
        return json_response(found.tolist())

    async def check(self, request: web.Request) -> web.Response:
        """``/weights_checker`` (``check_weights``) on the scheduler's model, between two steps
        and after the weight updates already asked for."""

        async def run(fn: Callable[[Any], Any]) -> Any:
            async with self.lock:
                future = self.scheduler.with_weights("weights_checker", fn)
                return await asyncio.wrap_future(future)

        return await check_weights(request, self.checker, run)

    async def stop_joining(self, _app: web.Application) -> None:
        """The server's shutdown: joins still waiting fail now, not after their timeout (the
        server waits for every handler before it exits)."""
        self._stopping.set()

    async def close(self, _app: web.Application) -> None:
        for receiver in self.receivers.values():
            await self._in_thread(receiver.destroy)
        self.receivers.clear()
        if self._send_groups is not None:
            await self._in_thread(self._send_groups.close)
        self._thread.shutdown(wait=False)
        if self._remote_thread is not None:
            self._remote_thread.shutdown(wait=False)


def _from_disk(success: bool, message: str) -> web.Response:
    """``/update_weights_from_disk``'s answer (SGLang's ``UpdateWeightFromDiskReqOutput``)."""
    body = {"success": success, "message": message, "num_paused_requests": 0}
    return web.json_response(body, status=200 if success else 400)


async def check_weights(
    request: web.Request,
    checker: WeightChecker,
    run: Callable[[Callable[[Any], Any]], Awaitable[Any]],
) -> web.Response:
    """SGLang 0.5.23's ``GET|POST /weights_checker`` (``CheckWeightsReqInput``): ``action``
    (``checksum``, the default; ``snapshot``, ``reset_tensors``, ``compare``),
    ``skip_tensor_list`` (substrings of the names to leave out), ``allow_quant_error`` (read; no
    weight is quantized here) and ``selector`` (``target``, ``draft``, ``all``), done by
    ``checker`` on the model ``run(fn)`` hands to ``fn`` where nothing else touches it.

    Answers ``{success, message}`` (``"Success."``), with ``checksum`` also ``ranks`` (one
    rank: each tensor's digest, ``per_gpu_checksum``, ``parallelism_info``) and
    ``per_engine_checksum``; a failed action is 400 ``{success: false, message}`` (a compare
    that finds differences lists them), a body that is not a ``CheckWeightsReqInput`` a 400 in
    SGLang's validation layout. The body may be empty (GET)."""
    body = await typed_body(request, CHECK_WEIGHTS, optional=True)
    if isinstance(body, web.Response):
        return body
    action = body.get("action", "checksum")
    skip = body.get("skip_tensor_list")
    selector = body.get("selector", "all")
    try:
        answer = await run(
            lambda model: checker.handle(model, action, skip=skip or (), selector=selector)
        )
    except (WeightCheckError, MemoryStateError) as exc:
        return failure(str(exc))
    except Exception as exc:  # SGLang answers what the action raised, 400
        log.exception("weights_checker_failed", action=action, error=repr(exc))
        return failure(str(exc))
    return json_response({"success": True, "message": "Success.", **(answer or {})})
