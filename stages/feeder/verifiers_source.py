"""A ``verifiers`` environment's datasets as a prompt source (``kind: verifiers``).

``source: {kind: verifiers, env: NAME, env_args: {...}, split: train|eval, tokenizer: MODEL}``
loads the environment (``stages.verifiers_env``) and reads its dataset as verifiers formats it
(``env.get_dataset()``, or with ``split: eval`` ``env.get_eval_dataset()``): each row's
``prompt``, a list of chat messages with the environment's system prompt and few-shot examples
already in it, is the prompt (rendered by the tokenizer's chat template, as any source's chat
prompts are). ``answer``, ``info``, ``task`` and ``example_id`` go into ``meta`` (the answer as
a string, as for every source); ``meta.verifiers`` names the environment and carries the row's
other columns, so that the ``verifiers`` agent and reward give the environment the very row
verifiers would. Prompt ids are ``ENV:EXAMPLE_ID`` (``ENV/eval:EXAMPLE_ID`` for the eval
dataset). How the held-out split is chosen (and kept apart from training) is ``sources.py``'s.

An environment that cannot be loaded, ``env_args`` its ``load_environment`` refuses, or a
dataset without a ``prompt`` column is a ``VerifiersError`` naming the key, before the run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

from stages.verifiers_env import VerifiersError, environment, spec

__all__ = ["FIELDS", "check", "has_eval", "rows"]

FIELDS = ("answer", "info", "task", "example_id")  # what of a row goes into meta as is
_BATCH = 512


def _dataset(env: str, env_args: Mapping[str, Any], which: Literal["train", "eval"]) -> Any:
    made = environment(env, env_args)
    what = "dataset" if which == "train" else "eval dataset"
    if which == "eval" and not has_eval(env, env_args):
        raise VerifiersError(f"`env` {env!r} has no eval dataset (`split: eval`)")
    try:
        data = made.get_dataset() if which == "train" else made.get_eval_dataset()
    except Exception as exc:  # the environment's own dataset code: whatever it raises
        raise VerifiersError(
            f"`env` {env!r}: building its {what} failed: {type(exc).__name__}: {exc} (verifiers "
            "needs a `prompt` column of chat messages, or a `question` column it makes one from)"
        ) from exc
    columns = list(getattr(data, "column_names", None) or ())
    if "prompt" not in columns:
        raise VerifiersError(
            f"`env` {env!r}: its {what} has no `prompt` column (columns: "
            f"{', '.join(columns) or 'none'}); verifiers environments give each row a list of "
            "chat messages as `prompt`"
        )
    return data


def check(env: str, env_args: Mapping[str, Any], split: Literal["train", "eval"]) -> None:
    """Load the environment and its ``split`` dataset; VerifiersError naming the key if that
    fails (the config's check, before the run)."""
    _dataset(env, env_args, split)


def has_eval(env: str, env_args: Mapping[str, Any]) -> bool:
    """Whether the environment has an eval dataset of its own (verifiers would otherwise serve
    its training dataset as eval, which held-out evaluation must not use)."""
    made = environment(env, env_args)
    return made.eval_dataset is not None or made.eval_dataset_source is not None


def rows(
    env: str, env_args: Mapping[str, Any], which: Literal["train", "eval"]
) -> tuple[str, tuple[str, ...], Iterator[dict[str, Any]]]:
    """``(label, meta keys, rows)`` of one of the environment's datasets: each row's
    ``prompt`` (messages, their null keys dropped), ``id``, ``verifiers`` (``spec``) and the
    ``FIELDS`` it has; the meta keys are those ``FIELDS`` but ``answer``, and ``verifiers``."""
    data = _dataset(env, env_args, which)
    columns = list(data.column_names)
    fields = [name for name in FIELDS if name in columns]
    others = [name for name in columns if name != "prompt" and name not in FIELDS]
    label = env if which == "train" else f"{env}/eval"

    def read() -> Iterator[dict[str, Any]]:
        for batch in data.with_format(None).iter(batch_size=_BATCH):
            for values in zip(*(batch[name] for name in columns), strict=True):
                row = dict(zip(columns, values, strict=True))
                extra = {name: row[name] for name in others}
                out = {name: row[name] for name in fields}
                out["prompt"] = _messages(row["prompt"])
                out["id"] = f"{label}:{row.get('example_id')}"
                out["verifiers"] = spec(env, env_args, fields, extra)
                yield out

    meta_keys = ("verifiers", *(name for name in fields if name != "answer"))
    return label, meta_keys, read()


def _messages(prompt: Any) -> Any:
    """Chat messages without the null keys a dataset adds (Arrow gives every message of a column
    every key any message has: ``tool_calls: None`` would reach the chat template)."""
    if not isinstance(prompt, list):
        return prompt
    return [
        {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in prompt
    ]
