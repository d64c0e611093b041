"""Raw readers: MediaWiki cleaning, GSM8K TOML files, hub errors, tiny generators."""

import bz2

import pytest

from ced_csa2.data import readers
from ced_csa2.data.readers import Article

ARTICLE = """{{Infobox thing|name=Widget|image=Widget.png}}
'''Widgets''' are small devices used in many kinds of machines.<ref>{{cite book|title=Widgets}}</ref> They were first described in 1900 by [[John Smith (engineer)|John Smith]].
[[File:Widget.jpg|thumb|right|A widget on a [[table]] in a museum with a long caption here]]

== History ==
Early widgets were made of wood and brass<ref name="w"/> and sold in [[London]] markets &amp; fairs.
{| class="wikitable"
! Year !! Widgets sold in the whole country
|-
| 1900 || one hundred and twenty thousand units
|}
Short line here.

=== Later ===
Modern widgets use plastic, steel and tiny electric motors for precise movement.
* A list item that is long enough to count as a paragraph here.

== See also ==
* Other long list item which should be dropped because of its section.

== References ==
{{reflist}}
[[Category:Devices]]
"""

EXPECTED = [
    "Widgets are small devices used in many kinds of machines. They were first described in 1900 by John Smith.",
    "Early widgets were made of wood and brass and sold in London markets & fairs.",
    "Modern widgets use plastic, steel and tiny electric motors for precise movement.",
    "A list item that is long enough to count as a paragraph here.",
]


def _page(title, ns, text, redirect=False):
    from xml.sax.saxutils import escape

    red = f'<redirect title="{title} target" />' if redirect else ""
    return (f"<page><title>{escape(title)}</title><ns>{ns}</ns><id>1</id>{red}"
            f"<revision><id>2</id><text xml:space=\"preserve\">{escape(text)}</text></revision></page>")


def _dump(tmp_path, pages):
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">'
           "<siteinfo><sitename>Wikipedia</sitename></siteinfo>" + "".join(pages) + "</mediawiki>")
    path = tmp_path / "dump.xml.bz2"
    path.write_bytes(bz2.compress(xml.encode()))
    return path


def test_wiki_articles_cleans_markup(tmp_path):
    path = _dump(tmp_path, [
        _page("Widget", 0, ARTICLE),
        _page("Widgets", 0, "#REDIRECT [[Widget]]", redirect=True),
        _page("Gadget", 0, "#redirect [[Widget]] with enough words to pass the length filter here"),
        _page("Wikipedia:About", 4, "This project page has plenty of words but is not an article."),
        _page("Stub", 0, "{{stub}} Too short."),
        _page("Widget (disambiguation)", 0, "'''Widget''' may refer to many different things in this list.\n"),
        _page("Gizmo", 0, "'''Gizmo''' may refer to many different things in this list.\n{{Disambiguation|geo}}"),
    ])
    assert readers.wiki_articles(path) == [Article("Widget", EXPECTED)]


def _write_toml(directory, i, id_orig, answer):
    (directory / f"{i:04d}.toml").write_text(
        f'id_orig = {id_orig}\nquestion = """\nHow many apples are there?\n"""\n'
        f'answer = """\n{answer}\n"""\nquestion_annotated = "ignored"\n')


def test_gsm8k_from_wheel_dir(tmp_path):
    _write_toml(tmp_path, 0, 11, "3*4=<<3*4=12>>12\n#### 12")
    _write_toml(tmp_path, 1, 20, "Lots.\n#### 1,234")
    _write_toml(tmp_path, 2, 39, "x\n#### 7")
    (tmp_path / "instruction.toml").write_text('text = "not a problem"\n')
    got = readers.gsm8k_from_wheel_dir(tmp_path, 2)
    assert got == [
        {"id": "gsm8k-test-11", "question": "How many apples are there?", "answer": "3*4=<<3*4=12>>12\n#### 12",
         "target": "12"},
        {"id": "gsm8k-test-20", "question": "How many apples are there?", "answer": "Lots.\n#### 1,234",
         "target": "1234"},
    ]
    assert len(readers.gsm8k_from_wheel_dir(tmp_path, 0)) == 3
    with pytest.raises(ValueError, match="data.math.n=5 but only 3"):
        readers.gsm8k_from_wheel_dir(tmp_path, 5)


def test_gsm8k_bad_answer_names_file(tmp_path):
    _write_toml(tmp_path, 0, 1, "no final number")
    with pytest.raises(ValueError, match=r"0000\.toml: answer does not end with '#### <number>'"):
        readers.gsm8k_from_wheel_dir(tmp_path, 0)


def test_hub_unreachable_is_one_line_naming_the_dataset_and_its_key(monkeypatch):
    """A hub dataset the hub does not answer for: a ValueError (one line from a stage), not a traceback."""
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (ConnectTimeout)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    for call, source, key in (
            (lambda: readers.gsm8k_hub("openai/gsm8k", "main", "test", 5), "openai/gsm8k@main", "data.math.hub_id"),
            (lambda: readers.wikitext_lines("Salesforce/wikitext", "wikitext-2-raw-v1", "test", "e53f048"),
             "Salesforce/wikitext@e53f048", "data.hub_id")):
        with pytest.raises(readers.HubDataError, match=rf"^{source}: the hub cache .* does not hold it and the hub "
                                                       rf"\(.*\) cannot be reached: .* check the spelling of {key}$"):
            call()


def test_wikitext_lines_and_gsm8k_hub_with_local_data(monkeypatch):
    import datasets

    tables = {
        "wikitext": {"text": ["", " = Title = \n", " Some prose line . \n", " = = Section = = \n", "More prose .\n"]},
        "gsm8k": {"question": ["q0", "q1", "q2"], "answer": ["a\n#### 1", "b\n#### 2,000", "c\n#### 3"]},
    }
    revisions = []

    def load_dataset(hub_id, config, split, revision):
        revisions.append(revision)
        return datasets.Dataset.from_dict(tables[hub_id])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert readers.wikitext_lines("wikitext", "c", "train") == ["Some prose line .", "More prose ."]
    got = readers.gsm8k_hub("gsm8k", "main", "test", 2, revision="0123abc")
    assert revisions == [None, "0123abc"]  # the pinned commit reaches the hub call
    assert [(p["id"], p["target"]) for p in got] == [("gsm8k-test-0", "1"), ("gsm8k-test-1", "2000")]
    with pytest.raises(ValueError, match=r"data.math.n=4, but gsm8k test has 3 problems"):
        readers.gsm8k_hub("gsm8k", "main", "test", 4)  # not quietly 3 under a label that says 4


def test_tiny_generators_are_deterministic():
    assert readers.tiny_corpus(3, 5) == readers.tiny_corpus(3, 5)
    assert readers.tiny_corpus(3, 5)[:2] == readers.tiny_corpus(3, 2)
    assert readers.tiny_corpus(3, 5) != readers.tiny_corpus(4, 5)
    assert all(len(t.split()) >= 20 for t in readers.tiny_corpus(0, 20))

    problems = readers.tiny_math(1, 6)
    assert problems == readers.tiny_math(1, 6) and problems != readers.tiny_math(2, 6)
    for p in problems:
        assert set(p) == {"id", "question", "answer", "target"}
        assert p["answer"].endswith(f"#### {p['target']}")
        assert str(eval(p["answer"].split("<<")[1].split("=")[0])) == p["target"]  # arithmetic is right
