"""Plans, maps and rows the runtime, scoring and training tests share: stand-ins for trained maps."""

import torch
from conftest import tiny_params
from torch import nn

from ced_csa2 import csa2, kv_hooks, projector
from ced_csa2.ced_runtime import CEDModeBRuntime, CEDParts, SinkKV
from ced_csa2.csa2 import CSA2Adapters
from ced_csa2.eval.scoring import multi_group_nll, sequence_nll
from ced_csa2.maps.xkv import XKVBasis
from ced_csa2.model_utils import geometry
from ced_csa2.pipeline import paths
from ced_csa2.pipeline.checkpoint import checkpoint_meta
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.plan import LayerPlan, load_plan
from ced_csa2.projector import KVProjector

QWEN_PLAN = LayerPlan(16, 20, (24, 28, 32))
# Tiny Gemma-3 (window 6; full at 3, 6): a full source read by sliding (5, 8) and full (6) targets,
# covering for Mode A with extra sources 4 and 7 (both sliding).
GEMMA_PLAN = LayerPlan(2, 3, (5, 6, 8), (4, 7))


# The tiny profile's params, and its plan and geometry as the stages load them: split 16, source 20,
# targets 24/28/32; hidden 64, kv_dim 32.
TINY_PARAMS = tiny_params()
TINY_PLAN, TINY_GEO = load_plan(TINY_PARAMS.plan, TINY_PARAMS.model)
MAP_KINDS = ("projector", "projectors", "adapters")


class Replay(nn.Module):
    """Stand-in for a trained map that returns given K/V: the identity substitution."""

    def __init__(self, kv):
        super().__init__()
        self.kv = kv

    def forward(self, *inputs):
        layer = inputs[0] if isinstance(inputs[0], int) else None
        return self.kv[layer] if layer is not None else self.kv[None]


def true_kv(model, x, layers):
    with torch.no_grad(), kv_hooks.capture(model, layers) as store:
        model(x)
    return {layer: (store["k"][layer].clone(), store["v"][layer].clone()) for layer in layers}


def identity_parts(model, x, plan):
    kv = true_kv(model, x, plan.kv_layers)
    return CEDParts(projector=Replay({None: kv[plan.source]}),
                    adapters=Replay({t: kv[t] for t in plan.targets}),
                    extra={e: Replay({None: kv[e]}) for e in plan.extra_sources})


def random_parts(geo, plan, seed=0):
    torch.manual_seed(seed)
    adapters = CSA2Adapters(plan.targets, geo.kv_dim)
    for p in adapters.parameters():  # the MLP's last layer starts at zero; make it count here
        nn.init.normal_(p, std=0.05)
    sink = SinkKV(plan.kv_layers, geo.kv_dim)  # Mode A's sink: "mean"
    nn.init.normal_(sink.k), nn.init.normal_(sink.v)
    return CEDParts(KVProjector(geo.hidden_size, geo.kv_dim), adapters,
                    {e: KVProjector(geo.hidden_size, geo.kv_dim) for e in plan.extra_sources},
                    xkv=random_xkv(geo, plan), sink=sink)


def random_xkv(geo, plan, rank=None):
    """xKV bases of random orthonormal columns (rank kv_dim by default: not lossless)."""
    layers = (plan.source, *plan.targets)
    basis = XKVBasis(layers, geo.kv_dim, rank or geo.kv_dim)
    with torch.no_grad():
        for U in (basis.k, basis.v):
            U.copy_(torch.linalg.qr(torch.randn(U.shape[0], U.shape[0]))[0][:, :U.shape[1]])
    return basis


LLAMA_PLAN = LayerPlan(2, 3, (5, 6))
LENGTHS = (17, 9, 23, 4, 12, 20, 2)  # batch_size 3: right-padded batches of unequal lengths, a short last one


def rows(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]
    # gold-style cuts (some past the end: nothing scored) and whole-record scoring
    return seqs, [0, 3, 11, 0, 12, 5, 1]


def save_maps(models, *, params=TINY_PARAMS, plan=TINY_PLAN, geo=TINY_GEO, only=MAP_KINDS, role=MAIN):
    """Random maps of ``plan`` on ``geo``, saved as the stages of ``role``'s branch save them, under the names
    ``TINY_PLAN`` reads (a map made for another source overwrites ``TINY_PLAN``'s, for a stage to refuse).

    Returns ``{kind: module}`` of what was written.
    """
    torch.manual_seed(0)
    meta = checkpoint_meta(params, plan, geo, params.model, params.plan, role=role)
    out = {}
    if "projector" in only:
        out["projector"] = KVProjector(geo.hidden_size, geo.kv_dim)
        projector.save_projector(paths.projector_path(TINY_PLAN.source, models), out["projector"], meta["projector"])
    if "projectors" in only:
        extra = {e: KVProjector(geo.hidden_size, geo.kv_dim) for e in plan.extra_sources}
        projector.save_projectors(models / paths.PROJECTORS_EXTRA.name, extra, meta["projectors"])
    if "adapters" in only:
        out["adapters"] = CSA2Adapters(plan.targets, geo.kv_dim)
        csa2.save_adapters(models / paths.ADAPTERS_PATH.name, out["adapters"], meta["adapters"])
    return out


def separate(model, plan, group, parts, seqs, cut, batch_size):
    """One group's ``sequence_nll`` under its own runtime: the reference a shared pass must equal."""
    with CEDModeBRuntime(model, plan, group, parts, kv_format="nvfp4"):
        return sequence_nll(model, seqs, cut, batch_size, pad_id=0)


def check_exact(model, plan, groups, batch_size=3):
    """Score ``groups`` in one shared pass on random maps and assert each equals its own run (:func:`separate`), bit
    for bit, with no hook left behind.

    Returns ``{group: (n_seqs, 2) tensor}`` of the shared pass.
    """
    parts = random_parts(geometry(model.config), plan)
    seqs, cut = rows(250)
    shared = multi_group_nll(model, plan, groups, parts, seqs, cut, batch_size, 0, kv_format="nvfp4")
    assert list(shared) == list(groups)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    for group in groups:
        ref = separate(model, plan, group, parts, seqs, cut, batch_size)
        assert torch.equal(shared[group], ref), (group, shared[group], ref)
        assert ref[:, 1].tolist() == [max(0, n - max(1, c)) for n, c in zip(LENGTHS, cut)]
    return shared
