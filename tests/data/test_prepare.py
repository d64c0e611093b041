"""prepare: record schema, exact token counts and limits, packing, determinism, disjoint splits."""

import dataclasses
import json
import re

import pytest
from conftest import tiny_params

from ced_csa2.config import DomainConfig, HubSplit, MixEntry, WheelPin
from ced_csa2.data import corpus, readers
from ced_csa2.data.readers import Article
from ced_csa2.pipeline import paths

PREPARED = (paths.TRAIN_JSONL, paths.EVAL_JSONL, paths.GSM8K_JSONL,
            *(paths.domain_jsonl(d.name) for d in tiny_params().data.domains))
OUTPUTS = (*PREPARED, *map(paths.provenance_path, PREPARED), paths.PREPARE_METRICS)  # each file with its record


def byte_tokenizer(bos: bool = False):
    """A local byte-level tokenizer (one token per byte), optionally adding a BOS to every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {sym: i for i, sym in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>"])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def with_data(params, **changes):
    return dataclasses.replace(params, data=dataclasses.replace(params.data, **changes))


@pytest.mark.parametrize("bos", [False, True])
def test_tiny_outputs_schema_counts_and_limits(tmp_path, bos):
    params, tok = tiny_params(), byte_tokenizer(bos)
    data = params.data
    metrics = corpus.prepare(params, tok, tmp_path)

    train, eval_ = read_jsonl(tmp_path / paths.TRAIN_JSONL), read_jsonl(tmp_path / paths.EVAL_JSONL)
    assert (len(train), len(eval_)) == (data.n_train, data.n_eval)
    for rec in train + eval_:
        assert list(rec) == ["id", "source", "text", "n_tokens"]
        assert rec["n_tokens"] == len(tok(rec["text"])["input_ids"])
        assert data.min_tokens <= rec["n_tokens"] <= data.max_tokens
    # tiny paragraphs are longer than max_tokens bytes, so every record is cut at the
    # limit (one token less where the cut fell on a space, which is stripped).
    assert all(r["n_tokens"] >= data.max_tokens - 1 for r in train)

    assert not {r["id"] for r in train} & {r["id"] for r in eval_}
    assert not {r["text"] for r in train} & {r["text"] for r in eval_}

    problems = read_jsonl(tmp_path / paths.GSM8K_JSONL)
    assert len(problems) == data.math.n and all(list(p) == ["id", "question", "answer", "target"] for p in problems)

    assert json.loads((tmp_path / paths.PREPARE_METRICS).read_text()) == metrics
    assert metrics["train"]["records"] == data.n_train
    assert metrics["train"]["tokens"] == sum(r["n_tokens"] for r in train)
    assert metrics["eval"]["sources"] == {"tiny-synthetic": data.n_eval}
    assert metrics["math"] == {"label": data.math.label, "n": data.math.n}

    assert len(data.domains) == 2 and list(metrics["domains"]) == [d.name for d in data.domains]
    for domain in data.domains:
        records = read_jsonl(tmp_path / paths.domain_jsonl(domain.name))
        assert len(records) == domain.n == metrics["domains"][domain.name]["records"]
        for rec in records:
            assert list(rec) == ["id", "source", "text", "n_tokens"] and rec["id"].startswith(f"{domain.name}-")
            assert data.min_tokens <= rec["n_tokens"] == len(tok(rec["text"])["input_ids"]) <= data.max_tokens
        assert metrics["domains"][domain.name]["sources"] == {"tiny-synthetic": domain.n}
    texts = [read_jsonl(tmp_path / paths.domain_jsonl(d.name)) for d in data.domains]
    assert [r["text"] for r in texts[0]] != [r["text"] for r in texts[1]]  # two tiny domains, two sets of texts


def test_outputs_are_byte_identical_across_runs(tmp_path):
    params, tok = tiny_params(), byte_tokenizer()
    corpus.prepare(params, tok, tmp_path / "a")
    corpus.prepare(params, tok, tmp_path / "b")
    for rel in OUTPUTS:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert not list((tmp_path / "a").rglob(".*tmp*")), "temporary files left behind"


@pytest.mark.parametrize("bos", [False, True])
def test_pack_joins_paragraphs_and_truncates(bos):
    tok = byte_tokenizer(bos)
    extra = int(bos)
    budget = corpus.TokenBudget(tok, min_tokens=10 + extra, max_tokens=50 + extra)
    paragraphs = ["a" * 20, "b" * 20, "c" * 20, "d" * 100, "e" * 5]
    assert budget.pack(paragraphs) == [
        ("a" * 20 + "\n" + "b" * 20, 41 + extra),  # "c" would overflow
        ("c" * 20, 20 + extra),                     # "d" would overflow
        ("d" * 50, 50 + extra),                     # too long alone: truncated, closes the record
    ]                                               # "e" alone is under min_tokens: dropped
    text, n = budget.truncate("ab " * 40)
    assert n == len(tok(text)["input_ids"]) <= 50 + extra and not text.endswith(" ")


def small_wiki(tmp_path, monkeypatch):
    """Params of the wiki_embedded kind (all train records) over eight small articles, served locally."""
    pin = WheelPin(package="gensim", version="0", member="x.bz2", sha256="0" * 64, python_version=None)
    articles = [Article(f"A{a}", [f"Article {a} paragraph {p:02d}. word word word" for p in range(12)])
                for a in range(8)]
    monkeypatch.setattr(corpus, "fetch_member", lambda p: tmp_path / "unused.bz2")
    monkeypatch.setattr(readers, "wiki_articles", lambda path: articles)
    return with_data(tiny_params(), kind="wiki_embedded", corpus_wheel=pin, heldout_articles=2, n_eval=3,
                     min_tokens=40, max_tokens=120, n_train=0)


def test_wiki_embedded_holds_out_whole_articles(tmp_path, monkeypatch):
    params = small_wiki(tmp_path, monkeypatch)
    tok = byte_tokenizer()
    corpus.prepare(params, tok, tmp_path)
    train, eval_ = read_jsonl(tmp_path / paths.TRAIN_JSONL), read_jsonl(tmp_path / paths.EVAL_JSONL)

    article_of = lambda rec: rec["id"].split("-")[1]  # noqa: E731
    assert len({article_of(r) for r in eval_}) <= 2 and len({article_of(r) for r in train}) == 6
    assert not {article_of(r) for r in train} & {article_of(r) for r in eval_}
    assert len(eval_) == 3 and all(r["source"] == "enwiki@gensim==0" for r in train + eval_)
    for rec in train + eval_:
        assert 40 <= rec["n_tokens"] == len(tok(rec["text"])["input_ids"]) <= 120
        assert "\n" in rec["text"]  # several paragraphs per record


def test_n_train_keeps_the_first_of_a_seeded_shuffle_of_the_train_records(tmp_path, monkeypatch):
    """wiki_embedded with n_train = k: k of the n_train = 0 records, in corpus order, nested in a larger
    n_train's; the eval records untouched; the same files twice."""
    params, tok = small_wiki(tmp_path, monkeypatch), byte_tokenizer()

    def run(name, n_train):
        metrics = corpus.prepare(with_data(params, n_train=n_train), tok, tmp_path / name)
        return metrics, read_jsonl(tmp_path / name / paths.TRAIN_JSONL), read_jsonl(tmp_path / name / paths.EVAL_JSONL)

    _, every, every_eval = run("all", 0)
    metrics, train, eval_ = run("k", 10)
    assert len(every) == 24 and len(train) == 10
    assert [r for r in every if r in train] == train  # a subset, in corpus order
    assert eval_ == every_eval
    assert metrics["n_train"] == {"param": 10, "built": 24, "kept": 10} and metrics["train"]["records"] == 10
    assert [r["id"] for r in train] != [r["id"] for r in every[:10]]  # sampled, not the first ten

    corpus.prepare(with_data(params, n_train=10), tok, tmp_path / "again")
    for rel in OUTPUTS:
        assert (tmp_path / "k" / rel).read_bytes() == (tmp_path / "again" / rel).read_bytes(), rel
    _, more, _ = run("more", 15)
    assert {r["id"] for r in train} < {r["id"] for r in more} and len(more) == 15
    _, beyond, _ = run("beyond", 30)  # at most n_train: all 24
    assert beyond == every


