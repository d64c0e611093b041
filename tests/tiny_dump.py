"""A synthetic dump's widths, params and arrays (trainers, fault catalogue), and the dump tests' corpus texts."""

import numpy as np
from conftest import tiny_params

from ced_csa2.data.dump_file import DumpLayout, DumpWriter
from ced_csa2.pipeline import paths

HIDDEN, KV = 64, 32  # the tiny Qwen3.5 profile (2 kv heads x 16)
N_RECORDS = 60


def params(**train):
    """Tiny-profile params sized for seconds of CPU time.

    The projector starts from PyTorch's init here (the default starts from the ridge map,
    ``tests/test_projector.py``): these tests check that the trainer learns.
    """
    return tiny_params(
        split={"val_fraction": 0.2, "tokens_per_record": 16},
        train_projector={"epochs": 4, "batch_size": 256, "lr": 2e-2, "init": "random", **train.get("projector", {})},
        train_adapters={"epochs": 12, "batch_size": 128, "base_lr": 1e-2, "refine_lr": 2.0,
                        **train.get("adapters", {})})


def synthetic_arrays(n_rows: int, layers, rng) -> dict[str, np.ndarray]:
    """K/V that are noisy nonlinear functions of ``H_split`` (and target K/V of the source K/V)."""

    def noisy_nonlinear(x):
        # A linear part (what ridge finds) plus a quadratic residual through 8 directions,
        # which a 48-wide MLP can learn from a few hundred pairs.
        d = x.shape[1]
        A = rng.standard_normal((d, KV)) / np.sqrt(d)
        B = rng.standard_normal((d, 8)) / np.sqrt(d)
        C = rng.standard_normal((8, KV)) / np.sqrt(8)
        y = x @ A + 0.3 * np.square(x @ B) @ C + 0.05 * rng.standard_normal((len(x), KV))
        return y.astype(np.float32)

    out = {"h_split": rng.standard_normal((n_rows, HIDDEN)).astype(np.float32)}
    source, *targets = layers
    out[f"k_{source}"], out[f"v_{source}"] = noisy_nonlinear(out["h_split"]), noisy_nonlinear(out["h_split"])
    for t in targets:
        out[f"k_{t}"], out[f"v_{t}"] = noisy_nonlinear(out[f"k_{source}"]), noisy_nonlinear(out[f"v_{source}"])
    return out


LAYERS = (20, 24, 28, 32)  # the tiny Qwen3.5 plan's source and targets (split 16)


def write_synthetic_dump(work, p, **attrs) -> None:
    """``work/data/dump/dump.h5``: :data:`N_RECORDS` records of :func:`synthetic_arrays` (seed 0), made "by" ``p``'s model."""
    from ced_csa2.stages import ridge

    rng = np.random.default_rng(0)
    lengths = rng.integers(24, 48, N_RECORDS).tolist()
    writer = DumpWriter(work / paths.DUMP_PATH, work / "data/dump.partial.h5", DumpLayout(HIDDEN, KV, LAYERS),
                        chunk_kib=64, attrs={"fingerprint": "synthetic", "model": p.model.name, "split": 16, **attrs})
    writer.append(synthetic_arrays(sum(lengths), LAYERS, rng), np.zeros(sum(lengths), np.int32), lengths)
    writer.finalize()
    ridge.run(p, work)  # models/ridge.pt: every trainer starts from it or is compared with it


TEXTS = [f"Record {i}: " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4] * (3 + i)) for i in range(11)]
