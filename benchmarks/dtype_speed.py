"""float32 vs bfloat16 on this machine: the model forward and projector training, same run.

    python benchmarks/dtype_speed.py                  # embedded default model (params.yaml)
    python benchmarks/dtype_speed.py --repeats 5

What ``dtype: auto`` / ``amp_dtype: auto`` should pick is a measurement, not a CPU flag:
this prints, for the decoder forward (SmolLM2-135M, ``batch x seq`` tokens, inference mode)
and for one projector training step (AdamW on ``hidden -> K|V`` rows, autocast vs none),
tokens (rows) per second in each dtype and the ratio ``bf16 / fp32`` (> 1: bf16 is faster),
together with the CPU capabilities :func:`ced_csa2.model_utils.fast_dtype` looks at.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from _timing import best_seconds

from ced_csa2.config import load_params
from ced_csa2.model_utils import load_model_and_tokenizer


def forward_tok_s(params, dtype: str, batch: int, seq: int, repeats: int) -> float:
    model, _ = load_model_and_tokenizer(params.model, dtype=dtype)
    x = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return batch * seq / best_seconds(lambda: model(x), repeats)


def projector_rows_s(hidden: int, kv_dim: int, rows: int, autocast: bool, repeats: int) -> float:
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

    return rows / best_seconds(step, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4096, help="projector batch (train_projector.batch_size)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    params = load_params()
    fwd = {dt: forward_tok_s(params, dt, args.batch, args.seq, args.repeats) for dt in ("float32", "bfloat16")}
    cfg = load_model_and_tokenizer(params.model, dtype="float32")[0].config
    kv_dim = cfg.num_key_value_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    train = {name: projector_rows_s(cfg.hidden_size, kv_dim, args.rows, name == "bfloat16", args.repeats)
             for name in ("float32", "bfloat16")}
    print(json.dumps({
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "amx": torch.cpu._is_amx_tile_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "threads": torch.get_num_threads(), "model": params.model.name,
        "forward_tok_s": {k: round(v) for k, v in fwd.items()},
        "forward_bf16_over_fp32": round(fwd["bfloat16"] / fwd["float32"], 2),
        "projector_rows_s": {k: round(v) for k, v in train.items()},
        "projector_bf16_over_fp32": round(train["bfloat16"] / train["float32"], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
