"""studies/training_mix.py: arms (candidates and leave-one-domain-out), the choice rule, a run on the tiny profile
whose arms hold exactly their rows and whose choice follows its rule, and bad study params refused."""

import sys

import pytest
import yaml
from conftest import ROOT, tiny_params
from study_params import prepared_study, refused, tsv_rows

sys.path.insert(0, str(ROOT / "studies"))
import training_mix as study_mod  # noqa: E402

from ced_csa2.config import ParamsError, load_params  # noqa: E402
from ced_csa2.pipeline.atomic_files import read_json  # noqa: E402
from ced_csa2.stages import gold_pairs  # noqa: E402

TINY_STUDY = {"rows": 1500, "leave_one_out_of": "uniform", "math_templates": 1, "candidates": [
    {"name": "wiki", "mix": [{"domain": "tiny", "weight": 1}]},
    {"name": "uniform", "mix": [{"domain": "tiny", "weight": 1}, {"domain": "reports_a", "weight": 1}]}]}


def test_the_committed_study_params_load_and_every_arm_is_a_valid_mix():
    study = study_mod.load_study(ROOT / "studies" / "training_mix.yaml")
    arms = study_mod.arms(study)
    assert list(arms)[:3] == ["wiki", "uniform", "wiki_math"]
    base = study_mod.candidates(study)[study.leave_one_out_of]
    assert set(base) == {"wiki_embedded", "factbook", "code", "math"}  # every trainable domain
    assert {a for a in arms if a.startswith("without_")} == {f"without_{d}" for d in base}
    assert all(d not in arms[f"without_{d}"] for d in base)
    params = load_params(ROOT / "params.yaml")
    assert study_mod.leave_one_out_arms(study, params.data.name) == {
        "wiki": {}, "uniform": {d: f"without_{d}" for d in ("factbook", "code", "math")}, "wiki_math": {"math": "wiki"}}
    for mix in arms.values():
        data = study_mod.arm_params(params, mix, study.rows, study.math_templates).data
        assert data.mix_rows == study.rows
        assert data.mix_math_templates == (study.math_templates if "math" in mix else 0)
        assert ("minus the 20 templates" in data.math_label()) == ("math" in mix)


@pytest.mark.parametrize("change,message", [
    ({"rows": 0}, "rows must be >= 1"),
    ({"leave_one_out_of": "other"}, "leave_one_out_of"),
    ({"candidates": TINY_STUDY["candidates"][1:]}, "'wiki'"),
    ({"leave_one_out_of": "wiki"}, "two or more domains"),
    ({"math_templates": 0}, "math_templates must be >= 1"),
])
def test_bad_study_params_are_refused(tmp_path, change, message):
    refused(study_mod, tmp_path, {**TINY_STUDY, **change}, message)


def test_a_math_arm_without_a_template_split_is_refused_before_any_work():
    params = load_params(ROOT / "params.yaml")
    with pytest.raises(ParamsError, match="'data.mix_math_templates' must be positive with a math domain in data.mix"):
        study_mod.arm_params(params, {"math": 1.0}, 100, 0)


def test_a_candidate_whose_trained_domains_no_arm_leaves_out_is_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**TINY_STUDY, "candidates": [
        *TINY_STUDY["candidates"], {"name": "b", "mix": [{"domain": "reports_a", "weight": 1}, {"domain": "reports_b", "weight": 1}]}]}))
    # without reports_b it is without_tiny's mix; without reports_a, no arm's
    with pytest.raises(ValueError, match="candidate 'b' trains on 'reports_a', but no arm trains on the rest"):
        study_mod.leave_one_out_arms(study_mod.load_study(path), "tiny")


def _rows(figures):
    return [{"arm": arm, "group": g, "domain": d, "dppl_pct": v + (0.1 if g == "csa2" else 0)}
            for (arm, d), v in figures.items() for g in study_mod.GROUPS]


def test_the_choice_judges_a_trained_domain_by_its_leave_one_out_arm_within_the_wikipedia_bound(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(TINY_STUDY))
    study = study_mod.load_study(path)
    figures = {("wiki", "tiny"): 10, ("wiki", "reports_a"): 20, ("wiki", "reports_b"): 20,
               ("uniform", "tiny"): 10.3, ("uniform", "reports_a"): 5, ("uniform", "reports_b"): 21,
               **{(a, d): 99 for a in ("without_tiny", "without_reports_a") for d in ("tiny", "reports_a", "reports_b")}}
    choice = study_mod.choose(_rows(figures), study, "tiny")
    assert choice["domains"] == ["reports_a", "reports_b"]
    # uniform's own reports_a (+5, trained on) would win; its held-out figure is wiki's (+20, the rest of its mix)
    assert choice["candidates"]["uniform"] == {"wiki_slack_points": 0.3, "held_out_mean_dppl_pct": 20.533,
                                               "held_out_from": {"reports_a": "wiki"}, "eligible": True}
    assert choice["chosen"] == "wiki"
    figures[("uniform", "reports_b")] = 19
    assert study_mod.choose(_rows(figures), study, "tiny")["chosen"] == "uniform"
    figures[("uniform", "tiny")] = 10.6  # past the 0.5-point bound on the corpus
    assert study_mod.choose(_rows(figures), study, "tiny")["chosen"] == "wiki"


def test_the_study_runs_on_the_tiny_profile(in_tiny_folder, monkeypatch):
    params = prepared_study(in_tiny_folder, "training_mix", TINY_STUDY)  # the evaluation records
    pairs = gold_pairs.run(params, in_tiny_folder)
    study_mod.main()

    out = read_json(in_tiny_folder / "studies" / "training_mix" / "mix.json")
    assert out["rows_by_arm"] == {"wiki": {"tiny": 1500}, "uniform": {"tiny": 750, "reports_a": 750},
                                  "without_tiny": {"reports_a": 1500}, "without_reports_a": {"tiny": 1500}}
    rows = tsv_rows(in_tiny_folder / "studies" / "training_mix" / "mix.tsv")
    domains = ["tiny", *(d.name for d in tiny_params().data.domains)]
    assert len(rows) == 4 * 3 * len(domains)  # every arm, group and domain
    # the same maps from the same rows: the arm trained on tiny alone twice gives the same figures
    same = [(r["group"], r["domain"], r["dppl_pct"]) for r in rows if r["arm"] == "wiki"]
    assert same == [(r["group"], r["domain"], r["dppl_pct"]) for r in rows if r["arm"] == "without_reports_a"]
    choice = out["choice"]
    assert choice["domains"] == [d.name for d in tiny_params().data.domains]
    assert choice["candidates"]["uniform"]["held_out_from"] == {"reports_a": "wiki"}
    eligible = [a for a, c in choice["candidates"].items() if c["eligible"]]
    assert choice["chosen"] == min(eligible, key=lambda a: choice["candidates"][a]["held_out_mean_dppl_pct"])
    gold = out["gold_nll"]  # no math arm: the whole math set, as the pipeline labels it
    assert (gold["math_set"], gold["problems"]) == (params.data.math_label(), len(pairs))
    assert {a: set(g) for a, g in gold["arms"].items()} == {a: set(study_mod.GROUPS) for a in out["rows_by_arm"]}
    assert gold["arms"]["wiki"] == gold["arms"]["without_reports_a"]
    assert "trained_on" in rows[0]
