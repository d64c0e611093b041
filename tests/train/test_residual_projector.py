"""The nonlinear CED projector: it starts as the ridge map exactly and its MLP lowers the held-out loss."""

import pytest
import torch
from tiny_dump import HIDDEN, KV, params, write_synthetic_dump

from ced_csa2.maps.residual_projector import ResidualProjector
from ced_csa2.train.residual_projector_training import HeadConfig, train_residual_projector
from ced_csa2.pipeline import paths
from ced_csa2.plan import load_plan
from ced_csa2.train.training import ridge_maps, split_masks

CFG = HeadConfig(epochs=12, batch_size=128, lr=1e-2, weight_decay=0.0, warmup_fraction=0.1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A synthetic dump whose K/V are a linear map of H_split plus a quadratic part, and its ridge maps."""
    work = tmp_path_factory.mktemp("residual")
    write_synthetic_dump(work, params())
    return work


def test_the_untrained_head_is_the_ridge_map_bit_for_bit(workdir):
    maps = ridge_maps(workdir / paths.RIDGE_PATH, ["proj_20"], params())["proj_20"]
    head = ResidualProjector(HIDDEN, KV, width=48)
    head.init_from_ridge(maps["W"], maps["b"])
    h = torch.randn(5, 7, HIDDEN)
    k, v = head(h)
    expected = torch.nn.functional.linear(h, maps["W"].T.contiguous(), maps["b"])
    assert torch.equal(torch.cat([k, v], dim=-1), expected)
    assert head.parameter_count() == 2 * KV * (HIDDEN + 1) + 48 * (HIDDEN + 1) + 2 * KV * (48 + 1)


def test_training_the_mlp_lowers_the_held_out_loss_and_leaves_the_ridge_base(workdir):
    p = params()
    plan, geo = load_plan(p.plan, p.model)
    dump = workdir / paths.DUMP_PATH
    train_mask, val_mask = split_masks(dump, p, plan, geo, [plan.source], tokens_per_record=0)
    head, fit = train_residual_projector(p, dump, workdir / paths.RIDGE_PATH, plan.source, geo, 48, CFG,
                                         train_mask, val_mask)
    assert fit["val_loss"] < 0.9 * fit["val_loss_init"] and fit["kept_epoch"] > 0
    assert fit["k"]["r2"] > fit["init"]["k"]["r2"] and fit["v"]["r2"] > fit["init"]["v"]["r2"]
    maps = ridge_maps(workdir / paths.RIDGE_PATH, ["proj_20"], p)["proj_20"]
    assert torch.equal(head.head.base.weight, maps["W"].T) and torch.equal(head.head.base.bias, maps["b"])
    again, refit = train_residual_projector(p, dump, workdir / paths.RIDGE_PATH, plan.source, geo, 48, CFG,
                                            train_mask, val_mask)
    assert refit == fit and all(torch.equal(a, b) for a, b in zip(head.state_dict().values(),
                                                                   again.state_dict().values()))
