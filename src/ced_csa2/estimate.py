"""Resource estimate of a profile before any heavy work: rows, dump bytes, memory, steps and time per stage.

    python -m ced_csa2.estimate                      # params.yaml as committed, on this machine's device
    python -m ced_csa2.estimate model=qwen3_5_4b data=wikitext plan=qwen3_5 budget=recipe --device cuda
    python -m ced_csa2.estimate --changed            # what `dvc repro` would re-run now, why, and its minutes
    python -m ced_csa2.estimate --changed -S ridge.lambda=10   # ... what `dvc exp run -S ridge.lambda=10` would

Overrides compose ``conf/`` in memory as ``python -m ced_csa2.compose`` would (``params.yaml``
is left as it is); without them ``params.yaml`` is read.  Nothing heavy runs: the model is
built from its config on the meta device (no weights) to count its parameters -- Qwen3.5-4B
from its built-in config (:func:`~ced_csa2.model_utils.qwen3_5_4b_config`, no download), a
pinned GGUF from its config in the asset cache (fetched and converted once), the tiny model
locally.  ``--workdir`` (default: here) is where ``data/`` and ``metrics/`` are read.

What the columns count:

* **rows** -- what the stage reads or scores.  The dump's rows are the tokens of the dumped
  records: exact from ``data/corpus/train.jsonl`` (the dump stage's own seeded sample) when
  ``metrics/prepare.json`` says it was prepared for this model and data, otherwise an upper
  bound, records x ``data.max_tokens``; eval tokens likewise from ``data/corpus/eval.jsonl``,
  GSM8K gold tokens from ``data/gsm8k_gold.json``.  The header says which.
* **disk** -- the dump's datasets as the dump stage writes them, in whole HDF5 chunks
  (:meth:`~ced_csa2.data.dump_file.DumpLayout.nbytes`; its payload, rows x width x itemsize, in the
  header).  The file adds its metadata (chunk indices, checksum attributes: a small fraction,
  ``docs/costs.md``); DVC's cache holds a second copy.
* **host / device** -- approximate peaks (:func:`peaks`): the measured footprint of a process
  with torch and transformers imported, the weights (loaded on the host first), one batch's
  working set, and what the stage holds (the trainers' rows, the ridge statistics, logits);
  a CPU run puts it all on the host.
* **steps** -- optimizer steps of the stages that train.
* **time** -- the stage's work over :data:`RATES` (FLOPs of its matmuls, dump bytes read and
  written, generation steps): measured on this project's CPU, *assumed* for a GPU.  On a CPU the
  command line scales the compute rates to the machine it runs on (:func:`calibrated_rates`: a
  two-second matmul probe against the same probe on the CPU the rates were fitted on, cached in
  ``<asset cache>/estimate/cpu_probe.json`` per CPU model, flags, cores and torch threads) and
  prints the load average when other work shares the CPU.  How close it comes:
  ``docs/costs.md``, "The estimate on your CPU".

Stages that need seconds and no model (``check_params``, ``storage``, ``gold_pairs``,
``report``) are not listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from .ced_runtime import prompt_tokens
from .eval.generation import supported_groups
from .config import Params, from_dict, load_params
from .csa2 import mlp_width
from .data.dump_file import DumpLayout
from .data.loader import record_split
from .data.records import DUMP_SAMPLE_STREAM, read_records, seeded_subset
from .eval.perplexity import EVAL_SAMPLE_STREAM
from .kv.kv_bytes import adapter_params_per_target, projector_params
from .maps.ridge import map_groups
from .model_utils import QWEN3_5_4B_ID, Geometry, geometry, load_config, qwen3_5_4b_config, resolve_dtype
from .pipeline.cli import ArgumentParser
from .pipeline.paths import EVAL_JSONL, GOLD_PATH, PREPARE_METRICS, TRAIN_JSONL, domain_jsonl
from .pipeline.stage_runner import error_line, is_input_error
from .plan import LayerPlan
from .groups import GROUPS
from .train.objective_registry import tune_objective
from .train.objectives import PHASE_GROUPS

MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Rates:
    """What one device sustains on the pipeline's work: the time column divides by these."""

    model_flops: float  # the base model's matmuls (dump, scoring, generation, online objectives), FLOP/s
    map_flops: float  # training and validating the projector / adapters on dump rows, FLOP/s
    f64_flops: float  # float64 statistics of ridge and fit_xkv, always on the host CPU, FLOP/s
    logits: float  # scored logits per second through the vocabulary-wide work (log-softmax, KL, top-1)
    decode_step_s: float  # least time of one generation step (every layer's kernels, launched from Python)
    read_bytes: float  # dump bytes read and CRC-verified per second (host)
    write_bytes: float  # dump bytes written per second (host)
    basis: str


# This project's 2-core AVX-512 Xeon in fp32 (the default's dtype on every CPU), fitted to the embedded default's measured stages
# (benchmarks/results/repro_e2e.md, metrics/*.json) with this module's own work model: the dump's forward
# passes, both trainers, ridge (float64), the four scoring stages' scored logits, the baseline's GSM8K generation
# (stop sequences end most answers sooner: a step here is an upper-bound step), reads from disk with CRC checks
# (benchmarks/dump_verify.py) and writes.  The fit's inputs, how close it comes per stage and how low its host
# peaks come out (the libraries -- lm-eval, h5py, ... -- this model does not count): docs/costs.md, "Figures
# behind the code's choices".
_CPU = Rates(model_flops=2.1e11, map_flops=2.1e11, f64_flops=8.7e10, logits=2.6e8, decode_step_s=0.092, read_bytes=1 / 1.27e-9,
             write_bytes=1e9, basis="measured on this project's 2-core CPU, fp32 (benchmarks/results/repro_e2e.md)")
