"""Greedy generation through the cache that holds each group's bytes, judged by what it generates.

Every other figure of the pipeline is teacher-forced under :class:`~ced_csa2.ced_runtime.CEDModeBRuntime`,
whose K/V substitution leaves every layer an ordinary cache, and counts bytes by formula
(:mod:`ced_csa2.kv.kv_bytes`).  Here each group decodes through the cache that really holds its
bytes (:func:`group_cache`, the one place that builds it, from the group's
:attr:`~ced_csa2.groups.Group.cache_kind` and ``rotate``):

* ``ordinary`` (``baseline``, ``ced``) -- ``DynamicCache``; for ``ced`` under Mode B's ``ced``
  runtime, so the source's K/V in it come from the projector: CED saves compute, not bytes, so
  its cache is the ordinary one;
* ``shared_store`` (``share_plain``, ``csa2``, ``ced_csa2``, ``ced_csa2_sink``) --
  :class:`~ced_csa2.runtime.shared_kv.SharedKVCache` with storage ``"bf16"``, which there means
  *the model's own dtype* in plain tensors (float32 on an fp32 model, bf16 on a bf16 one); a sink
  group's targets also hold their own K/V at each sequence's first positions;
* ``shared_store`` with ``fp4 = shared_source`` (``csa2_fp4``, ``ced_csa2_fp4``) --
  ``SharedKVCache(storage=kv_format)``: the one shared source entry in FP4 blocks, pre-k_norm and
  pre-RoPE, exactly what Mode B's FP4 groups round;
* the same, ``rotate`` (``csa2_fp4_rot``, ``ced_csa2_fp4_rot``) --
  ``SharedKVCache(storage=kv_format, rotate=True)``: that entry stored as the FP4 blocks of
  ``R x`` per head (the source layer's fixed randomised Hadamard ``R``, a weight) and read as
  ``Rᵀ dequant(.)``, exactly what Mode B's rotated groups round; the unrotated twin's bytes;
* ``fp4_every_layer`` (``baseline_fp4``; ``baseline_fp4_rot`` with ``rotate=True``) --
  :class:`~ced_csa2.runtime.shared_kv.FP4KVCache` (``kv_format``);
* ``formats_every_layer`` (``baseline_k6v4_rot``) -- :class:`~ced_csa2.runtime.shared_kv.BlockKVCache`
  of the group's own ``stream_formats`` (K in FP6, V in MXFP4, both rotated; not ``kv_format``);
* ``low_rank`` (``xkv``) -- :class:`~ced_csa2.runtime.low_rank_kv.LowRankKVCache`: ``xkv.rank``
  coefficients per token for K and for V stand for the group layers' entries.  Each forward's own
  chunk attends its exact entries and is compressed at the end of the forward (the causality
  choice, documented there), so its tokens are not the teacher-forced ``xkv``'s.

``baseline_fp4``'s, ``baseline_fp4_rot``'s and ``baseline_k6v4_rot``'s real caches are not their
teacher-forced twins: :class:`FP4KVCache` and :class:`BlockKVCache` quantise what a ``DynamicLayer``
holds (K after k_norm and RoPE), while Mode B quantises K before them, as the shared store does.  Same bytes, other roundings of K (V, which
has neither, is rounded as Mode B rounds it, rotated or not).

Mode A (:func:`mode_a_generation`): :meth:`CEDModeARuntime.prefill <ced_csa2.ced_runtime.CEDModeARuntime.prefill>`
returns an ordinary ``DynamicCache`` (every attention layer's entries, those above the cut
written from the maps), and decoding continues on it: Mode A saves prefill compute, not bytes.

Each run's bytes after the last step (:func:`~ced_csa2.runtime.shared_kv.cache_bytes`, *used*
and *allocated*) are checked against the accounting
(:func:`~ced_csa2.runtime.shared_kv.accounted_copies`) to the byte (:func:`check_bytes`).
:func:`fidelity` compares each group's tokens with the baseline's greedy continuation of the
same prompts: tokens before the first divergence, agreement position by position, and
*plausibility* -- the plain model's NLL per token of the group's continuation minus that of
its own -- with paired bootstrap 95% intervals over prompts (:mod:`ced_csa2.eval.stats`).
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from .. import kv_hooks
from ..ced_runtime import CEDModeARuntime, CEDModeBRuntime, CEDParts, continue_hidden, parts_for, plain_prefill
from ..kv.formats import FP4_FORMATS, group_format
from ..kv.kv_bytes import bytes_per_token
from ..data.records import seeded_subset
from ..model_utils import geometry
from ..pipeline.progress import Progress
from ..pipeline.timing import MIN_REPEATS, Paired, paired_seconds
from ..plan import LayerPlan
from ..groups import GROUPS, Group
from ..groups import group as lookup_group
from ..runtime.low_rank_kv import LowRankKVCache
from ..runtime.shared_kv import (
    BlockKVCache,
    CacheBytes,
    FP4KVCache,
    SharedKVCache,
    accounted_copies,
    cache_bytes,
    greedy_generate,
)
from . import stats
from .scoring import branch_point, head_logits, score_hidden

MODE_A = "mode_a"  # the label of Mode A's run (not a group: the prefill skip over the plain cache)


def cache_refusal(group: str) -> str | None:
    """Why ``group`` has no cache holding its bytes yet (one clause), or ``None`` when it has one (every
    registered group has one now; an unknown group is refused)."""
    lookup_group(group)
    return None


def supported_groups() -> tuple[str, ...]:
    """The groups :func:`group_cache` builds a cache for, in registry order."""
    return tuple(name for name in GROUPS if cache_refusal(name) is None)


def _dense_twin(spec: Group) -> str:
    """The group that maps, shares and keeps as ``spec`` does, with no FP4 or block-format entries
    (``csa2_fp4`` -> ``csa2``)."""
    return next(name for name, g in GROUPS.items()
                if g.layout == spec.layout and g.sink == spec.sink and not g.is_fp4 and g.stream_formats is None)


@dataclass
class GroupCache:
    """The cache that holds one group's bytes, and what must be open around every forward through it.

    Attributes
    ----------
    group
        The group (or :data:`MODE_A`).
    cache
        A fresh ``DynamicCache``, :class:`SharedKVCache`, :class:`FP4KVCache` (rotated or not) or
        :class:`BlockKVCache`.
    open
        A fresh context manager to run forwards in, at each call: opened once around a whole
        decode, or around each step (:func:`run_groups`, where groups alternate): the
        shared store's :meth:`~ced_csa2.runtime.shared_kv.SharedKVCache.feed`, or the Mode B
        runtime of the group's dense twin (a no-op for ``baseline``, the projector for ``ced``).
    storage
        What the accounting calls its entries (:func:`accounted_copies`): ``"bf16"`` (the model's
        dtype; for a group with its own ``stream_formats``, no FP4 storage: they fix its entries) or
        the FP4 format.
    kind
        The cache in words, for tables: ``"DynamicCache"``, ``"SharedKVCache(nvfp4)"``,
        ``"SharedKVCache(nvfp4, rotated)"``, ``"FP4KVCache"``, ``"FP4KVCache(rotated)"``,
        ``"BlockKVCache(k fp6/32 rotated, v mxfp4/32 rotated)"``, ``"LowRankKVCache(rank 16)"``, ...
    rank
        Coefficients per token for K and for V of a low-rank cache (the accounting's ``rank``); ``None``: none.
    branch
        The first layer (1-based) whose forward through this cache, inside ``open()``, may differ from
        the plain model's forward through a ``DynamicCache``: below it the hooks capture at most
        ``H_split`` and the source's K/V (what :meth:`~ced_csa2.runtime.group_runtime.GroupRuntime.seed`
        hands a runtime) and the cache stores what a ``DynamicCache`` stores.  ``n_layers + 1`` for
        ``baseline``; 1 where no layer is known to be plain (the every-layer FP4 and block caches, the
        low-rank cache).
    """

    group: str
    cache: Cache
    open: Callable[[], AbstractContextManager]
    storage: str
    kind: str
    rank: int | None = None
    branch: int = 1


def group_cache(model: nn.Module, plan: LayerPlan, group: str, parts: CEDParts | None,
                kv_format: str | None) -> GroupCache:
    """The cache that holds ``group``'s bytes: its :attr:`~ced_csa2.groups.Group.cache_kind`, rotated when the
    group is (the module's table).

    Parameters
    ----------
    model, plan, parts
        As for :class:`~ced_csa2.ced_runtime.CEDModeBRuntime` (``parts``: the maps the group reads).
    group
        A group of :data:`~ced_csa2.groups.GROUPS`.
    kv_format
        The FP4 format of an FP4 group (``nvfp4`` | ``mxfp4``); ignored by the others.

    Raises
    ------
    ValueError
        One line naming the group: unknown, without a cache yet (:func:`cache_refusal`), an FP4
        group without a valid ``kv_format``, or the maps it needs missing.
    """
    spec = lookup_group(group)
    reason = cache_refusal(group)
    if reason is not None:
        raise ValueError(f"group {group!r} cannot be decoded through the cache that holds its bytes: {reason}")
    if spec.is_fp4 and kv_format not in FP4_FORMATS:
        raise ValueError(f"group {group!r} stores FP4 entries and needs kv_format in {list(FP4_FORMATS)}, "
                         f"got {kv_format!r}")
    storage = kv_format if spec.is_fp4 else "bf16"
    twin = _dense_twin(spec)
    if spec.cache_kind == "low_rank":  # the group's layers store coefficients, every other layer its own entries
        cache = LowRankKVCache(model, plan, parts)
        return GroupCache(group, cache, cache.feed, storage, f"LowRankKVCache(rank {cache.rank})", cache.rank)
    if spec.cache_kind == "shared_store":  # the source stores once (FP4 or not, rotated or not), the targets nothing
        cache = SharedKVCache(model, plan, twin, parts, storage=storage, rotate=spec.rotate)
        # feed() hooks the source layer, and the projector's runtime (seeded: SharedKVCache.seed) from the split up
        branch = plan.source
        if spec.projected_source:
            branch = min(branch, branch_point(CEDModeBRuntime(model, plan, "ced", parts, kv_format=None),
                                              len(model.model.layers)))
        return GroupCache(group, cache, cache.feed, storage, f"SharedKVCache({storage}{', rotated' if spec.rotate else ''})",
                          branch=branch)
    # Every layer stores its own entry: ordinary, or FP4 / block formats everywhere; the projector (ced) changes compute only.
    if spec.cache_kind == "fp4_every_layer":
        cache = FP4KVCache(model.config, storage, rotate=spec.rotate)
        kind = "FP4KVCache(rotated)" if spec.rotate else "FP4KVCache"
    elif spec.cache_kind == "formats_every_layer":
        cache = BlockKVCache(model.config, group_format(spec))
        kind = "BlockKVCache({})".format(", ".join(
            f"{stream} {s.element}/{s.group}{' rotated' if s.rotate else ''}"
            for stream, s in zip("kv", spec.stream_formats)))
    else:
        cache, kind = DynamicCache(config=model.config), "DynamicCache"
    runtime = CEDModeBRuntime(model, plan, twin, parts, kv_format=None)
    # An ordinary cache under Mode B: the runtime's branch point, as the shared trunk of scoring takes it
    branch = branch_point(runtime, len(model.model.layers)) if kind == "DynamicCache" else 1
    return GroupCache(group, cache, lambda: runtime, storage, kind, branch=branch)  # the runtime re-enters


# ----------------------------------------------------------------------------- the shared prefill


def next_logits(model: nn.Module, cache: Cache, ids: torch.Tensor) -> torch.Tensor:
    """The logits ``(B, vocab)`` after feeding ``ids`` ``(B, t)`` through ``cache`` (the caller opened its context)."""
    return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


class PromptTrunk:
    """One batch of prompts prefilled by the plain model once, so that each group's cache starts at its branch.

    The plain model prefills ``prompts`` ``(B, T)`` through a ``DynamicCache``, recording what its forward
    hands each decoder layer, the hidden state entering each layer of ``branches``, ``H_split`` and the
    source's K/V (:mod:`ced_csa2.kv_hooks`).  :meth:`prefill` then fills one group's fresh cache.

    Parameters
    ----------
    model, plan
        The HF causal LM (no runtime open) and the layer plan.
    branches
        The :attr:`GroupCache.branch` of every cache to fill.
    prompts : torch.Tensor, shape (B, T)
        Unpadded prompts.
    """

    @torch.inference_mode()
    def __init__(self, model: nn.Module, plan: LayerPlan, branches: Iterable[int], prompts: torch.Tensor):
        self.model, self.plan, self.prompts, self.n = model, plan, prompts, len(model.model.layers)
        self.cache = DynamicCache(config=model.config)
        with kv_hooks.layer_calls(model, None, sorted({b for b in branches if 1 < b <= self.n})) as self.calls, \
                kv_hooks.capture(model, [plan.source], [plan.split]) as self.captured:
            self.logits = next_logits(model, self.cache, prompts)

    @torch.inference_mode()
    def prefill(self, built: GroupCache) -> torch.Tensor:
        """Fill ``built``'s fresh cache with the prompts; the logits after their last position ``(B, vocab)``.

        The cache takes the trunk's entries of the layers below its branch (the tensors a ``DynamicCache``
        stores), and inside its context (a runtime or a shared store, seeded with what the skipped layers'
        hooks would have captured) runs its layers from the branch on and the LM head: the same ops on the
        same inputs as its own whole prefill, so the same logits and entries to the bit.  A cache whose
        branch is layer 1, or whose layers below it are not the trunk's ``DynamicLayer`` s, prefills whole.
        """
        model, plan, n, trunk = self.model, self.plan, self.n, self.cache
        below = min(built.branch, n + 1) - 1
        if not all(type(trunk.layers[i]) is type(built.cache.layers[i]) is DynamicLayer for i in range(below)):
            below = 0
        for i in range(below):
            built.cache.layers[i].update(trunk.layers[i].keys, trunk.layers[i].values)
        with built.open() as context:
            if below == n:  # the plain model's forward: the trunk's own logits
                return self.logits
            if below == 0:
                return next_logits(model, built.cache, self.prompts)
            # a runtime or a shared store: what the hooks of the layers skipped would have captured
            context.seed(h_split=self.captured["h"][plan.split] if plan.split <= below else None,
                         source_kv=(self.captured["k"][plan.source], self.captured["v"][plan.source])
                         if plan.source <= below else None)
            hidden = kv_hooks.run_layers(model, self.calls["inputs"][below + 1], below + 1, self.calls,
                                         fresh_cache=False, cache=built.cache)
            return head_logits(model, hidden[:, -1:])[:, -1]  # as logits_to_keep=1 slices


def runs_protocol(plan: LayerPlan, mode_a, covered: bool) -> dict:
    """What a stage that runs every group through its own cache records of what ran: the plan, Mode A's
    settings (``mode_a``: a dict; or why it did not run) and the groups without such a cache, with why."""
    return {"plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets)},
            "mode_a": mode_a if covered else "not run: the plan does not cover every attention layer above the cut",
            "not_run": {g: cache_refusal(g) for g in GROUPS if cache_refusal(g)}}


# ----------------------------------------------------------------------------- decoding


@dataclass
class GroupGeneration:
    """One group's greedy continuation of a batch and its cache's bytes after the last step.

    Attributes
    ----------
    group
        The group, or :data:`MODE_A`.
    tokens : torch.Tensor, shape (B, N)
        The generated tokens.
    bytes : CacheBytes
        The cache's K/V bytes after the last step (``B · positions`` entries per stored copy).
    positions
        Positions the cache holds: ``T + N - 1`` (the last token is never fed back).
    accounted
        The accounting's bytes for the same cache (:func:`accounted_used_bytes`); equal to
        ``bytes.used`` (:func:`check_bytes` refuses otherwise).
    kind
        The cache in words (:attr:`GroupCache.kind`).
    """

    group: str
    tokens: torch.Tensor
    bytes: CacheBytes
    positions: int
    accounted: int
    kind: str

    @property
    def used_per_token(self) -> float:
        """Bytes used per cached position and prompt."""
        return self.bytes.used / (self.tokens.shape[0] * self.positions)

    @property
    def allocated_per_token(self) -> float:
        """Bytes allocated per cached position and prompt."""
        return self.bytes.allocated / (self.tokens.shape[0] * self.positions)


def check_prompts(model: nn.Module, prompts: torch.Tensor, new_tokens: int, min_prompt: int = 1) -> None:
    """Refuse, in one line, prompts that are not ``(B, T)`` token ids with ``T >= min_prompt``, ``new_tokens < 1``,
    or ``T + new_tokens - 1`` positions beyond the model's window (``max_position_embeddings``)."""
    if prompts.dim() != 2 or prompts.shape[0] < 1 or prompts.shape[1] < min_prompt or prompts.is_floating_point():
        raise ValueError(f"generation needs prompts of token ids (B, T) with B >= 1 and T >= {min_prompt}, got "
                         f"{prompts.dtype} {tuple(prompts.shape)}")
    if new_tokens < 1:
        raise ValueError(f"generation needs new_tokens >= 1, got {new_tokens}")
    check_window(model.config, prompts.shape[1], new_tokens)


