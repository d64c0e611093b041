"""The report's tables, groups.tsv and summary.json: one row per (group, objective), each change with its CI, protocol checked."""

from pathlib import Path

import pytest

from ced_csa2.eval.results import (
    HEADLINE,
    GOLD_PROTOCOL,
    RUN_PROTOCOL,
    check_same_protocol,
    domains_protocol,
    domains_table,
    frontier,
    frontier_table,
    goals,
    goals_table,
    group_rows,
    groups_table,
    gsm_note,
    headline_table,
    mode_a_table,
    objective_table,
    plots,
    start_kept_note,
    summary,
)


def metrics(tokens=1000):
    ppl = {"protocol": {"tokens_scored": tokens},
           "groups": {"baseline": {"ppl": 20.0}, "share_plain": {"ppl": 30.0, **delta("delta_pct", 50.0, 40.0, 61.0)},
                      "ced": {"ppl": 25.0, **delta("delta_pct", 25.0, 20.5, 30.25), **delta("kl", 0.5, 0.25, 0.75),
                              **delta("top1_pct", 80.0, 75.5, 85.0)}}}
    gsm = {"groups": {"baseline": {"gold_nll": {"nll_per_token": 1.5}},
                      "ced": {"gold_nll": {"nll_per_token": 2.0, **delta("delta", 0.5, 0.25, 0.75)}}}}
    run = {"run": {"steps": 10, "init": "ridge", "batch_size": 4, "keep": "best_val"}, "layers": {},
           "seed_init": {"run": {"steps": 7}}}
    seed_init = {"ced": {"ppl": 40.0, **delta("delta_pct", 100.0, 90.0, 110.0),
                         "gold_nll": {"nll_per_token": 3.0, **delta("delta", 1.5, 1.25, 1.75)}}}
    tuned = {"distill": {"train": {"phases": {"ced": {"steps": 4, "tokens": 400},
                                              "csa2": {"steps": 6, "tokens": 200}}},
                         "eval": {"protocol": {"tokens_scored": tokens},
                                  "groups": {"ced": {"ppl": 22.0, **delta("delta_pct", 10.0, 8.0, 12.0),
                                                     "gold_nll": {"nll_per_token": 1.75,
                                                                  **delta("delta", 0.25, 0.125, 0.5)}}}}}}
    tuned["ridge"] = {"train": {"phases": {}}, "eval": {"protocol": {"tokens_scored": tokens},  # untrained: no phase
                                                         "groups": {"ced": tuned["distill"]["eval"]["groups"]["ced"]}}}
    adapters = {**run, "run": {**run["run"], "steps": 3}}
    return ppl, gsm, run, adapters, tuned, seed_init


def delta(key, value, lo, hi):
    """A change as the eval stages write it: the value and its paired-bootstrap interval."""
    return {key: value, f"{key}_ci95": [lo, hi]}


def cells(lines):
    return {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in lines[2:]}


def test_rows_per_group_and_objective():
    rows = cells(objective_table(*metrics(), groups=["ced"]))
    assert list(rows) == [("baseline", "— (no maps)"), ("share_plain", "— (no maps)"), ("ced", "kv_mse (seed)"),
                          ("ced", "kv_mse, random init (seed read literally)"), ("ced", "distill"), ("ced", "ridge")]
    assert rows[("ced", "kv_mse, random init (seed read literally)")] == [
        "40.000", "+100.00 [+90.00, +110.00]", "–", "–", "3.0000", "+1.5000 [+1.2500, +1.7500]", "7", "(dumped rows)"]
    assert rows[("baseline", "— (no maps)")] == ["20.000", "–", "–", "–", "1.5000", "–", "–", "–"]
    assert rows[("share_plain", "— (no maps)")] == ["30.000", "+50.00 [+40.00, +61.00]", "–", "–", "–", "–", "–",
                                                    "–"]
    assert rows[("ced", "kv_mse (seed)")] == ["25.000", "+25.00 [+20.50, +30.25]", "0.5000 [0.2500, 0.7500]",
                                              "80.00 [75.50, 85.00]", "2.0000", "+0.5000 [+0.2500, +0.7500]", "10",
                                              "(dumped rows)"]
    # each row counts the steps and tokens of the maps its group reads: ced's projector, ced's own phase
    assert rows[("ced", "distill")] == ["22.000", "+10.00 [+8.00, +12.00]", "–", "–", "1.7500",
                                        "+0.2500 [+0.1250, +0.5000]", "4", "400"]
    assert rows[("ced", "ridge")][-2:] == ["0", "0"]


