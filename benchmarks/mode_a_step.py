"""One ``tune_mode_a`` step, as it runs against the whole-forward definition, on the params.yaml model.

    python benchmarks/mode_a_step.py                      # from the repository root
    python benchmarks/mode_a_step.py --repeats 7 --batch 4 --seq-len 256

The model is loaded as the pipeline loads it; the maps are random, of ``params.plan``'s shapes
with ``mode_a.train.head_width`` heads (speed does not depend on the weights).  One step is
the forward and backward of the KL on ``--batch`` records of ``--seq-len`` seeded random tokens,
the prompt cut as ``tune_mode_a`` cuts it.  Two arms, timed through
:func:`ced_csa2.pipeline.timing.paired_seconds` (one untimed warm-up each, arms alternated, median of
``--repeats``):

* ``whole``: the definition -- the plain model's forward on the records (the teacher's logits), the
  skip's prefill, the whole model on the continuation, backward (the step before the teacher was kept);
* ``step``: what ``tune_mode_a`` runs now -- :func:`~ced_csa2.train.objectives.mode_a_kl` with the
  teacher's pass kept from before the first step (:func:`~ced_csa2.train.objectives.mode_a_teacher`,
  timed once, apart), the layers above the cut alone on the continuation, backward.

``bound``: the forward work of ``whole`` over that of ``step``, counted in decoder-layer token passes
with the LM head as ``vocab * hidden / (parameters of one decoder layer)`` layers per token; both arms'
backward (through the layers above the cut, the same in both) is left out, so the measured ratio can
only be lower.  A ratio above it stops the run (:class:`~ced_csa2.pipeline.timing.BoundExceeded`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ced_csa2.ced_runtime import CEDModeARuntime, prompt_tokens
from ced_csa2.config import load_params
from ced_csa2.model_utils import decoder_layer, load_model_and_tokenizer
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import PROTOCOL, check_bound, paired_seconds
from ced_csa2.plan import load_plan
from ced_csa2.train.objectives import kl_distill, mode_a_kl, mode_a_teacher

from mode_a_prefill import cpu_line, random_parts


def whole_forward_kl(model, runtime: CEDModeARuntime, row: torch.Tensor, fraction: float) -> torch.Tensor:
    """The definition :func:`~ced_csa2.train.objectives.mode_a_kl` computes: both passes through every layer."""
    cut = prompt_tokens(row.shape[1], fraction)
    with torch.no_grad():
        teacher = model(input_ids=row).logits[:, cut - 1:-1]
    cache = runtime.prefill_with_grad(row[:, :cut - 1])
    student = model(input_ids=row[:, cut - 1:-1], cache=cache, use_cache=True).logits
    return kl_distill(student, teacher, torch.ones(row[:, cut:].shape, device=row.device), 1.0)


def step_bound(model, n_layers: int, split: int, tokens: int, prompt: int) -> float:
    """Forward work of the whole-forward step over the kept-teacher step (layer-token passes, LM head included)."""
    layer = sum(p.numel() for p in decoder_layer(model, 1).parameters())
    head = model.get_output_embeddings().weight.numel() / layer  # the LM head, in decoder layers per token
    cont = tokens - prompt + 1  # positions predicting the continuation (the prompt's last token first)
    whole = tokens * (n_layers + head) + (prompt - 1) * split + cont * (n_layers + head)
    step = (prompt - 1) * split + cont * (n_layers - split + 2 * head)  # student's and teacher's heads
    return whole / step


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--batch", type=int, default=None, help="records per step (default train.online.batch_size)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per record (default train.online.seq_len)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    params = load_params(args.params)
    plan, geo = load_plan(params.plan, params.model)
    batch, seq_len = args.batch or params.train.online.batch_size, args.seq_len or params.train.online.seq_len
    fraction = params.eval_ppl.prefix_fraction
    model, tok = load_model_and_tokenizer(params.model)
    model.requires_grad_(False)
    device = next(model.parameters()).device
    parts = random_parts(geo, plan, params.mode_a.train.head_width)
    for m in parts.maps():
        m.to(device)
    runtime = CEDModeARuntime(model, plan, geo, parts)
    row = torch.randint(0, len(tok), (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    t0 = time.perf_counter()
    teacher = mode_a_teacher(model, plan, row, fraction)
    teacher_s = time.perf_counter() - t0
    arms = {"whole": lambda: whole_forward_kl(model, runtime, row, fraction).backward(),
            "step": lambda: mode_a_kl(model, runtime, row, fraction, teacher).backward()}
    t = paired_seconds(arms, args.repeats, device=device)
    bound = step_bound(model, geo.n_layers, plan.split, seq_len, prompt_tokens(seq_len, fraction))
    ratio = t.ratio("whole", "step")
    print(f"model {params.model.name} ({str(model.dtype).removeprefix('torch.')}): {geo.n_layers} layers, cut "
          f"after {plan.split}; head width {params.mode_a.train.head_width}; {batch} records x {seq_len} tokens")
    print(f"CPU: {cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"timing: {PROTOCOL.format(repeats=args.repeats)}")
    print()
    print("| whole-forward step s | kept-teacher step s | ratio | bound | teacher pass s (once per record) |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {t.seconds['whole']:.3f} | {t.seconds['step']:.3f} | {ratio:.2f} | {bound:.2f} | {teacher_s:.3f} |")
    check_bound(ratio, bound, "tune_mode_a step (kept teacher vs whole forward)", t.seconds)


if __name__ == "__main__":
    run_main(main)
