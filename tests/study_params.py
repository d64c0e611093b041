"""Refusal checks shared by the study tests: a study's params file that ``load_study`` must refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml


def refused(study_mod, tmp_path: Path, params: str | dict, match: str) -> tuple[Path, ValueError]:
    """Write ``params`` (YAML text, or a mapping dumped as YAML) to a file and check that ``study_mod.load_study``
    refuses it with a ValueError matching ``match``; returns the file and the error."""
    path = tmp_path / "s.yaml"
    path.write_text(params if isinstance(params, str) else yaml.safe_dump(params))
    with pytest.raises(ValueError, match=match) as err:
        study_mod.load_study(path)
    return path, err.value
