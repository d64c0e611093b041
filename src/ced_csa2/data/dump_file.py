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
and filters cost many times the write time: ``docs/costs.md``), with chunks of a power-of-two number of rows
across the full width, sized to ``chunk_kib`` -- so a reader can fetch chunk-aligned
blocks of ``block_rows`` (a multiple of every dataset's chunk rows) without fancy
indexing.  Attributes record the model, plan, dtypes, injection point and tokenizer.

The writer appends whole records and flushes after each append; the attribute
``n_records`` says how many are complete, so a killed run resumes at record
granularity.  The file is written under a temporary name and renamed when complete.

**Integrity.**  Every dataset carries the attribute ``checksums``: a ``uint64`` array
``[rows covered, crc_0, crc_1, ...]`` where ``crc_j`` is the CRC32 of the bytes of rows
``[j*B, (j+1)*B)`` (the last block may be shorter) and ``B`` is the file attribute
``checksum_rows`` (= :attr:`DumpReader.block_rows`, the readers' unit, so verification
costs no extra read).  The writer computes them from the arrays it is about to write
and refuses non-finite values before writing anything (naming the dataset and rows);
:class:`DumpReader` verifies each block the first time it is read (CRC, then
finiteness) and raises :class:`DumpError` naming the file, the dataset and the rows,
so corrupt bytes never reach a model.  A resumed partial file is verified up to its
last complete record before anything is appended.

**Failures.**  The writer keeps no chunk cache (a write error surfaces at the write,
and HDF5 is never left holding dirty chunks it cannot flush -- that used to end in a
segmentation fault at exit).  An I/O error (full disk, file-size limit) raises
:class:`DumpWriteError`; the partial file is kept only if it still opens with its
complete records (the next run verifies and resumes it), otherwise it is removed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import h5py
import numpy as np

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: per-block CRC32 checksums on every dataset (module docstring)
CHECKSUM = "crc32"
CHECKSUM_ATTR = "checksums"
# Lower bound HDF5 1.8: dense attribute storage, so a checksum list may exceed the 64 KiB of a
# compact attribute (a dump of more than ~8k blocks, e.g. the full profile's beyond ~1M rows).
LIBVER = ("v108", "latest")
# What h5py raises when the HDF5 library fails to read, write, flush or close.
IO_ERRORS = (OSError, RuntimeError)
_VERIFY_READ_BYTES = 32 << 20  # DumpReader.verify reads this much per call


class DumpError(ValueError):
    """A dump file is missing, truncated, corrupt or does not match what was asked for."""


class DumpWriteError(DumpError):
    """Writing the dump failed (full disk, file-size limit, I/O error); the message says what was kept."""


def os_reason(exc: BaseException) -> str:
    """The OS error behind an h5py/OS exception on one line, e.g. ``[Errno 28] No space left on device``."""
    code = getattr(exc, "errno", None)
    if not code:
        found = re.search(r"errno = (\d+)", str(exc))
        code = int(found.group(1)) if found else None
    if code:
        return f"[Errno {code}] {os.strerror(code)}"
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def nonfinite_rows(a: np.ndarray, storage_dtype: str) -> np.ndarray:
    """Indices of the rows of ``a`` (on-disk dtype; bf16 as uint16 bits) holding a NaN or ±Inf."""
    if storage_dtype == "bfloat16":
        bad = (a & 0x7F80) == 0x7F80  # exponent all ones
        if not bad.any():
            return np.zeros(0, np.int64)
    else:
        finite = np.isfinite(a)
        if finite.all():
            return np.zeros(0, np.int64)
        bad = ~finite
    return np.flatnonzero(bad.reshape(len(a), -1).any(axis=1))


class BlockCrc:
    """CRC32 per block of ``block`` rows of one dataset, appended to row by row.

    ``crcs[j]`` covers rows ``[j*block, min((j+1)*block, rows))``; the last entry is the
    running CRC of a block still being filled.  :meth:`encode` is the ``checksums``
    attribute: ``[rows, crc_0, crc_1, ...]`` as ``uint64``.
    """

    def __init__(self, block: int, rows: int = 0, crcs=()):
        self.block, self.rows, self.crcs = int(block), int(rows), [int(c) for c in crcs]

    def update(self, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data)
        i, n = 0, len(data)
        while i < n:
            offset = self.rows % self.block
            take = min(n - i, self.block - offset)
            piece = data[i:i + take]
            if offset == 0:
                self.crcs.append(zlib.crc32(piece))
            else:
                self.crcs[-1] = zlib.crc32(piece, self.crcs[-1])
            self.rows += take
            i += take

    def encode(self) -> np.ndarray:
        return np.array([self.rows, *self.crcs], dtype=np.uint64)

    @staticmethod
    def decode(value) -> tuple[int, np.ndarray]:
        """``(rows covered, crcs)`` of a ``checksums`` attribute."""
        value = np.asarray(value, dtype=np.uint64).ravel()
        if value.size == 0:
            raise ValueError("empty checksums attribute")
        return int(value[0]), value[1:]


def check_block(path, name: str, data: np.ndarray, want: int, first_row: int, storage_dtype: str | None) -> None:
    """Raise :class:`DumpError` unless ``data`` (rows from ``first_row``) has CRC32 ``want`` and, when
    ``storage_dtype`` is given (a float dataset), only finite values."""
    got = zlib.crc32(np.ascontiguousarray(data))
    rows = f"rows [{first_row}, {first_row + len(data)})"
    if got != int(want):
        raise DumpError(f"{path}: dataset '{name}' {rows} fail their {CHECKSUM} checksum (stored {int(want):08x}, "
                        f"read {got:08x}): the file is corrupt; restore it (`dvc checkout -f`) or recompute it "
                        f"(`dvc repro -f dump`)")
    if storage_dtype is not None:
        bad = nonfinite_rows(data, storage_dtype)
        if bad.size:
            raise DumpError(f"{path}: dataset '{name}' holds non-finite values (NaN/Inf) at rows "
                            f"[{first_row + int(bad[0])}, {first_row + int(bad[-1]) + 1}); refusing to use it "
                            f"(recompute it with `dvc repro -f dump`)")


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

    def datasets(self, chunk_kib: int) -> dict[str, tuple[int, np.dtype, int]]:
        """Every dataset as :class:`DumpWriter` creates it: ``(width, dtype, rows per chunk)`` (width 0: 1-D)."""
        dt = self.np_dtype
        out = {name: (width, dt, chunk_rows(width, dt.itemsize, chunk_kib)) for name, width in self.widths().items()}
        return out | {"input_ids": (0, np.dtype(np.int32), 65536), "record_offsets": (0, np.dtype(np.int64), 4096)}

    def nbytes(self, rows: int, records: int, chunk_kib: int) -> tuple[int, int]:
        """``(payload, allocated)`` bytes of the datasets of a dump of ``rows`` tokens in ``records`` records.

        ``payload`` is the sum of the datasets' ``nbytes``; ``allocated`` what HDF5 stores for
        them, whole chunks (``Dataset.id.get_storage_size()``).  The file adds its metadata.
        """
        payload = allocated = 0
        for name, (width, dt, chunk) in self.datasets(chunk_kib).items():
            n = records + 1 if name == "record_offsets" else rows
            row_bytes = max(width, 1) * dt.itemsize
            payload += n * row_bytes
            allocated += -(-n // chunk) * chunk * row_bytes
        return payload, allocated


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

    Raises
    ------
    DumpError
        From :meth:`append`, for non-finite values (nothing is written and the partial
        file is removed: the same inputs would produce them again).
    DumpWriteError
        From any method, when the file system fails (full disk, file-size limit, I/O
        error); the partial file is kept when it still opens with its complete
        records (the next run verifies and resumes it) and removed otherwise.
    """

    def __init__(self, final_path: Path, partial_path: Path, layout: DumpLayout, chunk_kib: int,
                 attrs: Mapping):
        self.final_path, self.partial_path, self.layout = Path(final_path), Path(partial_path), layout
        self.f = None
        self._names = [*layout.widths(), "input_ids", "record_offsets"]
        with self._io("opening"):
            self.f = self._resume(attrs) or self._create(attrs, chunk_kib)

    def _open(self, mode: str):
        # rdcc_nbytes=0: no chunk cache, so nothing is left dirty when a write fails.
        return h5py.File(self.partial_path, mode, libver=LIBVER, rdcc_nbytes=0)

    def _resume(self, attrs):
        if not self.partial_path.exists():
            return None
        try:
            f = self._open("r+")
        except IO_ERRORS as exc:
            log.warning("partial dump %s is unreadable (%s); starting over", self.partial_path, os_reason(exc))
            self.partial_path.unlink()
            return None
        try:
            same = (f.attrs.get("fingerprint") == attrs["fingerprint"]
                    and f.attrs.get("format_version") == FORMAT_VERSION)
            if same:
                n = int(f.attrs["n_records"])
                rows = int(f["record_offsets"][n])
                self.block = int(f.attrs["checksum_rows"])
                self._crc = {name: self._recover(f, name, n + 1 if name == "record_offsets" else rows)
                             for name in self._names}
        except (*IO_ERRORS, KeyError, ValueError, IndexError) as exc:  # DumpError is a ValueError
            log.warning("partial dump %s is unreadable or fails its checksums (%s); starting over",
                        self.partial_path, " ".join(str(exc).split())[:300])
            with contextlib.suppress(*IO_ERRORS):
                f.close()
            self.partial_path.unlink()
            return None
        if not same:
            log.warning("partial dump %s was made with other inputs or params; starting over", self.partial_path)
            f.close()
            self.partial_path.unlink()
            return None
        # Drop rows of a record that was being written when the run stopped.
        for name in [*self.layout.widths(), "input_ids"]:
            f[name].resize(rows, axis=0)
        f["record_offsets"].resize(n + 1, axis=0)
        log.info("resuming %s after %d complete records (%d tokens, verified)", self.partial_path, n, rows)
        return f

    def _recover(self, f, name: str, kept: int) -> BlockCrc:
        """Verify the complete blocks of ``name``'s first ``kept`` rows; recompute the CRC of the last one.

        The stored checksums may cover more rows than the last complete record (a kill after
        they were written, before ``n_records``): blocks wholly below ``kept`` are verified
        against them, the block ``kept`` falls in is recomputed from the file.
        """
        ds = f[name]
        covered, crcs = BlockCrc.decode(ds.attrs[CHECKSUM_ATTR])
        if ds.shape[0] < kept or covered > ds.shape[0]:
            raise ValueError(f"dataset '{name}' has {ds.shape[0]} rows, its checksums cover {covered}, "
                             f"{kept} are complete")
        done = min(covered, kept) // self.block
        dtype = self.layout.storage_dtype if name in self.layout.widths() else None
        step = max(1, _VERIFY_READ_BYTES // max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:])) * self.block))
        for j0 in range(0, done, step):
            j1 = min(done, j0 + step)
            data = ds[j0 * self.block:j1 * self.block]
            for j in range(j0, j1):
                check_block(self.partial_path, name, data[(j - j0) * self.block:(j - j0 + 1) * self.block],
                            crcs[j], j * self.block, dtype)
        state = BlockCrc(self.block, done * self.block, crcs[:done])
        if kept > state.rows:
            state.update(ds[state.rows:kept])
        return state

    def _create(self, attrs, chunk_kib):
        self.partial_path.parent.mkdir(parents=True, exist_ok=True)
        f = self._open("w")
        sets = self.layout.datasets(chunk_kib)
        # DumpReader.block_rows: a multiple of every 2-D dataset's chunk rows
        self.block = max(sets[name][2] for name in self.layout.widths())
        for name, width in self.layout.widths().items():
            _, dt, rows = sets[name]
            f.create_dataset(name, shape=(0, width), maxshape=(None, width), dtype=dt, chunks=(rows, width))
        for name, first in (("input_ids", []), ("record_offsets", [0])):  # offsets start with record 0's
            _, dt, rows = sets[name]
            f.create_dataset(name, data=np.array(first, dt), maxshape=(None,), chunks=(rows,))
        for k, v in attrs.items():
            f.attrs[k] = v
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["layout"] = json.dumps(self.layout.__dict__ | {"kv_layers": list(self.layout.kv_layers)})
        f.attrs["checksum"] = CHECKSUM
        f.attrs["checksum_rows"] = self.block
        self._crc = {name: BlockCrc(self.block) for name in self._names}
        self._crc["record_offsets"].update(np.zeros(1, np.int64))
        for name in self._names:
            f[name].attrs[CHECKSUM_ATTR] = self._crc[name].encode()
        f.attrs["n_records"] = 0
        f.attrs["complete"] = False
        return f

    @property
    def n_records(self) -> int:
        return int(self.f.attrs["n_records"])

    def append(self, arrays: Mapping[str, np.ndarray], input_ids: np.ndarray, lengths: list[int]) -> None:
        """Append whole records: ``arrays[name]`` is ``(sum(lengths), width)`` rows in record order."""
        n_rows = int(sum(lengths))
        old = self._crc["record_offsets"].rows  # = len(record_offsets): records so far + 1
        start = self._crc["input_ids"].rows
        # In the on-disk dtype first, so that the checks and the CRC see the bytes that are written.
        arrays = {name: np.ascontiguousarray(arrays[name], dtype=self.layout.np_dtype) for name in self.layout.widths()}
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int32)
        for name in self.layout.widths():
            bad = nonfinite_rows(arrays[name], self.layout.storage_dtype)
            if bad.size:
                ends = np.cumsum(lengths)
                first, last = (old - 1 + int(np.searchsorted(ends, r, side="right")) for r in (bad[0], bad[-1]))
                self.abort(discard=True)
                raise DumpError(f"{self.final_path}: refusing to write non-finite values (NaN/Inf) to dataset "
                                f"'{name}' at rows [{start + int(bad[0])}, {start + int(bad[-1]) + 1}) (records "
                                f"{first}..{last}): the model produced them (an overflow in model.dtype?); nothing "
                                f"was written and the partial dump {self.partial_path} was removed")
        offsets = start + np.cumsum(lengths)
        with self._io("writing"):
            for name in self.layout.widths():
                ds = self.f[name]
                ds.resize(start + n_rows, axis=0)
                ds[start:] = arrays[name]
                self._crc[name].update(arrays[name])
            self.f["input_ids"].resize(start + n_rows, axis=0)
            self.f["input_ids"][start:] = input_ids
            self._crc["input_ids"].update(input_ids)
            offs = self.f["record_offsets"]
            offs.resize(old + len(lengths), axis=0)
            offs[old:] = offsets
            self._crc["record_offsets"].update(offsets.astype(np.int64))
            # Checksums before the record count: a kill in between leaves them covering rows that
            # resume drops again (DumpWriter._recover recomputes that block).
            for name in self._names:
                self.f[name].attrs[CHECKSUM_ATTR] = self._crc[name].encode()
            # The record count goes last: a kill before this line leaves the batch uncounted.
            self.f.attrs["n_records"] = old - 1 + len(lengths)
            self.f.flush()

    def finalize(self) -> Path:
        with self._io("finishing"):
            self.f.attrs["complete"] = True
            f, self.f = self.f, None
            f.close()
            with open(self.partial_path, "rb") as fh:
                os.fsync(fh.fileno())
            self.final_path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.partial_path, self.final_path)
        return self.final_path

    def close(self) -> None:
        """Close without finalising (the partial file stays resumable)."""
        if self.f is not None:
            f, self.f = self.f, None
            f.close()

    def abort(self, *, discard: bool = False) -> None:
        """After a failure elsewhere: close quietly, keeping the partial file for a resume unless ``discard``."""
        with contextlib.suppress(*IO_ERRORS):
            self.close()
        self.f = None
        if discard:
            with contextlib.suppress(FileNotFoundError):
                self.partial_path.unlink()

    @contextlib.contextmanager
    def _io(self, doing: str):
        """Turn a file-system failure inside the block into :class:`DumpWriteError`, after :meth:`_salvage`."""
        try:
            yield
        except IO_ERRORS as exc:
            kept = self._salvage()
            raise DumpWriteError(f"{self.final_path}: {doing} {self.partial_path} failed: {os_reason(exc)}; "
                                 f"{kept}") from None

    def _salvage(self) -> str:
        """Close after a failed write; keep the partial file only if it still opens with its complete records."""
        closed = self.f is None
        for _ in range(3):  # a close that failed to flush can succeed when retried (HDF5 gave up on the data)
            if closed:
                break
            try:
                self.f.close()
                closed = True
            except IO_ERRORS:
                continue
        self.f = None
        n = committed_records(self.partial_path) if closed else None
        if n is None:
            with contextlib.suppress(FileNotFoundError):
                self.partial_path.unlink()
            return "the partial dump was unreadable after the failure and was removed (the next run starts over)"
        return (f"the partial dump keeps {n} complete records (the next run verifies them and resumes there); "
                f"free some space and re-run")


def copy_records(reader: DumpReader, writer: DumpWriter, first: int = 0) -> None:
    """Append ``reader``'s records from ``first`` on to ``writer``, verified, about ``_VERIFY_READ_BYTES`` at a time.

    The bytes are copied in the on-disk dtype, and ``writer`` recomputes their checksums on
    its own row grid (how a data-parallel dump's shards become one dump).
    """
    offs, widths = reader.record_offsets, reader.layout.widths()
    row_bytes = reader.layout.np_dtype.itemsize * sum(widths.values())
    rows = max(1, _VERIFY_READ_BYTES // row_bytes)
    a = first
    while a < reader.n_records:
        # Whole records, at least one, of at most `rows` rows together.
        b = min(reader.n_records, max(a + 1, int(np.searchsorted(offs, offs[a] + rows, side="right")) - 1))
        lo, hi = int(offs[a]), int(offs[b])
        writer.append({name: reader.stored(name, lo, hi) for name in widths}, reader.stored("input_ids", lo, hi),
                      np.diff(offs[a:b + 1]).tolist())
        a = b


def committed_records(path: Path) -> int | None:
    """How many complete records a partial dump holds, or ``None`` when it does not open consistently."""
    try:
        with h5py.File(path, "r") as f:
            n = int(f.attrs["n_records"])
            offs = f["record_offsets"]
            if offs.shape[0] < n + 1:
                return None
            rows = int(offs[n])
            if any(f[name].shape[0] < rows for name in f if name != "record_offsets"):
                return None
            return n
    except Exception:  # noqa: BLE001 -- any failure to read it back means it cannot be resumed
        return None


def dump_provenance(path: str | Path) -> dict:
    """:meth:`DumpReader.provenance` of the dump at ``path``: what an artifact computed from it records."""
    with DumpReader(path) as reader:
        return reader.provenance()


class DumpReader:
    """A validated, read-only view of a complete dump file.

    Opening checks the format, the record offsets and that every dataset has checksums
    covering its rows, and verifies ``record_offsets`` and ``input_ids``; the float
    datasets are verified block by block the first time :meth:`rows` reads them (CRC32,
    then finiteness), or all at once by :meth:`verify`.  ``verify=False`` skips every
    checksum (benchmarks only: it lets corrupt bytes through).
    """

    def __init__(self, path: str | Path, *, verify: bool = True):
        self.path = Path(path)
        self.verify_reads = verify
        if not self.path.is_file():
            raise DumpError(f"{self.path}: dump file not found (run `dvc repro dump`)")
        try:
            sys.audit("ced_csa2.read", str(self.path))  # h5py opens in C: no "open" audit event
            self.f = h5py.File(self.path, "r")
        except IO_ERRORS as exc:
            raise DumpError(f"{self.path}: not a readable HDF5 file (truncated or corrupt?): {exc}") from None
        try:
            self._validate(dict(self.f.attrs))
        except DumpError:
            self.f.close()
            raise
        except (KeyError, TypeError, ValueError, *IO_ERRORS) as exc:  # HDF5 metadata that does not parse
            self.f.close()
            raise DumpError(f"{self.path}: not a readable dump (truncated or corrupt?): "
                            f"{' '.join(str(exc).split())[:300]}") from None

    def _validate(self, attrs):
        version = attrs.get("format_version")
        if version != FORMAT_VERSION:
            shown = version.item() if hasattr(version, "item") else version  # numpy scalar -> plain
            raise DumpError(f"{self.path}: format_version {shown!r}, expected {FORMAT_VERSION} (written by another "
                            f"version of ced_csa2; recompute it: `dvc repro -f dump`)")
        if not attrs.get("complete"):
            raise DumpError(f"{self.path}: dump is incomplete (the writing run did not finish)")
        lay = json.loads(attrs["layout"])
        self.layout = DumpLayout(lay["hidden_size"], lay["kv_dim"], tuple(lay["kv_layers"]), lay["storage_dtype"])
        self.attrs = attrs
        try:
            offs = self.f["record_offsets"][:]
            sizes = {name: self.f[name].shape for name in [*self.layout.widths(), "input_ids", "record_offsets"]}
        except (KeyError, *IO_ERRORS) as exc:
            raise DumpError(f"{self.path}: a dataset is missing or unreadable: {exc}") from None
        if attrs.get("checksum") != CHECKSUM or "checksum_rows" not in attrs:
            raise DumpError(f"{self.path}: has no {CHECKSUM} checksums (attribute 'checksum'); recompute it "
                            f"(`dvc repro -f dump`)")
        self.checksum_rows = int(attrs["checksum_rows"])
        self._n = {name: shape[0] for name, shape in sizes.items()}
        self._crcs, self._verified = {}, {}
        self._load_checksums("record_offsets")
        if self.verify_reads:  # before trusting the offsets
            for j in range(len(self._crcs["record_offsets"])):
                lo = j * self.checksum_rows
                check_block(self.path, "record_offsets", offs[lo:lo + self.checksum_rows],
                            self._crcs["record_offsets"][j], lo, None)
            self._verified["record_offsets"][:] = True
        if len(offs) != int(attrs["n_records"]) + 1 or offs[0] != 0 or np.any(np.diff(offs) <= 0):
            raise DumpError(f"{self.path}: record_offsets is inconsistent with n_records={attrs['n_records']}")
        for name, shape in sizes.items():
            if name != "record_offsets" and shape[0] != offs[-1]:
                raise DumpError(f"{self.path}: dataset '{name}' has {shape[0]} rows, record_offsets says {offs[-1]}")
        for name in [*self.layout.widths(), "input_ids"]:
            self._load_checksums(name)
        self.record_offsets = offs
        if self.verify_reads:
            self.verify(["input_ids"])

    def _load_checksums(self, name: str) -> None:
        try:
            covered, crcs = BlockCrc.decode(self.f[name].attrs[CHECKSUM_ATTR])
        except (KeyError, ValueError, *IO_ERRORS):
            raise DumpError(f"{self.path}: dataset '{name}' has no readable '{CHECKSUM_ATTR}' attribute; recompute "
                            f"the dump (`dvc repro -f dump`)") from None
        n, blocks = self._n[name], -(-self._n[name] // self.checksum_rows)
        if covered != n or len(crcs) != blocks:
            raise DumpError(f"{self.path}: dataset '{name}' has {n} rows but its checksums cover {covered} rows "
                            f"in {len(crcs)} blocks (truncated or corrupt?)")
        self._crcs[name] = crcs
        self._verified[name] = np.zeros(blocks, dtype=bool)

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
        """Rows ``[start, stop)`` of dataset ``name`` as float32 (bf16 bits widened exactly), verified."""
        a = self.stored(name, start, stop)
        if self.layout.storage_dtype == "bfloat16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32, copy=False)

    def _raw(self, name: str, start: int, stop: int) -> np.ndarray:
        try:
            return self.f[name][start:stop]
        except (KeyError, *IO_ERRORS) as exc:
            raise DumpError(f"{self.path}: dataset '{name}' rows [{start}, {stop}) cannot be read (corrupt file?): "
                            f"{os_reason(exc)}") from None

    def stored(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` in the on-disk dtype; blocks not yet verified are read whole and verified."""
        n = self._n[name]
        start, stop = min(max(int(start), 0), n), min(max(int(stop), 0), n)
        stop = max(start, stop)
        if not self.verify_reads:
            return self._raw(name, start, stop)
        return self._read_verified(name, start, stop)

    def _read_verified(self, name: str, start: int, stop: int) -> np.ndarray:
        n = self._n[name]
        if start >= stop:
            return self._raw(name, start, stop)
        B, done = self.checksum_rows, self._verified[name]
        b0, b1 = start // B, -(-stop // B)
        if done[b0:b1].all():
            return self._raw(name, start, stop)
        lo = b0 * B
        data = self._raw(name, lo, min(b1 * B, n))
        dtype = self.layout.storage_dtype if name in self.layout.widths() else None
        for j in range(b0, b1):
            if not done[j]:
                check_block(self.path, name, data[j * B - lo:(j + 1) * B - lo], self._crcs[name][j], j * B, dtype)
                done[j] = True
        return data[start - lo:stop - lo]

    def verify(self, names=None) -> DumpReader:
        """Verify every block of ``names`` (default: every dataset) now; raise :class:`DumpError` at the first bad one."""
        for name in self._n if names is None else names:
            if name not in self._n:
                raise DumpError(f"{self.path}: has no dataset '{name}'")
            ds = self.f[name]
            row_bytes = ds.dtype.itemsize * int(np.prod(ds.shape[1:]))
            step = self.checksum_rows * max(1, _VERIFY_READ_BYTES // max(1, row_bytes * self.checksum_rows))
            for start in range(0, self._n[name], step):
                self._read_verified(name, start, min(start + step, self._n[name]))
        return self

    def provenance(self) -> dict:
        """The params the dump was made from (``attrs["provenance"]``; ``{}`` for a file written without)."""
        return json.loads(self.attrs["provenance"]) if "provenance" in self.attrs else {}

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
