"""Custom logit processors: a request's own Python that changes the next token's logits.

As SGLang 0.5.23 runs them (``srt/sampling/custom_logit_processor.py``, ``Sampler.
_preprocess_logits``, ``SamplingBatchInfo.from_schedule_batch``), with the server flag
``--enable-custom-logit-processor``: a request's ``custom_logit_processor`` (top level of
``/generate``, one for all prompts or one per prompt of a batch; the same field on
``/v1/completions`` and ``/v1/chat/completions``) is the JSON ``{"callable": HEX}``, ``HEX`` the
``dill`` pickle of a ``CustomLogitProcessor`` class, what ``Class.to_str()`` writes. Each step,
the rows of one processor string are handed to one instance of its class at once:
``processor(logits, custom_param_list)``, ``logits`` those rows' ``[rows, vocab]`` (after the
penalties, the logit bias and the grammar's mask; before the temperature, the top log-probs and
the draw, so the returned log-probs are of the processed logits, as SGLang's), and each row's
``sampling_params.custom_params`` with ``"__req__"``, a view of its request (``rid``,
``origin_input_ids``, ``output_ids``: what SGLang's processors read of its ``Req``), where
``custom_params`` is a dictionary. ``max_thinking_tokens`` sets ``custom_params.
thinking_budget``, as there. The processor returns logits of the same shape.

The classes SGLang ships are here under the same names (written from their documented
behaviour): ``DisallowedTokensLogitsProcessor`` (``custom_params.token_ids`` never drawn),
``ThinkingBudgetLogitProcessor`` and its Qwen3, DeepSeek-R1, GLM-4.5 and Inkling settings
(past ``thinking_budget`` tokens of an open reasoning block: a newline, then the block's end)
and ``DeepseekOCRNoRepeatNGramLogitProcessor``. A string made by SGLang's own classes (or by a
class of the caller's built on them) loads here: SGLang's module is read as this one. Classes
defined in a client's ``__main__`` travel by value, as with SGLang; others by reference, so
their module must be importable by the engine.

Unpickling runs the client's code: that is why the flag exists (SGLang's warning is the same).
Where SGLang would fail later (a string that does not load, in its scheduler), the request is
refused here, 400 naming the field; a processor that raises, returns the wrong shape or leaves
a row no token to draw aborts the rows it ran on (finish reason ``abort`` with what went
wrong), counted, and the engine serves on.
"""

from __future__ import annotations

import io
import json
import threading
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a processor runs (the scheduler has it already)
    import torch

__all__ = [
    "CustomLogitProcessor",
    "DeepSeekR1ThinkingBudgetLogitProcessor",
    "DeepseekOCRNoRepeatNGramLogitProcessor",
    "DisallowedTokensLogitsProcessor",
    "Glm4MoeThinkingBudgetLogitProcessor",
    "InklingThinkingBudgetLogitProcessor",
    "LogitProcessors",
    "ProcessorError",
    "Qwen3ThinkingBudgetLogitProcessor",
    "RequestView",
    "ThinkingBudgetLogitProcessor",
    "processor_class",
    "sglang_string",
]

SGLANG_MODULE = "sglang.srt.sampling.custom_logit_processor"
# the most distinct processor strings kept loaded (a client sending new classes forever must
# not grow the engine forever); a string evicted is loaded again when it comes back
MAX_LOADED = 64


class ProcessorError(ValueError):
    """A ``custom_logit_processor`` string that cannot be used, and why."""


class CustomLogitProcessor(ABC):
    """A processor of the next token's logits (SGLang's base class, the same interface)."""

    @abstractmethod
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[Any] | None = None
    ) -> torch.Tensor:
        """``logits``: ``[rows, vocab]``; ``custom_param_list``: each row's ``custom_params``
        (a dictionary with ``__req__``, or what the request sent). Returns logits of the same
        shape (they may be ``logits`` changed in place)."""

    @classmethod
    def to_str(cls) -> str:
        """This class as a request's ``custom_logit_processor`` (SGLang's format)."""
        import dill

        return json.dumps({"callable": dill.dumps(cls).hex()})

    @classmethod
    def from_str(cls, text: str) -> CustomLogitProcessor:
        """A new instance of the class ``text`` holds."""
        return processor_class(text)()


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """``custom_params.token_ids`` (the same list for every row it runs on) are never drawn."""

    def __call__(self, logits: torch.Tensor, custom_param_list: list[Any] | None = None):
        assert custom_param_list, "DisallowedTokensLogitsProcessor needs custom_params.token_ids"
        banned = custom_param_list[0]["token_ids"]
        assert all(p["token_ids"] == banned for p in custom_param_list), (
            "every row of DisallowedTokensLogitsProcessor must ban the same token_ids"
        )
        logits[..., banned] = float("-inf")
        return logits


def _open_block(ids: Sequence[int], start: int, end: int) -> int:
    """Where the reasoning block still open at the end of ``ids`` starts, or -1."""
    for at in range(len(ids) - 1, -1, -1):
        if ids[at] == start:
            return at
        if ids[at] == end:
            return -1
    return -1


