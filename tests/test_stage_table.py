"""docs/pipeline.md's stage table is the one list of stages a reader sees: it must name every stage of
dvc.yaml, and nothing else (issue 65: one home per fact, checked against its source)."""

import re

import yaml
from conftest import ROOT

ROW = re.compile(r"^\| `([a-z0-9_]+)(@<[a-z]+>)?` \|", re.M)


def table_stages(text: str) -> list[str]:
    """The stage names of a markdown table's first column (``tune@<objective>``: ``tune``)."""
    return [m.group(1) for m in ROW.finditer(text)]


def test_the_stage_table_names_every_dvc_stage_once():
    stages = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    rows = table_stages((ROOT / "docs" / "pipeline.md").read_text())
    assert sorted(rows) == sorted(set(rows)), f"docs/pipeline.md: a stage has two rows: {rows}"
    assert set(stages) - set(rows) == set(), "docs/pipeline.md: stages of dvc.yaml without a row"
    assert set(rows) - set(stages) == set(), "docs/pipeline.md: rows for stages dvc.yaml does not have"


def test_the_parser_reads_plain_and_foreach_rows_and_nothing_else():
    text = ("| stage | writes |\n|---|---|\n| `dump` | x |\n| `eval_gsm8k` | v |\n| `tune@<objective>` | y |\n"
            "| group | z |\n| `not a stage` | w |\n")
    assert table_stages(text) == ["dump", "eval_gsm8k", "tune"]
