"""DeepSeek-V4.1's lightning indexer, retrofitted: a small trained scorer of the entries a layer reads.

The oracle indexer (:func:`~ced_csa2.runtime.sparse_attention.index_scores`) ranks a layer's
entries by its own exact attention logits: it reads the layer's full post-RoPE keys, so a
decode step that uses it must rebuild them for every cached position.  V4.1's lightning
indexer instead scores narrow keys it keeps itself (seed 003 §4.3).  Per layer:

* **keys**, one per position, from the KV the layer reads -- the stored pre-k_norm, pre-RoPE
  ``K`` (``kv_dim`` channels, the injection point of docs/design.md §1) -- projected to one
  ``head_dim``-wide key and rotated with the layer's own RoPE (its rotary part only, as the
  layer rotates its keys): ``k̂(j) = RoPE_j(W_k K(j))``;
* **queries** from the layer's attention input ``x`` (what ``q_proj`` reads), ``heads`` of
  them, rotated the same way, and one weight per head: ``q̂_h(t) = RoPE_t(W_q,h x(t))``,
  ``w_h(t) = W_w,h x(t)``;
* the **score** ``s(t, j) = Σ_h w_h(t) · ReLU(q̂_h(t) · k̂(j))`` -- V4.1's formula.

It is trained to imitate the frozen model (:func:`indexer_loss`): ``KL(p ‖ softmax s)`` per
query over the entries it may see, ``p`` the layer's attention averaged over its heads.
The keys are what a cache must add: one ``head_dim``-wide entry per position, kept in
MXFP4 (V4.1 stores its indexer keys in FP4) -- :func:`key_bytes` per token.

``head_dim`` is the model's, so the layer's ``(cos, sin)`` and ``apply_rotary_pos_emb`` serve
unchanged (Qwen3.5's partial rotary included).  The careful choices the seed leaves open
(``heads``, initialisation, the training recipe) are :class:`IndexerConfig`'s, stated there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..kv.fp4 import MXFP4
from ..kv.kv_bytes import fp4_entry_bytes

KEY_FORMAT_GROUP = 32  # MXFP4: one E8M0 scale per 32 channels


@dataclass(frozen=True)
class IndexerConfig:
    """Shape and training recipe of one layer's indexer (not fixed by the seed: our choices).

    ``heads`` 4 indexer heads (V4.1 uses 64 of width 128 on a model 30x wider); AdamW at
    ``lr`` with a cosine schedule for ``steps`` over ``rows`` sampled query rows per sequence.
    """

    heads: int = 4
    steps: int = 300
    lr: float = 3e-3
    rows: int = 256
    batch: int = 4  # sequences per step

    def __post_init__(self):
        if min(self.heads, self.steps, self.rows, self.batch) < 1 or not self.lr > 0:
            raise ValueError(f"indexer: heads, steps, rows and batch must be >= 1 and lr > 0, got {self}")


def key_format(head_dim: int) -> MXFP4:
    """MXFP4 of the indexer keys: 32-channel blocks, or one block per key when ``head_dim`` is narrower (tiny models)."""
    return MXFP4(group=min(KEY_FORMAT_GROUP, head_dim))


def key_bytes(head_dim: int) -> int:
    """Bytes per token of one indexer key in :func:`key_format` (``head_dim/2 + head_dim/group``)."""
    return fp4_entry_bytes(head_dim, key_format(head_dim).group)


class LightningIndexer(nn.Module):
    """One layer's indexer: ``s(t, j) = Σ_h w_h(t) ReLU(q̂_h(t) · k̂(j))``.

    Parameters
    ----------
    hidden, kv_dim, head_dim
        The layer's attention input width, its ``k_proj`` output width and head width.
    heads
        Indexer heads.
    rope
        The model's ``apply_rotary_pos_emb(q, k, cos, sin)`` (the one its attention calls).
    """

    def __init__(self, hidden: int, kv_dim: int, head_dim: int, heads: int, rope: Callable, *,
                 device=None, dtype=None):
        super().__init__()
        self.heads, self.head_dim, self._rope = heads, head_dim, rope
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.q = nn.Linear(hidden, heads * head_dim, **kw)
        self.k = nn.Linear(kv_dim, head_dim, **kw)
        self.w = nn.Linear(hidden, heads, **kw)
        # PyTorch's default init, with the head weights scaled so that the initial scores are O(1)
        # whatever the width: the softmax of the loss starts near uniform, not saturated.
        with torch.no_grad():
            self.w.weight.mul_(1 / math.sqrt(heads * head_dim))

    def keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Indexer keys ``(B, T, head_dim)`` of pre-RoPE ``K`` ``(B, T, kv_dim)`` at the positions of ``cos``/``sin``."""
        key = self.k(k)[:, None]  # (B, 1, T, d): one "head"
        return self._rope(key, key, cos, sin)[1][:, 0]

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``(B, heads, T, head_dim)`` and head weights ``(B, heads, T)`` of attention inputs ``x`` ``(B, T, hidden)``."""
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        q = self._rope(q, q[:, :1], cos, sin)[0]
        return q, self.w(x).transpose(1, 2)

    @staticmethod
    def scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``(B, Q, K)`` float32 scores of ``queries``/``weights`` (from :meth:`queries`) against ``keys`` ``(B, K, d)``."""
        dots = torch.einsum("bhqd,bkd->bhqk", queries.float(), keys.float()).relu_()
        return torch.einsum("bhq,bhqk->bqk", weights.float(), dots)


def indexer_loss(scores: torch.Tensor, target: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Mean over query rows of ``KL(target ‖ softmax(scores))`` over the ``visible`` entries.

    ``scores``, ``target`` (a distribution over each row's visible entries) and ``visible``
    (bool) are ``(B, Q, K)``.
    """
    # Invisible entries: -inf before the softmax, 0 after it, so 0 · (log 0 − 0) adds nothing (and no NaN
    # gradient); the clamp makes 0 · log 0 = 0 for visible entries the target gives no mass.
    log_q = scores.masked_fill(~visible, float("-inf")).log_softmax(-1).masked_fill(~visible, 0.0)
    return (target * (target.clamp_min(1e-30).log() - log_q)).sum(-1).mean()
