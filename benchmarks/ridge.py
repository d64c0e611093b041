"""Streaming ridge (``ced_csa2.maps.ridge.RidgeAccumulator``) against scikit-learn's in-memory Ridge.

    python benchmarks/ridge.py                              # synthetic dump, SmolLM2-135M widths
    python benchmarks/ridge.py --rows 200000 --hidden 2560 --kv-dim 1024
    python benchmarks/ridge.py --dump data/dump/dump.h5     # h_split -> [k_l || v_l] of the first K/V layer

Fits one map ``x -> y`` on every row of the dump twice, each in its own subprocess so
that each peak resident memory is honest: (a) streaming over chunk-aligned blocks with
float64 sufficient statistics, (b) loading all rows as float64 and fitting
``sklearn.linear_model.Ridge(alpha=λ, fit_intercept=True)``.  Prints wall time, peak
RSS above the post-import baseline, their ratios, and the largest coefficient and
intercept differences.  The two workers go through :func:`ced_csa2.pipeline.timing.paired_seconds`
(one untimed run of each, ``--repeats`` >= 3 alternated runs, per-kind median of the fit's
own seconds, the subprocess start-up left out; peak memory of the last run, which repeats).
No bound: the two do different arithmetic.  Not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def build_dump(path: Path, rows: int, hidden: int, kv_dim: int, seed: int = 0) -> Path:
    """A dump of ``rows`` tokens (records of 50-512) where K/V are a noisy linear map of ``h_split``."""
    from ced_csa2.data.dump_file import DumpLayout, DumpWriter

    rng = np.random.default_rng(seed)
    A = rng.standard_normal((hidden, 2 * kv_dim)).astype(np.float32) / np.sqrt(hidden)
    scale = rng.uniform(0.5, 3.0, hidden).astype(np.float32)
    scale[:8] = 50.0  # a few outlier channels, as real activations have
    w = DumpWriter(path, path.with_suffix(".partial.h5"), DumpLayout(hidden, kv_dim, (1,)), chunk_kib=512,
                   attrs={"fingerprint": "benchmark"})
    done = 0
    while done < rows:
        lens = [int(n) for n in rng.integers(50, 513, 16)]
        ends = np.minimum(np.cumsum(lens), rows - done)  # cut the last batch at exactly `rows`
        lens = [int(e) for e in np.diff(ends, prepend=0) if e > 0]
        n = sum(lens)
        h = rng.standard_normal((n, hidden), dtype=np.float32) * scale + 1.0
        kv = h @ A + 0.1 * rng.standard_normal((n, 2 * kv_dim), dtype=np.float32)
        w.append({"h_split": h, "k_1": kv[:, :kv_dim], "v_1": kv[:, kv_dim:]}, np.zeros(n, np.int32), lens)
        done += n
    return w.finalize()


def worker(kind: str, dump: Path, x: str, y: list[str], lam: float, block_rows: int, out: Path) -> None:
    """Fit in this process and write ``{W, b}`` to ``out`` and timings to stdout (one JSON line)."""
    import torch
    from sklearn.linear_model import Ridge

    from ced_csa2.data.dump_file import DumpReader
    from ced_csa2.data.loader import aligned_block_rows, cat_features, iter_blocks, load_rows
    from ced_csa2.maps.ridge import RidgeAccumulator

    with DumpReader(dump) as r:
        n, widths = r.n_tokens, r.layout.widths()
    mask = np.ones(n, dtype=bool)
    base = peak_rss_mb()
    t0 = time.perf_counter()
    if kind == "streaming":
        with DumpReader(dump) as r:
            acc = RidgeAccumulator(widths[x], sum(widths[name] for name in y))
            for block in iter_blocks(r, [x, *y], mask, aligned_block_rows(r, block_rows)):
                acc.update(torch.from_numpy(block[x]), torch.from_numpy(cat_features(block, y)))
        W, b = (t.numpy() for t in acc.solve(lam))
        load_s = None
    else:
        X = load_rows(dump, [x], mask, torch.float64).numpy()
        Y = load_rows(dump, y, mask, torch.float64).numpy()
        load_s = time.perf_counter() - t0
        model = Ridge(alpha=lam, fit_intercept=True).fit(X, Y)
        W, b = model.coef_.T, model.intercept_
    seconds = time.perf_counter() - t0
    np.savez(out, W=W, b=b)
    print(json.dumps({"seconds": seconds, "load_s": load_s, "peak_mb": peak_rss_mb(), "base_mb": base, "rows": n}))


def run_worker(kind: str, args, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--dump", str(args.dump), "--x", args.x, "--y", *args.y,
           "--lam", str(args.lam), "--block-rows", str(args.block_rows), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{kind} worker failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump", type=Path, help="an existing dump (default: build a synthetic one)")
    p.add_argument("--x", default="h_split", help="input dataset")
    p.add_argument("--y", nargs="+", help="output datasets (default: k_l v_l of the first K/V layer)")
    p.add_argument("--rows", type=int, default=100_000, help="rows of the synthetic dump")
    p.add_argument("--hidden", type=int, default=576, help="h_split width of the synthetic dump")
    p.add_argument("--kv-dim", type=int, default=192, help="K/V width of the synthetic dump")
    p.add_argument("--lam", type=float, default=1.0, help="ridge lambda")
    p.add_argument("--block-rows", type=int, default=8192, help="rows per streaming read (rounded to chunks)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each worker")
    p.add_argument("--worker", choices=["streaming", "sklearn"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.dump, args.x, args.y, args.lam, args.block_rows, args.out)
        return

    from ced_csa2.data.dump_file import DumpReader
    from ced_csa2.pipeline.timing import PROTOCOL, paired_seconds

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.dump is None:
            t0 = time.perf_counter()
            args.dump = build_dump(tmp / "dump.h5", args.rows, args.hidden, args.kv_dim)
            print(f"built {args.dump.stat().st_size / 2**20:.0f} MiB synthetic dump in {time.perf_counter() - t0:.1f} s")
        with DumpReader(args.dump) as r:
            layer = r.layout.kv_layers[0]
            args.y = args.y or [f"k_{layer}", f"v_{layer}"]
            widths, n = r.layout.widths(), r.n_tokens
        print(f"map {args.x} ({widths[args.x]}) -> {' || '.join(args.y)} ({sum(widths[y] for y in args.y)}), "
              f"{n} rows, lambda={args.lam:g}")
        res = {}

        def worker_of(kind):
            def go():
                res[kind] = run_worker(kind, args, tmp / f"{kind}.npz")
                return res[kind]["seconds"]
            return go
        timed = paired_seconds({kind: worker_of(kind) for kind in ("streaming", "sklearn")}, args.repeats,
                               self_timed=True)
        for kind, seconds in timed.seconds.items():
            res[kind]["seconds"] = seconds  # the median; load_s and memory are the last run's
        fits = {kind: np.load(tmp / f"{kind}.npz") for kind in res}
        dW = float(np.abs(fits["streaming"]["W"] - fits["sklearn"]["W"]).max())
        db = float(np.abs(fits["streaming"]["b"] - fits["sklearn"]["b"]).max())
        scale = float(np.abs(fits["sklearn"]["W"]).max())
    s, k = res["streaming"], res["sklearn"]
    mem = {kind: r["peak_mb"] - r["base_mb"] for kind, r in res.items()}
    print(f"timing: {PROTOCOL.format(repeats=args.repeats)} (the fit's own seconds)")
    print(f"{'':10s} {'wall s':>8s} {'peak RSS MiB':>13s} {'(above base)':>13s}")
    for kind, r in res.items():
        extra = f"  (load {r['load_s']:.2f} s)" if r["load_s"] is not None else ""
        print(f"{kind:10s} {r['seconds']:8.2f} {r['peak_mb']:13.0f} {mem[kind]:13.0f}{extra}")
    print(f"time ratio streaming/sklearn: {s['seconds'] / k['seconds']:.2f}")
    print(f"peak-memory ratio streaming/sklearn (above base): {mem['streaming'] / max(mem['sklearn'], 1e-9):.3f}")
    print(f"max |W diff| {dW:.3e} (max |W| {scale:.3e}), max |b diff| {db:.3e}")


if __name__ == "__main__":
    run_main(main)
