"""Record splits, row masks and the block loader on small real dump files."""

import itertools
import pickle

import h5py
import numpy as np
import pytest
import torch

from ced_csa2.data import loader as loader_mod
from ced_csa2.data.dump_file import DumpError, DumpLayout, DumpReader, DumpWriter
from ced_csa2.data.loader import BlockLoader, load_rows, record_split, row_mask

HIDDEN, KV_DIM, KV_LAYERS = 32, 8, (3, 5)


def write_dump(tmp_path, n_records=40, seed=0, lengths=None):
    """A dump whose ``h_split[:, 0]`` is the row index; chunks of 8 (h_split) and 32 (K/V) rows."""
    rng = np.random.default_rng(seed)
    lengths = list(rng.integers(5, 90, n_records)) if lengths is None else lengths
    layout = DumpLayout(HIDDEN, KV_DIM, KV_LAYERS)
    w = DumpWriter(tmp_path / "dump.h5", tmp_path / "dump.partial.h5", layout, chunk_kib=1,
                   attrs={"fingerprint": "test"})
    row = 0
    for i in range(0, len(lengths), 7):  # several records per append, appends straddle chunks
        lens = [int(n) for n in lengths[i:i + 7]]
        n = sum(lens)
        arrays = {name: rng.standard_normal((n, width)).astype(np.float32) for name, width in layout.widths().items()}
        arrays["h_split"][:, 0] = np.arange(row, row + n)
        w.append(arrays, np.zeros(n, np.int32), lens)
        row += n
    return w.finalize()


@pytest.fixture
def dump(tmp_path):
    return write_dump(tmp_path)


def test_record_split_is_disjoint_seeded_and_sized():
    train, val = record_split(100, 0.05, seed=3)
    assert len(val) == 5 and len(train) == 95
    assert not set(train) & set(val) and sorted([*train, *val]) == list(range(100))
    assert list(train) == sorted(train) and list(val) == sorted(val)
    again = record_split(100, 0.05, seed=3)
    assert np.array_equal(again[1], val)
    assert not np.array_equal(record_split(100, 0.05, seed=4)[1], val)
    assert len(record_split(3, 0.01, 0)[1]) == 1  # at least one record on each side
    with pytest.raises(ValueError, match="at least 2 records"):
        record_split(1, 0.1, 0)


def test_row_mask_counts():
    offs = np.array([0, 10, 13, 40, 41])
    full = row_mask(offs, [0, 2], 0, seed=0)
    assert full.shape == (41,) and np.flatnonzero(full).tolist() == [*range(10), *range(13, 40)]
    sampled = row_mask(offs, [0, 1, 2, 3], 5, seed=0)
    per_record = [int(sampled[a:b].sum()) for a, b in itertools.pairwise(offs)]
    assert per_record == [5, 3, 5, 1]  # shorter records keep all their rows
    assert np.array_equal(sampled, row_mask(offs, [0, 1, 2, 3], 5, seed=0))
    assert not np.array_equal(sampled, row_mask(offs, [0, 1, 2, 3], 5, seed=1))
    # A record's draw does not depend on which other records are kept.
    assert np.array_equal(row_mask(offs, [2], 5, seed=0)[13:40], sampled[13:40])
    with pytest.raises(ValueError, match="out of range"):
        row_mask(offs, [4], 0, 0)


def _epoch(loader):
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys), [len(x) for x in xs]


def test_block_loader_yields_every_masked_row_once(dump):
    with DumpReader(dump) as r:
        offs = r.record_offsets
        k3 = r.rows("k_3", 0, r.n_tokens)
    mask = row_mask(offs, record_split(len(offs) - 1, 0.2, 0)[0], 16, seed=0)
    loader = BlockLoader(dump, ["h_split"], ["k_3", "v_5"], mask, batch_size=50, shuffle=True, seed=0,
                         buffer_blocks=3)
    X, Y, sizes = _epoch(loader)
    assert loader.n_rows == mask.sum() == len(X) and len(sizes) == len(loader)
    assert all(s == 50 for s in sizes[:-1]) and 0 < sizes[-1] <= 50
    idx = X[:, 0].long().numpy()
    assert np.array_equal(np.sort(idx), np.flatnonzero(mask))
    assert X.shape[1] == HIDDEN and Y.shape[1] == 2 * KV_DIM
    assert torch.equal(Y[:, :KV_DIM], torch.from_numpy(k3[idx]))  # X and Y rows stay paired


