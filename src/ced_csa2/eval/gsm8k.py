"""GSM8K through lm-eval's own ``gsm8k`` task on local data, and gold-solution NLL.

Protocol (stage ``eval_gsm8k``).  The problems of ``data/gsm8k.jsonl`` (``DataConfig.math_label``: "GSM8K-100" on the
embedded default, never "GSM8K test") are all evaluated, in file order, with lm-eval's
own ``gsm8k`` task: a generated task YAML pulls in the installed ``gsm8k.yaml`` with
``include:``, so its prompt (``"Question: {q}\\nAnswer:"``), stop sequences, greedy
decoding and the ``strict-match`` (``#### N``) and ``flexible-extract`` (last number)
filters are used unchanged; only the data source is replaced (``dataset_path: json``,
the file's single split as test split).  Few-shot exemplars (``eval_gsm8k.num_fewshot``
> 0) never come from the evaluated problems: they are the first ``num_fewshot`` of
lm-eval's inline ``gsm8k-cot`` exemplars, rewritten into GSM8K's ``... \\n#### N`` answer
format.  Prompts go through the tokenizer's chat template only with
``eval_gsm8k.apply_chat_template`` (each exemplar its own turn with ``fewshot_as_multiturn``).
Generation stops after ``eval_gsm8k.max_gen_toks`` tokens.
Everything runs offline (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``).

Each group of ``eval_gsm8k.generate`` (generation is what GSM8K costs) generates through the
cache that holds its bytes (:func:`ced_csa2.eval.generation.group_cache`: the shared store for the
CSA2 groups, FP4 stores for the FP4 groups in ``kv_format``, an ordinary ``DynamicCache`` for
``baseline`` and ``ced``), a fresh one per lm-eval batch (left-padded, as lm-eval builds them),
its bytes checked against the accounting after every batch; the stage reports

* per filter (``strict-match``, ``flexible-extract``): ``exact_match``, ``correct``,
  ``n`` and ``ci95`` (Wilson score interval, z = 1.96) (generation times: ``timings/eval_gsm8k.json``);

and for each group of ``eval_gsm8k.groups`` (a superset)

* ``gold_nll`` (``nll_per_token``, ``tokens``; ``delta`` and its paired-bootstrap
  ``delta_ci95`` against baseline): teacher-forced negative log-likelihood per token of
  the gold ``answer`` (after lm-eval's target delimiter ``" "``) given the exact prompt
  lm-eval generated from (few-shot context included), token-weighted over all problems
  and tokenised as lm-eval's loglikelihood requests are: the pairs of
  ``data/gsm8k_gold.json`` (stage ``gold_pairs``; every generated group's prompts are
  checked to be those).  On a small model, accuracy is near zero for every group; this is
  the signal that still moves.  All groups are scored at once with a shared trunk
  (:func:`ced_csa2.eval.scoring.multi_group_nll`).

Mode A (``eval_gsm8k.mode_a``, when the plan covers every attention layer above the cut;
the maps of ``mode_a.maps``, ``mode_a.replay`` tokens replayed):
the same lm-eval task through :class:`~ced_csa2.eval.lm_eval_models.ModeALM` -- each prompt
prefilled by the prefill skip, the answer scored (``gold_nll``: gold NLL, paired against
the baseline) and with ``generate`` also generated (exact match) through all layers -- one
problem at a time (slower than a batched Mode B group: ``docs/costs.md``).

Every generated group (and Mode A with ``generate``) also records ``generations_sha256``,
the sha256 of its generated texts in problem order: runs that agree on it generated the
same text for every problem.

Data-parallel (``distributed.nproc``): the stage runs as that many processes (it starts
torchrun itself).  Each runs lm-eval's task whole, but generates only a contiguous share
of the single-process batches (:class:`~ced_csa2.eval.lm_eval_models.DataParallelLM`, which says why
lm-eval's own multi-process path is not used) and the texts are gathered; gold NLL and
Mode A's rows are scored by share and assembled on every rank.  Every batch is the
single-process one, so the metrics are one process's; rank 0 writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping

import torch
import yaml

from ..ced_runtime import CEDModeARuntime, CEDParts
from ..config import Params
from ..data.records import read_lines
from ..pipeline import distributed
from ..pipeline.atomic_files import write_json
from ..pipeline.paths import GOLD_PATH
from .perplexity import mode_a_note
from .scoring import BLOCK_TOKENS, multi_group_nll, sequence_nll
from .stats import paired_deltas

log = logging.getLogger(__name__)


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


@contextlib.contextmanager
def local_task(data_file: Path, num_fewshot: int) -> Iterator:
    """An lm-eval ``TaskManager`` that knows only the local task on ``data_file`` (:func:`write_task_yaml`).

    The task YAML and lm-eval's Arrow copy of the data live in a temporary directory, removed
    on exit.  Call :func:`go_offline` first: this imports lm-eval.
    """
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="ced_csa2_gsm8k_") as tmp:
        write_task_yaml(Path(tmp), data_file, num_fewshot)
        # The task includes gsm8k.yaml by absolute path: lm-eval's index of its
        # built-in tasks (thousands of YAML files) is not needed.
        yield TaskManager(include_path=tmp, include_defaults=False)


def go_offline() -> None:
    """Set ``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` for this process; call it before importing lm-eval.

    Both are read when datasets / huggingface_hub are first imported, so set first the local JSON
    never waits on a hub lookup.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"


def accuracy(results: dict) -> dict:
    """``{filter: {exact_match, correct, n, ci95}}`` from a ``simple_evaluate`` result (with samples)."""
    out = {}
    for name in FILTERS:
        scores = [s["exact_match"] for s in results["samples"][TASK] if s["filter"] == name]
        correct, n = int(sum(scores)), len(scores)
        out[name] = {"exact_match": results["results"][TASK][f"exact_match,{name}"], "correct": correct, "n": n,
                     "ci95": list(wilson_interval(correct, n))}
    return out


def generations_sha256(results: dict) -> str:
    """sha256 of the generated texts in problem order: runs that agree on it generated the same text everywhere."""
    samples = sorted((s for s in results["samples"][TASK] if s["filter"] == FILTERS[0]), key=lambda s: s["doc_id"])
    return hashlib.sha256(json.dumps([s["resps"][0][0] for s in samples]).encode()).hexdigest()


def gold_pairs(lm, results: dict, apply_chat_template: bool) -> list[tuple[list[int], int]]:
    """``(tokens of context + gold continuation, length of the context)`` per problem.

    The context is the exact prompt lm-eval generated from (logged with the sample); the
    continuation is ``target_delimiter + answer``, the delimiter dropped under a chat template
    (whose prompt ends in the assistant's turn) as lm-eval builds its loglikelihood requests.
    Tokenised by lm-eval's own ``_encode_pair``: trailing whitespace of the context moved into
    the continuation, the whole text encoded, and the context alone to find the cut.
    """
    config = results["configs"][TASK]
    delimiter = config["target_delimiter"]
    if apply_chat_template and not _keeps_delimiter(config.get("gen_prefix")):
        delimiter = ""
    samples = [s for s in results["samples"][TASK] if s["filter"] == FILTERS[0]]
    pairs = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        context, continuation = lm._encode_pair(s["arguments"][0][0], delimiter + s["doc"]["answer"])
        pairs.append((context + continuation, len(context)))
    return pairs


def _keeps_delimiter(gen_prefix: str | None) -> bool:
    """lm-eval keeps a chat-templated request's target delimiter only after a generation prefix without trailing space."""
    return bool(gen_prefix) and gen_prefix == gen_prefix.rstrip()


def gold_nll(model, pairs: list[tuple[list[int], int]], batch_size: int, pad_id: int, *,
             block_tokens: int = BLOCK_TOKENS) -> dict:
    """Token-weighted NLL per gold-answer token (pads never counted; only the answer tokens reach the LM
    head, ``block_tokens`` at a time: :func:`~ced_csa2.eval.scoring.score_hidden`)."""
    # Sorting by length keeps right-padding (and wasted compute) small; only sums are kept.
    pairs = sorted(pairs, key=lambda p: len(p[0]))
    return _per_token(sequence_nll(model, [p[0] for p in pairs], [p[1] for p in pairs], batch_size, pad_id,
                                   block_tokens=block_tokens))


def groups_gold_nll(model, plan, groups: list[str], parts: CEDParts | Mapping[str, CEDParts] | None,
                    pairs: list[tuple[list[int], int]], batch_size: int, pad_id: int, *, kv_format: str | None,
                    seed: int, more: dict[str, torch.Tensor] | None = None,
                    extra: Mapping[str, object] | None = None, block_tokens: int = BLOCK_TOKENS) -> dict[str, dict]:
    """:func:`gold_nll` of every group under its Mode B runtime, bit for bit, with one shared trunk per batch.

    ``extra`` adds runtimes by label, scored like groups (:func:`~ced_csa2.eval.scoring.multi_group_nll`);
    ``more`` adds arms scored elsewhere (Mode A): ``{name: (len(pairs), 2)}`` rows in the
    order of ``pairs``.  When ``baseline`` is among ``groups`` every other group and arm also
    gets ``delta`` (gold NLL per token minus the baseline's, nats) and ``delta_ci95`` (paired
    bootstrap over problems).

    Under a process group each rank scores a contiguous run of the single-process batches
    and the per-problem sums are assembled on every rank, so every figure is one process's.
    """
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]))  # little right-padding
    lo, hi = distributed.batch_bounds(len(pairs), batch_size)
    mine = order[lo:hi]
    nll = multi_group_nll(model, plan, groups, parts, [pairs[i][0] for i in mine], [pairs[i][1] for i in mine],
                          batch_size, pad_id, kv_format=kv_format, extra=extra, block_tokens=block_tokens)
    nll = {group: distributed.assemble(rows, lo, len(pairs)) for group, rows in nll.items()}
    nll.update({name: rows[order] for name, rows in (more or {}).items()})
    out = {group: _per_token(v) for group, v in nll.items()}
    for group, d in paired_deltas({g: v.numpy() for g, v in nll.items()}, "delta_nll", seed).items():
        out[group].update(delta=d["value"], delta_ci95=d["ci95"])
    return out


def _per_token(nll) -> dict:
    total, tokens = nll.sum(0).tolist()
    return {"nll_per_token": total / tokens, "tokens": int(tokens)}


def evaluate_group(lm, plan, group: str, parts: CEDParts | None, task_manager, params: Params
                   ) -> tuple[dict, list[tuple[list[int], int]]]:
    """lm-eval exact match of one group, generated through the cache that holds its bytes
    (:meth:`~ced_csa2.eval.lm_eval_models.DataParallelLM.through_cache`), and the gold pairs.

    The entry gains ``cache``: the cache in words (``DynamicCache``, ``SharedKVCache(nvfp4)``, ...).
    """
    with lm.through_cache(plan, group, parts, params.kv_format) as seen:
        entry, pairs = evaluate_lm(lm, task_manager, params, group)
    return ({**entry, "cache": seen["cache"]} if entry else entry), pairs


def evaluate_lm(lm, task_manager, params: Params, label: str) -> tuple[dict, list[tuple[list[int], int]] | None]:
    """lm-eval exact match of ``lm`` as it is (Mode A: :class:`~ced_csa2.eval.lm_eval_models.ModeALM`), and the gold pairs.

    ``({}, None)`` on a rank other than 0 of a process group: lm-eval returns its results
    on ``LOCAL_RANK`` 0 only (every rank took part in the generation).
    """
    t0 = time.perf_counter()
    results = _simple_evaluate(lm, task_manager, params, {"max_gen_toks": params.eval_gsm8k.max_gen_toks})
    seconds = time.perf_counter() - t0
    if results is None:
        return {}, None
    n = len(results["samples"][TASK]) // len(FILTERS)
    log.info("%s: generation %.1f s (%.2f s/problem)", label, seconds, seconds / n)
    return ({**accuracy(results), "generations_sha256": generations_sha256(results), "seconds": round(seconds, 1)},
            gold_pairs(lm, results, params.eval_gsm8k.apply_chat_template))


def prompt_pairs(tokenizer, task_manager, params: Params) -> list[tuple[list[int], int]]:
    """The gold pairs of :func:`evaluate_lm`, without a model: no forward pass, seconds.

    lm-eval builds the prompts exactly as for generation (same call, task, few-shot setting
    and seeds; the generation settings never enter a prompt), every generation request is
    answered with an empty string, and ``HFLM``'s own ``tok_encode`` tokenises.
    """
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.huggingface import HFLM

    class PromptsOnly(HFLM):
        def __init__(self):
            TemplateLM.__init__(self)  # not HFLM's: that one needs the model
            # What HFLM.tok_encode reads, as HFLM(pretrained=model, tokenizer=tokenizer) sets it.
            self.tokenizer, self.add_bos_token, self.custom_prefix_token_id = tokenizer, None, None
            self.backend = "causal"  # what _encode_pair reads: encode the whole text, then cut
            self.chat_template_args = {}  # HFLM.apply_chat_template's extra arguments (none)

        def generate_until(self, requests, disable_tqdm=False):
            return [""] * len(requests)

        def get_model_info(self) -> dict:
            return {}  # HFLM's describes the model

    lm = PromptsOnly()
    return gold_pairs(lm, _simple_evaluate(lm, task_manager, params), params.eval_gsm8k.apply_chat_template)


def prompt_protocol(params: Params) -> dict:
    """The settings that shape a GSM8K prompt; gold pairs are built, and checked, for exactly these."""
    cfg = params.eval_gsm8k
    return {"num_fewshot": cfg.num_fewshot, "apply_chat_template": cfg.apply_chat_template,
            "fewshot_as_multiturn": cfg.fewshot_as_multiturn}


def check_chat_template(tokenizer, params: Params) -> None:
    """Refuse ``eval_gsm8k.apply_chat_template`` for a tokenizer that has no chat template (before any work)."""
    if params.eval_gsm8k.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"eval_gsm8k.apply_chat_template is true, but model {params.model.name}'s tokenizer "
                         "has no chat template: set it to false (a base model) or use an instruct model")


def _simple_evaluate(lm, task_manager, params: Params, gen_kwargs: dict | None = None) -> dict | None:
    """lm-eval's ``simple_evaluate`` of the local task (:func:`prompt_protocol`), every seed ``seed``, samples logged.

    ``None`` where ``LOCAL_RANK`` is not 0 (lm-eval reports on one process of a torchrun launch).
    """
    from lm_eval import simple_evaluate

    seed = params.seed
    return simple_evaluate(
        model=lm, tasks=[TASK], task_manager=task_manager, **prompt_protocol(params),
        gen_kwargs=gen_kwargs, bootstrap_iters=0, log_samples=True,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)


def generate_groups(lm, model, plan, parts: CEDParts | None, task_manager, params: Params,
                    pairs: list[tuple[list[int], int]], n: int) -> tuple[dict[str, dict], dict[str, float]]:
    """Exact match of every group of ``eval_gsm8k.generate`` through lm-eval, and each one's generation seconds.

    Returns ``{group: entry}`` for every group of ``eval_gsm8k.groups`` (empty for the groups
    that only get gold NLL) and ``{group: seconds}``.  Refuses a run whose prompts are not
    ``pairs`` (``data/gsm8k_gold.json``) or which evaluated fewer than the ``n`` problems.
    """
    cfg = params.eval_gsm8k
    groups: dict[str, dict] = {g: {} for g in cfg.groups}
    seconds: dict[str, float] = {}
    for i, group in enumerate(cfg.generate, 1):
        log.info("generation %d/%d: %s", i, len(cfg.generate), group)
        groups[group], group_pairs = evaluate_group(lm, plan, group, parts, task_manager, params)
        if not distributed.is_main():
            continue  # lm-eval's results are rank 0's
        if group_pairs != pairs:
            raise RuntimeError(f"lm-eval built different prompts for group {group!r} than {GOLD_PATH} holds")
        g = groups[group]
        seconds[group] = g.pop("seconds")
        if g["strict-match"]["n"] != n:
            raise RuntimeError(f"lm-eval evaluated {g['strict-match']['n']} problems, expected all {n}")
        log.info("%s: strict-match %d/%d, flexible-extract %d/%d", group, g["strict-match"]["correct"], n,
                 g["flexible-extract"]["correct"], n)
    return groups, seconds


def mode_a_arm(params: Params, model, tok, plan, geo, parts: CEDParts | None, task_manager, pairs
               ) -> tuple[dict, dict[str, torch.Tensor]]:
    """Mode A's gold-answer rows (and exact match with ``generate``) through :class:`~ced_csa2.eval.lm_eval_models.ModeALM`.

    Returns the metrics entry (``covered: false`` and why, when it does not run) and
    ``{"mode_a": (n, 2) rows}`` for :func:`~ced_csa2.eval.gsm8k.groups_gold_nll` (empty when not run).
    """
    setting = params.eval_gsm8k.mode_a
    if setting == "off":
        return {"covered": None, "note": "eval_gsm8k.mode_a is off"}, {}
    missing = plan.uncovered(geo)
    if missing:
        return {"covered": False, "uncovered_attention_layers": missing,
                "note": f"plan {plan} does not cover every attention layer above the cut; Mode A not run"}, {}
    from .lm_eval_models import ModeALM

    replay, sink = params.mode_a.replay, params.mode_a.sink
    lm = ModeALM(CEDModeARuntime(model, plan, geo, parts, replay=replay, sink=sink), tok,
                 block_tokens=params.eval_ppl.score_block_tokens)
    entry = {}
    if setting == "generate":
        log.info("Mode A: generation through the prefill skip, one problem at a time")
        entry, mode_a_pairs = evaluate_lm(lm, task_manager, params, "mode_a")
        if distributed.is_main() and mode_a_pairs != pairs:
            raise RuntimeError(f"lm-eval built different prompts for Mode A than {GOLD_PATH} holds")
    t0 = time.perf_counter()
    rows = mode_a_gold_rows(lm, pairs)
    log.info("Mode A gold NLL: %.1f s", time.perf_counter() - t0)
    return ({"covered": True, **entry, "replay": replay, "sink": sink, "note": mode_a_note(replay, sink)},
            {"mode_a": rows})


def run_protocol(params: Params, model, plan, n: int, lm_eval_version: str) -> dict:
    """``metrics/gsm8k.json``'s protocol: model, set, prompts, generation, dtype, device, lm-eval, plan."""
    cfg = params.eval_gsm8k
    return {
        "model": params.model.name, "math_set": params.data.math_label(), "n": n,
        "model_revision": params.model.revision, "math_revision": params.data.math.revision,
        **prompt_protocol(params), "fewshot_source": FEWSHOT_SOURCE if cfg.num_fewshot else None,
        "max_gen_toks": cfg.max_gen_toks, "generated_groups": list(cfg.generate), "mode_a": cfg.mode_a,
        "generation": ("greedy, each group through the cache that holds its bytes, a fresh one per lm-eval batch, "
                       "its used bytes checked against the accounting"),
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device), "lm_eval": lm_eval_version, "task": "lm-eval gsm8k.yaml on local data",
        "plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets)},
        "kv_format": params.kv_format,
    }


def mode_a_gold_rows(lm, pairs: list[tuple[list[int], int]]) -> torch.Tensor:
    """Summed NLL and token count of each gold answer given its prompt, through ``lm`` (a ``ModeALM``), ``(R, 2)``.

    One problem at a time; under a process group each rank takes a contiguous share of the
    problems and the rows are assembled on every rank.
    """
    lo, hi = distributed.bounds(len(pairs))
    answers = lm._loglikelihood_tokens([(None, ids[:c], ids[c:]) for ids, c in pairs[lo:hi]])
    rows = torch.tensor([[-ll, len(ids) - c] for (ll, _), (ids, c) in zip(answers, pairs[lo:hi])],
                        dtype=torch.float64).reshape(-1, 2)
    return distributed.assemble(rows, lo, len(pairs))


def count_problems(path: Path) -> int:
    """Number of problems in ``data/gsm8k.jsonl``, each line checked before lm-eval reads any.

    A clear error, naming the file and line, when the file is missing or empty, or a line is
    not UTF-8, not a JSON object, or lacks a ``question`` or ``answer`` string.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dvc repro prepare` first")
    n = 0
    for i, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        try:
            problem = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{i}: not a JSON object") from None
        bad = [k for k in ("question", "answer") if not isinstance(problem, dict) or not isinstance(problem.get(k), str)]
        if bad:
            raise ValueError(f"{path}:{i}: has no {' or '.join(repr(k) for k in bad)} string "
                             "(each line is a GSM8K problem: question and answer)")
        n += 1
    if n == 0:
        raise ValueError(f"{path} has no problems: rerun `dvc repro prepare`")
    return n