RATES = {
    "cpu": _CPU,
    # No GPU was measured: ASSUMED ~1/3 of an A100's 312 TFLOP/s dense bf16 peak for the model (an H100 does
    # more, an RTX 4070 Ti SUPER less), half that for the small maps, ~40 B of memory traffic per scored
    # logit at 2 TB/s, 40 ms per generation step (HF generate launches every layer's kernels from Python);
    # ridge/fit_xkv and dump I/O at this CPU's rates.
    "cuda": Rates(model_flops=1e14, map_flops=5e13, f64_flops=_CPU.f64_flops, logits=5e10, decode_step_s=0.04,
                  read_bytes=_CPU.read_bytes, write_bytes=_CPU.write_bytes,
                  basis="ASSUMED (no GPU measured): 100 TFLOP/s bf16 for the model, 50 for the maps, 5e10 scored "
                        "logits/s, 40 ms per generation step; host CPU work and dump I/O at this project's CPU rates"),
}
# The probe: SmolLM2's MLP up-projection over 4,096 positions, float32, the decoder's commonest product.  A stand-in
# for the model's forward because it needs no weights (the full profile's model cannot run on most CPUs at all), takes
# two seconds whatever the profile, and measures what the fitted rates depend on: the BLAS kernels (AVX2, AVX-512) and
# the cores torch uses.  On the CPU that fitted _CPU it ran at 300 GFLOP/s, the decoder's matmuls at 210 (docs/costs.md,
# "Where the time goes").
PROBE_SHAPE = (4096, 576, 1536)
PROBE_REFERENCE_FLOPS = 3.0e11
PROBE_SECONDS = 2.0
PROBE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides the kernels (fp32, and bf16 if asked)
# Peak RSS of a stage that imports torch + transformers and loads no model (the storage stage, 308 MiB, repro_e2e.md).
RUNTIME_HOST = 308 * MiB
CUDA_CONTEXT = 512 * MiB  # ASSUMED: what the CUDA context and kernels take on the device before any tensor
# GSM8K token counts before `gold_pairs` has run: the embedded default's lm-eval pairs (SmolLM2's tokenizer):
# prompt 67 + gold answer 124 tokens on average, the longest 361; GSM8K test has 1,319 problems.
GOLD_PROMPT_TOKENS, GOLD_TOKENS, GOLD_MAX_TOKENS, GSM8K_TEST = 67, 191, 361, 1319


# ----------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs of the base model, from its config alone."""

    name: str
    geo: Geometry
    params: int  # every parameter of the causal LM (tied embeddings counted once)
    body: int  # the decoder layers': a token's forward multiplies by each once
    vocab: int
    intermediate: int
    source: str  # where the config came from


def model_facts(params: Params) -> ModelFacts:
    """Count the model's parameters on the meta device (no weights, nothing allocated)."""
    from transformers import AutoModelForCausalLM

    cfg = params.model
    if cfg.kind == "hub" and cfg.hf_id == QWEN3_5_4B_ID:
        config, source = qwen3_5_4b_config(), "built-in Qwen3.5-4B text config, no download"
    else:
        config, source = load_config(cfg), f"{cfg.kind} model config"
    text = config.get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text)
    return ModelFacts(cfg.hf_id or cfg.name, geometry(text), sum(p.numel() for p in model.parameters()),
                      sum(p.numel() for p in model.model.layers.parameters()), text.vocab_size,
                      text.intermediate_size, source)


@dataclass(frozen=True)
class Lengths:
    """Tokens per record of one set, and whether they are the prepared files' (exact) or an upper bound."""

    tokens: np.ndarray
    exact: bool
    source: str

    @property
    def total(self) -> int:
        return int(self.tokens.sum())


def prepared_for(params: Params, workdir: Path) -> bool:
    """Whether ``data/`` holds this model's and data's prepared corpus (``metrics/prepare.json`` says so)."""
    path = workdir / PREPARE_METRICS
    if not (path.is_file() and (workdir / TRAIN_JSONL).is_file()):
        return False
    made = json.loads(path.read_text())
    quotas = params.data.mix_quotas()
    return (made.get("data") == params.data.name and made.get("model") == params.model.name
            and {d: m.get("rows") for d, m in made.get("mix", {}).items()} == quotas)


def train_records(params: Params, workdir: Path) -> int | None:
    """How many train records ``prepare`` writes: the prepared corpus's count, else at most what params allow
    (``None``: only the corpus knows, as for the embedded Wikipedia sample without ``data.n_train``)."""
    if prepared_for(params, workdir):
        return len(read_records(workdir / TRAIN_JSONL))
    data = params.data
    if data.kind == "tiny":
        return data.n_train
    hub = sum(s.n for s in data.train) if data.kind == "wikitext" and all(s.n for s in data.train) else 0
    return min([n for n in (hub, data.n_train) if n], default=None)


def dump_lengths(params: Params, workdir: Path) -> Lengths:
    """Tokens per dumped record: the dump stage's seeded sample of the prepared corpus, or an upper bound."""
    if prepared_for(params, workdir):
        counts = [r["n_tokens"] for r in read_records(workdir / TRAIN_JSONL)]
        keep = seeded_subset(len(counts), params.dump.records, params.seed, DUMP_SAMPLE_STREAM)
        return Lengths(np.array(counts)[keep], True, f"exact: {TRAIN_JSONL}, the dump's {len(keep)} of "
                                                    f"{len(counts)} records")
    if params.data.mix:  # the mix fixes the rows, not the records: as few records as can hold them
        n, last = divmod(params.data.mix_rows, params.data.max_tokens)
        return Lengths(np.array([params.data.max_tokens] * n + [last] * bool(last)), False,
                       f"the mix's data.mix_rows {params.data.mix_rows:,} rows exactly, no {TRAIN_JSONL} prepared for it")
    n = min([n for n in (train_records(params, workdir), params.dump.records) if n], default=None)
    if n is None:
        raise ValueError(f"how many train records data '{params.data.name}' yields is known only after "
                         f"`dvc repro prepare` (or set dump.records): run it, then estimate again")
    return Lengths(np.full(n, params.data.max_tokens), False,
                   f"upper bound: {n:,} records x data.max_tokens {params.data.max_tokens}, no {TRAIN_JSONL} "
                   f"prepared for this model and data")


def eval_lengths(params: Params, workdir: Path) -> Lengths:
    """Tokens per scored eval record (``eval_ppl.records`` of them), exact or an upper bound."""
    if prepared_for(params, workdir):
        counts = [r["n_tokens"] for r in read_records(workdir / EVAL_JSONL)]
        keep = seeded_subset(len(counts), params.eval_ppl.records, params.seed, EVAL_SAMPLE_STREAM)
        return Lengths(np.array(counts)[keep], True, f"exact: {EVAL_JSONL}")
    n = min(params.eval_ppl.records or params.data.n_eval, params.data.n_eval)
    return Lengths(np.full(n, params.data.max_tokens), False, "upper bound")


def domain_lengths(params: Params, workdir: Path) -> Lengths:
    """Tokens per scored record of every other domain (``eval_ppl.domain_records`` of each ``data.domains`` set),
    exact where its prepared file is there, else ``data.max_tokens`` per record (an upper bound)."""
    counts, exact = [], prepared_for(params, workdir)
    for domain in params.data.domains:
        path = workdir / domain_jsonl(domain.name)
        if exact and path.is_file():
            tokens = [r["n_tokens"] for r in read_records(path)]
            counts += [tokens[i] for i in seeded_subset(len(tokens), params.eval_ppl.domain_records, params.seed,
                                                        EVAL_SAMPLE_STREAM)]
        else:
            exact = False
            counts += [params.data.max_tokens] * min(params.eval_ppl.domain_records or domain.n, domain.n)
    return Lengths(np.array(counts, dtype=np.int64), exact, "exact: data/corpus/domains" if exact else "upper bound")


