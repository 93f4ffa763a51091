"""What code deep inside a block reports to the code around it, without a list passed down.

``Collector(name)`` holds a context variable: ``with collector.collect() as items:`` gathers
what ``collector.note(...)`` is given while the block runs, in this task and what it awaits or
starts (asyncio copies the context into new tasks); ``note`` outside any block does nothing.
Used where the reporting code sits below an API that cannot carry the list (a reward function
wrapped for a library, a request-model checker called by many routes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Generic, TypeVar

__all__ = ["Collector"]

T = TypeVar("T")


class Collector(Generic[T]):
    def __init__(self, name: str) -> None:
        self._items: ContextVar[list[T] | None] = ContextVar(name, default=None)

    def note(self, items: Iterable[T]) -> None:
        """Add ``items`` to the innermost block collecting (none: nothing)."""
        collected = self._items.get()
        if collected is not None:
            collected.extend(items)

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[T]]:
        """The items ``note``d while the block runs."""
        collected: list[T] = []
        token = self._items.set(collected)
        try:
            yield collected
        finally:
            self._items.reset(token)