def test_objective_scored_on_other_tokens_is_refused():
    ppl, gsm, proj, adap, tuned, seed_init = metrics()
    tuned["distill"]["eval"]["protocol"]["tokens_scored"] = 999
    with pytest.raises(ValueError, match=r"objectives/eval.json \(distill\) scored 999 tokens, metrics/ppl.json 1000"):
        objective_table(ppl, gsm, proj, adap, tuned, seed_init, ["ced"])


def summary_inputs():
    """Two groups with GSM8K, one (share_plain) without; KV bytes on two bases; one tuned objective."""
    ppl = {"protocol": {"model": "m"}, "groups": {
        "baseline": {"ppl": 20.0, "nll_per_token": 3.0, "tokens": 10},
        "csa2": {"ppl": 22.5, **delta("delta_pct", 12.5, 10.0, 15.0), "nll_per_token": 3.1, "tokens": 10,
                 **delta("kl", 0.125, 0.1, 0.15), **delta("top1_pct", 90.0, 88.0, 92.0)},
        "share_plain": {"ppl": 30.0, **delta("delta_pct", 50.0, 45.0, 55.0), "nll_per_token": 3.4, "tokens": 10}},
        "mode_a": {"covered": True, "prefix_fraction": 0.5, "records": 4, "baseline": {"ppl": 19.0},
                   "mode_a": {"ppl": 38.0}, **delta("delta_pct", 100.0, 90.0, 110.0), **delta("kl", 1.5, 1.25, 1.75),
                   **delta("top1_pct", 50.0, 45.0, 55.0), "prefill_speedup_bound": 2.0, "replay": 0, "sink": "mean",
                   "maps": "trained", "note": "zero state"}}

    def em(correct, lo, hi):
        return {"exact_match": correct / 100, "ci95": [lo, hi], "correct": correct, "n": 100}

    gsm = {"protocol": {"n": 100}, "groups": {
        "baseline": {"strict-match": em(3, 0.01, 0.085), "flexible-extract": em(7, 0.034, 0.137),
                     "gold_nll": {"nll_per_token": 1.25, "tokens": 50}},
        "csa2": {"strict-match": em(0, 0.0, 0.037), "flexible-extract": em(2, 0.0055, 0.07),
                 "gold_nll": {"nll_per_token": 1.5, "tokens": 50, **delta("delta", 0.25, 0.2, 0.3)}},
        # gold NLL only: not among eval_gsm8k.generate
        "share_plain": {"gold_nll": {"nll_per_token": 2.0, "tokens": 50, **delta("delta", 0.75, 0.5, 1.0)}}},
        "mode_a": {"covered": True, "strict-match": em(1, 0.002, 0.054), "flexible-extract": em(4, 0.016, 0.098),
                   "gold_nll": {"nll_per_token": 2.5, "tokens": 50, **delta("delta", 1.25, 1.0, 1.5)}}}
    kv = {"decoder_attention": {"baseline": {"bytes_per_token": 1000.0, "compression_vs_baseline": 1.0},
                                "csa2": {"bytes_per_token": 800.0, "compression_vs_baseline": 1.25},
                                "share_plain": {"bytes_per_token": 800.0, "compression_vs_baseline": 1.25}},
          "all_attention": {g: {"bytes_per_token": 5.0, "compression_vs_baseline": 9.0}
                            for g in ("baseline", "csa2", "share_plain")}}
    storage = {"note": "prose", "active_model": {"kv": {"bf16": kv, "fp32": {}}}}
    tuned = {"distill": {"train": {"phases": {}}, "eval": {"protocol": {"tokens_scored": 10}, "groups": {
        "csa2": {"ppl": 21.0, **delta("delta_pct", 5.0, 4.0, 6.0),
                 "gold_nll": {"nll_per_token": 1.375, **delta("delta", 0.125, 0.0625, 0.25)}},
        "ced": {"ppl": 99.0, "gold_nll": {"nll_per_token": 9.0}}}}}}
    return ppl, gsm, storage, tuned


def numbers_only(obj):
    if isinstance(obj, dict):
        return all(isinstance(k, str) and numbers_only(v) for k, v in obj.items())
    return isinstance(obj, (int, float)) and not isinstance(obj, bool)


