"""The teacher of on-policy distillation: a model served by an engine (the built-in one or
SGLang) that scores the student's own samples, token by token.

Each sample the scorer scores goes to the teacher whole, its context and its completion (tokens
a tool or an environment inserted included: they are context), as ``input_ids`` with
``max_new_tokens: 0``, ``return_logprob`` and ``logprob_start_len`` at the context's last
token, a batch of samples a call (SGLang's prefill-only scoring; ``stages/engine/
prompt_logprobs.py``). The answer's ``meta_info.input_token_logprobs`` gives the log-prob of
every completion token under the teacher (of the raw logits: temperature 1). The scorer puts
them in the sample as ``teacher_logprobs``; the learner turns them into per-token advantages
(``stages.learner.distill``). Where a token was inserted its teacher value means nothing.

Calls go through an ``HttpCaller`` (``remote.py``: a connection pool, ``timeout_s`` a call,
``retries``, at most ``concurrency`` calls in flight). A call that fails for good, or an answer
that is not the engine's for these samples (not a list of one result a sample, the wrong number
of log-probs, other tokens than the sample's) leaves its samples without teacher values, and so
does a value that is not a finite number (that sample only): counted by kind
(``teacher_failed_<kind>``, samples), the first of each kind logged (``teacher_failed``). The
group goes on to the learner as it is; a learner that distills drops it (``no_teacher``).

Set-up (``start``): with ``launch`` the scorer starts the engine as a generator starts its own
(``EngineLauncher``: restarted when it dies, its output in ``RUN_DIR/logs``). With
``check_tokenizer`` (the default) a teacher whose tokenizer is not the student's is refused
before any sample is scored, the stage failing with what differs:

- where the teacher's tokenizer is on this machine (``launch.model``, or the folder that the
  engine's ``/model_info`` names as ``tokenizer_path``), every token of the student's
  vocabulary must have the same id in the teacher's (the teacher may have more, added tokens
  the student never samples; which token ends a turn may differ);
- in every case the engine itself is asked (``/generate`` prefill only, with
  ``return_text_in_logprobs``) for the text of a spread of the student's token ids (its end,
  start and padding tokens included), which must be the text the student's tokenizer gives
  each of them.

Not checkable from here: a teacher on another machine with the same ids for the probe's tokens
and different ones elsewhere (the probe asks about 24 ids; a different tokenizer differs almost
everywhere), and chat templates (the samples' token ids are sent, never text).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stages.generator.launcher import EngineLauncher, LaunchConfig
from stages.scorer.spec import check_headers, check_one_engine, http_option, http_url

__all__ = ["Teacher", "TeacherSpec"]

_PROBE_IDS = 24  # most token ids the probe asks about (within a tiny model's context)
_SHOWN = 5  # differing tokens named in an error


@dataclass
class TeacherSpec:
    url: str | None = field(
        default=None,
        metadata={
            "doc": "the teacher engine's URL (one you started: `inflight engine --model TEACHER "
            "--port N`, or SGLang's launch_server): http://HOST:PORT"
        },
    )
    launch: LaunchConfig | None = field(
        default=None,
        metadata={
            "doc": "start the teacher engine with the scorer instead: the generator's launch "
            "options (kind builtin|sglang, model, device, dtype, python, extra_args...), one "
            "engine in a process of its own"
        },
    )
    check_tokenizer: bool = field(
        default=True,
        metadata={
            "doc": "refuse, before any sample is scored, a teacher whose tokenizer gives other "
            "ids than the student's (false: no check, for a teacher that cannot tokenize text)"
        },
    )
    timeout_s: float = http_option("timeout_s")
    retries: int = http_option("retries")
    backoff_s: float = http_option("backoff_s")
    concurrency: int = http_option("concurrency")
    batch_size: int | None = http_option("batch_size")
    headers: dict[str, str] = http_option("headers")  # noqa: RUF009 (a field)

    def __post_init__(self) -> None:
        if (self.url is None) == (self.launch is None):
            raise ValueError(
                "a teacher has exactly one of url (an engine you started) or launch (the "
                "scorer starts one)"
            )
        check_headers(self.headers)
        if self.url is not None:
            http_url(self.url, "url")
            return
        assert self.launch is not None
        check_one_engine(self.launch, "the teacher's")


class _Bad(Exception):
    """One sample's answer is unusable: ``kind`` and why."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


