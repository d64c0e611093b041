"""Teacher-forced negative log-likelihood of token sequences, batched without counting pads.

:func:`sequence_nll` scores under whatever runtime hooks the caller installed;
:func:`multi_group_nll` scores several Mode B groups on the same sequences with one shared
trunk per batch (the layers below the first one a group changes run once), to the bit
what :func:`sequence_nll` gives under each group's :class:`~ced_csa2.ced_runtime.CEDModeBRuntime`.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from . import kv_hooks
from .ced_runtime import CEDModeBRuntime, CEDParts, parts_for
from .model_utils import decoder_layer
from .plan import LayerPlan


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


Reference = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def score_logits(out: torch.Tensor, start: int, logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor,
                 reference: Reference | None = None) -> Reference | None:
    """Write each row's summed NLL of its kept targets and their count into ``out[start:]``.

    ``logits`` ``(B, T, vocab)`` predict ``targets`` ``(B, T)``; ``keep`` ``(B, T)`` marks the
    scored ones.  With four columns in ``out``, also each row's summed KL(reference ‖ this)
    (nats) and number of kept tokens whose argmax is the reference's.  ``reference`` is what
    this function returned for the reference's logits of the same batch (``None``: these
    logits are the reference; KL 0, full agreement): its probabilities ``(B, T, vocab)``,
    ``Σ p log p`` and argmax ``(B, T)``.

    KL per token is ``Σ p log p - (Σ p x - logsumexp x)``: two reductions over the vocabulary
    and no ``(B, T, vocab)`` temporary per group (the log-probabilities of a batch are GBs).
    The terms are fp32 and their difference is taken in float64: absolute error ~1e-6
    nats per token, exactly 0 for logits identical to the reference's.
    """
    x = logits.float()
    targets = targets.to(x.device)
    # Flattened to (tokens, vocab): on a transposed (B, vocab, T) view the same call runs
    # ~3.5x slower on CPU (a strided softmax over the vocabulary).
    nll = F.cross_entropy(x.reshape(-1, x.shape[-1]), targets.reshape(-1), reduction="none").view(targets.shape)
    rows = slice(start, start + len(targets))
    out[rows, 0] = (nll.double().cpu() * keep).sum(1)
    out[rows, 1] = keep.sum(1)
    if out.shape[1] == 2:
        return None
    lse = nll + x.gather(-1, targets[..., None])[..., 0]  # log Σ exp x, from the NLL already computed
    top = x.argmax(-1)
    if reference is None:
        p = torch.exp(x - lse[..., None])
        reference = (p, _dot(p, x) - lse, top)
    p, p_log_p, ref_top = reference
    kl = p_log_p.double() - (_dot(p, x) - lse).double()
    out[rows, 2] = (kl.cpu() * keep).sum(1)
    out[rows, 3] = ((top == ref_top).cpu() & keep).sum(1)
    return reference


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``(B, T, V)`` tensors without the product (a batched matmul)."""
    return (a.reshape(-1, 1, a.shape[-1]) @ b.reshape(-1, b.shape[-1], 1)).view(a.shape[:-1])


@torch.inference_mode()
def sequence_nll(model, sequences: Sequence[Sequence[int]], score_from: Sequence[int], batch_size: int,
                 pad_id: int = 0) -> torch.Tensor:
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

    Returns
    -------
    torch.Tensor
        ``(len(sequences), 2)`` float64: summed NLL and number of scored tokens.
    """
    device = next(model.parameters()).device
    out = torch.zeros(len(sequences), 2, dtype=torch.float64)
    for start, ids, mask, scored in _batches(sequences, score_from, batch_size, pad_id):
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        score_logits(out, start, logits[:, :-1], ids[:, 1:], scored[:, 1:])  # position t-1 predicts token t
    return out


# ----------------------------------------------------------------------------- shared trunk

class _StopTrunk(Exception):
    """Raised by the trunk's hook once it has recorded the highest branch point."""


