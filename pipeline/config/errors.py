"""Config problems: one :class:`ConfigIssue` per mistake, all raised together in a ConfigError.

Validation never stops at the first mistake: every step appends issues to a list and the loader
raises one :class:`ConfigError` holding all of them, so a user fixes a file in one pass. Each
issue says where (``file.yaml:LINE`` or ``override 'KEY=VALUE'``), which key (dotted path) and
what is wrong and how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ConfigError", "ConfigIssue"]


@dataclass(frozen=True)
class ConfigIssue:
    """One mistake in a config.

    ``path`` is the dotted key path (``stages.square.replicas``; ``""`` for the whole file),
    ``where`` is ``file.yaml:LINE[:COL]``, ``override 'TEXT'`` or ``""`` when unknown.
    """

    path: str
    message: str
    where: str = ""

    def __str__(self) -> str:
        return ": ".join(part for part in (self.where, self.path, self.message) if part)


class ConfigError(Exception):
    """Every problem found in a config, reported at once (``.issues``, in file order)."""

    def __init__(self, issues: Sequence[ConfigIssue], source: str = "") -> None:
        if not issues:
            raise ValueError("a ConfigError needs at least one issue")
        super().__init__(list(issues), source)  # args make it picklable across processes
        self.issues: list[ConfigIssue] = list(issues)
        self.source = source

    def __str__(self) -> str:
        if len(self.issues) == 1:
            return str(self.issues[0])
        head = (
            f"{len(self.issues)} problems in {self.source}:"
            if self.source
            else (f"{len(self.issues)} problems:")
        )
        return "\n".join([head, *(f"  {issue}" for issue in self.issues)])
