"""Corpus readers of the evaluation domains (data.domains): cleaning, seeding, and one-line refusals."""

import re
import sys

import pytest
from domain_files import (BOOK, BOOK_PARAGRAPHS, CODEIO, GENERATORS, GSM_IDS, GSM_TOMLS, book_file, codeio_file,
                          factbook_dir, gsm_symbolic_files, gsm_toml_dir)

from ced_csa2.data import readers
from ced_csa2.data.readers import DomainText


def refused(match: str, call, *args):
    """``call(*args)`` raises a one-line ValueError matching ``match``."""
    with pytest.raises(ValueError, match=match) as err:
        call(*args)
    assert "\n" not in str(err.value)


def test_factbook_backgrounds_strip_html_one_text_per_country(tmp_path):
    directory = factbook_dir(tmp_path)
    assert readers.factbook_backgrounds(directory, 2) == [
        DomainText("ag", ["Algeria has known many empires & dynasties.",
                          "Its independence came in 1962 after a long war."]),
        DomainText("fr", ["France is one of the oldest nation-states of Europe today."]),  # &nbsp;: a plain space
    ]
    refused(r"factbook: 2 of 3 country files have an Introduction > Background text, fewer than the 3 asked",
            readers.factbook_backgrounds, directory, 3)
    refused(r"empty: no <region>/<country>.json files", readers.factbook_backgrounds, tmp_path / "empty", 1)
    (directory / "world" / "xx.json").write_text("{not json")
    refused(r"xx.json: not a JSON file", readers.factbook_backgrounds, directory, 1)


def test_gutenberg_book_reads_between_the_markers(tmp_path):
    path = book_file(tmp_path)
    assert readers.gutenberg_book(path, 3) == [DomainText("a_short_tale", BOOK_PARAGRAPHS)]
    refused(r"a_short_tale.txt: 3 paragraphs between the Gutenberg markers, fewer than the 4 asked",
            readers.gutenberg_book, path, 4)
    no_markers = book_file(tmp_path, BOOK.replace("*** END OF", "END OF"))
    refused(r"a_short_tale.txt: no '\*\*\* START OF", readers.gutenberg_book, no_markers, 1)
    empty = book_file(tmp_path, "")
    refused(r"no '\*\*\* START OF", readers.gutenberg_book, empty, 1)


def test_codeio_programs_task_blank_line_code(tmp_path):
    path = codeio_file(tmp_path)
    texts = readers.codeio_programs(path, 2)
    assert [t.key for t in texts] == ["0000", "0002"]
    assert texts[0].paragraphs == [f"{CODEIO[0]['task_description']}\n\n{CODEIO[0]['code_sample'].strip()}"]
    refused(r"codeio-hq.jsonl.gz: 2 of 3 entries have a task_description and a code_sample, fewer than the 3",
            readers.codeio_programs, path, 3)
    refused(r"0 of 0 entries", readers.codeio_programs, codeio_file(tmp_path, []), 1)
    refused(r"not a gzipped JSON list \(a dict\)", readers.codeio_programs, codeio_file(tmp_path, {"a": 1}), 1)
    (tmp_path / "plain.gz").write_text("not gzip")
    refused(r"plain.gz: not a gzipped JSON list", readers.codeio_programs, tmp_path / "plain.gz", 1)


def test_gsm_symbolic_problems_are_seeded_and_leave_no_modules(tmp_path):
    directory, utils = gsm_symbolic_files(tmp_path)
    before = set(sys.modules)
    problems = readers.gsm_symbolic_problems(directory, utils, 0, 7)
    assert set(sys.modules) == before  # the bare reasoning_gym package and its utils are gone again
    assert "reasoning_gym" not in sys.modules

    assert problems == readers.gsm_symbolic_problems(directory, utils, 0, 7)  # same seed, same problems
    other = readers.gsm_symbolic_problems(directory, utils, 1, 7)
    assert [p.key for p in other] != [p.key for p in problems]  # another seed, another order
    assert readers.gsm_symbolic_problems(directory, utils, 0, 4) == problems[:4]
    templates = [p.key.split("-t")[1] for p in problems]
    assert sorted(templates[:3]) == ["00", "01", "02"] and sorted(templates[3:6]) == ["00", "01", "02"]  # passes
    for p in problems:
        (text,) = p.paragraphs
        assert re.fullmatch(r"Question: [^\n]+\?\nAnswer: (.|\n)+\n#### \d+", text), text


