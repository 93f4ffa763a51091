"""SGLang 0.5.23's expert-distribution recorder on the built-in engine: how many tokens each
forward pass routed to each expert of each layer, between ``/start_expert_distribution_record``
and ``/stop_expert_distribution_record``, written to a file by
``/dump_expert_distribution_record`` (what EPLB, expert placement and routing-balance studies
read). The routes (``GET`` or ``POST``, no body) answer 200 with SGLang's texts (``Start
recording the expert distribution.``, ``Stop recording the expert distribution.``, ``Dump
expert distribution record.``) once the scheduler has done it, between two steps, as SGLang's
scheduler does it between two batches.

Follows ``entrypoints/http_server.py`` (the routes), ``eplb/expert_distribution.py`` (the
recorder, its gatherers and accumulators, ``_dump_to_file``), ``managers/scheduler.py``
(``expert_distribution_handle``) and ``arg_groups/fields/exec_.py`` with
``arg_groups/parallel_hook.py`` (the flags and their resolution).

Flags. ``--expert-distribution-recorder-mode``:

- ``stat``: each pass's ``[layers, experts]`` int32 counts in a circular buffer of
  ``--expert-distribution-recorder-buffer-size`` passes (default 1000, as SGLang resolves it
  from ``eplb_rebalance_num_iterations``; -1, or any negative: a buffer that grows, from 128
  rows by doubling). A dump writes ``{rank: 0, logical_count, average_utilization_rate_over_
  window: None}``, ``logical_count`` the whole buffer, ``[buffer_size, layers, experts]`` int32
  on the engine's device (a growing buffer: ``[passes, layers, experts]``), to
  ``expert_distribution_recorder_{time.time()}.pt``. As SGLang's circular buffer, a reset
  zeroes it but keeps its cursor: pass ``i`` since the server started recording lies in row
  ``i mod buffer_size`` (a dump does not reorder them).
- ``per_pass``: a record per pass, ``{forward_pass_id, rank: 0, gatherer_key: "primary",
  global_physical_count}`` (``[layers, experts]`` int32 on the CPU).
- ``per_token``: a record per pass, ``{forward_pass_id, rank, gatherer_key, input_ids,
  positions, extend_seq_lens, forward_mode, topk_ids_of_layer, misc_objects: [],
  global_physical_count}``: the pass's tokens and positions (lists), each prefill row's new
  tokens (``None`` for a decode step), SGLang's ``ForwardMode`` value (1 ``EXTEND``: a prefill
  or scoring pass, 2 ``DECODE``), and every token's top-k ids in every layer, ``[layers,
  tokens, 8]`` int32, -1 where a layer routes nothing or k < 8 (SGLang's ``_TOP_K_NUM``; a
  model with k > 8 gets k columns, where SGLang's copy would fail).

``per_pass`` and ``per_token`` dump ``{records, last_physical_to_logical_map}`` (the identity
map ``[layers, experts]`` int64 on the engine's device: one copy of each expert, no redundant
ones) to ``expert_distribution_recorder_{time.time()}_0.pt``. Every dump goes to
``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` (default ``/tmp``; made if missing), read at the
dump, and resets the record (recording goes on if it was on). ``stat_approx`` is refused at
start-up: SGLang takes it only with DeepEP's normal dispatch (``--moe-a2a-backend deepep``),
and without one refuses to start (``NotImplementedError``); this engine dispatches no experts
across devices, and ``stat`` counts exactly.

What a pass counts. The experts each token of a pass was run with, in every layer: the
``top_k_index`` transformers' experts modules are called with (``routed_experts``), ids
outside ``[0, experts)`` left out, as SGLang's ``_SelectExpertsSinglePassGatherer`` masks them.
Dense layers (Qwen3-MoE's ``mlp_only_layers``, DeepSeek's first layers) count nothing. A pass
here is one call of the model: a prefill or scoring pass over a batch of prompts (its
left-padding is not counted: the scheduler tells the recorder each row's new tokens,
``extend``), or a decode step; SGLang's batches may mix the two, so its passes, and which
pass a token falls in, can differ; the totals over a record are the same for the same tokens
computed. Tokens a prompt takes from the prefix cache are not computed again and count
nothing, as SGLang's radix cache leaves them out.

What it costs. The counting is an ``index_add_`` of a pass's ids into a device tensor per
layer (no per-token Python, no device sync in ``stat``; ``per_pass`` and ``per_token`` copy a
pass's record to the CPU, as SGLang's). The hooks are on the model only while recording:
stopped, or without the flag, the passes run exactly as before.

Where it differs from SGLang. Without ``--expert-distribution-recorder-mode`` SGLang's no-op
recorder raises in its scheduler (``Please set ServerArgs.expert_distribution_recorder_mode
to use ExpertDistributionRecorder.``), which ends the server; this engine answers 400 with
those words and goes on. A dump it cannot write (the folder) is a 400 naming the file, and
the record is kept. ``forward_pass_id`` counts the passes run while recording (SGLang's
counts every pass since the start). ``--expert-balancedness-report-mode`` (SGLang 0.5.23's
successor of ``--enable-expert-distribution-metrics``: a per-pass balancedness of the expert
load over EP ranks, in the log or Prometheus) is not served: with one device it is always 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch
from aiohttp import web
from torch.utils.hooks import RemovableHandle

from stages.engine.request_body import bad_request
from stages.engine.routed_experts import decoder_layers, experts_module, top_k_name

__all__ = [
    "MODES",
    "ExpertDistributionRecorder",
    "ExpertDistributionRoutes",
    "RecordError",
    "recorder_buffer_flag",
    "recorder_mode_flag",
]

log = structlog.get_logger("stages.engine.expert_distribution")

MODES = ("stat", "stat_approx", "per_pass", "per_token")  # SGLang's choices
FLAG = "--expert-distribution-recorder-mode"
DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"
DEFAULT_BUFFER = 1000  # SGLang's, from eplb_rebalance_num_iterations' default
_EXTEND, _DECODE = 1, 2  # SGLang's ForwardMode values
_TOP_K_NUM = 8  # the columns of SGLang's per-token top-k buffer
# SGLang's no-op recorder's words (ExpertDistributionRecorder._on_not_implemented)
NOT_SET = (
    "Please set ServerArgs.expert_distribution_recorder_mode to use ExpertDistributionRecorder."
)


class RecordError(ValueError):
    """A recorder command that cannot be done: the message says why."""


def recorder_mode_flag(value: str) -> str:
    """``--expert-distribution-recorder-mode``'s value, checked (argparse's ``type``)."""
    if value == "stat_approx":
        raise argparse.ArgumentTypeError(
            "stat_approx: SGLang's approximate count comes from DeepEP's normal-mode dispatch "
            "(--moe-a2a-backend deepep) and SGLang refuses it without one; the built-in engine "
            "dispatches no experts across devices: use stat, which counts exactly"
        )
    if value not in MODES:
        raise argparse.ArgumentTypeError(
            f"{value!r}: not one of SGLang's modes stat, per_pass, per_token (stat_approx "
            "needs DeepEP)"
        )
    return value


def recorder_buffer_flag(value: str) -> int:
    """``--expert-distribution-recorder-buffer-size``'s value: passes kept, or < 0 for all."""
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: not an integer") from None
    if size == 0:
        raise argparse.ArgumentTypeError(
            "0: a buffer of no passes keeps nothing (SGLang fails at its first pass); give the "
            "number of passes to keep, or -1 to keep them all"
        )
    return size


