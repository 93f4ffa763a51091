"""Prompt sources: read a task's prompts, check them, tokenize them, split train from eval.

``load_prompts(config, split)`` returns a ``PromptSet``: every usable prompt of ``split`` as the
data of a ``prompt`` message (``prompt_id``, ``input_ids``, ``meta``), and the count of bad rows
per reason. Sources are the built-in arithmetic tasks (``arithmetic``: ``a+b=``; ``chain``:
chains of additions and subtractions worked step by step, the long-tail task), a JSON-lines
file, a Parquet file, a folder written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a
``DatasetDict`` whose ``train`` / ``test`` / ``validation`` subsets serve the two splits), or a
dataset by name (``kind: hf``: ``datasets.load_dataset(dataset, dataset_config)``, its ``split``
for training and ``eval_split`` or a held-out share of ``split`` for eval; from the Hub or
``datasets``' cache, which is all it reads when ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` is
set), reasoning-gym's generated items (``kind: reasoning_gym``, ``reasoning_gym_source.py``) or a
``verifiers`` environment's dataset (``kind: verifiers``, ``verifiers_source.py``). The feeder
stage loads the ``train`` split; the learner loads ``eval`` for held-out evaluation.

A prompt is a string, or a list of chat messages (``{role, content}``) that the tokenizer's chat
template renders (``add_generation_prompt``); ``chat_template: true`` renders string prompts as
one user message too. Rendered text is tokenized without adding special tokens (the template has
them), plain text with the tokenizer's own. ``prompt_id`` is ``FILE:ROW`` (the arithmetic tasks
have their own ids) and ``meta`` holds ``task`` (the file's stem or folder's name), ``text`` (what
the model sees, after any chat template), ``answer`` (as a string), the ``meta_fields`` and, for a
prompt that went through a chat template, ``messages`` (the conversation before it: a tool
rollout renders it again with the tools).

A bad row (invalid JSON, a missing, empty or non-string prompt, a missing answer when one is
required, too many tokens, a chat template that fails on it...) is skipped, counted and logged
with its file and 1-based row number; after the first ``20`` such warnings only the counts are
logged. A source that cannot be used at all (a missing file, an unreadable Parquet file, a
column that is not there, not one usable row) raises ``SourceError`` naming the file and the
problem. Files are read a batch of rows at a time (never through pandas) and prompts are
tokenized a batch at a time.

The split of a file source into train and eval is a stable hash of the prompt (the raw text, or
the JSON of its chat messages) and ``split_seed``: the same prompt is on the same side on every
machine, whichever tokenizer is used, and duplicates of a prompt never straddle the split. A
verifiers environment's own eval dataset serves as the eval split when ``eval_fraction`` is 0;
its training dataset's prompts that the eval dataset also has are then left out of training.

Not here: shuffling, epochs and sharding between replicas (the feeder stage does that), and
finding models (``tokenizer`` is a folder or a Hub id that ``stages.hub`` resolves to a folder,
then loaded with ``local_files_only``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog

from pipeline.config.typed import did_you_mean
from stages.feeder.arithmetic import (
    ArithmeticConfig,
    ChainConfig,
    chain_problems,
    make_chain_tokenizer,
    make_tokenizer,
    problem_rows,
)
from stages.feeder.reasoning_gym_source import ReasoningGymError
from stages.feeder.reasoning_gym_source import dataset as reasoning_gym_dataset
from stages.feeder.reasoning_gym_source import items as reasoning_gym_items
from stages.feeder.verifiers_source import check as verifiers_check
from stages.feeder.verifiers_source import has_eval as verifiers_has_eval
from stages.feeder.verifiers_source import rows as verifiers_rows
from stages.hub import HubError, resolve_model, tokenizer_check
from stages.light_tokenizer import load_tokenizer
from stages.verifiers_env import VerifiersError

if TYPE_CHECKING:
    from stages.hf import PreTrainedTokenizerBase

__all__ = ["LazyPrompts", "PromptSet", "SourceConfig", "SourceError", "load_prompts"]

_BATCH = 512  # rows read, and prompts tokenized, per call
_PROBLEM_BATCH = 8192  # a built-in task's problems tokenized per call (no rows to check)
_PROBE = 8  # a lazy source's first prompts rendered at load: all unusable is an error
_WARN_ROWS = 20  # bad rows logged one by one; after that only counted
_EVAL_SUBSETS = ("test", "validation")  # DatasetDict subsets that serve the eval split
_Keep = Literal["all", "train", "eval"]
_Kind = Literal[
    "arithmetic", "chain", "jsonl", "parquet", "hf_disk", "hf", "reasoning_gym", "verifiers"
]


class SourceError(ValueError):
    """A prompt source that cannot be used at all; the message names the file and the problem."""


@dataclass
class SourceConfig:
    kind: Literal[
        "arithmetic", "chain", "jsonl", "parquet", "hf_disk", "hf", "reasoning_gym", "verifiers"
    ] = field(default="arithmetic", metadata={"doc": "where prompts come from"})
    path: str = field(
        default="",
        metadata={"doc": "file (jsonl, parquet) or save_to_disk folder (hf_disk)", "path": True},
    )
    prompt_field: str = field(
        default="prompt",
        metadata={"doc": "column with the prompt text, or with a list of chat messages"},
    )
    answer_field: str = field(
        default="answer", metadata={"doc": "column copied (as a string) into meta['answer']"}
    )
    meta_fields: list[str] = field(
        default_factory=list, metadata={"doc": "extra columns copied into meta"}
    )
    require_answer: bool = field(
        default=True, metadata={"doc": "a row without an answer is a bad row"}
    )
    tokenizer: str = field(
        default="",
        metadata={
            "doc": "model folder or Hub id (org/name[@revision]) whose tokenizer encodes "
            "the prompts",
            "path": "model",
            "check": tokenizer_check,
        },
    )
    chat_template: bool = field(
        default=False,
        metadata={"doc": "wrap text prompts as a user message in the tokenizer's chat template"},
    )
    max_prompt_tokens: int = field(
        default=1024, metadata={"min": 1, "doc": "longer prompts are bad rows"}
    )
    eval_fraction: float = field(
        default=0.0,
        metadata={"min": 0.0, "max": 0.9, "doc": "share of a file's prompts held out for eval"},
    )
    eval_path: str = field(
        default="",
        metadata={"doc": "a separate file or folder (same kind) for the eval split", "path": True},
    )
    split_seed: int = field(default=0, metadata={"doc": "which prompts eval_fraction holds out"})
    dataset: str = field(
        default="",
        metadata={
            "doc": "kind hf: a Hub dataset id (org/name[@revision]) or a local folder of data "
            "files, loaded with datasets.load_dataset; kind reasoning_gym: a dataset name",
            "path": "model",  # a folder or a Hub id
        },
    )
    options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"doc": "kind reasoning_gym: the dataset's options (its config's fields)"},
    )
    size: int = field(
        default=1000,
        metadata={"min": 1, "doc": "kind reasoning_gym: items made (both splits together)"},
    )
    seed: int = field(default=0, metadata={"doc": "kind reasoning_gym: the dataset's seed"})
    dataset_config: str = field(
        default="", metadata={"doc": "kind hf: the dataset's configuration (subset) name"}
    )
    split: str = field(
        default="train",
        metadata={
            "doc": "kind hf: the split read for training (datasets syntax: train[:90%]); kind "
            "verifiers: the environment's dataset read for training, train or eval"
        },
    )
    eval_split: str = field(
        default="", metadata={"doc": "kind hf: the split read for eval (test, validation...)"}
    )
    arithmetic: ArithmeticConfig = field(
        default_factory=ArithmeticConfig,
        metadata={"doc": "the arithmetic task (kind: arithmetic), with its own eval split"},
    )
    chain: ChainConfig = field(
        default_factory=ChainConfig,
        metadata={"doc": "the long-tail chain task (kind: chain), with its own eval split"},
    )
    env: str = field(
        default="",
        metadata={
            "doc": "kind verifiers: the environment, by name (its module, dashes as "
            "underscores) or dotted module path"
        },
    )
    env_args: dict[str, Any] = field(
        default_factory=dict,
        metadata={"doc": "kind verifiers: keyword arguments of its load_environment"},
    )

    def __post_init__(self) -> None:
        if self.kind in ("arithmetic", "chain"):
            if self.path or self.eval_path or self.eval_fraction:
                raise ValueError(
                    f"kind {self.kind!r} reads no files: drop path/eval_path/eval_fraction "
                    f"(its held-out share is {self.kind}.eval_fraction)"
                )
        elif self.kind == "reasoning_gym":
            if not self.dataset:
                raise ValueError("kind 'reasoning_gym' needs `dataset` (a dataset name)")
            if self.path or self.eval_path:
                raise ValueError(
                    "kind 'reasoning_gym' makes its items: drop path/eval_path (the eval split "
                    "is `eval_fraction` of them)"
                )
            try:  # an unknown name or option is a config error, found before the run
                reasoning_gym_dataset(self.dataset, self.options, self.size, self.seed)
            except ReasoningGymError as exc:
                raise ValueError(str(exc)) from None
        elif self.kind == "verifiers":
            if not self.env:
                raise ValueError("kind 'verifiers' needs `env` (an environment's name or module)")
            if self.path or self.eval_path:
                raise ValueError(
                    "kind 'verifiers' reads the environment's datasets: drop path/eval_path (the "
                    "eval split is its eval dataset, or `eval_fraction` of `split`)"
                )
            if self.split not in ("train", "eval"):
                raise ValueError(
                    f"kind 'verifiers': `split` is the environment's dataset to train on, train "
                    f"or eval, not {self.split!r}"
                )
            try:  # an unknown environment, refused arguments, no prompts: before the run
                verifiers_check(self.env, self.env_args, self.split)  # type: ignore[arg-type]
            except VerifiersError as exc:
                raise ValueError(str(exc)) from None
        elif self.kind == "hf":
            if not self.dataset:
                raise ValueError("kind 'hf' needs `dataset` (a Hub dataset id such as org/name)")
            if self.path or self.eval_path:
                raise ValueError(
                    "kind 'hf' reads `dataset`: drop path/eval_path (the eval split is "
                    "`eval_split`, or `eval_fraction` of `split`)"
                )
            if self.eval_split and self.eval_fraction:
                raise ValueError("give `eval_split` or `eval_fraction`, not both")
        else:
            if not self.path:
                raise ValueError(f"kind {self.kind!r} needs `path` (the file or folder to read)")
        if self.kind != "hf" and (self.dataset_config or self.eval_split):
            raise ValueError(f"dataset_config/eval_split are for kind 'hf', not {self.kind!r}")
        if self.kind not in ("hf", "reasoning_gym") and self.dataset:
            raise ValueError(f"dataset is for kinds 'hf' and 'reasoning_gym', not {self.kind!r}")
        if self.kind != "reasoning_gym" and self.options:
            raise ValueError(f"options are for kind 'reasoning_gym', not {self.kind!r}")
        if self.kind != "verifiers" and (self.env or self.env_args):
            raise ValueError(f"env/env_args are for kind 'verifiers', not {self.kind!r}")
        if self.kind not in ("arithmetic", "chain"):
            if not self.tokenizer:
                raise ValueError(
                    f"kind {self.kind!r} needs `tokenizer` (the model directory whose "
                    "tokenizer encodes the prompts)"
                )
            if self.eval_path and self.eval_fraction:
                raise ValueError("give `eval_path` or `eval_fraction`, not both")
        if self.chat_template and not self.tokenizer:
            raise ValueError("chat_template needs `tokenizer` (a model with a chat template)")


@dataclass
class PromptSet:
    """The usable prompts of one split (each the data of a ``prompt`` message) and the bad-row
    counts per reason."""

    prompts: list[dict[str, Any]] | LazyPrompts
    bad: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompts(
    config: SourceConfig,
    split: Literal["train", "eval"],
    *,
    log: Any = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    lazy: bool = False,
) -> PromptSet:
    """Every usable prompt of ``split``, in source order; raises ``SourceError``.

    ``tokenizer`` is one already loaded (else ``config.tokenizer`` is loaded, or for the
    arithmetic tasks their character tokenizer). ``log`` is a structlog logger (default: the
    process's). ``lazy``: a built-in task's problems are tokenized (and rendered) when read from
    the set (``LazyPrompts``; the feeder's choice: the calculator's 802,025 problems took 35 s
    to render through a chat template up front, 8 s to tokenize), other sources as always.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval' (got {split!r})")
    started = time.monotonic()
    if config.kind == "arithmetic":
        part = _arithmetic_part(config.arithmetic, split)
    elif config.kind == "chain":
        part = _chain_part(config.chain, split)
    else:
        part = _file_part(config, split)  # a missing file fails before the tokenizer loads
    loader = _Loader(config, tokenizer or _load_tokenizer(config), log or structlog.get_logger())
    if lazy and part.problems is not None:
        prompts: list[dict[str, Any]] | LazyPrompts = LazyPrompts(loader, part)
        if prompts and all(prompts[i] is None for i in range(min(len(prompts), _PROBE))):
            raise SourceError(
                f"{part.label}: none of the first {min(len(prompts), _PROBE)} prompts is "
                f"usable through the chat template ({loader.summary()})"
            )
    else:
        loader.read(part)
        prompts = loader.prompts
    if not prompts:
        raise SourceError(
            f"{part.label}: no usable prompts for the {split!r} split ({loader.summary()})"
        )
    loader.log.info(
        "prompts_loaded",
        split=split,
        source=config.kind,
        file=part.label,
        prompts=len(prompts),
        bad=dict(loader.bad),
        other_split=loader.other_split,
        seconds=round(time.monotonic() - started, 3),
    )
    return PromptSet(prompts, dict(loader.bad))


# ----------------------------------------------------------------------------- reading rows
@dataclass
class _Record:
    """One row as read: its data (a mapping), or why it could not be read."""

    number: int  # 1-based row (line, for jsonl)
    data: Any = None
    reason: str = ""  # set when the row could not be read
    detail: str = ""


@dataclass
class _Part:
    """One file (or folder subset) to read, and which of its prompts belong to the split."""

    label: str  # the file as logs and errors name it
    name: str  # prompt ids are f"{name}:{row}"
    task: str  # meta["task"]
    records: Iterable[_Record]
    columns: tuple[str, ...] | None = None  # known up front for tabular files (checked)
    keep: _Keep = "all"  # "train"/"eval": keep the rows the split hash puts there
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    meta_keys: tuple[str, ...] = ()
    id_key: str = ""  # the row's own prompt id (arithmetic); else f"{name}:{row}"
    # A built-in task's problems as (text, answer, prompt id): valid by construction, so they
    # skip the row checks (``records`` yields the same rows, for the chat-template path).
    problems: Iterable[tuple[str, str, str]] | None = None
    held: frozenset[str] = frozenset()  # prompts (as split keys) that the eval split holds
    require_answer: bool | None = None  # None: the config's require_answer


def _arithmetic_part(config: ArithmeticConfig, split: str) -> _Part:
    return _builtin_part("arithmetic", problem_rows(config, split))


def _chain_part(config: ChainConfig, split: str) -> _Part:
    rows = ((p.text, p.answer, p.prompt_id) for p in chain_problems(config, split))
    return _builtin_part("chain", rows)


def _builtin_part(task: str, rows: Iterator[tuple[str, str, str]]) -> _Part:
    def records() -> Iterator[_Record]:
        for i, (text, answer, prompt_id) in enumerate(rows, start=1):
            yield _Record(i, {"prompt": text, "answer": answer, "id": prompt_id})

    return _Part(task, task, task, records(), id_key="id", problems=rows)


def _config_part(
    config: SourceConfig,
    label: str,
    name: str,
    task: str,
    records: Iterable[_Record],
    columns: tuple[str, ...] | None,
    keep: _Keep,
) -> _Part:
    """A file source's part: the row keys come from the config."""
    return _Part(
        label,
        name,
        task,
        records,
        columns,
        keep,
        prompt_key=config.prompt_field,
        answer_key=config.answer_field,
        meta_keys=tuple(config.meta_fields),
    )


def _shown(path: Path) -> str:
    """A path for an error message: as given, and where it was looked for when relative."""
    return str(path) if path.is_absolute() else f"{path} (looked in {Path.cwd()})"


def _file_part(config: SourceConfig, split: str) -> _Part:
    """Which file holds ``split`` and which of its rows belong to it."""
    hashed = config.eval_fraction > 0
    if config.kind == "hf":
        return _hub_part(config, split, hashed)
    if config.kind == "reasoning_gym":
        return _reasoning_gym_part(config, split, hashed)
    if config.kind == "verifiers":
        return _verifiers_part(config, split, hashed)
    if split == "train":
        return _open(config, Path(config.path), "train", "train" if hashed else "all")
    if config.eval_path:
        return _open(config, Path(config.eval_path), "eval_path", "all")
    if hashed:
        return _open(config, Path(config.path), "train", "eval")
    if config.kind == "hf_disk" and _subsets(Path(config.path)):
        return _open(config, Path(config.path), "eval", "all")
    also = " or save a DatasetDict with a test subset" if config.kind == "hf_disk" else ""
    raise SourceError(
        f"{config.path}: no eval split: set `eval_fraction` (a share of the prompts held out) "
        f"or `eval_path` (a separate file){also}"
    )


def _open(config: SourceConfig, path: Path, role: str, keep: _Keep) -> _Part:
    """``role``: ``train`` (a DatasetDict's train subset), ``eval`` (its test/validation
    subset), ``eval_path`` (eval subset, else its only subset)."""
    if config.kind == "hf_disk":
        return _hf_part(config, path, role, keep)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "not found"
        raise SourceError(f"{config.kind} source {_shown(path)}: {what}")
    if config.kind == "jsonl":
        return _config_part(
            config, str(path), path.name, path.stem, _jsonl_records(path), None, keep
        )
    pf = _parquet_file(path)
    columns = _check_columns(config, tuple(pf.schema_arrow.names), str(path))
    records = _parquet_records(pf, columns)
    return _config_part(config, str(path), path.name, path.stem, records, columns, keep)


def _jsonl_records(path: Path) -> Iterator[_Record]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines (a trailing one, most often) are not rows
            try:
                data = json.loads(raw)
            except UnicodeDecodeError as exc:
                yield _Record(number, reason="invalid_json", detail=f"not UTF-8: {exc}")
            except ValueError as exc:
                yield _Record(number, reason="invalid_json", detail=str(exc))
            else:
                yield _Record(number, data)


def _check_columns(config: SourceConfig, names: tuple[str, ...], label: str) -> tuple[str, ...]:
    """The columns to read from a tabular source; SourceError for a named one that is absent."""
    wanted = [(config.prompt_field, "prompt_field")]
    if config.answer_field in names or config.require_answer:
        wanted.append((config.answer_field, "answer_field"))
    wanted += [(name, "meta_fields") for name in config.meta_fields]
    for name, option in wanted:
        if name not in names:
            hint = did_you_mean(name, names) or f"; its columns: {', '.join(names) or 'none'}"
            raise SourceError(f"{label}: no column {name!r} (from `{option}`){hint}")
    return tuple(dict.fromkeys(name for name, _ in wanted))


def _parquet_file(path: Path) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"parquet source {path}: not a readable Parquet file ({exc})") from exc