def check_window(config, prompt_tokens: int, new_tokens: int) -> None:
    """Refuse, in one line, ``prompt_tokens + new_tokens - 1`` cached positions beyond the model's window."""
    window = getattr(config.get_text_config(), "max_position_embeddings", None)
    if window is not None and prompt_tokens + new_tokens - 1 > window:
        raise ValueError(f"a prompt of {prompt_tokens} tokens and {new_tokens} new tokens needs "
                         f"{prompt_tokens + new_tokens - 1} positions; the model's window is {window}")


def accounted_used_bytes(model: nn.Module, plan: LayerPlan, group: str, storage: str, batch: int,
                         positions: int, rank: int | None = None) -> int:
    """The accounting's bytes of a cache holding ``positions`` positions of ``batch`` prompts: every stored
    copy (:func:`accounted_copies`, the ``all_attention`` basis, the model's dtype; ``rank``: a low-rank
    group's coefficients per token) at that context."""
    copies = accounted_copies(geometry(model.config), plan, group, storage, model.dtype.itemsize, rank=rank)
    return round(batch * positions * bytes_per_token(copies, positions))


def check_bytes(run: GroupGeneration) -> GroupGeneration:
    """``run`` when its cache's used bytes are the accounting's to the byte; else a one-line error naming it."""
    if run.bytes.used != run.accounted:
        b = run.tokens.shape[0] * run.positions
        raise RuntimeError(f"group {run.group!r}: its {run.kind} holds {run.bytes.used} B of K/V entries after the "
                           f"last step ({run.bytes.used / b:g} B/token), the accounting says {run.accounted} B "
                           f"({run.accounted / b:g} B/token)")
    return run


