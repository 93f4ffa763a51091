"""Load a Hugging Face causal-LM directory: the model, and its tokenizer when it has one.

``trust_remote_code`` (the engine's ``--trust-remote-code``, SGLang's flag) lets transformers run
the code a folder ships for its model, config or tokenizer (its ``auto_map``); without it such a
folder is refused at once, with a message that names the flag (transformers would otherwise ask
on a terminal and wait).

``dtype="auto"`` means float32 on CPU (bfloat16 matmuls are slow there) and the checkpoint's
own dtype elsewhere. A directory without tokenizer files loads without a tokenizer: the engine
then takes ``input_ids`` only and returns no ``text``. ``path`` may also be a Hugging Face Hub
repo id (``org/name[@revision]``): ``stages.hub`` turns it into the cached snapshot folder
(downloading it first unless ``HF_HUB_OFFLINE`` is set); transformers then reads local files only.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from stages.engine.images import VISION_MODEL_TYPES, Vision
from stages.engine.remote_instance import RemoteSeed, load_from_seed
from stages.hf import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from stages.hub import TOKENIZER_FILES, resolve_model
from stages.light_tokenizer import transformers_tokenizer

log = structlog.get_logger("stages.engine.loader")

__all__ = [
    "DTYPES",
    "DTYPE_ALIASES",
    "LOAD_FORMATS",
    "LoadedModel",
    "eos_ids",
    "fill_weights",
    "instantiate",
    "load_model",
    "load_tokenizer",
    "own_code",
    "torch_dtype",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # SGLang's other names for them
# SGLang's --load-format choices the engine takes: which weight files, or none (dummy)
# remote_instance: none read, the weights a running engine sends (stages.engine.remote_instance)
LOAD_FORMATS = {
    "auto": None,
    "safetensors": True,
    "pt": False,
    "dummy": None,
    "remote_instance": None,
}
# SGLang's switch for a --context-length past the model's own (model_config.py)
LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


@dataclass
class LoadedModel:
    path: Path
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase | None
    vocab_size: int
    context_length: int
    eos_token_ids: frozenset[int]
    # stop tokens whose text an answer keeps (the server sets them: protocol.GenerateInput's)
    kept_stop_ids: frozenset[int] = frozenset()
    tokenizer_path: Path | None = None  # where the tokenizer came from, if not ``path``
    weight_version: str | None = None  # the version its weights came with (remote_instance)
    load_format: str = "auto"  # how its weights were loaded (SGLang's --load-format)
    # a vision-language model's image reader (images.Vision; None: a text model)
    vision: Any = None

    @functools.cached_property
    def embed_width(self) -> int:
        """The width of the model's input embeddings (what an ``input_embeds`` row holds)."""
        return int(self.model.get_input_embeddings().embedding_dim)


def load_model(
    path: str | Path,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    tokenizer_path: str | Path | None = None,
    skip_tokenizer: bool = False,
    context_length: int | None = None,
    load_format: str = "auto",
    remote: RemoteSeed | None = None,
    overrides: dict[str, Any] | None = None,
) -> LoadedModel:
    """Load ``path`` (a folder or a Hub repo id) onto ``device``, with the tokenizer of
    ``tokenizer_path`` (default: the model's folder; ``skip_tokenizer``: none) and a context of
    ``context_length`` tokens (default: the model's own; longer only where SGLang allows it);
    ``load_format`` (``LOAD_FORMATS``, SGLang's ``--load-format``): the weights from safetensors
    or ``.bin`` files (``auto``: safetensors where there are some), or ``dummy``: none read,
    every floating tensor drawn as SGLang's ``initialize_dummy_weights`` draws it, for weights
    that an update brings later; or ``remote_instance``: none read, the weights the running
    engine ``remote`` serves, received from it (``stages.engine.remote_instance``; the model's
    weight version is then the seed's). ``overrides``: keys of the model's config changed before
    it is built (SGLang's ``--json-model-override-args``, ``override_config``). Raises
    ``ValueError`` (``stages.hub.HubError`` when the
    folder or repo is unusable; ``RemoteLoadError`` when the seed's weights do not come) or
    ``OSError``."""
    from stages.engine.pooling import model_kind  # pooling imports this module

    path = resolve_model(str(path), what="--model")
    kind = model_kind(path, is_embedding=False, trust_remote_code=trust_remote_code)
    if kind is not None:  # AutoModelForCausalLM would put a random head on it
        raise ValueError(
            f"{path} is a {'reward (classification)' if kind == 'classify' else 'embedding'} "
            "model, which does not generate: `inflight engine --model` serves it on its own "
            "(/classify, /encode), not as a generating engine"
        )
    vision = vision_model(path)
    model = instantiate(
        AutoModelForImageTextToText if vision else AutoModelForCausalLM, path, device=device,
        dtype=dtype, load_format=load_format, trust_remote_code=trust_remote_code, remote=remote,
        overrides=overrides,
    )  # fmt: skip
    version = fill_weights(model, load_format, remote)
    tokenizer, folder = None, None
    if not skip_tokenizer:
        if tokenizer_path is not None:
            folder = resolve_model(str(tokenizer_path), what="--tokenizer-path", needs="tokenizer")
        tokenizer = load_tokenizer(folder or path, trust_remote_code=trust_remote_code)
    return LoadedModel(
        path=path,
        model=model,
        tokenizer=tokenizer,
        vocab_size=model.get_input_embeddings().num_embeddings,
        context_length=_context(
            model.config.get_text_config().max_position_embeddings, context_length
        ),
        eos_token_ids=eos_ids(model, tokenizer),
        tokenizer_path=folder,
        weight_version=version,
        load_format=load_format,
        vision=Vision(path, model, tokenizer) if vision else None,
    )


def vision_model(path: Path) -> bool:
    """Whether ``path`` holds a vision-language model whose images this engine reads
    (``images.VISION_MODEL_TYPES``)."""
    config = path / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return model_type in VISION_MODEL_TYPES


