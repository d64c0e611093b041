"""The objectives table: one row per (group, objective), deltas against the baseline, protocol checked."""

import pytest

from ced_csa2.stages.report import objective_table


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