def test_wikitext_long_lines(tmp_path, monkeypatch):
    lines = {split: [f"{split} line {i} " + "x" * (i * 7) for i in range(40)] for split in ("train", "test")}
    monkeypatch.setattr(readers, "wikitext_lines", lambda hub_id, config, split, revision: lines[split])
    params = with_data(tiny_params(), kind="wikitext", hub_id="Salesforce/wikitext",
                       train=[HubSplit("wikitext-2-raw-v1", "train", 10)],
                       eval=HubSplit("wikitext-2-raw-v1", "test", 0), n_eval=5, min_tokens=100, max_tokens=200)
    tok = byte_tokenizer()
    corpus.prepare(params, tok, tmp_path)
    train, eval_ = read_jsonl(tmp_path / paths.TRAIN_JSONL), read_jsonl(tmp_path / paths.EVAL_JSONL)
    assert (len(train), len(eval_)) == (10, 5)
    for rec in train:
        i = int(rec["id"].rsplit("/", 1)[1])
        assert len(tok(lines["train"][i])["input_ids"]) >= 100  # only long lines are chosen
        assert rec["n_tokens"] == len(tok(rec["text"])["input_ids"]) <= 200
        assert lines["train"][i].startswith(rec["text"])
    assert [r["id"] for r in train] == sorted((r["id"] for r in train), key=lambda s: int(s.rsplit("/", 1)[1]))

    corpus.prepare(with_data(params, n_train=4), tok, tmp_path / "n4")  # n_train applies to this kind too
    kept = read_jsonl(tmp_path / "n4" / paths.TRAIN_JSONL)
    assert len(kept) == 4 and [r for r in train if r in kept] == kept
    assert read_jsonl(tmp_path / "n4" / paths.EVAL_JSONL) == eval_


