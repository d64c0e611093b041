"""Data-parallel stages (torchrun, gloo, 2 CPU processes) give what one process gives, on the tiny profile.

Each stage runs from the same inputs with ``distributed.nproc: 1`` (its ``run()`` in the test's
process) and ``2`` (``python -m``: the stage starts torchrun itself) and the outputs are compared:
the dump exactly, the ridge statistics' float64 solutions to 1e-10 relative, one epoch of each
trainer to the tolerance of its autocast dtype (``conftest.rtol_for``), perplexities to 1e-6,
GSM8K's metrics (generated texts, exact match, gold NLL) exactly.  A 2-process dump killed
midway resumes to the uninterrupted file.  Each test runs the upstream stages it reads (one
process) unless an earlier test of the module already has, so that any of them runs alone.
``model.device_map: auto`` (one process, the model spread by accelerate) keeps the dump rows and
logits bit for bit (its refusal of ``nproc > 1``: ``tests/test_config.py``).

    torchrun --nproc-per-node 2 tests/test_distributed.py <workdir> <out.pt>   # the float64 ridge check
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import psutil
import pytest
import torch

# Not conftest's ROOT: torchrun also runs this file as a script, where conftest is not importable.
ROOT = Path(__file__).resolve().parents[2]

OVERRIDES = ["model=tiny_qwen3_5", "data=tiny", "plan=qwen3_5", "dump.batch_size=4", "train_projector.epochs=1",
             "train_adapters.epochs=1", "train_adapters.batch_size=512", "eval_ppl.groups=[baseline,ced,csa2]",
             "eval_ppl.batch_size=4", "mode_a.maps=main", "mode_a.sink=none"]  # Mode A with the main branch's maps: no tune_mode_a


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")


def stage(repo: Path, name: str, nproc: int) -> subprocess.CompletedProcess | None:
    """Stage ``name`` in ``repo`` with ``distributed.nproc: nproc``: ``python -m ced_csa2.stages.<name>`` (which
    starts torchrun itself), or for ``nproc`` 1, the reference, the stage's own ``run()`` in this process on one
    thread, as torchrun gives each process (the imports are paid once; returns ``None``)."""
    from faults_common import run_stage_here

    shutil.copy(repo / f"params{nproc}.yaml", repo / "params.yaml")
    if nproc == 1:
        run_stage_here(repo, name)
        return None
    proc = subprocess.run([sys.executable, "-m", f"ced_csa2.stages.{name}"], cwd=repo, env=env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{name} (nproc {nproc}) failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    from conftest import compose

    dst = tmp_path_factory.mktemp("dp")
    for n in (1, 2):
        (dst / f"params{n}.yaml").write_text(compose([*OVERRIDES, f"distributed.nproc={n}"]))
    stage(dst, "prepare", 1)
    return dst


def output(repo: Path, name: str) -> Path:
    """The file of stage ``name`` that the downstream stages here read."""
    from ced_csa2.config import load_params
    from ced_csa2.pipeline.paths import ADAPTERS_PATH, DUMP_PATH, RIDGE_PATH, projector_path

    return repo / {"dump": DUMP_PATH, "ridge": RIDGE_PATH, "train_adapters": ADAPTERS_PATH,
                   "train_projector": projector_path(load_params(repo / "params1.yaml").plan.source)}[name]


def built(repo: Path, *names: str) -> None:
    """Run each of the stages ``names`` (in this order, one process) whose output ``repo`` lacks."""
    for name in names:
        if not output(repo, name).exists():
            stage(repo, name, 1)


def keep(repo: Path, rel: str) -> Path:
    """A copy of ``repo/rel`` beside it (the single-process result), before the 2-process run replaces it."""
    dst = repo / "single" / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(repo / rel, dst)
    return dst


@pytest.mark.slow
def test_sharded_dump_holds_exactly_the_single_process_rows(repo):
    stage(repo, "dump", 1)
    single = keep(repo, "data/dump/dump.h5")
    stage(repo, "dump", 2)
    with h5py.File(single) as a, h5py.File(repo / "data/dump/dump.h5") as b:
        assert set(a) == set(b)
        for name in a:
            assert np.array_equal(a[name][:], b[name][:]), name
            assert np.array_equal(a[name].attrs["checksums"], b[name].attrs["checksums"]), name
        assert dict(a.attrs).keys() == dict(b.attrs).keys() and a.attrs["fingerprint"] == b.attrs["fingerprint"]
    assert not list((repo / "data").glob("*.partial.*"))  # shards merged and removed


def ridge_float64(workdir: Path, out: Path) -> None:
    """The float64 ridge solutions of the plan's maps on the train records, in as many processes as torchrun started."""
    from ced_csa2.config import DistributedConfig, load_params
    from ced_csa2.data.dump_file import DumpReader
    from ced_csa2.data.loader import aligned_block_rows, record_split, row_mask
    from ced_csa2.maps.ridge import accumulate, map_groups
    from ced_csa2.pipeline import distributed
    from ced_csa2.plan import LayerPlan

    params = load_params(workdir / "params.yaml")
    with distributed.session(DistributedConfig(nproc=distributed.launched_world(), backend="auto")):
        with DumpReader(workdir / "data/dump/dump.h5") as reader:
            train, _ = record_split(reader.n_records, params.split.val_fraction, params.seed)
            mask = row_mask(reader.record_offsets, train, 0, params.seed)
            groups = map_groups(LayerPlan.from_config(params.plan))
            # Small blocks, so that each rank gets several.
            accs = accumulate(reader, groups, mask, aligned_block_rows(reader, 1), None)
        if distributed.is_main():
            torch.save([acc.solve(params.ridge.lam) for acc in accs], out)


