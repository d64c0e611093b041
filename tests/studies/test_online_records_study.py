"""studies/online_records.py: its params load typed and checked; its table pairs each row with its sink twin."""

import sys

import pytest
from conftest import ROOT
from study_params import refused

sys.path.insert(0, str(ROOT / "studies"))
import online_records as study_mod  # noqa: E402

from ced_csa2.config import load_params  # noqa: E402


def test_the_committed_study_params_load():
    study = study_mod.load_study(ROOT / "studies" / "online_records.yaml")
    assert study.branches[0] == study_mod.Branch("attn_out", 64)  # the pipeline's own branch
    assert {b.objective for b in study.branches} == set(study_mod.OBJECTIVES)


@pytest.mark.parametrize("text, match", [
    ("head_lr: 3.0e-4\nbranches: []\n", "at least one"),
    ("head_lr: 3.0e-4\nbranches: [{objective: attn_out, records: 0}]\n", r"branches\[0\] must train"),
    ("head_lr: 3.0e-4\nbranches: [{objective: ridge, records: 64}]\n", r"branches\[0\] must train .* got 'ridge'"),
    ("head_lr: 3.0e-4\nbranches: [{objective: distill, records: 8, head_width: -1}]\n", "head_width -1"),
    ("head_lr: 0\nbranches: [{objective: distill, records: 8}]\n", "head_lr must be > 0, got 0"),
])
def test_bad_branches_are_refused(tmp_path, text, match):
    refused(study_mod, tmp_path, text, match)


def test_an_unknown_key_is_refused(tmp_path):
    refused(study_mod, tmp_path, "head_lr: 3.0e-4\nbranches: [{objective: attn_out, records: 64, epochs: 2}]\n", "epochs")


def test_table_puts_each_group_s_sink_row_beside_it():
    def row(records, group, sink, dppl, head_width=0):
        return {"objective": "attn_out", "records": records, "head_width": head_width,
                "projector_params": 1000 + head_width, "group": group, "sink": sink, "steps": records // 4, "branch_s": 1.0,
                "val_kl_before": 0.2, "val_kl": 0.1, "dppl_pct": dppl, "dppl_ci_low": dppl - 1, "dppl_ci_high": dppl + 1,
                "eval_records": 32, "tokens": 1000}
    rows = [row(64, "ced", "none", 4.0), row(64, "ced", "mean", 2.0), row(512, "ced", "none", 3.0),
            row(512, "ced", "mean", 1.5), row(64, "ced", "none", 3.5, 8), row(64, "ced", "mean", 1.0, 8)]
    md = study_mod.table(rows, load_params(ROOT / "params.yaml"))
    assert ("| attn_out | 64 | linear (1,000 p.) | 16 | ced | 0.2000 → 0.1000 | 1 | +4.00 [+3.00, +5.00] | "
            "+2.00 [+1.00, +3.00] |") in md
    assert ("| attn_out | 512 | linear (1,000 p.) | 128 | ced | 0.2000 → 0.1000 | 1 | +3.00 [+2.00, +4.00] | "
            "+1.50 [+0.50, +2.50] |") in md
    csa2 = study_mod.table([{**row(64, "csa2", sink, 5.0), "projector_params": 0} for sink in ("none", "mean")],
                           load_params(ROOT / "params.yaml"))
    assert "| attn_out | 64 | – (reads the true K/V) | 16 | csa2 |" in csa2
    # a head branch pairs with its own sink row, not with the linear branch of the same records
    assert ("| attn_out | 64 | ridge + MLP 8 (1,008 p.) | 16 | ced | 0.2000 → 0.1000 | 1 | +3.50 [+2.50, +4.50] | "
            "+1.00 [+0.00, +2.00] |") in md