def _parquet_records(pf: Any, columns: tuple[str, ...]) -> Iterator[_Record]:
    """Rows a batch at a time; a row group that fails to decode makes its rows bad rows."""
    import pyarrow as pa

    first = 1
    for group in range(pf.metadata.num_row_groups):
        rows = pf.metadata.row_group(group).num_rows
        done = 0
        try:
            for batch in pf.iter_batches(
                batch_size=_BATCH, row_groups=[group], columns=list(columns)
            ):
                for data in batch.to_pylist():
                    yield _Record(first + done, data)
                    done += 1
        except (pa.ArrowException, OSError) as exc:
            for number in range(first + done, first + rows):
                yield _Record(number, reason="unreadable", detail=f"row group {group}: {exc}")
        first += rows


# --------------------------------------------------------------------------- datasets folders
def _subsets(folder: Path) -> list[str]:
    """The subsets of a DatasetDict folder; [] for a single Dataset (or not a folder)."""
    index = folder / "dataset_dict.json"
    if not index.is_file():
        return []
    try:
        splits = json.loads(index.read_text()).get("splits")
    except (OSError, ValueError, AttributeError) as exc:
        raise SourceError(f"hf_disk source {folder}: unreadable dataset_dict.json ({exc})") from exc
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise SourceError(f"hf_disk source {folder}: dataset_dict.json has no list of splits")
    return splits


