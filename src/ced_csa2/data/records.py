"""Corpus records as token rows: reading ``data/corpus/*.jsonl``, tokenising, padding; and checking that a
file of ``prepare``'s was made for the current params."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..assets import digest
from ..config import Params, check_provenance
from ..pipeline.checkpoint import up_to_difference
from ..pipeline.paths import provenance_path

# numpy seed-sequence tag of the dump's record sample (loader.py uses 0-3, training.py 4, objectives.py 5);
# here, not in the dump stage, so that the resource estimate draws the same sample.
DUMP_SAMPLE_STREAM = 6


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file; a byte that is not UTF-8 is named with its file and line."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def check_prepared(params: Params, workdir: Path, *files: Path) -> None:
    """Refuse a file of ``prepare``'s made for other params than ``params`` (a stage run by itself, a copied file).

    Each of ``files`` (paths relative to ``workdir``: ``data/corpus/train.jsonl``, ...) must lie beside
    the record ``prepare`` wrote with it (:func:`ced_csa2.pipeline.paths.provenance_path`), still be the
    bytes that record describes (its sha256), and have been made from what ``params`` says
    (:func:`ced_csa2.config.check_provenance`: the first key that differs, with both values).  It costs
    a hash of each file, so readers call it before they load the model.

    Raises
    ------
    FileNotFoundError
        The file, or its record, is missing.
    ValueError
        The file changed after ``prepare`` wrote it, or (a :class:`~ced_csa2.config.ParamsError`) it was
        made from other params.
    """
    for file in files:
        path, record = workdir / file, workdir / provenance_path(file)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found (run `dvc repro prepare`)")
        if not record.is_file():
            raise FileNotFoundError(f"{path}: has no record of the params it was made from ({record} is missing): "
                                    "rebuild it with `dvc repro prepare`")
        made = json.loads(record.read_text())
        sha256 = digest(path)
        if sha256 != made["sha256"]:
            raise ValueError(f"{path}: its sha256 is {up_to_difference(sha256, made['sha256'])}, not the "
                             f"{up_to_difference(made['sha256'], sha256)} recorded in "
                             f"{record}: the file changed after prepare wrote it (rebuild it with `dvc repro prepare`)")
        check_provenance(path, made["provenance"], params)


def read_records(path: Path) -> list[dict]:
    """Corpus records (``id``, ``source``, ``text``, ``n_tokens``), validated."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: corpus not found (run `dvc repro prepare`)")
    records = []
    for i, line in enumerate(read_lines(path), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{i}: not a JSON object") from None
        missing = {"id", "text", "n_tokens"} - set(rec)
        if missing:
            raise ValueError(f"{path}:{i}: record lacks {sorted(missing)}")
        records.append(rec)
    if not records:
        raise ValueError(f"{path}: corpus is empty")
    return records



def tokenize(tok, records: list[dict], max_tokens: int) -> list[list[int]]:
    """Token ids per record (default special tokens, truncated to ``max_tokens``)."""
    ids = tok([r["text"] for r in records], truncation=True, max_length=max_tokens)["input_ids"]
    for rec, row in zip(records, ids):
        if len(row) != rec["n_tokens"]:
            raise ValueError(f"record {rec['id']!r}: tokenizes to {len(row)} tokens, the corpus says "
                             f"{rec['n_tokens']} (corpus made with another tokenizer? rerun prepare)")
    return ids



def pad_batch(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(B, T_max)`` ids and attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def batches(rows: list[list[int]], batch_size: int, pad_id: int, device, order=None) -> list[tuple]:
    """``(ids, mask)`` ``(B, T)`` batches of ``rows`` (in ``order`` when given), right-padded."""
    order = range(len(rows)) if order is None else order
    rows = [rows[i] for i in order]
    return [tuple(t.to(device) for t in pad_batch(rows[s:s + batch_size], pad_id))
            for s in range(0, len(rows), batch_size)]


def seeded_subset(n_items: int, n: int, seed: int, stream: int) -> list[int]:
    """Indices of a seeded sample of ``n`` of ``n_items`` items, in their original order (0 = all).

    ``stream`` tags the purpose (numpy seed sequence ``[seed, stream]``), so that one
    sample never shifts another.
    """
    if n == 0 or n >= n_items:
        return list(range(n_items))
    return sorted(np.random.default_rng([seed, stream]).permutation(n_items)[:n].tolist())
