"""SGLang's request logging and request dumps on the built-in engine, as SGLang 0.5.23 has them
(``utils/request_logger.py``, ``TokenizerManager.dump_requests`` and
``dump_requests_before_crash``, ``ConfigureLoggingReq``).

- ``--log-requests``: every generating request is logged when it comes (``Receive: obj=...``)
  and each of its samples when it ends (``Finish: obj=..., out=...``), the sample's own part of
  a batch as ``obj``, its answer (what ``/generate`` answers for it) as ``out``. The native
  routes and the ``/v1`` ones alike, which build on ``/generate``'s; at level 2 or more a
  ``/v1`` request is also logged as it came (``Receive OpenAI: obj=...``).
- ``--log-requests-level``: 0 the metadata (no prompt, output or sampling parameters), 1 with
  the sampling parameters, 2 everything with strings and lists cut to 2048 (their halves),
  3 everything. From level 2 a sample given as ``input_ids`` is logged at its end with its
  prompt's ``text`` too (SGLang fills it in after the first line).
- ``--log-requests-format json``: one JSON object a line (``timestamp``, ``event``:
  ``request.received``, ``request.finished``, ``request.received.openai``, ``rid``, ``obj``,
  ``out``), long strings and lists cut in the middle with ``...``. In both, watermark keys
  are ``<redacted>`` (``watermarking.core.redact_watermark_secrets``), in dumps too.
- ``--log-requests-target``: ``stdout`` (the default) and/or folders, each written to
  ``HOSTNAME_0.log`` there, rotated hourly. The whitelisted request headers
  (``x-smg-routing-key`` and those in ``SGLANG_LOG_REQUEST_HEADERS``, comma-separated) are
  logged with them; with ``SGLANG_LOG_REQUEST_EXCEEDED_MS`` only samples that took at least that
  long are logged as finished.
- ``POST /configure_logging`` (``log_requests``, ``log_requests_level``,
  ``log_requests_format``, ``log_level``, ``dump_requests_folder``,
  ``dump_requests_threshold``, ``dump_requests_exclude_meta_keys``, ``crash_dump_folder``)
  changes these while the engine serves.
- Request dumps (``dump_requests_folder``): every finished sample is kept as ``(obj, out,
  created, finished)`` (wall-clock seconds), and each ``dump_requests_threshold`` of them (1000)
  are pickled to ``FOLDER/YYYY-MM-DD_HH-MM-SS.pkl`` as ``{"server_args", "config_updates",
  "resolved_config", "requests"}``, without the ``meta_info`` keys of
  ``dump_requests_exclude_meta_keys`` (``routed_experts`` and ``hidden_states``).
- Crash dumps (``--crash-dump-folder``): the samples that finished in the last 5 minutes are
  kept; when a model step fails (where SGLang's server dies, this engine fails what was in
  flight and serves on), they and the samples in flight then (with their output so far) are
  pickled to
  ``FOLDER/HOSTNAME/crash_dump_YYYY-MM-DD_HH-MM-SS.pkl`` (with ``launch_command`` too).

Unlike SGLang's, ``obj`` is the request's JSON body (with its ``rid``s), not SGLang's
``GenerateReqInput`` dataclass, so the text form prints it as a dict; what each level leaves
out is the same. A ``log_requests_level`` other than 0-3 or an unknown ``log_level`` is
SGLang's 500, and nothing is changed (SGLang keeps the level it could not use).
"""

from __future__ import annotations

import collections
import json
import logging
import logging.handlers
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import structlog

from pipeline.structured_log import set_process_level

__all__ = [
    "LEVELS",
    "Logged",
    "RequestLog",
    "entry",
    "for_json",
    "limits",
    "redacted",
    "truncated",
]

log = structlog.get_logger("stages.engine.request_log")

