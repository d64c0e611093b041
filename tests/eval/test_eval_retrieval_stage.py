"""The eval_retrieval stage and its library: the passkey task through every supported group's cache and Mode A on
the tiny Qwen3.5, the report's table and headline column from its rows, and the refusals that come before the
model loads."""

import dataclasses
import json

import pytest
import torch
from conftest import study_corpus, tiny_params
from tiny_maps import random_parts

from ced_csa2.data.corpus import write_prepared
from ced_csa2.eval import generation as gen
from ced_csa2.eval import retrieval
from ced_csa2.eval.results import group_rows, headline_table, retrieval_table, summary
from ced_csa2.model_utils import geometry, load_config
from ced_csa2.pipeline.paths import EVAL_JSONL, RETRIEVAL_METRICS
from ced_csa2.plan import load_plan
from ced_csa2.groups import GROUPS
from ced_csa2.stages import eval_retrieval as stage

ANSWER_TOKENS = 6  # " 12345" in the tiny byte-level tokenizer


def prepared(tmp_path, params):
    """``tmp_path`` with prepare's eval records: 3 records of ~400 byte-level tokens."""
    folder = study_corpus(tmp_path, records=3)
    write_prepared(params, tmp_path, EVAL_JSONL, (folder / "eval.jsonl").read_text())
    return tmp_path


def test_hits_through_each_cache_are_its_own_greedy_generation(tiny_model, tmp_path):
    """A record counts as retrieved through a label's cache exactly when the label's greedy generation through
    that cache (eval.generation, a separate decoding loop) returns its answer: each label's answers are its own
    continuation, one token changed in some records (the first, a middle or the last), in mixed batches."""
    model, tok = tiny_model
    params = tiny_params(eval_retrieval={"length": 300, "records": 5})
    plan, _ = load_plan(params.plan, params.model)
    parts = random_parts(geometry(model.config), plan)
    recs = stage.passkey_records(params, prepared(tmp_path, params), tok)
    assert {len(r.answer) for r in recs} == {ANSWER_TOKENS}
    prompts = torch.tensor([r.prompt for r in recs])
    # One batch here: the mixed batches under test are the hits' below.
    runs = gen.run_groups(model, plan, gen.supported_groups(), parts, prompts, ANSWER_TOKENS, params.kv_format,
                          mode_a=parts, batch_size=len(recs)).runs
    changed = [None, 0, ANSWER_TOKENS - 1, None, 2]  # per record: which answer token is not the continuation
    for label, run in runs.items():
        answers = run.tokens.clone()
        for i, at in enumerate(changed):
            if at is not None:
                answers[i, at] = (answers[i, at] + 1) % len(tok)
        own = [dataclasses.replace(r, answer=answers[i].tolist()) for i, r in enumerate(recs)]
        hits = (retrieval.mode_a_hits(model, plan, parts, own, 3) if label == gen.MODE_A else
                retrieval.group_hits(model, plan, label, parts, own, params.kv_format, 3))
        assert hits == [at is None for at in changed], label
        if label == "csa2":  # batching only groups records: one at a time scores the same
            assert retrieval.group_hits(model, plan, label, parts, own, params.kv_format, 1) == hits
    # answers of two lengths batch apart and come back in the records' order (3 tokens: record 2's change cut off;
    # ``own`` holds the loop's last label's, Mode A's, continuations)
    assert label == gen.MODE_A
    mixed = [dataclasses.replace(r, answer=r.answer[:3]) if i % 2 == 0 else r for i, r in enumerate(own)]
    assert retrieval.mode_a_hits(model, plan, parts, mixed, 2) == [True, False, True, True, False]


