"""The tiny pipeline on a GPU in bf16: `dvc repro` with every model stage on cuda (skipped without CUDA)."""

import json
import math
import sys

import pytest
import torch
from conftest import AMP_OVERRIDES, project_copy, sh
from conftest import E2E_OVERRIDES as OVERRIDES

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# The full profile's settings on the tiny model: bf16 compute and dump storage, the model stages on cuda
# (the trainers take cuda when there is one; their autocast is bf16 there).
CUDA = ["model.dtype=bfloat16", "dump.storage_dtype=bfloat16", "dump.device=cuda", "eval_ppl.device=cuda",
        "eval_gsm8k.device=cuda"]


def read(repo, rel: str) -> dict:
    return json.loads((repo / rel).read_text())


def test_tiny_pipeline_runs_on_cuda_in_bf16(tmp_path):
    repo = project_copy(tmp_path)
    sh(repo, sys.executable, "-m", "ced_csa2.compose", *OVERRIDES, *CUDA, *AMP_OVERRIDES)
    sh(repo, "dvc", "repro")
    dump = read(repo, "metrics/dump.json")
    assert dump["device"].startswith("cuda") and (dump["compute_dtype"], dump["storage_dtype"]) == ("bfloat16",) * 2
    for rel in ("metrics/projector.json", "metrics/adapters.json"):
        assert read(repo, rel)["run"]["device"] == "cuda", rel
    ppl, gsm = read(repo, "metrics/ppl.json"), read(repo, "metrics/gsm8k.json")
    for protocol in (ppl["protocol"], gsm["protocol"], read(repo, "metrics/objectives/attn_out/train.json")["protocol"],
                     read(repo, "metrics/objectives/eval.json")["protocol"]):
        assert protocol["device"].startswith("cuda") and protocol["dtype"] == "bfloat16", protocol
    assert all(math.isfinite(g["ppl"]) for g in ppl["groups"].values())
    assert all(math.isfinite(g["gold_nll"]["nll_per_token"]) for g in gsm["groups"].values())
    assert (repo / "reports/results.md").is_file()
