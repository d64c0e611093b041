"""The objectives table: one row per (group, objective), deltas against the baseline, protocol checked."""

import pytest

from ced_csa2.stages.report import objective_table, summary


def metrics(tokens=1000):
    ppl = {"protocol": {"tokens_scored": tokens},
           "groups": {"baseline": {"ppl": 20.0}, "share_plain": {"ppl": 30.0}, "ced": {"ppl": 25.0}}}
    gsm = {"groups": {"baseline": {"gold_nll": {"nll_per_token": 1.5}}, "ced": {"gold_nll": {"nll_per_token": 2.0}}}}
    run = {"run": {"wall_s": 10.0}}
    tuned = {"distill": {"train": {"phases": {"ced": {"wall_s": 4.0, "tokens": 400},
                                              "csa2": {"wall_s": 6.0, "tokens": 200}}},
                         "eval": {"protocol": {"tokens_scored": tokens},
                                  "groups": {"ced": {"ppl": 22.0, "gold_nll": {"nll_per_token": 1.75}}}}}}
    return ppl, gsm, run, run, tuned


def cells(lines):
    return {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in lines[2:]}


def test_rows_per_group_and_objective():
    rows = cells(objective_table(*metrics(), groups=["ced"]))
    assert list(rows) == [("baseline", "— (no maps)"), ("share_plain", "— (no maps)"), ("ced", "kv_mse (seed)"),
                          ("ced", "distill")]
    assert rows[("share_plain", "— (no maps)")] == ["30.000", "+50.00", "–", "–", "–", "–"]
    assert rows[("ced", "kv_mse (seed)")] == ["25.000", "+25.00", "2.0000", "+0.5000", "20", "–"]
    assert rows[("ced", "distill")] == ["22.000", "+10.00", "1.7500", "+0.2500", "10", "60"]


def test_objective_scored_on_other_tokens_is_refused():
    ppl, gsm, proj, adap, tuned = metrics()
    tuned["distill"]["eval"]["protocol"]["tokens_scored"] = 999
    with pytest.raises(ValueError, match=r"objectives/distill/eval.json scored 999 tokens, metrics/ppl.json 1000"):
        objective_table(ppl, gsm, proj, adap, tuned, ["ced"])


def summary_inputs():
    """Two groups with GSM8K, one (share_plain) without; KV bytes on two bases; one tuned objective."""
    ppl = {"protocol": {"model": "m"}, "groups": {
        "baseline": {"ppl": 20.0, "delta_pct": 0.0, "nll_per_token": 3.0, "tokens": 10},
        "csa2": {"ppl": 22.5, "delta_pct": 12.5, "nll_per_token": 3.1, "tokens": 10},
        "share_plain": {"ppl": 30.0, "delta_pct": 50.0, "nll_per_token": 3.4, "tokens": 10}}}

    def em(correct, lo, hi):
        return {"exact_match": correct / 100, "ci95": [lo, hi], "correct": correct, "n": 100}

    gsm = {"protocol": {"n": 100}, "groups": {
        "baseline": {"strict-match": em(3, 0.01, 0.085), "flexible-extract": em(7, 0.034, 0.137),
                     "gold_nll": {"nll_per_token": 1.25, "tokens": 50}, "seconds": 1.0},
        "csa2": {"strict-match": em(0, 0.0, 0.037), "flexible-extract": em(2, 0.0055, 0.07),
                 "gold_nll": {"nll_per_token": 1.5, "tokens": 50}, "seconds": 1.0}}}
    kv = {"decoder_attention": {"baseline": {"bytes_per_token": 1000.0, "compression_vs_baseline": 1.0},
                                "csa2": {"bytes_per_token": 800.0, "compression_vs_baseline": 1.25},
                                "share_plain": {"bytes_per_token": 800.0, "compression_vs_baseline": 1.25}},
          "all_attention": {g: {"bytes_per_token": 5.0, "compression_vs_baseline": 9.0}
                            for g in ("baseline", "csa2", "share_plain")}}
    storage = {"note": "prose", "active_model": {"kv": {"bf16": kv, "fp32": {}}}}
    tuned = {"distill": {"train": {"phases": {}}, "eval": {"protocol": {"tokens_scored": 10}, "groups": {
        "csa2": {"ppl": 21.0, "gold_nll": {"nll_per_token": 1.375}}, "ced": {"ppl": 99.0, "gold_nll": {
            "nll_per_token": 9.0}}}}}}
    return ppl, gsm, storage, tuned


def numbers_only(obj):
    if isinstance(obj, dict):
        return all(isinstance(k, str) and numbers_only(v) for k, v in obj.items())
    return isinstance(obj, (int, float)) and not isinstance(obj, bool)


def test_summary_holds_the_headline_per_group_and_objective():
    ppl, gsm, storage, tuned = summary_inputs()
    s = summary(ppl, gsm, storage, tuned, groups=["csa2"])
    assert numbers_only(s) and all(len(v) <= 11 for v in s.values())  # flat and short
    assert list(s) == ["baseline", "csa2", "share_plain", "csa2@distill"]
    assert s["csa2"] == pytest.approx({
        "ppl": 22.5, "dppl_pct": 12.5, "gold_nll": 1.5, "em_strict": 0.0, "em_strict_lo": 0.0, "em_strict_hi": 3.7,
        "em_flex": 2.0, "em_flex_lo": 0.55, "em_flex_hi": 7.0, "kv_bytes": 800.0, "kv_compression": 1.25})
    assert s["baseline"] == pytest.approx({
        "ppl": 20.0, "dppl_pct": 0.0, "gold_nll": 1.25, "em_strict": 3.0, "em_strict_lo": 1.0, "em_strict_hi": 8.5,
        "em_flex": 7.0, "em_flex_lo": 3.4, "em_flex_hi": 13.7, "kv_bytes": 1000.0, "kv_compression": 1.0})
    # no GSM8K run for share_plain: its GSM8K keys are absent, not zero
    assert s["share_plain"] == {"ppl": 30.0, "dppl_pct": 50.0, "kv_bytes": 800.0, "kv_compression": 1.25}
    # only train.eval_groups; ΔPPL against ppl.json's baseline
    assert s["csa2@distill"] == pytest.approx({"ppl": 21.0, "dppl_pct": 5.0, "gold_nll": 1.375})