def write_gold_pairs(path: Path, params: Params, pairs: list[tuple[list[int], int]]) -> None:
    """Write the gold pairs with the settings they were built for (checked by :func:`load_gold_pairs`)."""
    write_json(path, {"model": params.model.name, "math_set": params.data.math_label(), **prompt_protocol(params),
                      "pairs": pairs})


def load_gold_pairs(path: Path, params: Params, n: int | None = None) -> list[tuple[list[int], int]]:
    """The gold pairs the ``gold_pairs`` stage wrote, checked against the current model, math set and prompt
    settings, and (given ``n``) against the number of problems of ``data/gsm8k.jsonl``."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `dvc repro gold_pairs` first")
    data = json.loads(path.read_text())
    want = {"model": params.model.name, "math_set": params.data.math_label(), **prompt_protocol(params)}
    got = {k: data.get(k) for k in want}
    if got != want:
        raise ValueError(f"{path} was written for {got}, but params.yaml has {want}; rerun `dvc repro gold_pairs`")
    if n is not None and len(data["pairs"]) != n:
        raise ValueError(f"{path} holds {len(data['pairs'])} gold pairs for a math set of {n} problems; "
                         "rerun `dvc repro gold_pairs`")
    return [(ids, cut) for ids, cut in data["pairs"]]

