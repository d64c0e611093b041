"""studies/indexer.py end to end on the tiny Qwen3.5: checkpoints, figures from the saved files, refusals."""
import re
import sys

import pytest
from conftest import ROOT, study_corpus, tiny_params

from ced_csa2.data.joined import joined_sequences
from ced_csa2.maps.indexer import IndexerConfig, key_bytes, load_indexer
from ced_csa2.model_utils import attention, rope_fn
from ced_csa2.train import indexer_training as it

sys.path.insert(0, str(ROOT / "studies"))
import indexer as study_mod  # noqa: E402


def test_the_committed_study_params_load():
    study = study_mod.load_study(ROOT / "studies" / "indexer.yaml")
    assert study.variants["wide"].key_heads > study.variants["narrow"].key_heads == 1
    assert study.held_out.first_row >= 1024 and 128 in study.k
    assert study.every_layer in study.variants


def test_study_on_the_tiny_model(tiny_model, tmp_path):
    model, tok = tiny_model
    study_corpus(tmp_path, ("train", "eval"))
    study = study_mod.Study(train=study_mod.Sequences(96, 3, 32, 8), held_out=study_mod.Sequences(96, 1, 16, 48),
                            window=4, k=[4, 8], variants={"narrow": IndexerConfig(heads=2, steps=20, batch=2),
                                                    "copies": IndexerConfig(heads=2, steps=20, batch=2, rotate_keys=True,
                                                                            key_copies=2)})
    m = study_mod.run(tiny_params(), study, tmp_path, model_and_tok=(model, tok))
    v = m["variants"]["narrow"]
    assert m["protocol"]["train"]["query_rows"] == 3 * 32 and m["protocol"]["held_out"]["query_rows"] == 16
    assert v["key_bytes_per_token"] == key_bytes(v["key_width"]) and set(v["after"]["recall"]) == {4, 8}
    # The figures are the saved file's: reloading it and scoring again gives the same KL.
    layer = m["protocol"]["layer"]
    saved = load_indexer(tmp_path / "studies" / "indexer" / "narrow.pt", rope_fn(attention(model, layer)),
                         expect={"layer": layer})
    geo = study_mod.load_plan(tiny_params().plan, tiny_params().model)[1]
    seqs = joined_sequences(tok, tmp_path / "data" / "corpus" / "eval.jsonl", 96, 1)
    held = it.attention_samples(model, geo, [layer], seqs, 16, 48, seed=None)[layer]
    # the same float32 KL reloaded and recomputed (same ops, same inputs): a few eps32, << 1e-6
    assert it.held_out_kl(saved, held, 4) == pytest.approx(v["after"]["kl"], rel=1e-6)
    assert "| narrow | trained |" in study_mod.markdown(m)
    # Two stored copies: twice the key's width and bytes, and the saved file reloads with both.
    copies = m["variants"]["copies"]
    assert copies["key_width"] == 2 * v["key_width"] and copies["key_bytes_per_token"] == key_bytes(2 * v["key_width"])
    reloaded = load_indexer(tmp_path / "studies" / "indexer" / "copies.pt", rope_fn(attention(model, layer)),
                            expect={"layer": layer})
    # the same float32 KL reloaded and recomputed (same ops, same inputs): a few eps32, << 1e-6
    assert reloaded.key_copies == 2 and it.held_out_kl(reloaded, held, 4) == pytest.approx(copies["after"]["kl"], rel=1e-6)
    # The two references: each has recall 1 against itself; the attention top-k keeps the most attention.
    assert m["oracle"]["recall"] == {4: 1.0, 8: 1.0} and m["attention_top_k"]["recall_attention"] == {4: 1.0, 8: 1.0}
    for k in (4, 8):
        assert m["attention_top_k"]["mass"][k] >= max(m["oracle"]["mass"][k], v["after"]["mass"][k])


def test_every_layer_trains_the_named_variant_for_each_sparse_layer(tiny_model, tmp_path):
    from ced_csa2.runtime.layer_modes import sparse_layers

    model, tok = tiny_model
    study_corpus(tmp_path, ("train", "eval"))
    params = tiny_params()
    study = study_mod.Study(train=study_mod.Sequences(96, 2, 16, 8), held_out=study_mod.Sequences(96, 1, 8, 48),
                            window=4, k=[4], variants={"n": IndexerConfig(heads=2, steps=5, batch=2)}, every_layer="n")
    m = study_mod.run(params, study, tmp_path, model_and_tok=(model, tok))
    plan, geo = study_mod.load_plan(params.plan, params.model)
    layers = sparse_layers(plan, geo)
    assert list(m["every_layer"]) == list(layers) and len(layers) > 1
    for la in layers:
        saved = load_indexer(tmp_path / "studies" / "indexer" / "layers" / f"{la}.pt",
                             rope_fn(attention(model, la)), expect={"layer": la})
        assert saved.meta["recipe"]["heads"] == 2
        assert 0 < m["every_layer"][la]["oracle_mass"][4] <= m["every_layer"][la]["attention_top_k_mass"][4] <= 1
    assert f"| {layers[-1]} |" in study_mod.markdown(m)
    with pytest.raises(ValueError, match="every_layer names variant 'x'"):
        path = tmp_path / "s.yaml"
        path.write_text(re.sub(r"(?m)^every_layer: \S+$", "every_layer: x", (ROOT / "studies" / "indexer.yaml").read_text()))
        study_mod.load_study(path)


def test_an_oracle_start_on_gated_attention_is_refused_before_sampling(tiny_model, tmp_path, monkeypatch):
    model, tok = tiny_model
    study_corpus(tmp_path, ("train", "eval"))
    study = study_mod.Study(train=study_mod.Sequences(96, 3, 32, 8), held_out=study_mod.Sequences(96, 1, 16, 48),
                            window=4, k=[4], variants={"wide": IndexerConfig(heads=2, key_heads=2, offset=True, init="attention")})
    calls = []
    original = it.attention_samples
    monkeypatch.setattr(it, "attention_samples", lambda *a, **k: calls.append(1) or original(*a, **k))
    with pytest.raises(ValueError, match="plain q/k projections"):
        study_mod.run(tiny_params(), study, tmp_path, model_and_tok=(model, tok))
    assert not calls and not (tmp_path / "studies").exists()
