"""Teacher-forced negative log-likelihood of token sequences, batched without counting pads.

:func:`sequence_nll` scores under whatever runtime hooks the caller installed;
:func:`multi_group_nll` scores several Mode B groups on the same sequences with one shared
trunk per batch (the layers below the first one a group changes run once), to the bit
what :func:`sequence_nll` gives under each group's :class:`~ced_csa2.ced_runtime.CEDModeBRuntime`.

Both run the model to its final hidden state (after the final norm) and score it with
:func:`score_hidden`: only the scored positions reach the LM head, ``block_tokens`` of them
at a time, so the vocabulary-wide tensors are ``(block_tokens, vocab)``, never ``(B, T, vocab)``.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from .. import kv_hooks
from ..ced_runtime import CEDModeBRuntime, CEDParts, parts_for
from ..pipeline import distributed
from ..pipeline.progress import Progress
from ..plan import LayerPlan
from ..runtime.group_runtime import GroupRuntime

# Scored positions per LM-head block (``eval_ppl.score_block_tokens``): at Gemma-3's 262,144-token
# vocabulary one block's fp32 logits are 256 MiB, and scoring holds a few such tensors at once.
BLOCK_TOKENS = 256


def _batches(sequences: Sequence[Sequence[int]], score_from: Sequence[int], batch_size: int,
             pad_id: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(start, ids, attention mask, scored)`` per batch, right-padded to the batch's longest row."""
    for start in range(0, len(sequences), batch_size):
        rows = sequences[start:start + batch_size]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        scored = torch.zeros_like(ids, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
            scored[i, max(1, score_from[start + i]):len(r)] = True
        yield start, ids, mask, scored


def _progress(batches: Iterator, sequences: Sequence, batch_size: int, desc: str) -> Iterator:
    """``batches`` with a progress bar (on the main process only)."""
    return Progress(batches, total=-(-len(sequences) // batch_size), desc=desc, unit="batch",
                disable=not distributed.is_main())


def head_logits(model, rows: torch.Tensor) -> torch.Tensor:
    """Logits ``(..., vocab)`` of final hidden states ``rows`` ``(..., hidden)`` (after the final norm), as
    ``*ForCausalLM.forward`` ends: the LM head, and the logit soft-capping of models that have one
    (Gemma-2; Gemma-3 configs may set it)."""
    logits = model.get_output_embeddings()(rows)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def final_hidden(model, **inputs) -> torch.Tensor:
    """The decoder's output ``(B, T, hidden)`` after the final norm: the model's forward without its LM head."""
    return model.model(**inputs).last_hidden_state


@torch.inference_mode()
def score_hidden(model, out: Mapping[str, torch.Tensor], start: int, hidden: Mapping[str, torch.Tensor],
                 targets: torch.Tensor, keep: torch.Tensor, block_tokens: int = BLOCK_TOKENS,
                 reference: str | None = None) -> None:
    """Write each row's summed NLL of its kept targets and their count into ``out[label][start:]``.

    Parameters
    ----------
    model
        The causal LM whose LM head (:func:`head_logits`) turns ``hidden`` into logits.
    out
        Per label a ``(R, 2)`` or ``(R, 4)`` float64 tensor; rows ``start .. start + B`` are written.
        With four columns also each row's summed KL(reference ‖ label) (nats) and number of kept
        tokens whose argmax is the reference's.
    hidden
        Per label the final hidden states ``(B, T, hidden)`` (after the final norm) that predict
        ``targets``; labels may share one tensor.
    targets, keep
        ``(B, T)``: the tokens predicted, and which of them are scored.
    block_tokens
        Kept positions per LM-head block.  Only kept positions reach the head; the logits and
        the reference's probabilities exist for one block at a time, ``(block_tokens, vocab)``.
    reference
        The label KL and top-1 are measured against (required with four columns).

    Blocks run outer and labels inner, so one block's reference is computed once, shared by
    every label and freed.  Per token the terms are those of the whole-batch computation;
    only the LM head's matmul runs on fewer rows (float rounding apart: ~1e-7 relative in fp32).
    """
    if block_tokens <= 0:
        raise ValueError(f"score_hidden: block_tokens must be positive, got {block_tokens}")
    keep = keep.cpu()
    b_idx, t_idx = keep.nonzero(as_tuple=True)
    gathered: dict[int, torch.Tensor] = {}  # labels that share a hidden state share its rows and their scores
    rows = {label: gathered.setdefault(id(h), h[keep.to(h.device)]) for label, h in hidden.items()}  # (N, hidden)
    device = next(iter(rows.values())).device
    tgt = targets.cpu()[b_idx, t_idx].to(device)
    agreement = next(iter(out.values())).shape[1] == 4
    if agreement and reference not in hidden:
        raise ValueError(f"score_hidden: four columns need the reference among the labels, got {reference!r}")
    # Per-position float64 terms in (B, T) accumulators, summed over T at the end: the sums do
    # not depend on the block size, and are deterministic on every device (no atomics).
    shape = keep.shape
    terms = {label: torch.zeros((3 if agreement else 1, *shape), dtype=torch.float64) for label in rows}
    weight = _linear_head_weight(model) if agreement else None
    for lo in range(0, len(tgt), block_tokens):
        at = (b_idx[lo:lo + block_tokens], t_idx[lo:lo + block_tokens])
        y = tgt[lo:lo + block_tokens]
        done: dict[int, list[torch.Tensor]] = {}  # per distinct rows tensor: its terms of this block (CPU)
        if agreement:
            x = head_logits(model, rows[reference][lo:lo + block_tokens]).float()
            nll = F.cross_entropy(x, y, reduction="none")
            lse = nll + x.gather(-1, y[:, None])[:, 0]  # log Σ exp x, from the NLL already computed
            p = torch.exp(x - lse[:, None])
            # Σ_v p_v x_v for every label's logits x = W h: with a plain linear head it is (pᵀ W)·h, one
            # (block, vocab) x (vocab, hidden) matmul per block for all labels instead of a pass over
            # each label's (block, vocab) logits (memory-bound, a multiple of the LM head's time: docs/costs.md).
            p_w = p @ weight if weight is not None else None  # (block, hidden)
            p_x = (lambda r, x: (p_w * r.float()).sum(-1)) if p_w is not None else (lambda r, x: _dot(p, x))
            p_log_p, ref_top = p_x(rows[reference][lo:lo + block_tokens], x) - lse, x.argmax(-1)
            del x
            # the reference against itself: KL 0, full agreement
            done[id(rows[reference])] = [nll.double().cpu(), torch.zeros(len(y), dtype=torch.float64),
                                         torch.ones(len(y), dtype=torch.float64)]
        for label, r in rows.items():
            if id(r) not in done:
                x = head_logits(model, r[lo:lo + block_tokens]).float()
                # (tokens, vocab) rows: on a transposed view the same call runs several times slower on CPU
                nll = F.cross_entropy(x, y, reduction="none")
                done[id(r)] = [nll.double().cpu()]
                if agreement:
                    lse = nll + x.gather(-1, y[:, None])[:, 0]
                    # KL per token is Σ p log p - (Σ p x - logsumexp x): no (tokens, vocab) temporary
                    # per label.  fp32 terms, their difference in float64: ~1e-6 nats per token,
                    # exactly 0 for identical logits (Σ p x is formed as for the reference's own).
                    done[id(r)] += [(p_log_p.double() - (p_x(r[lo:lo + block_tokens], x) - lse).double()).cpu(),
                                    (x.argmax(-1) == ref_top).double().cpu()]
                del x
            for j, v in enumerate(done[id(r)]):
                terms[label][j][at] = v
        if agreement:
            del p, p_w
    span = slice(start, start + shape[0])
    for label, t in terms.items():
        o = out[label]
        o[span, 0] = t[0].sum(1)
        o[span, 1] = keep.sum(1)
        if agreement:
            o[span, 2] = t[1].sum(1)
            o[span, 3] = t[2].sum(1)


def continuation_logprob(model, hidden: torch.Tensor, targets: torch.Tensor,
                         block_tokens: int = BLOCK_TOKENS) -> tuple[float, bool]:
    """``(Σ log p(target), every target the argmax)`` of one continuation, ``block_tokens`` positions at a time.

    ``hidden`` ``(C, hidden)``: final hidden states (after the final norm) predicting ``targets`` ``(C,)``.
    """
    if block_tokens <= 0:
        raise ValueError(f"continuation_logprob: block_tokens must be positive, got {block_tokens}")
    total, greedy = 0.0, True
    for lo in range(0, len(targets), block_tokens):
        x = head_logits(model, hidden[lo:lo + block_tokens]).float()
        y = targets[lo:lo + block_tokens].to(x.device)
        total -= F.cross_entropy(x, y, reduction="sum").item()
        greedy = greedy and bool((x.argmax(-1) == y).all())
    return total, greedy


def _linear_head_weight(model) -> torch.Tensor | None:
    """The LM head's float32 weight ``(vocab, hidden)`` when the logits are exactly ``hidden @ weight.T``
    (no bias, no soft-capping: :func:`head_logits`), else ``None``.  A bf16 head is left to :func:`_dot`:
    its logits are rounded to bf16, and a float32 copy of a large vocabulary's weight costs GiBs."""
    head = model.get_output_embeddings()
    if (not isinstance(head, torch.nn.Linear) or head.bias is not None or head.weight.dtype != torch.float32
            or getattr(model.config, "final_logit_softcapping", None) is not None):
        return None
    return head.weight


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``(N, V)`` tensors without the product (a batched matmul)."""
    return (a.reshape(-1, 1, a.shape[-1]) @ b.reshape(-1, b.shape[-1], 1)).view(a.shape[:-1])


@torch.inference_mode()
def sequence_nll(model, sequences: Sequence[Sequence[int]], score_from: Sequence[int], batch_size: int,
                 pad_id: int = 0, *, block_tokens: int = BLOCK_TOKENS) -> torch.Tensor:
    """Summed NLL (nats) and token count of each sequence's scored part.

    Token ``t`` of a sequence is scored (``-log p(x_t | x_<t)``) when
    ``t >= score_from[i]`` (and ``t >= 1``: the first token has no prediction).

    Parameters
    ----------
    model
        A causal LM (any runtime hooks installed by the caller apply).
    sequences
        Token ids, one list per sequence (no padding).
    score_from
        First scored position of each sequence.
    batch_size
        Sequences per forward (right-padded to the longest; pads are masked out).
    block_tokens
        Scored positions per LM-head block (:func:`score_hidden`).

    Returns
    -------
    torch.Tensor
        ``(len(sequences), 2)`` float64: summed NLL and number of scored tokens.
    """
    device = next(model.parameters()).device
    out = torch.zeros(len(sequences), 2, dtype=torch.float64)
    for start, ids, mask, scored in _progress(_batches(sequences, score_from, batch_size, pad_id), sequences,
                                              batch_size, "score"):
        h = final_hidden(model, input_ids=ids.to(device), attention_mask=mask.to(device))
        # position t-1 predicts token t
        score_hidden(model, {"": out}, start, {"": h[:, :-1]}, ids[:, 1:], scored[:, 1:], block_tokens)
    return out


# ----------------------------------------------------------------------------- shared trunk

def branch_point(runtime: GroupRuntime, n_layers: int) -> int:
    """First layer (1-based) whose output differs from the plain model's under ``runtime``.

    The lowest layer whose K/V the group replaces (its source, its first target, or the
    first attention layer for ``baseline_fp4``); ``n_layers + 1`` for ``baseline``.
    """
    return min(runtime.replaced_layers, default=n_layers + 1)


@torch.inference_mode()
def multi_group_nll(model, plan: LayerPlan, groups: Sequence[str], parts: CEDParts | Mapping[str, CEDParts] | None,
                    sequences: Sequence[Sequence[int]], score_from: Sequence[int], batch_size: int,
                    pad_id: int = 0, *, kv_format: str | None, agreement: bool = False,
                    extra: Mapping[str, GroupRuntime] | None = None, block_tokens: int = BLOCK_TOKENS
                    ) -> dict[str, torch.Tensor]:
    """:func:`sequence_nll` of every Mode B group in ``groups``, the shared trunk run once per batch.

    Every group is the plain model below its :func:`branch_point`.  Per batch the plain
    model runs once (the model's own forward, so its masks, position embeddings and, on
    Qwen3.5, GatedDeltaNet layers are the model's own) up to the highest branch point
    (to the end when a group is the plain model), recording the hidden state entering
    each branch point, the arguments the forward passes each decoder layer, ``H_split``
    and the true source K/V (with an ``xkv`` group, the clean K/V of the source and every
    target, running at least through the top target).  Each other group then runs only its layers from its branch
    point on, under its :class:`~ced_csa2.ced_runtime.CEDModeBRuntime` (whose hooks are
    handed the trunk's ``H_split``/source K/V when they sit below the branch point), on a
    fresh cache, then the final norm -- as ``LlamaModel``/``Qwen3_5TextModel`` end a forward.
    Every group's final hidden state is kept (``(B, T, hidden)``: small) and all are scored
    together by :func:`score_hidden`, block by block of scored positions, through the LM head.
    Same batches, same shapes, same ops: each group's result equals :func:`sequence_nll` under
    its runtime exactly (fp32 and bf16 alike; checked in ``tests/eval/test_shared_trunk.py``).

    Parameters
    ----------
    model
        A HF causal LM of the Llama or Qwen3.5 (text) family, with no runtime installed.
    plan, parts, kv_format
        As for :class:`~ced_csa2.ced_runtime.CEDModeBRuntime` (every group checked before
        scoring); ``parts`` may also map each group to its own maps (:func:`~ced_csa2.ced_runtime.parts_for`).
    groups
        Group names (:data:`ced_csa2.groups.GROUP_NAMES`).
    sequences, score_from, batch_size, pad_id, block_tokens
        As for :func:`sequence_nll`.
    agreement
        Also measure each group against ``baseline`` (which must be in ``groups``) on the
        scored tokens: summed KL(baseline ‖ group) in nats and the number of tokens whose
        argmax is the baseline's.
    extra
        Further runtimes to score, by label, each used like a group's
        :class:`~ced_csa2.ced_runtime.CEDModeBRuntime` (a :class:`~ced_csa2.runtime.group_runtime.GroupRuntime`):
        e.g. a group with sparse reads on top
        (:class:`ced_csa2.runtime.sparse_attention.SparseGroup`), which branches at its first sparse layer.

    Returns
    -------
    dict
        ``{group: (len(sequences), c) float64 tensor}``: per sequence, the summed NLL and the
        number of scored tokens (``c = 2``), then the summed KL and agreeing tokens (``c = 4``
        with ``agreement``).
    """
    runtimes: dict[str, GroupRuntime] = {g: CEDModeBRuntime(model, plan, g, parts_for(parts, g), kv_format=kv_format)
                                         for g in dict.fromkeys(groups)}
    clash = sorted(set(runtimes) & set(extra or {}))
    if clash:
        raise ValueError(f"multi_group_nll: labels {clash} name both a group and an extra runtime")
    runtimes.update(extra or {})
    if not runtimes:
        return {}
    if agreement and "baseline" not in runtimes:
        raise ValueError(f"multi_group_nll: agreement is measured against 'baseline', which is not among {list(groups)}")
    n = len(model.model.layers)
    branch = {g: branch_point(rt, n) for g, rt in runtimes.items()}
    points = sorted({b for b in branch.values() if b <= n})
    plain = any(b > n for b in branch.values())
    # Stop the trunk at the highest branch point -- but only once every kind of layer above it
    # has been seen (the arguments of a layer are recorded per kind).
    stop = max(points[-1], kv_hooks.kinds_seen_by(model, range(points[-1], n + 1))) if points and not plain else None
    # xkv groups read the clean K/V of the source and every target (a compressed clean
    # prefill): the trunk, which is that clean pass, captures them, so it runs through the top target.
    clean_layers = (plan.source, *plan.targets) if any(rt.spec.low_rank for rt in runtimes.values()) else ()
    if clean_layers and stop is not None:
        stop = max(stop, max(clean_layers) + 1) if max(clean_layers) < n else None

    device = next(model.parameters()).device
    out = {g: torch.zeros(len(sequences), 4 if agreement else 2, dtype=torch.float64) for g in runtimes}
    batches = _batches(sequences, score_from, batch_size, pad_id)
    for start, ids, mask, scored in _progress(batches, sequences, batch_size, f"score {len(runtimes)} groups"):
        hidden = {}  # each group's final hidden state (after the final norm), in runtimes' order
        with kv_hooks.layer_calls(model, stop, points) as calls, \
                kv_hooks.capture(model, list(dict.fromkeys((plan.source, *clean_layers))), [plan.split]) as trunk:
            try:
                plain_h = final_hidden(model, input_ids=ids.to(device), attention_mask=mask.to(device))
            except kv_hooks.StopLayers:
                pass
            else:  # the plain model's groups: the trunk's own output
                hidden.update((g, plain_h) for g, b in branch.items() if b > n)
        for g, runtime in runtimes.items():
            b = branch[g]
            if b > n:
                continue
            with runtime:
                runtime.seed(h_split=trunk["h"][plan.split] if plan.split < b else None,
                             source_kv=(trunk["k"][plan.source], trunk["v"][plan.source]) if plan.source < b else None,
                             clean_kv={l: (trunk["k"][l], trunk["v"][l]) for l in clean_layers}
                             if runtime.spec.low_rank else None)
                # a fresh cache per branch, as the forward makes one
                hidden[g] = kv_hooks.run_layers(model, calls["inputs"][b], b, calls, fresh_cache=True)
        # position t-1 predicts token t; the scores of every group are written in one pass over the blocks
        cut: dict[int, torch.Tensor] = {}  # one view per distinct state: groups sharing the trunk's share its scores
        score_hidden(model, out, start, {g: cut.setdefault(id(hidden[g]), hidden[g][:, :-1]) for g in runtimes},
                     ids[:, 1:], scored[:, 1:], block_tokens, reference="baseline" if agreement else None)
    return out