def generate(model: nn.Module, plan: LayerPlan, group: str, parts: CEDParts | None, prompts: torch.Tensor,
             new_tokens: int, kv_format: str | None) -> GroupGeneration:
    """Greedy decoding of ``prompts`` ``(B, T)`` (equal lengths, no padding) for ``new_tokens`` tokens through
    ``group``'s cache (:func:`group_cache`), its bytes checked against the accounting (:func:`check_bytes`).

    Returns
    -------
    GroupGeneration
        ``tokens`` ``(B, new_tokens)``; the cache's bytes after the last step.
    """
    check_prompts(model, prompts, new_tokens)
    built = group_cache(model, plan, group, parts, kv_format)
    with built.open():
        out = greedy_generate(model, prompts, new_tokens, built.cache)
    return checked_run(model, plan, group, group, built.storage, out.tokens, built.cache, built.kind, rank=built.rank)


def mode_a_generation(model: nn.Module, plan: LayerPlan, parts: CEDParts, prompts: torch.Tensor, new_tokens: int,
                      *, replay: int = 0, sink: str = "none") -> GroupGeneration:
    """Greedy decoding after Mode A's prefill skip: ``prompts[:, :-1]`` ``(B, T - 1)`` prefilled by
    :class:`~ced_csa2.ced_runtime.CEDModeARuntime` (``replay``, ``sink`` as there), then the prompt's last
    token and ``new_tokens - 1`` generated ones through every layer.

    The prefill returns an ordinary ``DynamicCache`` and decoding continues on it: its bytes are
    the baseline's (checked against ``baseline``'s accounting).  Needs a covering plan and ``T >= 2``.
    """
    check_prompts(model, prompts, new_tokens, min_prompt=2)
    runtime = CEDModeARuntime(model, plan, geometry(model.config), parts, replay=replay, sink=sink)
    cache = runtime.prefill(prompts[:, :-1])
    out = greedy_generate(model, prompts[:, -1:], new_tokens, cache)
    return checked_run(model, plan, MODE_A, "baseline", "bf16", out.tokens, cache, type(cache).__name__)