def gold_lengths(params: Params, workdir: Path) -> tuple[Lengths, int]:
    """Tokens of each GSM8K gold pair (prompt + answer) and the mean prompt length."""
    path = workdir / GOLD_PATH
    if path.is_file():
        gold = json.loads(path.read_text())
        if (gold.get("model"), gold.get("num_fewshot"), gold.get("math_set")) == (
                params.model.name, params.eval_gsm8k.num_fewshot, params.data.math_label()):
            pairs = gold["pairs"]
            return (Lengths(np.array([len(ids) for ids, _ in pairs]), True, f"exact: {GOLD_PATH}"),
                    round(np.mean([cut for _, cut in pairs])))
    n = params.data.math.n or GSM8K_TEST
    return Lengths(np.full(n, GOLD_TOKENS), False, f"assumed {GOLD_TOKENS} tokens per problem"), GOLD_PROMPT_TOKENS


@dataclass(frozen=True)
class Setup:
    params: Params
    model: ModelFacts
    plan: LayerPlan
    device: str  # "cpu" | "cuda"
    dtype: torch.dtype  # the model's compute dtype there
    rates: Rates
    dump: Lengths
    eval: Lengths
    domains: Lengths  # eval_ppl's records of the other domains
    gold: Lengths
    prompt_tokens: int
    workdir: Path

    @property
    def b(self) -> int:
        """Bytes per element of the compute dtype."""
        return torch.finfo(self.dtype).bits // 8

    @property
    def weights(self) -> int:
        return self.model.params * self.b

    @property
    def split(self) -> tuple[np.ndarray, np.ndarray]:
        """Train and validation record indices of the dump (the ridge stage's split)."""
        return record_split(len(self.dump.tokens), self.params.split.val_fraction, self.params.seed)


# ----------------------------------------------------------------------------- work model

def forward_flops(m: ModelFacts, tokens: float, layers: float = 1.0, heads: float = 1.0) -> float:
    """Matmul FLOPs (2 per multiply-add) of ``tokens`` positions through ``layers`` x the decoder and ``heads`` LM heads.

    Attention's own ``T x T`` products are left out: at 512 tokens ~0.5% of Qwen3.5-4B's (8 attention layers),
    up to ~8% of SmolLM2's (30), which the CPU rates, fitted on SmolLM2, absorb.
    """
    return 2.0 * tokens * (layers * m.body + heads * m.geo.hidden_size * m.vocab)


def layer_bytes(s: Setup, tokens: int) -> int:
    """One decoder layer's transient tensors for ``tokens`` positions in inference (residual, norm, q/k/v/o,
    and the MLP's gate, up and product): ~(4 hidden + 3 intermediate) values each -- freed layer by layer."""
    return tokens * (4 * s.model.geo.hidden_size + 3 * s.model.intermediate) * s.b


def logits_bytes(s: Setup, tokens: int) -> int:
    """Logits of ``tokens`` positions in the compute dtype plus three fp32 copies (the fp32 logits, the
    log-softmax temporary, the reference's probabilities: one block of
    :func:`~ced_csa2.eval.scoring.score_hidden`, or a batch of distillation logits)."""
    return tokens * s.model.vocab * (s.b + 12)


def peaks(s: Setup, *, model: bool, device_work: int = 0, host_work: int = 0) -> tuple[int, int | None]:
    """``(host, device)`` peak bytes: ``device_work`` runs where the model runs (host on a CPU); the weights
    load on the host first (``from_pretrained``, then ``.to(device)``)."""
    weights = s.weights if model else 0
    if s.device == "cpu":
        return RUNTIME_HOST + weights + device_work + host_work, None
    device = CUDA_CONTEXT + weights + device_work if model or device_work else None  # host-only stages: no GPU
    return RUNTIME_HOST + weights + host_work, device


def branch_layer(s: Setup, group: str) -> int:
    """The first layer ``group`` changes, where its branch leaves the shared trunk (as
    :func:`~ced_csa2.eval.scoring.branch_point`; ``n_layers + 1`` for the plain model)."""
    g, plan = GROUPS[group], s.plan
    layers = [*([plan.source] if g.projected_source or g.fp4 == "shared_source" or g.low_rank else []),
              *([min(plan.targets)] if g.shares_source_kv else []),
              *([s.model.geo.attention_layers[0]] if g.fp4 == "every_layer" else [])]
    return min(layers, default=s.model.geo.n_layers + 1)


def scoring_seconds(s: Setup, groups, tokens: float, passes: int = 0) -> float:
    """All ``groups`` scored on ``tokens`` positions with one shared trunk (:func:`~ced_csa2.eval.scoring.multi_group_nll`:
    the plain model once, each other group from its branch layer up), plus ``passes`` whole forwards scored alike
    (Mode A's plain and skipped prefill): matmuls at the model rate, each scored logit's vocabulary-wide work
    (log-softmax, KL, top-1) at the logit rate."""
    n = s.model.geo.n_layers
    runs = n + sum(n + 1 - branch_layer(s, g) for g in groups if branch_layer(s, g) <= n)
    flops = forward_flops(s.model, tokens, layers=runs / n + passes, heads=len(groups) + passes)
    return flops / s.rates.model_flops + tokens * s.model.vocab * (len(groups) + passes) / s.rates.logits


def mode_a_covered(s: Setup) -> bool:
    return not s.plan.uncovered(s.model.geo)


def map_seconds(s: Setup, weights: int, train_rows: int, val_rows: int, epochs: int) -> float:
    """Training ``weights`` map parameters for ``epochs`` over ``train_rows`` (forward + backward: 3x a forward),
    validated on ``val_rows`` before training and after each epoch."""
    flops = 2.0 * weights * (3 * train_rows * epochs + val_rows * (epochs + 1))
    return flops / s.rates.map_flops


# ----------------------------------------------------------------------------- stages

@dataclass(frozen=True)
class StageEstimate:
    stage: str
    rows: str
    disk: int | None = None
    host: int | None = None
    device: int | None = None
    steps: int | None = None
    seconds: float | None = None
    note: str = ""


def est_prepare(s: Setup) -> StageEstimate:
    n = train_records(s.params, s.workdir)
    return StageEstimate("prepare", f"{'?' if n is None else f'{n:,}'} train + {s.params.data.n_eval:,} eval records",
                         note="tokenizer only" + (" + hub downloads" if s.params.data.kind == "wikitext" else ""))


def dump_layout(s: Setup) -> DumpLayout:
    geo = s.model.geo
    return DumpLayout(geo.hidden_size, geo.kv_dim, s.plan.kv_layers, s.params.dump.storage_dtype)


