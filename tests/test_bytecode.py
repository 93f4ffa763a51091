"""The suite writes the bytecode of the project's modules before it starts (``conftest``), so
that the processes it starts read it instead of compiling every module again, also under
``PYTHONDONTWRITEBYTECODE``."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_modules_the_suites_processes_import_have_current_bytecode() -> None:
    for source in ("stages/engine/server.py", "pipeline/cli.py", "transport/codec.py"):
        path = ROOT / source
        cached = Path(importlib.util.cache_from_source(str(path)))
        assert cached.exists(), cached
        header = cached.read_bytes()[:16]
        assert header[:4] == importlib.util.MAGIC_NUMBER
        flags, mtime, size = struct.unpack("<III", header[4:16])
        stat = path.stat()
        # what the import system checks before it uses the file (PEP 552's timestamp form)
        assert flags == 0 and mtime == int(stat.st_mtime) & 0xFFFFFFFF
        assert size == stat.st_size & 0xFFFFFFFF
