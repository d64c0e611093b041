"""studies/ridge_lambda.py: the committed params load, bad ones are refused in one line, and a run on the tiny profile
whose arm at the root's ridge.lambda is the pipeline's own ridge maps and whose other arms are other maps."""

import sys

import pytest
import yaml
from conftest import ROOT
from study_params import prepared_study, refused, tsv_rows

sys.path.insert(0, str(ROOT / "studies"))
import ridge_lambda as study_mod  # noqa: E402

from ced_csa2.config import load_params  # noqa: E402
from ced_csa2.eval.perplexity import eval_ids, groups_ppl  # noqa: E402
from ced_csa2.model_utils import load_model_and_tokenizer  # noqa: E402
from ced_csa2.pipeline.atomic_files import read_json  # noqa: E402
from ced_csa2.plan import load_plan  # noqa: E402
from ced_csa2.stages import dump, ridge  # noqa: E402
from ced_csa2.train.tuning import ridge_served  # noqa: E402

TINY_STUDY = {"lambdas": [1.0, 1000.0]}


def test_the_committed_study_params_load_with_the_pipelines_lambda_among_them():
    params = load_params(ROOT / "params.yaml")
    study = study_mod.load_study(ROOT / "studies" / "ridge_lambda.yaml", params)
    assert params.ridge.lam in study.lambdas and len(study.lambdas) >= 2


@pytest.mark.parametrize("change,message", [
    ({"lambdas": []}, r"lambdas must list distinct positive values, got \[\]"),
    ({"lambdas": [1.0, 0.0]}, "distinct positive values"),
    ({"lambdas": [1.0, 1.0]}, "'lambdas' lists 1.0 twice"),
    ({"lambda": [1.0]}, "lambda"),
])
def test_bad_study_params_are_refused_in_one_line(tmp_path, change, message):
    path, err = refused(study_mod, tmp_path, change, message)
    assert str(err).startswith(str(path)) and "\n" not in str(err)


def test_a_study_without_the_pipelines_lambda_is_refused_naming_it(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"lambdas": [10.0, 100.0]}))
    params = load_params(ROOT / "params.yaml")
    with pytest.raises(ValueError, match=r"s.yaml: lambdas must include params.yaml's ridge.lambda \(1\)"):
        study_mod.load_study(path, params)


def test_the_study_runs_on_the_tiny_profile(in_tiny_folder):
    params = prepared_study(in_tiny_folder, "ridge_lambda", TINY_STUDY)
    assert params.ridge.lam == 1.0
    study_mod.main()
    assert not (in_tiny_folder / "data" / "dump").exists()  # its dump stayed in its scratch folder

    rows = tsv_rows(in_tiny_folder / "studies" / "ridge_lambda" / "lambda.tsv")
    domains = [params.data.name, *(d.name for d in params.data.domains)]
    assert [(r["arm"], r["group"], r["domain"]) for r in rows] == [
        (f"lambda={lam:g}", g, d) for d in domains for lam in TINY_STUDY["lambdas"] for g in study_mod.GROUPS]
    # the reference arm is the pipeline's own ridge objective: its dump and ridge stages here, scored apart
    dump.run(params, in_tiny_folder)
    ridge.run(params, in_tiny_folder)
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model)
    served = ridge_served(params, plan, geo, in_tiny_folder)
    for d in domains:
        ids = eval_ids(params, tok, in_tiny_folder, None if d == params.data.name else d)
        ref = groups_ppl(model, plan, ["baseline", "csa2"], served["csa2"], ids, params, tok.pad_token_id)["csa2"]
        got = {r["arm"]: r for r in rows if (r["group"], r["domain"]) == ("csa2", d)}
        assert got["lambda=1"]["dppl_pct"] == f"{ref['delta_pct']:.6g}", d  # the TSV's 6 significant digits
        assert got["lambda=1000"]["dppl_pct"] != got["lambda=1"]["dppl_pct"], d  # another penalty, other maps
    out = read_json(in_tiny_folder / "studies" / "ridge_lambda" / "lambda.json")
    for t in out["transfer"]:  # the worst other domain over the corpus, from the rows
        mine = {r["domain"]: float(r["dppl_pct"]) for r in rows if (r["arm"], r["group"]) == (t["arm"], t["group"])}
        worst = max((d for d in mine if d != params.data.name), key=mine.get)
        assert (t["worst_domain"], f"{t['worst_domain_dppl_pct']:.6g}") == (worst, f"{mine[worst]:.6g}")
        if mine[params.data.name] > 0:
            # both ΔPPLs read back from the TSV's 6 significant digits (<= 5e-6 relative each): their ratio to 1e-5
            assert t["ratio"] == pytest.approx(mine[worst] / mine[params.data.name], rel=1e-5)
    assert set(out["ridge_r2"]) == {"lambda=1", "lambda=1000"}
    md = (in_tiny_folder / "studies" / "ridge_lambda" / "lambda.md").read_text()
    assert "| 1000 | csa2 |" in md and "issue 61's bound: ≤ 1.3×" in md
