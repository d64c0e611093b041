"""Data-parallel stages (torchrun, gloo, 2 CPU processes) give what one process gives, on the tiny profile.

Each stage runs from the same inputs with ``distributed.nproc: 1`` and ``2`` (the stage starts
torchrun itself) and the outputs are compared: the dump exactly, the ridge statistics' float64
solutions to 1e-10 relative, one epoch of each trainer to fp32 tolerance, perplexities to 1e-6.

    torchrun --nproc-per-node 2 tests/test_distributed.py <workdir> <out.pt>   # the float64 ridge check
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["model=tiny_qwen3_5", "data=tiny", "plan=qwen3_5", "dump.batch_size=4", "train_projector.epochs=1",
             "train_adapters.epochs=1", "train_adapters.batch_size=512", "eval_ppl.groups=[baseline,ced,csa2]",
             "eval_ppl.batch_size=4"]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")


def stage(repo: Path, name: str, nproc: int) -> None:
    """``python -m ced_csa2.stages.<name>`` in ``repo`` with ``distributed.nproc: nproc``."""
    shutil.copy(repo / f"params{nproc}.yaml", repo / "params.yaml")
    proc = subprocess.run([sys.executable, "-m", f"ced_csa2.stages.{name}"], cwd=repo, env=env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{name} (nproc {nproc}) failed:\n{proc.stdout}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    from ced_csa2.compose import compose

    dst = tmp_path_factory.mktemp("dp")
    for n in (1, 2):
        (dst / f"params{n}.yaml").write_text(compose([*OVERRIDES, f"distributed.nproc={n}"]))
    stage(dst, "prepare", 1)
    return dst


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
    from ced_csa2 import distributed
    from ced_csa2.config import DistributedConfig, load_params
    from ced_csa2.h5store import DumpReader
    from ced_csa2.loader import aligned_block_rows, record_split, row_mask
    from ced_csa2.plan import LayerPlan
    from ced_csa2.ridge import accumulate, map_groups

    params = load_params(workdir / "params.yaml")
    with distributed.session(DistributedConfig(nproc=distributed.launched_world())):
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
    for n in (1, 2):
        launch = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={n}"]
        proc = subprocess.run([*launch, __file__, str(repo), str(repo / f"ridge64_{n}.pt")], env=env(),
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-5000:]
    one, two = (torch.load(repo / f"ridge64_{n}.pt") for n in (1, 2))
    for (W1, b1), (W2, b2) in zip(one, two):
        assert W1.dtype == torch.float64
        assert float((W2 - W1).abs().max() / W1.abs().max()) <= 1e-10
        assert float((b2 - b1).abs().max() / b1.abs().max()) <= 1e-10
    # The stage itself: its float32 maps agree to float32 rounding, and rank 0 alone wrote them.
    stage(repo, "ridge", 1)
    single = torch.load(keep(repo, "models/ridge.pt"))["maps"]
    stage(repo, "ridge", 2)
    maps = torch.load(repo / "models/ridge.pt")["maps"]
    assert single.keys() == maps.keys()
    for name in maps:
        for key in ("W", "b"):
            torch.testing.assert_close(maps[name][key], single[name][key], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("name, metrics", [("train_projector", "projector"), ("train_adapters", "adapters")])
def test_one_epoch_of_ddp_training_is_one_process_training(repo, name, metrics):
    import json

    from ced_csa2.config import load_params
    from ced_csa2.paths import ADAPTERS_PATH, projector_path

    path = str(projector_path(load_params(repo / "params1.yaml").plan.source) if name == "train_projector"
               else ADAPTERS_PATH)
    stage(repo, name, 1)
    single, single_metrics = torch.load(keep(repo, path)), json.loads(keep(repo, f"metrics/{metrics}.json").read_text())
    stage(repo, name, 2)
    ddp, ddp_metrics = torch.load(repo / path), json.loads((repo / f"metrics/{metrics}.json").read_text())
    # The fp32 weights, through what was measured with them (held-out fit before and after the epoch) ...
    for layer, m in single_metrics["layers"].items():
        np.testing.assert_allclose(flat(ddp_metrics["layers"][layer]), flat(m), rtol=1e-5, atol=1e-7)
    # ... and the checkpoint's FP16 rounding of them (at most one FP16 ulp apart).
    assert single["state"].keys() == ddp["state"].keys()
    for key, value in single["state"].items():
        torch.testing.assert_close(ddp["state"][key].float(), value.float(), rtol=2 ** -10, atol=1e-6,
                                   msg=f"{name}: {key}")


def flat(tree) -> list[float]:
    """The numbers of a metrics tree, in key order (strings skipped)."""
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in flat(tree[k])]
    return [float(tree)] if isinstance(tree, (int, float)) else []


@pytest.mark.slow
def test_distributed_perplexity_is_single_process_perplexity(repo):
    import json

    stage(repo, "extra_projectors", 1)
    stage(repo, "eval_ppl", 1)
    single = json.loads(keep(repo, "metrics/ppl.json").read_text())
    stage(repo, "eval_ppl", 2)
    ddp = json.loads((repo / "metrics/ppl.json").read_text())
    assert single["groups"].keys() == ddp["groups"].keys()
    for group, v in single["groups"].items():
        assert ddp["groups"][group]["tokens"] == v["tokens"]
        assert abs(ddp["groups"][group]["ppl"] / v["ppl"] - 1) <= 1e-6, group
        for key in ("delta_pct_ci95", "kl_ci95"):
            if key in v:
                np.testing.assert_allclose(ddp["groups"][group][key], v[key], rtol=1e-6, atol=1e-9)
    if single["mode_a"].get("covered"):
        assert abs(ddp["mode_a"]["mode_a"]["ppl"] / single["mode_a"]["mode_a"]["ppl"] - 1) <= 1e-6


def test_contiguous_shards_cover_every_item_once_in_order():
    from ced_csa2.distributed import bounds

    for n in (0, 1, 5, 17):
        for world in (1, 2, 3):
            parts = [bounds(n, r, world) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


def test_nproc_must_match_the_processes_started(monkeypatch):
    from ced_csa2 import distributed
    from ced_csa2.config import DistributedConfig

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="'distributed.nproc' is 2 but this stage runs in 1 process"):
        with distributed.session(DistributedConfig(nproc=2)):
            pass
    with distributed.session(DistributedConfig(nproc=1)):  # no process group at all
        assert distributed.world_size() == 1 and not torch.distributed.is_initialized()


def test_a_stage_that_is_not_data_parallel_refuses_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ced_csa2.stages.storage"], cwd=tmp_path,
                          env=env() | {"WORLD_SIZE": "2", "RANK": "1"}, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("error: stage storage is not data-parallel: run it as one process "
                                                    "(python -m ced_csa2.stages.storage), not under torchrun")


if __name__ == "__main__":
    ridge_float64(Path(sys.argv[1]), Path(sys.argv[2]))
