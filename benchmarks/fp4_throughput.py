"""FP4 quantise + dequantise throughput against a plain ``clone()`` of the same tensor, in one run.

    python benchmarks/fp4_throughput.py                        # 65536 x 1024, float32 and bfloat16
    python benchmarks/fp4_throughput.py --rows 8192 --repeats 5 --dtypes float32

For each input dtype: ``clone`` (one read + one write of the tensor, the memory-bound
reference), then per format (:class:`~ced_csa2.kv.fp4.NVFP4`, :class:`~ced_csa2.kv.fp4.MXFP4`)
``quantize``, ``dequantize`` (back to the input dtype) and the round trip.  GB/s counts
the *input tensor's* bytes (``rows · D · itemsize``) per second for every path, so the
figures compare directly; "ratio" is a path's GB/s over ``clone``'s.  All paths of one
dtype through :func:`ced_csa2.pipeline.timing.paired_seconds` (one untimed warm-up of each, the
paths' order rotated over ``--repeats`` >= 3 rounds, per-path median).  No bound: a
path may read or write less than ``clone``.  Not part of the tests.
"""

from __future__ import annotations

import argparse

import torch

from ced_csa2.kv.fp4 import MXFP4, NVFP4
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import paired_seconds


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()

    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"shape ({args.rows}, {args.dim}), median of {args.repeats}, paths alternated")
    print(f"{'dtype':>9} {'path':<22} {'seconds':>9} {'GB/s':>8} {'ratio':>7}")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        x = torch.randn(args.rows, args.dim, device=args.device).to(dtype)
        gb = x.numel() * x.element_size() / 1e9

        arms = {"clone": lambda x=x: x.clone()}
        for fmt in (NVFP4(), MXFP4()):
            packed = fmt.quantize(x)
            tag = type(fmt).__name__
            arms[f"{tag} quantize"] = lambda f=fmt, x=x: f.quantize(x)
            arms[f"{tag} dequantize"] = lambda f=fmt, p=packed, t=dtype: f.dequantize(p, t)
            arms[f"{tag} quant+dequant"] = lambda f=fmt, x=x, t=dtype: f.dequantize(f.quantize(x), t)
            print(f"{'':>9} {tag}: stored {packed.nbytes / 1e6:.1f} MB vs {gb * 1e3:.1f} MB input "
                  f"({gb * 1e9 / packed.nbytes:.2f}x smaller)")
        seconds = paired_seconds(arms, args.repeats, device=args.device).seconds
        ref = seconds["clone"]
        for path, sec in seconds.items():
            print(f"{name:>9} {path:<22} {sec:9.4f} {gb / sec:8.2f} {ref / sec:7.3f}")


if __name__ == "__main__":
    run_main(main)
