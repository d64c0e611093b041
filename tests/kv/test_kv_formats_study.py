"""studies/kv_formats.py end to end on the tiny Qwen3.5: every format scored on the same records, table, plot."""

import sys

import pytest
from conftest import ROOT, study_corpus, tiny_params

from ced_csa2.kv.formats import KVFormat, StreamFormat
from ced_csa2.model_utils import geometry

sys.path.insert(0, str(ROOT / "studies"))
import kv_formats as study_mod  # noqa: E402


def test_the_committed_study_params_load():
    formats = study_mod.load_study(ROOT / "studies" / "kv_formats.yaml")
    assert formats["nvfp4"] == KVFormat(StreamFormat(), StreamFormat())
    assert formats["k_channel"].k.axis == "tokens" and formats["k_channel"].v == StreamFormat()


@pytest.mark.parametrize("text, message", [
    ("formats:\n  a: {k: {}, v: {}}\n", "paired against 'nvfp4_rot'"),
    ("formats:\n  nvfp4_rot: {k: {axis: heads}, v: {}}\n", "axis 'heads'"),
    ("formats:\n  nvfp4_rot: {k: {grup: 8}, v: {}}\n", "formats.nvfp4_rot.k.grup"),
    ("formats:\n  nvfp4_rot: {k: {}}\n", "formats.nvfp4_rot.v"),
])
def test_bad_study_params_are_refused_naming_the_key(tmp_path, text, message):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        study_mod.load_study(path)


def test_study_on_the_tiny_model(tiny_model, tmp_path):
    model, tok = tiny_model
    params = tiny_params()
    study_corpus(tmp_path, records=3)
    nvfp4 = StreamFormat()
    formats = {"nvfp4_rot": KVFormat(StreamFormat(rotate=True), StreamFormat(rotate=True)),
               "k_channel": KVFormat(StreamFormat(axis="tokens"), nvfp4)}
    m = study_mod.run(params, formats, tmp_path, model_and_tok=(model, tok))
    rows = m["formats"]
    geo = geometry(model.config)
    assert list(rows) == ["baseline", "nvfp4_rot", "k_channel"]
    n = len(geo.attention_layers)
    assert rows["baseline"]["bytes_per_token"] == 4 * geo.kv_dim * n
    assert rows["k_channel"]["bytes_per_token"] == n * 2 * (geo.kv_dim / 2 + geo.kv_dim / 16)
    assert rows["k_channel"]["compression"] == pytest.approx(4 * geo.kv_dim / (2 * (geo.kv_dim / 2 + geo.kv_dim / 16)))
    assert rows["k_channel"]["kl"] > 0 and "delta_vs_reference_pct" in rows["k_channel"]
    assert "delta_vs_reference_pct" not in rows["nvfp4_rot"]
    assert m["protocol"]["records"] == 3 and m["protocol"]["tokens_scored"] > 0
    assert "| k_channel | nvfp4 16 tokens | nvfp4 16 ch |" in study_mod.markdown(m)
    study_mod.plot(m, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
