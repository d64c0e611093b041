"""Passkey retrieval at length: a number hidden in filler text, asked for at the end.

The task is the passkey test of Mohtashami & Jaggi (2023), the shortest of RULER's needle
tests: an instruction, filler text with one needle sentence at a seeded depth, and the
question; the model must continue with the key.  A record counts as retrieved when greedy
decoding reproduces every token of the answer (``" 68263"``), which is checked
teacher-forced: each answer token must be the argmax given the prompt and the answer's
earlier tokens -- exactly what greedy generation would produce, without generating past
the first miss.

Prompts are assembled from separately tokenised pieces, so every prompt of a length has
exactly ``length`` tokens (prompt plus answer) and the needle's tokens are the same ones
wherever it sits.  The filler is real text (the embedded corpus's held-out records joined),
cut at a seeded offset.

* :func:`passkey_prompts` builds the records of one length;
* :func:`forward_hits` scores them in one teacher-forced pass each, under whatever runtime
  the caller installed (a Mode B group's :class:`~ced_csa2.ced_runtime.CEDModeBRuntime`);
* :func:`decode_hits` scores them through a KV cache as generation runs: the prompt
  prefilled, then one decode step per answer token (the sparse decode reads only at
  decode steps);
* :func:`group_hits` and :func:`mode_a_hits` score them so through the cache that holds a
  group's bytes (:func:`~ced_csa2.eval.generation.group_cache`) and after Mode A's prefill
  skip, records of one prompt length batched (all of them, when the key's tokens do not vary);
  :func:`groups_hits` scores several groups so, the layers below each cache's branch prefilled
  once per batch (:class:`~ced_csa2.eval.generation.PromptTrunk`);
* :func:`accuracy_row` is one group's accuracy with its Wilson interval and its paired change
  against the baseline over the same records;
* :func:`wilson` is the interval of an accuracy.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import Cache

from ..ced_runtime import CEDModeARuntime, CEDParts, parts_for
from ..model_utils import geometry
from ..plan import LayerPlan
from . import generation, stats
from .generation import next_logits
from .scoring import continuation_logprob, final_hidden

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}"


@dataclass(frozen=True)
class Passkey:
    """One retrieval record: ``prompt + answer`` is ``length`` tokens."""

    prompt: list[int]  # instruction, filler with the needle, question
    answer: list[int]  # the key as the model should continue: " 68263"
    key: str
    depth: float  # where the needle starts, as a fraction of the filler (0: first, 1: last)
    needle_at: int  # the needle's first token in ``prompt``


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def passkey_prompts(tok, filler: Sequence[int], length: int, n: int, seed: int, digits: int = 5) -> list[Passkey]:
    """``n`` records of exactly ``length`` tokens, their keys, filler offsets and depths drawn from ``seed``.

    Depths are stratified: record ``i`` puts its needle uniformly inside the ``i``-th of ``n``
    equal slices of the filler, so every depth is covered at every length.  The draw for one
    length does not depend on the other lengths asked for.

    Raises
    ------
    ValueError
        ``length`` leaves no room for filler, or ``filler`` is shorter than one prompt's share.
    """
    rng = random.Random(f"passkey:{seed}:{length}")
    intro, question = _ids(tok, INTRO), _ids(tok, QUESTION)
    out = []
    for i in range(n):
        key = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        needle, answer = _ids(tok, NEEDLE.format(key=key)), _ids(tok, ANSWER.format(key=key))
        room = length - len(intro) - len(needle) - len(question) - len(answer)
        if room < 1:
            raise ValueError(f"passkey prompts of {length} tokens leave no room for filler (the fixed text takes "
                             f"{length - room})")
        if len(filler) < room:
            raise ValueError(f"passkey prompts of {length} tokens need {room} filler tokens; the filler has {len(filler)}")
        start = rng.randrange(0, len(filler) - room + 1)
        cut = min(room, int((i + rng.random()) / n * (room + 1)))
        text = list(filler[start:start + room])
        prompt = intro + text[:cut] + needle + text[cut:] + question
        out.append(Passkey(prompt=prompt, answer=answer, key=key, depth=cut / room, needle_at=len(intro) + cut))
    return out


@torch.inference_mode()
def forward_hits(model, records: Sequence[Passkey], batch_size: int = 1) -> list[bool]:
    """Per record: is the answer the greedy continuation?  One teacher-forced forward per record.

    Records of one length (the same token count) run ``batch_size`` at a time, unpadded.
    The runtime installed around the call (if any) is what is scored.
    """
    device = next(model.parameters()).device
    hits = []
    for lo in range(0, len(records), batch_size):
        chunk = records[lo:lo + batch_size]
        rows = [r.prompt + r.answer for r in chunk]
        if len({len(r) for r in rows}) != 1:
            raise ValueError("forward_hits: a batch mixes record lengths; score one length at a time")
        hidden = final_hidden(model, input_ids=torch.tensor(rows, device=device))
        for r, h in zip(chunk, hidden):
            a = len(r.prompt)
            # position t - 1 predicts token t
            hits.append(continuation_logprob(model, h[a - 1:a - 1 + len(r.answer)], torch.tensor(r.answer))[1])
    return hits


@torch.inference_mode()
def answer_hits(model: nn.Module, cache: Cache, logits: torch.Tensor, answers: torch.Tensor) -> list[bool]:
    """Per row: is the answer the greedy continuation, decoded through ``cache``?

    Parameters
    ----------
    cache
        Holds every prompt position; the caller has opened whatever context its forwards need.
    logits : torch.Tensor, shape (B, vocab)
        The logits after the prompts' last position (:func:`~ced_csa2.eval.generation.next_logits` of the positions ``cache``
        did not hold yet).
    answers : torch.Tensor, shape (B, A)
        The answers: each token checked against the argmax, then fed as one decode step --
        exactly what greedy generation does while it agrees.  Decoding stops once no row
        agrees any more.
    """
    ok = torch.ones(answers.shape[0], dtype=torch.bool, device=answers.device)
    for i in range(answers.shape[1]):
        if i:
            logits = next_logits(model, cache, answers[:, i - 1:i])
        ok &= logits.argmax(-1) == answers[:, i]
        if not ok.any():
            break
    return ok.tolist()


@torch.inference_mode()
def decode_hits(model, make_cache: Callable[[], object], records: Sequence[Passkey]) -> list[bool]:
    """Per record: is the answer the greedy continuation, decoded through a fresh ``make_cache()``?

    ``make_cache()`` returns a cache with a ``feed()`` context (the shared stores of
    :mod:`ced_csa2.runtime.shared_kv`); the prompt is prefilled in one call, then each answer
    token is fed as one decode step (:func:`answer_hits`), one record at a time.
    """
    def scored():
        for batch in _batches(model, records, 1):
            cache = make_cache()
            with cache.feed():
                yield batch, answer_hits(model, cache, next_logits(model, cache, batch.prompts), batch.answers)
    return _in_order(len(records), scored())


@dataclass(frozen=True)
class _Batch:
    index: list[int]  # the records' positions in the caller's list
    prompts: torch.Tensor  # (B, T)
    answers: torch.Tensor  # (B, A)


def _batches(model: nn.Module, records: Sequence[Passkey], batch_size: int) -> Iterator[_Batch]:
    """``records`` in batches of at most ``batch_size`` that share one prompt length (records of one length
    share it unless their keys tokenise to different counts), on the model's device."""
    device = next(model.parameters()).device
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(records):
        by_shape.setdefault((len(r.prompt), len(r.answer)), []).append(i)
    for index in by_shape.values():
        for lo in range(0, len(index), batch_size):
            chunk = index[lo:lo + batch_size]
            yield _Batch(chunk, torch.tensor([records[i].prompt for i in chunk], device=device),
                         torch.tensor([records[i].answer for i in chunk], device=device))