def test_group_rows_hold_every_number_per_group_and_objective():
    ppl, gsm, storage, tuned = summary_inputs()
    s = group_rows(ppl, gsm, storage, tuned, groups=["csa2"])
    assert numbers_only(s) and all(len(v) <= 22 for v in s.values())  # flat and short
    assert list(s) == ["baseline", "csa2", "share_plain", "csa2@distill", "mode_a"]
    assert s["csa2"] == pytest.approx({
        "ppl": 22.5, "dppl_pct": 12.5, "dppl_pct_lo": 10.0, "dppl_pct_hi": 15.0, "kl": 0.125, "kl_lo": 0.1,
        "kl_hi": 0.15, "top1": 90.0, "top1_lo": 88.0, "top1_hi": 92.0, "gold_nll": 1.5, "dgold_nll": 0.25,
        "dgold_nll_lo": 0.2, "dgold_nll_hi": 0.3, "em_strict": 0.0, "em_strict_lo": 0.0, "em_strict_hi": 3.7,
        "em_flex": 2.0, "em_flex_lo": 0.55, "em_flex_hi": 7.0, "kv_bytes": 800.0, "kv_compression": 1.25})
    assert s["baseline"] == pytest.approx({  # the baseline has no change, so no delta keys
        "ppl": 20.0, "gold_nll": 1.25, "em_strict": 3.0, "em_strict_lo": 1.0, "em_strict_hi": 8.5,
        "em_flex": 7.0, "em_flex_lo": 3.4, "em_flex_hi": 13.7, "kv_bytes": 1000.0, "kv_compression": 1.0})
    # no generation for share_plain: its EM keys are absent, not zero
    assert s["share_plain"] == {"ppl": 30.0, "dppl_pct": 50.0, "dppl_pct_lo": 45.0, "dppl_pct_hi": 55.0,
                                "gold_nll": 2.0, "dgold_nll": 0.75, "dgold_nll_lo": 0.5, "dgold_nll_hi": 1.0,
                                "kv_bytes": 800.0, "kv_compression": 1.25}
    # only train.eval_groups; the changes (with CIs) eval_objective measured against its own baseline pass
    assert s["csa2@distill"] == pytest.approx({"ppl": 21.0, "dppl_pct": 5.0, "dppl_pct_lo": 4.0, "dppl_pct_hi": 6.0,
                                               "gold_nll": 1.375, "dgold_nll": 0.125, "dgold_nll_lo": 0.0625,
                                               "dgold_nll_hi": 0.25})

    assert s["mode_a"] == pytest.approx({
        "ppl": 38.0, "dppl_pct": 100.0, "dppl_pct_lo": 90.0, "dppl_pct_hi": 110.0, "kl": 1.5, "kl_lo": 1.25,
        "kl_hi": 1.75, "top1": 50.0, "top1_lo": 45.0, "top1_hi": 55.0, "em_strict": 1.0,
        "em_strict_lo": 0.2, "em_strict_hi": 5.4, "em_flex": 4.0, "em_flex_lo": 1.6, "em_flex_hi": 9.8,
        "gold_nll": 2.5, "dgold_nll": 1.25, "dgold_nll_lo": 1.0, "dgold_nll_hi": 1.5})


def test_summary_is_a_screen_of_changes_and_groups_table_has_the_rest():
    ppl, gsm, storage, tuned = summary_inputs()
    rows = group_rows(ppl, gsm, storage, tuned, groups=["csa2"])
    s = summary(rows)
    # the DVC metrics: the baseline's own figures, then only the changes; no interval, no objective row
    assert s == {"baseline": {"ppl": 20.0, "gold_nll": 1.25},
                 "csa2": {k: rows["csa2"][k] for k in HEADLINE if k in rows["csa2"]},
                 "share_plain": {"dppl_pct": 50.0, "dgold_nll": 0.75},  # share_plain has no KL in its input
                 "mode_a": {k: rows["mode_a"][k] for k in HEADLINE if k in rows["mode_a"]}}
    assert not any("worst_domain_dppl_pct" in r for r in s.values())  # no other domain scored here
    table = groups_table(rows)
    assert [r["group"] for r in table] == list(rows)
    assert all(list(r) == list(table[0]) for r in table)  # one column set: a TSV
    by_group = {r["group"]: r for r in table}
    assert by_group["csa2@distill"]["dppl_pct_lo"] == 4.0 and by_group["csa2@distill"]["kv_bytes"] == ""
    assert by_group["baseline"]["dppl_pct"] == "" and by_group["csa2"]["kv_compression"] == 1.25


def test_mode_a_table_sets_the_skip_against_the_full_prefill():
    ppl, gsm, _, _ = summary_inputs()
    train = {"covered": True, "steps": 16, "tokens": 8192, "protocol": {"records": 64, "val_records": 8},
             "val_before": {"kl": 1.5}, "val_after": {"kl": 0.75}}
    lines = mode_a_table(ppl, gsm, train)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:4]}
    assert "held-out KL (8 records) 1.5000 → 0.7500" in lines[-1] and "16 AdamW steps" in lines[-1]
    assert rows["baseline (full prefill)"] == ["19.000", "–", "–", "–", "3.0 [1.0, 8.5]", "7.0 [3.4, 13.7]", "1.2500",
                                               "–", "1×"]
    assert rows["mode_a (prefill skip, sink: mean, replay 0, maps trained through the skip (tune_mode_a))"] == ["38.000", "+100.00 [+90.00, +110.00]", "1.5000 [1.2500, 1.7500]",
                                             "50.00 [45.00, 55.00]", "1.0 [0.2, 5.4]", "4.0 [1.6, 9.8]", "2.5000",
                                             "+1.2500 [+1.0000, +1.5000]", "≤ 2.00×"]
    assert "zero state" in lines[-3] and "4 eval records" in lines[-3]
    ppl["mode_a"] = {"covered": False, "uncovered_attention_layers": [16, 17]}
    assert mode_a_table(ppl, gsm, {"covered": False}) == ["Mode A: not run — the plan does not cover attention layers [16, 17] above the "
                                      "cut (use a covering plan)."]


def test_window_line_names_the_sliding_layers_and_how_they_are_counted():
    from ced_csa2.eval.results import window_line

    assert window_line({"active_model": {"geometry": {"sliding_windows": {}}}}) == ""
    line = window_line({"active_model": {"geometry": {"sliding_windows": {"1": 512, "2": 512, "4": 512}}}})
    assert line.startswith("Sliding-window layers (3: 1, 2, 4; window 512)") and "min(context, window − 1)" in line


def test_the_frontier_marks_the_rows_no_other_row_beats_on_both_bytes_and_quality():
    rows = {"baseline": {"ppl": 20.0, "kv_bytes": 100.0, "kv_compression": 1.0},
            "a": {"dppl_pct": 5.0, "dppl_pct_lo": 4.0, "dppl_pct_hi": 6.0, "kv_bytes": 80.0, "kv_compression": 1.25},
            "b": {"dppl_pct": 7.0, "dppl_pct_lo": 6.0, "dppl_pct_hi": 8.0, "kv_bytes": 80.0, "kv_compression": 1.25},
            "c": {"dppl_pct": 4.0, "dppl_pct_lo": 3.0, "dppl_pct_hi": 5.0, "kv_bytes": 100.0, "kv_compression": 1.0},
            "d": {"dppl_pct": 9.0, "dppl_pct_lo": 8.0, "dppl_pct_hi": 10.0, "kv_bytes": 30.0, "kv_compression": 3.3},
            "b@x": {"dppl_pct": 3.0, "dppl_pct_lo": 2.0, "dppl_pct_hi": 4.0},  # stores what b stores
            "mode_a": {"dppl_pct": 40.0, "dppl_pct_lo": 30.0, "dppl_pct_hi": 50.0}}  # no bytes of its own
    points = frontier(rows)
    assert [(p["name"], p["kv_bytes"], p["front"]) for p in points] == [
        ("d", 30.0, True), ("b@x", 80.0, True), ("a", 80.0, False), ("b", 80.0, False),
        ("baseline", 100.0, True), ("c", 100.0, False)]
    table = frontier_table(points)
    assert table[2] == "| 30 | 3.30× | **d** | +9.00 [+8.00, +10.00] | ✓ |"
    assert table[-2] == "| 100 | 1.00× | **baseline** | – | ✓ |"