def _pick_subset(folder: Path, role: str) -> str | None:
    """Which subset of a DatasetDict folder serves ``role``; None for a plain Dataset folder."""
    subsets = _subsets(folder)
    if not subsets:
        return None
    wanted = ("train",) if role == "train" else _EVAL_SUBSETS
    for name in wanted:
        if name in subsets:
            return name
    if role != "eval" and len(subsets) == 1:
        return subsets[0]  # the only subset: what else could be meant
    raise SourceError(
        f"hf_disk source {folder}: a DatasetDict with subsets {', '.join(subsets)}; "
        f"the {'train' if role == 'train' else 'eval'} split reads {' or '.join(wanted)}"
    )


def _hf_part(config: SourceConfig, folder: Path, role: str, keep: _Keep) -> _Part:
    if not folder.is_dir():
        what = "is a file, not a save_to_disk folder" if folder.exists() else "not found"
        raise SourceError(f"hf_disk source {_shown(folder)}: {what}")
    subset = _pick_subset(folder, role)
    data_dir = folder / subset if subset else folder
    label = str(data_dir)
    if not (data_dir / "state.json").is_file():
        raise SourceError(
            f"hf_disk source {label}: not a datasets save_to_disk folder "
            "(no state.json or dataset_dict.json)"
        )
    name = f"{folder.name}/{subset}" if subset else folder.name
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        try:
            ds = datasets.load_from_disk(str(data_dir))
        except (OSError, ValueError) as exc:
            raise SourceError(f"hf_disk source {label}: cannot load it ({exc})") from exc
        return _dataset_part(config, ds, label, name, folder.name, keep)
    files, schema_names = _arrow_files(data_dir)
    columns = _check_columns(config, schema_names, label)
    records = _arrow_records(files, columns, label)
    return _config_part(config, label, name, folder.name, records, columns, keep)


