"""``eval_gsm8k`` stage: GSM8K accuracy of every runtime group through lm-eval, plus gold NLL.

    python -m ced_csa2.eval_gsm8k        # what `dvc repro eval_gsm8k` runs

Protocol.  The problems of ``data/gsm8k.jsonl`` (``data.math.label``: "GSM8K-100" on the
embedded default, never "GSM8K test") are all evaluated, in file order, with lm-eval's
own ``gsm8k`` task: a generated task YAML pulls in the installed ``gsm8k.yaml`` with
``include:``, so its prompt (``"Question: {q}\\nAnswer:"``), stop sequences, greedy
decoding and the ``strict-match`` (``#### N``) and ``flexible-extract`` (last number)
filters are used unchanged; only the data source is replaced (``dataset_path: json``,
the file's single split as test split).  Few-shot exemplars (``eval_gsm8k.num_fewshot``
> 0) never come from the evaluated problems: they are the first ``num_fewshot`` of
lm-eval's inline ``gsm8k-cot`` exemplars, rewritten into GSM8K's ``... \\n#### N`` answer
format.  No chat template.  Generation stops after ``eval_gsm8k.max_gen_toks`` tokens.
Everything runs offline (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``).

For each group of ``eval_gsm8k.groups`` the model runs inside
:class:`~ced_csa2.ced_runtime.CEDModeBRuntime` (Mode B substitution) and the stage
reports:

* per filter (``strict-match``, ``flexible-extract``): ``exact_match``, ``correct``,
  ``n`` and ``ci95`` (Wilson score interval, z = 1.96);
* ``gold_nll`` (``nll_per_token``, ``tokens``): teacher-forced negative log-likelihood
  per token of the gold ``answer`` (after lm-eval's target delimiter ``" "``) given the
  exact prompt lm-eval generated from (few-shot context included), token-weighted over
  all problems and tokenised as lm-eval's loglikelihood requests are.  On a small
  model, accuracy is near zero for every group; this is the signal that still moves;
* ``seconds``: wall time of the group (generation + gold NLL).

Writes ``metrics/gsm8k.json``: ``{"protocol": {...}, "groups": {group: {...}}}``, and
``data/gsm8k_gold.json``: the tokenised gold pairs (``[ids, context_length]`` per
problem; the same for every group), so that other stages score gold NLL on exactly
these prompts without re-running lm-eval.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from pathlib import Path

import yaml

from .ced_runtime import CEDModeBRuntime, CEDParts, load_parts
from .config import Params, run_stage
from .io_utils import write_json
from .model_utils import load_model_and_tokenizer, resolve_device
from .plan import load_plan
from .scoring import sequence_nll

log = logging.getLogger(__name__)

GSM8K_JSONL = Path("data/gsm8k.jsonl")
METRICS_PATH = Path("metrics/gsm8k.json")
GOLD_PATH = Path("data/gsm8k_gold.json")
TASK = "ced_csa2_gsm8k"
FILTERS = ("strict-match", "flexible-extract")
FEWSHOT_SOURCE = "lm-eval gsm8k-cot exemplars (first num_fewshot, in order), answers rewritten as '... #### N'"


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion.

    Parameters
    ----------
    successes, n
        Number of successes and of trials (``0 <= successes <= n``, ``n > 0``).
    z
        Standard-normal quantile (1.96: 95%).

    Returns
    -------
    (low, high)
        Unlike the normal approximation it stays inside [0, 1] and is not empty at 0/n,
        which is where a small model's GSM8K accuracy sits.
    """
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"Wilson interval needs 0 <= successes <= n and n > 0, got {successes}/{n}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


# ----------------------------------------------------------------------------- the lm-eval task

def _lm_eval_tasks_dir() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).resolve().parent / "tasks" / "gsm8k"


def fewshot_exemplars() -> list[dict]:
    """lm-eval's eight ``gsm8k-cot`` exemplars as ``{question, answer}`` in GSM8K format.

    They are inline in ``gsm8k-cot.yaml`` (so independent of the evaluated problems) but
    end in "The answer is N."; ``gsm8k.yaml``'s strict-match filter wants ``#### N``, so
    that closing sentence becomes a ``#### N`` line.
    """
    path = _lm_eval_tasks_dir() / "gsm8k-cot.yaml"
    samples = yaml.safe_load(path.read_text())["fewshot_config"]["samples"]
    out = []
    for s in samples:
        m = re.fullmatch(r"(?s)(.*?)\s*The answer is (\S+?)\.", s["target"].strip())
        if m is None:
            raise ValueError(f"{path}: exemplar target does not end in 'The answer is N.': {s['target']!r}")
        out.append({"question": s["question"], "answer": f"{m[1]}\n#### {m[2]}"})
    return out