def test_each_goal_takes_the_best_qualifying_row_and_says_whether_it_meets_its_limit():
    def row(d, compression=None):
        return {"dppl_pct": d, "dppl_pct_lo": d - 1, "dppl_pct_hi": d + 1,
                **({"kv_compression": compression} if compression else {})}

    rows = {"baseline": {"ppl": 20.0, "kv_compression": 1.0},
            "ced": row(4.7, 1.0), "ced@x": row(1.9), "ced@y": row(2.5),   # a recipe meets ced's +2%
            "ced_sink": row(1.85, 1.0),                                   # ced with its sink kept: a way of running ced
            "csa2": row(6.0, 1.25), "csa2@x": row(4.5),                  # none meets +4%
            "csa2_fp4": row(3.0, 3.2),                                    # FP4 entries: not a way of running csa2
            "ced_csa2": row(15.0, 1.25),
            "ced_csa2_sink": row(7.9, 1.24),                              # its sink kept: a way of running ced_csa2
            "xced_csa2": row(0.5, 1.25),                                  # another group, not a ced_csa2 recipe
            "baseline_fp4": row(1.5, 2.9),                                # 4-bit but under 3x: not a candidate
            "baseline_fp4_rot": row(2.0, 3.5),                            # at the limit, but k6v4 is lower
            "baseline_k6v4_rot": row(1.1, 3.05),                          # a block format of its own: a candidate
            "xkv": row(0.1, 4.0)}                                         # no block format
    met = {g["goal"]: g for g in goals(rows)}
    assert [(g["best"], g["dppl_pct"], g["met"]) for g in met.values()] == [
        ("ced_sink", 1.85, True), ("csa2@x", 4.5, False), ("ced_csa2_sink", 7.9, True),
        ("baseline_k6v4_rot", 1.1, True)]
    assert list(met) == ["`ced` ≤ +2%", "`csa2` ≤ +4%", "`ced_csa2` ≤ +9%", "KV format ≤ +2% at ≥ 3×"]
    table = goals_table(list(met.values()))
    assert table[2] == "| `ced` ≤ +2% | ced_sink | +1.85 [+0.85, +2.85] | yes |"
    assert table[3].endswith("| no |")
    none = goals({"baseline": {"ppl": 20.0}, "baseline_fp4": row(1.0, 2.0)})
    assert [g["best"] for g in none] == [None] * 4 and not any(g["met"] for g in none)
    assert goals_table(none)[-1] == "| KV format ≤ +2% at ≥ 3× | none qualifies | – | no |"


def test_the_headline_names_mode_a_s_own_reference():
    """Mode A's ΔPPL and KL are against the plain prefill on the second halves, not the baseline row's PPL."""
    lines = headline_table({"baseline": {"ppl": 20.0, "gold_nll": 1.5},
                            "mode_a": {"dppl_pct": 4.0, "kl": 0.06, "dgold_nll": 0.2},
                            "csa2": {"dppl_pct": 6.0, "kl": 0.07, "dgold_nll": 0.1}})
    assert lines[2:] == ["| baseline | 20.000 | – | 1.5000 | – | – | – | – |",
                         "| mode_a (ΔPPL, KL: against the plain prefill, on each record's second half) | +4.00 | 0.0600 "
                         "| +0.2000 | – | – | – | – |",
                         "| csa2 | +6.00 | 0.0700 | +0.1000 | – | – | – | – |"]


def with_domains(ppl: dict) -> dict:
    """``ppl`` with two other domains: ``ced`` worst on ``fiction``, Mode A on ``math``."""
    a = {"covered": True, "mode_a": {"ppl": 12.0}, **delta("delta_pct", 4.0, 3.0, 5.0)}
    return {**ppl, "protocol": {**ppl["protocol"], "data": "wiki", "records": 32},
            "mode_a": a,
            "domains": {
                "fiction": {"protocol": {"records": 12, "tokens_scored": 5000, "trained_on_domain": True},
                            "groups": {"baseline": {"ppl": 30.0},
                                       "ced": {"ppl": 40.0, **delta("delta_pct", 33.0, 30.0, 36.0)}},
                            "mode_a": {**a, **delta("delta_pct", 5.0, 4.0, 6.0)}},
                "math": {"protocol": {"records": 12, "tokens_scored": 4000, "trained_on_domain": False},
                         "groups": {"baseline": {"ppl": 5.0},
                                    "ced": {"ppl": 6.0, **delta("delta_pct", 20.0, 18.0, 22.0)}},
                         "mode_a": {**a, **delta("delta_pct", 8.0, 7.0, 9.0)}}}}


def test_each_domain_s_figures_and_the_worst_domain_reach_groups_tsv_the_summary_and_the_report():
    ppl, gsm, run, adapters, tuned, seed_init = metrics()
    ppl = with_domains(ppl)
    storage = {"active_model": {"kv": {"bf16": {"decoder_attention": {}}}}}
    rows = group_rows(ppl, gsm, storage, {}, ["ced"])
    assert {k: rows["ced"][k] for k in ("fiction_dppl_pct", "fiction_dppl_pct_lo", "fiction_dppl_pct_hi",
                                         "math_dppl_pct", "fiction_ppl", "worst_domain_dppl_pct", "worst_domain")} == {
        "fiction_dppl_pct": 33.0, "fiction_dppl_pct_lo": 30.0, "fiction_dppl_pct_hi": 36.0, "math_dppl_pct": 20.0,
        "fiction_ppl": 40.0, "worst_domain_dppl_pct": 33.0, "worst_domain": "fiction"}
    assert (rows["mode_a"]["worst_domain"], rows["mode_a"]["math_ppl"]) == ("math", 12.0)
    assert rows["baseline"]["fiction_ppl"] == 30.0 and "worst_domain" not in rows["baseline"]
    head = summary(rows)
    assert head["ced"]["worst_domain_dppl_pct"] == 33.0 and head["mode_a"]["worst_domain_dppl_pct"] == 8.0
    assert all(isinstance(v, float) for r in head.values() for v in r.values())  # DVC metrics: numbers only
    assert headline_table(head)[4] == "| ced | +25.00 | 0.5000 | +0.5000 | +33.00 | – | – | – |"
    table = domains_table(rows, ppl)
    assert table[0] == ("| group | wiki (held out) | fiction (trained on) | math | worst ÷ held out "
                        "| GSM8K gold solutions |")
    ced = next(line for line in table if line.startswith("| ced |"))
    # gold: exp(0.5) - 1 = 64.87%, its interval through the same monotone map
    assert ced == ("| ced | +25.00 [+20.50, +30.25] | +33.00 [+30.00, +36.00] | +20.00 [+18.00, +22.00] "
                   "| 1.32× (fiction) | +64.87 [+28.40, +111.70] |")
    assert "`fiction` 12 records (5,000 scored tokens)" in domains_protocol(ppl)
    assert domains_table(rows, {k: v for k, v in ppl.items() if k != "domains"}) == []


def test_objectives_scored_on_other_gold_pairs_are_refused():
    gsm = {"protocol": {"n": 100, "math_set": "GSM8K-100", "num_fewshot": 0, "apply_chat_template": False,
                        "fewshot_as_multiturn": False}}
    gold = (Path("metrics/gsm8k.json"), gsm["protocol"])
    evals = Path("metrics/objectives/eval.json")
    check_same_protocol(GOLD_PROTOCOL, gold, (evals, {**gsm["protocol"], "source": "data/gsm8k_gold.json"}),
                        measured="scored gold NLL")
    stale = {**gsm["protocol"], "n": 37, "num_fewshot": 2}
    with pytest.raises(ValueError, match=r"eval.json scored gold NLL with n=37, num_fewshot=2, metrics/gsm8k.json "
                                         r"with n=100, num_fewshot=0: rerun the pipeline"):
        check_same_protocol(GOLD_PROTOCOL, gold, (evals, stale), measured="scored gold NLL")


def test_result_files_of_another_run_are_refused():
    """metrics/ppl.json, gsm8k.json and objectives/eval.json must come from one model, dtype and plan."""
    run = {"model": "smollm2_135m", "model_revision": None, "dtype": "float32",
           "plan": {"split": 15, "source": 18, "targets": [22, 26, 30]}, "kv_format": "nvfp4", "device": "cpu"}
    ppl, gsm, evals = Path("metrics/ppl.json"), Path("metrics/gsm8k.json"), Path("metrics/objectives/eval.json")
    check_same_protocol(RUN_PROTOCOL, (ppl, run), (gsm, {**run, "device": "cuda:0"}), (evals, run))
    with pytest.raises(ValueError, match=r"gsm8k.json was measured with dtype='bfloat16', metrics/ppl.json with "
                                         r"dtype='float32': rerun the pipeline"):
        check_same_protocol(RUN_PROTOCOL, (ppl, run), (gsm, {**run, "dtype": "bfloat16"}), (evals, run))
    with pytest.raises(ValueError, match=r"eval.json was measured with plan=\{'split': 9"):
        check_same_protocol(RUN_PROTOCOL, (ppl, run), (gsm, run), (evals, {**run, "plan": {"split": 9, "source": 12,
                                                                                          "targets": [14]}}))