def _in_order(n: int, scored: Iterator[tuple[_Batch, list[bool]]]) -> list[bool]:
    hits: list[bool | None] = [None] * n
    for batch, ok in scored:
        for i, hit in zip(batch.index, ok):
            hits[i] = hit
    return hits


@torch.inference_mode()
def group_hits(model: nn.Module, plan: LayerPlan, group: str, parts: CEDParts | None, records: Sequence[Passkey],
               kv_format: str | None, batch_size: int) -> list[bool]:
    """Per record: is the answer ``group``'s greedy continuation through the cache that holds its bytes?

    Parameters
    ----------
    model, plan, parts, kv_format
        As for :func:`~ced_csa2.eval.generation.group_cache`, which builds a fresh cache per batch
        (refused in one line for a group without one); every forward runs inside its context.
    records
        Scored ``batch_size`` at a time among records of one prompt length: each batch's prompts
        ``(B, T)`` prefilled in one call, its answers ``(B, A)`` decoded (:func:`answer_hits`).

    Returns
    -------
    list[bool]
        One per record, in the order of ``records``.
    """
    def scored():
        for batch in _batches(model, records, batch_size):
            built = generation.group_cache(model, plan, group, parts, kv_format)
            with built.open():
                yield batch, answer_hits(model, built.cache, next_logits(model, built.cache, batch.prompts),
                                         batch.answers)
    return _in_order(len(records), scored())