def write_task_yaml(directory: Path, data_file: Path, num_fewshot: int) -> Path:
    """Write the local task (lm-eval's ``gsm8k.yaml`` on ``data_file``) into ``directory``.

    The only overrides are the data source and the few-shot source; ``training_split``
    and ``fewshot_split`` are cleared so lm-eval can never draw exemplars from the
    evaluated file (a single JSON file loads as split ``train``).
    """
    task = {
        "include": str(_lm_eval_tasks_dir() / "gsm8k.yaml"),
        "task": TASK,
        "tag": [],
        "dataset_path": "json",
        "dataset_name": None,
        # cache_dir: the Arrow copy lives (and dies) with the task directory, never stale.
        "dataset_kwargs": {"data_files": {"train": str(data_file.resolve())}, "cache_dir": str(directory / "hf")},
        "training_split": None,
        "fewshot_split": None,
        "test_split": "train",
        "num_fewshot": num_fewshot,
        "fewshot_config": {"sampler": "first_n", "samples": fewshot_exemplars()},
    }
    path = directory / f"{TASK}.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


def _offline() -> None:
    # Both are read when datasets / huggingface_hub are first imported; run() sets them
    # before importing lm-eval, so in the stage's own process the local JSON never
    # waits on a hub lookup.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"


# ----------------------------------------------------------------------------- one group

def accuracy(results: dict) -> dict:
    """``{filter: {exact_match, correct, n, ci95}}`` from a ``simple_evaluate`` result (with samples)."""
    out = {}
    for name in FILTERS:
        scores = [s["exact_match"] for s in results["samples"][TASK] if s["filter"] == name]
        correct, n = int(sum(scores)), len(scores)
        out[name] = {"exact_match": results["results"][TASK][f"exact_match,{name}"], "correct": correct, "n": n,
                     "ci95": list(wilson_interval(correct, n))}
    return out


def gold_pairs(lm, results: dict) -> list[tuple[list[int], int]]:
    """``(tokens of context + gold continuation, length of the context)`` per problem.

    The context is the exact prompt lm-eval generated from (logged with the sample); the
    continuation is ``target_delimiter + answer``.  Tokenised like lm-eval's
    loglikelihood requests: encode the whole text, and the context alone to find the cut.
    """
    delimiter = results["configs"][TASK]["target_delimiter"]
    samples = [s for s in results["samples"][TASK] if s["filter"] == FILTERS[0]]
    pairs = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        context = s["arguments"][0][0]
        whole = lm.tok_encode(context + delimiter + s["doc"]["answer"])
        pairs.append((whole, len(lm.tok_encode(context))))
    return pairs


def gold_nll(model, pairs: list[tuple[list[int], int]], batch_size: int, pad_id: int) -> dict:
    """Token-weighted NLL per gold-answer token (pads never counted)."""
    # Sorting by length keeps right-padding (and wasted compute) small; only sums are kept.
    pairs = sorted(pairs, key=lambda p: len(p[0]))
    nll = sequence_nll(model, [p[0] for p in pairs], [p[1] for p in pairs], batch_size, pad_id)
    total, tokens = nll.sum(0).tolist()
    return {"nll_per_token": total / tokens, "tokens": int(tokens)}


