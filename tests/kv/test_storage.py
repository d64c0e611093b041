"""The ``storage`` stage reproduces docs/design.md §6 and writes every figure with its basis."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, TINY_OVERRIDES, compose, tiny_params

from ced_csa2.kv.storage_table import qwen3_5_4b_geometry
from ced_csa2.model_utils import Geometry
from ced_csa2.pipeline.paths import STORAGE_METRICS as METRICS_PATH
from ced_csa2.groups import GROUPS as REGISTRY
from ced_csa2.stages.storage import run

GROUPS = set(REGISTRY)
# Each rotated group's unrotated twin: the group that stores the same entries (same layout, FP4 scope and sink).
ROTATED_TWINS = {name: twin for name, spec in REGISTRY.items() if spec.rotate
                 for twin, other in REGISTRY.items()
                 if not other.rotate and (other.layout, other.fp4, other.sink) == (spec.layout, spec.fp4, spec.sink)}
BASES = {"decoder_attention", "all_attention", "all_attention_amortised_4k", "all_attention_amortised_32k",
         "all_attention_amortised_128k"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``(returned dict, dict read back from disk)`` of one stage run on the tiny profile."""
    workdir = tmp_path_factory.mktemp("storage")
    returned = run(tiny_params(), workdir)
    return returned, json.loads((workdir / METRICS_PATH).read_text())


def test_qwen3_5_4b_geometry_is_built_locally():
    assert qwen3_5_4b_geometry() == Geometry(n_layers=32, hidden_size=2560, n_kv_heads=4, head_dim=256,
                                             attention_layers=(4, 8, 12, 16, 20, 24, 28, 32))


def test_file_holds_what_run_returns(written):
    returned, on_disk = written
    assert on_disk == json.loads(json.dumps(returned))


def test_qwen3_5_4b_section_reproduces_spec_section_6(written):
    qwen = written[1]["qwen3_5_4b"]
    bf16 = qwen["kv"]["bf16"]
    decoder, everything = bf16["decoder_attention"], bf16["all_attention"]
    # one full-attention layer: 2 (K, V) * 1024 channels * 2 bytes
    assert decoder["baseline"]["bytes_per_token"] / len(qwen["stored_layers"]["decoder_attention"]["baseline"]) == 4096
    assert decoder["baseline"]["bytes_per_token"] == 16384
    assert decoder["csa2"]["bytes_per_token"] == 4096 and decoder["csa2"]["compression_vs_baseline"] == 4
    assert everything["baseline"]["bytes_per_token"] == 32768
    assert everything["csa2"]["bytes_per_token"] == 20480 and everything["csa2"]["compression_vs_baseline"] == 1.6
    assert qwen["stored_layers"]["decoder_attention"]["csa2"] == [20]
    assert qwen["weights"]["adapter_input"] == "kv"  # train_adapters.input: the adapters read [K ‖ V]
    assert qwen["weights"]["adapter_params_per_target"] == 13638656
    assert qwen["weights"]["adapter_params"]["csa2"] == 3 * 13638656
    assert qwen["weights"]["adapter_params"]["share_plain"] == 0
    assert qwen["weights"]["projector_params_per_layer"] == 2560 * 2048 + 2048  # design §2: 5.24M
    # fp32 doubles every KV byte
    assert qwen["kv"]["fp32"]["all_attention"]["csa2"]["bytes_per_token"] == 2 * 20480


def test_fp4_groups_count_packed_entries(written):
    # NVFP4 (default kv_format): an entry of 1024 channels = 1024/2 element bytes + 1024/16 E4M3 scales = 576 B.
    qwen = written[1]["qwen3_5_4b"]["kv"]["bf16"]
    assert qwen["decoder_attention"]["csa2_fp4"]["bytes_per_token"] == 2 * 576
    assert qwen["all_attention"]["baseline_fp4"]["bytes_per_token"] == 8 * 2 * 576
    # csa2_fp4 / ced_csa2_fp4 store only the shared source (layer 20) in FP4, as the runtime
    # evaluates them: layers 4..16 keep their bf16 entries (4 x 4,096 B).
    assert qwen["all_attention"]["ced_csa2_fp4"]["bytes_per_token"] == 4 * 4096 + 2 * 576
    assert qwen["decoder_attention"]["csa2_fp4"]["compression_vs_baseline"] == 16384 / 1152