def _expert_count(module: torch.nn.Module, config: Any) -> int | None:
    for owner, name in (
        (module, "num_experts"),
        (config, "num_experts"),
        (config, "num_local_experts"),
        (config, "n_routed_experts"),
    ):
        value = getattr(owner, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class ExpertDistributionRecorder:
    """The recorder of one server, on its model. ``start``, ``stop``, ``dump`` and ``extend``
    run on the scheduler thread (between steps; ``extend`` just before a prefill pass), as do
    the hooks. ValueError at construction for a model without experts, or a mode it cannot
    honour."""

    def __init__(self, model: torch.nn.Module, mode: str, buffer_size: int | None = None) -> None:
        if mode not in ("stat", "per_pass", "per_token"):
            raise ValueError(f"{FLAG} {mode!r}: this engine records stat, per_pass, per_token")
        layers = decoder_layers(model, FLAG)
        modules = {
            i: m for i, layer in enumerate(layers) if (m := experts_module(layer)) is not None
        }
        if not modules:
            raise ValueError(
                f"{FLAG} {mode}: the model routes no experts (no decoder layer has an experts "
                "module called as experts(hidden_states, top_k_index, top_k_weights)); SGLang "
                "refuses to start there too (no ExpertLocationMetadata)"
            )
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        counts = {i: _expert_count(m, config) for i, m in modules.items()}
        missing = sorted(i for i, n in counts.items() if n is None)
        if missing:
            raise ValueError(
                f"{FLAG} {mode}: the experts modules of layers {missing} say not how many "
                "experts they have (num_experts), nor does the config"
            )
        self.mode = mode
        self.layers = len(layers)
        self.experts = max(n for n in counts.values() if n is not None)
        self.device = next(model.parameters()).device
        self.buffer_size = DEFAULT_BUFFER if buffer_size is None else buffer_size
        self.recording = False
        self._model = model
        self._modules = modules
        self._handles: list[RemovableHandle] = []
        self._passes = 0  # passes recorded since the server started (forward_pass_id)
        # the pass under way: its [layers, experts] counts (None: none), its real tokens
        # ([tokens] bool; None: all), and for per_token its inputs and each layer's top-k ids
        self._count: torch.Tensor | None = None
        self._real: torch.Tensor | None = None
        self._next_real: torch.Tensor | None = None  # extend's, for the next pass
        self._meta: dict[str, Any] = {}
        self._topk: dict[int, torch.Tensor] = {}
        # stat: the buffer, its next row, the rows written (a growing one's)
        self._buffer: torch.Tensor | None = None
        self._row = 0
        self._rows = 0
        self._records: list[dict[str, Any]] = []  # per_pass, per_token

    @classmethod
    def of(
        cls, model: torch.nn.Module, mode: str | None, buffer_size: int | None
    ) -> ExpertDistributionRecorder | None:
        """The recorder the server's flags ask for (None without a mode)."""
        return None if mode is None else cls(model, mode, buffer_size)

    # ---- commands (scheduler thread) --------------------------------------------------------

    def start(self) -> None:
        """SGLang's ``start_record``: clear the record, and record from the next pass."""
        if self.recording:
            log.warning(
                "expert_distribution_already_recording",
                message="SGLang server is already recording expert ids. Did you forget to dump "
                "the expert ids recorded so far by sending requests to the "
                "`/stop_expert_distribution_record` and `/dump_expert_distribution_record` "
                "endpoints?",
            )
        self._reset()
        self.recording = True
        if not self._handles:
            self._hook()

    def stop(self) -> None:
        """SGLang's ``stop_record``: record no more passes (the record is kept for a dump)."""
        if not self.recording:
            log.warning(
                "expert_distribution_not_recording",
                message="SGLang server has not been recording expert ids. Did you forget to "
                "start recording by sending request to the `/start_expert_distribution_record` "
                "endpoint?",
            )
        self.recording = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._count = self._real = self._next_real = None

    def dump(self) -> Path:
        """SGLang's ``dump_record``: write the record to its file, then clear it; the path.
        RecordError (the record kept) where the file cannot be written."""
        if self._count is not None:  # a pass that failed half-way: not recorded
            if self.mode == "stat":
                self._count.zero_()
            self._count = None
        if self.mode == "stat":
            name = f"expert_distribution_recorder_{time.time()}.pt"
            buffer = self._stat_buffer()
            logical = buffer if self.buffer_size > 0 else buffer[: self._rows]
            payload: dict[str, Any] = {
                "rank": 0,
                "logical_count": logical.clone(),
                "average_utilization_rate_over_window": None,
            }
        else:
            name = f"expert_distribution_recorder_{time.time()}_0.pt"
            payload = {
                "records": list(self._records),
                # one copy of each expert: physical expert i is logical expert i
                "last_physical_to_logical_map": torch.arange(self.experts, device=self.device)
                .repeat(self.layers, 1)
                .contiguous(),
            }
        folder = Path(os.environ.get(DIR_ENV) or "/tmp")
        path = folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(payload, str(path))
        except OSError as exc:
            raise RecordError(
                f"dump_expert_distribution_record: cannot write {path} ({DIR_ENV}="
                f"{os.environ.get(DIR_ENV)!r}): {exc}; the record is kept, dump again once the "
                "folder can be written"
            ) from None
        log.info("expert_distribution_dumped", path=str(path), mode=self.mode)
        self._reset()
        return path

    def extend(self, new_tokens: torch.Tensor) -> None:
        """Before a prefill or scoring pass: its rows' new tokens, ``[rows, width]`` nonzero
        where a token is real (left-padding zero). Nothing while not recording."""
        if self.recording:
            self._next_real = new_tokens.to(self.device, non_blocking=True).reshape(-1) != 0

    # ---- the record -------------------------------------------------------------------------

    def _reset(self) -> None:
        if self.mode == "stat":
            if self._buffer is not None:
                self._buffer.zero_()
            self._rows = 0  # (a circular buffer keeps its cursor, as SGLang's)
            if self.buffer_size < 0:
                self._row = 0
        else:
            self._records.clear()

    def _stat_buffer(self) -> torch.Tensor:
        if self._buffer is None:
            rows = self.buffer_size if self.buffer_size > 0 else 128
            shape = (rows, self.layers, self.experts)
            self._buffer = torch.zeros(shape, dtype=torch.int32, device=self.device)
        return self._buffer

    # ---- hooks ------------------------------------------------------------------------------

    def _hook(self) -> None:
        model = self._model
        self._handles = [
            model.register_forward_pre_hook(self._pass_start, with_kwargs=True),
            model.register_forward_hook(self._pass_end),
        ]
        for layer, module in self._modules.items():
            counter = self._counter(layer, top_k_name(module))
            self._handles.append(module.register_forward_pre_hook(counter, with_kwargs=True))

    def _pass_start(self, _model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        real, self._next_real = self._next_real, None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if real is not None and (ids is None or real.numel() != ids.numel()):
            real = None  # (not this pass's: a prefill that failed before its pass)
        self._real = real
        self._topk, self._meta = {}, {}
        if self.mode == "stat":
            buffer = self._stat_buffer()
            if self.buffer_size < 0 and self._row == len(buffer):  # grow it
                self._buffer = buffer = torch.cat((buffer, torch.zeros_like(buffer)))
            self._count = buffer[self._row]
            self._count.zero_()
        else:
            self._count = torch.zeros(
                (self.layers, self.experts), dtype=torch.int32, device=self.device
            )
        if self.mode == "per_token" and ids is not None:
            positions = kwargs.get("position_ids")
            if positions is None:
                positions = torch.zeros_like(ids)
            rows = ids.shape[0]
            ids, positions = ids.reshape(-1), positions.reshape(-1)
            if real is not None:
                ids, positions = ids[real], positions[real]
            self._meta = {
                "input_ids": ids.tolist(),
                "positions": positions.tolist(),
                "extend_seq_lens": None if real is None else real.view(rows, -1).sum(1).tolist(),
                "forward_mode": _DECODE if real is None else _EXTEND,
            }

    def _counter(self, layer: int, name: str) -> Any:
        def count(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            counts = self._count
            if counts is None:
                return
            ids = args[1] if len(args) > 1 else kwargs[name]
            ids = ids.reshape(-1, ids.shape[-1])
            valid = (ids >= 0) & (ids < self.experts)
            if self._real is not None and self._real.numel() == len(ids):
                valid &= self._real.view(-1, 1)
            index = ids.masked_fill(~valid, 0).reshape(-1)
            counts[layer].index_add_(0, index, valid.reshape(-1).to(torch.int32))
            if self.mode == "per_token":
                self._topk[layer] = ids

        return count

    @contextlib.contextmanager
    def pass_of(self, ids: torch.Tensor | None, positions: torch.Tensor) -> Iterator[None]:
        """A pass of the engine's own (``llama_forward``: no forward of the model to hook),
        recorded as a forward of the model is: its inputs (``ids``; None: embeddings) before,
        its end after, none after a pass that fails."""
        if not self._handles:  # not recording
            yield
            return
        inputs = {} if ids is None else {"input_ids": ids, "position_ids": positions}
        self._pass_start(self._model, (), inputs)
        yield
        self._pass_end(self._model, (), None)

    def _pass_end(self, _model: Any, _args: Any, _output: Any) -> None:
        counts, self._count = self._count, None
        if counts is None:
            return
        self._passes += 1
        if self.mode == "stat":
            self._row += 1
            self._rows += 1
            if self.buffer_size > 0:
                self._row %= self.buffer_size
            return
        record: dict[str, Any] = {
            "forward_pass_id": self._passes,
            "rank": 0,
            "gatherer_key": "primary",
        }
        if self.mode == "per_token":
            if not self._meta:  # (a pass without input_ids: nothing to say of its tokens)
                return
            record.update(self._meta)
            record["topk_ids_of_layer"] = self._token_topk()
            record["misc_objects"] = []
        record["global_physical_count"] = counts.cpu()
        self._records.append(record)
        self._real = None

    def _token_topk(self) -> torch.Tensor:
        """The pass's top-k ids ``[layers, tokens, max(8, k)]`` int32 on the CPU, -1 where
        a layer routed nothing."""
        tokens = len(self._meta["input_ids"])
        k = max((ids.shape[-1] for ids in self._topk.values()), default=0)
        out = torch.full((self.layers, tokens, max(_TOP_K_NUM, k)), -1, dtype=torch.int32)
        for layer, ids in self._topk.items():
            if self._real is not None and self._real.numel() == len(ids):
                ids = ids[self._real]
            out[layer, :, : ids.shape[-1]] = ids.to("cpu", torch.int32)
        return out


class ExpertDistributionRoutes:
    """``GET|POST /start_expert_distribution_record``, ``/stop_expert_distribution_record`` and
    ``/dump_expert_distribution_record`` on ``scheduler`` (its ``expert_distribution``: the
    recorder, None without the flag)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def add_to(self, app: web.Application) -> None:
        for method in ("GET", "POST"):
            app.router.add_route(method, "/start_expert_distribution_record", self.start)
            app.router.add_route(method, "/stop_expert_distribution_record", self.stop)
            app.router.add_route(method, "/dump_expert_distribution_record", self.dump)

    async def start(self, request: web.Request) -> web.Response:
        return await self._command("start", "Start recording the expert distribution.\n")

    async def stop(self, request: web.Request) -> web.Response:
        return await self._command("stop", "Stop recording the expert distribution.\n")

    async def dump(self, request: web.Request) -> web.Response:
        return await self._command("dump", "Dump expert distribution record.\n")

    async def _command(self, action: str, answer: str) -> web.Response:
        recorder = self.scheduler.expert_distribution
        if recorder is None:
            return bad_request(f"{NOT_SET} (the engine was started without {FLAG})")
        try:
            await asyncio.wrap_future(self.scheduler.between_steps(getattr(recorder, action)))
        except RecordError as exc:
            return bad_request(str(exc))
        return web.Response(text=answer)