def test_block_loader_order_per_epoch_and_seed(dump):
    mask = np.ones(DumpReader(dump).n_tokens, bool)

    def make(seed):
        return BlockLoader(dump, ["h_split"], ["k_5"], mask, 64, shuffle=True, seed=seed)

    a, b = make(0), make(0)
    e0 = _epoch(a)[0][:, 0]
    assert torch.equal(e0, _epoch(b)[0][:, 0])  # same seed, same epoch: identical
    a.set_epoch(1)
    e1 = _epoch(a)[0][:, 0]
    assert not torch.equal(e0, e1) and torch.equal(e0.sort().values, e1.sort().values)
    assert not torch.equal(e0, _epoch(make(1))[0][:, 0])
    ordered = _epoch(BlockLoader(dump, ["h_split"], ["k_5"], mask, 64, shuffle=False, seed=0))[0][:, 0]
    assert torch.equal(ordered, torch.arange(len(mask), dtype=torch.float32))


def reference_order(mask, block_rows, batch_size, buffer_blocks, seed, epoch):
    """The documented order, written out plainly: rows (by index) of each batch of an epoch."""
    blocks = np.flatnonzero([mask[s:s + block_rows].any() for s in range(0, len(mask), block_rows)])
    blocks = np.random.default_rng([seed, 2, epoch]).permutation(blocks)  # loader's _ORDER_STREAM
    rng = np.random.default_rng([seed, 3, epoch, 0])  # _BUFFER_STREAM, worker 0
    batches, carry = [], []
    for i in range(0, len(blocks), buffer_blocks):
        rows = carry + [r for b in blocks[i:i + buffer_blocks]
                        for r in range(b * block_rows, min((b + 1) * block_rows, len(mask))) if mask[r]]
        rows = [rows[j] for j in rng.permutation(len(rows))]
        n_full = len(rows) - len(rows) % batch_size
        batches += [rows[s:s + batch_size] for s in range(0, n_full, batch_size)]
        carry = rows[n_full:]
    return batches + ([carry] if carry else [])


@pytest.mark.parametrize("preload_bytes", [0, None], ids=["streamed", "preloaded"])
@pytest.mark.parametrize("batch_size,buffer_blocks", [(50, 3), (64, 1), (7, 2)])
def test_batches_follow_the_documented_order_streamed_or_preloaded(dump, batch_size, buffer_blocks, preload_bytes):
    with DumpReader(dump) as r:
        mask = row_mask(r.record_offsets, record_split(r.n_records, 0.2, 0)[0], 16, seed=1)
        unit, k3 = r.block_rows, r.rows("k_3", 0, r.n_tokens)
    loader = BlockLoader(dump, ["h_split"], ["k_3"], mask, batch_size, shuffle=True, seed=5,
                         buffer_blocks=buffer_blocks, preload_bytes=preload_bytes)
    for epoch in range(3):
        loader.set_epoch(epoch)
        got = list(loader)
        want = reference_order(mask, unit, batch_size, buffer_blocks, 5, epoch)
        assert [x[:, 0].long().tolist() for x, _ in got] == want
        assert all(torch.equal(y, torch.from_numpy(k3[rows])) for (_, y), rows in zip(got, want))


def test_preloaded_loader_reads_the_file_once_and_matches_streaming(dump, monkeypatch):
    reads = []
    original = DumpReader.rows
    monkeypatch.setattr(DumpReader, "rows", lambda self, *a: reads.append(a) or original(self, *a))
    with DumpReader(dump) as r:
        mask = row_mask(r.record_offsets, [0, 2, 3, 11, 17, 30], 0, 0)
    make = {name: BlockLoader(dump, ["h_split", "k_5"], ["k_3"], mask, 20, shuffle=shuffle, seed=0, preload_bytes=p)
            for name, p, shuffle in [("mem", None, True), ("disk", 0, True), ("mem_plain", None, False)]}
    epochs = {name: [] for name in make}
    for epoch in range(3):
        for name, loader in make.items():
            loader.set_epoch(epoch)
            before = len(reads)
            epochs[name].append(_epoch(loader)[:2])
            if name.startswith("mem"):
                assert (len(reads) > before) == (epoch == 0)  # read on the first epoch only
    for (xm, ym), (xd, yd) in zip(epochs["mem"], epochs["disk"]):
        assert torch.equal(xm, xd) and torch.equal(ym, yd)
    assert torch.equal(epochs["mem_plain"][2][0][:, 0].long(), torch.from_numpy(np.flatnonzero(mask)))
    too_big = BlockLoader(dump, ["h_split"], ["k_3"], mask, 20, shuffle=True, seed=0,
                          preload_bytes=int(mask.sum()) * 4 * (HIDDEN + KV_DIM) - 1)
    _epoch(too_big)
    before = len(reads)
    _epoch(too_big)
    assert len(reads) > before  # over the limit: streamed every epoch