class Teacher:
    """Teacher log-probs of samples' completions: ``start``, then ``logprobs`` per scoring
    call, ``aclose`` at the end. ``stats()``: its counters for the scorer's metrics."""

    def __init__(
        self,
        spec: TeacherSpec,
        log: Any,
        *,
        api_key: str | None,
        name: str,
        log_dir: Path,
        log_level: str = "info",
    ) -> None:
        from stages.engine.auth import auth_headers
        from stages.scorer.remote import HttpCaller

        self.spec, self.log = spec, log
        self.launcher = (
            EngineLauncher(
                spec.launch,
                name=f"{name}.teacher",
                log_dir=log_dir,
                log=log,
                log_level=log_level,
                api_key=api_key,
            )
            if spec.launch is not None
            else None
        )
        self.url = (spec.url or "").rstrip("/")
        who = {"teacher": self.url or spec.launch.model}  # type: ignore[union-attr]
        self.http = HttpCaller(
            spec, log, event="teacher_failed", who=who, headers=auth_headers(api_key)
        )
        self.scored = 0  # samples given teacher log-probs

    async def start(self, student: Any, load_tokenizer: Callable[[str], Any]) -> None:
        """Start the engine (``launch``) and check its tokenizer against ``student`` (the
        scorer's); raises ``ValueError`` saying what differs. ``load_tokenizer(folder or Hub
        id)`` loads a tokenizer."""
        check = self.spec.check_tokenizer
        if self.launcher is not None:
            if check:  # before anything starts
                model = self.spec.launch.model  # type: ignore[union-attr]
                teacher = await asyncio.to_thread(load_tokenizer, model)
                _same_ids(student, teacher, f"the teacher's ({model})")
            self.url = (await self.launcher.start())[0]
            self.http.who["teacher"] = self.url
        await self.http.start()
        if check:
            await self._check_engine(student, load_tokenizer)

    async def aclose(self) -> None:
        await self.http.aclose()
        if self.launcher is not None:
            await self.launcher.close()

    # ---------------------------------------------------------------------- the check
    async def _check_engine(self, student: Any, load_tokenizer: Callable[[str], Any]) -> None:
        from stages.scorer.remote import HttpFailure

        try:
            path = await self._tokenizer_path() if self.launcher is None else None
            if path is not None:  # a folder on this machine: compare the vocabularies

                def load() -> Any:
                    return load_tokenizer(path) if Path(path).is_dir() else None

                teacher = await asyncio.to_thread(load)
                if teacher is not None:
                    _same_ids(student, teacher, f"the teacher's ({path}, from /model_info)")
            ids = _probe_ids(student)
            body = {
                "input_ids": ids,
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0},
            }
            reply = await self.http.post(f"{self.url}/generate", body)
        except HttpFailure as failure:
            raise ValueError(
                f"teacher {self.url}: cannot check its tokenizer ({failure.kind}: "
                f"{failure.message}); is the engine up? (check_tokenizer: false skips the check)"
            ) from None
        try:
            entries = reply["meta_info"]["input_token_logprobs"]
            theirs = {int(entry[1]): entry[2] for entry in entries}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(
                f"teacher {self.url}: its answer to the tokenizer probe is not an engine's "
                f"({exc!r})"
            ) from None
        ours = {i: student.decode([i], skip_special_tokens=False) for i in ids}
        differ = [(i, text, theirs.get(i)) for i, text in ours.items() if theirs.get(i) != text]
        if differ:
            shown = ", ".join(f"{i}: {a!r} vs {b!r}" for i, a, b in differ[:_SHOWN])
            raise ValueError(
                f"teacher {self.url}: {len(differ)} of {len(ids)} token ids probed are other "
                f"text to its tokenizer than to the student's ({shown}): the teacher must share "
                "the student's tokenizer (its log-probs are read by token id)"
            )
        self.log.info("teacher_ready", teacher=self.url, probe_tokens=len(ids))

    async def _tokenizer_path(self) -> str | None:
        """The ``tokenizer_path`` the teacher's ``/model_info`` gives (None: none)."""
        for route in ("/model_info", "/get_model_info"):  # SGLang: older versions have only one
            status, info = await self.http.get(f"{self.url}{route}")
            if status == 200 and isinstance(info, Mapping):
                path = info.get("tokenizer_path")
                return path if isinstance(path, str) and path else None
        return None

    # ---------------------------------------------------------------------- scoring
    async def logprobs(
        self, samples: Sequence[Mapping[str, Any]], context: Mapping[str, Any]
    ) -> list[np.ndarray | None]:
        """Each sample's teacher log-probs (float32, one per completion token), or None where
        the teacher failed for it (counted, the first failure of each kind logged)."""
        n = len(samples)
        size = self.spec.batch_size or n
        spans = [(lo, min(n, lo + size)) for lo in range(0, n, size)]
        parts = await asyncio.gather(*(self._call(samples[lo:hi], context) for lo, hi in spans))
        out = [values for part in parts for values in part]
        self.scored += sum(values is not None for values in out)
        return out

    async def _call(
        self, samples: Sequence[Mapping[str, Any]], context: Mapping[str, Any]
    ) -> list[np.ndarray | None]:
        from stages.scorer.remote import HttpFailure, quoted

        sequences, starts = [], []
        for sample in samples:
            prompt = np.asarray(sample["prompt_ids"]).tolist()
            sequences.append(prompt + np.asarray(sample["completion_ids"]).tolist())
            starts.append(len(prompt) - 1)  # entry 0 is None: the context's last token
        body = {
            "input_ids": sequences,
            "return_logprob": True,
            "logprob_start_len": starts,
            "sampling_params": {"max_new_tokens": 0},
        }
        n = len(samples)
        try:
            reply = await self.http.post(f"{self.url}/generate", body)
            if not isinstance(reply, list) or len(reply) != n:
                got = len(reply) if isinstance(reply, list) else type(reply).__name__
                raise HttpFailure(
                    "bad_response", f"{got} results for {n} sequences: {quoted(reply)}"
                )
        except HttpFailure as failure:
            self.http.failed_call(failure, n, context)
            return [None] * n
        out: list[np.ndarray | None] = []
        bad: dict[int, tuple[str, str]] = {}
        for i, (result, ids, start) in enumerate(zip(reply, sequences, starts, strict=True)):
            try:
                out.append(_completion_logprobs(result, ids, start))
            except _Bad as problem:
                bad[i] = (problem.kind, problem.message)
                out.append(None)
        self.http.bad_values(bad, context)
        return out

    def stats(self) -> dict[str, int]:
        """``teacher_samples`` (given log-probs), ``teacher_calls``, ``teacher_errors``,
        ``teacher_timeouts``, ``teacher_retries`` and ``teacher_failed_<kind>`` (samples)."""
        stats = {"teacher_samples": self.scored}
        stats.update((f"teacher_{key}", value) for key, value in self.http.counts.items())
        stats.update((f"teacher_failed_{kind}", n) for kind, n in self.http.failed.items())
        return stats