def checked_run(model, plan, label: str, accounted_as: str, storage: str, tokens: torch.Tensor, cache: Cache,
                kind: str, rank: int | None = None) -> GroupGeneration:
    """``tokens`` ``(B, N)`` and ``cache``'s bytes after them as a :class:`GroupGeneration`, checked against
    ``accounted_as``'s accounting in ``storage`` (:func:`check_bytes`; ``rank``: :attr:`GroupCache.rank`)."""
    positions = cache.get_seq_length()
    run = GroupGeneration(label, tokens, cache_bytes(cache), positions,
                          accounted_used_bytes(model, plan, accounted_as, storage, tokens.shape[0], positions, rank),
                          kind)
    return check_bytes(run)


# ----------------------------------------------------------------------------- decode step time


class StepDecoder:
    """One cache's greedy decode, a forward per call: :meth:`prefill` (or :meth:`start`) once, then :meth:`step`,
    each forward inside a fresh ``open()`` (so that decoders of several groups can alternate on one model).

    Parameters
    ----------
    model
        The HF causal LM.
    cache
        The cache to decode through.
    open
        Returns the context manager a forward through ``cache`` runs in (:attr:`GroupCache.open`).
    """

    def __init__(self, model: nn.Module, cache: Cache, open: Callable[[], AbstractContextManager]):
        self.model, self.cache, self.open, self.chosen = model, cache, open, []

    @property
    def x(self) -> torch.Tensor:
        """The last token chosen ``(B, 1)``: the next step's input."""
        return self.chosen[-1]

    @property
    def tokens(self) -> torch.Tensor:
        """Every token chosen so far ``(B, n)``, the first from the prefill's logits."""
        return torch.cat(self.chosen, dim=1)

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor) -> None:
        with self.open():
            logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits
        self.chosen.append(logits[:, -1:].argmax(-1))

    def prefill(self, ids: torch.Tensor) -> None:
        """``ids`` ``(B, T)`` into the cache; each row's greedy next token is the first step's input."""
        self._forward(ids)

    def start(self, logits: torch.Tensor) -> None:
        """Begin from a cache filled elsewhere (:meth:`PromptTrunk.prefill`): ``logits`` ``(B, vocab)`` after
        its last position choose the first step's input."""
        self.chosen.append(logits.argmax(-1, keepdim=True))

    def step(self) -> None:
        """One greedy decode step: the last token in, the next one chosen."""
        self._forward(self.x)


