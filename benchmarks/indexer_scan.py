"""The trained indexer's scan at one decode step: its MXFP4 keys decoded by the format, or by table, in one run.

    python benchmarks/indexer_scan.py                          # 8,192 keys of 192 channels, 3 heads
    python benchmarks/indexer_scan.py --keys 2048 8192 32768 --repeats 41

A sparse CSA2 decode step with a trained lightning indexer (``runtime/sparse_decode``) scores
every older position's indexer key against the new position's queries, then takes the top-k.
The keys are stored in MXFP4, so each step first decodes all of them.  Arms, per key count:

* ``format decode``: :meth:`ced_csa2.kv.fp4.MXFP4.dequantize` (the element bytes' values, then
  a second pass multiplying by the block scales);
* ``table decode``: :class:`ced_csa2.runtime.sparse_decode.KeyScan` (one lookup per byte in a
  table of every scale byte × element byte product), the decode the store uses;
* ``scan, format`` / ``scan, table``: the decode plus
  :meth:`~ced_csa2.maps.indexer.LightningIndexer.scores` and the top-``k``: the indexer's whole
  selection minus its queries;
* ``scan, blocks``: the same by :meth:`KeyScan.scores`, which decodes and scores
  ``KeyScan.BLOCK`` keys at a time in buffers it reuses: the scan the store runs.

Random keys and queries of the shapes given (the timing depends on shapes only); the two
decodes are checked bit for bit first, and the three scans for the same selection.  All arms through
:func:`ced_csa2.pipeline.timing.paired_seconds` (one untimed call of each, then ``--repeats``
rounds, the order rotated, per-arm median); ratios are against ``format decode`` of the same
run.  Not part of the tests; timings never enter metrics.
"""

from __future__ import annotations

import argparse

import torch

from ced_csa2.maps.indexer import LightningIndexer, key_format
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import PROTOCOL, paired_seconds
from ced_csa2.runtime.sparse_decode import KeyScan


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, nargs="+", default=[8192], help="cached positions scanned")
    ap.add_argument("--width", type=int, default=192, help="indexer key channels (SmolLM2's attention_rot: 3 x 64)")
    ap.add_argument("--heads", type=int, default=3, help="indexer query heads")
    ap.add_argument("--k", type=int, default=128, help="entries selected")
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    fmt, scan = key_format(args.width), KeyScan()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; MXFP4 keys of {args.width} channels "
          f"(group {fmt.group}), {args.heads} heads, top-{args.k}; {PROTOCOL.format(repeats=args.repeats)}")
    print(f"{'keys':>7} {'arm':<14} {'ms':>8} {'x format decode':>16}")
    g = torch.Generator().manual_seed(args.seed)
    for n in args.keys:
        packed = fmt.quantize(torch.randn(1, n, args.width, generator=g))
        queries = torch.randn(1, args.heads, 1, args.width + 1, generator=g)  # + 1: the offset channel
        weights = torch.randn(1, args.heads, 1, generator=g)
        reference = fmt.dequantize(packed)
        if not torch.equal(scan(packed, n).view(torch.int32), reference.view(torch.int32)):
            raise SystemExit("KeyScan does not decode as MXFP4.dequantize: no timing of a wrong decode")

        def score(keys: torch.Tensor) -> torch.Tensor:
            return LightningIndexer.scores(queries, weights, keys)[:, 0]

        def top(scores: torch.Tensor) -> torch.Tensor:
            return scores.topk(min(args.k, n), dim=-1).indices

        arms = {"format decode": lambda: fmt.dequantize(packed),
                "table decode": lambda: scan(packed, n),
                "scan, format": lambda: top(score(fmt.dequantize(packed))),
                "scan, table": lambda: top(score(scan(packed, n))),
                "scan, blocks": lambda: top(scan.scores(packed, n, score))}
        picks = [arms[arm]().sort(-1).values for arm in ("scan, format", "scan, table", "scan, blocks")]
        if not all(torch.equal(p, picks[0]) for p in picks):
            raise SystemExit("the scans select differently: no timing of a wrong scan")
        seconds = paired_seconds(arms, args.repeats).seconds
        for arm, s in seconds.items():
            print(f"{n:>7} {arm:<14} {1e3 * s:>8.3f} {s / seconds['format decode']:>16.3f}")


if __name__ == "__main__":
    run_main(main)
