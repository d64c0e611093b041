"""The CED projector: its size on Qwen3.5-4B, its checkpoint round trip and the checks on loading."""

import pytest
import torch
import torch.nn.functional as F

from ced_csa2.pipeline.checkpoint import FORMAT_VERSION, CheckpointError
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.projector import KVProjector, load_projector, load_projectors, save_projector, save_projectors

META = {"role": MAIN.as_meta(), "layer": 20, "split": 16,
        "plan": {"split": 16, "source": 20, "targets": [24, 28, 32]},
        "model": "qwen3_5_4b", "model_id": "Qwen/Qwen3.5-4B", "params_hash": "0123456789abcdef"}


def small(seed=0, hidden=64, kv=32):
    torch.manual_seed(seed)
    return KVProjector(hidden, kv)


def test_parameter_count_on_qwen3_5_4b_geometry():
    with torch.device("meta"):
        p = KVProjector(2560, 1024)
    assert tuple(p.proj.weight.shape) == (2048, 2560)
    assert sum(t.numel() for t in p.parameters()) == 5_244_928


def test_forward_splits_one_linear_output_into_k_and_v():
    p = small()
    h = torch.randn(3, 5, 64)
    k, v = p(h)
    assert k.shape == v.shape == (3, 5, 32)
    assert torch.equal(torch.cat([k, v], -1), p.proj(h))


def test_init_from_ridge_predicts_the_ridge_map_exactly():
    p = small()
    W, b, h = torch.randn(64, 64), torch.randn(64), torch.randn(300, 64)
    p.init_from_ridge(W, b)
    assert torch.equal(torch.cat(p(h), -1), F.linear(h, W.T.contiguous(), b))


def test_round_trip_is_bit_exact_in_fp16(tmp_path):
    p = small()
    path = save_projector(tmp_path / "projector_k20v20.pt", p, META)
    half, meta = load_projector(path, dtype=torch.float16, role=MAIN)
    assert meta == {**META, "hidden_size": 64, "kv_dim": 32, "mlp_width": 0, "activation": "gelu"}
    for name, t in p.state_dict().items():
        assert torch.equal(half.state_dict()[name], t.half())
    full, _ = load_projector(path, role=MAIN)  # default float32 holds the FP16 values exactly
    assert full.proj.weight.dtype == torch.float32 and not full.training
    assert torch.equal(full.proj.weight, p.proj.weight.half().float())


def test_expect_mismatch_names_file_key_and_both_values(tmp_path):
    path = save_projector(tmp_path / "p.pt", small(), META)
    load_projector(path, expect={"hidden_size": 64, "kv_dim": 32, "layer": 20, "model": "qwen3_5_4b"}, role=MAIN)
    with pytest.raises(CheckpointError, match=r"p\.pt: 'layer' is 20 in the checkpoint, expected 18"):
        load_projector(path, expect={"layer": 18}, role=MAIN)
    with pytest.raises(CheckpointError, match=r"'kv_dim' is 32 in the checkpoint, expected 1024"):
        load_projector(path, expect={"kv_dim": 1024}, role=MAIN)
    with pytest.raises(CheckpointError, match=r"has no 'tokenizer'"):
        load_projector(path, expect={"tokenizer": "x"}, role=MAIN)


def test_missing_corrupt_or_foreign_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_projector(tmp_path / "absent.pt", role=MAIN)
    path = save_projector(tmp_path / "p.pt", small(), META)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"truncated\.pt: not a readable checkpoint"):
        load_projector(truncated, role=MAIN)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weight": torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match="not a ced_csa2.projector checkpoint"):
        load_projector(foreign, role=MAIN)


def test_a_file_of_an_older_format_version_is_refused_by_its_version(tmp_path):
    path = save_projector(tmp_path / "p.pt", small(), META)
    torch.save({**torch.load(path, weights_only=True), "format_version": FORMAT_VERSION - 1}, path)
    with pytest.raises(CheckpointError, match=rf"p\.pt: written by another version of ced-csa2 \(format "
                                              rf"{FORMAT_VERSION - 1}, this reads {FORMAT_VERSION}\): re-run its "
                                              r"stage, `dvc repro -f train_projector`$"):
        load_projector(path, role=MAIN)


def test_save_refuses_metadata_that_cannot_identify_the_projector(tmp_path):
    with pytest.raises(CheckpointError, match="without metadata"):
        save_projector(tmp_path / "p.pt", small(), {"layer": 20})
    assert not (tmp_path / "p.pt").exists()