def decode_alternated(decoders: Mapping[str, StepDecoder], steps: int, device: torch.device) -> Paired | None:
    """``steps`` greedy decode steps of every decoder, the decoders alternated step by step; their step times.

    With two or more decoders and ``steps >= MIN_REPEATS + 1`` the loop is
    :func:`~ced_csa2.pipeline.timing.paired_seconds`' (the first step of each untimed, then ``steps - 1`` rounds
    of one step per decoder in an order rotated each round, each decoder's median); otherwise the steps run
    untimed and ``None`` is returned.  Either way each decoder's own steps run in order on its own cache, so
    its tokens are those of decoding it alone.
    """
    with Progress(total=steps * len(decoders), desc="decode", unit="step") as bar:
        if len(decoders) >= 2 and steps - 1 >= MIN_REPEATS:
            return paired_seconds({label: d.step for label, d in decoders.items()}, steps - 1, device=device,
                                  setup=bar.update)  # the bar moves untimed, before each step
        for _ in range(steps):
            for d in decoders.values():
                bar.update()
                d.step()
    return None


# ----------------------------------------------------------------------------- fidelity


def first_divergence(tokens: torch.Tensor, base: torch.Tensor) -> np.ndarray:
    """Per prompt, the tokens ``tokens`` ``(B, N)`` share with ``base`` ``(B, N)`` before the first that differs
    (``N`` when none does): ``(B,)`` int."""
    return (tokens == base).int().cumprod(1).sum(1).cpu().numpy()


