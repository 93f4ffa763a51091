"""Messages and their schemas: the unit every channel carries.

A message is a ``kind`` tag, a schema ``version`` and a ``data`` map. ``data`` holds plain
msgpack values (None, bool, int, float, str, bytes, lists, str-keyed maps) and numpy arrays or
torch tensors at any depth; the codec moves arrays out of the msgpack header into zero-copy
frames. A :class:`Schema` names a kind, its current version and the fields a message of that kind
must carry; ports declare the schemas they send or accept, so a receiver can reject what it does
not understand without stopping.

This module does no I/O and keeps no registry: schemas live on the ports that use them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Message", "Schema", "uids_of"]


def uids_of(data: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``uid`` a message carries (what the run's ledger follows): one str, or a list of
    them for a message that carries several prompts' work (a batch of groups)."""
    uid = data.get("uid")
    if isinstance(uid, str):
        return (uid,)
    if isinstance(uid, list):
        return tuple(u for u in uid if isinstance(u, str))
    return ()


def _is_array(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return True
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def _torch():
    import sys

    return sys.modules.get("torch")  # never import torch just to type-check a field


# Field type names usable in Schema.fields; "array" means a numpy array or torch tensor.
_FIELD_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "bytes": lambda v: isinstance(v, (bytes, bytearray, memoryview)),
    "list": lambda v: isinstance(v, (list, tuple)),
    "map": lambda v: isinstance(v, Mapping),
    "array": _is_array,
    "any": lambda v: True,
}


@dataclass(frozen=True)
class Schema:
    """A message kind, its schema version, and its required fields.

    ``fields`` maps a field name to a type name (``int``, ``float``, ``str``, ``bool``, ``bytes``,
    ``list``, ``map``, ``array``, ``any``), or to several joined by ``|`` (``"int|None"`` admits a
    missing value given as None). Extra fields are allowed: versions add fields, they never
    change the meaning of an existing one.

    ``weight``: how many units of a receiver's inbox (and of its producers' credit) one message
    of this kind takes, from its data (``transport.credit``, "Weight"): a message that carries
    a batch of groups weighs its number of groups, so an inbox bounded at 64 still holds at most
    64 groups however they are packed. None: every message weighs 1.
    """

    kind: str
    version: int = 1
    fields: Mapping[str, str] = field(default_factory=dict)
    doc: str = ""
    weight: Callable[[Mapping[str, Any]], int] | None = field(default=None, compare=False)
    # (name, spec, None allowed, checks): every message is checked at least twice
    _rules: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rules = []
        for name, spec in self.fields.items():
            parts = spec.split("|")
            for part in parts:
                if part != "None" and part not in _FIELD_CHECKS:
                    raise ValueError(
                        f"schema {self.kind!r}: field {name!r} has unknown type {part!r}; "
                        f"use one of {sorted(_FIELD_CHECKS)} or None"
                    )
            checks = tuple(_FIELD_CHECKS[p] for p in parts if p != "None")
            rules.append((name, spec, "None" in parts, checks))
        object.__setattr__(self, "_rules", tuple(rules))

    def weigh(self, data: Mapping[str, Any]) -> int:
        """The weight of a message of this kind carrying ``data`` (ValueError unless an
        int >= 1); ``data`` has passed ``check``."""
        if self.weight is None:
            return 1
        value = self.weight(data)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"schema {self.kind!r}: a message weighs {value!r}, expected an int >= 1"
            )
        return value

    def check(self, data: Mapping[str, Any]) -> list[str]:
        """Problems with ``data`` as a message of this schema (empty when it conforms)."""
        problems = []
        for name, spec, none_ok, checks in self._rules:
            if name not in data:
                if not none_ok:
                    problems.append(f"missing field {name!r} ({spec})")
                continue
            value = data[name]
            if value is None and none_ok:
                continue
            for ok in checks:
                if ok(value):
                    break
            else:
                problems.append(f"field {name!r} should be {spec}, got {type(value).__name__}")
        return problems


@dataclass(slots=True)
class Message:
    """One message: ``kind`` and schema ``version`` tag the ``data`` map.

    ``sender`` is filled in by the receiving channel (``stage.replica`` of the producer);
    ``ack_id`` too (which delivery to acknowledge: ``Receiver.ack``). ``weight``: the units of
    inbox and credit it takes (its schema's ``weigh``; set by the channel at both ends).
    """

    kind: str
    data: dict[str, Any]
    version: int = 1
    sender: str = ""
    weight: int = field(default=1, compare=False)
    ack_id: tuple[bytes, int] | None = field(default=None, compare=False, repr=False)