def test_validation_errors_name_the_key(tmp_path):
    params, tok = tiny_params(), byte_tokenizer(bos=True)
    with pytest.raises(ValueError, match="data.min_tokens=1 is not above the 1 special tokens"):
        corpus.prepare(with_data(params, min_tokens=1), tok, tmp_path)
    wikitext = with_data(params, kind="wikitext", hub_id="h", train=[HubSplit("c", "train", 1)],
                         eval=HubSplit("c", "test", 7), n_eval=5)
    with pytest.raises(ValueError, match=r"data.eval.n=7 disagrees with data.n_eval=5"):
        corpus.prepare(wikitext, tok, tmp_path)
    twice = with_data(wikitext, eval=HubSplit("c", "test", 0), train=[HubSplit("c", "train", 1)] * 2)
    with pytest.raises(ValueError, match=r"data.train lists \['c/train'\] more than once"):
        corpus.prepare(twice, tok, tmp_path)
    no_math = with_data(params, math=dataclasses.replace(params.data.math, n=0))
    with pytest.raises(ValueError, match=r"data.math.n=0: the tiny math set is generated"):
        corpus.prepare(no_math, tok, tmp_path)
    assert not (tmp_path / paths.TRAIN_JSONL).exists()


def test_tiny_eval_records_do_not_move_with_n_train(tmp_path):
    params, tok = tiny_params(), byte_tokenizer()
    corpus.prepare(params, tok, tmp_path / "a")
    corpus.prepare(with_data(params, n_train=params.data.n_train + 3), tok, tmp_path / "b")
    eval_a, eval_b = ((tmp_path / d / paths.EVAL_JSONL).read_bytes() for d in "ab")
    train_a, train_b = (read_jsonl(tmp_path / d / paths.TRAIN_JSONL) for d in "ab")
    assert eval_a == eval_b and len(train_b) == len(train_a) + 3 and train_b[:len(train_a)] == train_a


def test_texts_with_unicode_line_breaks_stay_on_their_records_line(tmp_path):
    """JSON leaves U+0085/U+2028/U+2029 raw without ensure_ascii; str.splitlines would break a record at them."""
    from ced_csa2.data.records import read_records

    rows = [{"id": "r0", "source": "s", "text": "one\u2028two\x85three\u2029four", "n_tokens": 70},
            {"id": "r1", "source": "s", "text": "plain é text", "n_tokens": 70}]
    path = tmp_path / "records.jsonl"
    path.write_text(corpus._jsonl(rows), encoding="utf-8")
    assert read_records(path) == rows
    assert "é" in path.read_text(encoding="utf-8")  # other non-ASCII text is written as it is


BOOK_OF_TWELVE = "\n\n".join(["*** START OF THE PROJECT GUTENBERG EBOOK X ***",
                                *(f"Paragraph {i} of the tale goes on and on about the sea." for i in range(12)),
                                "*** END OF THE PROJECT GUTENBERG EBOOK X ***"])