def est_dump(s: Setup) -> StageEstimate:
    cfg, layout = s.params.dump, dump_layout(s)
    tokens = s.dump.tokens
    padded = sum(len(tokens[i:i + cfg.batch_size]) * int(tokens[i:i + cfg.batch_size].max())
                 for i in range(0, len(tokens), cfg.batch_size))  # right-padded batches compute their pads
    _, allocated = layout.nbytes(s.dump.total, len(tokens), cfg.chunk_kib)
    batch = cfg.batch_size * int(tokens.max())
    row_width = sum(layout.widths().values())
    host, device = peaks(s, model=True, device_work=layer_bytes(s, batch) + batch * row_width * s.b,
                         host_work=batch * row_width * layout.np_dtype.itemsize)
    seconds = forward_flops(s.model, padded, heads=0) / s.rates.model_flops + allocated / s.rates.write_bytes
    return StageEstimate("dump", f"{s.dump.total:,} rows", allocated, host, device, None, seconds,
                         f"{row_width} values/row, {cfg.storage_dtype}")


def row_counts(s: Setup, records: np.ndarray, per_record: int = 0) -> int:
    """Rows of ``records`` (``per_record`` > 0: at most that many sampled from each, as ``split.tokens_per_record``)."""
    tokens = s.dump.tokens[records]
    return int(np.minimum(tokens, per_record).sum() if per_record else tokens.sum())


def dump_read_bytes(s: Setup, names) -> int:
    """Bytes of the dump datasets ``names`` over every row (readers fetch whole chunk-aligned blocks)."""
    widths, item = dump_layout(s).widths(), dump_layout(s).np_dtype.itemsize
    return s.dump.total * sum(widths[n] for n in set(names)) * item


def est_ridge(s: Setup) -> StageEstimate:
    train, val = (row_counts(s, ix) for ix in s.split)
    layout, hidden, kv = dump_layout(s), s.model.geo.hidden_size, s.model.geo.kv_dim
    widths = layout.widths()
    groups = [(sum(widths[n] for n in g.xs), sum(widths[n] for n in g.y), g) for g in map_groups(s.plan)]
    adapters = groups[1:]  # ced_csa2's maps: the same shapes, fitted again from the projected source
    fit = sum(2.0 * train * d_in * (d_in + d_out) for d_in, d_out, _ in groups + adapters) + 2.0 * train * hidden * 2 * kv
    check = sum(2.0 * val * d_in * d_out for d_in, d_out, _ in groups + 2 * adapters)  # ced's maps, csa2's on ced
    # two passes over the train rows: every map, then ced_csa2's from h_split (projected) to the targets
    reads = (dump_read_bytes(s, [n for *_, g in groups for n in (*g.xs, *g.y)])
             + dump_read_bytes(s, ["h_split", *(n for *_, g in adapters for n in g.y)]))
    sets = layout.datasets(s.params.dump.chunk_kib)
    unit = max(sets[name][2] for name in widths)  # ridge reads blocks of whole chunks (loader.aligned_block_rows)
    rows = math.ceil(s.params.ridge.block_rows / unit) * unit
    block = rows * (sum(widths.values()) * 4 + max(d_in + d_out for d_in, d_out, _ in groups) * 8)  # + float64 copy
    stats = sum((d_in + 1) * (d_in + d_out) * 8 for d_in, d_out, _ in groups)
    host, _ = peaks(s, model=False, host_work=stats + block)
    return StageEstimate("ridge", f"{train:,} + {val:,} val", host=host,
                         seconds=(fit + check) / s.rates.f64_flops + reads / s.rates.read_bytes,
                         note="float64 statistics, host CPU")


def est_fit_xkv(s: Setup) -> StageEstimate:
    train, val = (row_counts(s, ix) for ix in s.split)
    layers = (s.plan.source, *s.plan.targets)
    d = len(layers) * s.model.geo.kv_dim
    rank = s.params.xkv.rank_for(s.model.geo.kv_dim)
    flops = 2 * (2.0 * train * d * d + 2.0 * val * d * rank * 2)  # K and V: Gram, then compress + reconstruct
    reads = dump_read_bytes(s, [f"{k}_{layer}" for layer in layers for k in "kv"])
    host, _ = peaks(s, model=False, host_work=2 * d * d * 8)
    return StageEstimate("fit_xkv", f"{train:,} + {val:,} val", host=host,
                         seconds=flops / s.rates.f64_flops + reads / s.rates.read_bytes, note="float64, host CPU")


def projector_training(s: Setup, stage: str, layers: tuple[int, ...], trained: bool) -> StageEstimate:
    """The seed's projector recipe (or, ``trained=False``, the ridge maps validated) for ``layers``."""
    cfg, geo = s.params.train_projector, s.model.geo
    train, val = (row_counts(s, ix) for ix in s.split)
    names = ["h_split", *(f"{k}_{layer}" for layer in layers for k in "kv")]
    n_params = projector_params(geo.hidden_size, geo.kv_dim) * len(layers)
    width = geo.hidden_size + 2 * geo.kv_dim * len(layers)
    # BlockLoader preloads the rows as float32, its blocks and their concatenation at once: 2x while loading
    rows_bytes = (2 * (train if trained else 0) + val) * width * 4
    if not trained:
        host, _ = peaks(s, model=False, host_work=rows_bytes)
        return StageEstimate(stage, f"{val:,} val", host=host, seconds=map_seconds(s, n_params, 0, val, 0)
                             + dump_read_bytes(s, names) / s.rates.read_bytes, note="ridge maps, validated only")
    steps = cfg.epochs * math.ceil(train / cfg.batch_size)
    # weights, grads and AdamW's two moments in fp32; a batch of inputs, targets, outputs and their grads
    work = n_params * 4 * 4 + min(cfg.batch_size, train) * (geo.hidden_size + 6 * geo.kv_dim * len(layers)) * 4
    host, device = peaks(s, model=False, device_work=work, host_work=rows_bytes)
    # train_projector also trains the seed's literal recipe (random init, last epoch) unless the params are it
    runs = 2 if stage == "train_projector" and (cfg.init, cfg.keep) != ("random", "last") else 1
    seconds = runs * map_seconds(s, n_params, train, val, cfg.epochs) + dump_read_bytes(s, names) / s.rates.read_bytes
    return StageEstimate(stage, f"{train:,} + {val:,} val", host=host, device=device, steps=runs * steps,
                         seconds=seconds, note="rows preloaded (streamed when over 1/4 of RAM)"
                         + ("; + the seed-literal reference" if runs == 2 else ""))


def est_extra_projectors(s: Setup) -> StageEstimate | None:
    if not s.plan.extra_sources:
        return None
    return projector_training(s, "extra_projectors", s.plan.extra_sources, s.params.extra_projectors == "trained")


