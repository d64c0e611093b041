"""Training data from the dump: record splits, row masks and block-shuffled batches.

Rows are never fetched one by one.  Every read is a contiguous slice of ``block_rows``
rows starting at a multiple of the dump's chunk-aligned :attr:`DumpReader.block_rows`,
so h5py reads whole chunks (per-row fancy indexing is far slower; the figure:
``docs/design.md`` §5).  Randomness comes from permuting the *order* of blocks
and then the rows inside an in-memory buffer of several blocks.

Which rows take part is a boolean mask over all rows of the dump: :func:`record_split`
splits whole records into train/validation (no record contributes to both), and
:func:`row_mask` turns a set of records into a mask, optionally sampling a fixed number
of tokens per record.

Random streams: each use draws from ``numpy.random.default_rng([seed, STREAM, ...])``
with its own ``STREAM`` tag, so changing one use never moves the others.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from .dump_file import DumpError, DumpReader

log = logging.getLogger(__name__)

_SPLIT_STREAM, _ROWS_STREAM, _ORDER_STREAM, _BUFFER_STREAM = 0, 1, 2, 3


# ----------------------------------------------------------------------------- which rows

def record_split(n_records: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split record indices into train and validation sets, seeded.

    Parameters
    ----------
    n_records
        Number of records (at least 2).
    val_fraction
        Fraction of records held out; rounded, at least one record on each side.
    seed
        Seed of the permutation.

    Returns
    -------
    train, val
        Disjoint sorted ``int64`` arrays whose union is ``range(n_records)``.
    """
    if n_records < 2:
        raise ValueError(f"record_split needs at least 2 records to hold one out, got {n_records}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"record_split val_fraction must be in (0, 1), got {val_fraction}")
    n_val = min(n_records - 1, max(1, round(n_records * val_fraction)))
    perm = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(n_records)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def row_mask(record_offsets: np.ndarray, records: Sequence[int], tokens_per_record: int, seed: int) -> np.ndarray:
    """Boolean mask over all rows selecting the rows of ``records``.

    Parameters
    ----------
    record_offsets
        ``(R + 1,)`` row offsets; record ``r`` is rows ``[off[r], off[r+1])``.
    records
        Indices of the records to keep.
    tokens_per_record
        ``0``: every row of each kept record.  ``k > 0``: ``k`` rows per record drawn
        uniformly without replacement (all rows of a shorter record).  The draw for a
        record depends only on ``seed`` and the record, not on which other records are
        kept.
    seed
        Seed of the draw.

    Returns
    -------
    mask
        ``(N,)`` bool, ``N = off[-1]``.
    """
    offs = np.asarray(record_offsets, dtype=np.int64)
    lengths = np.diff(offs)
    records = np.asarray(records, dtype=np.int64)
    if records.size and (records.min() < 0 or records.max() >= len(lengths)):
        raise ValueError(f"row_mask: record index out of range 0..{len(lengths) - 1}")
    record_of_row = np.repeat(np.arange(len(lengths)), lengths)
    kept = np.zeros(len(lengths), dtype=bool)
    kept[records] = True
    mask = kept[record_of_row]
    if tokens_per_record > 0:
        # One random key per row of the whole dump; within each record the rows with the
        # k smallest keys win.  Vectorised, and independent of the other kept records.
        keys = np.random.default_rng([seed, _ROWS_STREAM]).random(len(record_of_row))
        order = np.lexsort((keys, record_of_row))
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order)) - offs[record_of_row[order]]
        mask &= rank < tokens_per_record
    return mask


# ----------------------------------------------------------------------------- block reads

def aligned_block_rows(reader: DumpReader, rows: int = 0) -> int:
    """Smallest multiple of ``reader.block_rows`` that is at least ``rows`` (at least one block)."""
    unit = reader.block_rows
    return unit * max(1, math.ceil(rows / unit))


