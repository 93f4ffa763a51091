"""Request keys the engine ignores, as SGLang 0.5.23 ignores them, counted and logged.

SGLang's request models and structs ignore keys they do not name (pydantic's and msgspec's
``extra="ignore"``), ``/generate``'s and ``/encode``'s dataclasses included: a request with a
misspelt or newer field is answered as if it were not there. The engine answers the same, and
so that nothing is dropped unseen, each such key is counted by route and key
(``/server_info``'s ``ignored_fields``: ``"POST /generate retrun_logprob": 3``) and logged the
1st, 2nd, 4th ... time (``request_field_ignored``).

The routes' checks report the keys with ``note(keys)`` while the request is served; the
server's middleware collects them (``collect``) and counts them once the answer is made. A
body checked outside a served request (the in-process engine's own requests) notes nothing.
"""

from __future__ import annotations

from pipeline.collector import Collector

__all__ = ["collect", "note"]

_IGNORED: Collector[str] = Collector("ignored_fields")
note = _IGNORED.note  # the request being served had these keys, which were ignored
collect = _IGNORED.collect  # the keys noted while the block serves a request