def est_train_adapters(s: Setup) -> StageEstimate:
    cfg, geo, plan = s.params.train_adapters, s.model.geo, s.plan
    per = s.params.split.tokens_per_record
    train, val = (row_counts(s, ix, per) for ix in s.split)
    width = mlp_width(geo.kv_dim, cfg.width_mult)
    n_params = adapter_params_per_target(geo.kv_dim, width, cfg.input) * len(plan.targets)
    row = 2 * geo.kv_dim * (1 + len(plan.targets))  # X = [K ‖ V] of the source, Y = the targets' K ‖ V
    steps = cfg.epochs * math.ceil(train / cfg.batch_size)
    heads = 2 * len(plan.targets)
    # weights, grads and SGD's momentum in fp32; a batch and its activations and grads in every head
    work = n_params * 4 * 3 + min(cfg.batch_size, train) * (row + heads * 2 * (width + geo.kv_dim)) * 4
    host, device = peaks(s, model=False, device_work=work, host_work=(train + val) * row * 4)  # pairs in memory
    names = [f"{k}_{layer}" for layer in (plan.source, *plan.targets) for k in "kv"]
    seconds = map_seconds(s, n_params, train, val, cfg.epochs) + dump_read_bytes(s, names) / s.rates.read_bytes
    return StageEstimate("train_adapters", f"{train:,} + {val:,} val pairs", host=host, device=device, steps=steps,
                         seconds=seconds, note=f"SGD, batch {cfg.batch_size:,}")


def scoring_bytes(s: Setup, batch_tokens: int, groups) -> int:
    """A shared-trunk scoring batch (:func:`~ced_csa2.eval.scoring.multi_group_nll`): one layer's working set, the
    hidden state kept per branch point, every group's final hidden state and its scored rows, and one block of
    ``eval_ppl.score_block_tokens`` scored positions through the LM head and the vocabulary-wide work."""
    branches = len({branch_layer(s, g) for g in groups})
    block = min(s.params.eval_ppl.score_block_tokens, batch_tokens)
    return (layer_bytes(s, batch_tokens) + logits_bytes(s, block)
            + (branches + 2 * len(groups)) * batch_tokens * s.model.geo.hidden_size * s.b)


def est_eval_ppl(s: Setup) -> StageEstimate:
    cfg = s.params.eval_ppl
    # Mode A: the plain and the skipped prefill of every prompt, each continued through the rest of the record
    tokens = s.eval.total + s.domains.total  # the fitting domain's held-out records, then every other domain's
    seconds = scoring_seconds(s, cfg.groups, tokens, passes=2 if mode_a_covered(s) else 0)
    longest = max(int(s.eval.tokens.max()), int(s.domains.tokens.max(initial=0)))
    host, device = peaks(s, model=True, device_work=scoring_bytes(s, cfg.batch_size * longest, cfg.groups))
    domains = f", {len(s.params.data.domains)} other domains" if s.params.data.domains else ""
    return StageEstimate("eval_ppl", f"{tokens:,} tokens", host=host, device=device, seconds=seconds,
                         note=f"{len(cfg.groups)} groups{' + Mode A' if mode_a_covered(s) else ''}{domains}")


def generation_seconds(s: Setup, problems: int, batch: int, new_tokens: int, prompt_tokens: int) -> float:
    """Greedy generation of ``new_tokens`` after prompts of ``prompt_tokens`` for ``problems`` in batches (no early
    stop: an upper bound)."""
    batches = math.ceil(problems / batch)
    step = max(s.rates.decode_step_s, forward_flops(s.model, batch) / s.rates.model_flops)
    return batches * new_tokens * step + forward_flops(s.model, problems * prompt_tokens) / s.rates.model_flops


def kv_cache_bytes(s: Setup, context: int) -> float:
    """Device bytes of every attention layer's K/V cache over ``context`` positions (batch rows x positions), in the
    model's dtype."""
    return context * 2 * s.model.geo.kv_dim * len(s.model.geo.attention_layers) * s.b


def decode_bytes(s: Setup, context: int) -> float:
    """Device bytes of decoding ``context`` positions (batch rows x positions): the K/V cache and one layer's
    activations over them."""
    return kv_cache_bytes(s, context) + layer_bytes(s, context)


def est_eval_gsm8k(s: Setup) -> StageEstimate:
    cfg, n = s.params.eval_gsm8k, len(s.gold.tokens)
    seconds = len(cfg.generate) * generation_seconds(s, n, cfg.batch_size, cfg.max_gen_toks, s.prompt_tokens)
    mode_a = cfg.mode_a != "off" and mode_a_covered(s)
    # gold NLL of every group; Mode A's through the skip (plain + skipped prefill), its generation one at a time
    seconds += scoring_seconds(s, cfg.groups, s.gold.total, passes=2 if mode_a else 0)
    if mode_a and cfg.mode_a == "generate":
        seconds += generation_seconds(s, n, 1, cfg.max_gen_toks, s.prompt_tokens)
    longest = int(s.gold.tokens.max()) if s.gold.exact else GOLD_MAX_TOKENS
    # generation holds a batch's KV cache (attention layers) and prefills its prompts; gold NLL scores in batches
    context = cfg.batch_size * (s.prompt_tokens + cfg.max_gen_toks)
    generate = decode_bytes(s, context)
    host, device = peaks(s, model=True, device_work=max(generate, scoring_bytes(s, cfg.batch_size * longest,
                                                                                  cfg.groups)))
    return StageEstimate("eval_gsm8k", f"{n:,} problems, {s.gold.total:,} gold tokens", host=host, device=device,
                         seconds=seconds, note=f"generate {len(cfg.generate)} group(s) x <= {cfg.max_gen_toks} "
                                               f"tokens{', Mode A' if mode_a else ''}")


def est_eval_generation(s: Setup) -> StageEstimate:
    cfg = s.params.eval_generation
    labels = len(supported_groups()) + mode_a_covered(s)
    # per label: the generation; then the plain model prefills the prompts once and scores every label's
    # continuation on that prefill (eval.generation.continuation_nlls)
    scoring = forward_flops(s.model, cfg.prompts * cfg.prompt_tokens) + labels * forward_flops(
        s.model, cfg.prompts * cfg.new_tokens)
    seconds = (labels * generation_seconds(s, cfg.prompts, cfg.batch_size, cfg.new_tokens, cfg.prompt_tokens)
               + scoring / s.rates.model_flops)
    context = cfg.batch_size * (cfg.prompt_tokens + cfg.new_tokens)
    # every group's cache of a batch held at once (they decode alternated), each at most the ordinary one
    cache = decode_bytes(s, context) + (len(supported_groups()) - 1) * kv_cache_bytes(s, context)
    host, device = peaks(s, model=True, device_work=cache)
    return StageEstimate("eval_generation", f"{cfg.prompts} prompts x {cfg.prompt_tokens} + {cfg.new_tokens} tokens",
                         host=host, device=device, seconds=seconds,
                         note=f"{len(supported_groups())} groups{' and Mode A' * mode_a_covered(s)}, greedy")


def est_eval_retrieval(s: Setup) -> StageEstimate:
    cfg = s.params.eval_retrieval
    labels = len(supported_groups()) + mode_a_covered(s)
    # per label: each record's prompt prefilled, then its answer decoded (a key's digits and its space at most)
    seconds = labels * generation_seconds(s, cfg.records, cfg.batch_size, cfg.digits + 1, cfg.length)
    context = cfg.batch_size * cfg.length
    cache = decode_bytes(s, context)
    host, device = peaks(s, model=True, device_work=cache)
    return StageEstimate("eval_retrieval", f"{cfg.records} passkey records x {cfg.length:,} tokens", host=host,
                         device=device, seconds=seconds, note=f"{labels} labels (groups, Mode A): prefill + answer")