@pytest.mark.slow
def test_ridge_statistics_all_reduced_solve_as_one_process(repo):
    from faults_common import one_thread

    built(repo, "dump")
    with one_thread():  # one process: this one
        ridge_float64(repo, repo / "ridge64_1.pt")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           __file__, str(repo), str(repo / "ridge64_2.pt")], env=env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    one, two = (torch.load(repo / f"ridge64_{n}.pt") for n in (1, 2))
    for (W1, b1), (W2, b2) in zip(one, two):
        assert W1.dtype == torch.float64
        # float64 Gram sums in two shards vs one: ~n × eps64 ≈ 1e-12 relative after the solve
        assert float((W2 - W1).abs().max() / W1.abs().max()) <= 1e-10
        # float64 Gram sums in two shards vs one: ~n × eps64 ≈ 1e-12 relative after the solve
        assert float((b2 - b1).abs().max() / b1.abs().max()) <= 1e-10
    # The stage itself: its float32 maps agree to float32 rounding, and rank 0 alone wrote them.
    stage(repo, "ridge", 1)
    single = torch.load(keep(repo, "models/ridge.pt"))["maps"]
    stage(repo, "ridge", 2)
    maps = torch.load(repo / "models/ridge.pt")["maps"]
    assert single.keys() == maps.keys()
    for name in maps:
        for key in ("W", "b"):
            # float64 fits stored in float32: one float32 rounding (eps32/2 = 6e-8) apart at most plus the float64
            # differences above
            torch.testing.assert_close(maps[name][key], single[name][key], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("name, metrics", [("train_projector", "projector"), ("train_adapters", "adapters")])
def test_one_epoch_of_ddp_training_is_one_process_training(repo, name, metrics):
    from conftest import rtol_for, trainer_amp_dtype

    from ced_csa2.config import load_params

    built(repo, "dump", "ridge")  # train_adapters starts from the ridge maps
    params = load_params(repo / "params1.yaml")
    amp = trainer_amp_dtype(params)
    rtol = rtol_for(amp)
    path = output(repo, name).relative_to(repo).as_posix()
    stage(repo, name, 1)
    single, single_metrics = torch.load(keep(repo, path)), json.loads(keep(repo, f"metrics/{metrics}.json").read_text())
    stage(repo, name, 2)
    ddp, ddp_metrics = torch.load(repo / path), json.loads((repo / f"metrics/{metrics}.json").read_text())
    assert ddp_metrics["run"]["amp_dtype"] == single_metrics["run"]["amp_dtype"] == getattr(params, name).amp_dtype
    # The fp32 weights, through what was measured with them (held-out fit before and after the epoch) ...
    for layer, m in single_metrics["layers"].items():
        # atol for metrics near 0: ~1 eps32 of the O(1) quantities measured (rtol from rtol_for)
        np.testing.assert_allclose(flat(ddp_metrics["layers"][layer]), flat(m), rtol=rtol, atol=1e-7)
    # ... and the checkpoint's FP16 rounding of them: at most one FP16 ulp apart in float32.  Under
    # autocast a gradient rounded to its dtype can flip the projector's AdamW step on a weight near
    # zero (a step is ~lr whatever the gradient's size), so weights differ by a fraction of their
    # tensor's scale, not of their own size -- and never by less than one FP16 step where the
    # weights are FP16 subnormals (a zero-initialised MLP layer after one epoch): 2**-24.
    assert single["state"].keys() == ddp["state"].keys()
    for key, value in single["state"].items():
        want = value.float()
        # float32: ~8 eps32 of O(1) optimiser state for entries near 0 (rtol from rtol_for)
        atol = 1e-6 if amp == torch.float32 else max(rtol * float(want.abs().max()), 2.0 ** -24)
        torch.testing.assert_close(ddp["state"][key].float(), want, rtol=max(2 ** -10, rtol), atol=atol,
                                   msg=lambda detail: f"{name}: {key}: {detail}")


def flat(tree) -> list[float]:
    """The numbers of a metrics tree, in key order (strings skipped)."""
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in flat(tree[k])]
    return [float(tree)] if isinstance(tree, (int, float)) else []


