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
* the **score** ``s(t, j) = Σ_h w_h(t) · ReLU(q̂_h(t) · k̂(j))`` -- V4.1's formula;
* optionally an **offset** per head, ``b_h(t) = W_b,h x(t) + c_h``, inside the ReLU: the query's
  extra channel against a key channel that is always 1 (a homogeneous coordinate, never
  stored).  It is what lets an indexer start at the oracle (:meth:`LightningIndexer.init_from_attention`):
  where a layer's logits are negative for almost every entry (SmolLM2's layer 18), the ReLU
  would tie them all at 0; an offset that lifts them above 0 keeps the oracle's order.

Stored, the keys lose most where a few channels dominate (MXFP4 sets one scale per 32
channels from the largest); with ``rotate_keys`` keys and queries are both turned by one fixed
Hadamard matrix per ``head_dim`` slice after RoPE (:class:`~ced_csa2.kv.rotation.HeadRotation`),
which leaves every float score as it was and spreads those channels before FP4.  V4 rotates its
indexer keys so; V4.1 dropped the step (seed 002), so it is off unless a config asks.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..kv.fp4 import MXFP4
from ..kv.kv_bytes import fp4_entry_bytes
from ..kv.rotation import ROTATION_SEED, HeadRotation
from ..pipeline.checkpoint import load_checkpoint, load_state, save_checkpoint

KEY_FORMAT_GROUP = 32  # MXFP4: one E8M0 scale per 32 channels
KIND = "indexer"
REQUIRED_META = ("model_id", "layer", "seed", "provenance")


@dataclass(frozen=True)
class IndexerConfig:
    """Shape and training recipe of one layer's indexer (not fixed by the seed: our choices).

    ``heads`` indexer heads (V4.1 uses 64 of width 128 on a model 30x wider), keys ``key_heads``
    heads wide, with or without a per-head ``offset`` inside the ReLU (V4.1 has none), keys
    stored as they are (V4.1) or Hadamard-rotated (``rotate_keys``: V4), started at random or
    at the oracle (``init``, which needs the offset); AdamW at ``lr`` (no weight decay), 5%
    warm-up then cosine, ``steps`` steps of ``batch`` sequences.  ``anchor`` weighs a trust
    region around the start: ``anchor · KL(start ‖ indexer)`` added to the loss
    (:func:`~ced_csa2.train.indexer_training.fit`; 0, V4.1's loss, imitates the attention alone).
    """

    heads: int = 4
    key_heads: int = 1  # key width in heads (LightningIndexer)
    offset: bool = False  # LightningIndexer's offset b_h(t) inside the ReLU
    rotate_keys: bool = False  # LightningIndexer's Hadamard rotation of keys and queries before FP4
    init: str = "random"  # or "attention": LightningIndexer.init_from_attention
    steps: int = 300
    lr: float = 3e-3
    batch: int = 4  # sequences per step
    anchor: float = 0.0  # weight of KL(start ‖ indexer) in the loss
    key_copies: int = 1  # LightningIndexer's stored copies of each key, each under its own rotation

    def __post_init__(self):
        if self.key_copies > 1 and not self.rotate_keys:
            raise ValueError(f"indexer.key_copies {self.key_copies} needs rotate_keys: true (each copy is "
                             "stored under its own rotation; unrotated copies would round alike)")
        if min(self.heads, self.key_heads, self.key_copies, self.steps, self.batch) < 1 or not self.lr > 0 or not self.anchor >= 0:
            raise ValueError(f"indexer: heads, key_heads, steps and batch must be >= 1, lr > 0 and anchor >= 0, "
                             f"got {self}")
        if self.init not in ("random", "attention"):
            raise ValueError(f"indexer.init must be 'random' or 'attention', got {self.init!r}")
        if self.init == "attention" and not self.offset:
            raise ValueError("indexer.init 'attention' needs offset: true (without it the ReLU clips every "
                             "negative logit to a tie at 0, and the start is not the oracle's order)")


def key_format(width: int) -> MXFP4:
    """MXFP4 of ``width``-channel indexer keys: 32-channel blocks, or one block per key when narrower (tiny models)."""
    return MXFP4(group=min(KEY_FORMAT_GROUP, width))


def key_bytes(width: int) -> int:
    """Bytes per token of one ``width``-channel indexer key in :func:`key_format` (``width/2 + width/group``)."""
    return fp4_entry_bytes(width, key_format(width).group)


