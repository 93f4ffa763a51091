"""What SGLang's ``/weights_checker`` does to a model: checksums of its weights, and a snapshot
to compare them with after a weight update.

RL code uses it to prove that an update path brings an engine exactly the trainer's weights
(slime, verl): ``snapshot`` the weights as loaded, ``reset_tensors`` (every weight filled with
random values), publish the trainer's weights the way training does, then ``compare``: each
tensor must be bitwise what the snapshot held, so a tensor the update path misses, or writes
wrong, shows. ``checksum`` gives a digest per tensor and one for the whole model, to compare
engines with each other or with the trainer's own weights (``checksums`` of a model or state
dict here computes the same, for tensors of the same dtype on the same kind of device: a
digest is of the bytes on a CPU and of the 32-bit words on a GPU, as SGLang's).

As SGLang 0.5.23 does it (``srt/utils/weight_checker.py``, ``weight_checker_comparator.py``,
``scheduler_components/weight_updater.check_weights``):

- the tensors are the model's parameters, then its buffers, by their names (here a Hugging
  Face checkpoint's: ``model.layers.0.self_attn.q_proj.weight``; SGLang's own model classes
  name some fused, ``qkv_proj``). A tensor whose name holds one of ``skip_tensor_list``'s
  strings, or is one of the buffers computed from the config (``inv_freq``, ``cos_sin_cache``
  ...), is neither reset, compared nor summed;
- a tensor's digest is 16 hex digits: on the CPU the first 8 bytes of the sha256 of its bytes
  (``mm_utils.tensor_hash``); on a GPU the 64-bit tile hash of ``gpu_tensor_hash``, computed
  here with torch's integer ops (``_tile_hash``). The model's (``per_gpu_checksum``) is the
  sha256 of each sorted name followed by its digest;
- ``compare`` is bitwise (an element equal in float32; NaN never is), and its failure lists
  each tensor that differs with ``max_abs_err``, ``mean_abs_err`` and ``num_exceed`` in
  SGLang's words. A compare that succeeds drops the snapshot, one that fails keeps it;
- ``reset_tensors`` fills floats with uniform [0, 1) values, integers across their range.

The model runs on one device without tensor parallelism: one rank, ``role`` ``"target"`` (no
draft model; a ``selector`` of ``"draft"`` selects nothing). These functions run where the
model is safe to read and write: the scheduler's thread, between two steps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import structlog
import torch

__all__ = [
    "ACTIONS",
    "SELECTORS",
    "WeightCheckError",
    "WeightChecker",
    "checksums",
    "overall_checksum",
    "tensor_checksum",
]

log = structlog.get_logger("stages.engine.weight_checker")

ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
SELECTORS = ("target", "draft", "all")  # SGLang's CheckWeightsReqInput.selector

# buffers computed from the config, never loaded: SGLang's _NON_PERSISTENT_BUFFER_PATTERNS
_COMPUTED = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
_CHUNK = 64 * 1024 * 1024  # elements compared or filled at a time (SGLang's CHUNK_NUMEL)


class WeightCheckError(ValueError):
    """An action that failed: its message is the answer's."""


def _computed(name: str) -> bool:
    return any(pattern in name for pattern in _COMPUTED)


def _skipped(name: str, tensor: torch.Tensor, skip: Iterable[str]) -> bool:
    """Left out of reset, compare and checksum alike (SGLang's ``_is_skip_weight_check``)."""
    return (
        _computed(name)
        or getattr(tensor, "_skip_weight_check", False)
        or any(pattern in name for pattern in skip)
    )


def _state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def overall_checksum(digests: Mapping[str, str]) -> str:
    """The digest of a set of tensors: sha256 over each sorted name and its digest."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode())
        h.update(digests[name].encode())
    return h.hexdigest()


def tensor_checksum(tensor: torch.Tensor) -> str:
    """A tensor's digest, 16 hex digits: of its bytes on the CPU (sha256's first 8), of its
    32-bit words on a GPU (``_tile_hash``), as SGLang's ``tensor_hash`` on each."""
    if tensor.is_cuda:
        return f"{_tile_hash(tensor):016x}"
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(data.numpy())).digest()[:8].hex()