def test_gsm_symbolic_refuses_missing_or_broken_members(tmp_path):
    refused(r"no generators_\*.py files", readers.gsm_symbolic_problems, tmp_path / "none", tmp_path / "u.py", 0, 1)
    directory, utils = gsm_symbolic_files(tmp_path / "a", {"generators_x.py": "X = 1\n"})
    refused(r"define no generate_<k> function", readers.gsm_symbolic_problems, directory, utils, 0, 1)
    directory, utils = gsm_symbolic_files(tmp_path / "b", GENERATORS, utils="")  # utils without the helpers
    refused(r"generators_00_01.py: cannot be run as a module \(ImportError", readers.gsm_symbolic_problems,
            directory, utils, 0, 1)
    assert "reasoning_gym" not in sys.modules and "reasoning_gym.utils" not in sys.modules
    bad = {"generators_00_00.py": GENERATORS["generators_00_01.py"].replace("\\n#### {a + b}", "")}
    directory, utils = gsm_symbolic_files(tmp_path / "c", bad)
    refused(r"generate_\d: answer does not end with '#### <number>'", readers.gsm_symbolic_problems,
            directory, utils, 0, 2)


def test_training_problems_come_from_their_templates_alone_on_a_stream_of_their_own(tmp_path):
    directory, utils = gsm_symbolic_files(tmp_path)
    train = readers.gsm_symbolic_problems(directory, utils, 0, 6, train_templates=[2, 0])
    assert {p.key.split("-t")[1] for p in train} == {"00", "02"}  # never template 1
    assert all(re.fullmatch(r"train-\d{4}-t\d\d", p.key) for p in train)  # no evaluation key repeated
    assert train == readers.gsm_symbolic_problems(directory, utils, 0, 6, train_templates=[0, 2])  # seeded
    assert train != readers.gsm_symbolic_problems(directory, utils, 1, 6, train_templates=[0, 2])
    refused(r"gsm_symbolic: defines no generate_<k> for the training templates k in \[7\]",
            readers.gsm_symbolic_problems, directory, utils, 0, 1, [0, 7])


def test_each_generator_is_matched_to_its_gsm8k_item_by_its_template_text(tmp_path):
    """The generators' numbering differs from the TOMLs'; the map follows the question text."""
    directory, utils = gsm_symbolic_files(tmp_path)
    tomls = gsm_toml_dir(tmp_path)
    assert readers.gsm_symbolic_gsm8k_ids(directory, utils, tomls) == GSM_IDS
    # a generator whose template the TOMLs lack is refused, never guessed
    without_pens = gsm_toml_dir(tmp_path / "b", {k: v for k, v in GSM_TOMLS.items() if k != "0000.toml"})
    refused(r"gsm_symbolic: generate_1 matches no template of .*b/symbolic clearly \(best .* at 0\.\d\d, "
            r"runner-up at 0\.\d\d\)", readers.gsm_symbolic_gsm8k_ids, directory, utils, without_pens)
    # two generators of one template are refused
    twins = gsm_symbolic_files(tmp_path / "c", {**GENERATORS, "generators_03_03.py": GENERATORS["generators_02_02.py"]
                                                .replace("generate_2", "generate_3")})[0]
    refused(r"generate_3 and generate_2 both match .*/0001.toml", readers.gsm_symbolic_gsm8k_ids, twins, utils, tomls)


def test_tiny_domain_is_seeded_and_salted():
    texts = readers.tiny_domain(0, 5, "a")
    assert texts == readers.tiny_domain(0, 5, "a") and len(texts) == 5
    assert texts != readers.tiny_domain(1, 5, "a") and texts != readers.tiny_domain(0, 5, "b")
    assert not {t.paragraphs[0] for t in texts} & set(readers.tiny_corpus(0, 50))
    assert all(len(t.paragraphs[0].split()) >= 20 for t in texts)
