"""float32 vs bfloat16 on this machine: the model forward and projector training, same run.

    python benchmarks/dtype_speed.py                  # embedded default model (params.yaml)
    python benchmarks/dtype_speed.py --repeats 5

What ``dtype: auto`` / ``amp_dtype: auto`` should pick is a measurement, not a CPU flag:
this prints, for the decoder forward (SmolLM2-135M, ``batch x seq`` tokens, inference mode)
and for one projector training step (AdamW on ``hidden -> K|V`` rows, autocast vs none),
tokens (rows) per second in each dtype and the ratio ``bf16 / fp32`` (> 1: bf16 is faster),
together with the CPU capabilities :func:`ced_csa2.model_utils.fast_dtype` looks at.
Each pair through :func:`ced_csa2.pipeline.timing.paired_seconds` (one untimed warm-up of each
dtype, the two alternated over ``--repeats`` >= 3 rounds, per-arm median).  No bound: the
two dtypes do the same operations.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from ced_csa2.config import load_params
from ced_csa2.model_utils import load_model_and_tokenizer
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import PROTOCOL, paired_seconds


def forward_tok_s(params, batch: int, seq: int, repeats: int) -> dict[str, float]:
    """Tokens/s of the model's forward in float32 and bfloat16 (both models loaded, timed alternately)."""
    models = {dt: load_model_and_tokenizer(params.model, dtype=dt)[0] for dt in ("float32", "bfloat16")}
    x = torch.randint(0, models["float32"].config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def forward(model):
        def run():
            with torch.inference_mode():
                model(x)
        return run
    t = paired_seconds({dt: forward(m) for dt, m in models.items()}, repeats)
    return {dt: batch * seq / s for dt, s in t.seconds.items()}


def projector_step(hidden: int, kv_dim: int, rows: int, autocast: bool):
    """One AdamW step on a fresh ``hidden -> K|V`` projector (its own optimizer state), bf16 autocast or none."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(hidden, 2 * kv_dim)
    opt = torch.optim.AdamW(proj.parameters(), lr=1e-3)
    X, Y = torch.randn(rows, hidden), torch.randn(rows, 2 * kv_dim)

    def step():
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            loss = torch.nn.functional.mse_loss(proj(X).float(), Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4096, help="projector batch (train_projector.batch_size)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    params = load_params()
    fwd = forward_tok_s(params, args.batch, args.seq, args.repeats)
    cfg = load_model_and_tokenizer(params.model, dtype="float32")[0].config
    kv_dim = cfg.num_key_value_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    steps = {name: projector_step(cfg.hidden_size, kv_dim, args.rows, name == "bfloat16")
             for name in ("float32", "bfloat16")}
    train = {name: args.rows / s for name, s in paired_seconds(steps, args.repeats).seconds.items()}
    print(json.dumps({
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "amx": torch.cpu._is_amx_tile_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "threads": torch.get_num_threads(), "model": params.model.name,
        "timing": PROTOCOL.format(repeats=args.repeats),
        "forward_tok_s": {k: round(v) for k, v in fwd.items()},
        "forward_bf16_over_fp32": round(fwd["bfloat16"] / fwd["float32"], 2),
        "projector_rows_s": {k: round(v) for k, v in train.items()},
        "projector_bf16_over_fp32": round(train["bfloat16"] / train["float32"], 2),
    }, indent=2))


if __name__ == "__main__":
    run_main(main)
