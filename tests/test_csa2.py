"""CSA2 adapters: size on Qwen3.5-4B, exact ridge start, checkpoint round trip and load checks."""

import pytest
import torch
import torch.nn.functional as F

from ced_csa2.csa2 import CSA2Adapters, KVAdapter, ResidualMLP, load_adapters, mlp_width, save_adapters
from ced_csa2.pipeline.checkpoint import CheckpointError
from ced_csa2.pipeline.map_roles import MAIN

META = {"role": MAIN.as_meta(), "source": 20, "split": 16,
        "plan": {"split": 16, "source": 20, "targets": [24, 28, 32]},
        "model": "qwen3_5_4b", "model_id": "Qwen/Qwen3.5-4B", "hidden_size": 64, "params_hash": "0123456789abcdef"}


def trained_like(layers=(24, 28), kv=32, seed=0):
    """Small adapters with every weight nonzero (as after training)."""
    torch.manual_seed(seed)
    a = CSA2Adapters(layers, kv)
    with torch.no_grad():
        for t in a.parameters():
            t.normal_()
    return a


@pytest.mark.parametrize("input, count", [("own", 8_395_776), ("kv", 13_638_656)])
def test_parameter_count_of_one_target_layer_on_qwen3_5_4b_geometry(input, count):
    assert mlp_width(1024, 1.5) == 1536
    with torch.device("meta"):
        a = CSA2Adapters([24], 1024, input=input)
    assert a.width == 1536
    assert sum(t.numel() for t in a.parameters()) == count


def test_fresh_adapter_is_exactly_the_ridge_prediction():
    # x @ W + b computed as nn.Linear computes it: one GEMM against the (d_out, d_in)
    # weight with the bias inside. `x @ W + b` written out uses the other operand
    # layout and an unfused add, so it can differ in the last bit (and does at d=1024).
    torch.manual_seed(0)
    for n, d in [(300, 1024), (7, 64)]:
        W, b, x = torch.randn(d, d), torch.randn(d), torch.randn(n, 3, d)
        a = KVAdapter(d, mlp_width(d, 1.5))
        a.init_from_ridge(W, b)
        assert torch.equal(a.mlp(x), torch.zeros(n, 3, d))
        assert torch.equal(a(x), F.linear(x, W.T.contiguous(), b))
        # float32 x @ W + b in another grouping (F.linear vs matmul) over d terms, |x W| ~ 10: ~d eps32 × 10, loose
        # on purpose: the exact check is the line above
        assert torch.allclose(a(x), x @ W + b, rtol=1e-4, atol=1e-3)


def test_residual_mlp_starts_at_zero_and_has_a_gradient():
    mlp = ResidualMLP(8, 12, "silu")
    x = torch.randn(4, 8)
    assert torch.equal(mlp(x), torch.zeros(4, 8))
    mlp(x).pow(2).sum().backward()  # zero output: the gradient reaches only the last layer...
    assert mlp.down.weight.grad is not None and mlp.up.weight.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="unknown activation"):
        ResidualMLP(8, 12, "tanh")


def test_forward_applies_the_layer_s_k_and_v_adapters():
    a = trained_like()
    k, v = torch.randn(5, 32), torch.randn(5, 32)
    out_k, out_v = a(28, k, v)  # input "kv": both read the whole stored entry [K ‖ V]
    kv = torch.cat([k, v], dim=-1)
    assert torch.equal(out_k, a.k["28"](kv)) and torch.equal(out_v, a.v["28"](kv))
    own = CSA2Adapters((28,), 32, input="own")
    out_k, out_v = own(28, k, v)
    assert torch.equal(out_k, own.k["28"](k)) and torch.equal(out_v, own.v["28"](v))
    with pytest.raises(ValueError, match="unknown adapter input 'q'"):
        CSA2Adapters((28,), 32, input="q")
    with pytest.raises(KeyError, match="no adapters for layer 32"):
        a(32, k, v)


def test_round_trip_is_bit_exact_in_fp16(tmp_path):
    a = trained_like()
    path = save_adapters(tmp_path / "adapters.pt", a, META)
    half = load_adapters(path, device="cpu", dtype=torch.float16, role=MAIN)
    assert half.meta == {**META, "layers": [24, 28], "kv_dim": 32, "width": 48, "activation": "gelu",
                         "input": "kv"}
    for name, t in a.state_dict().items():
        assert torch.equal(half.state_dict()[name], t.half()), name
    full = load_adapters(path, role=MAIN)
    assert not full.training and full.k["24"].base.weight.dtype == torch.float32
    assert torch.equal(full.v["28"].mlp.down.weight, a.v["28"].mlp.down.weight.half().float())


def test_expect_mismatch_names_file_key_and_both_values(tmp_path):
    path = save_adapters(tmp_path / "adapters.pt", trained_like(), META)
    load_adapters(path, expect={"kv_dim": 32, "layers": (24, 28), "source": 20, "model": "qwen3_5_4b"}, role=MAIN)
    with pytest.raises(CheckpointError, match=r"adapters\.pt: 'layers' is \[24, 28\] in the checkpoint, "
                                              r"expected \[24, 28, 32\]"):
        load_adapters(path, expect={"layers": [24, 28, 32]}, role=MAIN)
    with pytest.raises(CheckpointError, match=r"'model' is 'qwen3_5_4b' in the checkpoint, expected 'smollm2_135m'"):
        load_adapters(path, expect={"model": "smollm2_135m"}, role=MAIN)


def test_corrupt_or_foreign_files_are_clear_errors(tmp_path):
    bad = tmp_path / "adapters.pt"
    bad.write_bytes(b"not a zip file at all")
    with pytest.raises(CheckpointError, match=r"adapters\.pt: not a readable checkpoint"):
        load_adapters(bad, role=MAIN)
    with pytest.raises(CheckpointError, match="not found"):
        load_adapters(tmp_path / "absent.pt", role=MAIN)
    from ced_csa2.projector import KVProjector, save_projector

    proj = save_projector(tmp_path / "p.pt", KVProjector(8, 4), {**META, "layer": 20})
    with pytest.raises(CheckpointError, match="not a ced_csa2.adapters checkpoint"):
        load_adapters(proj, role=MAIN)
