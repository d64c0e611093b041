"""The CED projector: its size on Qwen3.5-4B, its checkpoint round trip and the checks on loading."""

import pytest
import torch
import torch.nn.functional as F

from ced_csa2.pipeline.checkpoint import FORMAT_VERSION, CheckpointError
from ced_csa2.projector import KVProjector, load_projector, load_projectors, save_projector, save_projectors

META = {"layer": 20, "split": 16, "plan": {"split": 16, "source": 20, "targets": [24, 28, 32]},
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
    half, meta = load_projector(path, dtype=torch.float16)
    assert meta == {**META, "hidden_size": 64, "kv_dim": 32}
    for name, t in p.state_dict().items():
        assert torch.equal(half.state_dict()[name], t.half())
    full, _ = load_projector(path)  # default float32 holds the FP16 values exactly
    assert full.proj.weight.dtype == torch.float32 and not full.training
    assert torch.equal(full.proj.weight, p.proj.weight.half().float())


def test_expect_mismatch_names_file_key_and_both_values(tmp_path):
    path = save_projector(tmp_path / "p.pt", small(), META)
    load_projector(path, expect={"hidden_size": 64, "kv_dim": 32, "layer": 20, "model": "qwen3_5_4b"})
    with pytest.raises(CheckpointError, match=r"p\.pt: 'layer' is 20 in the checkpoint, expected 18"):
        load_projector(path, expect={"layer": 18})
    with pytest.raises(CheckpointError, match=r"'kv_dim' is 32 in the checkpoint, expected 1024"):
        load_projector(path, expect={"kv_dim": 1024})
    with pytest.raises(CheckpointError, match=r"has no 'tokenizer'"):
        load_projector(path, expect={"tokenizer": "x"})


def test_missing_corrupt_or_foreign_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_projector(tmp_path / "absent.pt")
    path = save_projector(tmp_path / "p.pt", small(), META)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"truncated\.pt: not a readable checkpoint"):
        load_projector(truncated)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weight": torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match="not a ced_csa2.projector checkpoint"):
        load_projector(foreign)


def test_a_file_of_an_older_format_version_is_refused_by_its_version(tmp_path):
    path = save_projector(tmp_path / "p.pt", small(), META)
    torch.save({**torch.load(path, weights_only=True), "format_version": FORMAT_VERSION - 1}, path)
    with pytest.raises(CheckpointError, match=rf"p\.pt: format_version {FORMAT_VERSION - 1}, "
                                              rf"expected {FORMAT_VERSION}"):
        load_projector(path)


def test_save_refuses_metadata_that_cannot_identify_the_projector(tmp_path):
    with pytest.raises(CheckpointError, match="without metadata"):
        save_projector(tmp_path / "p.pt", small(), {"layer": 20})
    assert not (tmp_path / "p.pt").exists()


def test_several_projectors_in_one_file_and_an_empty_one(tmp_path):
    meta = {k: v for k, v in META.items() if k != "layer"} | {"hidden_size": 64, "kv_dim": 32}
    many = {16: small(1), 17: small(2)}
    loaded, m = load_projectors(save_projectors(tmp_path / "extra.pt", many, meta), expect={"layers": [16, 17]})
    assert sorted(loaded) == [16, 17] and m["layers"] == [16, 17]
    assert torch.equal(loaded[17].proj.weight, many[17].proj.weight.half().float())
    empty, m = load_projectors(save_projectors(tmp_path / "empty.pt", {}, meta))
    assert empty == {} and m["layers"] == [] and m["kv_dim"] == 32
    with pytest.raises(CheckpointError, match="not a ced_csa2.projector checkpoint"):
        load_projector(tmp_path / "empty.pt")
