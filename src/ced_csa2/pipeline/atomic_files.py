"""Atomic file output: write to a temporary sibling, then rename into place.

A stage killed half-way never leaves a truncated output under the real name, and a write
that fails (full disk, read-only folder, Ctrl-C) removes its temporary file and leaves the
destination as it was; the temporary file of a writer that was killed (SIGKILL cannot be
caught) is removed by the next write of the same file.  JSON is strict: NaN and Infinity
are refused, naming the key.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import math
import os
from pathlib import Path

# The machine's disk, not a bug, when a write (or a download) fails with one of these: full, over quota or
# a file-size limit, read-only, failing, or not writable by this user.  Errors with them are one line naming
# the file (stage_runner) or the cache folder (hub_refusals).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM})


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove ``.<name>.tmp<pid>`` siblings of ``path`` whose writer process no longer exists."""
    removed = []
    for tmp in Path(path).parent.glob(f".{glob.escape(Path(path).name)}.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()
                removed.append(tmp)
    return removed


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via ``.<name>.tmp<pid>`` + fsync + ``os.replace``.

    On any failure, ``KeyboardInterrupt`` included, the temporary file is removed and
    ``path`` is untouched.  An ``OSError`` that names no file (a full disk at ``write`` or
    ``fsync``) is re-raised naming ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
            raise type(exc)(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from exc
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def nonfinite_keys(obj, where: str = "") -> list[tuple[str, float]]:
    """``(dotted key path, value)`` of every NaN/±Infinity float in nested dicts and lists."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [(where or "<root>", obj)]
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return []
    return [hit for k, v in items for hit in nonfinite_keys(v, f"{where}.{k}" if where else str(k))]


def write_json(path: Path, obj) -> None:
    """Deterministic, strict JSON (sorted keys, indent 2, trailing newline), written atomically.

    Raises ``ValueError`` naming the file and the key path of a NaN or Infinity (which
    ``json`` would write as the non-JSON tokens ``NaN``/``Infinity``), and ``TypeError``
    naming the file for an object JSON cannot encode; nothing is written in either case.
    """
    try:
        text = json.dumps(obj, sort_keys=True, indent=2, allow_nan=False)
    except ValueError:
        bad = nonfinite_keys(obj)
        if not bad:
            raise
        listed = ", ".join(f"'{k}' = {v}" for k, v in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ValueError(f"{path}: refusing to write non-finite JSON number(s) at {listed} "
                         f"(JSON has no NaN/Infinity)") from None
    except TypeError as exc:
        raise TypeError(f"{path}: {exc}") from None
    atomic_write_text(path, text + "\n")



def read_json(path: Path) -> dict:
    """The JSON written at ``path`` by a stage; a missing file is one line naming it (run the stage first)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: metrics file not found (run `dvc repro` for the stage that writes it)")
    return json.loads(path.read_text())


def write_tsv(path: Path, rows: list[dict]) -> None:
    """Rows as a tab-separated table (every row has the first row's columns; floats to 6 significant digits)."""
    cols = list(rows[0])
    lines = ["\t".join(cols)] + ["\t".join(f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c]) for c in cols)
                                 for r in rows]
    atomic_write_text(Path(path), "\n".join(lines) + "\n")