class LightningIndexer(nn.Module):
    """One layer's indexer: ``s(t, j) = Σ_h w_h(t) ReLU(q̂_h(t) · k̂(j))``.

    Parameters
    ----------
    hidden, kv_dim, head_dim
        The layer's attention input width, its ``k_proj`` output width and head width.
    heads
        Indexer heads.
    key_heads
        The key's width in heads: ``key_heads · head_dim`` channels, each ``head_dim`` slice
        rotated as the layer rotates a head (1: V4.1's one narrow key; the layer's own
        ``n_kv_heads``: as wide as its keys, what :meth:`init_from_attention` needs).
    rope
        The model's ``apply_rotary_pos_emb(q, k, cos, sin)`` (the one its attention calls).
    offset
        Give each head an offset ``b_h(t) = W_b,h x(t) + c_h`` inside its ReLU (zero at the start).
    rotate_keys
        Turn keys and queries by a fixed Hadamard matrix per ``head_dim`` slice after RoPE
        (seed ``ROTATION_SEED``: weights derived from a seed, not stored).
    key_copies
        Store each key this many times, copy ``c`` turned by the randomised Hadamard matrix of
        seed ``ROTATION_SEED + c`` (needs ``rotate_keys``), the queries likewise and scaled by
        ``1 / key_copies``: every float score is unchanged, while MXFP4 rounds the copies
        differently, so their average scores closer to the float keys (docs/results.md).
    """

    def __init__(self, hidden: int, kv_dim: int, head_dim: int, heads: int, rope: Callable, *, key_heads: int = 1,
                 offset: bool = False, rotate_keys: bool = False, key_copies: int = 1, device=None, dtype=None):
        super().__init__()
        if key_copies > 1 and not rotate_keys:
            raise ValueError(f"key_copies {key_copies} needs rotate_keys (each copy under its own rotation)")
        self.heads, self.key_heads, self.head_dim, self._rope = heads, key_heads, head_dim, rope
        self.rotations = [HeadRotation(head_dim, ROTATION_SEED + c) for c in range(key_copies)] if rotate_keys else []
        kw = {"device": device, "dtype": dtype}
        self.q = nn.Linear(hidden, heads * key_heads * head_dim, bias=False, **kw)
        self.k = nn.Linear(kv_dim, key_heads * head_dim, bias=False, **kw)
        self.w = nn.Linear(hidden, heads, **kw)
        # PyTorch's default init, with the head weights scaled so that the initial scores are O(1)
        # whatever the width: the softmax of the loss starts near uniform, not saturated.
        with torch.no_grad():
            self.w.weight.mul_(1 / math.sqrt(heads * key_heads * head_dim))
            self.w.bias.zero_()
        self.b = nn.Linear(hidden, heads, **kw) if offset else None
        if self.b is not None:
            nn.init.zeros_(self.b.weight)
            nn.init.zeros_(self.b.bias)

    @property
    def key_copies(self) -> int:
        return max(1, len(self.rotations))

    @property
    def key_width(self) -> int:
        """Channels of a stored key: every copy of its ``key_heads · head_dim``."""
        return self.key_copies * self.key_heads * self.head_dim

    @property
    def has_offset(self) -> bool:
        return self.b is not None

    @torch.no_grad()
    def init_from_attention(self, attn: nn.Module, n_heads: int, n_kv_heads: int) -> LightningIndexer:
        """Start at the oracle: head ``g`` sums the query heads of KV head ``g``, the key is the layer's own.

        Then ``s(t, j) = w Σ_g ReLU(Σ_{h ∈ g} q_h(t) · k_g(j) + c_g)``, ``w`` the attention's
        scaling over ``n_heads`` (so that ``s`` starts as the heads' mean logit, on the
        attention's scale): wherever no part is clipped, the oracle's score
        (:func:`~ced_csa2.runtime.sparse_attention.index_scores`) scaled and shifted, so the same
        order.  The offsets ``c_g`` start at 0: :func:`~ced_csa2.train.indexer_training.lift_offsets`
        sets them from data.  Needs ``heads == key_heads == n_kv_heads``, the offset, and an
        attention whose queries and keys are plain projections (no bias, no q_norm/k_norm, no
        gate: Llama, SmolLM2).
        """
        plain = (getattr(attn, "q_proj", None) is not None and attn.q_proj.bias is None
                 and attn.k_proj.bias is None and not hasattr(attn, "q_norm") and not hasattr(attn, "k_norm")
                 and attn.q_proj.out_features == n_heads * self.head_dim)
        if not plain or self.heads != n_kv_heads or self.key_heads != n_kv_heads or not self.has_offset:
            raise ValueError(f"init from attention needs heads = key_heads = n_kv_heads ({n_kv_heads}; got "
                             f"{self.heads}, {self.key_heads}), the offset (has it: {self.has_offset}) and plain "
                             f"q/k projections without bias, norms or gate ({type(attn).__name__} has "
                             f"{'them' if not plain else 'none'})")
        d, group = self.head_dim, n_heads // n_kv_heads
        wq = attn.q_proj.weight.view(n_kv_heads, group, d, -1).sum(1)  # (n_kv, d, hidden): summed per KV head
        self.q.weight.zero_()
        for g in range(n_kv_heads):
            rows = slice((g * n_kv_heads + g) * d, (g * n_kv_heads + g + 1) * d)  # head g, key slice g
            self.q.weight[rows] = wq[g]
        self.k.weight.copy_(torch.eye(self.k.out_features))
        self.w.weight.zero_()
        self.w.bias.fill_(attn.scaling / n_heads)
        return self

    def _rotated(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, scale: float = 1.0
                 ) -> torch.Tensor:
        """``(B, T, heads · key_heads · head_dim)`` -> ``(B, heads, T, key_width)``: each ``head_dim`` slice
        rotated (RoPE, then each copy's rotation), the copies side by side, times ``scale``."""
        b, t, _ = x.shape
        x = x.view(b, t, heads * self.key_heads, self.head_dim).transpose(1, 2)
        x = self._rope(x, x[:, :1], cos, sin)[0]
        copies = [r.rotate(x).to(x.dtype) for r in self.rotations] or [x]
        x = torch.cat([c.view(b, heads, self.key_heads, t, self.head_dim).transpose(2, 3).reshape(b, heads, t, -1)
                       for c in copies], -1)
        return x * scale if scale != 1.0 else x

    def keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Indexer keys ``(B, T, key_width)`` of pre-RoPE ``K`` ``(B, T, kv_dim)`` at the positions of ``cos``/``sin``."""
        return self._rotated(self.k(k), 1, cos, sin)[:, 0]

    def stored_keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:meth:`keys` as a cache holds them: through :func:`key_format` (MXFP4) and back, float32."""
        fmt = key_format(self.key_width)
        return fmt.dequantize(fmt.quantize(self.keys(k, cos, sin)))

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``(B, heads, T, key_width [+ 1])`` and head weights ``(B, heads, T)`` of attention inputs ``x`` ``(B, T, hidden)``.

        With the offset, each query ends in one more channel, ``b_h(t)``: what it meets in the key
        is the constant 1 that :meth:`keys` does not return (so no store holds it).
        """
        q = self._rotated(self.q(x), self.heads, cos, sin, 1.0 / self.key_copies)  # the copies' mean score
        if self.b is not None:
            q = torch.cat((q, self.b(x).transpose(1, 2)[..., None].to(q.dtype)), -1)
        return q, self.w(x).transpose(1, 2)

    @staticmethod
    def scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``(B, Q, K)`` float32 scores of ``queries``/``weights`` (from :meth:`queries`) against ``keys`` ``(B, K, d)``.

        Queries one channel wider than the keys carry the offset (:meth:`queries`).
        """
        d = keys.shape[-1]
        if queries.shape[-1] not in (d, d + 1):
            raise ValueError(f"indexer queries of width {queries.shape[-1]} cannot score keys of width {d}")
        dots = torch.einsum("bhqd,bkd->bhqk", queries[..., :d].float(), keys.float())
        if queries.shape[-1] == d + 1:
            dots = dots + queries[..., d:].float()
        return torch.einsum("bhq,bhqk->bqk", weights.float(), dots.relu_())