def _completion_logprobs(result: Any, ids: list[int], start: int) -> np.ndarray:
    """The log-probs of ``ids[start + 1:]`` in one engine result; raises ``_Bad``."""
    try:
        entries = result["meta_info"]["input_token_logprobs"]
        tokens = [entry[1] for entry in entries]
        values = [entry[0] for entry in entries[1:]]
    except (KeyError, IndexError, TypeError) as exc:
        raise _Bad("bad_response", f"no input_token_logprobs in the result ({exc!r})") from None
    if tokens[1:] != ids[start + 1 :]:
        raise _Bad(
            "bad_response",
            f"log-probs of {len(tokens) - 1} tokens {tokens[1:8]}... for the completion's "
            f"{len(ids) - start - 1} {ids[start + 1 : start + 8]}...",
        )
    for k, value in enumerate(values):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise _Bad("bad_value", f"the log-prob of completion token {k} is {value!r}")
    return np.asarray(values, dtype=np.float32)


def _same_ids(student: Any, teacher: Any, whose: str) -> None:
    """A ValueError unless every token of ``student``'s vocabulary has its id in ``teacher``'s."""
    theirs = teacher.get_vocab()
    differ = [
        (tok, i, theirs.get(tok)) for tok, i in student.get_vocab().items() if theirs.get(tok) != i
    ]
    if not differ:
        return
    shown = ", ".join(
        f"{tok!r}: {i} vs {other}" for tok, i, other in sorted(differ, key=lambda d: d[1])[:_SHOWN]
    )
    raise ValueError(
        f"{whose} tokenizer gives {len(differ)} of the student's {len(student.get_vocab())} "
        f"tokens another id or none ({shown}...): the teacher must share the student's "
        "tokenizer (its log-probs are read by token id)"
    )


def _probe_ids(student: Any) -> list[int]:
    """The token ids the probe asks the teacher engine about: the student's end, start and
    padding tokens, and a spread over its base vocabulary. Not every special token: a tokenizer
    class may add one the model has no row for (transformers' Qwen2Tokenizer adds an unknown
    ``<|endoftext|>`` to a tokenizer.json without one), which an engine refuses."""
    size = student.vocab_size
    roles = (student.eos_token_id, student.bos_token_id, student.pad_token_id)
    spread = range(0, size, max(1, -(-size // (_PROBE_IDS - 3))))
    return list(dict.fromkeys([*(i for i in roles if isinstance(i, int)), *spread]))