def _dataset_part(
    config: SourceConfig, ds: Any, label: str, name: str, task: str, keep: _Keep
) -> _Part:
    """A loaded ``datasets.Dataset`` read a batch at a time, its columns mapped by the config."""
    columns = _check_columns(config, tuple(ds.column_names), label)
    records = _dataset_records(ds.select_columns(list(columns)).with_format(None))
    return _config_part(config, label, name, task, records, columns, keep)


# --------------------------------------------------------------- reasoning-gym (reasoning_gym)
def _reasoning_gym_part(config: SourceConfig, split: str, hashed: bool) -> _Part:
    if split == "eval" and not hashed:
        raise SourceError(
            f"reasoning_gym {config.dataset}: no eval split: set `eval_fraction` (a share of "
            "the items held out)"
        )
    rows = reasoning_gym_items(config.dataset, config.options, config.size, config.seed)
    records = (_Record(i, row) for i, row in enumerate(rows, start=1))
    name = config.dataset
    keep: _Keep = split if hashed else "all"  # type: ignore[assignment]
    return _Part(
        f"reasoning_gym {name}", name, name, records, None, keep,
        meta_keys=("reasoning_gym",), id_key="id",
    )  # fmt: skip


# ------------------------------------------------------------ verifiers environments (verifiers)
def _verifiers_part(config: SourceConfig, split: str, hashed: bool) -> _Part:
    """The environment's ``split`` dataset (a hashed share of it, with ``eval_fraction``); else
    for eval its eval dataset, whose prompts the training split then leaves out."""
    env, args = config.env, config.env_args
    trained: Literal["train", "eval"] = config.split  # type: ignore[assignment]
    own_eval = not hashed and trained == "train" and verifiers_has_eval(env, args)
    which, keep, held = trained, "all", frozenset()
    if hashed:
        keep = split
    elif split == "eval":
        if not own_eval:
            raise SourceError(
                f"verifiers {env}: no eval split: the environment has no eval dataset "
                f"{'apart from the one trained on ' if trained == 'eval' else ''}(verifiers would "
                "serve its training prompts); set `eval_fraction` (a share held out)"
            )
        which = "eval"
    elif own_eval:
        _, _, eval_rows = verifiers_rows(env, args, "eval")
        held = frozenset(_split_key(row["prompt"]) for row in eval_rows)
    label, meta_keys, rows = verifiers_rows(env, args, which)
    records = (_Record(i, row) for i, row in enumerate(rows, start=1))
    return _Part(
        f"verifiers {label}", label, env, records, None, keep,  # type: ignore[arg-type]
        meta_keys=meta_keys, id_key="id", held=held, require_answer=False,
    )  # fmt: skip