def indexer_loss(scores: torch.Tensor, target: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Mean over query rows of ``KL(target ‖ softmax(scores))`` over the ``visible`` entries.

    ``scores``, ``target`` (a distribution over each row's visible entries) and ``visible``
    (bool) are ``(B, Q, K)``.
    """
    # Invisible entries: -inf before the softmax, 0 after it, so 0 · (log 0 − 0) adds nothing (and no NaN
    # gradient); the clamp makes 0 · log 0 = 0 for visible entries the target gives no mass.
    log_q = scores.masked_fill(~visible, float("-inf")).log_softmax(-1).masked_fill(~visible, 0.0)
    return (target * (target.clamp_min(1e-30).log() - log_q)).sum(-1).mean()


def save_indexer(path: str | Path, indexer: LightningIndexer, meta: Mapping) -> Path:
    """Write ``indexer`` (FP16) with ``meta`` (:data:`REQUIRED_META`) atomically; its shapes go into the meta."""
    shapes = {"hidden_size": indexer.q.in_features, "kv_dim": indexer.k.in_features, "head_dim": indexer.head_dim,
              "heads": indexer.heads, "key_heads": indexer.key_heads, "offset": indexer.has_offset,
              "rotate_keys": bool(indexer.rotations), "key_copies": indexer.key_copies}
    return save_checkpoint(path, KIND, indexer, {**meta, **shapes}, REQUIRED_META)


def load_indexer(path: str | Path, rope: Callable, *, expect: Mapping) -> LightningIndexer:
    """The float32 indexer of ``path`` (eval mode, ``.meta`` attached), after the file's checks and ``expect``'s.

    ``expect`` holds what the model and layer fix (``model_id``, ``layer``, ``hidden_size``,
    ``kv_dim``, ``head_dim``): a mismatch is refused naming the file and key, before any weight is read.
    """
    state, meta = load_checkpoint(path, KIND, expect, role=None)  # a study's file: no branch of the pipeline
    indexer = LightningIndexer(meta["hidden_size"], meta["kv_dim"], meta["head_dim"], meta["heads"], rope,
                               key_heads=meta["key_heads"], offset=meta["offset"], rotate_keys=meta["rotate_keys"],
                               key_copies=meta.get("key_copies", 1))
    load_state(Path(path), indexer, state)
    indexer.eval().requires_grad_(False)
    indexer.meta = meta
    return indexer
