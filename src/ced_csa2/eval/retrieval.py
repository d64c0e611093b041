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
* :func:`wilson` is the interval of an accuracy.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

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
def decode_hits(model, make_cache: Callable[[], object], records: Sequence[Passkey]) -> list[bool]:
    """Per record: is the answer the greedy continuation, decoded through a fresh ``make_cache()``?

    ``make_cache()`` returns a cache with a ``feed()`` context (the shared stores of
    :mod:`ced_csa2.runtime.shared_kv`); the prompt is prefilled in one call, then each answer
    token is fed as one decode step, stopping at the first token that is not the argmax.
    """
    device = next(model.parameters()).device
    hits = []
    for r in records:
        cache = make_cache()
        with cache.feed():
            step = torch.tensor([r.prompt], device=device)
            ok = True
            for want in r.answer:
                logits = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
                if int(logits.argmax()) != want:
                    ok = False
                    break
                step = torch.tensor([[want]], device=device)
        hits.append(ok)
    return hits


def wilson(hits: int, n: int, z: float = 1.959963984540054) -> list[float]:
    """Wilson score interval ``[low, high]`` of a proportion ``hits / n`` (95% for the default ``z``)."""
    if n <= 0 or not 0 <= hits <= n:
        raise ValueError(f"wilson: need 0 <= hits <= n and n > 0, got {hits} of {n}")
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [max(0.0, centre - half), min(1.0, centre + half)]