def mean_ci(values: np.ndarray, *, seed: int) -> dict:
    """Mean of per-prompt ``values`` ``(R,)`` and its bootstrap 95% interval over prompts
    (:func:`~ced_csa2.eval.stats.ratio_bootstrap`: the same seed draws the same prompts as every other figure)."""
    values = np.asarray(values, dtype=np.float64)
    return stats.ratio_bootstrap(values, np.ones_like(values), seed=seed)


def median_ci(values: np.ndarray, *, seed: int, n_boot: int = 2000) -> dict:
    """Median of per-prompt ``values`` ``(R,)`` and its bootstrap 95% interval over prompts (the resamples of
    :func:`mean_ci`'s, by the same seed)."""
    values = np.asarray(values, dtype=np.float64)
    # stats' percentile bootstrap over record resamples, with the median as its statistic
    return stats.bootstrap(lambda idx: np.median(values[idx], axis=-1), len(values), n_boot, seed, 0.95)


@torch.inference_mode()
def continuation_nlls(model: nn.Module, prompts: torch.Tensor, runs: Mapping[str, torch.Tensor],
                      batch_size: int) -> dict[str, np.ndarray]:
    """Per label of ``runs`` (``{label: tokens (B, N)}``), the plain model's summed NLL of each continuation after
    its prompt (``prompts`` ``(B, T)``, ``T >= 2``), teacher-forced, and its token count: ``(B, 2)`` float64.

    Each batch of ``batch_size`` prompts is prefilled once (:func:`~ced_csa2.ced_runtime.plain_prefill`, all but
    the last token) and every label's continuation is scored on a copy of that cache
    (:func:`~ced_csa2.ced_runtime.continue_hidden`): the prompts' positions run once, not once per label.
    Call with no runtime hooks installed.
    """
    out = {label: torch.zeros(len(prompts), 2, dtype=torch.float64) for label in runs}
    for start in range(0, len(prompts), batch_size):
        x = prompts[start:start + batch_size]
        cache = plain_prefill(model, x[:, :-1])
        for label, tokens in runs.items():
            t = tokens[start:start + len(x)].to(x.device)
            hidden = continue_hidden(model, copy.deepcopy(cache), x, t)
            score_hidden(model, {label: out[label]}, start, {label: hidden}, t, torch.ones_like(t, dtype=torch.bool))
    return {label: o.numpy() for label, o in out.items()}


