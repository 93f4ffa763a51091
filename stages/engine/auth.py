"""Engine API keys: SGLang's ``--api-key`` contract, for the built-in server and every client.

The contract (SGLang's ``srt/utils/auth.py``): a server with a key answers a request only if it
carries ``Authorization: Bearer KEY`` (scheme in any case, key compared in constant time); every
other request gets HTTP 401 with ``{"error": "Unauthorized"}``. ``OPTIONS`` requests and paths
under ``/health`` and ``/metrics`` are always answered, so that liveness probes need no secret.
A server without a key answers everyone and ignores the header.

Where a key comes from: ``engine_api_key(ctx)``: the run's (``ctx.engine_api_key``, made by the
supervisor per run, or taken from ``INFLIGHT_ENGINE_API_KEY`` in its environment so that engines
a user started with that key can be attached), else ``INFLIGHT_ENGINE_API_KEY`` here. It travels
to engine processes in their environment, never on a command line.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "API_KEY_ENV",
    "EngineAuthError",
    "auth_headers",
    "authorized",
    "bind_error",
    "engine_api_key",
    "is_loopback_host",
]

API_KEY_ENV = "INFLIGHT_ENGINE_API_KEY"
UNAUTHORIZED = {"error": "Unauthorized"}  # SGLang's body with its 401
_EXEMPT_PREFIXES = ("/health", "/metrics")


class EngineAuthError(Exception):
    """An engine refused this process's API key (HTTP 401/403): no retry can succeed."""

    def __init__(self, url: str, status: int, *, sent: bool, what: str = "") -> None:
        had = "the key sent" if sent else "no key (none was set)"
        on = f" on {what}" if what else ""
        super().__init__(
            f"engine at {url} refused the API key (HTTP {status}{on}; this process sent {had}): "
            f"engines started by the run get its key; for an engine you started yourself, set "
            f"{API_KEY_ENV} to its --api-key where you run `inflight run`"
        )
        self.url, self.status = url, status


def authorized(method: str, path: str, header: str | None, key: str | None) -> bool:
    """Whether a request may be served (SGLang's rule, see the module docstring)."""
    if not key or method == "OPTIONS" or path.startswith(_EXEMPT_PREFIXES):
        return True
    scheme, _, token = (header or "").partition(" ")
    # bytes: compare_digest refuses non-ASCII str, and a client's garbage must be a 401
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.encode("utf-8", "surrogatepass"), key.encode()
    )


def auth_headers(key: str | None) -> dict[str, str]:
    """The header every engine request carries when there is a key (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def engine_api_key(ctx: Any = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The key for this run's engines: ``ctx.engine_api_key``, else ``INFLIGHT_ENGINE_API_KEY``."""
    key = getattr(ctx, "engine_api_key", None)  # contexts built outside a run have none
    return key or (os.environ if environ is None else environ).get(API_KEY_ENV) or None


def is_loopback_host(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name (or "" = every interface): assume others can reach it
        return False


def bind_error(host: str, key: str | None, *, insecure: bool = False) -> str | None:
    """Why an engine must not listen on ``host`` as configured (one line), or None."""
    if key or insecure or is_loopback_host(host):
        return None
    return (
        f"--host {host} is reachable from other machines and the engine has no API key: "
        f"set {API_KEY_ENV} (or --api-key), bind 127.0.0.1, or pass --insecure"
    )
