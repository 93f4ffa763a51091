"""reasoning-gym's procedural datasets as a prompt source (``kind: reasoning_gym``).

``source: {kind: reasoning_gym, dataset: NAME, options: {...}, size: N, seed: S, eval_fraction:
F, tokenizer: MODEL}`` makes ``reasoning_gym.create_dataset(NAME, size=N, seed=S, **options)``
(the package's own generator: the same items on every machine) and serves its items as prompts:
the item's ``question`` is the prompt (plain, or as a user message with ``chat_template: true``),
its ``answer`` is ``meta.answer``, and ``meta.reasoning_gym`` names the item (``dataset``,
``options``, ``size``, ``seed``, ``index``) so that the ``reasoning_gym`` reward function can
score a completion with the dataset's own ``score_answer`` (``stages.scorer.rewards``). The
train and eval splits are the items whose question hashes to each side of ``eval_fraction``
(as a file's are): an item and every item with the same question are on one side only, so the
held-out prompts are never trained on. Prompt ids are ``NAME:INDEX``.

An unknown dataset name (with the closest names), options the dataset's config does not take,
or a package that is not installed is a ``SourceError`` before the run starts.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

from pipeline.config.typed import did_you_mean

__all__ = ["ReasoningGymError", "dataset", "dataset_names", "items", "spec_of"]


class ReasoningGymError(ValueError):
    """A dataset that cannot be made; the message says why."""


def _package() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ReasoningGymError(
            "kind reasoning_gym needs the reasoning-gym package: pip install reasoning-gym"
        ) from exc
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset the installed reasoning-gym can make."""
    from reasoning_gym.factory import DATASETS

    _package()
    return sorted(DATASETS)


def spec_of(name: str, options: Mapping[str, Any], size: int, seed: int) -> dict[str, Any]:
    """What ``meta.reasoning_gym`` holds of the dataset (each item adds its ``index``)."""
    return {"dataset": name, "options": dict(options), "size": size, "seed": seed}


def dataset(name: str, options: Mapping[str, Any], size: int, seed: int) -> Any:
    """The dataset (made once per process for the same arguments); ReasoningGymError if it
    cannot be made."""
    return _made(name, json.dumps(dict(options), sort_keys=True), size, seed)


@functools.lru_cache(maxsize=16)
def _made(name: str, options_json: str, size: int, seed: int) -> Any:
    package = _package()
    names = dataset_names()
    if name not in names:
        hint = did_you_mean(name, names) or f"; it has {len(names)}, e.g. {', '.join(names[:8])}"
        raise ReasoningGymError(f"reasoning-gym has no dataset {name!r}{hint}")
    options = json.loads(options_json)
    try:
        return package.create_dataset(name, size=size, seed=seed, **options)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ReasoningGymError(
            f"reasoning-gym dataset {name!r} with options {options}: {type(exc).__name__}: {exc}"
        ) from exc


def items(name: str, options: Mapping[str, Any], size: int, seed: int) -> Iterator[dict]:
    """The dataset's items as source rows: ``prompt``, ``answer``, ``id``, ``reasoning_gym``."""
    data = dataset(name, options, size, seed)
    spec = spec_of(name, options, size, seed)
    for index in range(size):
        item = data[index]
        yield {
            "prompt": item["question"],
            "answer": item["answer"],
            "id": f"{name}:{index}",
            "reasoning_gym": {**spec, "index": index},
        }