def online_counts(s: Setup, records: int | None = None) -> tuple[int, int, int]:
    """``(train records, val records, tokens per record)`` of the online objectives (``train.online``;
    ``records`` train records instead of ``train.online.records``, as ``tune_mode_a`` asks)."""
    cfg = s.params.train.online
    n = train_records(s.params, s.workdir) or len(s.dump.tokens)  # the whole train split, not the dump's sample
    train, val = record_split(n, s.params.split.val_fraction, s.params.seed)
    asked = cfg.records if records is None else records
    return min(asked, len(train)), min(cfg.val_records, len(val)), min(cfg.seq_len, s.params.data.max_tokens)


def est_tune(s: Setup, objective: str) -> StageEstimate:
    name, spec = f"tune@{objective}", tune_objective(objective)
    if not spec.trains:
        return StageEstimate(name, "-", note="the ridge maps as they are: seconds")
    cfg, geo = s.params.train.online, s.model.geo
    records, val, seq = online_counts(s)
    steps_per_phase = cfg.epochs * math.ceil(records / cfg.batch_size)
    step = forward_flops(s.model, cfg.batch_size * seq)
    train = sum(spec.step_cost[g] for g in PHASE_GROUPS) * steps_per_phase * step
    checks = len(PHASE_GROUPS) * 2 * 2 * forward_flops(s.model, val * seq)  # teacher + student, before and after
    tokens = cfg.batch_size * seq
    # kept for the backward from the first substituted layer up: ~(8 hidden + 4 intermediate) values per token
    # and layer; a loss that reads the final hidden state (distill) also holds teacher and student logits and
    # their fp32 log-softmax
    layers = geo.n_layers - s.plan.source + 1
    work = tokens * layers * (8 * geo.hidden_size + 4 * s.model.intermediate) * s.b
    if spec.final_teacher:
        work += 2 * logits_bytes(s, tokens)
    # the held-out KL: the teacher's and the student's logits of one block of positions at a time
    block = min(s.params.eval_ppl.score_block_tokens, tokens)
    work = max(work, 2 * logits_bytes(s, block))
    # the teacher passes, kept on the host for every phase (TeacherCache): per token H_split and, for the source
    # and each target, its K/V, its attention's input and output and RoPE's cos/sin (~28 KB a token on SmolLM2
    # in float32); the final hidden state of the held-out passes (and of the training ones where the loss reads it)
    readers = 1 + len(s.plan.targets)
    per_token = geo.hidden_size + readers * 2 * (geo.kv_dim + geo.hidden_size + geo.head_dim)
    finals = val + (records if spec.final_teacher else 0)
    kept = ((records + val) * per_token + finals * geo.hidden_size) * seq * s.b
    host, device = peaks(s, model=True, device_work=work, host_work=kept)
    return StageEstimate(name, f"{records:,} records x {seq} tokens", host=host, device=device,
                         steps=len(PHASE_GROUPS) * steps_per_phase, seconds=(train + checks) / s.rates.model_flops,
                         note=f"{len(PHASE_GROUPS)} phases, batch {cfg.batch_size}")


def est_tune_mode_a(s: Setup) -> StageEstimate | None:
    """Mode A's maps trained through the skip: the teacher's forward once per record (kept on the host, two
    hidden states per continuation token), then per record and epoch the skip and the continuation through the
    layers above the cut, forward and backward (3x a forward), the teacher's and the student's LM heads, the
    records of one length in one forward; the held-out KL before and after (the projectors' residual MLPs, if
    any, are small beside the model: not counted)."""
    if not mode_a_covered(s):
        return None
    cfg, geo, online = s.params.mode_a.train, s.model.geo, s.params.train.online
    records, val, seq = online_counts(s, cfg.records)
    half = seq - prompt_tokens(seq, s.params.eval_ppl.prefix_fraction)
    upper = (geo.n_layers - s.plan.split) / geo.n_layers
    skip = forward_flops(s.model, seq - half, layers=s.plan.split / geo.n_layers, heads=0)
    step = skip + 3 * forward_flops(s.model, half, layers=upper) + forward_flops(s.model, half, layers=0)  # + teacher's head
    teacher = forward_flops(s.model, seq)
    checks = 2 * val * (teacher + skip + forward_flops(s.model, half, layers=upper, heads=2))
    steps = cfg.epochs * math.ceil(records / online.batch_size)
    # the continuation's activations above the cut for the backward; teacher and student logits and log-softmax;
    # for a whole step's records at once (one forward per length)
    work = online.batch_size * (half * (geo.n_layers - s.plan.split) * (8 * geo.hidden_size + 4 * s.model.intermediate)
                                * s.b + 2 * logits_bytes(s, half))
    kept = records * 2 * half * geo.hidden_size * s.b  # the teachers' H_split and final hidden states
    host, device = peaks(s, model=True, device_work=work, host_work=kept)
    return StageEstimate("tune_mode_a", f"{records:,} records x {seq} tokens", host=host, device=device, steps=steps,
                         seconds=(records * teacher + cfg.epochs * records * step + checks) / s.rates.model_flops,
                         note=f"{online.batch_size} records per step, one forward per length; teacher kept")


def est_eval_objectives(s: Setup) -> StageEstimate | None:
    objectives = s.params.train.objectives
    if not objectives:
        return None
    # One shared trunk: the baseline once, every group once per objective.
    groups = ["baseline", *(g for _ in objectives for g in s.params.train.eval_groups), "ced"]  # + the seed-literal
    seconds = scoring_seconds(s, groups, s.eval.total) + scoring_seconds(s, groups, s.gold.total)
    longest = max(s.params.eval_ppl.batch_size * int(s.eval.tokens.max()),
                  s.params.eval_gsm8k.batch_size * (int(s.gold.tokens.max()) if s.gold.exact else GOLD_MAX_TOKENS))
    host, device = peaks(s, model=True, device_work=scoring_bytes(s, longest, groups))
    return StageEstimate("eval_objectives", f"{s.eval.total:,} + {s.gold.total:,} gold tokens",
                         host=host, device=device, seconds=seconds, note=f"{len(groups)} groups")


def estimate(s: Setup) -> list[StageEstimate]:
    """Every heavy stage of the pipeline, in ``dvc.yaml`` order."""
    objectives = s.params.train.objectives
    stages = [est_prepare(s), est_dump(s), est_ridge(s), est_fit_xkv(s),
              projector_training(s, "train_projector", (s.plan.source,), trained=True), est_extra_projectors(s),
              est_train_adapters(s), est_tune_mode_a(s), est_eval_ppl(s), est_eval_gsm8k(s),
              *(est_tune(s, o) for o in objectives), est_eval_objectives(s), est_eval_generation(s),
              est_eval_retrieval(s)]
    return [e for e in stages if e is not None]


