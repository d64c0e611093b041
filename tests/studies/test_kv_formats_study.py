"""studies/kv_formats.py end to end on the tiny Qwen3.5: every format scored on the same records, table, plot."""

import sys

import pytest
from conftest import ROOT, study_corpus, tiny_params
from study_params import refused

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
    refused(study_mod, tmp_path, text, message)


def test_study_on_the_tiny_model(tiny_model, tmp_path):
    model, tok = tiny_model
    params = tiny_params()
    study_corpus(tmp_path, records=3)
    nvfp4 = StreamFormat()
    geo = geometry(model.config)
    rope = geo.head_dim // 4  # the tiny Qwen3.5's partial RoPE, as Qwen3.5-4B's: a quarter of each head
    formats = {"nvfp4_rot": KVFormat(StreamFormat(rotate=True), StreamFormat(rotate=True)),
               "k_channel": KVFormat(StreamFormat(axis="tokens"), nvfp4),
               "k_rope": KVFormat(StreamFormat(rotate=True, exact=rope, group=4), nvfp4),  # tiny heads: groups of 4
               "all_exact": KVFormat(StreamFormat(exact=geo.head_dim), StreamFormat(exact=geo.head_dim))}
    m = study_mod.run(params, formats, tmp_path, model_and_tok=(model, tok))
    rows = m["formats"]
    assert list(rows) == ["baseline", "nvfp4_rot", "k_channel", "k_rope", "all_exact"]
    # every channel exact: the runtime reads back what the layers wrote, and pays bf16's bytes
    assert rows["all_exact"]["kl"] == 0 and rows["all_exact"]["delta_pct"] == 0
    assert rows["all_exact"]["bytes_per_token"] == rows["baseline"]["bytes_per_token"]
    heads, rest = geo.n_kv_heads, geo.head_dim - rope
    k_bytes = heads * (2 * rope + rest / 2 + rest / 4)
    assert rows["k_rope"]["bytes_per_token"] == len(geo.attention_layers) * (k_bytes + geo.kv_dim / 2 + geo.kv_dim / 16)
    # on Qwen3.5-4B by accounting (4 heads of 256, the same exact channels): K per head 2 bytes per exact
    # channel, the rest 4 bits + a scale per 4; V 512 + 64; against 2 x 2 x 1024 in bf16
    qwen_k = 4 * (2 * rope + (256 - rope) / 2 + (256 - rope) / 4)
    assert rows["k_rope"]["qwen3_5_4b_compression"] == pytest.approx(4096 / (qwen_k + 576))
    assert "| k_rope | nvfp4 4 ch rot +%d exact | nvfp4 16 ch |" % rope in study_mod.markdown(m)
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
