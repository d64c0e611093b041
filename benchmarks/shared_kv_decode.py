"""Decode-step time and bytes: the shared KV store against the ordinary cache, in one run.

    python benchmarks/shared_kv_decode.py                           # contexts 512 2048 8192
    python benchmarks/shared_kv_decode.py --contexts 64 --steps 3   # a quick check
    python benchmarks/shared_kv_decode.py --contexts 8192 --full-layers 1 2 --storages bf16 --profile

On the model, plan and dtype of ``params.yaml`` (the embedded SmolLM2 by default), for
each context length ``T`` it prefills ``T`` random tokens into every cache below, then
times ``--steps`` (>= 3) greedy decode steps of each through
:func:`ced_csa2.pipeline.timing.paired_seconds`: one untimed step of each cache, then rounds of one
step per cache, their order rotated each round, per-cache median (each step enters and
leaves its cache's hooks: microseconds against a step).  Caches:

* ``baseline / dynamic`` -- the plain model with transformers' ``DynamicCache``: the reference;
* ``{group} / dynamic`` -- Mode B (:class:`~ced_csa2.ced_runtime.CEDModeBRuntime`) with a
  ``DynamicCache``: the same outputs as the shared store, every layer storing its own K/V;
* ``{group} / shared-{storage}`` -- :class:`~ced_csa2.runtime.shared_kv.SharedKVCache`: the
  source's pre-norm K/V stored once, every target's K/V recomputed from it at each step (the
  cache of ``{group}``, or of ``{group}_fp4`` with an FP4 storage, built as the
  ``eval_generation`` stage builds it: :func:`~ced_csa2.eval.generation.group_cache`);
* ``{group} / shared-{format} rotated`` (``--rotated``) -- ``{group}_fp4_rot``'s: the same store
  holding ``FP4(R x)`` per head, un-rotated at every read (one ``head_dim²`` matmul per entry);
* ``{group} / shared-{storage} k{k}+w{window}`` --
  :class:`~ced_csa2.runtime.sparse_decode.SparseSharedKVCache`: the same store, the targets reading
  only the newest ``window`` positions and the source's top-``k`` (oracle indexer) at each step,
  their adapters run on those entries only (``--sparse K:WINDOW[:KEEP] ...``; ``KEEP``: the entries
  each target keeps between steps, default ``K + WINDOW``, label ``keep{n}``);
* ``... k{k}+w{window} indexed {name}`` -- the same with each trained lightning indexer of ``--indexers``
  (default ``studies/indexer/attention_rot.pt``; random weights of the narrow shape when absent: the timing
  depends on shapes only): its MXFP4 keys in the store, the source reading its selection too;
  the sparse caches also hold the entries each target keeps between steps (adapted, reused where a
  later step reads the same positions), counted in their bytes and accounting;
* ``baseline / fp4-{format}`` -- :class:`~ced_csa2.runtime.shared_kv.FP4KVCache` (``baseline_fp4``'s,
  by ``group_cache``): every layer's K/V in FP4, no sharing (the cost of FP4 alone); with
  ``--rotated`` also ``baseline / fp4-{format} rotated`` (``baseline_fp4_rot``'s).

``--full-layers K ...`` times instead the many-reader plans of ``studies/sharing.py``: ``K`` Full
layers above the cut (:func:`~ced_csa2.runtime.sub_plans.spaced_full_layers`), every other attention
layer above it a reader of the Full layer below it, served by
:class:`~ced_csa2.runtime.sub_plans.SubPlansSharedKVCache` (one ``SharedKVCache`` store per Full
layer, random maps of the trained shapes) -- ``k{K} {group} / shared-{storage}``, one arm per ``K``
and ``--storages`` entry, and one per ``--sparse`` reads (the oracle's: every Full layer's store a
``SparseSharedKVCache``) -- against the reference alone.  ``--profile`` then runs one more step of
every arm under ``torch.profiler`` and prints the operators taking most of its time.

Columns: ms per decode step (median) and its ratio to the reference's; the ratio of the
summed step times with its 95% interval over the rounds (paired bootstrap: a round's steps of
every cache are resampled together, :func:`~ced_csa2.eval.stats.ratio_bootstrap`), which says
whether a ratio near 1 is above or below it; the cache's K/V bytes after the run
(:func:`~ced_csa2.runtime.shared_kv.cache_bytes`): *used* (the entries written) and *allocated* (the
tensors holding them, the bytes the cache holds: a store's reserve of up to ``TokenStore.GROW``
positions included), used over the :mod:`ced_csa2.kv.kv_bytes` accounting (``all_attention``
basis, ``T + steps`` cached positions: 1 exactly), and used and allocated over the reference's
allocated bytes.  Maps: the trained ones in ``--models-dir`` when
``projector_k{s}v{s}.pt`` and ``adapters.pt`` are there, else random maps of the trained
shapes (the timing depends on shapes only); the first line says which.  Not part of the
tests.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

from ced_csa2.ced_runtime import CEDModeBRuntime, CEDParts, load_parts
from ced_csa2.config import load_params
from ced_csa2.csa2 import CSA2Adapters
from ced_csa2.eval.generation import StepDecoder, group_cache
from ced_csa2.eval.stats import ratio_bootstrap
from ced_csa2.kv.kv_bytes import bytes_per_token
from ced_csa2.maps.indexer import IndexerConfig, LightningIndexer, key_bytes, load_indexer
from ced_csa2.model_utils import attention, geometry, load_model_and_tokenizer, rope_fn
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import paired_seconds
from ced_csa2.plan import LayerPlan
from ced_csa2.projector import KVProjector
from ced_csa2.groups import GROUPS
from ced_csa2.runtime.shared_kv import SHARED_GROUPS, STORAGES, accounted_copies, cache_bytes
from ced_csa2.runtime.sparse_decode import SparseDecode, SparseSharedKVCache
from ced_csa2.runtime.sub_plans import SubPlansSharedKVCache, nested_copies, spaced_full_layers, sub_plans
from ced_csa2.train.indexer_training import new_indexer


def maps(models_dir: Path, plan: LayerPlan, geo, params, model) -> tuple[CEDParts, str]:
    """Trained maps from ``models_dir`` if present, else random ones of the same shapes."""
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    files = [models_dir / f"projector_k{plan.source}v{plan.source}.pt", models_dir / "adapters.pt"]
    if all(f.is_file() for f in files):
        trained = load_parts(models_dir, params, plan, geo, role=MAIN, device=device, dtype=dtype)
        return trained, f"trained maps from {models_dir}/"
    return random_maps(plan, geo, params, model), f"RANDOM maps (no {files[0].name} + {files[1].name} in {models_dir}/)"


def random_maps(plan: LayerPlan, geo, params, model) -> CEDParts:
    """A projector and adapters of the trained shapes (``train_adapters``' width), random, in the model's dtype."""
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    cfg = params.train_adapters
    adapters = CSA2Adapters(plan.targets, geo.kv_dim, width_mult=cfg.width_mult, activation=cfg.activation,
                            input=cfg.input, device=device, dtype=dtype)
    return CEDParts(KVProjector(geo.hidden_size, geo.kv_dim, device=device, dtype=dtype), adapters)


def indexer_for(path: Path, model, plan: LayerPlan, geo, params) -> tuple[LightningIndexer, str]:
    """The trained indexer of ``path`` if present, else a random narrow one (IndexerConfig defaults)."""
    rope = rope_fn(attention(model, plan.source))
    model_id = params.model.hf_id or params.model.name
    if path.is_file():
        return load_indexer(path, rope, expect={"model_id": model_id, "layer": plan.source}), f"trained indexer {path}"
    return new_indexer(model, geo, plan.source, IndexerConfig(), seed=0), f"RANDOM indexer (no {path})"


def fp4_group(group: str, rotated: bool = False) -> str:
    """The registry group storing ``group``'s shared entry in FP4 (``csa2`` -> ``csa2_fp4``, rotated ``csa2_fp4_rot``)."""
    return f"{group}_fp4" + ("_rot" if rotated else "")


def reference(model, plan):
    """The reference case of :func:`cases` and :func:`sub_plan_cases`: the plain model with a ``DynamicCache``."""
    return ("baseline / dynamic", ([plan], "baseline", "bf16"),
            lambda: group_cache(model, plan, "baseline", None, None).cache, lambda cache: contextlib.nullcontext())


def cases(model, plan, group: str, parts: CEDParts, storages, fp4_formats, sparse: list[SparseDecode],
          indexers: dict[str, LightningIndexer], rotated: bool = False):
    """``(label, accounting ([plan], group, storage), make_cache, context)`` for each cache to compare; a group's own
    cache is built by :func:`group_cache`, as the ``eval_generation`` stage builds it."""
    config = model.config

    def built(name: str, kv_format: str | None):
        return lambda: group_cache(model, plan, name, parts, kv_format).cache

    yield reference(model, plan)
    runtime = CEDModeBRuntime(model, plan, group, parts, kv_format="nvfp4")  # built once, entered per step
    yield (f"{group} / dynamic", ([plan], "baseline", "bf16"), lambda: DynamicCache(config=config), lambda cache: runtime)
    for storage in storages:
        names = [group] if storage == "bf16" else [fp4_group(group), *([fp4_group(group, True)] if rotated else [])]
        for name in names:
            label = f"{group} / shared-{storage}" + (" rotated" if GROUPS[name].rotate else "")
            yield label, ([plan], name, storage), built(name, storage), lambda cache: cache.feed()
        for reads in sparse:
            name = f"{group} / shared-{storage} k{reads.k}+w{reads.window}" + (
                f" keep{reads.keep}" if reads.keep is not None else "")
            yield (name, ([plan], group, storage, None, reads),
                   lambda s=storage, r=reads: SparseSharedKVCache(model, plan, group, parts, s, reads=r),
                   lambda cache: cache.feed())
            for indexer_name, indexer in indexers.items():
                yield (f"{name} indexed {indexer_name}", ([plan], group, storage, indexer, reads),
                       lambda s=storage, r=reads, i=indexer: SparseSharedKVCache(model, plan, group, parts, s,
                                                                                 reads=r, indexer=i),
                       lambda cache: cache.feed())
    for fmt in fp4_formats:
        for name in ("baseline_fp4", *(["baseline_fp4_rot"] if rotated else [])):
            label = f"baseline / fp4-{fmt}" + (" rotated" if GROUPS[name].rotate else "")
            yield label, ([plan], name, fmt), built(name, fmt), lambda cache: contextlib.nullcontext()


def sub_plan_cases(model, plan, geo, params, group: str, storages, full_layers: list[int], sparse: list[SparseDecode]):
    """The reference, then :class:`SubPlansSharedKVCache` per ``k`` of ``full_layers`` and storage, dense and with
    each of ``sparse``'s reads (the oracle): ``k`` Full layers above ``plan``'s cut, every other attention layer above
    it a reader (random maps of the trained shapes)."""
    yield reference(model, plan)
    for k in full_layers:
        plans = sub_plans(geo, plan.split, spaced_full_layers(geo, plan.split, k))
        parts = {p: random_maps(p, geo, params, model) for p in plans}
        readers = sum(len(p.targets) for p in plans)
        full = " ".join(str(p.source) for p in plans)
        for storage in storages:
            make = lambda s=storage, ps=plans, q=parts: SubPlansSharedKVCache(model, ps, group, q, s)  # noqa: E731
            yield (f"k{k} {group} / shared-{storage} (Full {full}, {readers} readers)", (plans, group, storage), make,
                   lambda cache: cache.feed())
            for r in sparse:
                make = lambda s=storage, ps=plans, q=parts, r=r: SubPlansSharedKVCache(  # noqa: E731
                    model, ps, group, q, s, reads=r)
                yield (f"k{k} {group} / shared-{storage} k{r.k}+w{r.window}" + (f" keep{r.keep}" if r.keep else ""),
                       (plans, group, storage, None, r), make, lambda cache: cache.feed())


def print_profile(runs: dict[str, StepDecoder], top: int = 6) -> None:
    """One more step of every arm under ``torch.profiler``: its wall ms and the ``top`` operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    for label, decoder in runs.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decoder.step()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        print(f"profile {label}: {total / 1e3:.1f} ms self CPU in one step; " + "; ".join(
            f"{e.key} {e.self_cpu_time_total / 1e3:.1f} ms ({100 * e.self_cpu_time_total / total:.0f}%, "
            f"{e.count} calls)" for e in ops[:top]))


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192], help="prefill lengths T")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per context and cache")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--group", default="csa2", choices=SHARED_GROUPS)
    ap.add_argument("--storages", nargs="+", default=list(STORAGES), choices=STORAGES)
    ap.add_argument("--fp4-baselines", nargs="*", default=["nvfp4", "mxfp4"], choices=STORAGES[1:])
    ap.add_argument("--rotated", action="store_true",
                    help="also time each dense FP4 store rotated ({group}_fp4_rot, baseline_fp4_rot)")
    ap.add_argument("--sparse", nargs="*", default=["128:64"], metavar="K:WINDOW[:KEEP]",
                    help="sparse decode reads of the shared stores (none: dense stores only)")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--models-dir", type=Path, default=Path("models"))
    ap.add_argument("--indexers", type=Path, nargs="+", default=[Path("studies/indexer/attention_rot.pt")],
                    help="trained indexers, each timed in its own sparse arms (labelled by file stem)")
    ap.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                    help="model dtype (default: params.model.dtype)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--full-layers", type=int, nargs="+", metavar="K",
                    help="time instead k Full layers above the cut, every other layer a reader, per K (see above)")
    ap.add_argument("--profile", action="store_true", help="then profile one more step of every arm")
    args = ap.parse_args()
    sparse = [SparseDecode.from_spec(spec) for spec in args.sparse]
    if set(args.storages) - {"bf16"} and fp4_group(args.group) not in GROUPS:
        ap.error(f"--group {args.group} has no FP4 group ({fp4_group(args.group)} is not in the registry); "
                 "give --storages bf16")
    stems = [path.stem for path in args.indexers]
    if len(set(stems)) < len(stems):  # the arms are labelled by stem: two files of one stem would share a row
        ap.error(f"--indexers: two files share a name {sorted({s for s in stems if stems.count(s) > 1})}; "
                 "each indexer's arms are labelled by its file stem")

    params = load_params(args.params)
    model, _ = load_model_and_tokenizer(params.model, dtype=args.dtype, device=args.device)
    geo = geometry(model.config)
    plan = LayerPlan.from_config(params.plan).validate(geo)
    parts, note = maps(args.models_dir, plan, geo, params, model)
    loaded = {path.stem: indexer_for(path, model, plan, geo, params) for path in args.indexers}
    indexers = {name: indexer for name, (indexer, _) in loaded.items()}
    indexer_notes = [note for _, note in loaded.values()]
    dtype = next(model.parameters()).dtype
    dtype_bytes = torch.finfo(dtype).bits // 8
    print(f"{params.model.name} {dtype} on {args.device} ({torch.get_num_threads()} threads); plan split "
          f"{plan.split} source {plan.source} targets {list(plan.targets)}; batch {args.batch}; {note}; {'; '.join(indexer_notes)}")
    print(f"'bf16' storage = the model dtype ({dtype}); median of {args.steps} decode steps after one warm-up, "
          "the caches' steps alternated")
    header = (f"{'context':>7}  {'cache':<60} {'ms/step':>8} {'x ref':>6} {'sum x ref [95% CI]':>20} {'used MiB':>9} "
              f"{'alloc MiB':>9} {'used/accounted':>14} {'used/ref':>8} {'alloc/ref':>9}")
    print(header)
    gen = torch.Generator().manual_seed(args.seed)
    for context in args.contexts:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, context), generator=gen).to(args.device)
        ref_ms = ref_bytes = None
        runs, accounting = {}, {}
        arms = (sub_plan_cases(model, plan, geo, params, args.group, args.storages, args.full_layers, sparse)
                if args.full_layers else cases(model, plan, args.group, parts, args.storages, args.fp4_baselines,
                                               sparse, indexers, args.rotated))
        for label, acc, make_cache, ctx in arms:
            cache = make_cache()
            runs[label], accounting[label] = StepDecoder(model, cache, lambda c=cache, ctx=ctx: ctx(c)), acc
            runs[label].prefill(ids)
        paired = paired_seconds({label: d.step for label, d in runs.items()}, args.steps, device=args.device)
        seconds, ref_label = paired.seconds, next(iter(runs))
        for label, (acc_plans, acc_group, acc_storage, *sparse_parts) in accounting.items():
            cache, ms = runs[label].cache, 1e3 * seconds[label]
            nbytes = cache_bytes(cache)
            per_token = bytes_per_token(nested_copies([accounted_copies(geo, p, acc_group, acc_storage, dtype_bytes)
                                                       for p in acc_plans]))
            accounted = per_token * args.batch * cache.get_seq_length()
            if sparse_parts:  # the indexer's keys per position; the last step's adapted entries (flat)
                reader, reads = sparse_parts
                accounted += key_bytes(reader.key_width) * args.batch * cache.get_seq_length() if reader else 0
                accounted += reads.adapted_bytes(sum(len(p.targets) for p in acc_plans), geo.kv_dim, dtype_bytes,
                                                 args.batch)
            ref_ms, ref_bytes = ref_ms or ms, ref_bytes or nbytes.allocated
            summed = ratio_bootstrap(np.array(paired.runs[label]), np.array(paired.runs[ref_label]), seed=args.seed)
            low, high = summed["ci95"]
            print(f"{context:>7}  {label:<60} {ms:>8.2f} {ms / ref_ms:>6.2f} "
                  f"{summed['value']:>6.3f} [{low:.3f}, {high:.3f}] {nbytes.used / 2**20:>9.2f} "
                  f"{nbytes.allocated / 2**20:>9.2f} {nbytes.used / accounted:>14.4f} {nbytes.used / ref_bytes:>8.3f} "
                  f"{nbytes.allocated / ref_bytes:>9.3f}")
            del cache
        if args.profile:
            print_profile(runs)
        del runs


if __name__ == "__main__":
    run_main(main)