def test_several_projectors_in_one_file_and_an_empty_one(tmp_path):
    meta = {k: v for k, v in META.items() if k != "layer"} | {"hidden_size": 64, "kv_dim": 32}
    many = {16: small(1), 17: small(2)}
    loaded, m = load_projectors(save_projectors(tmp_path / "extra.pt", many, meta), role=MAIN,
                                expect={"layers": [16, 17]})
    assert sorted(loaded) == [16, 17] and m["layers"] == [16, 17]
    assert torch.equal(loaded[17].proj.weight, many[17].proj.weight.half().float())
    empty, m = load_projectors(save_projectors(tmp_path / "empty.pt", {}, meta), role=MAIN)
    assert empty == {} and m["layers"] == [] and m["kv_dim"] == 32
    with pytest.raises(CheckpointError, match="not a ced_csa2.projector checkpoint"):
        load_projector(tmp_path / "empty.pt", role=MAIN)


def headed(seed=0, hidden=64, kv=32, width=16):
    """A projector with a residual MLP, its input stats set (one outlier channel) and its MLP moved off zero."""
    torch.manual_seed(seed)
    p = KVProjector(hidden, kv, mlp_width=width)
    mean, std = torch.randn(hidden), torch.rand(hidden) + 0.5
    std[3] = 1000.0  # an outlier channel, as H_split has
    p.set_input_stats(mean, std)
    return p


def test_a_residual_head_starts_exactly_at_its_linear_map():
    p = headed()
    h = torch.randn(4, 7, 64)
    assert torch.equal(torch.cat(p(h), -1), p.proj(h))  # the MLP's last layer is zero: it adds exact zeros
    with torch.no_grad():
        p.mlp.down.weight.normal_()
    z = (h - p.h_mean) / p.h_std
    # float32: the same matmuls and gelu in another grouping, O(1) outputs: a few eps32, << 1e-6
    assert torch.allclose(torch.cat(p(h), -1), p.proj(h) + p.mlp.down(F.gelu(p.mlp.up(z))), atol=1e-6)
    assert sorted(n for n, _ in p.named_parameters() if n.startswith("mlp.")) == [
        "mlp.down.bias", "mlp.down.weight", "mlp.up.bias", "mlp.up.weight"]
    assert {id(w) for w in p.mlp_parameters()} == {id(w) for w in p.mlp.parameters()}
    assert small().mlp_parameters() == []


def test_input_stats_are_rounded_as_the_file_stores_them_and_must_be_positive():
    p = KVProjector(8, 4, mlp_width=4)
    mean = torch.full((8,), 1 / 3)
    p.set_input_stats(mean, torch.ones(8))
    assert torch.equal(p.h_mean, mean.half().float()) and not torch.equal(p.h_mean, mean)
    with pytest.raises(ValueError, match="std must be > 0"):
        p.set_input_stats(mean, torch.zeros(8))
    with pytest.raises(ValueError, match="without an MLP"):
        small().set_input_stats(mean, torch.ones(8))


def test_a_residual_head_round_trips_with_its_form_and_stats(tmp_path):
    p = headed()
    with torch.no_grad():
        p.mlp.down.weight.normal_()
    loaded, meta = load_projector(save_projector(tmp_path / "p.pt", p, META), role=MAIN)
    assert (meta["mlp_width"], meta["activation"]) == (16, "gelu") and loaded.mlp_width == 16
    for name, t in p.state_dict().items():  # weights and the input standardisation, as FP16
        assert torch.equal(loaded.state_dict()[name], t.half().float()), name
    rounded = KVProjector(64, 32, mlp_width=16)
    rounded.load_state_dict({n: t.half().float() for n, t in p.state_dict().items()})
    h = torch.randn(5, 64)
    assert torch.equal(torch.cat(loaded(h), -1), torch.cat(rounded(h), -1))
    meta_many = {k: v for k, v in META.items() if k != "layer"} | {"hidden_size": 64, "kv_dim": 32}
    many, m = load_projectors(save_projectors(tmp_path / "extra.pt", {16: headed(1), 17: headed(2)}, meta_many),
                              role=MAIN)
    assert m["mlp_width"] == 16 and all(q.mlp_width == 16 for q in many.values())
    with pytest.raises(ValueError, match="different heads"):
        save_projectors(tmp_path / "mixed.pt", {16: headed(1), 17: small(2)}, meta_many)
