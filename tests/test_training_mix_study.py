"""studies/training_mix.py: arms (candidates and leave-one-domain-out), a run on the tiny profile whose arms hold
exactly their rows and whose choice follows its rule, and bad study params refused."""

import sys

import pytest
import yaml
from conftest import ROOT, tiny_params

sys.path.insert(0, str(ROOT / "studies"))
import training_mix as study_mod  # noqa: E402

from ced_csa2.config import ParamsError, load_params  # noqa: E402
from ced_csa2.data import corpus  # noqa: E402
from ced_csa2.model_utils import load_tokenizer  # noqa: E402
from ced_csa2.pipeline.atomic_files import read_json  # noqa: E402

TINY_STUDY = {"rows": 1500, "leave_one_out_of": "uniform", "candidates": [
    {"name": "wiki", "mix": [{"domain": "tiny", "weight": 1}]},
    {"name": "uniform", "mix": [{"domain": "tiny", "weight": 1}, {"domain": "reports_a", "weight": 1}]}]}


def test_the_committed_study_params_load_and_every_arm_is_a_valid_mix():
    study = study_mod.load_study(ROOT / "studies" / "training_mix.yaml")
    arms = study_mod.arms(study)
    assert list(arms)[:3] == ["wiki", "uniform", "half_wiki"]
    base = study_mod.candidates(study)[study.leave_one_out_of]
    assert {a for a in arms if a.startswith("without_")} == {f"without_{d}" for d in base}
    assert all(d not in arms[f"without_{d}"] for d in base)
    params = load_params(ROOT / "params.yaml")
    for mix in arms.values():
        assert study_mod.arm_params(params, mix, study.rows).data.mix_rows == study.rows


@pytest.mark.parametrize("change,message", [
    ({"rows": 0}, "rows must be >= 1"),
    ({"leave_one_out_of": "other"}, "leave_one_out_of"),
    ({"candidates": TINY_STUDY["candidates"][1:]}, "'wiki'"),
    ({"leave_one_out_of": "wiki"}, "two or more domains"),
])
def test_bad_study_params_are_refused(tmp_path, change, message):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**TINY_STUDY, **change}))
    with pytest.raises(ValueError, match=message):
        study_mod.load_study(path)


def test_a_math_arm_without_a_template_split_is_refused_before_any_work():
    params = load_params(ROOT / "params.yaml")
    with pytest.raises(ParamsError, match="'data.mix_math_templates' must be positive with a math domain in data.mix"):
        study_mod.arm_params(params, {"math": 1.0}, 100)


def test_the_study_runs_on_the_tiny_profile(in_tiny_folder, monkeypatch):
    params = load_params(in_tiny_folder / "params.yaml")
    corpus.prepare(params, load_tokenizer(params.model), in_tiny_folder)  # the evaluation records
    (in_tiny_folder / "studies").mkdir()
    (in_tiny_folder / "studies" / "training_mix.yaml").write_text(yaml.safe_dump(TINY_STUDY))
    study_mod.main()

    out = read_json(in_tiny_folder / "studies" / "training_mix" / "mix.json")
    assert out["rows_by_arm"] == {"wiki": {"tiny": 1500}, "uniform": {"tiny": 750, "reports_a": 750},
                                  "without_tiny": {"reports_a": 1500}, "without_reports_a": {"tiny": 1500}}
    rows = [line.split("\t") for line in (in_tiny_folder / "studies" / "training_mix" / "mix.tsv").read_text().splitlines()]
    header, rows = rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]
    domains = ["tiny", *(d.name for d in tiny_params().data.domains)]
    assert len(rows) == 4 * 3 * len(domains)  # every arm, group and domain
    # the same maps from the same rows: the arm trained on tiny alone twice gives the same figures
    same = [(r["group"], r["domain"], r["dppl_pct"]) for r in rows if r["arm"] == "wiki"]
    assert same == [(r["group"], r["domain"], r["dppl_pct"]) for r in rows if r["arm"] == "without_reports_a"]
    choice = out["choice"]
    assert choice["unseen_domains"] == ["reports_b"]
    eligible = [a for a, c in choice["candidates"].items() if c["eligible"]]
    assert choice["chosen"] == min(eligible, key=lambda a: choice["candidates"][a]["unseen_mean_dppl_pct"])
    assert "trained_on" in header