def instantiate(
    auto: Any,
    path: Path,
    *,
    device: str,
    dtype: str,
    load_format: str = "auto",
    trust_remote_code: bool = False,
    remote: RemoteSeed | None = None,
    overrides: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """The model of ``path`` as transformers' ``auto`` class builds it, on ``device`` and in
    eval mode: its weights read as ``load_format`` says (``LOAD_FORMATS``), or, for ``dummy``
    and ``remote_instance``, none read, every weight left for ``fill_weights``; its config
    changed first by ``overrides`` (``override_config``)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format must be one of {sorted(LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "remote_instance" and remote is None:
        raise ValueError("load format remote_instance needs the seed instance to load from")
    trust = {"trust_remote_code": trust_remote_code}
    with own_code(path):
        config = None
        if overrides or load_format in ("dummy", "remote_instance"):
            config = AutoConfig.from_pretrained(path, local_files_only=True, **trust)
            override_config(config, overrides or {})
        if load_format in ("dummy", "remote_instance"):  # every weight written below
            with _weights_left_uninitialized():
                model = auto.from_config(config, dtype=torch_dtype(device, dtype, config), **trust)
            model.tie_weights()  # (init_weights, which ties them, was skipped)
        else:
            model = auto.from_pretrained(
                path,
                dtype=torch_dtype(device, dtype),
                local_files_only=True,
                use_safetensors=LOAD_FORMATS[load_format],
                **({} if config is None else {"config": config}),
                **trust,
            )
    return model.to(device).eval()


def override_config(config: Any, overrides: dict[str, Any]) -> None:
    """Set ``overrides`` on ``config`` as SGLang 0.5.23's ``get_config`` sets
    ``--json-model-override-args``: an object for a sub-config (a vision model's
    ``text_config``) updates it, one for ``rope_scaling`` or ``rope_parameters`` is merged into
    it, anything else replaces the key."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            current.update(value)
        elif key in ("rope_scaling", "rope_parameters") and isinstance(value, dict):
            setattr(config, key, {**current, **value} if isinstance(current, dict) else value)
        else:
            setattr(config, key, value)


def fill_weights(model: torch.nn.Module, load_format: str, remote: RemoteSeed | None) -> str | None:
    """The weights ``instantiate`` left unread: drawn as SGLang's ``initialize_dummy_weights``
    draws them (``dummy``), or received from the running engine ``remote``
    (``remote_instance``: its weight version returned; None otherwise)."""
    if load_format == "dummy":
        dummy_weights(model)
    elif load_format == "remote_instance" and remote is not None:
        return load_from_seed(model, remote, next(model.parameters()).device)
    return None


def _weights_left_uninitialized() -> Any:
    """transformers' ``no_init_weights``: a model built without drawing its weights, for one
    whose weights are all written next (4 s of a 0.26B model's start on CPU). Buffers computed
    in the modules' constructors (rotary frequencies) are computed as ever."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older layout: the weights are drawn, then overwritten
        return nullcontext()
    return no_init_weights()


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, low: float = -1e-3, high: float = 1e-3) -> None:
    """Every floating tensor of ``model`` uniform in ``[low, high)``, each drawn from a
    generator seeded 1234 (SGLang's ``initialize_dummy_weights``: the same values for the same
    size and dtype, wherever the tensor lives)."""
    for tensor in model.state_dict().values():
        if torch.is_floating_point(tensor):
            generator = torch.Generator(device=tensor.device)
            generator.manual_seed(1234)
            tensor.uniform_(low, high, generator=generator)


def _context(derived: int, asked: int | None) -> int:
    """The context length served: ``asked`` (``--context-length``) where it is no longer than
    the model's ``derived`` one, or longer where SGLang's variable allows it (logged), else
    SGLang's ValueError (``ModelConfig._derive_context_length``)."""
    if asked is None or asked <= derived:
        return derived if asked is None else asked
    message = (
        f"Warning: User-specified context_length ({asked}) is greater than the derived "
        f"context_length ({derived}). This may lead to incorrect model outputs or CUDA errors. "
        "Note that the derived context_length may differ from max_position_embeddings in the "
        "model's config."
    )
    if _env_bool(LONGER_CONTEXT_ENV):
        log.warning("context_length_longer_than_the_model", message=message)
        return asked
    raise ValueError(
        f"{message} To allow overriding this maximum, set the env var {LONGER_CONTEXT_ENV}=1"
    )


def _env_bool(name: str) -> bool:
    """A boolean variable as SGLang's ``EnvBool`` reads it (unset: false; a word it does not
    know: ValueError naming it)."""
    value = os.environ.get(name, "false").lower()
    if value in ("true", "1", "yes", "y"):
        return True
    if value in ("false", "0", "no", "n"):
        return False
    raise ValueError(f"{name}: {value!r} is not a valid boolean value")


def torch_dtype(device: str, dtype: str, config: Any = None) -> torch.dtype | str:
    """What ``from_pretrained`` gets for ``--dtype``: ``auto`` is float32 on CPU, and
    elsewhere the checkpoint's own (with a ``config``, for ``from_config``: its ``dtype``)."""
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype == "auto" and config is not None and device != "cpu":
        own = getattr(config, "dtype", None)
        return own if isinstance(own, torch.dtype) else DTYPES.get(str(own), torch.float32)
    if dtype == "auto":
        return torch.float32 if device == "cpu" else "auto"
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")


def eos_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The end-of-sequence ids of the model's configs and its tokenizer."""
    eos: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None), model.config.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, list):
            eos.update(source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return frozenset(eos)


def load_tokenizer(
    path: Path, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer; None when it has no tokenizer files."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    with own_code(path):
        return transformers_tokenizer(path, trust_remote_code=trust_remote_code)


@contextmanager
def own_code(path: Path) -> Iterator[None]:
    """Loading from ``path`` inside: transformers' refusal of the folder's own code (``auto_map``
    without ``trust_remote_code``) becomes a ValueError that names the engine's flag."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise ValueError(
            f"{path} ships its own code for its model, config or tokenizer (auto_map in its "
            "config files): the engine runs it only with --trust-remote-code (SGLang's flag), "
            "which you pass for a folder you trust"
        ) from None
