"""The eval_generation stage and its library: every supported group and Mode A decoded on the tiny Qwen3.5,
the report's table and headline columns from its rows, and the refusals that come before the model loads."""

import json

import pytest
from conftest import study_corpus, tiny_params
from tiny_maps import random_parts

from ced_csa2.data.corpus import write_prepared
from ced_csa2.eval import generation as gen
from ced_csa2.eval.results import generation_table, group_rows, headline_table
from ced_csa2.model_utils import geometry, load_config
from ced_csa2.pipeline.paths import EVAL_JSONL
from ced_csa2.plan import load_plan
from ced_csa2.stages import eval_generation as stage


def test_every_group_and_mode_a_on_the_tiny_model(tiny_model):
    model, tok = tiny_model
    params = tiny_params()
    plan, _ = load_plan(params.plan, params.model)
    parts = random_parts(geometry(model.config), plan)
    records = [{"id": f"r{i}", "text": f"Record {i}: the quick brown fox jumps over the lazy dog again."}
               for i in range(3)]
    prompts = gen.prompt_ids(records, "eval.jsonl", tok, 3, 12, params.seed, 0)
    assert prompts.shape == (3, 12)
    runs = gen.run_groups(model, plan, gen.supported_groups(), parts, prompts, 5, params.kv_format, mode_a=parts,
                          batch_size=2).runs
    rows = gen.generation_rows(model, prompts, runs, seed=params.seed, batch_size=2)
    assert list(rows) == [*gen.supported_groups(), gen.MODE_A]
    base = rows["baseline"]
    assert base["first_divergence_mean"] == base["first_divergence_median"] == 5
    assert base["agreement"] == 1.0 and base["delta_nll"] == 0.0 and base["used_ratio_to_baseline"] == 1.0
    assert rows[gen.MODE_A]["used_bytes_per_token"] == base["used_bytes_per_token"]
    assert rows["csa2"]["used_bytes_per_token"] < base["used_bytes_per_token"]
    assert rows["csa2_fp4"]["used_bytes_per_token"] < rows["csa2"]["used_bytes_per_token"]
    for r in rows.values():
        assert len(r["agreement_by_position"]) == 5 and r["allocated_bytes_per_token"] >= r["used_bytes_per_token"]
    assert "seconds" not in json.dumps(rows)  # timings go to timings/, never into the metrics

    protocol = {"model": "tiny", "dtype": "float32", "data": "eval.jsonl", "domain": "tiny", "prompts": 3,
                "prompt_tokens": 12, "new_tokens": 5, "cached_positions": 16, "kv_format": "nvfp4",
                "reference": "the baseline's", "plausibility": "Δ NLL", "ci": "bootstrap",
                "not_run": {"xkv": "no cache"}}  # the table's note, as a protocol that left a group out renders it
    table = generation_table({"protocol": protocol, "groups": rows})
    assert "n = 3 prompts of 12 tokens" in table[0] and "float32" in table[0]
    assert any(line.startswith("| csa2_fp4 | SharedKVCache(nvfp4) |") for line in table)
    assert any(line.startswith("| csa2_fp4_rot | SharedKVCache(nvfp4, rotated) |") for line in table)
    assert any(line.startswith("| baseline_fp4_rot | FP4KVCache(rotated) |") for line in table)
    assert rows["csa2_fp4_rot"]["used_bytes_per_token"] == rows["csa2_fp4"]["used_bytes_per_token"]
    assert table[-1].startswith("Not run") and "`xkv`" in table[-1]
    everything = generation_table({"protocol": {**protocol, "not_run": {}}, "groups": rows})
    assert everything == table[:-2]  # every group ran: no "Not run" line
    ppl = {"groups": {"baseline": {"ppl": 20.0}, "ced": {"ppl": 21.0}}, "mode_a": {"covered": False}}
    storage = {"active_model": {"kv": {"bf16": {"decoder_attention": {}}}}}
    columns = group_rows(ppl, {"groups": {}}, storage, {}, [], generation={"groups": rows})["ced"]
    assert columns["gen_agreement"] == rows["ced"]["agreement"]
    assert columns["gen_dnll_lo"] <= columns["gen_dnll"] <= columns["gen_dnll_hi"]
    headline = {k: v for k, v in columns.items() if k.startswith("gen_") and "_" not in k[4:]}
    line = headline_table({"ced": {"dppl_pct": 1.0, **headline}})[2]
    assert line.endswith(f"| {columns['gen_agreement']:.3f} | {columns['gen_dnll']:+.4f} | – |")  # no passkey run


def _with(params, **changes):
    import dataclasses

    return dataclasses.replace(params, eval_generation=dataclasses.replace(params.eval_generation, **changes))


def test_short_records_and_prompts_beyond_the_window_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(stage, "load_model_and_tokenizer", never)
    params = tiny_params()
    folder = study_corpus(tmp_path, records=3)  # records of ~400 byte-level tokens
    write_prepared(params, tmp_path, EVAL_JSONL, (folder / "eval.jsonl").read_text())  # with prepare's record
    with pytest.raises(ValueError, match=r"record 'r0' is \d+ tokens long; a prompt of 1000 tokens needs a record "
                                         r"of at least 1001$"):
        stage.run(_with(params, prompts=3, prompt_tokens=1000), tmp_path)
    window = load_config(params.model).max_position_embeddings
    with pytest.raises(ValueError, match=f"needs {window + 3} positions; the model's window is {window}$"):
        stage.run(_with(params, prompts=3, prompt_tokens=window, new_tokens=4), tmp_path)
    one = study_corpus(tmp_path, records=1)
    write_prepared(params, tmp_path, EVAL_JSONL, (one / "eval.jsonl").read_text())
    with pytest.raises(ValueError, match=r"1 eval record\(s\); the intervals resample prompts and need at least 2"):
        stage.run(_with(params, prompts=4, prompt_tokens=8), tmp_path)