def _layer_kinds(model) -> list[str]:
    """Per decoder layer (0-based) the key the model's forward picks its mask by (``layer_types``)."""
    cfg = model.model.config
    n = len(model.model.layers)
    return list(getattr(cfg, "layer_types", None) or ["decoder"] * n)[:n]


def branch_point(runtime: CEDModeBRuntime, n_layers: int) -> int:
    """First layer (1-based) whose output differs from the plain model's under ``runtime``.

    The lowest layer whose K/V the group replaces (its source, its first target, or the
    first attention layer for ``baseline_fp4``); ``n_layers + 1`` for ``baseline``.
    """
    return min(runtime.replaced_layers, default=n_layers + 1)


@torch.inference_mode()
def multi_group_nll(model, plan: LayerPlan, groups: Sequence[str], parts: CEDParts | Mapping[str, CEDParts] | None,
                    sequences: Sequence[Sequence[int]], score_from: Sequence[int], batch_size: int,
                    pad_id: int = 0, *, kv_format: str | None, agreement: bool = False,
                    extra: Mapping[str, object] | None = None) -> dict[str, torch.Tensor]:
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
    fresh cache, then the final norm and LM head -- as ``LlamaModel``/``Qwen3_5TextModel``
    and their ``*ForCausalLM`` end a forward.  Same batches, same shapes, same ops: each
    group's result equals :func:`sequence_nll` under its runtime exactly (fp32 and bf16
    alike; checked in ``tests/test_shared_trunk.py``).

    Parameters
    ----------
    model
        A HF causal LM of the Llama or Qwen3.5 (text) family, with no runtime installed.
    plan, parts, kv_format
        As for :class:`~ced_csa2.ced_runtime.CEDModeBRuntime` (every group checked before
        scoring); ``parts`` may also map each group to its own maps (:func:`~ced_csa2.ced_runtime.parts_for`).
    groups
        Group names (:data:`ced_csa2.groups.GROUP_NAMES`).
    sequences, score_from, batch_size, pad_id
        As for :func:`sequence_nll`.
    agreement
        Also measure each group against ``baseline`` (which must be in ``groups``) on the
        scored tokens: summed KL(baseline ‖ group) in nats and the number of tokens whose
        argmax is the baseline's.
    extra
        Further runtimes to score, by label, each used like a group's
        :class:`~ced_csa2.ced_runtime.CEDModeBRuntime` (``replaced_layers``, ``spec``,
        ``seed``, a context manager): e.g. a group with sparse reads on top
        (:class:`ced_csa2.sparse_attention.SparseGroup`), which branches at its first sparse layer.

    Returns
    -------
    dict
        ``{group: (len(sequences), c) float64 tensor}``: per sequence, the summed NLL and the
        number of scored tokens (``c = 2``), then the summed KL and agreeing tokens (``c = 4``
        with ``agreement``).
    """
    runtimes = {g: CEDModeBRuntime(model, plan, g, parts_for(parts, g), kv_format=kv_format)
                for g in dict.fromkeys(groups)}
    clash = sorted(set(runtimes) & set(extra or {}))
    if clash:
        raise ValueError(f"multi_group_nll: labels {clash} name both a group and an extra runtime")
    runtimes.update(extra or {})
    if not runtimes:
        return {}
    if agreement and "baseline" not in runtimes:
        raise ValueError(f"multi_group_nll: agreement is measured against 'baseline', which is not among {list(groups)}")
    layers, kinds = model.model.layers, _layer_kinds(model)
    n = len(layers)
    branch = {g: branch_point(rt, n) for g, rt in runtimes.items()}
    points = sorted({b for b in branch.values() if b <= n})
    plain = any(b > n for b in branch.values())
    stop = None
    if points and not plain:
        # Stop the trunk at the highest branch point -- but only once every kind of layer
        # above it has been seen (the arguments of a layer are recorded per kind).
        first = {}
        for i, kind in enumerate(kinds, 1):
            first.setdefault(kind, i)
        stop = max(points[-1], *(first[kinds[i - 1]] for i in range(points[-1], n + 1)))
    # xkv groups read the clean K/V of the source and every target (a compressed clean
    # prefill): the trunk, which is that clean pass, captures them, so it runs through the top target.
    clean_layers = (plan.source, *plan.targets) if any(rt.spec.low_rank for rt in runtimes.values()) else ()
    if clean_layers and stop is not None:
        stop = max(stop, max(clean_layers) + 1) if max(clean_layers) < n else None

    device = next(model.parameters()).device
    out = {g: torch.zeros(len(sequences), 4 if agreement else 2, dtype=torch.float64) for g in runtimes}
    inputs: dict[int, torch.Tensor] = {}
    layer_kwargs: dict[str, dict] = {}

    def record(layer: int):
        def hook(module, args, kwargs):
            if len(args) != 1:
                raise RuntimeError(f"decoder layer {layer} was called with {len(args)} positional arguments; "
                                   "multi_group_nll supports the hidden state only")
            if layer in points:
                inputs[layer] = args[0]
            kind, kw = kinds[layer - 1], dict(kwargs)
            seen = layer_kwargs.setdefault(kind, kw)
            if seen is not kw and (seen.keys() != kw.keys() or any(seen[k] is not kw[k] for k in kw)):
                raise RuntimeError(f"decoder layer {layer} got other arguments than an earlier {kind!r} layer; "
                                   "multi_group_nll cannot replay this model's forward")
            if layer == stop:
                raise _StopTrunk
        return hook

    def trunk_hooks():
        return [decoder_layer(model, i).register_forward_pre_hook(record(i), with_kwargs=True)
                for i in range(1, (stop or n) + 1)]

    for start, ids, mask, scored in _batches(sequences, score_from, batch_size, pad_id):
        inputs.clear()
        layer_kwargs.clear()
        reference = None  # the baseline's log-probabilities of this batch (agreement)
        with kv_hooks._installed(trunk_hooks), \
                kv_hooks.capture(model, list(dict.fromkeys((plan.source, *clean_layers))), [plan.split]) as trunk:
            try:
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            except _StopTrunk:
                pass
            else:  # the plain model's groups: the trunk's own logits (freed before the branches run)
                for g in (g for g, b in branch.items() if b > n):
                    reference = score_logits(out[g], start, logits[:, :-1], ids[:, 1:], scored[:, 1:])
                del logits
        for g, runtime in runtimes.items():
            b = branch[g]
            if b > n:
                continue
            with runtime:
                runtime.seed(h_split=trunk["h"][plan.split] if plan.split < b else None,
                             source_kv=(trunk["k"][plan.source], trunk["v"][plan.source]) if plan.source < b else None,
                             clean_kv={l: (trunk["k"][l], trunk["v"][l]) for l in clean_layers}
                             if runtime.spec.low_rank else None)
                h, fresh = inputs[b], {}
                for i in range(b, n + 1):
                    kw = dict(layer_kwargs[kinds[i - 1]])
                    for name in ("cache", "past_key_values"):  # a fresh cache per branch, as the forward makes one
                        if kw.get(name) is not None:
                            kw[name] = fresh.setdefault(name, type(kw[name])(config=model.model.config))
                    h = kv_hooks._hidden(layers[i - 1](h, **kw))
                logits = _head(model, h)
                score_logits(out[g], start, logits[:, :-1], ids[:, 1:], scored[:, 1:], reference)
    return out


def _head(model, h: torch.Tensor) -> torch.Tensor:
    """Logits from the last layer's output, as ``*ForCausalLM.forward`` ends: final norm, LM head, and
    the logit soft-capping of models that have one (Gemma-2; Gemma-3 configs may set it)."""
    logits = model.get_output_embeddings()(model.model.norm(h))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap
