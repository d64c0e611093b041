"""Atomic file output: write to a temporary sibling, then rename into place.

A stage killed half-way never leaves a truncated output under the real name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via ``path.tmp<pid>`` + ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj) -> None:
    """Deterministic JSON (sorted keys, indent 2, trailing newline), written atomically."""
    atomic_write_text(path, json.dumps(obj, sort_keys=True, indent=2) + "\n")