@torch.inference_mode()
def groups_hits(model: nn.Module, plan: LayerPlan, groups: Sequence[str], parts: CEDParts | Mapping[str, CEDParts] | None,
                records: Sequence[Passkey], kv_format: str | None, batch_size: int) -> dict[str, list[bool]]:
    """:func:`group_hits` of every group in ``groups``, each batch's prompts prefilled once below the groups' branch
    layers (:class:`~ced_csa2.eval.generation.PromptTrunk`: the same logits to the bit as each group's own prefill), then each group's
    answers decoded through its cache (:func:`answer_hits`), one group's cache held at a time.

    Returns
    -------
    dict
        ``{group: one bool per record, in the order of records}``.
    """
    scored: dict[str, list[tuple[_Batch, list[bool]]]] = {g: [] for g in groups}
    for batch in _batches(model, records, batch_size):
        built = {g: generation.group_cache(model, plan, g, parts_for(parts, g), kv_format) for g in groups}  # empty
        trunk = generation.PromptTrunk(model, plan, [b.branch for b in built.values()], batch.prompts)
        for g in groups:
            cache = built.pop(g)
            logits = trunk.prefill(cache)
            with cache.open():
                scored[g].append((batch, answer_hits(model, cache.cache, logits, batch.answers)))
    return {g: _in_order(len(records), iter(s)) for g, s in scored.items()}


@torch.inference_mode()
def mode_a_hits(model: nn.Module, plan: LayerPlan, parts: CEDParts, records: Sequence[Passkey], batch_size: int,
                *, replay: int = 0, sink: str = "none") -> list[bool]:
    """Per record: is the answer the greedy continuation after Mode A's prefill skip?

    Each batch's prompts but their last token are prefilled by
    :class:`~ced_csa2.ced_runtime.CEDModeARuntime` (``replay``, ``sink`` as there), which returns an
    ordinary cache; the last prompt token and the answers then decode through every layer, as
    :func:`~ced_csa2.eval.generation.mode_a_generation` continues.  Needs a covering plan.

    Returns
    -------
    list[bool]
        One per record, in the order of ``records``.
    """
    runtime = CEDModeARuntime(model, plan, geometry(model.config), parts, replay=replay, sink=sink)

    def scored():
        for batch in _batches(model, records, batch_size):
            cache = runtime.prefill(batch.prompts[:, :-1])
            yield batch, answer_hits(model, cache, next_logits(model, cache, batch.prompts[:, -1:]), batch.answers)
    return _in_order(len(records), scored())


def accuracy_row(hits: Sequence[bool], base: Sequence[bool] | None, seed: int) -> dict:
    """One group's accuracy over ``n`` records and, against the baseline's ``base`` on the same records, its change.

    Returns
    -------
    dict
        ``retrieved``, ``n``, ``accuracy_pct`` and ``accuracy_ci95`` (:func:`wilson`, %); with ``base``:
        ``delta_points`` and ``delta_points_ci95`` (percentage points, paired bootstrap over records,
        95%: :func:`~ced_csa2.eval.stats.ratio_bootstrap` of the per-record differences, whose
        resamples the seed fixes).
    """
    h = np.asarray(hits, dtype=np.float64)
    row = {"retrieved": int(h.sum()), "n": len(h), "accuracy_pct": 100 * float(h.mean()),
           "accuracy_ci95": [100 * x for x in wilson(int(h.sum()), len(h))]}
    if base is not None:
        if len(base) != len(h):
            raise ValueError(f"accuracy_row: {len(h)} records against a baseline of {len(base)}; pair the same records")
        d = stats.ratio_bootstrap(h - np.asarray(base, dtype=np.float64), np.ones_like(h), scale=100.0, seed=seed)
        row |= {"delta_points": d["value"], "delta_points_ci95": d["ci95"]}
    return row


def wilson(hits: int, n: int, z: float = 1.959963984540054) -> list[float]:
    """Wilson score interval ``[low, high]`` of a proportion ``hits / n`` (95% for the default ``z``)."""
    if n <= 0 or not 0 <= hits <= n:
        raise ValueError(f"wilson: need 0 <= hits <= n and n > 0, got {hits} of {n}")
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [max(0.0, centre - half), min(1.0, centre + half)]