class ThinkingBudgetLogitProcessor(CustomLogitProcessor):
    """A row whose open reasoning block (from ``THINKING_START_TOKEN_ID``, prompt included)
    holds ``custom_params.thinking_budget`` tokens or more is made to close it: a newline
    first unless its last token is one, then ``THINKING_END_TOKEN_ID``. Rows without a
    non-negative integer budget, or not in a block, are left alone."""

    THINKING_START_TOKEN_ID: int
    THINKING_END_TOKEN_ID: int
    NEW_LINE_TOKEN_ID: int

    def __call__(self, logits: torch.Tensor, custom_param_list: list[Any] | None = None):
        for row, params in enumerate(custom_param_list or ()):
            if not isinstance(params, dict):
                continue
            budget = params.get("thinking_budget")
            if not isinstance(budget, int) or budget < 0:  # True is 1 there too
                continue
            req = params["__req__"]
            output = req.output_ids
            ids = [*req.origin_input_ids, *output]
            start = _open_block(ids, self.THINKING_START_TOKEN_ID, self.THINKING_END_TOKEN_ID)
            if start < 0 or len(ids) - start - 1 < budget:
                continue
            forced = self.THINKING_END_TOKEN_ID
            if not output or output[-1] != self.NEW_LINE_TOKEN_ID:
                forced = self.NEW_LINE_TOKEN_ID
            logits[row, :] = float("-inf")
            logits[row, forced] = 0.0
        return logits


class Glm4MoeThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    """GLM-4.5 / 4.6's ids (``<think>`` 151350, ``</think>`` 151351, newline 198)."""

    THINKING_START_TOKEN_ID = 151350
    THINKING_END_TOKEN_ID = 151351
    NEW_LINE_TOKEN_ID = 198


class Qwen3ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    """Qwen3's ids (``<think>`` 151667, ``</think>`` 151668, newline 198)."""

    THINKING_START_TOKEN_ID = 151667
    THINKING_END_TOKEN_ID = 151668
    NEW_LINE_TOKEN_ID = 198


class DeepSeekR1ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    """DeepSeek-R1's ids (``<think>`` 128798, ``</think>`` 128799, newline 201)."""

    THINKING_START_TOKEN_ID = 128798
    THINKING_END_TOKEN_ID = 128799
    NEW_LINE_TOKEN_ID = 201


class InklingThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    """Inkling's ids (start 200008, end 200010, newline 198)."""

    THINKING_START_TOKEN_ID = 200008
    THINKING_END_TOKEN_ID = 200010
    NEW_LINE_TOKEN_ID = 198


class DeepseekOCRNoRepeatNGramLogitProcessor(CustomLogitProcessor):
    """No n-gram of ``custom_params.ngram_size`` tokens repeats within the last
    ``window_size`` tokens (prompt and output): each token that would complete one already
    there is banned, except ``whitelist_token_ids``. Rows without positive sizes are left
    alone."""

    def __call__(self, logits: torch.Tensor, custom_param_list: list[Any] | None = None):
        for row, params in enumerate(custom_param_list or ()):
            if not params or params.get("__req__") is None:
                continue
            try:
                size = int(params.get("ngram_size") or 0)
                window = int(params.get("window_size") or 0)
            except (TypeError, ValueError):
                continue
            if size <= 0 or window <= 0:
                continue
            req = params["__req__"]
            seq = req.origin_input_ids + req.output_ids
            first, last = max(0, len(seq) - window), len(seq) - size + 1
            if len(seq) < size or last <= first:
                continue
            tail = seq[len(seq) - size + 1 :] if size > 1 else None
            banned = {
                seq[at + size - 1]
                for at in range(first, last)
                if tail is None or seq[at : at + size - 1] == tail
            }
            try:
                banned -= {int(t) for t in params.get("whitelist_token_ids") or ()}
            except (TypeError, ValueError):
                pass
            if banned:
                logits[row, list(banned)] = float("-inf")
        return logits


SHIPPED = (
    "DisallowedTokensLogitsProcessor",
    "ThinkingBudgetLogitProcessor",
    "Glm4MoeThinkingBudgetLogitProcessor",
    "Qwen3ThinkingBudgetLogitProcessor",
    "DeepSeekR1ThinkingBudgetLogitProcessor",
    "InklingThinkingBudgetLogitProcessor",
    "DeepseekOCRNoRepeatNGramLogitProcessor",
)


def sglang_string(name: str) -> str:
    """A ``custom_logit_processor`` naming SGLang's shipped class ``name`` (one of
    ``SHIPPED``) by reference, as its ``to_str()`` does: a real SGLang server and this engine
    both load it, and the client needs neither SGLang nor dill to write it."""
    if name not in SHIPPED:
        raise ValueError(f"SGLang ships no processor {name!r}; it ships {', '.join(SHIPPED)}")
    data = b"\x80\x02c" + f"{SGLANG_MODULE}\n{name}\n".encode() + b"."  # GLOBAL, STOP
    return json.dumps({"callable": data.hex()})


