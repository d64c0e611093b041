"""FP4 quantise + dequantise throughput against a plain ``clone()`` of the same tensor, in one run.

    python benchmarks/fp4_throughput.py                        # 65536 x 1024, float32 and bfloat16
    python benchmarks/fp4_throughput.py --rows 8192 --repeats 5 --dtypes float32

For each input dtype: ``clone`` (one read + one write of the tensor, the memory-bound
reference), then per format (:class:`~ced_csa2.fp4.NVFP4`, :class:`~ced_csa2.fp4.MXFP4`)
``quantize``, ``dequantize`` (back to the input dtype) and the round trip.  GB/s counts
the *input tensor's* bytes (``rows · D · itemsize``) per second for every path, so the
figures compare directly; "ratio" is a path's GB/s over ``clone``'s.  Best of
``--repeats`` runs, after one warm-up.  Not part of the tests.
"""

from __future__ import annotations

import argparse

import torch
from _timing import best_seconds

from ced_csa2.fp4 import MXFP4, NVFP4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"shape ({args.rows}, {args.dim}), best of {args.repeats}")
    print(f"{'dtype':>9} {'path':<22} {'seconds':>9} {'GB/s':>8} {'ratio':>7}")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        x = torch.randn(args.rows, args.dim, device=args.device).to(dtype)
        gb = x.numel() * x.element_size() / 1e9

        def timed(fn):
            return best_seconds(fn, args.repeats, device=args.device)

        ref = timed(lambda x=x: x.clone())
        rows = [("clone", ref)]
        for fmt in (NVFP4(), MXFP4()):
            packed = fmt.quantize(x)
            tag = type(fmt).__name__
            rows.append((f"{tag} quantize", timed(lambda f=fmt, x=x: f.quantize(x))))
            rows.append((f"{tag} dequantize", timed(lambda f=fmt, p=packed, t=dtype: f.dequantize(p, t))))
            rows.append((f"{tag} quant+dequant", timed(lambda f=fmt, x=x, t=dtype: f.dequantize(f.quantize(x), t))))
            print(f"{'':>9} {tag}: stored {packed.nbytes / 1e6:.1f} MB vs {gb * 1e3:.1f} MB input "
                  f"({gb * 1e9 / packed.nbytes:.2f}x smaller)")
        for path, sec in rows:
            print(f"{name:>9} {path:<22} {sec:9.4f} {gb / sec:8.2f} {ref / sec:7.3f}")


if __name__ == "__main__":
    main()