def checksums(
    model: torch.nn.Module | Mapping[str, torch.Tensor], skip: Iterable[str] = ()
) -> dict[str, str]:
    """Each tensor's digest, by name: a model's parameters and buffers, or a state dict's
    tensors (a trainer's weights, to compare with an engine's ``/weights_checker`` answer).
    Computed buffers and names holding a string of ``skip`` are left out."""
    skip = tuple(skip)
    named = model.items() if isinstance(model, Mapping) else _state(model)
    return {
        name: tensor_checksum(tensor.data)
        for name, tensor in named
        if not _skipped(name, tensor, skip)
    }


class WeightChecker:
    """The actions of ``/weights_checker`` on one model; holds the snapshot between them."""

    def __init__(self) -> None:
        self._snapshot: dict[str, torch.Tensor] | None = None

    def handle(
        self,
        model: torch.nn.Module,
        action: str,
        *,
        skip: Iterable[str] = (),
        selector: str = "all",
    ) -> dict[str, Any] | None:
        """Run ``action`` on ``model``: the checksum's answer (``ranks`` and
        ``per_engine_checksum``) or None. Raises WeightCheckError."""
        skip = tuple(skip)
        if selector not in SELECTORS:
            raise WeightCheckError(
                f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'"
            )
        if action not in ACTIONS:
            raise WeightCheckError(f"Unsupported action={action!r}")
        log.info("weights_checker", action=action, skip_tensor_list=list(skip), selector=selector)
        if selector == "draft":  # the only model here is the target
            return None
        if action == "snapshot":
            self._snapshot = {
                name: tensor.detach().to("cpu", copy=True) for name, tensor in _state(model)
            }
        elif action == "reset_tensors":
            for name, tensor in _state(model):
                if not _skipped(name, tensor, skip):
                    _fill_random(tensor.data)
        elif action == "compare":
            self._compare(model, skip)
        else:
            return _checksum_answer(checksums(model, skip))
        return None

    def _compare(self, model: torch.nn.Module, skip: tuple[str, ...]) -> None:
        if self._snapshot is None:
            raise WeightCheckError("compare: no snapshot to compare with; take one first")
        current = dict(_state(model))
        if list(current) != list(self._snapshot):
            raise WeightCheckError(
                "compare: the model's tensors are not those of the snapshot: "
                f"{sorted(set(current) ^ set(self._snapshot))[:8]}"
            )
        errors, infos = [], []
        for name, tensor in current.items():
            if ".cos_sin_cache" in name:  # computed from the config (SGLang skips it so)
                continue
            expect = self._snapshot[name]
            if expect.shape != tensor.shape:
                errors.append(f"name={name} expect={_describe(expect)} actual={_describe(tensor)}")
                continue
            equal, max_err, mean_err, exceed = _differences(expect, tensor)
            if equal:
                continue
            line = (
                f"name={name} max_abs_err={max_err} mean_abs_err={mean_err} "
                f"num_exceed={exceed} expect={_describe(expect)} actual={_describe(tensor)} "
            )
            (infos if _skipped(name, tensor, skip) else errors).append(line)
        if infos:
            log.info("weights_checker_skipped_differ", tensors=infos)
        if errors:
            raise WeightCheckError("check tensor equality failed:\n" + "\n".join(errors))
        self._snapshot = None


def _checksum_answer(digests: dict[str, str]) -> dict[str, Any]:
    """SGLang's answer to ``checksum`` for one rank (``ChecksumInfo``)."""
    overall = overall_checksum(digests)
    rank = {
        "checksums": digests,
        "per_gpu_checksum": overall,
        "parallelism_info": [
            {
                "role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1,
            }
        ],
    }  # fmt: skip
    return {
        "ranks": [rank],
        "per_engine_checksum": hashlib.sha256(overall.encode()).hexdigest(),
    }


def _describe(tensor: torch.Tensor) -> str:
    """A tensor in a compare's message, as SGLang's ``RawComparable`` writes itself."""
    return f"raw(shape={tuple(tensor.shape)} dtype={tensor.dtype})"


