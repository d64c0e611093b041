"""The corpora the pipeline reads: train/eval records from the embedded Wikipedia sample, WikiText
or the tiny set, under a token budget, the evaluation domains' records under the same budget,
and the math problems (the ``prepare`` stage writes them).
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..assets import digest, fetch_member
from ..config import DataConfig, DomainConfig, Params, provenance
from ..pipeline.atomic_files import atomic_write_text, write_json
from ..pipeline.paths import (
    DOMAINS_DIR,
    EVAL_JSONL,
    GSM8K_JSONL,
    PREPARE_METRICS,
    TRAIN_JSONL,
    domain_jsonl,
    provenance_path,
)
from ..pipeline.progress import Progress
from . import readers

log = logging.getLogger(__name__)


_PARAGRAPH_SEP = "\n"  # paragraphs joined into one record keep their line breaks


@dataclass(frozen=True)
class Record:
    """One corpus record as written to ``data/corpus/*.jsonl``."""

    id: str
    source: str
    text: str
    n_tokens: int


class TokenBudget:
    """Counts tokens exactly as later stages will, and cuts texts to ``max_tokens``.

    Parameters
    ----------
    tokenizer
        A fast (Rust-backed) HF tokenizer; offsets are needed to cut at token boundaries.
    min_tokens, max_tokens
        Records outside ``[min_tokens, max_tokens]`` are dropped or truncated.
    """

    def __init__(self, tokenizer, min_tokens: int, max_tokens: int):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens
        # Tokens the tokenizer adds to every text by default (e.g. a BOS).
        self.n_special = self.count("")

    def count(self, text: str) -> int:
        """Length of ``tokenizer(text)["input_ids"]`` (default special-token handling)."""
        return len(self.tokenizer(text)["input_ids"])

    def truncate(self, text: str) -> tuple[str, int]:
        """Cut ``text`` at a token boundary so it has at most ``max_tokens`` tokens.

        Returns
        -------
        tuple[str, int]
            The (possibly shortened) text and its exact token count.
        """
        n = self.count(text)
        if n <= self.max_tokens:
            return text, n
        offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        keep = self.max_tokens - self.n_special
        # Re-tokenising a prefix can merge differently at the cut, so verify and back off.
        while keep > 0:
            cut = text[: offsets[keep - 1][1]].rstrip()
            n = self.count(cut)
            if n <= self.max_tokens:
                return cut, n
            keep -= 1
        raise ValueError(f"cannot cut a text to data.max_tokens={self.max_tokens} tokens: {text[:60]!r}...")

    def cut_exactly(self, text: str, n: int) -> str | None:
        """A prefix of ``text``, cut at a token boundary, of exactly ``n`` tokens; ``None`` when none exists.

        Near the cut, re-tokenising a prefix can merge differently, so the token boundaries
        around the ``n``-th are tried, each with and without trailing whitespace.
        """
        keep = n - self.n_special
        offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        for k in (keep, keep + 1, keep - 1, keep + 2, keep - 2):
            if 1 <= k <= len(offsets):
                cut = text[: offsets[k - 1][1]]
                for candidate in (cut, cut.rstrip()):
                    if candidate and self.count(candidate) == n:
                        return candidate
        return None

    def pack(self, paragraphs: list[str]) -> list[tuple[str, int]]:
        """Greedily join consecutive paragraphs into texts of at most ``max_tokens`` tokens.

        A paragraph longer than ``max_tokens`` on its own becomes one truncated text.
        Texts shorter than ``min_tokens`` are dropped.

        Returns
        -------
        list[tuple[str, int]]
            ``(text, n_tokens)`` in paragraph order.
        """
        packed, current, current_n = [], [], 0

        def flush():
            if current and current_n >= self.min_tokens:
                packed.append((_PARAGRAPH_SEP.join(current), current_n))

        for paragraph in paragraphs:
            if current:
                n = self.count(_PARAGRAPH_SEP.join([*current, paragraph]))
                if n <= self.max_tokens:
                    current.append(paragraph)
                    current_n = n
                    continue
                flush()
            text, n = self.truncate(paragraph)
            current, current_n = [text], n
            if text != paragraph:  # a truncated paragraph is full: nothing may follow it
                flush()
                current, current_n = [], 0
        flush()
        return packed


def _rng(seed: int, purpose: str) -> random.Random:
    # One generator per purpose, so changing one choice never shifts another.
    return random.Random(f"{seed}:{purpose}")


def wiki_embedded_records(data: DataConfig, budget: TokenBudget) -> tuple[list[Record], list[Record]]:
    """Train and eval records from the Wikipedia sample in the pinned gensim wheel."""
    pin = data.corpus_wheel
    articles = readers.wiki_articles(fetch_member(pin))
    if data.heldout_articles >= len(articles):
        raise ValueError(f"data.heldout_articles={data.heldout_articles} leaves no training article "
                         f"(the sample has {len(articles)})")
    heldout = set(_rng(data.seed, "heldout").sample(range(len(articles)), data.heldout_articles))
    log.info("Held out %d articles for evaluation: %s", len(heldout),
             ", ".join(articles[i].title for i in sorted(heldout)))
    source = f"enwiki@{pin.package}=={pin.version}"
    train, eval_pool = [], []
    for a, article in enumerate(Progress(articles, desc="pack articles", unit=" article", leave=False)):
        for k, (text, n) in enumerate(budget.pack(article.paragraphs)):
            (eval_pool if a in heldout else train).append(Record(f"enwiki-{a:03d}-{k:02d}", source, text, n))
    log.info("%d train records; sampling %d eval records from %d held-out records", len(train), data.n_eval,
             len(eval_pool))
    return train, _sample(eval_pool, data.n_eval, data.seed, "eval")


def wikitext_records(data: DataConfig, budget: TokenBudget) -> tuple[list[Record], list[Record]]:
    """Seeded long lines of each hub train split, and of the eval split."""
    train = []
    for split in data.train:
        train += _long_lines(data, split.config, split.split, split.n, budget)
    return train, _long_lines(data, data.eval.config, data.eval.split, data.n_eval, budget)


def _long_lines(data: DataConfig, config: str, split: str, n: int, budget: TokenBudget) -> list[Record]:
    """``n`` (0 = all) lines of at least ``min_tokens`` tokens, a seeded sample, truncated.

    Lines are visited in a seeded random order until ``n`` qualify, which samples
    uniformly among long lines without tokenising the whole split.
    """
    lines = readers.wikitext_lines(data.hub_id, config, split, data.revision)
    order = list(range(len(lines)))
    _rng(data.seed, f"{config}/{split}").shuffle(order)
    chosen = []
    with Progress(total=n or None, desc=f"{config}/{split}", unit=" line", leave=False) as bar:
        for i in order:
            if budget.count(lines[i]) < budget.min_tokens:
                continue
            text, n_tokens = budget.truncate(lines[i])
            chosen.append(Record(f"{config}/{split}/{i}", config, text, n_tokens))
            bar.update()
            if len(chosen) == n:
                break
    if n and len(chosen) < n:
        log.warning("%s/%s has only %d lines of >= %d tokens (wanted %d)", config, split, len(chosen),
                    budget.min_tokens, n)
    return sorted(chosen, key=lambda r: int(r.id.rsplit("/", 1)[1]))


def tiny_records(data: DataConfig, budget: TokenBudget) -> tuple[list[Record], list[Record]]:
    """Synthetic records: the first ``n_eval`` for eval, the next ``n_train`` for training.

    Eval first, so that the eval records do not move with ``data.n_train`` (the seeded paragraphs
    of a longer draw begin with those of a shorter one: :func:`~ced_csa2.data.readers.tiny_corpus`).
    """
    records = []
    for i, paragraph in enumerate(readers.tiny_corpus(data.seed, data.n_train + data.n_eval)):
        text, n = budget.truncate(paragraph)
        if n >= budget.min_tokens:
            records.append(Record(f"tiny-{i:04d}", "tiny-synthetic", text, n))
    if len(records) < data.n_train + data.n_eval:
        raise ValueError(f"only {len(records)} tiny records reach data.min_tokens={data.min_tokens} "
                         f"(need data.n_train + data.n_eval = {data.n_train + data.n_eval})")
    return records[data.n_eval:data.n_eval + data.n_train], records[:data.n_eval]


def _sample(records: list[Record], n: int, seed: int, purpose: str) -> list[Record]:
    """A seeded sample of ``n`` records, kept in their original order."""
    if len(records) <= n:
        if len(records) < n:
            log.warning("Only %d records available for %s (wanted %d); using all", len(records), purpose, n)
        return records
    keep = sorted(_rng(seed, purpose).sample(range(len(records)), n))
    return [records[i] for i in keep]


def _nested_sample(records: list[Record], n: int, seed: int, purpose: str) -> list[Record]:
    """The first ``n`` records of a seeded shuffle, back in their original order.

    Unlike :func:`_sample`, a larger ``n`` keeps a superset of a smaller one's records.
    """
    order = list(range(len(records)))
    _rng(seed, purpose).shuffle(order)
    return [records[i] for i in sorted(order[:n])]


# The corpus readers by ``data.kind`` (its ``Literal`` in config.py lists these keys).
CORPORA = {"wiki_embedded": wiki_embedded_records, "wikitext": wikitext_records, "tiny": tiny_records}

# Generated domains (math, tiny) draw this many texts per record asked for: the records are a
# seeded sample of those within the token budget, as a file-backed domain's are of all its texts.
GENERATED_POOL = 4
_GENERATED_KINDS = ("math", "tiny")
# Each domain kind's reader: ``(files, domain, seed, n_texts) -> texts`` (``DomainConfig.kind`` lists these keys).
DOMAIN_READERS = {
    "factbook": lambda files, domain, seed, n_texts: readers.factbook_backgrounds(files[0], domain.n),
    "fiction": lambda files, domain, seed, n_texts: readers.gutenberg_book(files[0], domain.n),
    "code": lambda files, domain, seed, n_texts: readers.codeio_programs(files[0], domain.n),
    "math": lambda files, domain, seed, n_texts: readers.gsm_symbolic_problems(files[0], files[1], seed, n_texts),
    "tiny": lambda files, domain, seed, n_texts: readers.tiny_domain(seed, n_texts, domain.name),
}


def domain_records(domain: DomainConfig, seed: int, budget: TokenBudget, train_rows: int = 0,
                   train_templates: list[int] | None = None) -> tuple[list[Record], list[Record]]:
    """One domain's evaluation records (a seeded sample of ``domain.n``) and its training pool (the others).

    Each text's paragraphs are packed under ``budget`` as an article's are (ids
    ``<name>-<key>-<k>``); fewer than ``domain.n`` records within the budget is refused.  A
    generated domain samples its evaluation records from its first ``GENERATED_POOL * n``
    texts whatever ``train_rows`` is (the generators are prefix-stable), and draws enough
    texts after those for ``train_rows`` training tokens (twice the fewest texts that could
    hold them: a text below ``min_tokens`` is dropped).  A math domain given
    ``train_templates`` (:class:`MathSplit`) draws those texts from these templates alone
    instead, and its training pool holds them alone (less any equal to an evaluation record): no
    other template is trained on.

    Returns
    -------
    tuple[list[Record], list[Record]]
        ``(evaluation records, training pool)``, each in the reader's order, disjoint.
    """
    pins = domain.files
    n_eval_texts = GENERATED_POOL * domain.n if domain.kind in _GENERATED_KINDS else None
    extra = 2 * -(-train_rows // budget.min_tokens) if n_eval_texts else 0
    files = [fetch_member(pin) for pin in pins]
    texts = DOMAIN_READERS[domain.kind](files, domain, seed, (n_eval_texts or 0) + (0 if train_templates else extra))
    source = f"{domain.kind}@{pins[0].package}=={pins[0].version}" if pins else f"{domain.kind}-synthetic"

    def pack(part):
        return [Record(f"{domain.name}-{t.key}-{k:02d}", source, text, n)
                for t in Progress(part, desc=f"domain {domain.name}", unit=" text", leave=False)
                for k, (text, n) in enumerate(budget.pack(t.paragraphs))]

    pool = pack(texts[:n_eval_texts])
    if len(pool) < domain.n:
        raise ValueError(f"data.domains '{domain.name}': {len(pool)} records of {len(texts[:n_eval_texts])} texts lie "
                         f"within data.min_tokens..max_tokens ({budget.min_tokens}..{budget.max_tokens}), fewer than "
                         f"its n={domain.n}")
    log.info("Domain %s: sampling %d of %d records", domain.name, domain.n, len(pool))
    sample = _sample(pool, domain.n, seed, f"domain:{domain.name}")
    if train_templates:
        # A template with few values can draw a training problem equal to an evaluation one: dropped,
        # so that no evaluation text is trained on.
        held_out = {r.text for r in sample}
        train = pack(readers.gsm_symbolic_problems(files[0], files[1], seed, extra, train_templates))
        return sample, [r for r in train if r.text not in held_out]
    chosen = {r.id for r in sample}
    return sample, [r for r in pool if r.id not in chosen] + pack(texts[n_eval_texts:] if n_eval_texts else [])


def take_rows(name: str, pool: list[Record], rows: int, budget: TokenBudget, seed: int) -> list[Record]:
    """Records of ``pool`` holding exactly ``rows`` tokens: whole records in a seeded order, the last one cut.

    The cut record (a prefix of exactly the tokens still missing, which may be shorter than
    ``min_tokens``) keeps its id; the records are returned in the pool's order.
    """
    order = list(range(len(pool)))
    _rng(seed, f"mix:{name}").shuffle(order)
    taken, left = {}, rows
    for i in order:
        if left == 0:
            break
        if pool[i].n_tokens <= left:
            taken[i], left = pool[i], left - pool[i].n_tokens
        elif (cut := budget.cut_exactly(pool[i].text, left)) is not None:
            taken[i], left = Record(pool[i].id, pool[i].source, cut, left), 0
    if left:
        raise ValueError(f"data.mix '{name}': its training records hold {sum(r.n_tokens for r in pool):,} tokens, "
                         f"fewer than its {rows:,} of data.mix_rows")
    return [taken[i] for i in sorted(taken)]


@dataclass(frozen=True)
class MathSplit:
    """The GSM-Symbolic templates a math domain of ``data.mix`` trains on, and the GSM8K items they are."""

    domain: str  # the math domain's name
    templates: list[int]  # the generators (generate_<k>) its training pool draws from, sorted
    gsm8k_ids: list[int]  # their GSM8K test indices (id_orig), sorted: left out of the scored math set


def math_split(data: DataConfig) -> MathSplit | None:
    """The template split of the math domain in ``data.mix`` (``None`` without one; docs/design.md §4).

    Each of the domain's generators is matched to its GSM8K test item through ``data.math``'s
    TOMLs (:func:`~ced_csa2.data.readers.gsm_symbolic_gsm8k_ids`); ``data.mix_math_templates`` of
    them, a sample seeded by ``data.seed``, are the training templates.  Refused in one line when
    they would be every template (no GSM8K item of theirs left to score).
    """
    mixed = {e.domain for e in data.mix}
    domain = next((d for d in data.domains if d.kind == "math" and d.name in mixed), None)
    if domain is None:
        return None
    generators, utils = (fetch_member(pin) for pin in domain.files)
    ids = readers.gsm_symbolic_gsm8k_ids(generators, utils, fetch_member(data.math.wheel))
    k = data.mix_math_templates
    if k >= len(ids):
        raise ValueError(f"data.mix_math_templates={k}: the math domain '{domain.name}' has {len(ids)} templates, so "
                         f"it must be below {len(ids)} (the GSM8K items of the others are the ones scored)")
    templates = sorted(_rng(data.seed, "math_templates").sample(sorted(ids), k))
    return MathSplit(domain.name, templates, sorted(ids[t] for t in templates))


def math_problems(data: DataConfig, split: MathSplit | None = None) -> list[dict]:
    """The math set of ``data.math`` as ``{id, question, answer, target}`` dicts, less ``split``'s GSM8K items."""
    math = data.math
    if math.kind == "wheel":
        problems = readers.gsm8k_from_wheel_dir(fetch_member(math.wheel), math.n)
    elif math.kind == "hub":
        problems = readers.gsm8k_hub(math.hub_id, math.hub_config, math.split, math.n, math.revision)
    else:
        problems = readers.tiny_math(data.seed, math.n)
    if split is None:
        return problems
    trained = {readers.gsm8k_test_id(i) for i in split.gsm8k_ids}
    kept = [p for p in problems if p["id"] not in trained]
    if not kept:
        raise ValueError(f"data.mix_math_templates={data.mix_math_templates}: the math training pool's templates are "
                         f"all {len(problems)} items of data.math (n={math.n}), leaving none to score")
    return kept


def validate(data: DataConfig, budget: TokenBudget) -> None:
    """Checks that need the tokenizer or cross several keys, before any heavy work."""
    if not getattr(budget.tokenizer, "is_fast", False):
        raise ValueError(f"prepare needs a fast tokenizer (for token offsets), got {type(budget.tokenizer).__name__}")
    if budget.n_special >= data.min_tokens:
        raise ValueError(f"data.min_tokens={data.min_tokens} is not above the {budget.n_special} special "
                         "tokens the tokenizer adds to every text")
    splits = [(s.config, s.split) for s in data.train]
    repeated = sorted({f"{c}/{split}" for c, split in splits if splits.count((c, split)) > 1})
    if data.kind == "wikitext" and repeated:
        raise ValueError(f"data.train lists {repeated} more than once (each line would be a training record twice)")
    if data.math.kind == "tiny" and data.math.n < 1:
        raise ValueError(f"data.math.n={data.math.n}: the tiny math set is generated, so it needs n >= 1 problems")
    if data.kind == "wikitext" and data.eval.n not in (0, data.n_eval):
        raise ValueError(f"data.eval.n={data.eval.n} disagrees with data.n_eval={data.n_eval} "
                         "(prepare samples data.n_eval eval records; set data.eval.n to 0 or the same value)")


def split_stats(records: list[Record]) -> dict:
    """Record and token counts of one split, for ``metrics/prepare.json``."""
    tokens = [r.n_tokens for r in records]
    return {
        "records": len(records),
        "tokens": sum(tokens),
        "mean_tokens": round(sum(tokens) / len(tokens), 2) if tokens else 0.0,
        "min_tokens": min(tokens, default=0),
        "max_tokens": max(tokens, default=0),
        "sources": dict(sorted(Counter(r.source for r in records).items())),
    }


# Line breaks to str.splitlines() (which data.records.read_lines uses) that JSON leaves unescaped when
# ensure_ascii is off: escaped, so that a text holding one stays on its record's line.
_LINE_BREAKS = {c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"}


def records_jsonl(records: list[Record]) -> str:
    """``records`` as ``data/corpus/*.jsonl`` holds them, one JSON object per line."""
    return _jsonl([asdict(r) for r in records])


def _jsonl(rows: list[dict]) -> str:
    lines = (json.dumps(row, ensure_ascii=False) for row in rows)
    return "".join(line.translate(str.maketrans(_LINE_BREAKS)) + "\n" for line in lines)


@dataclass(frozen=True)
class Built:
    """Everything ``prepare`` builds before it composes the training records."""

    problems: list[dict]  # the math set, less the GSM8K items of the math training pool's templates
    math_split: MathSplit | None  # the template split of a math domain in data.mix
    eval: list[Record]  # the corpus's held-out records
    domains: dict[str, list[Record]]  # each data.domains entry's evaluation records
    pools: dict[str, list[Record]]  # training pools by domain name: data.name's and each data.domains entry's
    n_built: int  # the corpus's training records before data.n_train


def build_records(data: DataConfig, budget: TokenBudget, train_rows: dict[str, int]) -> Built:
    """The math set, evaluation records and training pools of ``data``.

    ``train_rows`` maps a domain name to the most training tokens that will be asked of it
    (a generated domain draws texts for them; see :func:`domain_records`).
    """
    validate(data, budget)
    split = math_split(data)  # first: cheap, and surfaces a bad pin or split before the corpus work
    problems = math_problems(data, split)  # as cheap
    domains, pools = {}, {}  # as cheap
    for d in data.domains:
        templates = split.templates if split and d.name == split.domain else None
        domains[d.name], pools[d.name] = domain_records(d, data.seed, budget, train_rows.get(d.name, 0), templates)
    built, eval_ = CORPORA[data.kind](data, budget)
    pools[data.name] = _nested_sample(built, data.n_train, data.seed, "train") if data.n_train else built
    return Built(problems, split, eval_, domains, pools, len(built))


def mix_train(data: DataConfig, pools: dict[str, list[Record]], budget: TokenBudget) -> dict[str, list[Record]]:
    """The training records of ``data.mix`` by domain (:func:`take_rows` of each quota); without a mix, the corpus's."""
    if not data.mix:
        return {data.name: pools[data.name]}
    return {name: take_rows(name, pools[name], rows, budget, data.seed)
            for name, rows in data.mix_quotas().items()}


# Model keys that set how the model computes, not what its tokenizer does: no file of prepare's depends on them.
COMPUTE_KEYS = ("model.dtype", "model.attn_implementation", "model.device_map")
# data keys that shape the training records alone (data.mix's domains' own entries join them).
TRAIN_KEYS = ("data.train", "data.n_train", "data.mix", "data.mix_rows")
# The math template split: it shapes the training records and the math set, and only with a math
# domain in the mix (it is 0 without one), so only then does either file record it.
MATH_SPLIT_KEY = "data.mix_math_templates"


def corpus_provenance(params: Params) -> dict[Path, dict[str, Any]]:
    """What each file ``prepare`` writes is made from (its provenance, :func:`ced_csa2.config.provenance`), by path.

    Each file records the keys that change it and no others, so that an edit leaving a file's bytes
    alone leaves its record alone too, and DVC re-runs none of its readers (a new evaluation domain
    re-dumps nothing, a new mix re-scores no held-out record):

    - every corpus file: the model's tokenizer (``model`` but :data:`COMPUTE_KEYS`) and the token budget;
    - ``eval.jsonl``: ``data`` but its label, the math set, the other domains and :data:`TRAIN_KEYS`;
    - ``train.jsonl``: those, :data:`TRAIN_KEYS` and the ``data.domains`` entries the mix trains on;
    - ``domains/<name>.jsonl``: its own ``data.domains`` entry, ``data.seed`` and the budget;
    - ``gsm8k.jsonl``: ``data.math`` and ``data.seed`` (the tiny set is generated), no tokenizer;
      with a math domain in the mix, also :data:`MATH_SPLIT_KEY` and that domain's entry (its
      training templates' GSM8K items are left out).
    """
    data = params.data
    tokenizer = {k: v for k, v in provenance(params, "model").items() if k not in COMPUTE_KEYS}
    budget = {**tokenizer, **provenance(params, "data.seed", "data.min_tokens", "data.max_tokens")}
    corpus = {**tokenizer, **{k: v for k, v in provenance(params, "data").items()
                              if k not in ("data.name", "data.domains", *TRAIN_KEYS, MATH_SPLIT_KEY)
                              and not k.startswith("data.math.")}}
    mixed = {e.domain for e in data.mix}
    math_mixed = [f"data.domains.{i}" for i, d in enumerate(data.domains) if d.kind == "math" and d.name in mixed]
    split = (MATH_SPLIT_KEY,) if math_mixed else ()
    return {
        TRAIN_JSONL: {**corpus, **provenance(params, *TRAIN_KEYS, *split, *(f"data.domains.{i}" for i, d in
                                                                           enumerate(data.domains) if d.name in mixed))},
        EVAL_JSONL: corpus,
        **{domain_jsonl(d.name): {**budget, **provenance(params, f"data.domains.{i}")}
           for i, d in enumerate(data.domains)},
        GSM8K_JSONL: provenance(params, "data.seed", "data.math", *split, *math_mixed),
    }


def write_prepared(params: Params, out_dir: Path, file: Path, text: str) -> None:
    """Write ``text`` as ``out_dir / file``, one of ``prepare``'s files, and beside it what it was made from.

    The record (:func:`ced_csa2.pipeline.paths.provenance_path`) holds the file's sha256 and its
    :func:`corpus_provenance`; :func:`ced_csa2.data.records.check_prepared` checks both before a stage
    reads the file.  The file is written first: a run killed between the two leaves a record that
    no longer matches it, refused, never a record vouching for a file it was not written with.
    """
    path = Path(out_dir) / file
    atomic_write_text(path, text)
    write_json(Path(out_dir) / provenance_path(file),
               {"sha256": digest(path), "provenance": corpus_provenance(params)[file]})


def prepare(params: Params, tokenizer, out_dir: Path) -> dict:
    """Build and write the corpus records and math set of ``params`` under ``out_dir``.

    Parameters
    ----------
    params
        Validated parameters; ``params.data`` selects corpus and math set.
    tokenizer
        The model's fast HF tokenizer (token counts and truncation).
    out_dir
        Root under which ``data/`` and ``metrics/`` files are written (the repository
        root for the DVC stage).

    Returns
    -------
    dict
        The metrics written to ``metrics/prepare.json``.
    """
    data = params.data
    budget = TokenBudget(tokenizer, data.min_tokens, data.max_tokens)
    built = build_records(data, budget, data.mix_quotas())
    mixed = mix_train(data, built.pools, budget)
    train = [r for records in mixed.values() for r in records]
    eval_, domains, problems = built.eval, built.domains, built.problems
    if not train or not eval_:
        raise ValueError(f"data '{data.name}' produced {len(train)} train and {len(eval_)} eval records; "
                         "both must be non-empty (check data.min_tokens)")
    train_texts = {r.text for r in train}
    overlap = {r.text for r in eval_} & train_texts
    if overlap:
        raise ValueError(f"data '{data.name}': {len(overlap)} eval texts also occur in the training records")
    for name, records in domains.items():
        shared = sum(r.text in train_texts for r in records)
        if shared:
            raise ValueError(f"data.domains '{name}': {shared} of its texts also occur in the training records")

    out_dir = Path(out_dir)
    write_prepared(params, out_dir, TRAIN_JSONL, records_jsonl(train))
    write_prepared(params, out_dir, EVAL_JSONL, records_jsonl(eval_))
    write_prepared(params, out_dir, GSM8K_JSONL, _jsonl(problems))
    for name, records in domains.items():
        write_prepared(params, out_dir, domain_jsonl(name), records_jsonl(records))
    for stale in sorted((out_dir / DOMAINS_DIR).glob("*.jsonl")):  # a domain no longer configured
        if stale.stem not in domains:
            log.info("Removing %s (not in data.domains)", stale)
            stale.unlink()
            provenance_path(stale).unlink(missing_ok=True)
    metrics = {
        "data": data.name,
        "model": params.model.name,
        # The hub commits asked for (null: each repository's default branch at the time of the run).
        "revisions": {"model": params.model.revision, "data": data.revision, "math": data.math.revision},
        "n_train": {"param": data.n_train, "built": built.n_built, "kept": len(built.pools[data.name])},
        "train": split_stats(train),
        "eval": split_stats(eval_),
        # with a math domain in the mix: its training templates and their GSM8K items, left unscored
        "math": {"label": data.math_label(), "n": len(problems),
                 **({"trained_templates": {"domain": built.math_split.domain, "templates": built.math_split.templates,
                                           "gsm8k_ids": built.math_split.gsm8k_ids}} if built.math_split else {})},
        "domains": {name: split_stats(records) for name, records in domains.items()},
        # per mix domain: its normalised weight, its training tokens (exactly its quota) and records,
        # and the tokens its training pool held
        "mix": {e.domain: {"weight": round(e.weight / sum(x.weight for x in data.mix), 6),
                           "rows": sum(r.n_tokens for r in mixed[e.domain]), "records": len(mixed[e.domain]),
                           "pool_rows": sum(r.n_tokens for r in built.pools[e.domain])} for e in data.mix},
    }
    write_json(out_dir / PREPARE_METRICS, metrics)
    log.info("Wrote %d train records (%d tokens; of %d built), %d eval records (%d tokens), %d %s problems",
             len(train), metrics["train"]["tokens"], built.n_built, len(eval_), metrics["eval"]["tokens"],
             len(problems), data.math_label())
    return metrics