def setup(params: Params, device: str, workdir: Path = Path(".")) -> Setup:
    """Everything the stage estimates read: the model's facts, the plan and the row counts."""
    model = model_facts(params)
    plan = LayerPlan.from_config(params.plan).validate(model.geo)
    gold, prompt = gold_lengths(params, workdir)
    return Setup(params, model, plan, device, resolve_dtype(params.model.dtype, torch.device(device)), RATES[device],
                 dump_lengths(params, workdir), eval_lengths(params, workdir), domain_lengths(params, workdir), gold,
                 prompt, workdir)


# ----------------------------------------------------------------------------- this machine's rates

def cpu_key() -> dict:
    """What makes one CPU's rates another's: its model name, :data:`PROBE_FLAGS` present, cores, torch threads."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)  # the last CPU's lines: all alike
    flags = set(fields.get("flags\t\t", "").split())
    return {"cpu": fields.get("model name\t", "unknown").strip(), "flags": [f for f in PROBE_FLAGS if f in flags],
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def probe_flops(seconds: float = PROBE_SECONDS) -> float:
    """FLOP/s of :data:`PROBE_SHAPE`'s float32 product, repeated for ``seconds`` after one warm-up (thread pool, buffers)."""
    m, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    a @ b
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        reps += 1
    return 2.0 * m * k * n * reps / elapsed


