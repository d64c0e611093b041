"""studies/sparse_decode.py end to end on the tiny Qwen3.5: every cache scored on the same tokens, tables, plot."""

import sys

import pytest
import yaml
from conftest import ROOT, study_corpus, tiny_params
from study_params import refused
from tiny_maps import random_parts

from ced_csa2.maps.indexer import IndexerConfig, key_bytes
from ced_csa2.model_utils import geometry
from ced_csa2.runtime.shared_kv import TokenStore
from ced_csa2.train.indexer_training import new_indexer

sys.path.insert(0, str(ROOT / "studies"))
import sparse_decode as study_mod  # noqa: E402


def test_the_committed_study_params_load():
    study = study_mod.load_study(ROOT / "studies" / "sparse_decode.yaml")
    variants = yaml.safe_load((ROOT / "studies" / "indexer.yaml").read_text())["variants"]
    assert max(study.k) + study.window < study.prefill and set(study.indexers) <= set(variants)


def test_reads_that_would_cover_the_context_are_refused(tmp_path):
    refused(study_mod, tmp_path, "context: 96\nsequences: 1\nprefill: 32\nsteps: 8\nwindow: 4\nk: [40]\nindexers: []\n",
            "k \\+ window must stay below prefill")


def test_study_on_the_tiny_model(tiny_model, tmp_path):
    model, tok = tiny_model
    params = tiny_params()
    study_corpus(tmp_path, records=2)
    plan, geo = study_mod.load_plan(params.plan, params.model)
    indexer = new_indexer(model, geo, plan.source, IndexerConfig(heads=2), seed=0)
    study = study_mod.Study(context=96, sequences=2, prefill=48, steps=8, window=4, k=[4, 16], indexers=["r"])
    m = study_mod.run(params, study, tmp_path, model_and_tok=(model, tok),
                      parts=random_parts(geometry(model.config), plan), indexers={"r": indexer})
    rows = m["groups"]
    assert set(rows) == {"baseline", "csa2"} | {f"csa2 sparse {s}@{k}" for s in ("oracle", "r") for k in (4, 16)}
    assert m["protocol"]["scored_tokens"] == 2 * 8
    assert rows["csa2"]["kl_vs_csa2"] == 0 and rows["baseline"]["kl_vs_baseline"] == 0
    assert rows["csa2 sparse oracle@4"]["kl_vs_csa2"] > 0
    extra = rows["csa2 sparse r@4"]["used_bytes_per_position"] - rows["csa2 sparse oracle@4"]["used_bytes_per_position"]
    assert extra == key_bytes(indexer.key_width)
    assert rows["csa2"]["used_bytes_per_position"] < rows["baseline"]["used_bytes_per_position"]
    # allocated: the store's reserve up to GROW positions (56 cached here), and the indexer keys' own
    positions, grow = study.prefill + study.steps, TokenStore.GROW
    assert all(r["allocated_bytes_per_position"] >= r["used_bytes_per_position"] for r in rows.values())
    assert rows["baseline"]["allocated_bytes_per_position"] == rows["baseline"]["used_bytes_per_position"]
    reserve = geometry(model.config).kv_dim * 2 * 4 * (grow - positions) / positions  # the store's K, V (float32)
    csa2 = rows["csa2"]
    assert csa2["allocated_bytes_per_position"] == pytest.approx(csa2["used_bytes_per_position"] + reserve)
    allocated_extra = (rows["csa2 sparse r@4"]["allocated_bytes_per_position"]
                       - rows["csa2 sparse oracle@4"]["allocated_bytes_per_position"])
    assert allocated_extra == pytest.approx(key_bytes(indexer.key_width) * grow / positions)
    assert "| csa2 | " in study_mod.markdown(m) and "bytes/position used | allocated |" in study_mod.markdown(m)
    assert "| csa2 sparse r@16 |" in study_mod.markdown(m)
    study_mod.plot(m, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
