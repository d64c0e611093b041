"""docs/extending.md's recipe for a group from flags the code already has is complete: its edits alone add one.

On a copy of ``src/`` and ``conf/``, a throwaway group is added exactly as the recipe says -- one ``Group`` in
``groups.py``'s registry, its name in ``conf/config.yaml``'s ``eval_ppl.groups`` -- and nothing else is
touched.  A fresh interpreter on that copy then composes the tiny profile's params (config validation takes the
new name), runs the ``storage`` stage, scores the group in Mode B through the shared trunk and decodes through the
cache its flags pick, on the tiny Qwen3.5.
"""

import json
import os
import shutil
import subprocess
import sys

from conftest import ROOT, TINY_OVERRIDES

NEW = "share_plain_fp4"  # as csa2_fp4 is to csa2: share_plain with the one shared source entry in FP4
ROW = (f'    Group("{NEW}", False, True, False, "shared_source",\n'
       '          "as share_plain, the one shared source entry in FP4 (kv_format)"),\n')
SCORED = ("baseline", "share_plain", NEW, "csa2_fp4")

RUN = f"""
import json, sys
from pathlib import Path

import torch, yaml
sys.path.insert(0, {str(ROOT / "tests")!r})  # tiny_maps: random maps, and the shared pass checked against separate ones
from tiny_maps import QWEN_PLAN, check_exact

from ced_csa2.compose import compose
from ced_csa2.config import Params, from_dict
from ced_csa2.eval.generation import generate
from ced_csa2.model_utils import load_model_and_tokenizer
from ced_csa2.stages import storage

params = from_dict(Params, yaml.safe_load(compose({TINY_OVERRIDES!r})))
table = storage.run(params, Path(sys.argv[1]))
model, _ = load_model_and_tokenizer(params.model, dtype=torch.float32)
nll = check_exact(model, QWEN_PLAN, {SCORED!r})
prompts = torch.randint(model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
decoded = {{g: generate(model, QWEN_PLAN, g, None, prompts, 4, "nvfp4") for g in ({NEW!r}, "share_plain")}}
print(json.dumps({{"eval_ppl_groups": params.eval_ppl.groups, "storage": table,
                   "nll": {{g: nll[g][:, 0].tolist() for g in nll}},
                   "generation": {{g: {{"kind": d.kind, "used": d.bytes.used, "accounted": d.accounted}}
                                  for g, d in decoded.items()}}}}))
"""


def add_the_group(copy):
    """The recipe's two edits, on ``copy`` (a copy of ``src/`` and ``conf/``)."""
    groups = copy / "src" / "ced_csa2" / "groups.py"
    text = groups.read_text()
    assert text.count("\n)}\nGROUP_NAMES") == 1, "GROUPS no longer ends as this test expects"
    groups.write_text(text.replace("\n)}\nGROUP_NAMES", f"\n{ROW})}}\nGROUP_NAMES"))
    config = copy / "conf" / "config.yaml"
    text = config.read_text()
    head, tail = text.split("\neval_ppl:\n", 1)
    assert "xkv]" in tail, "eval_ppl.groups no longer ends with xkv"
    config.write_text(f"{head}\neval_ppl:\n{tail.replace('xkv]', f'xkv, {NEW}]', 1)}")


def test_a_group_added_by_the_recipe_is_accounted_scored_and_decoded(tmp_path):
    copy = tmp_path / "project"
    for folder in ("src", "conf"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    add_the_group(copy)
    proc = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "work")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(copy / "src")))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["eval_ppl_groups"][-1] == NEW

    storage = out["storage"]
    assert NEW in storage["groups"]
    for section in ("active_model", "qwen3_5_4b"):
        metrics = storage[section]
        for dtype, table in metrics["kv"].items():
            for basis in ("decoder_attention", "all_attention"):  # the entries csa2_fp4 stores: no adapters change that
                assert table[basis][NEW] == table[basis]["csa2_fp4"], (section, dtype, basis)
            for basis in (b for b in table if b.startswith("all_attention_amortised")):  # no weights, no sink entries
                assert table[basis][NEW]["bytes_per_token"] == table["all_attention"][NEW]["bytes_per_token"], basis
        assert metrics["weights"]["adapter_params"][NEW] == 0 < metrics["weights"]["adapter_params"]["csa2_fp4"]
        assert metrics["stored_layers"]["decoder_attention"][NEW] == metrics["stored_layers"]["decoder_attention"][
            "share_plain"]

    nll = out["nll"]  # each equal to its own separate pass, bit for bit (check_exact)
    assert nll[NEW] != nll["share_plain"], "the FP4 source entry changed nothing"
    assert nll[NEW] != nll["csa2_fp4"] and nll[NEW] != nll["baseline"]

    decoded = out["generation"]  # decoded through the cache its flags pick, its bytes the accounted ones
    assert decoded[NEW]["kind"] == "SharedKVCache(nvfp4)" and decoded["share_plain"]["kind"] == "SharedKVCache(bf16)"
    assert decoded[NEW]["used"] == decoded[NEW]["accounted"] < decoded["share_plain"]["used"]
