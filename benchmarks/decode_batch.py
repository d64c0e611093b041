"""What a greedy decode step costs per prompt as the batch grows: the reason for ``eval_generation.batch_size``.

    python benchmarks/decode_batch.py                             # batches 8 16 32 at 80 cached positions
    python benchmarks/decode_batch.py --batches 1 8 32 --context 512 --repeats 9

On the model of ``params.yaml`` (the embedded SmolLM2 by default), one ordinary ``DynamicCache`` per
batch size is prefilled with ``--context`` seeded random tokens per prompt; then
:func:`ced_csa2.pipeline.timing.paired_seconds` times one greedy decode step of each (one untimed
step of each, ``--repeats`` rounds with the batches' order rotated each round, each batch's
median).  A decode step reads every weight once whatever the batch, so on a CPU whose step is
bound by reading the weights a batch of ``b`` prompts costs much less than ``b / b0`` steps of
``b0``: that is the figure printed, *step ratio* (a step of ``b`` over a step of the smallest
batch ``b0``), beside its physical bounds: at least 1 (more rows, no less work) and at most
``b / b0`` plus the noise of the median (rows cost at most linearly).  A ratio more than
10% outside ``[1, b / b0]`` (a median's noise on a shared machine) is flagged, never hidden.  The caches grow by one
position a round, alike for every batch.  Not part of the tests; timings never go into metrics.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch
from transformers import DynamicCache

from ced_csa2.config import load_params
from ced_csa2.eval.generation import StepDecoder
from ced_csa2.model_utils import load_model_and_tokenizer
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import PROTOCOL, paired_seconds

from mode_a_prefill import cpu_line


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32], help="prompts per decode step, one arm each")
    ap.add_argument("--context", type=int, default=80, help="cached positions per prompt before the first timed step")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if len(set(args.batches)) < 2 or min(args.batches) < 1:
        ap.error(f"--batches needs two or more distinct positive sizes, got {args.batches}")

    params = load_params(args.params)
    model, tok = load_model_and_tokenizer(params.model)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(args.seed)
    decoders = {}
    for b in sorted(set(args.batches)):
        decoders[b] = StepDecoder(model, DynamicCache(config=model.config), contextlib.nullcontext)
        decoders[b].prefill(torch.randint(0, len(tok), (b, args.context), generator=generator).to(device))
    t = paired_seconds({b: d.step for b, d in decoders.items()}, args.repeats, device=device)
    b0 = min(decoders)
    print(f"model {params.model.name} ({str(model.dtype).removeprefix('torch.')}); {args.context} cached positions "
          f"per prompt; DynamicCache")
    print(f"CPU: {cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"timing: {PROTOCOL.format(repeats=args.repeats)}")
    print()
    print(f"| prompts | ms per step | ms per prompt | step ratio to {b0} | bounds |")
    print("|---:|---:|---:|---:|---|")
    for b, s in t.seconds.items():
        ratio = s / t.seconds[b0]
        flag = "" if 0.9 <= ratio <= 1.1 * b / b0 else " **outside**"
        print(f"| {b} | {1e3 * s:.1f} | {1e3 * s / b:.2f} | {ratio:.2f} | [1, {b / b0:g}]{flag} |")


if __name__ == "__main__":
    run_main(main)