# ------------------------------------------------------------------ datasets by name (kind hf)
def _hub_part(config: SourceConfig, split: str, hashed: bool) -> _Part:
    """``split`` of the dataset ``config.dataset`` names: the ``split`` it reads (the held-out
    share of it, with ``eval_fraction``), or ``eval_split``."""
    if split == "train":
        wanted, option, keep = config.split, "split", "train" if hashed else "all"
    elif config.eval_split:
        wanted, option, keep = config.eval_split, "eval_split", "all"
    elif hashed:
        wanted, option, keep = config.split, "split", "eval"
    else:
        raise SourceError(
            f"hf source {config.dataset}: no eval split: set `eval_split` (the dataset's test or "
            "validation split) or `eval_fraction` (a share of `split` held out)"
        )
    ds, label = _load_dataset(config, wanted, option)
    folder = Path(config.dataset)
    # prompt ids: org/name[/config]/split:ROW, or for a local folder its name/split:ROW
    repo = folder.name if folder.is_dir() else config.dataset.partition("@")[0]
    name = "/".join(p for p in (repo, config.dataset_config, wanted) if p)
    return _dataset_part(config, ds, label, name, Path(repo).name, keep)


def _load_dataset(config: SourceConfig, split: str, option: str) -> tuple[Any, str]:
    """``datasets``' ``load_dataset(dataset, dataset_config, split=...)``, in its two steps so
    that an error names the key at fault: the dataset and configuration, then the split. It
    reads the cache (``HF_DATASETS_CACHE``, else ``HF_HOME/datasets``) and, unless
    ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` is set, the Hub."""
    try:
        import datasets
    except ImportError as exc:
        raise SourceError("kind hf needs the `datasets` package: pip install datasets") from exc
    spec = config.dataset
    path, revision = spec, None
    if not Path(spec).is_dir() and "@" in spec:
        path, _, revision = spec.partition("@")
    subset = config.dataset_config or None
    asked = f"hf source {spec!r}" + (f" (dataset_config {subset!r})" if subset else "")
    label = f"hf source {spec}" + (f" ({subset})" if subset else "") + f" [{split}]"
    offline = bool(getattr(datasets.config, "HF_HUB_OFFLINE", datasets.config.HF_DATASETS_OFFLINE))
    try:
        builder = datasets.load_dataset_builder(path, subset, revision=revision)
    except ConnectionError as exc:  # offline (or the Hub unreachable) and not in the cache
        why = "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set" if offline else "the Hub is unreachable"
        raise SourceError(
            f"{asked}: not in the datasets cache {datasets.config.HF_DATASETS_CACHE} and {why} "
            f"({exc}); check `dataset`, or load it once where the Hub is reachable (same HF_HOME)"
            + (", or unset HF_HUB_OFFLINE/HF_DATASETS_OFFLINE" if offline else "")
        ) from exc
    except Exception as exc:  # datasets' own errors: no such dataset, configuration, files...
        raise SourceError(
            f"{asked}: cannot load it: {type(exc).__name__}: {exc}; check `dataset`"
            + (
                " and `dataset_config`"
                if subset
                else " (and set `dataset_config` if it has several)"
            )
        ) from exc
    try:
        builder.download_and_prepare()
    except Exception as exc:  # a download or a data file that fails
        raise SourceError(f"{asked}: cannot prepare it: {type(exc).__name__}: {exc}") from exc
    try:
        ds = builder.as_dataset(split=split)
    except (ValueError, KeyError) as exc:
        splits = ", ".join(builder.info.splits or ())
        why = f"its splits: {splits}" if splits else str(exc)
        raise SourceError(f"{asked}: no split {split!r} (`{option}`); {why}") from exc
    return ds, label


