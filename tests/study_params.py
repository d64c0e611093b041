"""What the study tests share: a study's params file that ``load_study`` must refuse, a tiny folder prepared for a
study run, and the rows of the TSV a study writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ced_csa2.config import Params, load_params
from ced_csa2.data import corpus
from ced_csa2.model_utils import load_tokenizer


def refused(study_mod, tmp_path: Path, params: str | dict, match: str) -> tuple[Path, ValueError]:
    """Write ``params`` (YAML text, or a mapping dumped as YAML) to a file and check that ``study_mod.load_study``
    refuses it with a ValueError matching ``match``; returns the file and the error."""
    path = tmp_path / "s.yaml"
    path.write_text(params if isinstance(params, str) else yaml.safe_dump(params))
    with pytest.raises(ValueError, match=match) as err:
        study_mod.load_study(path)
    return path, err.value


def prepared_study(folder: Path, name: str, study: dict) -> Params:
    """``folder``'s params (``folder/params.yaml``) with ``prepare``'s files made there and ``studies/<name>.yaml``
    holding ``study``: what ``dvc repro studies/dvc.yaml:<name>`` finds in a checkout. Returns the params."""
    params = load_params(folder / "params.yaml")
    corpus.prepare(params, load_tokenizer(params.model), folder)
    (folder / "studies").mkdir(exist_ok=True)
    (folder / "studies" / f"{name}.yaml").write_text(yaml.safe_dump(study))
    return params


def tsv_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a study's TSV (``path``), each ``{column: cell}`` by its header line."""
    header, *rows = (line.split("\t") for line in path.read_text().splitlines())
    return [dict(zip(header, row)) for row in rows]
