"""The dump file: token-level hidden states and true K/V in one chunked HDF5 file.

Layout of ``data/dump/dump.h5`` (rows are tokens of the training corpus, records
concatenated in corpus order, no pad positions):

================  ==================  ==============================================
dataset           shape               content
================  ==================  ==============================================
``h_split``       (N, hidden)         output of the split layer, ``H_split``
``k_{l}``         (N, kv_dim)         layer ``l``'s ``k_proj`` output (pre-k_norm, pre-RoPE)
``v_{l}``         (N, kv_dim)         layer ``l``'s ``v_proj`` output
``input_ids``     (N,) int32          the token at each row
``record_offsets`` (R + 1,) int64     rows of record ``r`` are ``[off[r], off[r+1])``
================  ==================  ==============================================

Every 2-D dataset is resizable along rows, uncompressed (activations barely compress
and filters cost 10-20x in write speed), with chunks of a power-of-two number of rows
across the full width, sized to ``chunk_kib`` -- so a reader can fetch chunk-aligned
blocks of ``block_rows`` (a multiple of every dataset's chunk rows) without fancy
indexing.  Attributes record the model, plan, dtypes, injection point and tokenizer.

The writer appends whole records and flushes after each append; the attribute
``n_records`` says how many are complete, so a killed run resumes at record
granularity.  The file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import h5py
import numpy as np

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class DumpError(ValueError):
    """A dump file is missing, truncated, corrupt or does not match what was asked for."""


def chunk_rows(width: int, itemsize: int, chunk_kib: int) -> int:
    """Largest power-of-two row count whose ``rows x width`` chunk fits in ``chunk_kib`` KiB."""
    rows = max(1, (chunk_kib * 1024) // (width * itemsize))
    return 1 << (rows.bit_length() - 1)


@dataclass(frozen=True)
class DumpLayout:
    """Which datasets a dump holds and how wide they are."""

    hidden_size: int
    kv_dim: int
    kv_layers: tuple[int, ...]
    storage_dtype: str = "float32"

    def widths(self) -> dict[str, int]:
        out = {"h_split": self.hidden_size}
        for layer in self.kv_layers:
            out[f"k_{layer}"] = self.kv_dim
            out[f"v_{layer}"] = self.kv_dim
        return out

    @property
    def np_dtype(self) -> np.dtype:
        # HDF5/numpy have no bfloat16: store its bits as uint16 (reader views them back).
        return np.dtype(np.uint16) if self.storage_dtype == "bfloat16" else np.dtype(self.storage_dtype)


class DumpWriter:
    """Append records to ``final_path``'s temporary sibling; resume it when its fingerprint matches.

    Parameters
    ----------
    final_path
        Where the complete file goes (renamed into place by :meth:`finalize`).
    partial_path
        The temporary file (kept outside DVC outputs, which DVC deletes before a run).
    layout, chunk_kib
        Datasets and chunk size.
    attrs
        Attributes stored on the file; ``attrs["fingerprint"]`` decides whether an
        existing partial file can be resumed.
    """

    def __init__(self, final_path: Path, partial_path: Path, layout: DumpLayout, chunk_kib: int,
                 attrs: Mapping):
        self.final_path, self.partial_path, self.layout = Path(final_path), Path(partial_path), layout
        self.f = self._resume(attrs) or self._create(attrs, chunk_kib)

    def _resume(self, attrs):
        if not self.partial_path.exists():
            return None
        try:
            f = h5py.File(self.partial_path, "r+")
            same = f.attrs.get("fingerprint") == attrs["fingerprint"]
            n = int(f.attrs["n_records"]) if same else 0
        except (OSError, KeyError) as exc:
            log.warning("partial dump %s is unreadable (%s); starting over", self.partial_path, exc)
            self.partial_path.unlink()
            return None
        if not same:
            log.warning("partial dump %s was made with other inputs or params; starting over", self.partial_path)
            f.close()
            self.partial_path.unlink()
            return None
        # Drop rows of a record that was being written when the run stopped.
        rows = int(f["record_offsets"][n])
        for name in [*self.layout.widths(), "input_ids"]:
            f[name].resize(rows, axis=0)
        f["record_offsets"].resize(n + 1, axis=0)
        log.info("resuming %s after %d complete records (%d tokens)", self.partial_path, n, rows)
        return f

    def _create(self, attrs, chunk_kib):
        self.partial_path.parent.mkdir(parents=True, exist_ok=True)
        f = h5py.File(self.partial_path, "w")
        dt = self.layout.np_dtype
        for name, width in self.layout.widths().items():
            f.create_dataset(name, shape=(0, width), maxshape=(None, width), dtype=dt,
                             chunks=(chunk_rows(width, dt.itemsize, chunk_kib), width))
        f.create_dataset("input_ids", shape=(0,), maxshape=(None,), dtype=np.int32, chunks=(65536,))
        f.create_dataset("record_offsets", data=np.zeros(1, np.int64), maxshape=(None,), chunks=(4096,))
        for k, v in attrs.items():
            f.attrs[k] = v
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["layout"] = json.dumps(self.layout.__dict__ | {"kv_layers": list(self.layout.kv_layers)})
        f.attrs["n_records"] = 0
        f.attrs["complete"] = False
        return f

    @property
    def n_records(self) -> int:
        return int(self.f.attrs["n_records"])

    def append(self, arrays: Mapping[str, np.ndarray], input_ids: np.ndarray, lengths: list[int]) -> None:
        """Append whole records: ``arrays[name]`` is ``(sum(lengths), width)`` rows in record order."""
        n_rows = int(sum(lengths))
        start = int(self.f["record_offsets"][-1])
        for name in self.layout.widths():
            ds = self.f[name]
            ds.resize(start + n_rows, axis=0)
            ds[start:] = arrays[name]
        self.f["input_ids"].resize(start + n_rows, axis=0)
        self.f["input_ids"][start:] = input_ids
        offs = self.f["record_offsets"]
        old = offs.shape[0]
        offs.resize(old + len(lengths), axis=0)
        offs[old:] = start + np.cumsum(lengths)
        # The record count goes last: a kill before this line leaves the batch uncounted.
        self.f.attrs["n_records"] = old - 1 + len(lengths)
        self.f.flush()

    def finalize(self) -> Path:
        self.f.attrs["complete"] = True
        self.f.close()
        self.final_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.partial_path, self.final_path)
        return self.final_path

    def close(self) -> None:
        """Close without finalising (the partial file stays resumable)."""
        self.f.close()


class DumpReader:
    """A validated, read-only view of a complete dump file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DumpError(f"{self.path}: dump file not found (run `dvc repro dump`)")
        try:
            sys.audit("ced_csa2.read", str(self.path))  # h5py opens in C: no "open" audit event
            self.f = h5py.File(self.path, "r")
            attrs = dict(self.f.attrs)
        except OSError as exc:
            raise DumpError(f"{self.path}: not a readable HDF5 file (truncated or corrupt?): {exc}") from None
        try:
            self._validate(attrs)
        except DumpError:
            self.f.close()
            raise

    def _validate(self, attrs):
        if attrs.get("format_version") != FORMAT_VERSION:
            raise DumpError(f"{self.path}: format_version {attrs.get('format_version')!r}, expected {FORMAT_VERSION}")
        if not attrs.get("complete"):
            raise DumpError(f"{self.path}: dump is incomplete (the writing run did not finish)")
        lay = json.loads(attrs["layout"])
        self.layout = DumpLayout(lay["hidden_size"], lay["kv_dim"], tuple(lay["kv_layers"]), lay["storage_dtype"])
        self.attrs = attrs
        try:
            offs = self.f["record_offsets"][:]
            sizes = {name: self.f[name].shape for name in [*self.layout.widths(), "input_ids"]}
        except (KeyError, OSError) as exc:
            raise DumpError(f"{self.path}: a dataset is missing or unreadable: {exc}") from None
        if len(offs) != int(attrs["n_records"]) + 1 or offs[0] != 0 or np.any(np.diff(offs) <= 0):
            raise DumpError(f"{self.path}: record_offsets is inconsistent with n_records={attrs['n_records']}")
        for name, shape in sizes.items():
            if shape[0] != offs[-1]:
                raise DumpError(f"{self.path}: dataset '{name}' has {shape[0]} rows, record_offsets says {offs[-1]}")
        self.record_offsets = offs

    @property
    def n_records(self) -> int:
        return len(self.record_offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.record_offsets[-1])

    @property
    def block_rows(self) -> int:
        """Smallest row count that is chunk-aligned for every dataset."""
        return max(self.f[name].chunks[0] for name in self.layout.widths())

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of dataset ``name`` as float32 (bf16 bits widened exactly)."""
        a = self.f[name][start:stop]
        if self.layout.storage_dtype == "bfloat16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32, copy=False)

    def check(self, *, kv_layers=None, hidden_size=None, kv_dim=None) -> "DumpReader":
        """Raise naming both values when the dump does not hold what a stage needs."""
        lay = self.layout
        if kv_layers is not None and not set(kv_layers) <= set(lay.kv_layers):
            raise DumpError(f"{self.path}: holds K/V of layers {list(lay.kv_layers)}, the plan needs {sorted(kv_layers)}")
        if hidden_size is not None and hidden_size != lay.hidden_size:
            raise DumpError(f"{self.path}: hidden size {lay.hidden_size}, the model has {hidden_size}")
        if kv_dim is not None and kv_dim != lay.kv_dim:
            raise DumpError(f"{self.path}: kv_dim {lay.kv_dim}, the model has {kv_dim}")
        return self

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
