"""Teacher-forced negative log-likelihood of token sequences, batched without counting pads."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


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
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        # logits at position t-1 predict token t
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:].to(device), reduction="none").cpu()
        keep = scored[:, 1:]
        out[start:start + len(rows), 0] = (nll.double() * keep).sum(1)
        out[start:start + len(rows), 1] = keep.sum(1)
    return out