def test_rotated_fp4_groups_cost_their_plain_twins_bytes(written):
    # The rotation is weights built from a seed (listed, in no basis): every per-token figure is the twin's.
    assert ROTATED_TWINS
    for section in ("active_model", "qwen3_5_4b"):
        metrics = written[1][section]
        for table in metrics["kv"].values():
            for rows in table.values():
                for rotated, twin in ROTATED_TWINS.items():
                    assert rows[rotated] == rows[twin], (rotated, twin)
        weights = metrics["weights"]
        assert weights["rotation_params"]["baseline_fp4"] == 0 and "seed" in weights["rotation_counting"]
    qwen = written[1]["qwen3_5_4b"]["weights"]["rotation_params"]  # head_dim 256; 8 FP4 layers, or the source
    assert qwen["baseline_fp4_rot"] == 8 * 256 ** 2 and qwen["csa2_fp4_rot"] == 256 ** 2


def test_every_figure_carries_its_basis_and_dtype(written):
    metrics = written[1]
    assert set(metrics["bases"]) == BASES and set(metrics["groups"]) == GROUPS
    for section in ("active_model", "qwen3_5_4b"):
        kv = metrics[section]["kv"]
        assert set(kv) == {"bf16", "fp32"}
        for table in kv.values():
            assert set(table) == BASES
            for rows in table.values():
                assert set(rows) == GROUPS
                assert rows["baseline"]["compression_vs_baseline"] == 1.0


@pytest.mark.parametrize("context,tokens", [("4k", 4096), ("32k", 32768), ("128k", 131072)])
def test_amortised_rows_add_the_adapter_weights(written, context, tokens):
    qwen = written[1]["qwen3_5_4b"]
    for dtype, nbytes in (("bf16", 2), ("fp32", 4)):
        table = qwen["kv"][dtype]
        for group in GROUPS:  # adapter weights, or xkv's bases (each group has at most one of them), and sink entries
            adapters = qwen["weights"]["adapter_params"][group] + qwen["weights"]["xkv_basis_params"][group]
            expected = (table["all_attention"][group]["bytes_per_token"] + adapters * nbytes / tokens
                        + qwen["sink_bytes_per_sequence"][dtype][group] / tokens)
            row = table[f"all_attention_amortised_{context}"][group]
            # float64 byte counts (integers, one division): a few eps64 relative
            assert row["bytes_per_token"] == pytest.approx(expected, rel=1e-12)
            assert row["compression_vs_baseline"] == pytest.approx(
                # float64 byte counts (integers, one division): a few eps64 relative
                table["all_attention"]["baseline"]["bytes_per_token"] / expected, rel=1e-12)


def test_sink_entries_are_a_constant_per_sequence(written):
    """ced_csa2_sink's three targets each hold 4 positions' K and V (1024 channels, 2 bytes in bf16) per sequence: in
    no per-token basis, where it costs ced_csa2's bytes; ced_sink's kept entries are its ordinary cache's."""
    qwen = written[1]["qwen3_5_4b"]
    assert qwen["sink_bytes_per_sequence"]["bf16"]["ced_csa2_sink"] == 3 * 4 * 2 * 1024 * 2
    assert qwen["sink_bytes_per_sequence"]["fp32"]["ced_csa2_sink"] == 3 * 4 * 2 * 1024 * 4
    assert qwen["sink_bytes_per_sequence"]["bf16"]["ced_sink"] == qwen["sink_bytes_per_sequence"]["bf16"]["ced"] == 0
    for basis in ("decoder_attention", "all_attention"):
        assert qwen["kv"]["bf16"][basis]["ced_csa2_sink"] == qwen["kv"]["bf16"][basis]["ced_csa2"]
    assert "sink" in qwen["sink_counting"]