@pytest.mark.slow
def test_distributed_perplexity_is_single_process_perplexity(repo):
    built(repo, "dump", "ridge", "train_projector", "train_adapters")
    stage(repo, "extra_projectors", 1)
    stage(repo, "eval_ppl", 1)
    single = json.loads(keep(repo, "metrics/ppl.json").read_text())
    stage(repo, "eval_ppl", 2)
    ddp = json.loads((repo / "metrics/ppl.json").read_text())
    assert single["groups"].keys() == ddp["groups"].keys()
    for group, v in single["groups"].items():
        assert ddp["groups"][group]["tokens"] == v["tokens"]
        # float64 NLL sums of float32 per-token terms: the shards only split the rows; a few eps32 per token,
        # relative <~ 1e-7
        assert abs(ddp["groups"][group]["ppl"] / v["ppl"] - 1) <= 1e-6, group
        for key in ("delta_pct_ci95", "kl_ci95"):
            if key in v:
                # float64 sums of float32 per-token terms, rows split across shards: a few eps32 relative
                np.testing.assert_allclose(ddp["groups"][group][key], v[key], rtol=1e-6, atol=1e-9)
    if single["mode_a"].get("covered"):
        # float64 NLL sums of float32 per-token terms: the shards only split the rows; a few eps32 per token,
        # relative <~ 1e-7
        assert abs(ddp["mode_a"]["mode_a"]["ppl"] / single["mode_a"]["mode_a"]["ppl"] - 1) <= 1e-6


# tiny_gemma3, not tiny_qwen3_5: the tiny Qwen3.5 (tied embeddings, random weights) greedily
# repeats the prompt's last token for every problem, which would make equal texts vacuous.
GSM8K_OVERRIDES = ["model=tiny_gemma3", "data=tiny", "plan=tiny_gemma3", "eval_gsm8k.groups=[baseline,ced_csa2]",
                   "eval_gsm8k.generate=[baseline,ced_csa2]", "eval_gsm8k.mode_a=generate",
                   "eval_gsm8k.max_gen_toks=16", "eval_gsm8k.batch_size=4", "mode_a.maps=main",
                   "mode_a.sink=none"]
GENERATE_BAR = re.compile(r"Running generate_until requests: 100%\|[^|\n]*\| (\d+)/\1 ")


def save_random_maps(workdir: Path, params) -> None:
    """Random maps of the plan (projector, extra projectors, adapters), saved as the stages save them."""
    from ced_csa2 import csa2, projector
    from ced_csa2.pipeline import paths
    from ced_csa2.pipeline.checkpoint import checkpoint_meta
    from ced_csa2.pipeline.map_roles import MAIN
    from ced_csa2.plan import load_plan

    plan, geo = load_plan(params.plan, params.model)
    meta = checkpoint_meta(params, plan, geo, params.model, params.plan, role=MAIN)
    torch.manual_seed(0)
    maps = {layer: projector.KVProjector(geo.hidden_size, geo.kv_dim) for layer in (plan.source, *plan.extra_sources)}
    projector.save_projector(paths.projector_path(plan.source, workdir / paths.MODELS), maps.pop(plan.source),
                             meta["projector"])
    projector.save_projectors(workdir / paths.PROJECTORS_EXTRA, maps, meta["projectors"])
    adapters = csa2.CSA2Adapters(plan.targets, geo.kv_dim)
    for p in adapters.parameters():  # the MLP's last layer starts at zero; make it count here
        torch.nn.init.normal_(p, std=0.05)
    csa2.save_adapters(workdir / paths.ADAPTERS_PATH, adapters, meta["adapters"])