def test_a_wheel_domain_is_packed_sampled_and_labelled(tmp_path, monkeypatch):
    """A fiction domain from a (local) Gutenberg text: paragraphs packed under the corpus's budget, n of them."""
    from domain_files import book_file

    book = book_file(tmp_path, BOOK_OF_TWELVE)
    monkeypatch.setattr(corpus, "fetch_member", lambda pin: book)
    pin = WheelPin(package="reasoning-gym", version="0.1.25", member="x.txt", sha256="0" * 64, python_version=None)
    fiction = DomainConfig(name="fiction", kind="fiction", n=3, files=[pin])
    params, tok = with_data(tiny_params(), domains=[fiction], min_tokens=40, max_tokens=140), byte_tokenizer()
    metrics = corpus.prepare(params, tok, tmp_path / "out")
    records = read_jsonl(tmp_path / "out" / paths.domain_jsonl("fiction"))
    assert len(records) == 3 and metrics["domains"]["fiction"]["records"] == 3
    assert all(r["source"] == "fiction@reasoning-gym==0.1.25" for r in records)
    assert all(re.fullmatch(r"fiction-a_short_tale-\d\d", r["id"]) for r in records)
    assert all(40 <= r["n_tokens"] <= 140 and "\n" in r["text"] for r in records)  # paragraphs packed
    assert all(r["text"].startswith("Paragraph") for r in records)
    assert not (tmp_path / "out" / paths.domain_jsonl("reports_a")).exists()

    # a domain file left by an earlier configuration is removed, with its record
    for stale in (paths.domain_jsonl("old"), paths.provenance_path(paths.domain_jsonl("old"))):
        (tmp_path / "out" / stale).write_text("{}\n")
    corpus.prepare(params, tok, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / paths.DOMAINS_DIR).iterdir()) == [
        "fiction.jsonl", "fiction.provenance.json"]

    too_many = with_data(params, domains=[dataclasses.replace(fiction, n=10)])
    with pytest.raises(ValueError, match=r"data.domains 'fiction': \d+ records of 1 texts lie within "
                                         r"data.min_tokens..max_tokens \(40..140\), fewer than its n=10"):
        corpus.prepare(too_many, tok, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()  # refused before anything is written


def test_a_domain_text_that_is_also_a_train_text_is_refused(tmp_path, monkeypatch):
    params, tok = tiny_params(), byte_tokenizer()
    train_texts = readers.tiny_corpus(params.data.seed, 30)
    copies = [readers.DomainText(f"{i:04d}", [t]) for i, t in enumerate(train_texts)]
    monkeypatch.setattr(readers, "tiny_domain", lambda seed, n, salt: copies[:n])
    with pytest.raises(ValueError, match=r"data.domains 'reports_a': \d+ of its texts also occur in the training"):
        corpus.prepare(params, tok, tmp_path)


def test_a_mix_holds_exactly_its_weights_rows_and_leaves_the_evaluation_records(tmp_path):
    """Each mix domain gives exactly its share of data.mix_rows tokens; no evaluation record moves."""
    from ced_csa2.config import MixEntry

    tok = byte_tokenizer(bos=True)  # one special token per record: the cut must count it
    plain = corpus.prepare(tiny_params(), tok, tmp_path / "plain")
    mix = [MixEntry("tiny", 2.0), MixEntry("reports_a", 1.0), MixEntry("reports_b", 1.0)]
    params = with_data(tiny_params(dump={"records": 0}), mix=mix, mix_rows=1001)
    metrics = corpus.prepare(params, tok, tmp_path / "mixed")

    train = read_jsonl(tmp_path / "mixed" / paths.TRAIN_JSONL)
    assert all(r["n_tokens"] == len(tok(r["text"])["input_ids"]) for r in train)
    rows = {name: sum(r["n_tokens"] for r in train if r["id"].startswith(f"{name}-")) for name in
            ("tiny", "reports_a", "reports_b")}
    assert rows == {"tiny": 501, "reports_a": 250, "reports_b": 250}  # 1001 x 2/4, 1/4, 1/4: one left over
    assert {name: m["rows"] for name, m in metrics["mix"].items()} == rows
    assert metrics["train"]["tokens"] == 1001
    # every evaluation file is byte-identical to the unmixed run's, and so is its record: the mix
    # is a change of the training records alone, so no stage that reads only the others re-runs
    for path in (paths.EVAL_JSONL, *(paths.domain_jsonl(d.name) for d in params.data.domains)):
        for file in (path, paths.provenance_path(path)):
            assert (tmp_path / "mixed" / file).read_bytes() == (tmp_path / "plain" / file).read_bytes(), file
    record = json.loads((tmp_path / "mixed" / paths.provenance_path(paths.TRAIN_JSONL)).read_text())["provenance"]
    assert record["data.mix"] == [{"domain": e.domain, "weight": e.weight} for e in mix]
    assert record["data.domains.0.name"] == "reports_a" and record["data.domains.1.name"] == "reports_b"  # mixed in
    eval_texts = {r["text"] for d in params.data.domains
                  for r in read_jsonl(tmp_path / "mixed" / paths.domain_jsonl(d.name))}
    assert not eval_texts & {r["text"] for r in train}
    assert plain["mix"] == {} and len(read_jsonl(tmp_path / "plain" / paths.TRAIN_JSONL)) == params.data.n_train

    # the same params give the same bytes
    corpus.prepare(params, tok, tmp_path / "again")
    assert (tmp_path / "again" / paths.TRAIN_JSONL).read_bytes() == (tmp_path / "mixed" / paths.TRAIN_JSONL).read_bytes()


def test_cut_exactly_gives_a_prefix_of_exactly_n_tokens():
    from ced_csa2.model_utils import load_tokenizer

    tok = load_tokenizer(tiny_params().model)
    budget = corpus.TokenBudget(tok, 8, 512)
    text = " ".join(readers.tiny_corpus(0, 3))
    for n in range(budget.n_special + 1, 60):
        cut = budget.cut_exactly(text, n)
        assert cut is not None and text.startswith(cut) and budget.count(cut) == n
    assert budget.cut_exactly("short", 400) is None


def test_a_mix_domain_without_enough_training_tokens_is_refused_before_writing(tmp_path):
    from ced_csa2.config import MixEntry

    params = with_data(tiny_params(dump={"records": 0}), mix=[MixEntry("tiny", 1.0)], mix_rows=10**6)
    with pytest.raises(ValueError, match=r"data.mix 'tiny': its training records hold [\d,]+ tokens, fewer than its "
                                         r"1,000,000 of data.mix_rows"):
        corpus.prepare(params, byte_tokenizer(), tmp_path)
    assert not tmp_path.joinpath(paths.TRAIN_JSONL).exists()


@pytest.mark.parametrize("weights,rows,quotas", [
    ((1, 1, 1), 100, (34, 33, 33)),  # one token left over: to the first of the equal remainders
    ((0.1, 0.2, 0.7), 10, (1, 2, 7)),
    ((3, 1, 1), 7, (4, 2, 1)),  # 4.2, 1.4, 1.4: the leftover to the larger remainder, then the earlier
])
def test_mix_quotas_sum_to_the_rows_and_follow_the_weights(weights, rows, quotas):
    from ced_csa2.config import MixEntry

    names = ("tiny", "reports_a", "reports_b")
    data = with_data(tiny_params(dump={"records": 0}), mix=[MixEntry(n, float(w)) for n, w in zip(names, weights)],
                     mix_rows=rows).data
    assert data.mix_quotas() == dict(zip(names, quotas))


def _math_profile(tmp_path, monkeypatch, **data):
    """The tiny profile with a math domain of the fake generators and a GSM8K set of the fake TOMLs (local files)."""
    from domain_files import gsm_symbolic_files, gsm_toml_dir

    generators, utils = gsm_symbolic_files(tmp_path)
    files = {"generators": generators, "utils": utils, "tomls": gsm_toml_dir(tmp_path)}
    monkeypatch.setattr(corpus, "fetch_member", lambda pin: files[pin.member])
    pin = lambda member: WheelPin(package="reasoning-gym", version="0.1.25", member=member, sha256="0" * 64,
                                  python_version=None)
    base = tiny_params(dump={"records": 0})
    math_set = dataclasses.replace(base.data.math, kind="wheel", n=0, wheel=pin("tomls"), label="GSM8K-4")
    domain = DomainConfig(name="math", kind="math", n=3, files=[pin("generators"), pin("utils")])
    return with_data(base, math=math_set, domains=[*base.data.domains, domain], **data)


# sha256 over every file prepare wrote (its path, a NUL, its bytes), as the code before the math
# domain became trainable wrote them: the default (no math domain in the mix) must not move.
BEFORE_MATH_TRAINING = {
    "tiny": "a86e121948bc2235570f27b18e0648cd2e3fc0f5763f26e58c9b729030c3d548",
    "tiny+math": "cef48b031ed62248e5040aff0a9ddfa4a8524591832a2b1e4f21ebef0ffb7a25",
}


def _tree_digest(root) -> str:
    import hashlib

    files = sorted(p for p in root.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() for p in files)).hexdigest()


