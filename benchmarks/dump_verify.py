"""What the dump's checksums cost: verification in seconds per GB and against the ridge stage's read.

    python benchmarks/dump_verify.py                    # ~1 GB synthetic dump at SmolLM2-135M widths
    python benchmarks/dump_verify.py --rows 250000 --hidden 2560 --kv-dim 1024 --layers 4

Writes a synthetic dump with the embedded default's geometry (``h_split`` 576 wide, K/V
of 4 layers at kv_dim 192: 8,448 bytes per row in float32) through ``DumpWriter`` and
measures, each the median of ``--repeats`` (>= 3) runs after one untimed run, the
verified and unverified reads alternated (:func:`ced_csa2.pipeline.timing.paired_seconds`):

* ``crc+finite``: CRC32 and the non-finite check alone, on rows already in memory
  (what the writer adds per GB, and the CPU part of verification);
* ``verify (warm)``: ``DumpReader.verify()`` of every dataset, file in the page cache;
* ``verify (cold)``: the same after ``posix_fadvise(DONTNEED)`` dropped this file's pages;
* the ridge stage's own read (``iter_blocks`` over its datasets, train then validation
  rows, as ``ridge.fit_maps``/``evaluate_maps`` read them) with verification off and on
  (on-read verification adds no I/O: each block is checked the first time it is read);
* the ridge stage itself (``ced_csa2.stages.ridge.run``, embedded params) with
  verification off and on.

Not part of the tests.  Results are for this machine; the README quotes them.
"""

from __future__ import annotations

import os
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import median_seconds, paired_seconds

ROOT = Path(__file__).resolve().parents[1]


def build(path: Path, rows: int, hidden: int, kv_dim: int, layers: tuple[int, ...]) -> float:
    """Write the dump; returns the seconds spent in ``DumpWriter.append`` + ``finalize``."""
    from ced_csa2.data.dump_file import DumpLayout, DumpWriter

    rng = np.random.default_rng(0)
    w = DumpWriter(path, path.with_suffix(".partial.h5"), DumpLayout(hidden, kv_dim, layers), chunk_kib=512,
                   attrs={"fingerprint": "benchmark", "split": 15, "model": "smollm2_135m"})
    done, spent = 0, 0.0
    while done < rows:
        lens = [int(n) for n in rng.integers(50, 513, 8)]
        ends = np.minimum(np.cumsum(lens), rows - done)
        lens = [int(e) for e in np.diff(ends, prepend=0) if e > 0]
        n = sum(lens)
        arrays = {"h_split": rng.standard_normal((n, hidden), dtype=np.float32)}
        for layer in layers:
            for kind in "kv":
                arrays[f"{kind}_{layer}"] = rng.standard_normal((n, kv_dim), dtype=np.float32)
        t0 = time.perf_counter()
        w.append(arrays, np.zeros(n, np.int32), lens)
        spent += time.perf_counter() - t0
        done += n
    t0 = time.perf_counter()
    w.finalize()
    return spent + time.perf_counter() - t0


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=120_000)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--kv-dim", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-stage", action="store_true", help="skip timing the whole ridge stage")
    args = ap.parse_args()

    import torch

    from ced_csa2.config import load_params
    from ced_csa2.data import loader
    from ced_csa2.data.dump_file import DumpReader, nonfinite_rows
    from ced_csa2.maps.ridge import map_groups
    from ced_csa2.pipeline.paths import DUMP_PATH
    from ced_csa2.plan import LayerPlan
    from ced_csa2.stages import ridge as ridge_stage

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    layers = tuple(range(18, 18 + 4 * args.layers, 4))
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        work = Path(tmp)
        path = work / DUMP_PATH
        write_s = build(path, args.rows, args.hidden, args.kv_dim, layers)
        size = path.stat().st_size
        gb = size / 1e9
        row_bytes = (args.hidden + 2 * args.kv_dim * len(layers)) * 4
        print(f"dump: {args.rows:,} rows x {row_bytes:,} B = {args.rows * row_bytes / 1e9:.3f} GB of activations, "
              f"file {gb:.3f} GB; written in {write_s:.2f} s ({write_s / gb:.2f} s/GB incl. checksums)")

        block = np.random.default_rng(1).standard_normal((512, args.hidden + 2 * args.kv_dim * len(layers)),
                                                          dtype=np.float32)
        per = median_seconds(lambda: (zlib.crc32(block), nonfinite_rows(block, "float32")), 50 * args.repeats)
        print(f"crc+finite in memory: {per / block.nbytes * 1e9:.3f} s/GB")

        def verify_all():
            with DumpReader(path) as r:
                r.verify()

        warm = median_seconds(verify_all, args.repeats)
        cold = median_seconds(verify_all, args.repeats, warmup=False, setup=lambda: drop_cache(path))
        print(f"verify every dataset: warm {warm:.3f} s = {warm / gb:.3f} s/GB; cold {cold:.3f} s = "
              f"{cold / gb:.3f} s/GB")

        # The ridge stage's read: its datasets, train then validation rows, blocks of ridge.block_rows.
        params = load_params(ROOT / "params.yaml")
        plan = LayerPlan.from_config(params.plan)
        ridge_names = sorted({n for g in map_groups(plan) for n in (g.x, *g.y)})

        def ridge_read(verify: bool):
            def go():
                with DumpReader(path, verify=verify) as r:
                    train, val = loader.record_split(r.n_records, params.split.val_fraction, params.seed)
                    br = loader.aligned_block_rows(r, params.ridge.block_rows)
                    for recs in (train, val):
                        mask = loader.row_mask(r.record_offsets, recs, 0, params.seed)
                        for _ in loader.iter_blocks(r, ridge_names, mask, br):
                            pass
            return go

        for label, setup in (("warm", None), ("cold", lambda: drop_cache(path))):
            t = paired_seconds({False: ridge_read(False), True: ridge_read(True)}, args.repeats, setup=setup).seconds
            print(f"ridge's read ({label}, {len(ridge_names)} datasets): {t[False]:.3f} s unverified, "
                  f"{t[True]:.3f} s verified on read: +{t[True] - t[False]:.3f} s = "
                  f"{(t[True] - t[False]) / t[False]:+.1%} of the read")

        if not args.skip_stage:
            original = ridge_stage.DumpReader

            def stage(verify):
                def run():
                    ridge_stage.DumpReader = lambda p: original(p, verify=verify)
                    try:
                        ridge_stage.run(params, work)
                    finally:
                        ridge_stage.DumpReader = original
                return run
            t = paired_seconds({False: stage(False), True: stage(True)}, args.repeats).seconds
            print(f"ridge stage (warm): {t[False]:.2f} s unverified, {t[True]:.2f} s verified: "
                  f"{(t[True] - t[False]) / t[False]:+.1%}")


if __name__ == "__main__":
    run_main(main)