def without_seconds(tree):
    """A metrics tree without its timings (``seconds``), the one thing two runs may differ in."""
    if isinstance(tree, dict):
        return {k: without_seconds(v) for k, v in tree.items() if k != "seconds"}
    return tree


@pytest.mark.slow
def test_distributed_gsm8k_is_single_process_gsm8k(tmp_path):
    """Two processes each generate half of the single-process batches; the metrics JSON is one process's.

    Mode B (baseline; ced_csa2 with random maps) and Mode A generation through lm-eval, gold
    NLL of both groups and Mode A: every generated text (``generations_sha256``), exact match
    and gold NLL equal, only the timings differ.  The 6 problems in batches of 4 give rank 0
    one batch of 4 (Mode B) and 3 of Mode A's 6 one-problem batches: what its progress bars
    count (rank 1 shows none).
    """
    from conftest import compose
    from faults_common import one_thread

    from ced_csa2.config import load_params
    from ced_csa2.pipeline.paths import GSM8K_METRICS
    from ced_csa2.stages import eval_gsm8k, gold_pairs, prepare

    for n in (1, 2):
        (tmp_path / f"params{n}.yaml").write_text(compose([*GSM8K_OVERRIDES, f"distributed.nproc={n}"]))
    params = load_params(tmp_path / "params1.yaml")
    prepare.run(params, tmp_path)
    gold_pairs.run(params, tmp_path)
    save_random_maps(tmp_path, params)
    with one_thread():  # the stage's own run(), in this process: the imports are paid once
        eval_gsm8k.run(params, tmp_path)
    single = json.loads((tmp_path / GSM8K_METRICS).read_text())
    two = stage(tmp_path, "eval_gsm8k", 2)
    ddp = json.loads((tmp_path / GSM8K_METRICS).read_text())

    assert without_seconds(ddp) == without_seconds(single)
    groups = single["groups"]
    assert groups["baseline"]["generations_sha256"] != groups["ced_csa2"]["generations_sha256"]
    assert single["mode_a"]["covered"] and "generations_sha256" in single["mode_a"]
    # tqdm may print a finished bar twice; rank 1 shows none; all 6 in one bar would be no sharding.
    assert {int(n) for n in GENERATE_BAR.findall(two.stderr)} == {3, 4}, "rank 0's share of the batches"


@pytest.mark.slow
def test_two_process_dump_killed_midway_resumes_to_the_uninterrupted_file(repo, tmp_path):
    """SIGKILL of the stage's own process (as tests/faults/test_faults_dump.py kills the 1-process dump) once both ranks are writing.

    The kill goes out when each rank has logged at least one committed batch of its shard
    and neither has finished.  It reaches torchrun and both workers (``relaunch``'s
    parent-death signal), the shards keep their complete batches, and the rerun resumes both
    and merges: the same datasets and attributes as an uninterrupted dump (of one process, which two
    processes match).
    """
    from faults_common import committed, dump_contents, wait_until

    from ced_csa2.pipeline.paths import DUMP_PATH

    ref, work = tmp_path / "ref", tmp_path / "work"
    for folder in (ref, work):
        shutil.copytree(repo / "data" / "corpus", folder / "data" / "corpus")
        for n in (1, 2):
            (folder / f"params{n}.yaml").write_text((repo / f"params{n}.yaml").read_text().replace(
                "  batch_size: 4\n  storage_dtype", "  batch_size: 1\n  storage_dtype"))
    stage(ref, "dump", 1)  # uninterrupted; one process writes what two do (the sharded dump's test above)

    shutil.copy(work / "params2.yaml", work / "params.yaml")
    log = tmp_path / "killed.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ced_csa2.stages.dump"], cwd=work, env=env(),
                                stdout=subprocess.DEVNULL, stderr=err)
    workers = []
    try:
        # Both shards (48 records, 24 a rank) hold a committed batch: a resume on each rank.
        def both_ranks(text):
            shards = committed(text)
            return shards if len(shards) == 2 else None

        progress = wait_until(proc, log, both_ranks, "a committed batch on both ranks")
        workers = psutil.Process(proc.pid).children(recursive=True)  # torchrun and its 2 workers
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, "finished before its kill point"
        assert all(n < total for n, total in progress.values()), f"a rank had finished its shard: {progress}"
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, f"torchrun or a worker outlived the killed stage: {alive}"
    finally:  # nothing of a failed run outlives the test
        for p in [*workers, *(psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else [])]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (work / DUMP_PATH).exists() and list((work / "data").glob("dump.partial.rank*"))

    rerun = stage(work, "dump", 2)
    done_before = [int(n) for n in re.findall(r"dumping \d+ records \((\d+) already done\)", rerun.stderr)]
    print(f"the rerun's ranks resumed after {done_before} records")
    assert len(done_before) == 2 and all(done_before), done_before
    assert dump_contents(work / DUMP_PATH) == dump_contents(ref / DUMP_PATH)
    assert sorted(p.relative_to(work).as_posix() for p in (work / "data").rglob("*") if p.is_file()) == [
        *(f"data/corpus/{name}.{ext}" for name in ("domains/reports_a", "domains/reports_b", "eval", "train")
          for ext in ("jsonl", "provenance.json")),  # the tiny profile's corpus, each file with its record
        "data/dump/dump.h5"]