def test_without_math_in_the_mix_prepare_writes_what_it_wrote_before(tmp_path, monkeypatch):
    from domain_files import gsm_symbolic_files

    generators, utils = gsm_symbolic_files(tmp_path)
    monkeypatch.setattr(corpus, "fetch_member", lambda pin: {"g": generators, "u": utils}[pin.member])
    pin = lambda member: WheelPin(package="reasoning-gym", version="0.1.25", member=member, sha256="0" * 64,
                                  python_version=None)
    base = tiny_params()
    math = DomainConfig(name="math", kind="math", n=3, files=[pin("g"), pin("u")])
    for name, params in (("tiny", base), ("tiny+math", with_data(base, domains=[*base.data.domains, math]))):
        corpus.prepare(params, byte_tokenizer(), tmp_path / name)
        assert _tree_digest(tmp_path / name) == BEFORE_MATH_TRAINING[name], name


def test_the_math_training_pool_and_the_scored_gsm8k_items_share_no_template(tmp_path, monkeypatch):
    from domain_files import GSM_IDS

    mix = [MixEntry("tiny", 1.0), MixEntry("math", 1.0)]
    params = _math_profile(tmp_path, monkeypatch, mix=mix, mix_rows=1200, mix_math_templates=2)
    tok = byte_tokenizer()
    metrics = corpus.prepare(params, tok, tmp_path / "mixed")
    split = metrics["math"]["trained_templates"]
    math_ids = [r["id"] for r in read_jsonl(tmp_path / "mixed" / paths.TRAIN_JSONL) if r["id"].startswith("math-")]
    trained = {int(re.fullmatch(r"math-train-\d{4}-t(\d\d)-\d\d", i)[1]) for i in math_ids}
    assert trained == set(split["templates"]) and len(trained) == 2  # the pool drew from its templates alone
    assert split["gsm8k_ids"] == sorted(GSM_IDS[k] for k in trained)
    scored = {r["id"] for r in read_jsonl(tmp_path / "mixed" / paths.GSM8K_JSONL)}
    # no scored item is a trained template's, and every other item (555: no generator) is scored
    assert scored == {f"gsm8k-test-{i}" for i in (7, 40, 123, 555)} - {f"gsm8k-test-{GSM_IDS[k]}" for k in trained}
    assert metrics["math"] == {"label": "GSM8K-4 minus the 2 templates of the math training pool", "n": 2,
                               "trained_templates": split}
    record = json.loads((tmp_path / "mixed" / paths.provenance_path(paths.GSM8K_JSONL)).read_text())["provenance"]
    assert record["data.mix_math_templates"] == 2 and record["data.domains.2.name"] == "math"

    # the math domain's evaluation records do not move with the mix
    plain = with_data(params, mix=[], mix_rows=0, mix_math_templates=0)
    plain_metrics = corpus.prepare(plain, tok, tmp_path / "plain")
    math_file = paths.domain_jsonl("math")
    assert (tmp_path / "mixed" / math_file).read_bytes() == (tmp_path / "plain" / math_file).read_bytes()
    assert plain_metrics["math"] == {"label": "GSM8K-4", "n": 4}

    # seeded and deterministic: the same seed, the same split and bytes; the split follows data.seed
    corpus.prepare(params, tok, tmp_path / "again")
    assert _tree_digest(tmp_path / "again") == _tree_digest(tmp_path / "mixed")
    splits = {tuple(corpus.math_split(with_data(params, seed=seed).data).templates) for seed in range(8)}
    assert len(splits) > 1


def test_a_math_split_leaving_nothing_to_score_is_refused_before_writing(tmp_path, monkeypatch):
    params = _math_profile(tmp_path, monkeypatch, mix=[MixEntry("math", 1.0)], mix_rows=100, mix_math_templates=3)
    with pytest.raises(ValueError, match=r"^data.mix_math_templates=3: the math domain 'math' has 3 templates, so it "
                                         r"must be below 3 \(the GSM8K items of the others are the ones scored\)$"):
        corpus.prepare(params, byte_tokenizer(), tmp_path / "refused")
    # data.math's first two items (n=2: 0000.toml and 0001.toml, of generators 1 and 2) both trained on
    split_of = lambda seed: corpus.math_split(with_data(params, seed=seed, mix_math_templates=2).data).templates
    seed = next(seed for seed in range(100) if split_of(seed) == [1, 2])
    params = with_data(params, math=dataclasses.replace(params.data.math, n=2), mix_math_templates=2, seed=seed)
    with pytest.raises(ValueError, match=r"^data.mix_math_templates=2: the math training pool's templates are all 2 "
                                         r"items of data.math \(n=2\), leaving none to score$"):
        corpus.prepare(params, byte_tokenizer(), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