def block_counts(mask: np.ndarray, block_rows: int) -> np.ndarray:
    """Masked rows in each ``block_rows``-row block of the dump, ``(ceil(N / block_rows),)`` int64."""
    starts = np.arange(0, len(mask), block_rows)
    return np.add.reduceat(mask.astype(np.int64), starts) if len(starts) else np.zeros(0, np.int64)


def active_blocks(mask: np.ndarray, block_rows: int) -> np.ndarray:
    """Indices of the ``block_rows``-row blocks that hold at least one masked row, ``(B,)`` int64."""
    return np.flatnonzero(block_counts(mask, block_rows))


def check_request(reader: DumpReader, names: Sequence[str], mask: np.ndarray) -> None:
    """Raise :class:`DumpError` when a dataset is absent or the mask does not cover the dump's rows."""
    widths = reader.layout.widths()
    for name in names:
        if name not in widths:
            raise DumpError(f"{reader.path}: has no dataset '{name}' (it holds {sorted(widths)})")
    if mask.shape != (reader.n_tokens,):
        raise DumpError(f"{reader.path}: row mask has shape {mask.shape}, the dump has {reader.n_tokens} rows")


def iter_blocks(reader: DumpReader, names: Sequence[str], mask: np.ndarray, block_rows: int,
                blocks: Sequence[int] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Read blocks of rows and keep the masked ones.

    Parameters
    ----------
    reader
        An open dump.
    names
        Datasets to read; each is read once per block.
    mask
        ``(N,)`` bool row mask.
    block_rows
        Rows per read, a multiple of ``reader.block_rows`` (see :func:`aligned_block_rows`).
    blocks
        Block indices in the order to read them (default: every active block, in order).

    Yields
    ------
    dict
        ``{name: (n_kept, width) float32 array}`` for one block, ``n_kept >= 1``.
    """
    if block_rows % reader.block_rows:
        raise ValueError(f"block_rows {block_rows} is not a multiple of {reader.path}'s block_rows "
                         f"{reader.block_rows}")
    for b in active_blocks(mask, block_rows) if blocks is None else blocks:
        start = int(b) * block_rows
        stop = min(start + block_rows, len(mask))
        keep = mask[start:stop]
        every = bool(keep.all())  # skip the masking copy for fully selected blocks
        yield {name: reader.rows(name, start, stop) if every else reader.rows(name, start, stop)[keep]
               for name in names}


def cat_features(block: dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    """Concatenate the listed datasets of a block along features, ``(n, Σ widths)``."""
    if len(names) == 1:
        return block[names[0]]
    return np.concatenate([block[n] for n in names], axis=1)


def load_rows(path: str | Path, names: Sequence[str], mask: np.ndarray, dtype: torch.dtype = torch.float32,
              *, block_rows: int = 0) -> torch.Tensor:
    """Load the masked rows of some datasets into memory, in row order.

    Parameters
    ----------
    path
        Dump file.
    names
        Datasets, concatenated along features in this order.
    mask
        ``(N,)`` bool row mask.
    dtype
        Dtype of the result.
    block_rows
        Rows per read, rounded up to the dump's chunk alignment (0: one aligned block).

    Returns
    -------
    torch.Tensor
        ``(mask.sum(), Σ widths)``.
    """
    mask = np.asarray(mask, dtype=bool)
    with DumpReader(path) as reader:
        check_request(reader, names, mask)
        widths = reader.layout.widths()
        out = np.empty((int(mask.sum()), sum(widths[n] for n in names)), dtype=np.float32)
        row = 0
        for block in iter_blocks(reader, names, mask, aligned_block_rows(reader, block_rows)):
            part = cat_features(block, names)
            out[row:row + len(part)] = part
            row += len(part)
    return torch.from_numpy(out).to(dtype)


# ----------------------------------------------------------------------------- batches

def quarter_of_ram() -> int:
    """A quarter of the machine's physical memory in bytes (BlockLoader's default preload limit)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


