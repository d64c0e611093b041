"""Training lightning indexers to imitate the frozen model's attention, and scoring them against the oracle.

:func:`attention_samples` runs the frozen model once over token sequences and keeps, per
layer, what an indexer reads and what it must imitate -- at ``rows`` sampled query
positions per sequence (every row of a ``T``-token sequence would hold ``T²`` floats per
layer):

* ``x`` -- the layer's attention input at those rows (``k_proj``'s input);
* ``k`` -- its pre-RoPE keys at every position (``k_proj``'s output);
* ``target`` -- its attention at those rows, averaged over its heads;
* ``oracle`` -- the oracle indexer's scores there (:func:`~ced_csa2.runtime.sparse_attention.index_scores`).

:func:`fit` trains a :class:`~ced_csa2.maps.indexer.LightningIndexer` on one layer's samples
(AdamW, warm-up + cosine, seeded; an oracle start first gets its offsets from
:func:`lift_offsets`); :func:`held_out_kl` and :func:`selection` score it as a decode step
reads it -- its keys through the MXFP4 store
(:meth:`~ced_csa2.maps.indexer.LightningIndexer.stored_keys`) -- against the attention
and the oracle's top-``k`` outside the local window (what the sparse reads select from).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..maps.indexer import IndexerConfig, LightningIndexer, indexer_loss
from ..model_utils import Geometry, attention, rope_fn, rotary
from ..pipeline.progress import Progress
from ..runtime.attention_calls import AttentionCalls
from ..runtime.sparse_attention import index_scores
from .training import warmup_cosine

log = logging.getLogger(__name__)


@dataclass
class LayerSamples:
    """One layer's samples over ``N`` sequences of ``T`` tokens, ``R`` rows each (float32, CPU)."""

    rows: torch.Tensor    # (N, R) the sampled query positions, ascending
    x: torch.Tensor       # (N, R, hidden) attention inputs at the rows
    k: torch.Tensor       # (N, T, kv_dim) pre-RoPE keys of every position
    target: torch.Tensor  # (N, R, T) attention averaged over heads (0 beyond each row)
    oracle: torch.Tensor  # (N, R, T) oracle scores (-inf beyond each row)
    cos: torch.Tensor     # (1, T, rot) the layer's RoPE at positions 0..T-1
    sin: torch.Tensor


def sample_rows(length: int, rows: int, first: int, rng: np.random.Generator | None) -> torch.Tensor:
    """``rows`` ascending positions in ``first .. length - 1``: seeded uniform draws, or evenly spaced without ``rng``."""
    if not 0 <= first < length:
        raise ValueError(f"rows start at {first}: outside a {length}-token sequence")
    n = min(rows, length - first)
    if rng is None:
        return torch.linspace(first, length - 1, n).round().long().unique()
    return torch.from_numpy(np.sort(rng.choice(np.arange(first, length), size=n, replace=False)))


