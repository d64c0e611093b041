"""Long sequences from a corpus of short records: the records' texts joined in file order, cut into equal pieces."""

from __future__ import annotations

from pathlib import Path

from .records import read_records


def joined_sequences(tok, path: Path, context: int, n: int) -> list[list[int]]:
    """The first ``n`` consecutive ``context``-token sequences of the records of ``path`` joined in file order.

    The texts are joined with blank lines and tokenised once (no special tokens), so a
    sequence may span articles.
    """
    text = "\n\n".join(r["text"] for r in read_records(path))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n * context:
        raise ValueError(f"{path}: its records hold {len(ids)} tokens: fewer than {n} sequences of {context}")
    return [ids[i * context:(i + 1) * context] for i in range(n)]
