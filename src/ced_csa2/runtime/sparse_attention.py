"""Top-k + local-window sparse reads in the attention layers above the cut, with V4.1's layer modes and HSI.

A training-free ablation of the selection side of CSA2 (seed 002, seed 003 §4.3 and §4.7;
docs/design.md §7).  :class:`SparseAttention` is a context manager, like the K/V hooks of
:mod:`ced_csa2.kv_hooks`: while it is open, every sparse layer (:func:`~ced_csa2.runtime.layer_modes.sparse_layers`)
attends, per query position and causally, over

* its **local window**: the last ``window`` positions up to and including its own, and
* the **top-k** of the remaining visible entries, chosen as its mode says
  (:class:`~ced_csa2.runtime.layer_modes.LayerModes`): Full and Reindex layers rank them with
  their own indexer, a Reuse layer reads exactly the selection of its index source.

It composes with every Mode B runtime and with :class:`~ced_csa2.runtime.shared_kv.SharedKVCache`:
it changes only *which* of the K/V the layer is handed it attends to, so a CSA2 target
still reads ``adapter(KV_source)`` -- in teacher-forced passes and in cached generation.

**Indexer: an oracle.**  An entry's score is the selecting layer's own exact attention
logit, summed over all its query heads: ``s(t, j) = Σ_h q_h(t) · k_{g(h)}(j)`` (post-RoPE,
as the layer attends; the positive ``1/√d`` scale changes no ranking).  One selection per
query position is shared by all heads of the layer, as V4.1's indexer picks entries for
all heads at once -- and it is what makes a *Reuse* meaningful across layers whose heads
do not correspond (a CSA2 target's K is ``adapter(KV_source)``, mixing heads).  Summing
over heads is the lightning indexer's ``Σ_j w_j ReLU(q_j · k)`` with unit weights and no
ReLU; it costs one ``kv_dim``-long dot product per entry (sum the query heads of each KV
head first).  A real indexer scores narrower, cheaper keys (V4.1: 128 channels, FP4) and
is trained to imitate attention; this one reads the layer's full keys and *is* attention,
so the figures it gives are an upper bound on what a trained indexer could select.

**Or trained lightning indexers** (``indexers=``, one per selecting layer:
:class:`~ced_csa2.maps.indexer.LightningIndexer`): a layer then ranks by its indexer's score,
its keys from the pre-RoPE K the layer is handed (``k_proj``'s output, after any Mode B
injection: a CSA2 target's is ``adapter(KV_source)``) read back from MXFP4, its queries from
the layer's attention input -- both taken from ``k_proj`` in the same forward, so this needs
every position's K in that forward (teacher-forced; a cached step is refused).

**HSI** (:class:`HSI`, seed 003 §4.7): a Full layer whose KV a Reindex layer reads
max-pools its scores over blocks of ``block`` positions (aligned at position 0), keeps the
``pool_blocks`` best blocks -- the block holding the query's own (newest) position taking
one of them whenever ``newest_block`` -- and every Reindex layer reading its KV ranks only
that pool (``≤ pool_blocks · block`` positions, minus its window).  At ``pool_blocks ·
block ≥`` context the pool is every visible position.

**Exactness.**  When a layer's selection covers every entry the model's own mask lets a
query see (``k`` and ``window`` reach the whole context), the attention call is passed on
unchanged, so the output is the dense one bit for bit.  Otherwise the model's own
attention function (``sdpa`` or ``eager``) runs with its mask narrowed to the selection.

Mechanics: the model's attention calls are routed through the context
(:class:`~ced_csa2.runtime.attention_calls.AttentionCalls`), which acts on the sparse layers'
modules only and always restores the model's function on exit.  A forward starts at the lowest
sparse layer, which clears the selections of the previous one.

Limits: statistics count every query row (score unpadded batches for them); sliding-window
layers may run Full/Reindex/Reuse among layers of the same window, but not HSI across windows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..maps.indexer import LightningIndexer
from ..model_utils import Geometry, attention, rotary
from .attention_calls import AttentionCalls
from .group_runtime import GroupRuntime
from .layer_modes import LayerModes, ModeError


@dataclass(frozen=True)
class HSI:
    """The hierarchical sparse indexer's pool (seed 003 §4.7: ``block`` 8, ``pool_blocks`` 2048)."""

    block: int = 8
    pool_blocks: int = 2048
    newest_block: bool = True  # the block holding the query's own position is always in the pool

    def __post_init__(self):
        if self.block < 1 or self.pool_blocks < 1:
            raise ValueError(f"HSI block and pool_blocks must be >= 1, got {self.block} and {self.pool_blocks}")

    @property
    def max_positions(self) -> int:
        return self.block * self.pool_blocks