def test_active_section_is_the_tiny_model(written):
    active = written[1]["active_model"]
    assert active["model"] == "tiny_qwen3_5"
    assert active["geometry"]["kv_dim"] == 2 * 16
    # decoder's four attention layers, K and V of 32 channels in bf16
    assert active["kv"]["bf16"]["decoder_attention"]["baseline"]["bytes_per_token"] == 4 * 2 * 32 * 2
    assert active["weights"]["adapter_width"] == 48  # 1.5 * 32
    assert active["weights"]["adapter_params"]["csa2"] == 3 * 2 * (64 * 32 + 32 + 64 * 48 + 48 + 48 * 32 + 32)


def test_deepseek_reference_and_note(written):
    metrics = written[1]
    deepseek = metrics["deepseek_v4_1"]
    assert deepseek["entry_bytes"] == {"v41_main_kv": 288, "v41_indexer_k": 68, "v4_flash": 584}
    assert deepseek["chain"]["bytes_per_token"] == {"v4_flash": 3514.25, "cross_layer_reuse": 652,
                                                    "relaxed_compression": 1630, "fp4_main_kv": 890}
    rounded = {k: round(v, 2) for k, v in deepseek["chain"]["factors"].items()}
    assert rounded == {"cross_layer_reuse_divides_by": 5.39, "relaxed_compression_multiplies_by": 2.5,
                       "fp4_main_kv_divides_by": 1.83, "net_divides_by": 3.95}
    assert "basis" in deepseek
    assert "3.44x" in metrics["note"] and "fits none" in metrics["note"]
    assert "decoder_attention 4.0000x" in metrics["note"] and "all_attention 1.6000x" in metrics["note"]


def test_width_mult_reaches_both_sections(tmp_path):
    metrics = run(tiny_params(train_adapters={"width_mult": 1.0}), tmp_path)
    d = 1024
    assert metrics["qwen3_5_4b"]["weights"]["adapter_params_per_target"] == 2 * (5 * d * d + 3 * d)  # n = 2d
    assert metrics["active_model"]["weights"]["adapter_width"] == 32

def test_command_line_entry_point(tmp_path):
    (tmp_path / "params.yaml").write_text(compose(TINY_OVERRIDES))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-m", "ced_csa2.stages.storage"], cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=300)
    written = json.loads((tmp_path / METRICS_PATH).read_text())
    assert written["qwen3_5_4b"]["kv"]["bf16"]["decoder_attention"]["csa2"]["bytes_per_token"] == 4096


def test_sliding_window_model_counts_its_window_in_the_amortised_bases(tmp_path):
    import yaml
    from conftest import TINY_GEMMA3_OVERRIDES

    from ced_csa2.config import Params, from_dict

    params = from_dict(Params, yaml.safe_load(compose(TINY_GEMMA3_OVERRIDES)))
    active = run(params, tmp_path)["active_model"]
    assert active["geometry"]["sliding_windows"] == {str(la): 6 for la in (1, 2, 4, 5, 7, 8)}
    entry = 2 * 32 * 2  # K + V of kv_dim 32 in bf16
    kv = active["kv"]["bf16"]
    # Per token (a context within the window): all 8 layers; csa2 drops its readers 5, 6, 8.
    assert kv["all_attention"]["baseline"]["bytes_per_token"] == 8 * entry
    assert kv["all_attention"]["csa2"]["bytes_per_token"] == 5 * entry
    # At 4K tokens the six sliding layers hold 5 entries each; the full ones (3, 6) 4,096.
    for group, full, sliding in (("baseline", 2, 6), ("csa2", 1, 4)):
        expected = (full * entry * 4096 + sliding * entry * 5) / 4096
        weights = active["weights"]["adapter_params"][group] * 2 / 4096
        assert kv["all_attention_amortised_4k"][group]["bytes_per_token"] == pytest.approx(expected + weights)