def _unpickler(data: bytes) -> Any:
    import dill

    class Unpickler(dill.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # SGLang's classes (and its base of a caller's) are these
            return super().find_class(__name__ if module == SGLANG_MODULE else module, name)

    return Unpickler(io.BytesIO(data))


_LOADED: OrderedDict[str, type] = OrderedDict()
_LOADING = threading.Lock()  # requests are read on the event loop, processors run elsewhere


def processor_class(text: str) -> type:
    """The processor class ``text`` holds (loaded once while it stays among the last
    ``MAX_LOADED``); ProcessorError saying what is wrong with it."""
    with _LOADING:
        found = _LOADED.get(text)
        if found is not None:
            _LOADED.move_to_end(text)
            return found
        found = _load(text)
        _LOADED[text] = found
        if len(_LOADED) > MAX_LOADED:
            _LOADED.popitem(last=False)
        return found


def _load(text: str) -> type:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProcessorError(f'expected the JSON {{"callable": HEX}} of to_str(): {exc}') from None
    hexed = data.get("callable") if isinstance(data, dict) else None
    if not isinstance(hexed, str):
        raise ProcessorError('expected the JSON {"callable": HEX} of to_str()')
    try:
        raw = bytes.fromhex(hexed)
    except ValueError as exc:
        raise ProcessorError(f"callable: not hexadecimal: {exc}") from None
    try:
        found = _unpickler(raw).load()
    except ImportError as exc:
        raise ProcessorError(f"the class cannot be loaded here: {exc}") from None
    except Exception as exc:  # any unpickling error: the client's bytes
        raise ProcessorError(f"callable: {type(exc).__name__}: {exc}") from None
    if not isinstance(found, type) or not callable(found):
        raise ProcessorError(f"callable: expected a processor class, got {type(found).__name__}")
    return found


def masks_safely(text: str) -> bool:
    """Whether the processor only bans tokens, so that a sampling support stays the
    distribution's (SGLang's ``supports_sampling_mask``: ``DisallowedTokensLogitsProcessor``)."""
    try:
        return issubclass(processor_class(text), DisallowedTokensLogitsProcessor)
    except ProcessorError:
        return False


class RequestView:
    """What ``custom_params["__req__"]`` shows a processor of its request, as SGLang's ``Req``:
    ``rid``, ``origin_input_ids`` and ``output_ids`` (``array('q')`` both; the output as
    sampled before this step, read once a step: ``fresh`` starts a step)."""

    __slots__ = ("_outputs", "_prompt", "_prompt_ids", "_taken", "rid")

    def __init__(self, rid: str, prompt: list[int], outputs: Callable[[], list[int]]) -> None:
        self.rid = rid
        self._prompt_ids = prompt
        self._prompt: array | None = None
        self._outputs = outputs
        self._taken: array | None = None

    def fresh(self, known: list[int] | None = None) -> None:
        """A new step; ``known``: the output as it is (else read when asked)."""
        self._taken = None if known is None else array("q", known)

    @property
    def origin_input_ids(self) -> array:
        if self._prompt is None:
            self._prompt = array("q", self._prompt_ids)
        return self._prompt

    @property
    def output_ids(self) -> array:
        if self._taken is None:
            self._taken = array("q", self._outputs())
        return self._taken


class LogitProcessors:
    """The engine's processor instances, one per distinct string (SGLang merges its rows by
    string, ``ProcessorEntry``), and how many rows they failed."""

    def __init__(self) -> None:
        self._instances: OrderedDict[str, Any] = OrderedDict()
        self.failures = 0  # rows aborted because their processor failed

    def apply(
        self, logits: torch.Tensor, text: str, rows: list[int], params: list[Any]
    ) -> str | None:
        """Run ``text``'s processor on ``rows`` of ``logits`` (changed in place). None, or
        why the rows must be aborted (their logits then left as they were)."""
        import torch

        try:
            processor = self._instance(text)
            index = torch.tensor(rows, device=logits.device)
            selected = logits.index_select(0, index)
            out = processor(selected, params)
            if not isinstance(out, torch.Tensor) or out.shape != selected.shape:
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ProcessorError(f"returned {shape}, expected a tensor {tuple(selected.shape)}")
            out = out.to(logits.dtype)
            if not bool(torch.isfinite(out).any(dim=-1).all()):  # no token left to draw
                raise ProcessorError("left a row no token to draw (every logit -inf or NaN)")
        except Exception as exc:
            self.failures += len(rows)
            what = exc if isinstance(exc, ProcessorError) else f"raised {type(exc).__name__}: {exc}"
            return f"custom logit processor {_name(text)}: {what}"
        logits.index_copy_(0, index, out)
        return None

    def _instance(self, text: str) -> Any:
        found = self._instances.get(text)
        if found is None:
            found = self._instances[text] = processor_class(text)()
            if len(self._instances) > MAX_LOADED:
                self._instances.popitem(last=False)
        else:
            self._instances.move_to_end(text)
        return found


def _name(text: str) -> str:
    try:
        return processor_class(text).__name__
    except ProcessorError:
        return "(not loadable)"
