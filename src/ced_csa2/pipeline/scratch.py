"""Stages run in a scratch folder: what a study copies there first.

A study that runs the pipeline's own stages (``dump``, ``ridge``, ...) on ``prepare``'s files in a
temporary folder reads nothing another CPU made, so its lock entry holds on any machine
(``docs/extending.md``, "A study").  The stages check each input against the provenance record
``prepare`` writes beside it, so the record travels with the file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .paths import provenance_path


def copy_prepared(workdir: Path, *files: Path) -> None:
    """Copy each of ``prepare``'s ``files`` (paths relative to the working directory) and its provenance record
    into ``workdir`` at the same relative path, creating the folders."""
    for file in files:
        for path in (file, provenance_path(file)):
            (workdir / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, workdir / path)