class BlockLoader(torch.utils.data.IterableDataset):
    """Shuffled ``(X, Y)`` batches of masked rows, read in chunk-aligned blocks.

    Each epoch permutes the order of the blocks that hold masked rows (seeded by
    ``seed`` and the epoch), reads ``buffer_blocks`` of them at a time, keeps the masked
    rows, shuffles the rows of that buffer, and yields full batches; rows left over
    carry into the next buffer, and the last, partial batch of the epoch is yielded too.
    Every masked row appears exactly once per epoch.  Call :meth:`set_epoch` before each
    epoch (as with ``DistributedSampler``) to get a new order.

    When the masked rows take at most ``preload_bytes`` (as float32), they are read once,
    on the first epoch, and later epochs gather their batches from memory: the same
    batches in the same order as streaming (the plan of blocks, buffers and
    permutations is computed from the mask alone), without re-reading and re-checking
    every block each epoch (``benchmarks/train_throughput.py``: most of the loader's overhead over
    rows preloaded by hand goes; the figures: ``docs/costs.md``).

    The file is opened on first iteration in each process, never in ``__init__``, so
    the loader can be pickled or forked into ``DataLoader`` workers (use
    ``DataLoader(loader, batch_size=None, num_workers=w)``; the blocks are dealt out
    round-robin between workers).

    Parameters
    ----------
    path
        Dump file.
    x, y
        Datasets concatenated along features into ``X (b, Σ widths_x)`` and
        ``Y (b, Σ widths_y)``.
    mask
        ``(N,)`` bool row mask over the dump (see :func:`row_mask`).
    batch_size
        Rows per batch.
    shuffle
        Permute blocks and rows; otherwise rows come in file order.
    seed
        Seed of the permutations.
    dtype
        Dtype of ``X`` and ``Y``.
    buffer_blocks
        Blocks shuffled together; larger mixes more records per batch at more memory.
    block_rows
        Rows per read, rounded up to the dump's chunk alignment (0: one aligned block).
    preload_bytes
        Largest size of the masked rows that is held in memory (default: a quarter of
        the machine's RAM; 0: always stream).  Never in ``DataLoader`` workers.
    """

    def __init__(self, path: str | Path, x: Sequence[str], y: Sequence[str], mask: np.ndarray, batch_size: int, *,
                 shuffle: bool, seed: int, dtype: torch.dtype = torch.float32, buffer_blocks: int = 8,
                 block_rows: int = 0, preload_bytes: int | None = None):
        super().__init__()
        if not x or not y:
            raise ValueError(f"BlockLoader needs at least one dataset in x and in y, got x={list(x)}, y={list(y)}")
        if batch_size <= 0 or buffer_blocks <= 0:
            raise ValueError(f"BlockLoader batch_size and buffer_blocks must be positive, got {batch_size}, "
                             f"{buffer_blocks}")
        self.path, self.x, self.y = Path(path), list(x), list(y)
        self.mask = np.asarray(mask, dtype=bool)
        self.batch_size, self.shuffle, self.seed, self.dtype = batch_size, shuffle, seed, dtype
        self.buffer_blocks, self.min_block_rows = buffer_blocks, block_rows
        self.preload_bytes = quarter_of_ram() if preload_bytes is None else preload_bytes
        self.epoch = 0
        self._reader: DumpReader | None = None
        self._pid: int | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def n_rows(self) -> int:
        """Masked rows, i.e. rows per epoch."""
        return int(self.mask.sum())

    def __len__(self) -> int:
        return math.ceil(self.n_rows / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _open(self) -> DumpReader:
        # A handle inherited through fork is not usable in the child: open one per process.
        if self._reader is None or self._pid != os.getpid():
            reader = DumpReader(self.path)
            try:
                check_request(reader, [*self.x, *self.y], self.mask)
            except DumpError:
                reader.close()
                raise
            self._reader, self._pid = reader, os.getpid()
        return self._reader

    def close(self) -> None:
        if self._reader is not None and self._pid == os.getpid():
            self._reader.close()
        self._reader = self._pid = None

    def __getstate__(self):
        return self.__dict__ | {"_reader": None, "_pid": None, "_rows": None}

    def _block_order(self, block_rows: int) -> tuple[np.ndarray, np.random.Generator]:
        blocks = active_blocks(self.mask, block_rows)
        if self.shuffle:
            blocks = np.random.default_rng([self.seed, _ORDER_STREAM, self.epoch]).permutation(blocks)
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = np.random.default_rng([self.seed, _BUFFER_STREAM, self.epoch, worker])
        return blocks[worker::n_workers], rng

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        reader = self._open()
        block_rows = aligned_block_rows(reader, self.min_block_rows)
        if self._should_preload(reader):
            yield from self._iter_preloaded(reader, block_rows)
        else:
            yield from self._iter_streamed(reader, block_rows)

    def _should_preload(self, reader: DumpReader) -> bool:
        # Only in the main process: DataLoader workers each hold a share of the blocks.
        if self.preload_bytes <= 0 or torch.utils.data.get_worker_info() is not None:
            return False
        widths = reader.layout.widths()
        return self.n_rows * 4 * sum(widths[n] for n in dict.fromkeys([*self.x, *self.y])) <= self.preload_bytes

    def _buffers(self, block_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """The epoch's plan, the same for both paths: per buffer, its blocks and its row order.

        Yields ``(blocks, order)``: the next ``buffer_blocks`` blocks to read, and the
        permutation of the buffer's rows (rows carried from the previous buffer first, then
        the masked rows of ``blocks`` in file order), or ``None`` without shuffling.
        """
        blocks, rng = self._block_order(block_rows)
        counts = block_counts(self.mask, block_rows)
        carried = 0
        for i in range(0, len(blocks), self.buffer_blocks):
            group = blocks[i:i + self.buffer_blocks]
            n = carried + int(counts[group].sum())
            yield group, (rng.permutation(n) if self.shuffle else None)
            carried = n % self.batch_size

    def _iter_streamed(self, reader: DumpReader, block_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        names = list(dict.fromkeys([*self.x, *self.y]))  # a dataset in both x and y is read once
        carry: tuple[torch.Tensor, torch.Tensor] | None = None
        for group, order in self._buffers(block_rows):
            blocks = list(iter_blocks(reader, names, self.mask, block_rows, group))
            X, Y = (torch.cat(([carry[i]] if carry else []) +
                              [torch.from_numpy(cat_features(b, side)).to(self.dtype) for b in blocks])
                    for i, side in enumerate((self.x, self.y)))
            rest = yield from self._full_batches(X, Y, order if order is not None else np.arange(len(X)))
            carry = X[torch.from_numpy(rest)], Y[torch.from_numpy(rest)]
        if carry and len(carry[0]):
            yield carry

    def _iter_preloaded(self, reader: DumpReader, block_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # All masked rows in memory once, in file order; each epoch then gathers its batches by
        # row index following the very same plan as the streamed path, so batches are identical.
        if self._rows is None:
            names = list(dict.fromkeys([*self.x, *self.y]))
            blocks = list(iter_blocks(reader, names, self.mask, block_rows))
            self._rows = tuple(torch.from_numpy(np.concatenate([cat_features(b, side) for b in blocks])).to(self.dtype)
                               for side in (self.x, self.y))
        X, Y = self._rows
        starts = np.concatenate([[0], np.cumsum(block_counts(self.mask, block_rows))])
        carry = np.zeros(0, np.int64)
        for group, order in self._buffers(block_rows):
            idx = np.concatenate([carry, *(np.arange(starts[b], starts[b + 1]) for b in group)])
            carry = yield from self._full_batches(X, Y, idx[order] if order is not None else idx)
        if len(carry):
            yield X[torch.from_numpy(carry)], Y[torch.from_numpy(carry)]

    def _full_batches(self, X: torch.Tensor, Y: torch.Tensor, idx: np.ndarray):
        """Yield the full batches of rows ``idx`` of ``(X, Y)`` (gathered copies); return the rest of ``idx``."""
        n_full = len(idx) - len(idx) % self.batch_size
        for s in range(0, n_full, self.batch_size):
            take = torch.from_numpy(idx[s:s + self.batch_size])
            yield X[take], Y[take]
        return idx[n_full:]