def test_device_map_auto_keeps_dump_rows_and_logits(tmp_path, tiny_model):
    """A model spread by accelerate -- layers from 14 on offloaded to disk, hooks on every module -- computes the
    plain model's dump rows and, under the K/V-replacing runtime, its logits, bit for bit."""
    from conftest import tiny_params
    from faults_common import one_thread
    from test_ced_runtime import random_parts

    from ced_csa2.ced_runtime import CEDModeBRuntime
    from ced_csa2.data.dumping import forward_batch
    from ced_csa2.data.records import pad_batch
    from ced_csa2.model_utils import dispatch_auto, geometry, load_model_and_tokenizer
    from ced_csa2.plan import LayerPlan

    params = tiny_params()
    plain, tok = tiny_model
    auto, _ = load_model_and_tokenizer(tiny_params(model={"device_map": "auto"}).model)
    assert set(auto.hf_device_map.values()) == {"cpu"}  # no GPU here: all of it in CPU memory
    size = sum(p.numel() * p.element_size() for p in plain.parameters())
    spread = dispatch_auto(load_model_and_tokenizer(params.model)[0], max_memory={"cpu": size // 2},
                           offload_dir=tmp_path)
    assert {"cpu", "disk"} == set(spread.hf_device_map.values())
    # The source (20) and its readers on disk: their weights are read in at each forward by accelerate's hooks.
    assert spread.hf_device_map["model.layers.19"] == "disk" and spread.model.layers[19].self_attn.k_proj.weight.is_meta

    plan = LayerPlan.from_config(params.plan)
    rows = [tok(t)["input_ids"] for t in ("2 cats, 3 dogs.", "4 pens twice, then 3.")]
    x, mask = pad_batch(rows, tok.pad_token_id)
    parts = random_parts(geometry(plain.config), plan)
    with one_thread():  # 2 threads on 2 busy cores can take 10x as long
        reference = forward_batch(plain, plan, x, mask, "float32")
        for model in (auto, spread):
            got = forward_batch(model, plan, x, mask, "float32")
            assert reference.keys() == got.keys()
            assert all(np.array_equal(got[k], reference[k]) for k in reference)
        for group in ("baseline", "ced_csa2"):
            logits = []
            for model in (plain, spread):
                with torch.no_grad(), CEDModeBRuntime(model, plan, group, parts, kv_format=None):
                    logits.append(model(input_ids=x, attention_mask=mask).logits)
            assert torch.equal(*logits), group


def test_contiguous_shards_cover_every_item_once_in_order():
    from ced_csa2.pipeline.distributed import bounds

    for n in (0, 1, 5, 17):
        for world in (1, 2, 3):
            parts = [bounds(n, r, world) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


def test_nproc_must_match_the_processes_started(monkeypatch):
    from ced_csa2.config import DistributedConfig
    from ced_csa2.pipeline import distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="'distributed.nproc' is 2 but this stage runs in 1 process"):
        with distributed.session(DistributedConfig(nproc=2, backend="auto")):
            pass
    with distributed.session(DistributedConfig(nproc=1, backend="auto")):  # no process group at all
        assert distributed.world_size() == 1 and not torch.distributed.is_initialized()


def test_a_stage_that_is_not_data_parallel_refuses_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ced_csa2.stages.storage"], cwd=tmp_path,
                          env=env() | {"WORLD_SIZE": "2", "RANK": "1"}, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("error: stage storage is not data-parallel: run it as one process "
                                                    "(python -m ced_csa2.stages.storage), not under torchrun")


if __name__ == "__main__":
    ridge_float64(Path(sys.argv[1]), Path(sys.argv[2]))