def fidelity(model: nn.Module, prompts: torch.Tensor, runs: Mapping[str, torch.Tensor], *, base: str = "baseline",
             seed: int, batch_size: int = 8) -> dict[str, dict]:
    """Each run's continuation against ``base``'s, per prompt, summarised with paired bootstrap 95% CIs over prompts.

    Parameters
    ----------
    model
        The unmodified model (no runtime open): it scores every continuation teacher-forced.
    prompts : torch.Tensor, shape (B, T)
        The prompts all runs continued.
    runs
        ``{label: tokens (B, N)}``, ``base`` among them.
    seed
        The bootstrap's seed (the same prompts drawn for every figure).
    batch_size
        Prompts prefilled together, every run's continuations then scored on that prefill (:func:`continuation_nlls`).

    Returns
    -------
    dict
        Per label: ``first_divergence`` (``mean`` and ``median``, each ``{"value", "ci95", ...}``, and
        ``per_prompt``: tokens before the first that differs from ``base``'s, ``N`` if none);
        ``agreement`` (``mean`` over positions and prompts with its CI; ``by_position`` and
        ``by_position_ci95``: the fraction of prompts whose token ``i = 1..N`` is ``base``'s);
        ``delta_nll`` (the plain model's NLL per token of the label's continuation minus of
        ``base``'s, nats, :func:`~ced_csa2.eval.stats.paired_bootstrap`; ``per_prompt``).
    """
    if base not in runs:
        raise ValueError(f"fidelity needs the reference run {base!r} among {list(runs)}")
    ref = runs[base]
    shapes = {label: tuple(t.shape) for label, t in runs.items() if t.shape != ref.shape}
    if shapes or ref.shape[0] != prompts.shape[0]:
        raise ValueError(f"fidelity needs every run's tokens {tuple(ref.shape)} for the {prompts.shape[0]} prompts; "
                         f"got {shapes or tuple(ref.shape)}")
    n = ref.shape[1]
    nll = continuation_nlls(model, prompts, runs, batch_size)
    out = {}
    for label, tokens in runs.items():
        first = first_divergence(tokens, ref)
        agree = (tokens == ref).double().cpu().numpy()  # (B, N)
        ones = np.ones(len(agree))
        positions = [stats.ratio_bootstrap(agree[:, i], ones, seed=seed) for i in range(n)]
        delta = stats.paired_bootstrap(nll[label], nll[base], "delta_nll", seed=seed)
        out[label] = {
            "first_divergence": {"mean": mean_ci(first, seed=seed), "median": median_ci(first, seed=seed),
                                 "per_prompt": first.tolist()},
            "agreement": {"mean": stats.ratio_bootstrap(agree.sum(1), n * ones, seed=seed),
                          "by_position": [p["value"] for p in positions],
                          "by_position_ci95": [p["ci95"] for p in positions]},
            "delta_nll": {**delta, "per_prompt": ((nll[label][:, 0] - nll[base][:, 0]) / n).tolist()},
        }
    return out


@dataclass
class DecodedGroups:
    """What :func:`run_groups` decoded.

    Attributes
    ----------
    runs
        ``{label: GroupGeneration}``, the groups' in their order, then :data:`MODE_A`'s if it ran.
    step_seconds
        The decode step times of the first batch's groups, alternated step by step (:func:`decode_alternated`;
        ``None`` for fewer than two groups or ``MIN_REPEATS + 2`` new tokens): a timing, never a metric.
    """

    runs: dict[str, GroupGeneration]
    step_seconds: Paired | None


def run_groups(model: nn.Module, plan: LayerPlan, groups, parts: CEDParts | Mapping[str, CEDParts] | None,
               prompts: torch.Tensor, new_tokens: int, kv_format: str | None, *,
               mode_a: CEDParts | None = None, replay: int = 0, sink: str = "none",
               batch_size: int | None = None) -> DecodedGroups:
    """:func:`generate` for each of ``groups`` (and :func:`mode_a_generation` with ``mode_a``'s maps, if given),
    ``batch_size`` prompts at a time (``None``: all at once); the batches' tokens joined and bytes added up.

    Each batch's prompts are prefilled once below the groups' branch layers (:class:`PromptTrunk`: the
    same logits and entries to the bit as each group's own prefill), then the groups decode through their
    caches alternated step by step (:func:`decode_alternated`): each group's tokens are its own decode's, and
    the steps are the decode step timing, every group at the same context length in each round, so the
    timing costs no step of its own.  All of one batch's caches are held at once.  ``parts``: one set of
    maps for every group, or ``{group: CEDParts}``.
    """
    runs: dict[str, list[GroupGeneration]] = {g: [] for g in groups}
    step_seconds = None
    for i, x in enumerate(torch.split(prompts, batch_size or len(prompts))):
        check_prompts(model, x, new_tokens)
        built = {g: group_cache(model, plan, g, parts_for(parts, g), kv_format) for g in groups}  # empty
        trunk = PromptTrunk(model, plan, [b.branch for b in built.values()], x) if built else None
        decoders = {g: StepDecoder(model, b.cache, b.open) for g, b in built.items()}
        for g in Progress(groups, desc="prefill", unit="group"):
            decoders[g].start(trunk.prefill(built[g]))
        paired = decode_alternated(decoders, new_tokens - 1, x.device)
        step_seconds = paired if i == 0 else step_seconds
        for g, b in built.items():
            runs[g].append(checked_run(model, plan, g, g, b.storage, decoders[g].tokens, b.cache, b.kind, rank=b.rank))
        if mode_a is not None:
            runs.setdefault(MODE_A, []).append(mode_a_generation(model, plan, mode_a, x, new_tokens, replay=replay,
                                                                 sink=sink))
    return DecodedGroups({label: _joined(r) for label, r in runs.items()}, step_seconds)