def _dataset_records(ds: Any) -> Iterator[_Record]:
    number = 1
    for batch in ds.iter(batch_size=_BATCH):
        names = list(batch)
        for values in zip(*(batch[n] for n in names), strict=True):
            yield _Record(number, dict(zip(names, values, strict=True)))
            number += 1


def _arrow_files(data_dir: Path) -> tuple[list[Path], tuple[str, ...]]:
    """The shard files of a save_to_disk folder (read without ``datasets``) and their columns."""
    import pyarrow as pa

    try:
        state = json.loads((data_dir / "state.json").read_text())
        files = [data_dir / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"hf_disk source {data_dir}: unreadable state.json ({exc})") from exc
    if not files:
        raise SourceError(f"hf_disk source {data_dir}: state.json lists no data files")
    try:
        with pa.memory_map(str(files[0])) as source:
            names = tuple(pa.ipc.open_stream(source).schema.names)
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(
            f"hf_disk source {files[0]}: not a readable Arrow stream ({exc})"
        ) from exc
    return files, names


def _arrow_records(files: list[Path], columns: tuple[str, ...], label: str) -> Iterator[_Record]:
    import pyarrow as pa

    number = 1
    for path in files:
        try:
            with pa.memory_map(str(path)) as source:
                for batch in pa.ipc.open_stream(source):
                    for data in batch.select(list(columns)).to_pylist():
                        yield _Record(number, data)
                        number += 1
        except (pa.ArrowException, OSError, KeyError) as exc:
            raise SourceError(f"hf_disk source {label}: cannot read {path.name} ({exc})") from exc


# ------------------------------------------------------------------------------- checking rows
def _load_tokenizer(config: SourceConfig) -> PreTrainedTokenizerBase:
    if not config.tokenizer:
        return make_chain_tokenizer() if config.kind == "chain" else make_tokenizer()
    try:
        path = resolve_model(config.tokenizer, what="tokenizer", needs="tokenizer")
    except HubError as exc:
        raise SourceError(f"{exc} (the model whose tokenizer encodes the prompts)") from exc
    try:  # transformers (and torch) only for a folder whose tokenizer needs them
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise SourceError(f"tokenizer {path}: cannot load it ({exc})") from exc