def _differences(expect: torch.Tensor, actual: torch.Tensor) -> tuple[bool, float, float, int]:
    """``(equal, max_abs_err, mean_abs_err, num_exceed)`` of two tensors of a shape, compared
    chunk by chunk on ``actual``'s device (SGLang's ``compare_weights`` of raw weights: the
    tolerance 0, so every element that differs exceeds it)."""
    wide = torch.float64 if actual.dtype == torch.float64 else torch.float32
    flat_e, flat_a = expect.reshape(-1), actual.detach().reshape(-1)
    equal, total, exceed = True, 0.0, 0
    max_err = torch.zeros((), dtype=wide)  # torch.maximum: a NaN difference shows as NaN
    for start in range(0, flat_a.numel(), _CHUNK):
        a = flat_a[start : start + _CHUNK].to(wide)
        e = flat_e[start : start + _CHUNK].to(a.device, wide)
        diff = (a - e).abs()
        if bool((diff == 0).all()):
            continue
        equal = False
        max_err = torch.maximum(max_err, diff.max().cpu())
        total += float(diff.sum())
        exceed += int((~(diff <= 0)).sum())  # NaN counts
    return equal, float(max_err), total / max(flat_a.numel(), 1), exceed


def _fill_random(tensor: torch.Tensor) -> None:
    """Overwrite ``tensor`` in place (views of it, such as the engine's fused projections, see
    it): floats uniform in [0, 1), bools at random, integers across their dtype's range."""
    flat = tensor.view(-1)
    for chunk in flat.split(_CHUNK):
        if tensor.dtype.is_floating_point:
            chunk.copy_(torch.rand(chunk.shape, device=chunk.device))
        elif tensor.dtype == torch.bool:
            chunk.copy_(torch.rand(chunk.shape, device=chunk.device) > 0.5)
        else:
            info = torch.iinfo(tensor.dtype)
            chunk.copy_(
                torch.randint(
                    int(info.min), int(info.max), chunk.shape,
                    device=chunk.device, dtype=tensor.dtype,
                )
            )  # fmt: skip


# ---- SGLang's gpu_tensor_hash, in torch's integer ops ---------------------------------------
# Each 32-bit word v at index i is mixed with two position keys, p1 and p2, through murmur3's
# finalizer; the mixed words of each tile of 8192 are summed (mod 2^32), each sum xored with the
# byte count and mixed again, and the tiles' (h1 << 32 | h2) summed (mod 2^64) and finished
# with splitmix64. All arithmetic here is on int64 values below 2^48, so nothing overflows.

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_SEED = 0x243F6A88
_FMIX = (0x85EBCA6B, 0xC2B2AE35)
_POS = (0x27D4EB2D, 0x165667B1)
_TILE = 8192  # words a tile
_TILES_A_CHUNK = 512  # tiles mixed at a time: a few int64 copies of 4M words (32 MB each)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for words ``x`` (int64, below 2^32) and a 32-bit constant."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX[0])
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX[1])
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 32-bit words (int32, read as unsigned by the caller), the last
    zero-padded; a view of the tensor where its bytes allow, else a copy."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -data.numel() % 4
    if pad:
        data = torch.cat((data, data.new_zeros(pad)))
    try:
        return data.view(torch.int32)
    except RuntimeError:  # a view that does not start on a 4-byte boundary
        return data.clone().view(torch.int32)


def _tile_hash(tensor: torch.Tensor) -> int:
    """SGLang's ``gpu_tensor_hash`` of ``tensor`` (any device; SGLang uses it on GPUs)."""
    words = _words(tensor)
    n = words.numel()
    if n == 0:
        return 0
    seed1 = _SEED & _M32
    seed2 = ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    nbytes = (n * 4) & _M32
    sum1 = sum2 = 0
    step = _TILE * _TILES_A_CHUNK
    for start in range(0, n, step):
        v = words[start : start + step].to(torch.int64) & _M32  # unsigned, one chunk at a time
        i = torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64) & _M32
        p1 = ((_mul32(i, _POS[0]) + seed1) & _M32) ^ _rotl32(i, 15)
        p2 = ((_mul32(i, _POS[1]) + seed2) & _M32) ^ _rotl32(i, 13)
        tiles = -(-v.numel() // _TILE)
        for p, which in ((p1, 1), (p2, 2)):
            k = _fmix32(v ^ p)
            k = torch.nn.functional.pad(k, (0, tiles * _TILE - k.numel()))
            h = _fmix32((k.view(tiles, _TILE).sum(1) & _M32) ^ nbytes)
            if which == 1:
                sum1 += int(h.sum())
            else:
                sum2 += int(h.sum())
    return _splitmix64(((sum1 << 32) + sum2) & _M64)


def _splitmix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)
