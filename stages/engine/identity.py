"""Which engine answers on a port: a launched engine's ``/health`` says who it is.

A launcher picks a free port, starts an engine on it and polls ``/health`` until it answers 200.
Between the pick and the bind (seconds: the engine loads torch first) another process on the
host may take the same number, and then the 200 comes from somebody else's engine, whose
answers (or refusals) the run would take for its own. So the launcher gives each built-in
engine a token in its environment (``INFLIGHT_ENGINE_ID``), the engine returns it in the
``X-Inflight-Engine-Id`` header of ``/health``, and a 200 that carries another token is not
taken as ready: the launched engine meets the taken port itself and exits (``engine_bind_failed``),
which the launcher reports. An answer without the header (SGLang) is taken as before.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

ENGINE_ID_ENV = "INFLIGHT_ENGINE_ID"
ENGINE_ID_HEADER = "X-Inflight-Engine-Id"


def new_engine_id() -> str:
    return secrets.token_hex(8)


def answered_by_another(headers: Mapping[str, str], engine_id: str) -> bool:
    """Whether a ``/health`` answer with ``headers`` came from an engine other than the one
    launched with ``engine_id`` (one that names a different id; SGLang names none)."""
    named = headers.get(ENGINE_ID_HEADER)
    return named is not None and named != engine_id