def _head_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor):
    """Head-averaged attention and oracle scores ``(B, R, T)`` of the query ``rows`` (causal, unpadded)."""
    b, h, _, d = query.shape
    n_kv, t = key.shape[1], key.shape[2]
    q = query[:, :, rows].float()
    k = key.float().repeat_interleave(h // n_kv, dim=1)
    future = torch.arange(t, device=key.device)[None] > rows[:, None]  # (R, T)
    logits = (q @ k.transpose(-1, -2) * module.scaling).masked_fill(future, float("-inf"))
    oracle = index_scores(query[:, :, rows], key).masked_fill(future, float("-inf"))
    return logits.softmax(-1).mean(1), oracle


@torch.no_grad()
def attention_samples(model: nn.Module, geo: Geometry, layers: Sequence[int], sequences: Sequence[Sequence[int]],
                      rows: int, first_row: int, seed: int | None) -> dict[int, LayerSamples]:
    """Run ``model`` over ``sequences`` (equal lengths) and keep each layer's :class:`LayerSamples`.

    ``seed`` draws ``rows`` random rows per sequence in ``first_row ..``; ``None`` spaces
    them evenly (the held-out evaluation).  Refuses sliding-window layers (no plan here has one).
    """
    sliding = [la for la in layers if geo.window(la) is not None]
    if sliding:
        raise NotImplementedError(f"indexer samples assume full causal attention; layers {sliding} slide")
    lengths = {len(s) for s in sequences}
    if len(lengths) != 1:
        raise ValueError(f"attention_samples takes sequences of one length, got lengths {sorted(lengths)}")
    rng = None if seed is None else np.random.default_rng(seed)
    modules = {attention(model, la): la for la in layers}
    device = next(model.parameters()).device
    kept = {la: {"rows": [], "x": [], "k": [], "target": [], "oracle": []} for la in layers}
    this: dict = {}

    def attend(original, module, query, key, value, attention_mask, *args, **kwargs):
        layer = modules.get(module)
        if layer is not None:
            target, oracle = _head_attention(module, query, key, this["rows"].to(key.device))
            kept[layer]["target"].append(target.cpu())
            kept[layer]["oracle"].append(oracle.cpu())
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    def k_proj_hook(layer):
        def hook(mod, inp, out):
            kept[layer]["x"].append(inp[0][:, this["rows"].to(out.device)].float().cpu())
            kept[layer]["k"].append(out.float().cpu())
        return hook

    with ExitStack() as stack:
        stack.enter_context(AttentionCalls(next(iter(modules)), "sampling attention for the indexer").routed(attend))
        for la in layers:
            stack.callback(attention(model, la).k_proj.register_forward_hook(k_proj_hook(la)).remove)
        for ids in Progress(sequences, desc="indexer samples", unit="seq"):
            this["rows"] = sample_rows(len(ids), rows, first_row, rng)
            for la in layers:
                kept[la]["rows"].append(this["rows"][None])
            model.model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
    length = lengths.pop()
    positions = torch.arange(length, device=device)[None]
    out = {}
    for la in layers:
        cos, sin = (c.float().cpu() for c in rotary(model, la, torch.zeros(1, device=device), positions))
        out[la] = LayerSamples(**{name: torch.cat(v) for name, v in kept[la].items()}, cos=cos, sin=sin)
    return out


def new_indexer(model: nn.Module, geo: Geometry, layer: int, cfg: IndexerConfig, seed: int) -> LightningIndexer:
    """A float32 indexer for ``layer``: drawn from ``seed``, then started at the oracle if ``cfg.init`` says so."""
    torch.manual_seed(seed)
    attn = attention(model, layer)
    indexer = LightningIndexer(geo.hidden_size, geo.kv_dim, geo.head_dim, cfg.heads, rope_fn(attn),
                               key_heads=cfg.key_heads, offset=cfg.offset, rotate_keys=cfg.rotate_keys,
                               key_copies=cfg.key_copies)
    if cfg.init == "attention":
        indexer.init_from_attention(attn, model.config.num_attention_heads, geo.n_kv_heads)
    return indexer


@torch.no_grad()
def lift_offsets(indexer: LightningIndexer, samples: LayerSamples, window: int) -> torch.Tensor:
    """Set each head's constant offset ``c_h`` to the lowest dot product it meets in ``samples``, negated.

    Over every sampled row's entries older than the ``window`` (the ones an indexer ranks), so
    no dot product of the training data is clipped by the ReLU: an oracle start
    (:meth:`~ced_csa2.maps.indexer.LightningIndexer.init_from_attention`) then ranks as the
    oracle does.  Returns the offsets ``(heads,)``.
    """
    if not indexer.has_offset:
        raise ValueError("lift_offsets: this indexer has no offset (IndexerConfig.offset)")
    low = torch.full((indexer.heads,), float("inf"))
    t = samples.k.shape[1]
    for i in range(samples.k.shape[0]):
        rows = samples.rows[i]
        keys = indexer.keys(samples.k[i:i + 1], samples.cos, samples.sin)
        q, _ = indexer.queries(samples.x[i:i + 1], samples.cos[0, rows][None], samples.sin[0, rows][None])
        dots = torch.einsum("bhqd,bkd->bhqk", q[..., :-1].float(), keys.float())[0]  # (heads, R, T)
        older = torch.arange(t)[None] <= rows[:, None] - window
        low = torch.minimum(low, dots.masked_fill(~older, float("inf")).amin((1, 2)))
    indexer.b.bias.copy_((-low).clamp_min(0.0))
    return indexer.b.bias.detach().clone()


def _batch_loss(indexer: LightningIndexer, s: LayerSamples, idx: torch.Tensor, window: int,
                stored: bool = False, start: LightningIndexer | None = None, anchor: float = 0.0) -> torch.Tensor:
    """KL over the entries older than the local ``window`` (the window is always read: only those are ranked).

    ``stored``: the keys as a decode step reads them (MXFP4, ``LightningIndexer.stored_keys``);
    training takes them unrounded.  With a ``start`` indexer, ``anchor · KL(start ‖ indexer)``
    over the same entries is added: the trust region of :func:`fit`.
    """
    rows = s.rows[idx]
    older = torch.arange(s.k.shape[1])[None, None] <= rows[..., None] - window

    def scores(ix: LightningIndexer) -> torch.Tensor:
        keys = (ix.stored_keys if stored else ix.keys)(s.k[idx], s.cos, s.sin)
        return LightningIndexer.scores(*ix.queries(s.x[idx], s.cos[0, rows], s.sin[0, rows]), keys)

    target = s.target[idx] * older
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    own = scores(indexer)
    loss = indexer_loss(own, target, older)
    if start is not None and anchor:
        with torch.no_grad():
            reference = scores(start).masked_fill(~older, float("-inf")).softmax(-1).masked_fill(~older, 0.0)
        loss = loss + anchor * indexer_loss(own, reference, older)
    return loss


def fit(indexer: LightningIndexer, samples: LayerSamples, cfg: IndexerConfig, window: int, seed: int) -> list[float]:
    """Train ``indexer`` in place on ``samples`` for ``cfg.steps`` AdamW steps; the per-step training loss.

    The loss is KL(attention ‖ softmax of the scores) over each row's entries older than ``window``,
    the attention renormalised over them (:func:`_batch_loss`).  ``cfg.anchor`` adds that weight
    times KL(start ‖ indexer), the start a frozen copy of ``indexer`` as it comes in: a trust
    region.  From the oracle start the two terms pull apart -- the oracle's top-``k`` (the logit
    sum) is not the attention's (docs/results.md, the indexer study) -- and the weight sets
    where the trained indexer lands between them.
    """
    gen = torch.Generator().manual_seed(seed)
    start = copy.deepcopy(indexer).requires_grad_(False) if cfg.anchor else None
    opt = torch.optim.AdamW(indexer.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(cfg.steps, 0.05))
    n, losses = samples.k.shape[0], []
    for _ in Progress(range(cfg.steps), desc="indexer fit", unit="step"):
        idx = torch.randperm(n, generator=gen)[:cfg.batch]
        loss = _batch_loss(indexer, samples, idx, window, start=start, anchor=cfg.anchor)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def held_out_kl(indexer: LightningIndexer, samples: LayerSamples, window: int) -> float:
    """Mean per-row KL of :func:`fit`'s loss over every sequence of ``samples``, the keys as stored (MXFP4)."""
    n = samples.k.shape[0]
    return float(np.mean([_batch_loss(indexer, samples, torch.tensor([i]), window, stored=True).item()
                          for i in range(n)]))


@torch.no_grad()
def selection(indexer: LightningIndexer | None, samples: LayerSamples, ks: Sequence[int], window: int, *,
              by_attention: bool = False) -> dict[str, dict[int, float]]:
    """How well a top-``k`` selection among the entries older than the ``window`` does, per ``k``.

    * ``recall`` -- mean ``|top-k(indexer) ∩ top-k(oracle)| / k`` over the rows, the oracle
      being the exact logits summed over heads (:func:`~ced_csa2.runtime.sparse_attention.index_scores`,
      the layer-modes study's selector);
    * ``recall_attention`` -- the same against the top-``k`` of the attention itself (head-averaged,
      ``samples.target``): the entries that hold the most of what the layer attends to, which
      the logit sum does not rank alike (docs/results.md, the indexer study), and the
      distribution the indexer is trained to imitate (:func:`fit`);
    * ``mass`` -- mean share of the row's attention over those entries (``samples.target``,
      renormalised over them) that the selection holds: what a sparse read keeps of what
      the layer would attend to (the attention top-``k`` holds the most any selection can).

    The indexer reads its keys as stored (MXFP4, ``LightningIndexer.stored_keys``); ``indexer=None``
    scores the logit-sum oracle itself (``recall`` 1), or with ``by_attention`` the attention
    top-``k`` (``recall_attention`` 1).  Rows with fewer than ``k`` such entries are left out of
    that ``k``'s means.
    """
    if by_attention and indexer is not None:
        raise ValueError("selection: by_attention scores the attention's own top-k, not an indexer")
    hits = {k: [] for k in ks}
    hits_attention = {k: [] for k in ks}
    mass = {k: [] for k in ks}
    t = samples.k.shape[1]
    for i in range(samples.k.shape[0]):
        rows = samples.rows[i]
        older = torch.arange(t)[None] <= rows[:, None] - window  # (R, T)
        oracle = samples.oracle[i].masked_fill(~older, float("-inf"))
        target = samples.target[i] * older
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
        by_mass = target.masked_fill(~older, -1.0)  # older entries first, then by their attention
        if by_attention:
            mine = by_mass
        elif indexer is None:
            mine = oracle
        else:
            keys = indexer.stored_keys(samples.k[i:i + 1], samples.cos, samples.sin)
            q, w = indexer.queries(samples.x[i:i + 1], samples.cos[0, rows][None], samples.sin[0, rows][None])
            mine = LightningIndexer.scores(q, w, keys)[0].masked_fill(~older, float("-inf"))
        n_older = older.sum(-1)
        for k in ks:
            ok = n_older >= k
            if not ok.any():
                continue
            picked = torch.zeros(int(ok.sum()), t, dtype=torch.bool)
            picked.scatter_(1, mine[ok].topk(k, -1).indices, True)
            hits[k].extend((picked.gather(1, oracle[ok].topk(k, -1).indices).sum(-1).float() / k).tolist())
            hits_attention[k].extend((picked.gather(1, by_mass[ok].topk(k, -1).indices).sum(-1).float() / k).tolist())
            mass[k].extend((target[ok] * picked).sum(-1).tolist())
    mean = lambda d: {k: float(np.mean(v)) if v else None for k, v in d.items()}  # noqa: E731
    return {"recall": mean(hits), "recall_attention": mean(hits_attention), "mass": mean(mass)}