def _split_key(prompt: str | list) -> str:
    """What the split hashes of a prompt: the text, or the JSON of its chat messages."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)


def _held_out(key: str, seed: int, fraction: float) -> bool:
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def _messages_ok(value: list) -> bool:
    return bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )


def _plain(value: Any) -> Any:
    """``value`` made of what a message can carry (str-keyed maps, lists, scalars)."""
    if value is None or isinstance(value, (str, bool, int, float, bytes)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)  # dates, decimals...


class LazyPrompts:
    """A built-in task's problems, each tokenized (and rendered by the chat template, with
    ``chat_template: true``) when it is read (``prompts[i]``): the same ``prompt`` data as
    ``load_prompts`` gives eagerly, or ``None`` for a problem the template fails on or that
    comes out longer than ``max_prompt_tokens`` (the reader skips it; ``bad`` counts it by
    reason, and the first few are logged as bad rows are)."""

    def __init__(self, loader: _Loader, part: _Part) -> None:
        assert part.problems is not None
        self._loader, self._part = loader, part
        self._rows = list(part.problems)
        loader.read_rows = len(self._rows)

    @property
    def bad(self) -> dict[str, int]:
        return self._loader.bad

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        text, answer, prompt_id = row = self._rows[index]
        loader, number = self._loader, index % len(self._rows) + 1
        # exactly the eager path, one row at a time: a failure is counted and logged there
        if loader.config.chat_template:  # the row checks, the template, the tokenizer, the limit
            loader.check(self._part, number, {"prompt": text, "answer": answer, "id": prompt_id})
            loader.flush()
        else:  # as read_problems does
            (ids,) = loader.encode([text], True)
            loader.add_problem(self._part, number, row, ids)
        return loader.prompts.pop() if loader.prompts else None


@dataclass
class _Pending:
    part: _Part
    number: int
    prompt_id: str
    text: str
    templated: bool
    meta: dict[str, Any]


class _Loader:
    """Checks the rows of one ``load_prompts`` call, tokenizes them, counts what is bad."""

    def __init__(self, config: SourceConfig, tokenizer: PreTrainedTokenizerBase, log: Any) -> None:
        self.config, self.tokenizer, self.log = config, tokenizer, log
        self.prompts: list[dict[str, Any]] = []
        self.bad: dict[str, int] = {}
        self.read_rows = 0
        self.other_split = 0
        self.pending: list[_Pending] = []
        if config.chat_template and not getattr(tokenizer, "chat_template", None):
            raise SourceError(
                f"tokenizer {config.tokenizer}: has no chat template, but chat_template is true"
            )

    def summary(self) -> str:
        bad = ", ".join(f"{n} {reason}" for reason, n in sorted(self.bad.items())) or "none"
        return f"{self.read_rows} rows read; bad: {bad}; in the other split: {self.other_split}"

    def reject(self, part: _Part, number: int, reason: str, detail: str = "") -> None:
        self.bad[reason] = self.bad.get(reason, 0) + 1
        total = sum(self.bad.values())
        if total <= _WARN_ROWS:
            extra = {"detail": detail} if detail else {}
            self.log.warning("bad_row", file=part.label, row=number, reason=reason, **extra)
        elif total == _WARN_ROWS + 1:
            self.log.warning("bad_rows_quiet", logged=_WARN_ROWS, note="the rest are only counted")

    def read(self, part: _Part) -> None:
        if part.problems is not None and not self.config.chat_template:
            self.read_problems(part, part.problems)
            return
        seen_fields: set[str] = set()
        first_fields: list[str] | None = None
        for record in part.records:
            self.read_rows += 1
            if record.reason:
                self.reject(part, record.number, record.reason, record.detail)
                continue
            if not isinstance(record.data, dict):
                kind = type(record.data).__name__
                self.reject(part, record.number, "not_an_object", f"a JSON {kind}")
                continue
            if part.columns is None:
                seen_fields.update(record.data)
                if first_fields is None:
                    first_fields = list(record.data)
            self.check(part, record.number, record.data)
            if len(self.pending) >= _BATCH:
                self.flush()
        self.flush()
        if part.columns is None and first_fields is not None:
            self.check_fields(part, seen_fields, first_fields)

    def read_problems(self, part: _Part, rows: Iterable[tuple[str, str, str]]) -> None:
        """A built-in task's problems: only tokenized and held to ``max_prompt_tokens`` (the
        row checks cannot fail for them), in large batches: the calculator's 800,000 prompts
        load in 8 s instead of 13 (most of what is left is the tokenizer itself)."""
        rows = iter(rows)
        while True:
            batch = list(itertools.islice(rows, _PROBLEM_BATCH))
            if not batch:
                return
            encoded = self.encode([text for text, _, _ in batch], True)
            for row, ids in zip(batch, encoded, strict=True):
                self.read_rows += 1
                self.add_problem(part, self.read_rows, row, ids)

    def add_problem(
        self, part: _Part, number: int, row: tuple[str, str, str], ids: list[int]
    ) -> None:
        """One tokenized problem ``(text, answer, prompt id)``, held to ``max_prompt_tokens``."""
        limit = self.config.max_prompt_tokens
        if len(ids) > limit:
            self.reject(part, number, "too_long", f"{len(ids)} tokens > {limit}")
            return
        text, answer, prompt_id = row
        meta = {"task": part.task, "text": text, "answer": answer}
        self.prompts.append({"prompt_id": prompt_id, "input_ids": ids, "meta": meta})

    def check_fields(self, part: _Part, seen: set[str], first: list[str]) -> None:
        """A field the config names that no row of a JSON-lines file has is a config error."""
        wanted = [(part.prompt_key, "prompt_field")]
        if self.config.require_answer:
            wanted.append((part.answer_key, "answer_field"))
        wanted += [(name, "meta_fields") for name in part.meta_keys]
        for name, option in wanted:
            if name not in seen:
                hint = did_you_mean(name, seen) or f"; the first row has: {', '.join(first)}"
                raise SourceError(f"{part.label}: no row has the field {name!r} (`{option}`){hint}")

    def check(self, part: _Part, number: int, data: dict[str, Any]) -> None:
        config = self.config
        prompt = data.get(part.prompt_key)
        if prompt is None:
            self.reject(part, number, "missing_prompt")
            return
        if isinstance(prompt, str):
            if not prompt.strip():
                self.reject(part, number, "empty_prompt")
                return
        elif not (isinstance(prompt, list) and _messages_ok(prompt)):
            what = "not a list of {role, content} strings" if isinstance(prompt, list) else ""
            self.reject(part, number, "bad_prompt", what or f"a {type(prompt).__name__}")
            return
        key = _split_key(prompt)
        if part.keep != "all":
            held = _held_out(key, config.split_seed, config.eval_fraction)
            if held != (part.keep == "eval"):
                self.other_split += 1
                return
        if key in part.held:
            self.other_split += 1
            return
        answer = data.get(part.answer_key)
        required = config.require_answer if part.require_answer is None else part.require_answer
        if answer is None and required:
            self.reject(part, number, "missing_answer")
            return
        text, templated = self.render(part, number, prompt)
        if text is None:
            return
        meta: dict[str, Any] = {"task": part.task, "text": text}
        if templated:  # the conversation itself, for rollouts that render their own context
            meta["messages"] = (
                prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            )
        meta.update({name: _plain(data.get(name)) for name in part.meta_keys})
        if answer is not None:
            meta["answer"] = str(answer)
        prompt_id = data[part.id_key] if part.id_key else f"{part.name}:{number}"
        self.pending.append(_Pending(part, number, prompt_id, text, templated, meta))

    def render(self, part: _Part, number: int, prompt: str | list) -> tuple[str | None, bool]:
        """The text the model sees, and whether a chat template made it."""
        if isinstance(prompt, str) and not self.config.chat_template:
            return prompt, False
        if not getattr(self.tokenizer, "chat_template", None):
            raise SourceError(
                f"{part.label} row {number}: the prompt is a list of chat messages, but the "
                f"tokenizer {self.config.tokenizer or f'({self.config.kind})'} has no chat template"
            )
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # the template is the model's code: whatever it raises, skip
            self.reject(part, number, "chat_template", f"{type(exc).__name__}: {exc}")
            return None, True
        return text, True

    def encode(self, texts: list[str], special: bool) -> list[list[int]]:
        """Token ids of ``texts``. A fast tokenizer without padding or truncation set is asked
        directly (its ``encode_batch``): the same ids as calling the tokenizer, without the
        per-row conversion ``transformers`` does, which was half of the time of loading the
        calculator's 800,000 prompts. One text (a lazy source reads one problem at a time) is
        encoded on this thread: ``encode_batch`` hands even one text to its thread pool, 28 us
        a prompt in a busy run against 10."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.padding is None and backend.truncation is None:
            if len(texts) == 1:
                return [backend.encode(texts[0], add_special_tokens=special).ids]
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=special)]
        encoded = self.tokenizer(
            texts, add_special_tokens=special, return_attention_mask=False, verbose=False
        )["input_ids"]
        return [list(row) for row in encoded]

    def flush(self) -> None:
        """Tokenize the pending prompts (one call per kind: a chat template already added
        the special tokens, plain text gets the tokenizer's own)."""
        if not self.pending:
            return
        ids: list[list[int] | None] = [None] * len(self.pending)
        for templated in (False, True):
            where = [i for i, p in enumerate(self.pending) if p.templated == templated]
            if not where:
                continue
            encoded = self.encode([self.pending[i].text for i in where], not templated)
            for i, row_ids in zip(where, encoded, strict=True):
                ids[i] = row_ids
        limit = self.config.max_prompt_tokens
        for p, row_ids in zip(self.pending, ids, strict=True):
            assert row_ids is not None
            if len(row_ids) > limit:
                self.reject(p.part, p.number, "too_long", f"{len(row_ids)} tokens > {limit}")
                continue
            self.prompts.append({"prompt_id": p.prompt_id, "input_ids": row_ids, "meta": p.meta})
        self.pending.clear()
