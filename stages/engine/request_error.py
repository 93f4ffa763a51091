"""The error of a malformed request, raised wherever a request is read (``protocol`` and the
modules it builds on) and answered by each route in its API's error shape."""

from __future__ import annotations

__all__ = ["RequestError"]


class RequestError(ValueError):
    """A malformed request; ``field`` is the JSON path of the offending value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
