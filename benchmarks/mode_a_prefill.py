"""Mode A's prefill speed-up on the params.yaml model, against the bound its layer count allows.

    python benchmarks/mode_a_prefill.py                                   # from the repository root
    python benchmarks/mode_a_prefill.py --workdir /path/to/repro --repeats 5
    python benchmarks/mode_a_prefill.py --dtypes float32 --lengths 512 --head-widths 0 64 384  # what heads cost
    python benchmarks/mode_a_prefill.py --dtypes float32 --lengths 512 --ranks 0 128 256      # what a bank saves

The model is loaded as the pipeline loads it (``load_model_and_tokenizer(params.model,
dtype=...)``), once per ``--dtypes`` entry; the plan is ``params.plan`` (it must cover every
attention layer above the cut, as ``eval_ppl``'s Mode A requires).  The maps are the ones
``eval_ppl`` runs Mode A with (:func:`~ced_csa2.ced_runtime.load_mode_a_parts` of ``--workdir``:
``mode_a.maps``, with the sink's constants under ``mode_a.sink: mean``; or ``--models``, a
folder of the main branch's maps, through :func:`~ced_csa2.ced_runtime.load_parts`), float32 as in ``eval_ppl``,
when they are there and match, else random maps of the right shapes (speed does not depend on
the weights); the output says which.  Every arm runs with ``mode_a.sink`` (random arms: random
constants).  ``--head-widths w ...`` adds, in the same paired run, one
arm per width ``w``: random maps whose projectors carry a residual MLP of width ``w`` (0: linear),
so the speed a ``mode_a.train.head_width`` costs is measured before any training; ``--ranks r ...``
likewise one arm per ``r``: random maps whose projectors are one bank of rank ``r``
(``mode_a.train.rank``; 0: one linear map per layer).

Prompt lengths: the median prompt of ``eval_ppl``'s Mode A (``prefix_fraction`` of each
eval record of ``--workdir``, minus the last token, which the continuation consumes)
-- 220 tokens if ``data/corpus/eval.jsonl`` is not there -- and ``--lengths``.  Tokens
are seeded random ids of the vocabulary.

Each (length, dtype): the two arms that ``eval_ppl`` times (the plain prefill and
:meth:`~ced_csa2.ced_runtime.CEDModeARuntime.prefill`, both under inference mode) through
:func:`ced_csa2.pipeline.timing.paired_seconds` (one untimed warm-up of each, arms alternated,
median of ``--repeats``).  ``bound`` = ``n_layers / split``
(:func:`ced_csa2.eval.perplexity.prefill_bound`: embedding and maps left out, so the reachable
speed-up is lower); a ratio above it is flagged in its row and, once the table is
complete, stops the run (:class:`~ced_csa2.pipeline.timing.BoundExceeded`, naming every such row).
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

import torch

from ced_csa2.ced_runtime import (CEDModeARuntime, CEDParts, SinkKV, load_mode_a_parts, load_parts, plain_prefill,
                                  prompt_tokens)
from ced_csa2.config import load_params
from ced_csa2.csa2 import CSA2Adapters
from ced_csa2.eval.perplexity import eval_ids, prefill_bound
from ced_csa2.model_utils import load_model_and_tokenizer
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.pipeline.paths import EVAL_JSONL
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import PROTOCOL, BoundExceeded, check_bound, paired_seconds
from ced_csa2.plan import load_plan
from ced_csa2.projector import KVProjector, ProjectorBank

DEFAULT_PROMPT = 220  # the embedded default's median Mode A prompt, when its eval records are absent


def random_parts(geo, plan, head_width: int = 0, rank: int = 0) -> CEDParts:
    """Maps of ``plan``'s shapes, seeded (float32, as :func:`load_parts` builds them); projectors with a
    residual MLP of ``head_width`` (0: linear), or one bank of rank ``rank`` (0: one map per layer)."""
    torch.manual_seed(0)
    adapters, sink = CSA2Adapters(plan.targets, geo.kv_dim), SinkKV(plan.kv_layers, geo.kv_dim)
    if rank:
        return CEDParts(adapters=adapters, bank=ProjectorBank(geo.hidden_size, geo.kv_dim, plan.projected, rank),
                        sink=sink)

    def projector():
        return KVProjector(geo.hidden_size, geo.kv_dim, mlp_width=head_width)
    return CEDParts(projector(), adapters, {e: projector() for e in plan.extra_sources}, sink=sink)


def median_prompt(params, tok, workdir: Path) -> tuple[int, str]:
    """Median Mode A prompt length (tokens the prefill sees) of ``workdir``'s eval records, and where it came from."""
    if not (workdir / EVAL_JSONL).is_file():
        return DEFAULT_PROMPT, f"default {DEFAULT_PROMPT} ({workdir / EVAL_JSONL} absent)"
    ids = eval_ids(params, tok, workdir)
    # as mode_a_prefix cuts: all but the prompt's last token prefilled
    lengths = [prompt_tokens(len(r), params.eval_ppl.prefix_fraction) - 1 for r in ids]
    return int(statistics.median(lengths)), f"median of {len(ids)} eval records' prompts"


