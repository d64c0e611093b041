"""Plans, maps and rows the runtime, scoring and training tests share: stand-ins for trained maps."""

import torch
from torch import nn

from ced_csa2 import kv_hooks
from ced_csa2.ced_runtime import CEDParts, SinkKV
from ced_csa2.csa2 import CSA2Adapters
from ced_csa2.maps.xkv import XKVBasis
from ced_csa2.plan import LayerPlan
from ced_csa2.projector import KVProjector

QWEN_PLAN = LayerPlan(16, 20, (24, 28, 32))
# Tiny Gemma-3 (window 6; full at 3, 6): a full source read by sliding (5, 8) and full (6) targets,
# covering for Mode A with extra sources 4 and 7 (both sliding).
GEMMA_PLAN = LayerPlan(2, 3, (5, 6, 8), (4, 7))


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
