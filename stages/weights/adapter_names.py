"""The names LoRA adapters go by on the engines (``publish.lora_transport: files``): version N's
adapter is ``policy-vN`` on every engine, and a request names the one of the version its engine
serves. Light on purpose (no torch): the generator imports it, and the config loader imports
the generator's module to read its options.

Not here: writing and loading adapters (``stages.weights.adapter_files``).
"""

from __future__ import annotations

__all__ = ["ADAPTER_PREFIX", "adapter_for", "adapter_name"]

ADAPTER_PREFIX = "policy"  # version N's adapter is "policy-vN" on every engine


def adapter_name(prefix: str, version: int) -> str:
    """The name version ``version``'s adapter is loaded under on every engine."""
    return f"{prefix}-v{version}"


def adapter_for(names: dict[int, str], version: int) -> tuple[str | None, int] | None:
    """What a request to an engine serving ``version`` names: ``(adapter, version)``, ``(None,
    0)`` for the base model, or None when no adapter was ever announced (``names``: version ->
    name, from the version announcements). A version whose announcement was missed (a
    generator started since) is named as the announced ones are."""
    if not names:
        return None
    if version <= 0:
        return None, 0
    name = names.get(version)
    if name is None:
        prefix = names[max(names)].rsplit("-v", 1)[0]
        name = adapter_name(prefix, version)
    return name, version
