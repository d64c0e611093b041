"""studies/map_transfer.py: the committed params load, bad ones are refused in one line, and a run on the tiny profile
whose maps' errors are the ridge maps' on each domain's records and whose ΔPPL rows are eval_ppl's scoring."""

import sys

import numpy as np
import pytest
import torch
from conftest import FLOAT32_RTOL, ROOT
from study_params import prepared_study, refused, tsv_rows

sys.path.insert(0, str(ROOT / "studies"))
import map_transfer as study_mod  # noqa: E402

from ced_csa2 import kv_hooks  # noqa: E402
from ced_csa2.eval.perplexity import eval_ids, groups_ppl  # noqa: E402
from ced_csa2.maps.ridge import load_ridge  # noqa: E402
from ced_csa2.model_utils import load_model_and_tokenizer  # noqa: E402
from ced_csa2.pipeline.paths import RIDGE_PATH  # noqa: E402
from ced_csa2.plan import load_plan  # noqa: E402
from ced_csa2.stages import dump, ridge  # noqa: E402
from ced_csa2.train.tuning import ridge_served  # noqa: E402

TINY_STUDY = {"groups": ["ced", "ced_csa2"], "controls": ["baseline_fp4_rot"], "n_boot": 200}


def test_the_committed_study_params_load():
    study = study_mod.load_study(ROOT / "studies" / "map_transfer.yaml")
    assert study.groups and study.controls


@pytest.mark.parametrize("study,message", [
    ({**TINY_STUDY, "groups": ["baseline_fp4_rot"]},
     r"groups must list groups that run the projector or adapters \(ced, "),
    ({**TINY_STUDY, "groups": ["xkv"]},  # low-rank bases, no map
     "groups must list groups that run the projector or adapters"),
    ({**TINY_STUDY, "controls": ["csa2"]}, r"controls must list groups other than baseline that fit no map"),
    ({**TINY_STUDY, "controls": ["baseline"]}, "controls must list groups other than baseline"),
    ({**TINY_STUDY, "n_boot": 10}, "n_boot must be at least 100"),
    ({"group": ["ced"]}, "group"),  # a misspelt key alone
])
def test_bad_study_params_are_refused_in_one_line(tmp_path, study, message):
    path, err = refused(study_mod, tmp_path, study, message)
    assert str(err).startswith(str(path)) and "\n" not in str(err)


def relative_error(model, plan, maps, ids) -> dict[str, float]:
    """The ridge projector's relative K/V error on ``ids``, one record at a time (no padding), from ``ridge.pt``."""
    s, sse, sq = plan.source, {"k": 0.0, "v": 0.0}, {"k": 0.0, "v": 0.0}
    proj = maps[f"proj_{s}"]
    for row in ids:
        with torch.inference_mode(), kv_hooks.capture(model, [s], [plan.split]) as store:
            model.model(input_ids=torch.tensor([row]))
        pred = store["h"][plan.split][0] @ proj["W"] + proj["b"]
        for kind, part in zip("kv", pred.chunk(2, dim=-1)):
            true = store[kind][s][0]
            sse[kind] += float(((part.double() - true.double()) ** 2).sum())
            sq[kind] += float((true.double() ** 2).sum())
    return {kind: sse[kind] / sq[kind] for kind in "kv"}


def test_the_study_runs_on_the_tiny_profile(in_tiny_folder):
    params = prepared_study(in_tiny_folder, "map_transfer", TINY_STUDY)
    study_mod.main()
    assert not (in_tiny_folder / "data" / "dump").exists()  # its dump stayed in its scratch folder

    rows = tsv_rows(in_tiny_folder / "studies" / "map_transfer" / "transfer.tsv")
    home, domains = params.data.name, [params.data.name, *(d.name for d in params.data.domains)]
    maps = ["projector/k", "projector/v", "projector@sink/k", "projector@sink/v", "csa2_adapters/k",
            "csa2_adapters/v", "ced_csa2_adapters/k", "ced_csa2_adapters/v"]
    assert [(r["kind"], r["name"], r["domain"]) for r in rows] == [
        *((k, g, d) for d in domains for k, g in [("group", "ced"), ("group", "ced_csa2"), ("control", "baseline_fp4_rot")]),
        *(("map", m, d) for d in domains for m in maps)]
    # the maps' error: the ridge stage's projector on each domain's records, computed here record by record
    dump.run(params, in_tiny_folder)
    ridge.run(params, in_tiny_folder)
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model)
    fitted, _ = load_ridge(in_tiny_folder / RIDGE_PATH)
    error = {(r["name"], r["domain"]): r for r in rows if r["kind"] == "map"}
    expected = {}
    for d in domains:
        ids = eval_ids(params, tok, in_tiny_folder, None if d == home else d)
        expected[d] = relative_error(model, plan, fitted, ids)
        for kind in "kv":
            # one forward per record here, padded batches in the study: float32 summation orders apart
            assert float(error[f"projector/{kind}", d]["rel_error"]) == pytest.approx(expected[d][kind],
                                                                                       rel=FLOAT32_RTOL), (d, kind)
            ratio = float(error[f"projector/{kind}", d]["ratio"])
            assert ratio == pytest.approx(expected[d][kind] / expected[home][kind], rel=FLOAT32_RTOL), (d, kind)
            low, high = (float(error[f"projector/{kind}", d][c]) for c in ("ratio_ci_low", "ratio_ci_high"))
            assert low <= ratio <= high, (d, kind)
        # ΔPPL: eval_ppl's scoring of ced_csa2 with its own pair of maps
        served = ridge_served(params, plan, geo, in_tiny_folder)
        ref = groups_ppl(model, plan, ["baseline", "ced_csa2"], served["ced_csa2"], ids, params,
                         tok.pad_token_id)["ced_csa2"]
        got = next(r for r in rows if (r["name"], r["domain"]) == ("ced_csa2", d))
        assert got["dppl_pct"] == f"{ref['delta_pct']:.6g}", d  # the TSV's 6 significant digits
    assert all(float(error[m, home]["ratio"]) == 1.0 for m in maps)
    # the sink's positions left out: another error than over every position, a map of the same rows
    assert error["projector@sink/k", home]["rel_error"] != error["projector/k", home]["rel_error"]
    md = (in_tiny_folder / "studies" / "map_transfer" / "transfer.md").read_text()
    other = domains[1]
    k = error["projector/k", other]
    assert (f"{float(k['rel_error']):.3f} (×{float(k['ratio']):.2f} [{float(k['ratio_ci_low']):.2f}, "
            f"{float(k['ratio_ci_high']):.2f}])") in md
    assert "| baseline_fp4_rot (control) |" in md and "issue 61's bound: ≤ 1.3×" in md
    assert np.isfinite([float(r["dppl_pct"]) for r in rows if r["kind"] != "map"]).all()
