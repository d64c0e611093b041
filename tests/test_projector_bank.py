"""Mode A's projector bank: one shared basis for several layers' maps, its reduced-rank start and its file."""

import numpy as np
import pytest
import torch

from ced_csa2.ced_runtime import CEDParts
from ced_csa2.pipeline.checkpoint import CheckpointError
from ced_csa2.pipeline.map_roles import MODE_A
from ced_csa2.plan import LayerPlan
from ced_csa2.projector import KVProjector, ProjectorBank, load_bank, reduced_rank, save_bank

HIDDEN, KV = 16, 4
LAYERS = (5, 3, 7)  # the bank keeps its layers' order: the plan's source first
META = {"role": MODE_A.as_meta(), "split": 2,
        "plan": {"split": 2, "source": 5, "targets": [8], "extra_sources": [3, 7]},
        "model": "tiny", "model_id": "tiny", "params_hash": "0123456789abcdef"}
FP32 = dict(rtol=1e-4, atol=1e-5)  # float32 matmuls of float64-fitted weights


def inputs(n=400, seed=0):
    """``H`` ``(n, HIDDEN)`` with channels of very different spread (as ``H_split``'s outliers) and its moments."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, HIDDEN, generator=g, dtype=torch.float64) * torch.logspace(-1, 1.5, HIDDEN, dtype=torch.float64)
         + torch.randn(HIDDEN, generator=g, dtype=torch.float64))
    mean = h.mean(0)
    return h, mean, (h - mean).T @ (h - mean) / n


def projectors(W: torch.Tensor, b: torch.Tensor) -> dict[int, KVProjector]:
    """Linear projectors of ``LAYERS`` whose side-by-side weights are ``W`` ``(HIDDEN, D)`` and biases ``b``."""
    out = {}
    for i, layer in enumerate(LAYERS):
        p = KVProjector(HIDDEN, KV)
        p.init_from_ridge(W[:, i * 2 * KV:(i + 1) * 2 * KV].float(), b[i * 2 * KV:(i + 1) * 2 * KV].float())
        out[layer] = p
    return out


def stacked(maps: dict, h: torch.Tensor) -> torch.Tensor:
    """``{layer: (k, v)}`` as ``(n, D)``, layers in ``LAYERS`` order."""
    return torch.cat([torch.cat(maps[layer], -1) for layer in LAYERS], -1)


def test_a_bank_reproduces_maps_of_at_most_its_rank_exactly():
    g = torch.Generator().manual_seed(1)
    D = 2 * KV * len(LAYERS)
    W = torch.randn(HIDDEN, 5, generator=g, dtype=torch.float64) @ torch.randn(5, D, generator=g, dtype=torch.float64)
    b = torch.randn(D, generator=g, dtype=torch.float64)
    maps = projectors(W, b)
    h, mean, cov = inputs()
    x = h.float()
    want = stacked({layer: p(x) for layer, p in maps.items()}, x)
    for rank, kept in ((5, 5), (100, HIDDEN)):  # above min(hidden, D) the basis is capped there
        bank = reduced_rank(maps, mean, cov, rank)
        assert bank.rank == kept and bank.layers == LAYERS
        torch.testing.assert_close(stacked(bank(x), x), want, **FP32)


def test_reduced_rank_is_the_best_rank_r_map_of_block_scaled_predictions():
    """An independent route: the SVD of the data's own block-scaled predictions (not the covariance's root)."""
    g = torch.Generator().manual_seed(2)
    D = 2 * KV * len(LAYERS)
    W = torch.randn(HIDDEN, D, generator=g, dtype=torch.float64) * torch.linspace(0.1, 10, D, dtype=torch.float64)
    b = torch.randn(D, generator=g, dtype=torch.float64)
    maps = projectors(W, b)
    W32 = torch.cat([maps[layer].proj.weight.detach().double().T for layer in LAYERS], 1)  # what the bank factors
    h, mean, cov = inputs()
    Y = ((h - mean) @ W32).numpy()
    scale = np.sqrt((Y ** 2).mean(0).reshape(-1, KV).mean(1)).repeat(KV)
    V = np.linalg.svd(Y / scale, full_matrices=False)[2][:6].T
    want = W32.numpy() / scale @ V @ V.T * scale
    bank = reduced_rank(maps, mean, cov, 6)
    got = (bank.heads.weight.detach().double() @ bank.basis.weight.detach().double()).T
    # float32 bank weights (a float64 fit stored in float32, product of two): ~2 eps32 relative per entry times the
    # 6-term product, 1e-4 relative leaves room; atol in units of the largest entry
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    at_mean = mean.float()[None]  # the bank predicts the maps' own K/V at the inputs' mean
    torch.testing.assert_close(stacked(bank(at_mean), at_mean), stacked({l: p(at_mean) for l, p in maps.items()}, at_mean),
                               **FP32)


def test_one_layer_alone_is_its_slice_of_the_bank_and_parts_use_the_bank():
    torch.manual_seed(0)
    bank = ProjectorBank(HIDDEN, KV, LAYERS, 3)
    h = torch.randn(2, 7, HIDDEN)
    every = bank(h)
    plan = LayerPlan(2, 5, (8,), (3, 7))
    parts = CEDParts(bank=bank)
    for layer in LAYERS:
        for got, want in zip(bank.project(layer, h), every[layer]):
            assert got.shape == (2, 7, KV)
            torch.testing.assert_close(got, want, **FP32)
        torch.testing.assert_close(parts.project(layer, plan, h), every[layer], **FP32)
    assert parts.project_all(plan, h).keys() == set(plan.projected) and parts.maps() == [bank]


def test_a_bank_round_trips_in_fp16_and_a_file_for_other_layers_is_refused(tmp_path):
    torch.manual_seed(0)
    bank = ProjectorBank(HIDDEN, KV, LAYERS, 3)
    path = save_bank(tmp_path / "projector_bank.pt", bank, META)
    loaded, meta = load_bank(path, expect={"model": "tiny", "layers": list(LAYERS), "hidden_size": HIDDEN}, role=MODE_A)
    assert (meta["rank"], loaded.layers) == (3, LAYERS)
    for name, t in bank.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.half().float()), name
    with pytest.raises(CheckpointError, match=r"projector_bank\.pt: 'layers' is \[5, 3, 7\] in the checkpoint, "
                                              r"expected \[5, 3\]$"):
        load_bank(path, expect={"layers": [5, 3]}, role=MODE_A)


def test_a_bank_needs_a_basis():
    with pytest.raises(ValueError, match="rank must be >= 1, got 0"):
        ProjectorBank(HIDDEN, KV, LAYERS, 0)
