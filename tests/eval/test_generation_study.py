"""studies/generation.py end to end on the tiny Qwen3.5: every supported group and Mode A, the tables, the plot,
and the refusals that come before the model loads."""

import json
import sys

import pytest
from conftest import ROOT, study_corpus, tiny_params
from tiny_maps import random_parts

from ced_csa2.eval import generation as gen
from ced_csa2.model_utils import geometry

sys.path.insert(0, str(ROOT / "studies"))
import generation as study_mod  # noqa: E402


def test_the_committed_study_params_load():
    study = study_mod.load_study(ROOT / "studies" / "generation.yaml")
    assert study.prompts >= 2 and study.prompt_tokens >= 2 and study.new_tokens >= 1


def test_bad_study_params_are_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("prompts: 1\nprompt_tokens: 8\nnew_tokens: 4\nbatch_size: 2\n")
    with pytest.raises(ValueError, match="need prompts >= 2"):
        study_mod.load_study(path)


def test_study_on_the_tiny_model(tiny_model, tmp_path):
    model, tok = tiny_model
    params = tiny_params()
    study_corpus(tmp_path, records=3)
    plan, geo = study_mod.load_plan(params.plan, params.model)
    parts = random_parts(geometry(model.config), plan)
    study = study_mod.Study(prompts=3, prompt_tokens=12, new_tokens=5, batch_size=2)
    m, seconds = study_mod.run(params, study, tmp_path, model_and_tok=(model, tok), parts=parts, mode_a_parts=parts)
    rows = m["groups"]
    assert list(rows) == [*gen.supported_groups(), gen.MODE_A] and set(seconds) == set(rows)
    base = rows["baseline"]
    assert base["first_divergence_mean"] == base["first_divergence_median"] == study.new_tokens
    assert base["agreement"] == 1.0 and base["delta_nll"] == 0.0 and base["used_ratio_to_baseline"] == 1.0
    assert rows[gen.MODE_A]["used_bytes_per_token"] == base["used_bytes_per_token"]
    assert rows["csa2"]["used_bytes_per_token"] < base["used_bytes_per_token"]
    assert rows["csa2_fp4"]["used_bytes_per_token"] < rows["csa2"]["used_bytes_per_token"]
    for r in rows.values():
        assert len(r["agreement_by_position"]) == study.new_tokens
        assert r["allocated_bytes_per_token"] >= r["used_bytes_per_token"]
    p = m["protocol"]
    assert (p["prompts"], p["prompt_tokens"], p["new_tokens"], p["cached_positions"]) == (3, 12, 5, 16)
    assert set(p["not_run"]) == {"baseline_fp4_rot", "csa2_fp4_rot", "ced_csa2_fp4_rot", "xkv"}
    assert "seconds" not in json.dumps(m)  # timings go to timings/, never into the metrics
    md = study_mod.markdown(m)
    assert "| csa2_fp4 | SharedKVCache(nvfp4) |" in md and "n = 3 prompts of 12 tokens" in md and "float32" in md
    assert "Not run" in md and "`xkv`" in md
    study_mod.plot(m, tmp_path / "agreement.png")
    assert (tmp_path / "agreement.png").stat().st_size > 0


def test_short_records_and_prompts_beyond_the_window_are_refused_before_the_model_loads(tmp_path):
    params = tiny_params()
    study_corpus(tmp_path, records=3)  # records of ~400 byte-level tokens
    never = object()  # the model is never loaded: run would fail on it
    study = study_mod.Study(prompts=3, prompt_tokens=1000, new_tokens=4, batch_size=2)
    with pytest.raises(ValueError, match=r"record 'r0' is \d+ tokens long; a prompt of 1000 tokens needs a record "
                                         r"of at least 1001$"):
        study_mod.run(params, study, tmp_path, model_and_tok=(never, study_mod.load_tokenizer(params.model)))
    window = study_mod.load_config(params.model).max_position_embeddings
    study = study_mod.Study(prompts=3, prompt_tokens=window, new_tokens=4, batch_size=2)
    with pytest.raises(ValueError, match=f"needs {window + 3} positions; the model's window is {window}$"):
        study_mod.run(params, study, tmp_path, model_and_tok=(never, None))
    study = study_mod.Study(prompts=4, prompt_tokens=8, new_tokens=4, batch_size=2)
    with pytest.raises(ValueError, match="3 eval records; the study takes 4 prompts"):
        study_mod.run(params, study, tmp_path, model_and_tok=(never, study_mod.load_tokenizer(params.model)))
