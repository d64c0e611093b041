"""Passkey retrieval (ced_csa2.eval.retrieval) and studies/retrieval.py on the tiny Qwen3.5."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, study_corpus, tiny_params
from scipy.stats import binomtest
from tiny_maps import random_parts, save_maps

from ced_csa2.ced_runtime import CEDModeBRuntime
from ced_csa2.config import ParamsError
from ced_csa2.data.corpus import write_prepared
from ced_csa2.eval import retrieval
from ced_csa2.maps.indexer import IndexerConfig
from ced_csa2.model_utils import geometry
from ced_csa2.pipeline.paths import EVAL_JSONL
from ced_csa2.plan import load_plan
from ced_csa2.runtime.shared_kv import SharedKVCache
from ced_csa2.train.indexer_training import new_indexer

sys.path.insert(0, str(ROOT / "studies"))
import retrieval as study_mod  # noqa: E402


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def filler(tiny_model):
    return ids(tiny_model[1], "Rivers run to the sea, and the sea is never full. " * 20)


def greedy(model, prompt, n):
    """The model's own greedy continuation of ``prompt``, ``n`` tokens, one full forward per token."""
    out = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(prompt):]


def test_prompts_are_exactly_as_long_as_asked_and_hold_their_needle(tiny_model, filler):
    tok = tiny_model[1]
    recs = retrieval.passkey_prompts(tok, filler, 300, 6, seed=0)
    for i, r in enumerate(recs):
        assert len(r.prompt) + len(r.answer) == 300
        assert len(r.key) == 5 and r.answer == ids(tok, f" {r.key}")
        needle = ids(tok, retrieval.NEEDLE.format(key=r.key))
        assert r.prompt[r.needle_at:r.needle_at + len(needle)] == needle
        assert r.prompt[-len(ids(tok, retrieval.QUESTION)):] == ids(tok, retrieval.QUESTION)
        assert i / 6 <= r.depth <= (i + 1) / 6  # stratified depths
    assert retrieval.passkey_prompts(tok, filler, 300, 6, seed=0) == recs
    assert [r.key for r in retrieval.passkey_prompts(tok, filler, 300, 6, seed=1)] != [r.key for r in recs]


def test_prompts_too_short_or_with_too_little_filler_are_refused(tiny_model, filler):
    tok = tiny_model[1]
    with pytest.raises(ValueError, match="leave no room for filler"):
        retrieval.passkey_prompts(tok, filler, 50, 1, seed=0)
    with pytest.raises(ValueError, match="filler tokens; the filler has 10"):
        retrieval.passkey_prompts(tok, filler[:10], 300, 1, seed=0)


@pytest.mark.parametrize("hits,n", [(0, 10), (3, 10), (10, 10), (41, 50), (1, 1)])
def test_wilson_interval_is_scipy_s(hits, n):
    ci = binomtest(hits, n).proportion_ci(confidence_level=0.95, method="wilson")
    # float64 closed form against scipy's: a few eps64 (2.2e-16) of a value in [0, 1]
    assert retrieval.wilson(hits, n) == pytest.approx([ci.low, ci.high], abs=1e-12)


def test_the_model_s_own_greedy_continuation_is_retrieved_and_a_changed_token_is_not(tiny_model, filler):
    model, tok = tiny_model
    recs = retrieval.passkey_prompts(tok, filler, 300, 2, seed=0)
    own = [dataclasses.replace(r, answer=greedy(model, r.prompt, len(r.answer))) for r in recs]
    wrong = [dataclasses.replace(r, answer=r.answer[:-1] + [(r.answer[-1] + 1) % len(tok)]) for r in own]
    assert retrieval.forward_hits(model, own) == [True, True]
    assert retrieval.forward_hits(model, wrong) == [False, False]
    assert retrieval.forward_hits(model, own + wrong, batch_size=2) == [True, True, False, False]


def test_decoding_through_a_cache_scores_as_the_teacher_forced_pass(tiny_model, filler):
    model, tok = tiny_model
    plan, _ = load_plan(tiny_params().plan, tiny_params().model)
    recs = retrieval.passkey_prompts(tok, filler, 300, 2, seed=0)
    with CEDModeBRuntime(model, plan, "share_plain", None, kv_format=None):
        own = [dataclasses.replace(r, answer=greedy(model, r.prompt, len(r.answer))) for r in recs]
    first_wrong = [dataclasses.replace(r, answer=[(r.answer[0] + 1) % len(tok)] + r.answer[1:]) for r in own]
    cache = lambda: SharedKVCache(model, plan, "share_plain")  # noqa: E731
    assert retrieval.decode_hits(model, cache, own) == [True, True]
    assert retrieval.decode_hits(model, cache, first_wrong) == [False, False]


def test_study_params_with_reads_covering_the_context_are_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("lengths: [128]\nbaseline_lengths: []\nrecords: 2\ndigits: 5\nbatch_size: 1\n"
                    "groups: [baseline]\nsparse: {window: 64, k: 64, indexers: []}\n")
    with pytest.raises(ValueError, match="must stay below the shortest length \\(128\\)"):
        study_mod.load_study(path)
    study_mod.load_study(ROOT / "studies" / "retrieval.yaml")  # the committed params load


