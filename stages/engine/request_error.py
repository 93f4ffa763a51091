"""The error of a malformed request, raised wherever a request is read (``protocol`` and the
modules it builds on) and answered by each route in its API's error shape; and that of a
request the scheduler ended with an error."""

from __future__ import annotations

__all__ = ["AbortedWithError", "RequestError"]


class RequestError(ValueError):
    """A malformed request; ``field`` is the JSON path of the offending value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class AbortedWithError(ValueError):
    """A request not streamed that the scheduler ended as aborted with an error status (a
    finish reason with a ``status_code``, such as SGLang's 400 for an abort while the
    request's grammar compiles): refused with that status instead of answered, as SGLang's
    ``TokenizerManager._handle_abort_finish_reason`` refuses it."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