def busy_load() -> float | None:
    """The 1-minute load average when other work holds over half the cores (times then stretch), else ``None``."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return load if load > 0.5 * (os.cpu_count() or 1) else None


def calibrated_rates(reprobe: bool = False, cache: Path | None = None) -> Rates:
    """:data:`RATES` ``["cpu"]``'s compute rates scaled to this CPU, its ``basis`` saying how (the report prints it).

    The probe's result is cached per :func:`cpu_key` in ``cache`` (default ``<asset cache>/estimate/cpu_probe.json``)
    when the machine was quiet: a busy moment's rate would slow every later estimate.  Dump I/O keeps the fitted rates
    (disk, not cores).  ``reprobe``: measure again.
    """
    from .assets import cache_root
    from .pipeline.atomic_files import atomic_write_text

    path = cache or cache_root() / "estimate" / "cpu_probe.json"
    key = cpu_key()
    name = json.dumps(key, sort_keys=True)
    probes = json.loads(path.read_text()) if path.is_file() else {}
    probe = None if reprobe else probes.get(name)
    if probe is None:
        load = busy_load()
        probe = {"flops": probe_flops(), "when": time.strftime("%Y-%m-%d %H:%M"), "load": load}
        if load is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({**probes, name: probe}, indent=1, sort_keys=True))
    scale = probe["flops"] / PROBE_REFERENCE_FLOPS
    rates = dataclasses.replace(
        _CPU, model_flops=_CPU.model_flops * scale, map_flops=_CPU.map_flops * scale,
        f64_flops=_CPU.f64_flops * scale, logits=_CPU.logits * scale, decode_step_s=_CPU.decode_step_s / scale,
        basis=(f"calibrated here: {scale:.2f}x the fitted CPU's compute rates (probe {probe['flops'] / 1e9:.0f} of "
               f"{PROBE_REFERENCE_FLOPS / 1e9:.0f} GFLOP/s fp32, {probe['when']}"
               + (f", under load {probe['load']:.1f}, not cached" if probe["load"] is not None else "")
               + f"; {key['cores']} cores, {key['torch_threads']} torch threads, {' '.join(key['flags']) or 'no AVX2'})"))
    now = busy_load()
    if now is not None:
        rates = dataclasses.replace(rates, basis=rates.basis + f"; BUSY now: load {now:.1f} on {key['cores']} cores, "
                                                               "the times stretch while it lasts")
    return rates


# ----------------------------------------------------------------------------- output

def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:,.1f} GiB" if n >= GiB else f"{n / MiB:,.1f} MiB"


def fmt_seconds(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t / 3600:.1f} h" if t >= 5400 else f"{t / 60:.0f} min" if t >= 90 else f"{t:.0f} s"


def report(s: Setup, stages: list[StageEstimate]) -> str:
    """The printed estimate: what it assumes, then one row per stage."""
    p, m = s.params, s.model
    payload, allocated = dump_layout(s).nbytes(s.dump.total, len(s.dump.tokens), p.dump.chunk_kib)
    header = {
        "profile": (f"model {p.model.name}, data {p.data.name}, plan {p.plan.name} (split {s.plan.split}, source "
                    f"{s.plan.source}, targets {list(s.plan.targets)}, {len(s.plan.extra_sources)} extra sources)"),
        "model": (f"{m.name}: {m.params:,} parameters ({m.body:,} in the decoder layers), {m.geo.n_layers} layers, "
                  f"hidden {m.geo.hidden_size}, kv_dim {m.geo.kv_dim}, vocab {m.vocab:,} [{m.source}]"),
        "device": f"{s.device}, {str(s.dtype).removeprefix('torch.')}: weights {fmt_bytes(s.weights)}",
        "rows": (f"dump {s.dump.total:,} tokens in {len(s.dump.tokens):,} records ({s.dump.source}); eval "
                 f"{s.eval.total:,} tokens ({s.eval.source}); GSM8K gold {s.gold.total:,} tokens ({s.gold.source})"),
        "dump": (f"{payload:,} B payload ({payload / s.dump.total:,.0f} B/token, {p.dump.storage_dtype}), "
                 f"{allocated:,} B in whole chunks ({fmt_bytes(allocated)}; x2 with DVC's cache copy)"),
        "rates": s.rates.basis,
    }
    lines = [*(f"{key:<9} {text}" for key, text in header.items()), "",
             f"{'stage':<26} {'rows':<34} {'disk':>10} {'host peak':>10} {'device peak':>11} {'steps':>8} {'time':>7}  note"]
    for e in stages:
        lines.append(f"{e.stage:<26} {e.rows:<34} {fmt_bytes(e.disk):>10} {fmt_bytes(e.host):>10} "
                     f"{fmt_bytes(e.device):>11} {'-' if e.steps is None else f'{e.steps:,}':>8} "
                     f"{fmt_seconds(e.seconds):>7}  {e.note}")
    total = sum(e.seconds or 0 for e in stages)
    host = max(e.host or 0 for e in stages)
    device = max((e.device or 0 for e in stages), default=0)
    lines.append(f"{'total':<26} {'':<34} {fmt_bytes(allocated):>10} {fmt_bytes(host):>10} "
                 f"{fmt_bytes(device or None):>11} {'':>8} {fmt_seconds(total):>7}  time: sum; memory: max")
    return "\n".join(lines)


def rerun_plan(workdir: Path, params_text: str | None = None) -> list[tuple[str, str]]:
    """What ``dvc repro`` of ``dvc.yaml`` would do now, stage by stage in pipeline order: ``[(stage, why)]``.

    In ``dvc.yaml``'s order.  A stage DVC reports changed (``dvc status``) whose inputs are all
    in the workspace already is looked up in DVC's run cache: ``"run cache"`` when an earlier run with these inputs is
    there (restored in seconds, nothing computed), else ``"changed: <what>"``.  Stages downstream
    of a changed one get ``"downstream of <stage>"``: they re-run unless the run cache also holds
    the inputs their upstream stages will write (which is only known once those ran).

    ``params_text``: a composed ``params.yaml`` (what ``dvc exp run -S ...`` would write) read in place of the
    workspace's, which stays as it is: each stage's params are compared with ``dvc.lock``'s and looked up in the
    run cache with those values.
    """
    import tempfile

    import networkx as nx
    from dvc.dependency.param import ParamsDependency, read_param_file
    from dvc.fs import LocalFileSystem
    from dvc.repo import Repo

    with Repo(str(workdir)) as repo, tempfile.TemporaryDirectory() as tmp:
        composed = Path(tmp) / "params.yaml"
        if params_text is not None:
            composed.write_text(params_text)

        def params_values(dep):  # the composition's values of a stage's params, flattened as DVC records them
            return read_param_file(LocalFileSystem(), str(composed), list(dep.params) or None, flatten=True)

        # Both from one index, taken before `status`: DVC drops its index after each locked call, and
        # collecting it again parses every dvc.yaml and dvc.lock again.
        graph = repo.index.graph  # an edge points from a stage to a stage it depends on
        target = (workdir / "dvc.yaml").resolve()
        # dvc.yaml's order (already an order its dependencies respect); studies/dvc.yaml is not
        # what `dvc repro` runs
        stages = [s for s in repo.index.stages if Path(s.path).resolve() == target]
        status = repo.status(targets=[str(workdir / "dvc.yaml")])
        if params_text is not None:  # the composition's verdict on params in place of the workspace file's
            for stage in stages:
                params = [d for d in stage.deps if isinstance(d, ParamsDependency)]
                changes = [c for c in status.get(stage.addressing, [])
                           if not (isinstance(c, dict) and set(c) == {"changed deps"}
                                   and set(c["changed deps"]) <= {str(d) for d in params})]
                if any(params_values(d) != (d.hash_info.value or {}) for d in params):
                    changes.append({"changed deps": {str(d): "modified" for d in params}})
                status[stage.addressing] = changes
            status = {name: changes for name, changes in status.items() if changes}
        plan = []
        for stage in stages:
            upstream = sorted(d.addressing for d in nx.descendants(graph, stage) if d.addressing in status)
            if upstream:
                plan.append((stage.addressing, f"downstream of {', '.join(upstream)}"))
            elif stage.addressing in status:
                stage.save_deps()  # the inputs' current hashes (in memory): the run cache's key
                if params_text is not None:
                    for dep in (d for d in stage.deps if isinstance(d, ParamsDependency)):
                        dep.fill_values(params_values(dep))
                # DVC's own lookup (no public API asks "is this run cached?"; restore(dry=True)
                # answers from dvc.lock for a stage whose definition is unchanged)
                cache = repo.stage_cache._load(stage)
                if cache is not None and repo.stage_cache._create_stage(cache, wdir=stage.wdir).outs_cached():
                    plan.append((stage.addressing, "run cache"))
                else:
                    what = sorted({k for change in status[stage.addressing] if isinstance(change, dict) for k in change})
                    plan.append((stage.addressing, f"changed: {', '.join(what) or 'always'}"))
    return plan


def changed_report(plan: list[tuple[str, str]], estimated: dict[str, float], measured: dict[str, float]) -> str:
    """The printed ``--changed`` preview: each stage ``dvc repro`` would touch, why, and its minutes.

    ``measured``: wall seconds of the stage's last run here (``timings/<stage>.json``);
    ``estimated``: :func:`estimate`'s seconds, used where nothing was measured.
    """
    if not plan:
        return "dvc repro: nothing to do (every stage up to date)"
    lines = [f"{'stage':<22} {'time':>8}  why"]
    total = 0.0
    for stage, why in plan:
        if why == "run cache":
            text = "seconds"
        elif stage in measured or stage in estimated:
            seconds = measured.get(stage, estimated.get(stage))
            total += seconds
            text = fmt_seconds(seconds) + ("" if stage in measured else " (est.)")
        else:
            text = "-"
        lines.append(f"{stage:<22} {text:>8}  {why}")
    lines.append(f"{'total':<22} {fmt_seconds(total):>8}  time: last run here (timings/), else estimated; "
                 "a downstream stage may still come from the run cache")
    return "\n".join(lines)


def measured_seconds(workdir: Path) -> dict[str, float]:
    """``{stage: wall seconds}`` of the last run of each stage in ``workdir`` (``timings/``)."""
    from .pipeline.paths import TIMINGS

    return {p.stem: json.loads(p.read_text())["wall_s"] for p in sorted((workdir / TIMINGS).glob("*.json"))
            if "wall_s" in json.loads(p.read_text())}


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m ced_csa2.estimate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/ (none: read params.yaml)")
    ap.add_argument("-S", "--set-param", action="append", default=[], metavar="KEY=VALUE", dest="set_params",
                    help="an override as `dvc exp run -S` takes it (the same as a positional one)")
    ap.add_argument("--device", choices=list(RATES), default=None,
                    help="where the model stages run (default: cuda when this machine has it, else cpu)")
    ap.add_argument("--workdir", type=Path, default=Path("."), help="where data/ and metrics/ are (default: here)")
    ap.add_argument("--changed", action="store_true",
                    help="preview the edit: the stages `dvc repro` would run now (params.yaml against dvc.lock; with "
                         "overrides, their composition, as `dvc exp run -S` would write it), why, and their minutes")
    ap.add_argument("--probe", action="store_true", help="measure this CPU's rate again (else the cached probe)")
    args = ap.parse_args(argv)
    overrides = [*args.overrides, *args.set_params]
    try:
        if overrides:
            from .compose import compose_or_exit

            text = compose_or_exit(overrides)
            params = from_dict(Params, yaml.safe_load(text))
        else:
            text, params = None, load_params(args.workdir / "params.yaml")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        s = setup(params, device, args.workdir)
        if device == "cpu":  # after setup: a bad params file answers before the probe's seconds
            s = dataclasses.replace(s, rates=calibrated_rates(args.probe))
        stages = estimate(s)
    except Exception as exc:  # a bad params file, plan, profile or asset cache: one line, as a stage says it
        if not is_input_error(exc):
            raise
        raise SystemExit(error_line(exc)) from None
    if args.changed:
        estimated = {e.stage: e.seconds for e in stages if e.seconds is not None}
        print(changed_report(rerun_plan(args.workdir, text), estimated, measured_seconds(args.workdir)))
        return
    print(report(s, stages))


if __name__ == "__main__":
    main()