@dataclass(frozen=True)
class SparseReads:
    """What a sparse layer reads: ``window`` recent positions plus ``k`` selected entries (HSI optional)."""

    k: int
    window: int = 0
    hsi: HSI | None = None

    def __post_init__(self):
        if self.k < 0 or self.window < 0:
            raise ValueError(f"sparse reads need k >= 0 and window >= 0, got k={self.k}, window={self.window}")


# ----------------------------------------------------------------------------- selection (tensors)

def visible(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """``(B, Q, K)`` bool: the entries the model's own mask lets each query see.

    ``mask`` is what the attention function gets: ``None`` (causal, the queries being the
    last ``Q`` of the ``K`` positions), a bool mask (``True`` = attend) or an additive float
    mask, ``(B, 1 | heads, Q, K)``; a position visible to any head counts.
    """
    if mask is None:
        return causal(q_len, kv_len, device).expand(batch, q_len, kv_len)
    mask = mask[..., :kv_len]
    ok = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return ok.any(1).expand(batch, q_len, kv_len)


def query_positions(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Key index of each query's own position ``(Q,)``: the queries are the last ``Q`` of ``K``."""
    return torch.arange(kv_len - q_len, kv_len, device=device)


def causal(q_len: int, kv_len: int, device) -> torch.Tensor:
    """``(1, Q, K)`` bool: key ``j`` is at or before query ``i``'s position."""
    return torch.arange(kv_len, device=device)[None] <= query_positions(q_len, kv_len, device)[:, None]


def local_window(q_len: int, kv_len: int, window: int, device) -> torch.Tensor:
    """``(1, Q, K)`` bool: the last ``window`` positions up to and including each query's own."""
    j, p = torch.arange(kv_len, device=device)[None], query_positions(q_len, kv_len, device)[:, None]
    return ((j <= p) & (j > p - window))[None]


def index_scores(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The oracle indexer: ``(B, Q, K)`` float32 ``Σ_h q_h · k_{g(h)}`` over all query heads.

    ``query`` ``(B, H, Q, d)``, ``key`` ``(B, n_kv, K, d)``; head ``h`` reads KV head
    ``h // (H / n_kv)`` (transformers' ``repeat_kv``), so the query heads of each KV head
    are summed first: one ``n_kv · d``-long dot product per (query, entry).
    """
    b, h, q, d = query.shape
    n_kv = key.shape[1]
    summed = query.float().view(b, n_kv, h // n_kv, q, d).sum(2)
    return torch.einsum("bgqd,bgkd->bqk", summed, key.float())


def top_k(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, Q, K)`` bool: per query the ``k`` best-scoring candidates (all of them when there are ≤ k)."""
    if k >= scores.shape[-1]:
        return candidates.clone()
    masked = scores.masked_fill(~candidates, float("-inf"))
    values, idx = masked.topk(k, dim=-1)
    return torch.zeros_like(candidates).scatter_(-1, idx, values > float("-inf"))


def hsi_pool(scores: torch.Tensor, allowed: torch.Tensor, hsi: HSI) -> torch.Tensor:
    """``(B, Q, K)`` bool: the HSI candidate pool of each query (a Full layer's scores, seed 003 §4.7).

    Blocks of ``hsi.block`` key positions (from position 0) score the max of their visible
    entries; the ``hsi.pool_blocks`` best blocks are kept, the block holding the query's own
    position first when ``hsi.newest_block``.  Returns their visible positions: never more
    than ``pool_blocks · block``, every visible one when the blocks all fit.
    """
    b, q, kv_len = scores.shape
    n_blocks = -(-kv_len // hsi.block)
    pad = n_blocks * hsi.block - kv_len
    s = torch.nn.functional.pad(scores.masked_fill(~allowed, float("-inf")), (0, pad), value=float("-inf"))
    blocks = s.view(b, q, n_blocks, hsi.block).amax(-1)
    if hsi.newest_block:
        newest = (query_positions(q, kv_len, scores.device) // hsi.block).expand(b, q)
        blocks.scatter_(-1, newest[..., None], float("inf"))
    if hsi.pool_blocks >= n_blocks:
        kept = blocks > float("-inf")
    else:
        values, idx = blocks.topk(hsi.pool_blocks, dim=-1)
        kept = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, idx, values > float("-inf"))
    return kept.repeat_interleave(hsi.block, dim=-1)[..., :kv_len] & allowed


# ----------------------------------------------------------------------------- statistics

class SelectionStats:
    """Running sums over the query rows a :class:`SparseAttention` has served, per sparse layer.

    Per layer: ``queries``; ``visible`` (entries a dense read reads), ``read`` (entries
    read: window + selection), ``scored`` (entries its indexer ranked: 0 for Reuse),
    ``selected`` (its top-k); in :attr:`pairs`, for consecutive sparse layers ``(prev,
    layer)``, over the rows where both selections bind (more candidates than ``k``):
    ``shared`` entries, ``picked`` by ``layer``, and ``chance`` -- what two independent
    uniform ``k``-subsets of the ``N`` visible non-window entries would share (``k²/N`` a
    row); in :attr:`source_pairs` the same for each Reindex layer against its KV source
    (what reusing that layer's selection would have kept).  Reindex layers under HSI also
    count ``pool_hits`` of ``pool_wanted``: how much of their unrestricted top-k the pool holds.
    """

    def __init__(self):
        self.layer: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.pairs: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.source_pairs: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def per_token(self, key: str, layers=None) -> float:
        """``Σ_layers key / queries`` -- e.g. entries read per token over ``layers`` (default all)."""
        layers = self.layer if layers is None else layers
        return sum(self.layer[la][key] / self.layer[la]["queries"] for la in layers if self.layer[la]["queries"])

    def shared_fraction(self, pairs=None, of: dict | None = None) -> tuple[float, float] | tuple[None, None]:
        """Shared share of the picked entries over ``pairs`` of ``of`` (default: every consecutive pair),
        and its chance level; ``(None, None)`` when no row counted."""
        of = self.pairs if of is None else of
        pairs = list(of if pairs is None else pairs)
        picked = sum(of[p]["picked"] for p in pairs)
        if not picked:
            return None, None
        return sum(of[p]["shared"] for p in pairs) / picked, sum(of[p]["chance"] for p in pairs) / picked


# ----------------------------------------------------------------------------- the runtime

class SparseAttention:
    """Sparse reads in the sparse layers of ``model`` while the context is open; always restored.

    Parameters
    ----------
    model
        A HF causal LM of the Llama, Qwen3.5 or Gemma-3 family (``sdpa`` or ``eager`` attention).
    modes
        The validated :class:`~ced_csa2.runtime.layer_modes.LayerModes` of the sparse layers.
    reads
        ``k``, ``window`` and the optional :class:`HSI`.
    geo
        The model's geometry (checks HSI against sliding windows).
    stats
        A :class:`SelectionStats` to add this context's counts to (``None``: no counting).
    record
        Keep each layer's masks of the last forward in :attr:`trace` (tests): ``chosen``
        (its selection), ``window``, ``read`` (what it attended) and, for a pool maker, ``pool``.
    indexers
        ``{layer: LightningIndexer}`` for every selecting layer (Full / Reindex): rank by them
        instead of the oracle.  ``None``: the oracle.

    Examples
    --------
    >>> modes = LayerModes.build(plan, geo, "csa2", {26: 22, 30: 22})      # doctest: +SKIP
    >>> with CEDModeBRuntime(model, plan, "csa2", parts, kv_format=None), \\
    ...         SparseAttention(model, modes, SparseReads(k=128, window=64), geo):   # doctest: +SKIP
    ...     logits = model(ids).logits
    """

    def __init__(self, model: nn.Module, modes: LayerModes, reads: SparseReads, geo: Geometry, *,
                 stats: SelectionStats | None = None, record: bool = False,
                 indexers: dict[int, LightningIndexer] | None = None):
        modes.validate(geo)
        if indexers is not None:
            missing = [la for la in modes.layers if modes.selecting(la) and la not in indexers]
            if missing:
                raise ModeError(f"layers {missing} select their own entries but have no trained indexer "
                                f"(indexers given for {sorted(indexers)})")
        if reads.hsi is not None:
            for la in modes.layers:
                kv = modes.kv_source[la]
                if modes.mode(la) == "reindex" and geo.window(kv) != geo.window(la):
                    raise ModeError(f"layer {la} (window {geo.window(la)}) would search the HSI pool of layer {kv} "
                                    f"(window {geo.window(kv)}): their caches hold different positions")
        self.model, self.modes, self.reads, self.stats, self.record = model, modes, reads, stats, record
        self.indexers = indexers
        self._by_module = {attention(model, la): la for la in modes.layers}
        self._proj_io: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> k_proj's (input, output)
        self._pool_makers = set(modes.pool_sources()) if reads.hsi is not None else set()
        # Per forward: each selecting layer's top-k, each pool maker's HSI pool, the shared frames.
        self._chosen: dict[int, torch.Tensor] = {}
        self._pool: dict[int, torch.Tensor] = {}
        self._frames: dict[tuple, dict] = {}
        self._frame_of: dict[int, dict] = {}
        self.trace: dict[int, dict[str, torch.Tensor]] = {}
        self._calls = AttentionCalls(attention(model, modes.layers[0]), "sparse reads narrow the attention mask")
        self._installed = None  # the open _wrapped() context

    @property
    def layers(self) -> tuple[int, ...]:
        return self.modes.layers

    # -- installation

    @contextmanager
    def _wrapped(self) -> Iterator[None]:
        def attend(original, module, query, key, value, attention_mask, *args, **kwargs):
            layer = self._by_module.get(module)
            if layer is not None:
                attention_mask = self._narrow(layer, query, key, attention_mask)
            return original(module, query, key, value, attention_mask, *args, **kwargs)

        def keep_proj_io(layer):
            return lambda mod, inp, out: self._proj_io.__setitem__(layer, (inp[0], out))

        # Registered after any Mode B runtime's hooks (entered first): k_proj's output is then the injected K.
        handles = [attention(self.model, la).k_proj.register_forward_hook(keep_proj_io(la))
                   for la in (self.indexers or ())]
        try:
            with self._calls.routed(attend):
                yield
        finally:
            for h in handles:
                h.remove()
            self._proj_io.clear()
            self._reset()

    def __enter__(self) -> "SparseAttention":
        self._installed = self._wrapped()
        self._installed.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        installed, self._installed = self._installed, None
        if installed is not None:
            installed.__exit__(*exc)

    # -- one layer's reads

    def _frame(self, mask: torch.Tensor | None, b: int, q_len: int, kv_len: int, device) -> dict:
        """What every sparse layer of this forward shares: visible entries, windows, candidates and their counts.

        Keyed by the mask object and the shapes (the layers of one forward get the same mask).
        """
        key = (id(mask), b, q_len, kv_len)
        frame = self._frames.get(key)
        if frame is None or frame["mask"] is not mask:
            allowed = visible(mask, b, q_len, kv_len, device)
            window = local_window(q_len, kv_len, self.reads.window, device) & allowed
            candidates = allowed & ~window
            n_candidates = candidates.sum(-1)
            frame = self._frames[key] = {
                "mask": mask, "allowed": allowed, "window": window, "candidates": candidates,
                "n_candidates": n_candidates, "binding": n_candidates > self.reads.k,
                "n_visible": int(allowed.sum()), "n_window": int(window.sum())}
        return frame

    def _narrow(self, layer: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None):
        """The attention mask narrowed to ``layer``'s reads (the mask unchanged when it reads everything)."""
        modes, reads = self.modes, self.reads
        if layer == self.layers[0]:  # a new forward: earlier selections are stale
            self._reset()
        kv_len = key.shape[2]
        f = self._frame(mask, query.shape[0], query.shape[2], kv_len, query.device)
        allowed, window, candidates = f["allowed"], f["window"], f["candidates"]
        scores = scored = None
        if modes.selecting(layer):
            scores = index_scores(query, key) if self.indexers is None else self._indexer_scores(layer, query, key)
            if modes.mode(layer) == "reindex" and reads.hsi is not None:
                scored = candidates & self._stored(self._pool, modes.kv_source[layer], layer, allowed.shape, "HSI pool")
            chosen = top_k(scores, candidates if scored is None else scored, reads.k)
            if layer in self._pool_makers:
                self._pool[layer] = hsi_pool(scores, allowed, reads.hsi)
            self._chosen[layer] = chosen
        else:
            chosen = self._stored(self._chosen, modes.index_source[layer], layer, allowed.shape, "selection") & allowed
        self._frame_of[layer] = f
        n_chosen = int(chosen.sum())
        if self.stats is not None:
            self._count(layer, f, chosen, n_chosen, scored, scores)
        read = window | chosen  # chosen ⊆ candidates: disjoint from the window
        if self.record:
            self.trace[layer] = {"chosen": chosen, "window": window, "read": read, "allowed": allowed,
                                 **({"pool": self._pool[layer]} if layer in self._pool else {})}
        if f["n_window"] + n_chosen == f["n_visible"]:
            return mask  # it reads every entry it may see: the dense call, bit for bit
        narrowed = read[:, None]  # (B, 1, Q, K): one selection for all heads
        if mask is None:
            mask = torch.ones((), dtype=torch.bool) if self._calls.impl == "sdpa" else torch.zeros((), dtype=query.dtype)
        elif mask.shape[-1] > kv_len:  # a mask wider than the keys (padding of a static cache): nothing read there
            narrowed = torch.nn.functional.pad(narrowed, (0, mask.shape[-1] - kv_len))
        mask = mask.to(query.device)
        if mask.dtype == torch.bool:
            return mask & narrowed
        return torch.where(narrowed, mask, torch.finfo(mask.dtype).min)

    def _indexer_scores(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """``(B, Q, K)`` scores of ``layer``'s trained indexer over the ``K`` entries it is handed."""
        x, k = self._proj_io.pop(layer, (None, None))
        if k is None or k.shape[1] != key.shape[2]:
            raise RuntimeError(f"layer {layer}'s trained indexer ranks {key.shape[2]} entries but this forward's "
                               f"k_proj gave {0 if k is None else k.shape[1]}: trained selection needs every "
                               "position in one forward (teacher-forced, no cache)")
        indexer, q_len = self.indexers[layer], query.shape[2]
        cos, sin = rotary(self.model, layer, x, torch.arange(k.shape[1], device=k.device)[None])
        keys = indexer.stored_keys(k.float(), cos.float(), sin.float())
        queries, weights = indexer.queries(x[:, -q_len:].float(), cos[:, -q_len:].float(), sin[:, -q_len:].float())
        return LightningIndexer.scores(queries, weights, keys)

    def _reset(self) -> None:
        for store in (self._chosen, self._pool, self._frames, self._frame_of):
            store.clear()

    def _stored(self, store: dict, source: int, layer: int, shape, what: str) -> torch.Tensor:
        got = store.get(source)
        if got is None or got.shape != shape:
            raise RuntimeError(f"layer {layer} reads the {what} of layer {source}, which made none for this forward "
                               f"(expected shape {tuple(shape)}); run the layers in order within one forward")
        return got

    def _count(self, layer: int, f: dict, chosen: torch.Tensor, n_chosen: int, scored, scores) -> None:
        s = self.stats.layer[layer]
        s["queries"] += f["allowed"].shape[0] * f["allowed"].shape[1]
        s["visible"] += f["n_visible"]
        s["read"] += f["n_window"] + n_chosen
        s["selected"] += n_chosen
        if self.modes.selecting(layer):
            s["scored"] += int(f["n_candidates"].sum()) if scored is None else int(scored.sum())
        if scored is not None:  # Reindex under HSI: how much of its unrestricted top-k the pool holds
            free = top_k(scores, f["candidates"], self.reads.k)
            s["pool_hits"] += int((free & scored).sum())
            s["pool_wanted"] += int(free.sum())
        i = self.layers.index(layer)
        if i:
            self._overlap(self.stats.pairs, self.layers[i - 1], layer, chosen, f)
        if self.modes.mode(layer) == "reindex":  # what a Reuse of its KV source would have read instead
            self._overlap(self.stats.source_pairs, self.modes.kv_source[layer], layer, chosen, f)

    def _overlap(self, pairs: dict, other: int, layer: int, chosen: torch.Tensor, f: dict) -> None:
        """Add how many of ``layer``'s picks ``other`` (its selection, or the one it reused) picked too."""
        theirs = self._chosen.get(self.modes.index_source[other])
        if theirs is None or theirs.shape != chosen.shape:
            return
        both = f["binding"] & self._frame_of[other]["binding"]
        if not bool(both.any()):
            return
        p = pairs[(other, layer)]
        picked = chosen.sum(-1)[both].double()
        p["rows"] += int(both.sum())
        p["picked"] += float(picked.sum())
        p["shared"] += int((chosen & theirs).sum(-1)[both].sum())
        p["chance"] += float((picked * theirs.sum(-1)[both] / f["n_candidates"][both]).sum())

class SparseGroup(GroupRuntime):
    """A Mode B group's runtime with sparse reads on top: one context, scored like a group.

    ``runtime`` (a :class:`~ced_csa2.ced_runtime.CEDModeBRuntime`) supplies the K/V -- its
    own for ``baseline``, ``adapter(KV_source)`` for the targets under ``csa2`` -- and
    ``sparse`` narrows what the sparse layers read of them.  A
    :class:`~ced_csa2.runtime.group_runtime.GroupRuntime` (:func:`ced_csa2.eval.scoring.multi_group_nll`'s
    ``extra=``): its first changed layer is the lowest sparse layer, so the shared trunk runs the layers below
    it once.
    """

    def __init__(self, runtime, sparse: SparseAttention):
        self.runtime, self.sparse, self.spec = runtime, sparse, runtime.spec

    @property
    def replaced_layers(self) -> tuple[int, ...]:
        """Every layer whose output differs from the plain model's from here on (for the branch point)."""
        return tuple(sorted({*self.runtime.replaced_layers, *self.sparse.layers}))

    def seed(self, **kwargs) -> None:
        self.runtime.seed(**kwargs)

    def __enter__(self) -> "SparseGroup":
        self.runtime.__enter__()
        try:
            self.sparse.__enter__()
        except BaseException:
            self.runtime.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.sparse.__exit__(*exc)
        finally:
            self.runtime.__exit__(*exc)
