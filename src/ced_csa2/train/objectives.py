"""Losses that train the maps *through* the frozen model: ``attn_out``, ``distill`` and Mode A's KL.

K/V MSE (the seed's objective) weighs every K/V direction equally; attention does not.
Both objectives here look at what the substituted K/V do instead, and both are computed
online from one teacher forward pass of the frozen model per batch (kept for a branch's
phases by :class:`TeacherCache`); logits are recomputed from final hidden states, never stored.

* ``attn_out``: for every layer the group substitutes, the layer's own attention module
  is re-run on its *true* input (true queries) with the substituted K/V, and compared
  with its true output (relative MSE over real tokens).  The maps' inputs (``H_split``,
  the source's K/V) are the true ones, as in the dump-based training.
* ``distill``: the same model is teacher (no substitution, no grad) and student
  (:class:`~ced_csa2.ced_runtime.CEDModeBRuntime` active, gradients through the maps
  only); loss = ``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` per real
  token, plus ``kv_weight`` times the relative K/V MSE of the substituted layers.

* :func:`mode_a_kl`: the maps Mode A uses (source and extra projectors, adapters) under
  the prefill skip itself: the prompt prefilled by the skip, the continuation through every
  layer, KL(plain ‖ Mode A) on the continuation (stage ``tune_mode_a``, as SwiftKV trains
  its single-input K/V).  Its teacher pass (:func:`mode_a_teacher`: two hidden states per
  continuation token, no logits) is the one thing kept between steps: the caller computes it
  once per record.

A *phase* trains maps under one group: the projector under ``ced``, the adapters under
``csa2``, and both at once under ``ced_csa2`` (its own projector and adapters, from the
ridge start: the maps of the group they serve).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import kv_hooks
from ..ced_runtime import CEDModeARuntime, CEDModeBRuntime, CEDParts, StopForward, prompt_tokens
from ..config import Params
from ..data.loader import record_split
from ..data.records import read_records, tokenize
from ..eval.scoring import final_hidden, head_logits
from ..model_utils import Geometry, attention, decoder_layer
from ..pipeline.paths import TRAIN_JSONL
from ..plan import LayerPlan
from .projector_training import ridge_projectors
from .training import build_adapters

KV = tuple[torch.Tensor, torch.Tensor]
PHASE_GROUPS = ("ced", "csa2", "ced_csa2")


def substituted_layers(plan: LayerPlan, group: str) -> tuple[int, ...]:
    """Layers whose K/V a training phase replaces: the source (``ced``), the targets (``csa2``) or both."""
    if group not in PHASE_GROUPS:
        raise ValueError(f"training phase group must be one of {PHASE_GROUPS}, got {group!r}")
    return {"ced": (plan.source,), "csa2": tuple(plan.targets), "ced_csa2": (plan.source, *plan.targets)}[group]


def predicted_kv(parts: CEDParts, plan: LayerPlan, group: str, store: dict) -> dict[int, KV]:
    """The maps' K/V ``{layer: (k, v)}``, each ``(B, T, kv_dim)``, from the true inputs in ``store``.

    ``store`` is a :func:`ced_csa2.kv_hooks.capture` store holding ``H_split`` and the
    source's K/V of a teacher pass.  Under ``ced_csa2`` the targets read the projected
    source, as the group runs.
    """
    out = {}
    if group != "csa2":
        out[plan.source] = parts.project(plan.source, plan, store["h"][plan.split])
    if group != "ced":
        k_src, v_src = out[plan.source] if group == "ced_csa2" else (store["k"][plan.source], store["v"][plan.source])
        out |= {t: parts.adapt(t, k_src, v_src) for t in plan.targets}
    return out


def relative_mse(pred: torch.Tensor, true: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum((pred - true)^2) / sum(true^2)`` over the real tokens (``mask`` ``(B, T)``)."""
    m = mask.unsqueeze(-1).to(pred.dtype)
    return ((pred.float() - true.float()) ** 2 * m).sum() / ((true.float() ** 2) * m).sum().clamp_min(1e-12)


def kl_distill(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over real tokens of ``T^2 KL(softmax(teacher/T) || softmax(student/T))``.

    ``student``, ``teacher``: logits ``(B, T, vocab)``; ``mask``: ``(B, T)``.  Exactly zero
    when the logits are equal (the log-probabilities cancel term by term).
    """
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    s = F.log_softmax(student.float() / temperature, dim=-1)
    per_token = (t.exp() * (t - s)).sum(-1)
    m = mask.to(per_token.dtype)
    return temperature ** 2 * (per_token * m).sum() / m.sum()


def kl_from_hidden(model: nn.Module, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                   temperature: float, block_tokens: int | None = None) -> torch.Tensor:
    """:func:`kl_distill` of the LM-head logits (:func:`~ced_csa2.eval.scoring.head_logits`) of two final hidden states.

    ``student``, ``teacher``: ``(B, T, hidden)`` (after the final norm); ``mask``: ``(B, T)``.
    ``block_tokens=None`` forms the ``(B, T, vocab)`` logits at once (what a training step's gradient
    needs).  An integer runs the LM head on that many real positions at a time and sums the blocks'
    KL, so the vocabulary-wide tensors are ``(block_tokens, vocab)``: the held-out checks, whose
    batches of Gemma-3's 262,144-token vocabulary are 1 GiB of logits each.  The same
    value to float rounding (each block's LM head runs on fewer rows, the sum in another order).
    """
    if block_tokens is None:
        return kl_distill(head_logits(model, student), head_logits(model, teacher), mask, temperature)
    if block_tokens <= 0:
        raise ValueError(f"kl_from_hidden: block_tokens must be positive, got {block_tokens}")
    keep = mask.bool().to(student.device)
    s, t = student[keep], teacher[keep.to(teacher.device)]  # (N, hidden): the real positions only
    if not len(s):
        raise ValueError("kl_from_hidden: the mask holds no real position")
    total = torch.zeros((), dtype=torch.float64, device=s.device)
    for lo in range(0, len(s), block_tokens):
        rows = slice(lo, lo + block_tokens)
        ones = torch.ones(len(s[rows]), device=s.device)
        block = kl_distill(head_logits(model, s[rows]), head_logits(model, t[rows]), ones, temperature)
        total += block.double() * len(ones)
    return (total / len(s)).float()


@contextmanager
def capture_attention(model: nn.Module, layers: tuple[int, ...]) -> Iterator[dict]:
    """Record ``(args, kwargs, output)`` of each listed layer's attention module, always unhooked.

    ``store[layer]``: the call's positional and keyword arguments (hidden states, position
    embeddings, mask, ...) and its attention output ``(B, T, hidden)`` -- enough to re-run
    the module on the same input.
    """
    store: dict = {}
    handles = []
    try:
        for layer in layers:
            attn = attention(model, layer)
            handles.append(attn.register_forward_pre_hook(
                lambda mod, args, kwargs, layer=layer: store.__setitem__(layer, [args, kwargs, None]),
                with_kwargs=True))
            handles.append(attn.register_forward_hook(
                lambda mod, inp, out, layer=layer: store[layer].__setitem__(2, out[0] if isinstance(out, tuple) else out)))
        yield store
    finally:
        for h in handles:
            h.remove()


@contextmanager
def stop_after(model: nn.Module, layer: int) -> Iterator[None]:
    """End every forward pass inside the context after decoder ``layer`` (the rest is skipped)."""
    def stop(mod, inp, out):
        raise StopForward

    handle = decoder_layer(model, layer).register_forward_hook(stop)
    try:
        yield
    except StopForward:
        pass
    finally:
        handle.remove()


def teacher_pass(model: nn.Module, plan: LayerPlan, group: str, ids: torch.Tensor, mask: torch.Tensor,
                 final: bool = True) -> dict:
    """One no-grad forward of the frozen model recording what the losses need.

    Returns ``{"final": (B, T, hidden), "kv": capture store, "attn": capture_attention store}``:
    the final hidden state (after the final norm), whose LM head
    (:func:`~ced_csa2.eval.scoring.head_logits`) gives the model's own logits.  ``final=False``
    (``attn_out``'s training steps) ends the forward after the last substituted layer -- nothing
    above it is needed -- and ``"final"`` is ``None``.
    """
    layers = substituted_layers(plan, group)
    out = None
    with torch.no_grad(), ExitStack() as stack:
        kv = stack.enter_context(kv_hooks.capture(model, (plan.source, *plan.targets), [plan.split]))
        attn = stack.enter_context(capture_attention(model, layers))
        if not final:
            stack.enter_context(stop_after(model, max(layers)))  # the forward ends there: nothing below runs
        out = final_hidden(model, input_ids=ids, attention_mask=mask, use_cache=False)
    return {"final": out, "kv": kv, "attn": attn}


class TeacherCache:
    """The frozen model's teacher pass of each distinct batch, computed once and shared by every phase.

    The teacher does not change while the maps train, and a branch's phases (``ced``, ``csa2``,
    ``ced_csa2``) and its held-out checks see the same batches: one pass per batch recording what
    every phase reads -- the attention of the source and every target (``ced_csa2``'s layers, a
    superset of the others') -- instead of one per phase and step.  The same tensors as a pass of
    the phase's own (the plain model's layers do not depend on what is recorded), so the losses
    are bit for bit the uncached ones.  Logits are never kept (``(B, T, vocab)`` per batch): the
    final hidden state is, and the reader runs the LM head on it (:func:`kl_from_hidden`).

    The passes are kept on the host and moved to the model's device at each read, as
    ``tune_mode_a`` keeps its teachers: ~27 KB a token on SmolLM2 in float32, ~60 KB on Qwen3.5-4B
    in bf16, so the full profile's 2,048 records would hold ~30 GiB beside the model on its GPU.
    On a CPU the move is no copy.

    Parameters
    ----------
    final
        Whether reads need the final hidden state (``distill``, held-out KL); without, each pass
        ends after the top substituted layer.
    """

    def __init__(self, model: nn.Module, plan: LayerPlan, final: bool):
        self.model, self.plan, self.final = model, plan, final
        self._passes: dict[tuple, dict] = {}

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> dict:
        """:func:`teacher_pass`'s result for batch ``ids``/``mask`` ``(B, T)``, whatever the phase."""
        key = (tuple(ids.shape), ids.cpu().numpy().tobytes(), mask.cpu().numpy().tobytes())
        if key not in self._passes:
            self._passes[key] = map_tensors(teacher_pass(self.model, self.plan, "ced_csa2", ids, mask,
                                                         final=self.final), _Offloaded.of)
        return map_tensors(self._passes[key], _Offloaded.back, leaf=_Offloaded)


@dataclass(frozen=True)
class _Offloaded:
    """A tensor kept on the host, and the device it came from (under ``device_map: auto`` layers differ)."""

    tensor: torch.Tensor
    device: torch.device

    @staticmethod
    def of(tensor: torch.Tensor) -> _Offloaded:
        return _Offloaded(tensor.cpu(), tensor.device)  # on a CPU: the tensor itself, no copy

    def back(self) -> torch.Tensor:
        return self.tensor.to(self.device)


def map_tensors(tree, fn, leaf: type = torch.Tensor):
    """``tree`` (dicts, lists, tuples and named tuples, to any depth) with ``fn`` applied to every ``leaf``;
    anything else (``None``, numbers, other objects) as it is."""
    if isinstance(tree, leaf):
        return fn(tree)
    if isinstance(tree, dict):
        return {key: map_tensors(value, fn, leaf) for key, value in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_tensors(value, fn, leaf) for value in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(value, fn, leaf) for value in tree)
    return tree


def kv_loss(parts: CEDParts, plan: LayerPlan, group: str, teacher: dict, mask: torch.Tensor) -> torch.Tensor:
    """Relative K/V MSE of the maps against the true K/V, summed over substituted layers and K/V."""
    store = teacher["kv"]
    return sum(relative_mse(pred, store[kind][layer], mask)
               for layer, kv in predicted_kv(parts, plan, group, store).items()
               for kind, pred in zip("kv", kv))


def attn_out_loss(model: nn.Module, parts: CEDParts, plan: LayerPlan, group: str, teacher: dict,
                  mask: torch.Tensor) -> torch.Tensor:
    """Relative MSE of each substituted layer's attention output, summed over the layers.

    Each layer's attention module is re-run on its captured true input with ``k_proj`` /
    ``v_proj`` outputs replaced by the maps' prediction (gradients reach only the maps).
    """
    total = torch.zeros((), device=mask.device)
    for layer, (k, v) in predicted_kv(parts, plan, group, teacher["kv"]).items():
        args, kwargs, true_out = teacher["attn"][layer]
        with kv_hooks.inject(model, {(layer, "k"): k, (layer, "v"): v}):
            out = attention(model, layer)(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        total = total + relative_mse(out, true_out, mask)
    return total


def student_final(model: nn.Module, parts: CEDParts, plan: LayerPlan, group: str, ids: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``(B, T, hidden)`` (after the final norm) with the ``group`` substitution active."""
    with CEDModeBRuntime(model, plan, group, parts, kv_format=None):  # ced / csa2: no FP4
        return final_hidden(model, input_ids=ids, attention_mask=mask, use_cache=False)


def distill_loss(model: nn.Module, parts: CEDParts, plan: LayerPlan, group: str, teacher: dict,
                 ids: torch.Tensor, mask: torch.Tensor, temperature: float, kv_weight: float = 0.0,
                 student: torch.Tensor | None = None, block_tokens: int | None = None) -> torch.Tensor:
    """KL of the student (``group`` substitution active) to the teacher, ``+ kv_weight *`` :func:`kv_loss`.

    ``student``: its final hidden states (:func:`student_final`) when already computed;
    ``block_tokens``: as for :func:`kl_from_hidden` (``None`` in training).  ``group="baseline"``
    (no substitution) gives a student identical to the teacher: the loss is exactly zero and
    depends on no parameter.
    """
    if student is None:
        student = student_final(model, parts, plan, group, ids, mask)
    loss = kl_from_hidden(model, student, teacher["final"], mask, temperature, block_tokens)
    if kv_weight and group != "baseline":
        loss = loss + kv_weight * kv_loss(parts, plan, group, teacher, mask)
    return loss


@dataclass
class ModeATeacher:
    """The plain model's pass over records ``(B, T)`` of one length, as :func:`mode_a_kl` reads it.

    Attributes
    ----------
    h_split
        ``(B, C, hidden)``: ``H_split`` at the ``C`` positions that predict the continuation
        (``cut - 1 .. T - 2``), the input of the layers above the cut there.
    final
        ``(B, C, hidden)``: the final hidden states (after the final norm) at those positions;
        the teacher's logits are their LM head.
    """

    h_split: torch.Tensor
    final: torch.Tensor

    @staticmethod
    def stack(teachers: list[ModeATeacher]) -> ModeATeacher:
        """Records of one length, in the order given, as one ``(B, C, hidden)`` batch."""
        return ModeATeacher(torch.cat([t.h_split for t in teachers]), torch.cat([t.final for t in teachers]))

    def split(self) -> list[ModeATeacher]:
        """One ``(1, C, hidden)`` teacher per record."""
        return [ModeATeacher(h[None], f[None]) for h, f in zip(self.h_split, self.final)]

    def to(self, device) -> ModeATeacher:
        return ModeATeacher(self.h_split.to(device), self.final.to(device))


@torch.no_grad()
def mode_a_teacher(model: nn.Module, plan: LayerPlan, row: torch.Tensor, fraction: float) -> ModeATeacher:
    """The plain model's pass over records ``row`` ``(B, T)`` (one length) that :func:`mode_a_kl` needs.

    One forward per record, whatever the epochs: the teacher does not change while the maps train.
    """
    cut = prompt_tokens(row.shape[1], fraction)
    with kv_hooks.capture(model, (), [plan.split]) as store:
        final = final_hidden(model, input_ids=row)
    return ModeATeacher(store["h"][plan.split][:, cut - 1:-1], final[:, cut - 1:-1])


def mode_a_kl(model: nn.Module, runtime: CEDModeARuntime, row: torch.Tensor, fraction: float,
              teacher: ModeATeacher | None = None) -> torch.Tensor:
    """KL(plain ‖ Mode A) per continuation token of records ``row`` ``(B, T)`` (one length), through the prefill skip.

    The prompt (:func:`~ced_csa2.ced_runtime.prompt_tokens`, as
    :func:`ced_csa2.eval.perplexity.mode_a_prefix` cuts) is prefilled by the skip with the
    maps' gradients kept (:meth:`~ced_csa2.ced_runtime.CEDModeARuntime.prefill_with_grad`);
    the continuation runs through the layers above the cut, reading the mapped K/V, from the
    teacher's ``H_split`` (:meth:`~ced_csa2.ced_runtime.CEDModeARuntime.continue_above_cut`: below
    the cut the continuation is the plain model's).  The teacher is the plain model on the whole
    row (:func:`mode_a_teacher`; computed here when not given).  Temperature 1: what ``eval_ppl``
    reports.
    """
    cut = prompt_tokens(row.shape[1], fraction)
    prompt, cont = row[:, :cut], row[:, cut:]
    if teacher is None:
        teacher = mode_a_teacher(model, runtime.plan, row, fraction)
    cache = runtime.prefill_with_grad(prompt[:, :-1])
    hidden = runtime.continue_above_cut(cache, torch.cat([prompt[:, -1:], cont[:, :-1]], 1), teacher.h_split)
    return kl_from_hidden(model, hidden, teacher.final, torch.ones(cont.shape, device=row.device), 1.0)


SAMPLE_STREAM = 5  # numpy seed-sequence tag (loader.py uses 0-3, training.py 4)



def ridge_parts(params: Params, plan: LayerPlan, geo: Geometry, ridge_path: Path, projected: bool = False) -> CEDParts:
    """Projector and adapters at the ridge solution (seeded, float32).

    The adapters' maps are fitted on the true source K/V, or (``projected``) on the
    source K/V the ridge projector predicts (the ridge stage's ``ced_*`` maps).
    """
    projector = ridge_projectors(ridge_path, [plan.source], geo, params)[plan.source]
    return CEDParts(projector, build_adapters(params, plan, geo.kv_dim, ridge_path, projected=projected))



def online_records(params: Params, tok, workdir: Path, records: int | None = None
                   ) -> tuple[list[list[int]], list[list[int]]]:
    """Seeded train and held-out token rows (the ridge stage's record split), cropped to ``seq_len``.

    ``records`` train rows (default ``train.online.records``): a prefix of one seeded permutation,
    so a smaller sample is part of every larger one; a split smaller than that gives all its records
    (the caller's protocol records how many).
    """
    cfg = params.train.online
    rows = tokenize(tok, read_records(workdir / TRAIN_JSONL), params.data.max_tokens)
    train, val = record_split(len(rows), params.split.val_fraction, params.seed)
    n_train = cfg.records if records is None else records
    rng = np.random.default_rng([params.seed, SAMPLE_STREAM])
    pick = [np.sort(rng.permutation(ix)[:n]) for ix, n in ((train, n_train), (val, cfg.val_records))]
    return tuple([rows[i][:cfg.seq_len] for i in ix] for ix in pick)