def evaluate_group(lm, model, plan, group: str, parts: CEDParts | None, task_manager, params: Params,
                   pad_id: int) -> tuple[dict, list[tuple[list[int], int]]]:
    """lm-eval accuracy and gold NLL of one group, all under the same Mode B runtime; and the gold pairs."""
    from lm_eval import simple_evaluate

    cfg, seed = params.eval_gsm8k, params.seed
    t0 = time.perf_counter()
    with CEDModeBRuntime(model, plan, group, parts):
        results = simple_evaluate(
            model=lm, tasks=[TASK], task_manager=task_manager, num_fewshot=cfg.num_fewshot,
            gen_kwargs={"max_gen_toks": cfg.max_gen_toks}, bootstrap_iters=0, log_samples=True,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
        t_gen = time.perf_counter() - t0
        pairs = gold_pairs(lm, results)
        gold = gold_nll(model, pairs, cfg.batch_size, pad_id)
    seconds = time.perf_counter() - t0
    n = len(results["samples"][TASK]) // len(FILTERS)
    log.info("%s: generation %.1f s (%.2f s/problem), gold NLL %.1f s", group, t_gen, t_gen / n, seconds - t_gen)
    return {**accuracy(results), "gold_nll": gold, "seconds": round(seconds, 1)}, pairs


# ----------------------------------------------------------------------------- stage

def count_problems(path: Path) -> int:
    """Number of problems in ``data/gsm8k.jsonl`` (a clear error when it is missing or empty)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dvc repro prepare` first")
    n = sum(1 for line in path.read_text().splitlines() if line.strip())
    if n == 0:
        raise ValueError(f"{path} has no problems: rerun `dvc repro prepare`")
    return n


def run(params: Params, workdir: Path = Path("."), *, parts: CEDParts | None = None,
        model_and_tok=None) -> dict:
    """Evaluate every group and write ``metrics/gsm8k.json``; returns what it wrote.

    Parameters
    ----------
    params
        Validated parameters (``seed``, ``model``, ``plan``, ``data.math.label``, ``eval_gsm8k``).
    workdir
        Repository root holding ``data/`` and ``models/``.
    parts
        Trained maps; loaded from ``workdir/models`` when ``None`` and a group needs them.
    model_and_tok
        ``(model, tokenizer)`` to use instead of loading ``params.model`` (tests).
    """
    _offline()
    from lm_eval import __version__ as lm_eval_version
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    workdir, cfg = Path(workdir), params.eval_gsm8k
    data_file = workdir / GSM8K_JSONL
    n = count_problems(data_file)
    plan, _ = load_plan(params.plan, params.model)
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device(cfg.device))
    if parts is None and any(g != "baseline" for g in cfg.groups):
        parts = load_parts(workdir / "models", plan, device=model.device, expect={"model": params.model.name})
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=cfg.batch_size)
    log.info("GSM8K (%s, %d problems, %d-shot, max_gen_toks %d) for groups %s", params.data.math.label, n,
             cfg.num_fewshot, cfg.max_gen_toks, list(cfg.groups))

    groups, pairs = {}, None
    with tempfile.TemporaryDirectory(prefix="ced_csa2_gsm8k_") as tmp:
        write_task_yaml(Path(tmp), data_file, cfg.num_fewshot)
        # The task includes gsm8k.yaml by absolute path: lm-eval's index of its
        # built-in tasks (thousands of YAML files) is not needed.
        task_manager = TaskManager(include_path=tmp, include_defaults=False)
        for i, group in enumerate(cfg.groups, 1):
            log.info("group %d/%d: %s", i, len(cfg.groups), group)
            groups[group], group_pairs = evaluate_group(lm, model, plan, group, parts, task_manager, params,
                                                        tok.pad_token_id)
            if pairs is not None and group_pairs != pairs:
                raise RuntimeError(f"lm-eval built different prompts for group {group!r} than for {cfg.groups[0]!r}")
            pairs = group_pairs
            g = groups[group]
            if g["strict-match"]["n"] != n:
                raise RuntimeError(f"lm-eval evaluated {g['strict-match']['n']} problems, expected all {n}")
            log.info("%s: strict-match %d/%d, flexible-extract %d/%d, gold NLL %.4f/token", group,
                     g["strict-match"]["correct"], n, g["flexible-extract"]["correct"], n,
                     g["gold_nll"]["nll_per_token"])

    metrics = {
        "protocol": {
            "model": params.model.name, "math_set": params.data.math.label, "n": n,
            "num_fewshot": cfg.num_fewshot, "fewshot_source": FEWSHOT_SOURCE if cfg.num_fewshot else None,
            "max_gen_toks": cfg.max_gen_toks, "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device), "lm_eval": lm_eval_version, "task": "lm-eval gsm8k.yaml on local data",
            "plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets)},
        },
        "groups": groups,
    }
    write_json(workdir / GOLD_PATH, {"model": params.model.name, "math_set": params.data.math.label,
                                      "num_fewshot": cfg.num_fewshot, "pairs": pairs})
    write_json(workdir / METRICS_PATH, metrics)
    return metrics


def load_gold_pairs(path: Path, params: Params) -> list[tuple[list[int], int]]:
    """The gold pairs written by this stage, checked against the current model and prompt settings."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dvc repro eval_gsm8k` first")
    data = json.loads(path.read_text())
    want = {"model": params.model.name, "num_fewshot": params.eval_gsm8k.num_fewshot}
    got = {k: data.get(k) for k in want}
    if got != want:
        raise ValueError(f"{path} was written for {got}, but params.yaml has {want}; rerun `dvc repro eval_gsm8k`")
    return [(ids, cut) for ids, cut in data["pairs"]]


def main() -> None:
    run_stage(run)


if __name__ == "__main__":
    main()