def test_study_on_the_tiny_model(tiny_model, tmp_path):
    model, tok = tiny_model
    params = tiny_params()
    study_corpus(tmp_path, records=3)
    plan, geo = load_plan(params.plan, params.model)
    study = study_mod.Study(lengths=[280, 320], baseline_lengths=[360], records=3, digits=5, batch_size=2,
                            groups=["baseline", "csa2", "ced"],
                            sparse=study_mod.Sparse(window=4, k=8, indexers=["r"], layer_modes={
                                "full_reuse": study_mod.LayerModeGroup("csa2", {t: plan.source for t in plan.targets})}))
    m = study_mod.run(params, study, tmp_path, model_and_tok=(model, tok), parts=random_parts(geometry(model.config), plan),
                      indexers={"r": new_indexer(model, geo, plan.source, IndexerConfig(heads=2), seed=0)})
    rows = m["groups"]
    assert set(rows) == {"baseline", "csa2", "ced", "csa2 sparse oracle@8", "csa2 sparse r@8", "full_reuse oracle@8"}
    assert set(rows["baseline"]) == {"280", "320", "360"}
    assert all(set(rows[g]) == {"280", "320"} for g in rows if g != "baseline")
    for g, by_len in rows.items():
        for r in by_len.values():
            assert r["n"] == 3 and r["accuracy_pct"] == pytest.approx(100 * r["retrieved"] / 3)
            lo, hi = r["accuracy_ci95"]
            assert lo <= r["accuracy_pct"] <= hi
            assert ("delta_points" in r) == ("mcnemar" in r) == (g != "baseline")
    assert "| csa2 sparse r@8 |" in study_mod.markdown(m)
    study_mod.plot(m, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("b, c, p", [(3, 0, 0.25), (0, 3, 0.25), (4, 4, 1.0), (0, 0, 1.0), (10, 1, 24 / 2048)])
def test_mcnemar_p_is_the_exact_two_sided_binomial_tail_of_the_discordant_pairs(b, c, p):
    # b records the baseline retrieved and the group did not, c the reverse, 5 concordant either way;
    # by hand: b=3, c=0 -> 2 * 0.5^3; b=10, c=1 -> 2 * (1 + 11) / 2^11
    base = [True] * b + [False] * c + [True] * 5 + [False] * 5
    hits = [False] * b + [True] * c + [True] * 5 + [False] * 5
    # float64 sums of at most 11 binomial terms: a few ulps, far inside 1e-12
    assert study_mod.mcnemar(hits, base) == {"b": b, "c": c, "p_value": pytest.approx(p, rel=1e-12)}


PAIRED_PARAMS = "lengths: [280]\nbaseline_lengths: []\nrecords: 3\ndigits: 5\nbatch_size: 2\ngroups: [baseline, csa2]\n"


def prepare_corpus(folder):
    """``folder``'s held-out corpus, with the record ``prepare`` writes beside it."""
    corpus = study_corpus(folder, records=3) / "eval.jsonl"
    write_prepared(tiny_params(), folder, EVAL_JSONL, corpus.read_text())


def test_study_params_with_an_unknown_key_are_refused_in_one_line(in_tiny_folder, monkeypatch, capsys):
    prepare_corpus(in_tiny_folder)
    path = in_tiny_folder / "s.yaml"
    path.write_text(PAIRED_PARAMS + "recordz: 200\n")
    with pytest.raises(ParamsError, match=f"^{path}: params key 'recordz' is not"):
        study_mod.load_study(path)
    monkeypatch.setattr(sys, "argv", ["retrieval.py", "--params", str(path)])
    with pytest.raises(SystemExit) as ended:  # before the model or any map is read: the folder has none
        study_mod.run_study(study_mod.main, study_mod.arguments())
    err = capsys.readouterr().err.strip()
    assert ended.value.code == 2 and "recordz" in err and "\n" not in err


def test_the_paired_params_load_without_sparse_arms():
    study = study_mod.load_study(ROOT / "studies" / "retrieval_paired.yaml")
    assert study.groups == ["baseline", "csa2"] and study.baseline_lengths == [] and study.sparse is None


def test_study_cli_runs_a_params_file_without_sparse_arms_into_its_out_folder(in_tiny_folder, tiny_model):
    prepare_corpus(in_tiny_folder)
    save_maps(in_tiny_folder / "models", only=("projector", "adapters"))  # no indexers: none are asked for
    (in_tiny_folder / "paired.yaml").write_text(PAIRED_PARAMS)
    args = study_mod.arguments().parse_args(["--params", "paired.yaml", "--out", "paired"])
    study_mod.main(args)
    m = json.loads((in_tiny_folder / "paired" / "metrics.json").read_text())
    assert set(m["groups"]) == {"baseline", "csa2"} and set(m["groups"]["csa2"]) == {"280"}
    row, base = m["groups"]["csa2"]["280"], m["groups"]["baseline"]["280"]
    assert row["n"] == base["n"] == 3 and "mcnemar" not in base
    t = row["mcnemar"]
    # the discordant counts account for the change in hits: c - b = group's retrieved - baseline's
    assert t["c"] - t["b"] == row["retrieved"] - base["retrieved"] and 0 < t["p_value"] <= 1
    assert m["protocol"]["sparse"] is None
    assert f"b {t['b']}, c {t['c']}" in (in_tiny_folder / "paired" / "retrieval.md").read_text()
    assert (in_tiny_folder / "paired" / "accuracy_vs_length.png").stat().st_size > 0
    defaults = study_mod.arguments().parse_args([])  # the full study's files, as stage retrieval runs it
    assert (defaults.params, defaults.out) == (Path("studies/retrieval.yaml"), Path("studies/retrieval"))