def test_the_stage_on_the_tiny_model_writes_deterministic_metrics(tiny_model, tmp_path):
    model, tok = tiny_model
    params = tiny_params(eval_retrieval={"length": 320, "records": 4, "batch_size": 3})
    plan, _ = load_plan(params.plan, params.model)
    parts = random_parts(geometry(model.config), plan)
    m = stage.run(params, prepared(tmp_path, params), parts=parts, model_and_tok=(model, tok))
    written = (tmp_path / RETRIEVAL_METRICS).read_bytes()
    assert json.loads(written) == json.loads(json.dumps(m))
    assert list(m["groups"]) == [*gen.supported_groups(), gen.MODE_A]
    p = m["protocol"]
    assert (p["records"], p["length"], p["digits"], p["dtype"], p["data"]) == (4, 320, 5, "float32", str(EVAL_JSONL))
    assert set(p["not_run"]) == {g for g in GROUPS if g not in gen.supported_groups()}
    base = m["groups"]["baseline"]
    assert "delta_points" not in base
    for label, r in m["groups"].items():
        assert r["n"] == 4 and r["retrieved"] == sum(r["hits"]) and len(r["hits"]) == 4
        assert r["accuracy_ci95"] == [100 * x for x in retrieval.wilson(r["retrieved"], 4)]
        if label != "baseline":  # the paired change: the mean of the per-record differences
            assert r["delta_points"] == pytest.approx(100 * sum(h - b for h, b in zip(r["hits"], base["hits"])) / 4)
            assert r["delta_points_ci95"][0] <= r["delta_points"] <= r["delta_points_ci95"][1]
    assert "seconds" not in written.decode()  # timings go to timings/, never into the metrics
    stage.run(params, tmp_path, parts=parts, model_and_tok=(model, tok))
    assert (tmp_path / RETRIEVAL_METRICS).read_bytes() == written  # the same params, the same bytes


def test_the_report_s_table_and_the_headline_s_passkey_column():
    rows = {"baseline": retrieval.accuracy_row([True, True, True, False], None, seed=0),
            "csa2": retrieval.accuracy_row([True, False, True, False], [True, True, True, False], seed=0)}
    protocol = {"model": "tiny", "dtype": "float32", "records": 4, "length": 320, "digits": 5, "seed": 0,
                "filler": "eval.jsonl joined", "domain": "tiny", "depth": "stratified", "task": "passkey",
                "kv_format": "nvfp4", "ci": "Wilson; paired bootstrap", "not_run": {"xkv": "no cache"}}
    table = retrieval_table({"protocol": protocol, "groups": rows})
    assert "n = 4 records of 320 tokens" in table[0] and "float32" in table[0]
    assert table[4].startswith("| baseline | 3/4 | 75.0 [") and table[4].endswith("| – |")
    assert table[5].startswith("| csa2 | 2/4 | 50.0 [") and "| -25.0 [" in table[5]
    assert table[-1].startswith("Not run") and "`xkv`" in table[-1]
    everything = retrieval_table({"protocol": {**protocol, "not_run": {}}, "groups": rows})
    assert everything == table[:-2]  # every group ran: no "Not run" line
    ppl = {"groups": {"baseline": {"ppl": 20.0}, "csa2": {"ppl": 21.2}}, "mode_a": {"covered": False}}
    storage = {"active_model": {"kv": {"bf16": {"decoder_attention": {}}}}}
    passkey = {g: {k: v for k, v in row.items() if "passkey" in k}
               for g, row in group_rows(ppl, {"groups": {}}, storage, {}, [], retrieval={"groups": rows}).items()}
    head = summary({"baseline": {"ppl": 20.0, "gold_nll": 1.5, **passkey["baseline"]},
                    "csa2": {"dppl_pct": 6.0, "kl": 0.07, **passkey["csa2"]}})
    assert head == {"baseline": {"ppl": 20.0, "gold_nll": 1.5, "passkey_pct": 75.0},
                    "csa2": {"dppl_pct": 6.0, "kl": 0.07, "passkey_pct": 50.0}}
    lines = headline_table(head)
    assert lines[0].endswith("| passkey % |")
    assert lines[2].endswith("| – | – | – | 75 |") and lines[3].endswith("| – | – | – | 50 |")


def test_lengths_beyond_the_window_and_short_filler_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(stage, "load_model_and_tokenizer", never)
    params = tiny_params()
    prepared(tmp_path, params)
    window = load_config(params.model).max_position_embeddings
    with pytest.raises(ValueError, match=rf"^eval_retrieval.length {window + 1} is beyond the model's window "
                                         rf"\({window} positions\)$"):
        stage.run(tiny_params(eval_retrieval={"length": window + 1}), tmp_path)
    with pytest.raises(ValueError, match=rf"^{tmp_path / EVAL_JSONL}: passkey prompts of {window} tokens need \d+ "
                                         rf"filler tokens; the filler has \d+ \(eval_retrieval.length {window}\)$"):
        stage.run(tiny_params(eval_retrieval={"length": window}), tmp_path)
    with pytest.raises(ValueError, match=r"eval_retrieval.records.*must be at least 2"):
        tiny_params(eval_retrieval={"records": 1})
