"""Where the paths in a config point: relative to the file that wrote them.

A relative path written in a pipeline file is relative to that file's folder, so a config works
from any working directory (``cd /tmp && inflight run ~/proj/configs/default.yaml``); one given
in a command-line override (``stages.learner.model=models/x``) is relative to the working
directory, as paths typed in a shell are. ``~`` is expanded. The result is absolute, so the
resolved ``config.yaml`` a run directory keeps means the same from anywhere.

Fields say how their value names a file through their ``path`` metadata:

- ``True``: a plain path (a data file, a folder to create), always resolved.
- ``"model"``: a local folder *or* a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B``,
  ``org/name@rev``). Resolved when that path exists; otherwise a value shaped like a Hub id is
  kept as written for the Hub resolver, and anything else (``./x``, ``../x``, ``a/b/c``) is
  resolved, so that "not found" names the full path. A value from the file that does not exist
  next to the file but does exist relative to the working directory (a config written before
  this rule) is refused, with the path to write instead.
- ``"command"``: a program: a bare name (``python3``) is kept for ``PATH`` lookup, a value with
  a ``/`` is a path.

A default (a key the config does not set, like ``run.runs_root: runs``) is relative to the
working directory, as before. Nothing here reads files beyond checking that a path exists;
whether a folder holds a model is for the stage that loads it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pipeline.config.yaml_source import Locations

__all__ = ["PathResolver", "looks_like_hub_id"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_like_hub_id(value: str) -> bool:
    """Whether ``value`` could be a Hub repo id: ``name`` or ``org/name``, optional ``@rev``."""
    name, _, revision = value.partition("@")
    if "@" in value and not revision:
        return False
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name


class PathResolver:
    """Resolves the path-valued fields of one config (``typed.build``'s ``paths`` hook).

    ``locations`` tell where each key was written: a key from the file resolves against
    ``source``'s folder, a key from an override against ``cwd`` (default: the working directory
    when the resolver was made).
    """

    def __init__(self, source: Path, locations: Locations, cwd: Path | None = None) -> None:
        self.config_dir = Path(os.path.abspath(source)).parent
        self.cwd = Path(os.path.abspath(cwd if cwd is not None else os.getcwd()))
        self.locations = locations

    def __call__(self, key: str, value: str, kind: Any, written: bool = True) -> str:
        from_file = written and not self.locations.at(key).startswith("override ")
        base = self.config_dir if from_file else self.cwd
        if kind == "command" and "/" not in value:
            return value
        expanded = os.path.expanduser(value)
        candidate = os.path.normpath(os.path.join(base, expanded))  # join keeps an absolute one
        if kind != "model" or os.path.exists(candidate):
            return candidate
        here = os.path.join(self.cwd, expanded)
        if from_file and base != self.cwd and os.path.exists(here):
            relative = os.path.relpath(here, self.config_dir)
            instead = repr(relative)
            if relative.startswith(os.path.join("..", "..", "")):  # far up: absolute reads better
                instead = f"{os.path.normpath(here)!r} (or {instead})"
            raise ValueError(
                f"{value!r} is not found next to the config file ({candidate} does not exist), "
                f"but exists relative to the working directory: a relative path in a config "
                f"file is relative to the file's folder: write {instead}"
            )
        # a Hub id is kept for the Hub resolver; any other missing path is reported in full
        return value if looks_like_hub_id(value) else candidate