LEVELS = (0, 1, 2, 3)
EXCEEDED_ENV = "SGLANG_LOG_REQUEST_EXCEEDED_MS"
HEADERS_ENV = "SGLANG_LOG_REQUEST_HEADERS"
_DEFAULT_HEADERS = ("x-smg-routing-key",)
_CRASH_WINDOW_S = 300.0  # SGLang keeps the requests of the last 5 minutes for a crash dump
_INPUTS = ("text", "input_ids", "input_embeds", "image_data", "audio_data", "video_data")
# what levels 0 and 1 leave out of obj (1 keeps the sampling parameters) and of out
_SKIPPED = {
    0: frozenset((*_INPUTS, "lora_path", "sampling_params")),
    1: frozenset((*_INPUTS, "lora_path")),
}
_OUT_SKIPPED = frozenset(("text", "output_ids", "embedding"))
# the keys of a batch request that hold one value per prompt (GenerateReqInput.__getitem__)
_PER_PROMPT = frozenset(
    (
        *_INPUTS,
        "sampling_params",
        "watermark",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "return_sampling_mask",
        "sampling_logprobs_mode",
        "return_hidden_states",
        "modalities",
        "lora_path",
        "lora_id",
        "custom_logit_processor",
        "extra_key",
        "cache_salt",
    )
)


def limits(level: int) -> tuple[int, frozenset[str], frozenset[str]]:
    """What ``level`` logs (``RequestLogger._compute_metadata``): the longest string or list
    kept whole, the keys left out of ``obj`` and those left out of ``out``; ValueError for a
    level SGLang does not know."""
    if level in _SKIPPED:
        return 1 << 30, _SKIPPED[level], _OUT_SKIPPED
    if level == 2:
        return 2048, frozenset(), frozenset()
    if level == 3:
        return 1 << 30, frozenset(), frozenset()
    raise ValueError(f"Invalid --log-requests-level: self.log_requests_level={level!r}")


_SECRETS = frozenset(("watermark_key", "watermark_key_b", "watermark_config"))
_HOLDERS = frozenset(("watermark", "sampling_params", "preferred_sampling_params"))
_SCALARS = frozenset((int, float, str, bool, bytes, type(None)))