def _joined(runs: list[GroupGeneration]) -> GroupGeneration:
    """The batches of one label as one run: tokens concatenated, bytes summed (each batch checked already)."""
    first = runs[0]
    return GroupGeneration(first.group, torch.cat([r.tokens for r in runs]),
                           CacheBytes(sum(r.bytes.used for r in runs), sum(r.bytes.allocated for r in runs)),
                           first.positions, sum(r.accounted for r in runs), first.kind)


def prompt_ids(records: list[dict], where, tok, n: int, prompt_tokens: int, seed: int, stream: int) -> torch.Tensor:
    """The prompts ``(min(n, len(records)), prompt_tokens)``: the first tokens of a seeded sample of ``n`` of
    ``records`` (all when there are fewer; numpy stream ``stream``), as ``eval_ppl`` samples its records.

    Raises
    ------
    ValueError
        One line naming ``where``: fewer than 2 records (the intervals resample prompts), or a record shorter
        than ``prompt_tokens + 1``.
    """
    if len(records) < 2:
        raise ValueError(f"{where}: {len(records)} eval record(s); the intervals resample prompts and need at least 2")
    picked = [records[i] for i in seeded_subset(len(records), n, seed, stream)]
    need = prompt_tokens + 1
    ids = tok([r["text"] for r in picked], truncation=True, max_length=need)["input_ids"]
    for rec, row in zip(picked, ids):
        if len(row) < need:
            raise ValueError(f"{where}: record {rec['id']!r} is {len(row)} tokens long; a prompt of "
                             f"{prompt_tokens} tokens needs a record of at least {need}")
    return torch.tensor([row[:prompt_tokens] for row in ids])


def generation_rows(model: nn.Module, prompts: torch.Tensor, runs: Mapping[str, GroupGeneration], *, seed: int,
                    batch_size: int) -> dict[str, dict]:
    """Per label of ``runs`` (``baseline`` among them): its cache, :func:`fidelity` against the baseline with
    intervals, per-prompt values, and its bytes per cached position (used, allocated, and as ratios to the
    baseline's)."""
    fid = fidelity(model, prompts, {label: r.tokens for label, r in runs.items()}, seed=seed, batch_size=batch_size)
    base = runs["baseline"]
    rows = {}
    for label, r in runs.items():
        f = fid[label]
        rows[label] = {
            "cache": r.kind,
            "first_divergence_mean": f["first_divergence"]["mean"]["value"],
            "first_divergence_mean_ci95": f["first_divergence"]["mean"]["ci95"],
            "first_divergence_median": f["first_divergence"]["median"]["value"],
            "first_divergence_median_ci95": f["first_divergence"]["median"]["ci95"],
            "agreement": f["agreement"]["mean"]["value"], "agreement_ci95": f["agreement"]["mean"]["ci95"],
            "agreement_by_position": f["agreement"]["by_position"],
            "agreement_by_position_ci95": f["agreement"]["by_position_ci95"],
            "delta_nll": f["delta_nll"]["value"], "delta_nll_ci95": f["delta_nll"]["ci95"],
            "used_bytes_per_token": r.used_per_token, "allocated_bytes_per_token": r.allocated_per_token,
            "used_ratio_to_baseline": r.used_per_token / base.used_per_token,
            "allocated_ratio_to_baseline": r.allocated_per_token / base.allocated_per_token,
            "per_prompt": {"first_divergence": f["first_divergence"]["per_prompt"],
                           "delta_nll": f["delta_nll"]["per_prompt"]},
        }
    return rows
