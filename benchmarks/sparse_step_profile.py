"""Where a sparse CSA2 decode step's time goes, beside the ordinary cache's step, at one context.

    python benchmarks/sparse_step_profile.py                     # 8,192 positions, 9 steps
    python benchmarks/sparse_step_profile.py --context 512 --steps 3

On the model, plan and maps of ``params.yaml`` (the helpers of ``benchmarks/shared_kv_decode.py``:
trained maps and the trained indexer when present, random ones of the same shapes when not),
both caches are prefilled with the same ``--context`` random tokens.  Then:

1. the step time of each, through :func:`ced_csa2.pipeline.timing.paired_seconds` (one untimed
   step each, then ``--steps`` rounds, the order rotated, per-cache median), uninstrumented;
2. ``--steps`` more steps of each with timers around their parts (median per step), which add a
   few microseconds per call:

   * both caches: the attention calls (every layer) and the ordinary layers' cache updates
     (transformers' ``DynamicLayer.update``, which concatenates: a copy of every entry);
   * the sparse cache's store (:mod:`ced_csa2.runtime.sparse_decode`): its writes, and its reads
     split into the indexer's selection, the adapters, k_norm + RoPE and the rest (gathering,
     bookkeeping); and how many entries went through the adapters (the others were reused from
     the step before).

The last line is the saving the sparse reads can reach: what the ordinary cache spends on the
shared layers' attention and cache updates (its per-layer mean times their number), against
what the sparse store spends of its own.  Not part of the tests; timings never enter metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ced_csa2.config import load_params
from ced_csa2.eval.generation import StepDecoder
from ced_csa2.model_utils import attention, geometry, load_model_and_tokenizer
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import paired_seconds
from ced_csa2.plan import LayerPlan
from ced_csa2.runtime.attention_calls import AttentionCalls
from ced_csa2.runtime.sparse_decode import SparseDecode, SparseSharedKVCache

sys.path.insert(0, str(Path(__file__).parent))
from shared_kv_decode import indexer_for, maps  # noqa: E402


class Timers:
    """Seconds spent in wrapped callables, per name, for the current step."""

    def __init__(self):
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.adapted = 0  # entries through an adapter this step (all targets)
        self.adapted_per_step: list[int] = []

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] += time.perf_counter() - t0
        return timed

    def end_step(self) -> None:
        self.steps.append(dict(self.step))
        self.step.clear()
        self.adapted_per_step.append(self.adapted)
        self.adapted = 0

    def median_ms(self, name: str) -> float:
        return 1e3 * statistics.median(s.get(name, 0.0) for s in self.steps)


@contextlib.contextmanager
def instrumented(model, layer: int, cache, timers: Timers) -> Iterator[None]:
    """Timers on ``cache``'s ordinary layers, every attention call and (a sparse cache) its store; always removed.

    ``layer``: an attention layer of ``model`` (whose attention-function entry every layer shares).
    """
    patched: list[tuple[object, str]] = []

    def patch(owner, name: str, label: str) -> None:
        setattr(owner, name, timers.wrap(label, getattr(owner, name)))
        patched.append((owner, name))

    def attend(original, module, *args, **kwargs):
        return timers.wrap("attention", original)(module, *args, **kwargs)

    try:
        for cache_layer in cache.layers:
            if type(cache_layer) is DynamicLayer:  # not the store's layers (their update is the store's read)
                patch(cache_layer, "update", "ordinary layers' cache update")
        store = getattr(cache, "_store", None)
        if store is not None:
            patch(store, "write", "store: write")
            patch(store, "read", "store: read")
            patch(store, "_indexed", "store read: indexer")
            patch(store, "_norm_rope", "store read: k_norm + RoPE")
            patch(store.parts, "adapt", "store read: adapters")
            adapt = store.parts.adapt

            def counted(layer, k, v):
                timers.adapted += k.shape[0] * k.shape[1]
                return adapt(layer, k, v)
            store.parts.adapt = counted  # the timed adapter, its entries counted (removed with it)
        with AttentionCalls(attention(model, layer), "timing the attention calls").routed(attend):
            yield
    finally:
        for owner, name in reversed(patched):
            delattr(owner, name)  # the instance attribute goes; the class's method is back


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192, help="prefilled positions")
    ap.add_argument("--steps", type=int, default=9, help="timed decode steps per cache, and instrumented ones")
    ap.add_argument("--sparse", default="128:64", metavar="K:WINDOW[:KEEP]")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--models-dir", type=Path, default=Path("models"))
    ap.add_argument("--indexer", type=Path, default=Path("studies/indexer/attention_rot.pt"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reads = SparseDecode.from_spec(args.sparse)

    params = load_params(args.params)
    model, _ = load_model_and_tokenizer(params.model)
    geo = geometry(model.config)
    plan = LayerPlan.from_config(params.plan).validate(geo)
    parts, note = maps(args.models_dir, plan, geo, params, model)
    indexer, indexer_note = indexer_for(args.indexer, model, plan, geo, params)
    print(f"{params.model.name} {next(model.parameters()).dtype}, {torch.get_num_threads()} threads; {note}; "
          f"{indexer_note}; window {reads.window} + top-{reads.k}, each target keeping {reads.kept} entries")
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(args.seed))
    sparse = SparseSharedKVCache(model, plan, "csa2", parts, reads=reads, indexer=indexer)
    runs = {"ordinary": StepDecoder(model, DynamicCache(config=model.config), contextlib.nullcontext),
            "sparse": StepDecoder(model, sparse, sparse.feed)}
    for d in runs.values():
        d.prefill(ids)
    step = paired_seconds({name: d.step for name, d in runs.items()}, args.steps).seconds
    print(f"context {args.context}: ordinary cache {1e3 * step['ordinary']:.2f} ms/step, sparse "
          f"{1e3 * step['sparse']:.2f} ms/step ({step['sparse'] / step['ordinary']:.3f}x); median of {args.steps}, "
          "alternated, uninstrumented")

    timers = {name: Timers() for name in runs}
    for _ in range(args.steps):
        for name, d in runs.items():
            with instrumented(model, plan.source, d.cache, timers[name]):
                d.step()
            timers[name].end_step()
    ordinary, sparse = timers["ordinary"], timers["sparse"]
    n_layers, shared = len(geo.attention_layers), 1 + len(plan.targets)
    print(f"instrumented, median ms per step ({args.steps} steps):")
    for name, t in timers.items():
        parts_ms = {label: t.median_ms(label) for label in sorted({k for s in t.steps for k in s})}
        print(f"  {name:<8} " + ", ".join(f"{label} {ms:.2f}" for label, ms in parts_ms.items()))
    read = len(plan.targets) * (reads.k + reads.window)
    adapted = statistics.median(sparse.adapted_per_step)
    print(f"  the targets adapted a median {adapted:.0f} of the {read} entries they read a step "
          f"({adapted / read:.0%}; the rest kept from earlier steps)")
    per_layer = (ordinary.median_ms("attention") + ordinary.median_ms("ordinary layers' cache update")) / n_layers
    own = sparse.median_ms("store: read") + sparse.median_ms("store: write")
    print(f"the {shared} shared layers' reads can save {shared * per_layer:.2f} ms a step (the ordinary cache's "
          f"attention + cache update, {per_layer:.2f} ms per layer); the sparse store spends {own:.2f} ms of its own "
          "(reads and writes, its layers' attention not counted)")


if __name__ == "__main__":
    run_main(main)