def redacted(value: Any, in_watermark: bool = False) -> Any:
    """``value`` with its watermark secrets as ``<redacted>``, as SGLang logs and dumps
    requests (``watermarking.core.redact_watermark_secrets``): the value of a key named
    ``watermark_key``, ``watermark_key_b`` or ``watermark_config`` at any depth, and ``key`` and
    ``key_b`` under ``watermark``."""
    if isinstance(value, dict):
        return {
            k: "<redacted>"
            if k in _SECRETS or (in_watermark and k in ("key", "key_b"))
            else redacted(v, in_watermark or k == "watermark")
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        if _SCALARS.issuperset(map(type, value)):
            return list(value) if isinstance(value, list) else value
        items = [v if type(v) in _SCALARS else redacted(v, in_watermark) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _field(name: str, value: Any) -> Any:
    """A dict's value under ``name``, redacted as SGLang's ``_redact_field`` does."""
    if name in _SECRETS:
        return "<redacted>"
    if name in _HOLDERS:
        return redacted(value, name == "watermark")
    return value


_MARKED = _SECRETS | {"watermark"}
_PLAIN = frozenset((str, int, float, bool, type(None)))
_NUMBERS = frozenset((int, float, bool, type(None)))


def _untouched(data: Any, max_length: int) -> bool:
    """Whether ``data`` renders as itself: no string or list longer than ``max_length``, no
    watermark secret, only JSON's types (then ``truncated`` is its ``repr`` and ``for_json``
    the value itself, as SGLang's functions give, at a fraction of their cost)."""
    kind = type(data)
    if kind in _PLAIN:
        return kind is not str or len(data) <= max_length
    if kind is dict:
        return all(k not in _MARKED and _untouched(v, max_length) for k, v in data.items())
    if kind is list:  # (a tuple: for_json's is a list)
        if len(data) > max_length:
            return False
        return _NUMBERS.issuperset(map(type, data)) or all(_untouched(v, max_length) for v in data)
    return False


def _shown(data: dict[str, Any], skip: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in skip} if skip else data


def truncated(data: Any, max_length: int = 2048, skip: Iterable[str] = ()) -> str:
    """``data`` as SGLang's text lines print it (``_dataclass_to_string_truncated``): strings
    as ``repr``, a string or list longer than ``max_length`` as its first and last halves,
    a dict's keys but ``skip`` (at the top only), watermark secrets redacted."""
    if isinstance(data, str):
        if len(data) > max_length:
            half = max_length // 2
            return f"{data[:half]!r} ... {data[-half:]!r}"
        return repr(data)
    if isinstance(data, list | tuple):
        if len(data) > max_length:
            half = max_length // 2
            return f"{redacted(data[:half])} ... {redacted(data[-half:])}"
        return str(redacted(data))
    if isinstance(data, dict):
        skipped = frozenset(skip)
        if _untouched(data, max_length):
            return repr(_shown(data, skipped))
        parts = (
            f"'{k}': {truncated(_field(k, v), max_length)}"
            for k, v in data.items()
            if k not in skipped
        )
        return "{" + ", ".join(parts) + "}"
    return str(redacted(data))


def for_json(data: Any, max_length: int = 2048, skip: Iterable[str] = ()) -> Any:
    """``data`` as SGLang's JSON lines hold it (``_transform_data_for_logging``): a string
    longer than ``max_length`` as its halves joined by ``...``, a list as its halves with a
    ``"..."`` between them, a dict without ``skip`` (at the top only), watermark secrets
    redacted, what JSON has no type for as its ``str``."""
    if isinstance(data, str):
        if len(data) > max_length:
            half = max_length // 2
            return data[:half] + "..." + data[-half:]
        return data
    if isinstance(data, list | tuple):
        if len(data) > max_length:
            half = max_length // 2
            return (
                [for_json(v, max_length) for v in data[:half]]
                + ["..."]
                + [for_json(v, max_length) for v in data[-half:]]
            )
        return [for_json(v, max_length) for v in data]
    if isinstance(data, dict):
        skipped = frozenset(skip)
        if _untouched(data, max_length):
            return _shown(data, skipped)
        return {k: for_json(_field(k, v), max_length) for k, v in data.items() if k not in skipped}
    if data is None or isinstance(data, int | float | bool):
        return data
    return str(redacted(data))


def entry(
    requests: RequestLog | None,
    body: dict[str, Any],
    rids: Iterable[str],
    listed: bool,
    headers: Any = None,
) -> Logged | None:
    """``body`` logged as received in ``requests`` (an engine's request log; None: none) where
    it is active: its entry for ``finished`` and ``ended``, else None (``rids`` not read)."""
    if requests is None or not requests.active:
        return None
    return requests.received(body, list(rids), listed, headers)


def _targets(names: list[str] | None) -> list[logging.Logger]:
    """SGLang's log targets (``log_utils.create_log_targets``): stdout, or per folder its
    ``HOSTNAME_0.log`` rotated hourly; each line ``[YYYY-MM-DD HH:MM:SS] message``."""
    out = []
    for name in names or ["stdout"]:
        if name.lower() == "stdout":
            logger_name, make = f"{__name__}.stdout", lambda: logging.StreamHandler(sys.stdout)
        else:
            os.makedirs(name, exist_ok=True)
            path = os.path.join(name, f"{socket.gethostname()}_0.log")
            logger_name = f"{__name__}.file.{name}.{socket.gethostname()}_0"

            def make(path: str = path) -> logging.Handler:
                return logging.handlers.TimedRotatingFileHandler(
                    path, when="H", backupCount=0, encoding="utf-8"
                )

        logger = logging.getLogger(logger_name)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        if not logger.handlers:
            handler = make()
            handler.setFormatter(
                logging.Formatter("[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
            )
            logger.addHandler(handler)
        out.append(logger)
    return out


def _batched(body: dict[str, Any]) -> int:
    """How many prompts ``body`` holds as a batch (0: a single prompt)."""
    text = body.get("text")
    if isinstance(text, list):
        return len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return 0


class Logged:
    """A request as it was logged when it came: its body, its samples' rids, when it came and
    its whitelisted headers; which samples are still running (for a crash dump)."""

    __slots__ = ("body", "created", "headers", "prompts", "rids", "running")

    def __init__(self, body: dict[str, Any], rids: list[str], headers: dict[str, str]) -> None:
        self.body = body
        self.rids = rids
        self.headers = headers
        self.prompts = _batched(body)
        self.created = time.time()
        self.running = set(range(len(rids)))

    def whole(self, listed: bool) -> dict[str, Any]:
        """The request as its received line shows it: its rid(s), then its body's keys."""
        rid: Any = self.rids if listed else self.rids[0]
        return {"rid": rid, **{k: v for k, v in self.body.items() if k != "rid"}}

    def sample(self, index: int) -> dict[str, Any]:
        """Sample ``index``'s own request: its rid, and of a batch's per-prompt keys its
        prompt's value (``GenerateReqInput.__getitem__``)."""
        out: dict[str, Any] = {"rid": self.rids[index]}
        count = self.prompts
        prompt = index // max(1, len(self.rids) // count) if count else 0
        for key, value in self.body.items():
            if key == "rid":
                continue
            if count and key in _PER_PROMPT and isinstance(value, list) and len(value) == count:
                value = value[prompt]
            out[key] = value
        return out


class RequestLog:
    """The engine's request logging and dumps (see the module's docstring). Called on the
    loops that serve requests (the server's; in the generator's process, the generator's too)
    and, for a crash dump, on the scheduler thread; ``active`` is false while there is nothing
    to log or keep."""

    def __init__(
        self,
        *,
        log_requests: bool = False,
        level: int = 2,
        fmt: str = "text",
        targets: list[str] | None = None,
        crash_dump_folder: str | None = None,
        decode: Callable[[list[int], bool], str] | None = None,
        server_args: dict[str, Any] | None = None,
    ) -> None:
        self.launched = {  # the launch's settings, as /server_info reports them
            "log_requests": log_requests,
            "log_requests_level": level,
            "log_requests_format": fmt,
            "log_requests_target": targets,
            "crash_dump_folder": crash_dump_folder,
        }
        self.log_requests = log_requests
        self.level = level
        self.format = fmt
        self.target_names = targets
        self.limits = limits(level) if log_requests else (0, frozenset(), frozenset())
        self.targets = _targets(targets) if log_requests else []
        self.decode = decode
        self.server_args = dict(server_args or {})
        self.config_updates: dict[str, Any] = {}  # /set_internal_state's, for the dumps
        extra = [h for h in os.environ.get(HEADERS_ENV, "").split(",") if h.strip()]
        self.headers = (*_DEFAULT_HEADERS, *(h.strip().lower() for h in extra))
        self.exceeded_ms = float(os.environ.get(EXCEEDED_ENV, "0") or 0)
        self.dump_folder = ""
        self.dump_threshold = 1000
        self.dump_exclude = ["routed_experts", "hidden_states"]
        self.dumped: list[tuple[Any, ...]] = []
        self.crash_folder = crash_dump_folder or ""
        self.recent: collections.deque[tuple[Any, ...]] = collections.deque()
        self.open: dict[int, Logged] = {}  # the requests in flight, for a crash dump
        # the bookkeeping is shared by the loops that serve requests (an engine in the
        # generator's process has two) and the scheduler thread (crash dumps)
        self._lock = threading.Lock()
        self.active = self._is_active()

    def _is_active(self) -> bool:
        return bool(self.log_requests or self.dump_folder or self.crash_folder)

    # -- /configure_logging ------------------------------------------------------------------
    def configure(self, fields: dict[str, Any]) -> None:
        """Apply ``/configure_logging``'s fields (None: unchanged). ValueError, with nothing
        changed, for a level SGLang refuses (a 500 there)."""
        log_requests = fields.get("log_requests")
        level = fields.get("log_requests_level")
        log_level = fields.get("log_level")
        on = self.log_requests if log_requests is None else log_requests
        new_level = self.level if level is None else level
        new_limits = limits(new_level) if on else (0, frozenset(), frozenset())
        if log_level is not None:  # SGLang's root logger level (ValueError: unknown)
            set_process_level(log_level)
        self.log_requests, self.level, self.limits = on, new_level, new_limits
        if fields.get("log_requests_format") is not None:
            self.format = fields["log_requests_format"]
        if on and not self.targets:
            self.targets = _targets(self.target_names)
        if fields.get("dump_requests_folder") is not None:
            self.dump_folder = fields["dump_requests_folder"]
        if fields.get("dump_requests_threshold") is not None:
            self.dump_threshold = fields["dump_requests_threshold"]
        if fields.get("dump_requests_exclude_meta_keys") is not None:
            self.dump_exclude = list(fields["dump_requests_exclude_meta_keys"])
        if fields.get("crash_dump_folder") is not None:
            self.crash_folder = fields["crash_dump_folder"]
        self.active = self._is_active()
        log.info("request_logging_configured", **{k: v for k, v in fields.items() if v is not None})

    # -- requests ----------------------------------------------------------------------------
    def received(
        self, body: dict[str, Any], rids: list[str], listed: bool, headers: Any = None
    ) -> Logged:
        """A request that came (its samples' ``rids``), logged; its token for ``finished``."""
        wanted = self._wanted(headers)
        logged = Logged(body, rids, wanted)
        if self.log_requests:
            whole = logged.whole(listed)
            head = {"rid": whole["rid"]}
            self._log_obj("request.received", "Receive", whole, self.limits[1], wanted, head)
        if self.crash_folder:
            with self._lock:
                self.open[id(logged)] = logged
        return logged

    def received_openai(self, body: Any, headers: Any = None) -> None:
        """A ``/v1`` request as it came, before it became a generating one (level 2 or more;
        ``log_openai_received_request``: cut at 2048 unless the level says otherwise)."""
        if not self.log_requests or self.level < 2:
            return
        if isinstance(body, dict):  # as SGLang's model_dump(exclude_none=True) leaves out
            body = {k: v for k, v in body.items() if v is not None}  # (its defaults aside)
        wanted = self._wanted(headers)
        self._log_obj("request.received.openai", "Receive OpenAI", body, frozenset(), wanted)

    def _wanted(self, headers: Any) -> dict[str, str]:
        """The whitelisted ones of a request's ``headers`` (None: none)."""
        if headers is None:
            return {}
        return {h: v for h in self.headers if (v := headers.get(h))}

    def _log_obj(
        self,
        event: str,
        label: str,
        obj: Any,
        skip: frozenset[str],
        headers: dict[str, str],
        head: dict[str, Any] | None = None,
    ) -> None:
        """A request as it came: ``event`` (JSON, after ``head``) or ``label: obj=...``."""
        max_length = self.limits[0]
        if self.format == "json":
            data: dict[str, Any] = {**(head or {}), "obj": for_json(obj, max_length, skip)}
            if headers:
                data["headers"] = headers
            self._json(event, data)
        else:
            shown = f", headers={headers}" if headers else ""
            self._line(f"{label}: obj={truncated(obj, max_length, skip)}{shown}")

    def finished(self, logged: Logged, index: int, out: dict[str, Any]) -> None:
        """Sample ``index`` of ``logged`` ended with the answer ``out``."""
        with self._lock:
            logged.running.discard(index)
            if not logged.running:
                self.open.pop(id(logged), None)
        if not self._is_active():
            return
        obj = logged.sample(index)
        if self.level >= 2 and "text" not in obj and self.decode is not None:
            ids = obj.get("input_ids")
            if isinstance(ids, list) and all(type(t) is int for t in ids):
                obj["text"] = self.decode(ids, False)
        now = time.time()
        if self.log_requests:
            self._log_finished(logged, obj, out)
        with self._lock:
            if self.dump_folder:
                self._keep(obj, out, logged.created, now)
            if self.crash_folder:
                self.recent.append((obj, out, logged.created, now))
                while self.recent and now - self.recent[0][3] >= _CRASH_WINDOW_S:
                    self.recent.popleft()

    def finished_all(self, logged: Logged, answers: list[dict[str, Any]], first: int = 0) -> None:
        """Samples ``first``, ``first + 1``... of ``logged`` ended with ``answers``."""
        for index, answer in enumerate(answers, first):
            self.finished(logged, index, answer)

    def ended(self, logged: Logged) -> None:
        """``logged`` is over, whatever became of the samples not logged as finished (a
        refusal, a client gone): no crash dump lists them as running."""
        with self._lock:
            self.open.pop(id(logged), None)

    def _log_finished(self, logged: Logged, obj: dict[str, Any], out: dict[str, Any]) -> None:
        meta = out.get("meta_info") or {}
        if self.exceeded_ms > 0 and (meta.get("e2e_latency") or 0) * 1000 < self.exceeded_ms:
            return
        max_length, skip, out_skip = self.limits
        if self.format == "json":
            data: dict[str, Any] = {"rid": obj["rid"], "obj": for_json(obj, max_length, skip)}
            if logged.headers:
                data["headers"] = logged.headers
            data["out"] = for_json(out, max_length, out_skip)
            self._json("request.finished", data)
            return
        shown = f", headers={logged.headers}" if logged.headers else ""
        self._line(
            f"Finish: obj={truncated(obj, max_length, skip)}{shown}, "
            f"out={truncated(out, max_length, out_skip)}"
        )

    def _json(self, event: str, data: dict[str, Any]) -> None:
        line = json.dumps(
            {"timestamp": datetime.now().isoformat(), "event": event, **data},
            ensure_ascii=False,
            default=str,
        )
        self._line(line)

    def _line(self, message: str) -> None:
        for target in self.targets:  # the logger's handlers, without looking up the caller
            record = logging.LogRecord(target.name, logging.INFO, __file__, 0, message, None, None)
            for handler in target.handlers:
                handler.handle(record)

    # -- dumps -------------------------------------------------------------------------------
    def _keep(self, obj: dict[str, Any], out: dict[str, Any], created: float, now: float) -> None:
        meta, exclude = out.get("meta_info"), self.dump_exclude
        if exclude and isinstance(meta, dict) and any(k in meta for k in exclude):
            out = {**out, "meta_info": {k: v for k, v in meta.items() if k not in exclude}}
        self.dumped.append((obj, out, created, now))
        if len(self.dumped) >= self.dump_threshold:
            stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
            path = os.path.join(self.dump_folder, f"{stamp}.pkl")
            log.info("requests_dumped", requests=len(self.dumped), path=path)
            data = self._dump_data(self.dumped)
            self.dumped = []
            threading.Thread(target=self._write, args=(path, data), daemon=True).start()

    def _so_far(self, ids: list[int] | None) -> dict[str, Any]:
        """A sample in flight's output so far, as SGLang's ``get_crash_dump_output``."""
        if not ids:
            return {}
        if self.decode is None:
            return {"output_ids": list(ids)}
        return {"text": self.decode(ids, True), "output_ids": list(ids)}

    def _dump_data(self, requests: list[tuple[Any, ...]]) -> dict[str, Any]:
        return {
            "server_args": dict(self.server_args),
            "config_updates": dict(self.config_updates),
            "resolved_config": {**self.server_args, **self.config_updates},
            "requests": redacted(list(requests)),
        }

    def _write(self, path: str, data: dict[str, Any]) -> None:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "wb") as f:
                pickle.dump(data, f)
        except (OSError, pickle.PicklingError, TypeError) as exc:
            log.error("request_dump_failed", path=path, error=repr(exc))

    def crash_dump(self, why: str, outputs: dict[str, list[int]] | None = None) -> str | None:
        """Pickle the samples of the last 5 minutes and those in flight (``--crash-dump-folder``;
        a model step failed; called on the scheduler thread, before what was in flight is
        failed): the file written, or None (no folder, nothing to dump). ``outputs``: the
        output ids so far of the samples in flight, by rid, each listed with them (and their
        text) as SGLang lists its last chunk; ``{}`` for one without."""
        if not self.crash_folder:
            return None
        now = time.time()
        with self._lock:
            running = [
                (logged.sample(i), self._so_far((outputs or {}).get(logged.rids[i])),
                 logged.created, now)
                for logged in self.open.values()
                for i in sorted(logged.running)
            ]  # fmt: skip
            recent = list(self.recent)
        requests = [*recent, *running]
        if not requests:
            return None
        stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        path = os.path.join(self.crash_folder, socket.gethostname(), f"crash_dump_{stamp}.pkl")
        data = self._dump_data(requests)
        data["launch_command"] = list(sys.argv)
        self._write(path, data)
        log.error(
            "requests_dumped_before_crash",
            finished=len(recent),
            unfinished=len(running),
            path=path,
            why=why,
        )
        return path
