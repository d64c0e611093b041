"""studies/layer_modes.py end to end on the tiny Qwen3.5 (its tables, plot and figures hold together)."""

import sys

import pytest
from conftest import ROOT, study_corpus, tiny_params
from tiny_maps import (
    random_parts,
)

from ced_csa2.model_utils import geometry
from ced_csa2.runtime.layer_modes import ModeError
from ced_csa2.runtime.sparse_attention import HSI

sys.path.insert(0, str(ROOT / "studies"))
import layer_modes as study_mod


def test_the_committed_study_params_load_and_name_the_embedded_plans_layers():
    study = study_mod.load_study(ROOT / "studies" / "layer_modes.yaml")
    assert study.groups["full_reuse"].index_source_layer_ids == {22: 18, 26: 18, 30: 18}
    assert study.context >= 2048 and study.score_from < study.context


def test_study_on_the_tiny_model(tiny_model, tmp_path):
    model, tok = tiny_model
    params = tiny_params()
    study_corpus(tmp_path, records=2)
    groups = {"full": study_mod.GroupSpec("baseline"), "full_reuse": study_mod.GroupSpec("csa2", {28: 20, 32: 20}),
              "full_reindex_hsi": study_mod.GroupSpec("csa2", hsi=True)}
    study = study_mod.Study(context=96, sequences=2, score_from=48, window=4, k=[4, 16], hsi=HSI(4, 4), groups=groups)
    parts = random_parts(geometry(model.config), study_mod.load_plan(params.plan, params.model)[0])
    metrics = study_mod.run(params, study, tmp_path, model_and_tok=(model, tok), parts=parts)
    rows = metrics["groups"]
    assert set(rows) == {"baseline", "csa2"} | {f"{g}@k{k}" for g in groups for k in (4, 16)}
    assert all(r["tokens"] == 2 * 48 for r in rows.values())
    assert rows["full_reuse@k4"]["indexer_entries_per_token"] < rows["full@k4"]["indexer_entries_per_token"]
    assert rows["full@k4"]["entries_read_per_token"] < rows["full@k16"]["entries_read_per_token"]
    assert rows["full_reindex_hsi@k16"]["hsi_pool_recall"] is not None
    assert metrics["modes"]["full_reuse"]["compact"] == "20 F · 24 X · 28 R(20) · 32 R(20)"
    md = study_mod.markdown(metrics)
    assert "| full_reuse | csa2 | 20 F · 24 X · 28 R(20) · 32 R(20) | every visible entry |" in md
    study_mod.plot(metrics, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_trained_selection_reads_the_every_layer_indexers(tiny_model, tmp_path):
    from ced_csa2.maps.indexer import IndexerConfig, save_indexer
    from ced_csa2.runtime.layer_modes import sparse_layers
    from ced_csa2.train.indexer_training import new_indexer

    model, tok = tiny_model
    params = tiny_params()
    study_corpus(tmp_path, records=2)
    plan, geo = study_mod.load_plan(params.plan, params.model)
    for la in sparse_layers(plan, geo):
        save_indexer(tmp_path / study_mod.INDEXERS / f"{la}.pt", new_indexer(model, geo, la, IndexerConfig(heads=2), 0),
                     {"model_id": params.model.hf_id or params.model.name, "layer": la, "seed": 0, "provenance": {}})
    groups = {"full": study_mod.GroupSpec("baseline"), "full_reuse": study_mod.GroupSpec("csa2", {28: 20, 32: 20})}
    study = study_mod.Study(context=96, sequences=2, score_from=48, window=4, k=[4], hsi=HSI(4, 4), groups=groups,
                            selectors=["oracle", "trained"])
    metrics = study_mod.run(params, study, tmp_path, model_and_tok=(model, tok), parts=random_parts(geo, plan))
    rows = metrics["groups"]
    assert set(rows) == {"baseline", "csa2"} | {f"{g}{s}@k4" for g in groups for s in ("", "+trained")}
    oracle, trained = rows["full@k4"], rows["full+trained@k4"]
    assert trained["selector"] == "trained" and oracle["selector"] == "oracle"
    assert trained["indexer_entries_per_token"] == oracle["indexer_entries_per_token"]  # same candidates ranked
    assert trained["indexer_macs_per_token"] == oracle["indexer_macs_per_token"] / geo.kv_dim * 2 * geo.head_dim
    assert trained["nll_per_token"] != oracle["nll_per_token"]  # other picks (random indexers)
    assert "| full (trained) | baseline | 4 |" in study_mod.markdown(metrics)
    study_mod.plot(metrics, tmp_path / "plot.png")
    # Missing files are refused, naming the file, before any scoring.
    (tmp_path / study_mod.INDEXERS / f"{sparse_layers(plan, geo)[-1]}.pt").unlink()
    with pytest.raises(Exception, match=f"{sparse_layers(plan, geo)[-1]}.pt"):
        study_mod.run(params, study, tmp_path, model_and_tok=(model, tok), parts=random_parts(geo, plan))


def test_study_refuses_an_invalid_group_before_loading_anything(tmp_path):
    params = tiny_params()
    study = study_mod.Study(context=96, sequences=1, score_from=48, window=4, k=[4], hsi=HSI(),
                            groups={"bad": study_mod.GroupSpec("csa2", {21: 20})})
    with pytest.raises(ModeError, match="layer modes name layer 21"):
        study_mod.run(params, study, tmp_path, model_and_tok=(None, None))