def test_reads_are_chunk_aligned_blocks(dump, monkeypatch):
    reads = []
    original = DumpReader.rows

    def spy(self, name, start, stop):
        reads.append((start, stop))
        return original(self, name, start, stop)

    monkeypatch.setattr(DumpReader, "rows", spy)
    with DumpReader(dump) as r:
        unit, n = r.block_rows, r.n_tokens
        mask = row_mask(r.record_offsets, [1, 5, 9, 30], 0, 0)
    assert unit == 32  # K/V chunks of 32 rows bound the alignment (h_split's are 8)
    _epoch(BlockLoader(dump, ["h_split"], ["k_3"], mask, 16, shuffle=True, seed=0, block_rows=100))
    loader_reads, reads[:] = list(reads), []
    load_rows(dump, ["v_5"], mask)
    for start, stop in loader_reads + reads:
        assert start % unit == 0 and ((stop - start) % unit == 0 or stop == n)
    # block_rows=100 rounds up to 128; only the blocks holding masked rows are read, once per dataset.
    assert {stop - start for start, stop in loader_reads} <= {128, n % 128}
    touched = {s // 128 for s in np.flatnonzero(mask)}
    assert len(loader_reads) == 2 * len(touched)
    assert {s // 32 for s in np.flatnonzero(mask)} == {start // 32 for start, _ in reads}


def test_open_is_lazy_per_process_and_picklable(dump, monkeypatch):
    opened = []
    monkeypatch.setattr(loader_mod, "DumpReader", lambda p: opened.append(p) or DumpReader(p))
    mask = np.ones(DumpReader(dump).n_tokens, bool)
    loader = BlockLoader(dump, ["h_split"], ["k_3"], mask, 128, shuffle=True, seed=0)
    assert opened == [] and loader._reader is None
    pickle.dumps(loader)
    _epoch(loader)
    _epoch(loader)
    assert len(opened) == 1
    clone = pickle.loads(pickle.dumps(loader))  # an open loader pickles without its handle
    assert clone._reader is None and torch.equal(_epoch(clone)[0], _epoch(loader)[0])
    loader.close()


def test_forked_workers_cover_every_row_once(dump):
    mask = np.ones(DumpReader(dump).n_tokens, bool)
    loader = BlockLoader(dump, ["h_split"], ["k_3"], mask, 100, shuffle=True, seed=0)
    _epoch(loader)  # the parent holds an open handle when the workers fork
    dl = torch.utils.data.DataLoader(loader, batch_size=None, num_workers=2,
                                     multiprocessing_context="fork")
    idx = torch.cat([x[:, 0] for x, _ in dl]).long()
    assert torch.equal(idx.sort().values, torch.arange(len(mask)))


def test_load_rows_matches_h5py(dump):
    with DumpReader(dump) as r:
        mask = row_mask(r.record_offsets, [0, 3, 7], 10, seed=2)
    got = load_rows(dump, ["k_5", "h_split"], mask, torch.float64)
    with h5py.File(dump) as f:
        want = np.concatenate([f["k_5"][:][mask], f["h_split"][:][mask]], axis=1)
    assert got.dtype == torch.float64 and torch.equal(got, torch.from_numpy(want).double())


def test_bad_requests_name_the_problem(dump):
    n = DumpReader(dump).n_tokens
    with pytest.raises(DumpError, match="no dataset 'k_4'"):
        load_rows(dump, ["k_4"], np.ones(n, bool))
    with pytest.raises(DumpError, match="row mask has shape"):
        next(iter(BlockLoader(dump, ["h_split"], ["k_3"], np.ones(n - 1, bool), 8, shuffle=False, seed=0)))