def cpu_line() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name}; {', '.join(isa) or 'no avx2'}; {'no ' if 'amx_bf16' not in flags else ''}AMX"


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--workdir", type=Path, default=Path("."), help="where data/corpus/eval.jsonl is")
    ap.add_argument("--models", type=Path, default=None,
                    help="a folder of the main branch's maps (default: the ones eval_ppl's Mode A reads from "
                         "--workdir)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--head-widths", type=int, nargs="*", default=[],
                    help="also time random maps with residual heads of these widths (0 = linear)")
    ap.add_argument("--ranks", type=int, nargs="*", default=[],
                    help="also time random maps whose projectors are one bank of these ranks (0 = one map per layer)")
    args = ap.parse_args()

    params = load_params(args.params)
    plan, geo = load_plan(params.plan, params.model)
    print(f"model {params.model.name}: {geo.n_layers} layers, Mode A runs {plan.split} "
          f"(bound {prefill_bound(geo, plan):.3f}x without an exact sink; plan {plan})")
    print(f"CPU: {cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"timing: {PROTOCOL.format(repeats=args.repeats)}")
    exceeded = []
    for dtype in args.dtypes:
        model, tok = load_model_and_tokenizer(params.model, dtype=getattr(torch, dtype))
        device = next(model.parameters()).device
        where = args.models or args.workdir
        try:
            parts = (load_parts(args.models, params, plan, geo, role=MAIN, device=device) if args.models
                     else load_mode_a_parts(args.workdir, params, plan, geo, device=device))
            if parts.sink is None:  # a folder of maps without the sink's constants: random ones (a timing)
                parts.sink = random_parts(geo, plan).sink
            label, maps = "trained", f"trained ({where}), sink {params.mode_a.sink}"
        except (OSError, ValueError):  # CheckpointError is a ValueError
            parts, label, maps = random_parts(geo, plan), "random", f"random (no matching maps in {where})"
        if dtype == args.dtypes[0]:
            prompt, origin = median_prompt(params, tok, args.workdir)
            lengths = [prompt, *args.lengths]
            print(f"maps: {maps}; prompt lengths: {prompt} ({origin}), {', '.join(map(str, args.lengths))}")
            print()
            print("| prompt tokens | dtype | maps | plain s | Mode A s | ratio | bound |")
            print("|---:|---|---|---:|---:|---:|---:|")
        sink = params.mode_a.sink
        runtimes = {label: CEDModeARuntime(model, plan, geo, parts, sink=sink)}  # keyed by the table's "maps" column
        runtimes.update({f"random, head {w}": CEDModeARuntime(model, plan, geo, random_parts(geo, plan, w), sink=sink)
                         for w in args.head_widths})
        runtimes.update({f"random, rank {r}": CEDModeARuntime(model, plan, geo, random_parts(geo, plan, rank=r), sink=sink)
                         for r in args.ranks})
        timed_plain = torch.inference_mode()(plain_prefill)
        g = torch.Generator().manual_seed(0)
        for n in lengths:
            bound = prefill_bound(geo, plan, prefilled=[n], sink=int(params.mode_a.sink == "exact"))
            ids = torch.randint(0, len(tok), (1, n), generator=g).to(device)
            # the arms bind this loop's model and prompt (both are deleted after the dtype's loop)
            arms = {"plain": lambda m=model, x=ids: timed_plain(m, x)}
            arms.update({k: (lambda r=r, x=ids: r.prefill(x)) for k, r in runtimes.items()})
            t = paired_seconds(arms, args.repeats, device=device)
            for arm in runtimes:
                ratio = t.ratio("plain", arm)
                try:
                    check_bound(ratio, bound, f"Mode A prefill ({arm} maps), {n} tokens, {dtype}", t.seconds)
                    flag = ""
                except BoundExceeded as exc:
                    exceeded.append(str(exc))
                    flag = " **exceeds the bound**"
                print(f"| {n} | {dtype} | {arm} | {t.seconds['plain']:.4f} | {t.seconds[arm]:.4f} | "
                      f"{ratio:.3f}{flag} | {bound:.3f} |", flush=True)
        del model, runtimes, parts
    if exceeded:
        raise BoundExceeded("; ".join(exceeded))


if __name__ == "__main__":
    run_main(main)