def fits(kept_k, kept_v, keep="best_val", **run):
    """Adapter metrics of two target layers whose K and V maps ended at epochs ``kept_k`` and ``kept_v``."""
    stats = {"ridge": {"cos": 0.9, "r2": 0.8}, "trained": {"cos": 0.9, "r2": 0.8}}
    return {"run": {"keep": keep, **run},
            "layers": {"22": {"k": {**stats, "kept_epoch": kept_k}, "v": {**stats, "kept_epoch": kept_v}},
                       "26": {"k": {**stats, "kept_epoch": kept_v}, "v": {**stats, "kept_epoch": kept_v}}}}


def test_the_report_says_why_trained_equals_ridge_only_for_maps_kept_at_the_start():
    projector = {"run": {"keep": "best_val", "init": "ridge"}, "layers": {"18": {"kept_epoch": 0}}}
    [note, _] = start_kept_note(projector, fits(0, 7))
    assert note.startswith("Kept at epoch 0 (metrics `kept_epoch`): projector H → KV_18, adapter KV_src K → KV_22. ")
    assert "no epoch beat the ridge start" in note
    projector["layers"]["18"]["kept_epoch"] = 3
    assert start_kept_note(projector, fits(5, 7)) == []
    # epoch 0 of a random-init projector or a last-epoch run is no ridge start kept for its held-out MSE
    random_init = {"run": {"keep": "best_val", "init": "random"}, "layers": {"18": {"kept_epoch": 0}}}
    assert start_kept_note(random_init, fits(0, 0, keep="last")) == []


def test_the_report_points_to_gold_nll_only_when_the_baseline_solves_almost_no_gsm8k_problem():
    ppl = {"protocol": {"model": "smollm2_135m"}}

    def gsm(correct, hi):
        return {"groups": {"baseline": {"strict-match": {"correct": correct, "n": 100, "ci95": [0.0, hi]}}}}

    [note, _] = gsm_note(ppl, gsm(0, 0.037))
    assert note.startswith("GSM8K exact match: the baseline itself solves 0 of 100 (strict match; 95% interval up "
                           "to 3.7%): **smollm2_135m** is too small")
    assert "Read the gold NLL/token column" in note
    assert gsm_note(ppl, gsm(40, 0.5)) == []
    assert gsm_note(ppl, {"groups": {"baseline": {"gold_nll": {}}}}) == []  # exact match not generated


def test_the_figures_plot_layer_numbers_not_categories(tmp_path, caplog):
    ppl = {"protocol": {"model": "m"}, "groups": {"baseline": {"ppl": 20.0},
                                                 "ced": {"ppl": 21.0, **delta("delta_pct", 5.0, 4.0, 6.0)}}}
    storage = {"active_model": {"kv": {"bf16": {"decoder_attention": {"ced": {"compression_vs_baseline": 2.0}}}}}}
    point = {"kv_bytes": 100.0, "dppl_pct": 0.0, "dppl_pct_lo": 0.0, "dppl_pct_hi": 0.0, "front": True}
    points = [{**point, "name": "baseline"},
              {**point, "name": "ced", "kv_bytes": 50.0, "dppl_pct": 5.0, "dppl_pct_lo": 4.0, "dppl_pct_hi": 6.0}]
    generation = {"protocol": {"prompts": 2, "prompt_tokens": 8},
                  "groups": {"ced": {"agreement_by_position": [1.0, 0.5],
                                     "agreement_by_position_ci95": [[0.9, 1.0], [0.2, 0.8]]}}}
    with caplog.at_level("INFO"):
        written = plots(tmp_path, ppl, fits(0, 0), storage, points, generation)
    assert all(path.is_file() for path in written)
    # adapters.json keys its layers "22", "26": plotted as strings they were categories, one log line per curve
    assert [r.getMessage() for r in caplog.records if r.name.startswith("matplotlib")] == []
