"""Figures as PNG files whose bytes a rerun reproduces, written atomically.

DVC hashes a figure like any output, so the same figure must give the same bytes: matplotlib's
``Software`` metadata (its version string) is left out.  The write goes through
:func:`~ced_csa2.pipeline.atomic_files.atomic_write_bytes`: a failed write leaves the old figure whole.
"""

from __future__ import annotations

import io
from pathlib import Path

from .atomic_files import atomic_write_bytes


def write_png(fig, path: Path) -> Path:
    """Save the matplotlib figure ``fig`` to ``path`` (folders made) and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    return path
