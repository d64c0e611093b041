"""Fault catalogue: bad data named (file, line, record) before the heavy work, and figures written atomically.

* a GSM8K line without ``answer`` (lm-eval would fail deep inside with a ``TypeError``);
* a byte that is not UTF-8 in a corpus file;
* an eval record too short for Mode A's prompt/continuation split, and too few eval records
  for an interval bootstrapped over records;
* a figure whose write fails (a file-size limit): the prior figure stays whole, the error names it.
"""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_params

from ced_csa2.data.records import read_records
from ced_csa2.eval.gsm8k import count_problems
from ced_csa2.eval.perplexity import eval_ids
from ced_csa2.model_utils import tiny_tokenizer
from ced_csa2.pipeline.paths import EVAL_JSONL
from ced_csa2.pipeline.stage_runner import is_input_error


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("bad,message", [
    ({"question": "How many?"}, "has no 'answer' string"),
    ({"answer": "#### 3"}, "has no 'question' string"),
    ({"question": "How many?", "answer": 3}, "has no 'answer' string"),
    (["not", "an", "object"], "has no 'question' or 'answer' string"),
])
def test_a_gsm8k_line_without_its_strings_is_named_before_lm_eval(tmp_path, bad, message):
    good = {"question": "What is 1 + 2?", "answer": "1 + 2 = 3\n#### 3"}
    path = _jsonl(tmp_path / "gsm8k.jsonl", [good, good, bad])
    with pytest.raises(ValueError, match=rf"{path}:3: {message}") as caught:
        count_problems(path)
    assert is_input_error(caught.value)
    assert count_problems(_jsonl(tmp_path / "ok.jsonl", [good, good])) == 2


def test_a_corpus_byte_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"id": f"r{i}", "text": "words", "n_tokens": 2} for i in range(3)]
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows[:2]) + b'{"id": "r2", "text": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: not UTF-8 text \(byte 0xff at offset \d+\)"):
        read_records(path)


def _eval_corpus(workdir, texts):
    tok = tiny_tokenizer()
    rows = [{"id": f"e{i}", "source": "test", "text": t, "n_tokens": len(tok(t)["input_ids"])} for i, t in enumerate(texts)]
    return _jsonl(workdir / EVAL_JSONL, rows), tok


def test_an_eval_record_too_short_for_mode_a_is_named(tmp_path):
    path, tok = _eval_corpus(tmp_path, ["a long enough eval record", "x"])
    short = len(tok("x")["input_ids"])
    assert short < 3
    params = tiny_params(eval_ppl={"records": 0})
    with pytest.raises(ValueError, match=rf"{path}: record 'e1' is {short} token\(s\) long; each eval record needs "
                                         r"at least 3"):
        eval_ids(params, tok, tmp_path)


def test_one_eval_record_is_too_few_for_an_interval(tmp_path):
    path, tok = _eval_corpus(tmp_path, ["a long enough eval record"])
    with pytest.raises(ValueError, match=rf"{path}: 1 eval record\(s\); the paired intervals are bootstrapped "
                                         r"over records and need at least 2"):
        eval_ids(tiny_params(eval_ppl={"records": 0}), tok, tmp_path)


def test_a_figure_whose_write_fails_leaves_the_prior_one_whole_and_names_it(tmp_path):
    """The report's PNG writer under a 4 KiB file-size limit: EFBIG names the figure, which stays as it was."""
    figure = tmp_path / "reports" / "ppl_by_group.png"
    figure.parent.mkdir()
    figure.write_bytes(b"the prior, good figure")
    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from pathlib import Path
from ced_csa2.pipeline.figures import write_png
fig, ax = plt.subplots(figsize=(8, 6))
ax.imshow(__import__("numpy").random.default_rng(0).random((200, 200)))  # noise: a PNG far above 4 KiB
try:
    write_png(fig, Path({str(figure)!r}))
except OSError as exc:
    print(exc.errno, exc, file=sys.stderr)
    sys.exit(3)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin",
                               # under the limit a .pyc would be written short and break every later import
                               "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("27 ") and str(figure) in done.stderr, done.stderr
    assert figure.read_bytes() == b"the prior, good figure"
    assert sorted(p.name for p in figure.parent.iterdir()) == ["ppl_by_group.png"]  # no temp file left
