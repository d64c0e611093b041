"""Faults a user of the full profile (Qwen3.5-4B from the hub, on a GPU) meets, each driven here on the
tiny profile by the real fault where one can run on this machine: ``torch.OutOfMemoryError`` raised
inside a forward of the real tiny model, an offline hub cache missing the repository or the revision
or holding a download cut short, a local endpoint refusing as the hub refuses (gated, no such
repository, no such revision), a truncated ``.safetensors`` shard, a model folder of another
architecture, CUDA asked for without one.
Each ends in one ``error:`` line naming what to change, exit status 2, every earlier output
byte-identical.  (The disk filling mid-dump, and its resume, is in ``test_faults_dump.py``.)
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import TINY_GEMMA3_OVERRIDES, compose, tiny_params
from faults_common import (
    NO_CUDA,
    TINY_YAML,
    HubRefusals,
    edit,
    hub_cache_with,
    one_error_line,
    probe_hub,
    run_stage_here,
    run_stage_process,
    snapshot,
    stage_env,
)

from ced_csa2 import assets
from ced_csa2.config import DEVICE_KEYS, LocalModel, Params, ParamsError, from_dict, load_params, replaced
from ced_csa2.model_utils import ModelLoadError, build_tiny_model, load_model_and_tokenizer, tiny_tokenizer
from ced_csa2.pipeline.paths import DUMP_PARTIAL
from ced_csa2.pipeline.stage_runner import BATCH_PARAMS, run_stage
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import PlanError
from ced_csa2.stages import check_params

# ----------------------------------------------------------------------------- the GPU out of memory

# What torch says (its first two sentences; an allocator report of several lines follows).
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.\n"
            "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
OOM_SAYS = "the GPU ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)"
KEPT = "every output is its complete old file (none is left half-written)"


def stage_run_raising(stage: str, exc: BaseException):
    """A ``run(params, *args)`` of module ``ced_csa2.stages.<stage>`` that works a little, then raises ``exc``."""
    def run(params, *args):
        logging.getLogger(stage).info("batch 1 of 4")
        raise exc
    run.__module__ = f"ced_csa2.stages.{stage}"
    return run


# (stage, its argument, the params its line tells the user to lower): every stage that holds batches on the GPU
OOM_STAGES = [
    ("dump", (), "dump.batch_size"),
    ("ridge", (), "ridge.block_rows"),
    ("train_projector", (), "train_projector.batch_size"),
    ("extra_projectors", (), "train_projector.batch_size"),
    ("train_adapters", (), "train_adapters.batch_size"),
    ("tune", ("attn_out",), "train.online.batch_size or train.online.seq_len"),
    ("tune_mode_a", (), "train.online.batch_size or train.online.seq_len"),
    ("eval_ppl", (), "eval_ppl.batch_size"),
    ("eval_generation", (), "eval_generation.batch_size"),
    ("eval_retrieval", (), "eval_retrieval.batch_size"),
    ("eval_gsm8k", (), "eval_gsm8k.batch_size"),
    ("eval_objectives", (), "eval_gsm8k.batch_size"),
]


@pytest.mark.parametrize("stage,args,lower", OOM_STAGES, ids=[s for s, _, _ in OOM_STAGES])
def test_gpu_out_of_memory_names_the_stage_and_the_batch_param(in_tiny_folder, capsys, stage, args, lower):
    with pytest.raises(SystemExit) as end:
        run_stage(stage_run_raising(stage, torch.OutOfMemoryError(CUDA_OOM)), *args)
    assert end.value.code == 2
    name = f"{stage}@{args[0]}" if args else stage
    assert capsys.readouterr().err == (f"error: {name}: {OOM_SAYS}: lower {lower} in params.yaml and run it "
                                       f"again; {KEPT}\n")


def test_cuda_out_of_memory_error_is_the_same_one_line(in_tiny_folder, capsys):
    """``torch.cuda.OutOfMemoryError``, the name older code catches, is answered alike."""
    with pytest.raises(SystemExit) as end:
        run_stage(stage_run_raising("eval_ppl", torch.cuda.OutOfMemoryError(CUDA_OOM)))
    assert end.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: eval_ppl: {OOM_SAYS}: lower eval_ppl.batch_size in params.yaml")


def test_out_of_memory_in_a_stage_without_batch_params_says_what_else_to_do(in_tiny_folder, capsys):
    with pytest.raises(SystemExit) as end:
        run_stage(stage_run_raising("fit_xkv", torch.OutOfMemoryError(CUDA_OOM)))
    assert end.value.code == 2
    assert capsys.readouterr().err == (f"error: fit_xkv: {OOM_SAYS}: free the GPU's memory (another process may hold "
                                       f"it) or use a GPU with more; {KEPT}\n")


def test_gpu_out_of_memory_in_a_study_is_the_same_one_line(in_tiny_folder, capsys, monkeypatch):
    def main():
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(sys, "argv", [__file__])  # run_study parses the command line: pytest's own arguments are not it
    with pytest.raises(SystemExit) as end:
        run_study(main)
    assert end.value.code == 2
    assert capsys.readouterr().err == (f"error: test_faults_full_profile: {OOM_SAYS}: free the GPU's memory (another "
                                       f"process may hold it) or use a GPU with more; {KEPT}\n")


def test_every_batch_param_named_is_a_params_key():
    """A renamed key would send the user after a param that is not there."""
    for profile in (yaml.safe_load(compose()), yaml.safe_load(TINY_YAML)):
        for keys in BATCH_PARAMS.values():
            for key in keys:
                section = profile
                for part in key.split("."):
                    assert isinstance(section, dict) and part in section, f"{key} is not in params.yaml"
                    section = section[part]
                assert isinstance(section, int) and section > 0, key


# A forward hook on decoder layer 16 of the stage's own (real, tiny) model: the 2nd forward runs out
# of memory, after the dump committed its first batch.
OOM_IN_FORWARD = f"""
import torch
import ced_csa2.model_utils as model_utils
_build, _forwards = model_utils.build_tiny_model, [0]
def _out_of_memory(module, inputs, output):
    _forwards[0] += 1
    if _forwards[0] == 2:
        raise torch.OutOfMemoryError({CUDA_OOM!r})
def _build_running_out(*args, **kwargs):
    model = _build(*args, **kwargs)
    model_utils.decoder_layer(model, 16).register_forward_hook(_out_of_memory)
    return model
model_utils.build_tiny_model = _build_running_out
"""


@pytest.fixture(scope="module")
def prepared_workdir(tmp_path_factory):
    """A folder after a good ``prepare`` (tiny profile; a dump of 16 records): what ``dump`` reads."""
    workdir = tmp_path_factory.mktemp("prepared")
    (workdir / "params.yaml").write_text(TINY_YAML)
    edit("  device: auto\n  records: 128\n", "  device: auto\n  records: 16\n")(workdir)
    run_stage_here(workdir, "prepare")
    return workdir


def test_gpu_out_of_memory_mid_dump_is_one_line_and_the_rerun_resumes(prepared_workdir, tmp_path):
    workdir = tmp_path / "work"
    shutil.copytree(prepared_workdir, workdir)
    before = snapshot(workdir)

    line = one_error_line(run_stage_process(workdir, "dump", OOM_IN_FORWARD))

    assert line == (f"error: dump: {OOM_SAYS}: lower dump.batch_size in params.yaml and run it again; {KEPT}")
    after = snapshot(workdir)
    assert after.pop(str(DUMP_PARTIAL)) and after == before  # the corpus untouched; the batches done kept
    again = run_stage_process(workdir, "dump")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming" in again.stderr and "after 8 complete records" in again.stderr, again.stderr[-3000:]


# ----------------------------------------------------------------------------- the hub

@pytest.fixture(scope="module")
def saved_tiny_model(tmp_path_factory):
    """The tiny profile's model and tokenizer as ``save_pretrained`` writes them."""
    folder = tmp_path_factory.mktemp("saved") / "tiny"
    build_tiny_model(tiny_params().model.tiny, len(tiny_tokenizer())).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


OFFLINE_CASES = {  # id: (what is loaded, its hub id, revision)
    "cached": ("model", "org/tiny", None),
    "revision-not-cached": ("model", "org/tiny", "v2"),
    "commit-not-cached": ("model", "org/tiny", "b" * 40),
    "repository-not-cached": ("model", "org/absent", None),
    "download-cut-short": ("model", "org/partial", None),
    "wikitext-not-cached": ("wikitext", "Salesforce/wikitext", None),
    "gsm8k-revision-not-cached": ("gsm8k", "openai/gsm8k", "e53f048"),
}


@pytest.fixture(scope="module")
def offline_answers(tmp_path_factory, saved_tiny_model):
    """What loading each of :data:`OFFLINE_CASES` says with ``HF_HUB_OFFLINE=1`` (one subprocess), and the cache."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    hub_cache_with(hf_home, "org/tiny", saved_tiny_model)
    partial = hf_home / "hub" / "models--org--partial" / "blobs"
    partial.mkdir(parents=True)
    (partial / f"{'c' * 64}.incomplete").write_bytes(b"the first bytes of model.safetensors")  # a download killed
    answers = probe_hub(list(OFFLINE_CASES.values()), HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    return dict(zip(OFFLINE_CASES, answers)), hf_home / "hub"


OFFLINE = "the hub is offline (HF_HUB_OFFLINE=1)"
NOT_CACHED = (f"(it holds main) and {OFFLINE}: download it with network access, or set model.revision to one the "
              "cache holds")
OFFLINE_SAYS = {
    "revision-not-cached": f"org/tiny@v2: the hub cache {{hub}}/models--org--tiny holds no revision 'v2' {NOT_CACHED}",
    "commit-not-cached": f"org/tiny@{'b' * 40}: the hub cache {{hub}}/models--org--tiny holds no revision '{'b' * 40}' "
                         f"{NOT_CACHED}",
    "repository-not-cached": f"org/absent@main: the hub cache {{hub}} does not hold it and {OFFLINE}: download it once "
                             "with network access, or check the spelling of model.hf_id",
    "download-cut-short": "org/partial@main: its download was cut short (1 partial file(s) in {hub}/models--org--"
                          f"partial/blobs) and {OFFLINE}: run again with network access to finish it",
    "wikitext-not-cached": f"Salesforce/wikitext@main: the hub cache {{hub}} does not hold it and {OFFLINE}: download "
                           "it once with network access, or check the spelling of data.hub_id",
    "gsm8k-revision-not-cached": f"openai/gsm8k@e53f048: the hub cache {{hub}} does not hold it and {OFFLINE}: "
                                 "download it once with network access, or check the spelling of data.math.hub_id",
}
ERROR_TYPE = {"wikitext-not-cached": "HubDataError", "gsm8k-revision-not-cached": "HubDataError"}


def test_an_offline_hub_loads_what_its_cache_holds(offline_answers):
    assert offline_answers[0]["cached"] == "loaded"


@pytest.mark.parametrize("case", list(OFFLINE_SAYS))
def test_an_offline_hub_names_the_id_the_revision_and_what_to_do(offline_answers, case):
    answers, hub = offline_answers
    assert answers[case] == {"type": ERROR_TYPE.get(case, "ModelLoadError"),
                             "message": OFFLINE_SAYS[case].format(hub=hub)}


REFUSALS = {  # id: (model hf_id, revision, what the endpoint answers, the message)
    "gated": ("org/gated", None, (401, "GatedRepo"),
              "org/gated@main: the repository is gated: accept its terms at https://huggingface.co/org/gated, then log "
              "in (hf auth login, or HF_TOKEN)"),
    "no-such-repository": ("org/misspelt", None, (401, "RepoNotFound"),
                           "org/misspelt@main: the hub has no such repository (or it is private): check the spelling "
                           "of model.hf_id, or log in (hf auth login, or HF_TOKEN) for a private one"),
    "revision-deleted": ("org/tiny", "v1-deleted", (404, "RevisionNotFound"),
                         "org/tiny@v1-deleted: the repository has no revision 'v1-deleted' (deleted, or mistyped): set "
                         "model.revision to a commit, branch or tag it has"),
}


# A download the disk cannot hold: a config.json of 1 MB under a file-size limit of 64 KiB (RLIMIT_FSIZE:
# the write fails with EFBIG, as a full disk fails with ENOSPC).
FSIZE_LIMIT = "import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))\n"
LARGE_CONFIG = b'{"model_type": "qwen3"}' + b" " * 1_000_000
DISK_SAYS = ("org/large@main: writing the hub cache {hub} failed (File too large): free space there, or set HF_HOME to "
             "a folder on a disk with room that you can write, then run again")


@pytest.fixture(scope="module")
def online_answers(tmp_path_factory):
    """What loading each of :data:`REFUSALS`, then ``org/large``, says from an endpoint refusing (serving) it as the
    hub does (one subprocess, under :data:`FSIZE_LIMIT`), and the hub cache."""
    hub = HubRefusals({"org/large": LARGE_CONFIG, **{hf_id: answer for hf_id, _, answer, _ in REFUSALS.values()}})
    hf_home = tmp_path_factory.mktemp("hf_home_online")
    try:
        answers = probe_hub([*(("model", hf_id, revision) for hf_id, revision, _, _ in REFUSALS.values()),
                             ("model", "org/large", None)], FSIZE_LIMIT,
                            HF_HOME=str(hf_home), HF_ENDPOINT=hub.endpoint, HF_HUB_OFFLINE="0")
    finally:
        hub.close()
    return dict(zip([*REFUSALS, "disk-full"], answers)), hf_home / "hub"


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_hub_refusal_names_the_id_the_revision_and_what_to_do(online_answers, case):
    assert online_answers[0][case] == {"type": "ModelLoadError", "message": REFUSALS[case][3]}


def test_a_download_the_disk_cannot_hold_names_the_hub_cache(online_answers):
    answers, hub = online_answers
    assert answers["disk-full"] == {"type": "ModelLoadError", "message": DISK_SAYS.format(hub=hub)}
    assert not list(hub.glob("models--org--large/blobs/*"))  # no partial file stays in the cache


def test_a_hub_model_missing_offline_ends_the_stage_in_one_line_before_any_work(saved_tiny_model, tmp_path):
    """``check_params`` (what ``dvc repro`` runs first) reads the hub model's config: one line, exit 2."""
    (tmp_path / "params.yaml").write_text(TINY_YAML)
    edit("  kind: tiny\n  hf_id: null\n", "  kind: hub\n  hf_id: Qwen/Qwen3.5-4B\n")(tmp_path)
    before = snapshot(tmp_path)
    env = {**{k: v for k, v in stage_env().items() if not k.startswith("HF_")},
           "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "ced_csa2.stages.check_params"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600, check=False)

    assert one_error_line(done) == (f"error: Qwen/Qwen3.5-4B@main: the hub cache {tmp_path / 'hf_home' / 'hub'} does "
                                    f"not hold it and {OFFLINE}: download it once with network access, or check the "
                                    "spelling of model.hf_id")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- the model's files, the device

def test_a_truncated_safetensors_shard_is_refused_in_one_line(saved_tiny_model, tmp_path):
    """A shard cut short (a copy or download interrupted) whose digest was pinned as it was."""
    folder = tmp_path / "model"
    shutil.copytree(saved_tiny_model, folder)
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    cfg = replaced(tiny_params().model, kind="local", local=LocalModel(path=str(folder), sha256=assets.digest(folder)))
    with pytest.raises(ModelLoadError) as err:
        load_model_and_tokenizer(cfg)
    assert str(err.value) == ("model 'tiny_qwen3_5' (local): a .safetensors weights file is truncated or corrupt "
                              "(Error while deserializing header: incomplete metadata, file not fully covered): "
                              "copy or download the model again")


def test_a_model_folder_of_another_architecture_is_refused_by_the_plan(tmp_path):
    """A Gemma-3 folder where the Qwen3.5 profile's model should be: its plan's layers are not there, said by
    ``check_params`` from the folder's config, before any weight loads or any file is written."""
    gemma = from_dict(Params, yaml.safe_load(compose(TINY_GEMMA3_OVERRIDES))).model
    folder = tmp_path / "gemma"
    build_tiny_model(gemma.tiny, len(tiny_tokenizer())).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    params = tiny_params()
    params = dataclasses.replace(params, model=replaced(params.model, kind="local", local=LocalModel(
        path=str(folder), sha256=assets.digest(folder))))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(PlanError, match=r"^plan split layer 16 does not exist: the model has layers 1\.\.8$"):
        check_params.run(params, out)
    assert not list(out.iterdir())


# Each eval stage's device set to CUDA on a machine without it: refused when params.yaml loads, so by
# check_params before DVC runs a stage.
DEVICE_SECTIONS = {
    "eval_generation": ("  new_tokens: 32\n  batch_size: 32\n  device: auto\n",
                        "  new_tokens: 32\n  batch_size: 32\n  device: cuda\n"),
    "eval_retrieval": ("  digits: 5\n  batch_size: 8\n  device: auto\n",
                       "  digits: 5\n  batch_size: 8\n  device: cuda\n"),
    "eval_gsm8k": ("  batch_size: 16\n  device: auto\n", "  batch_size: 16\n  device: cuda\n"),
    "eval_ppl": ("  prefix_fraction: 0.5\n  device: auto\n", "  prefix_fraction: 0.5\n  device: cuda\n"),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("section", list(DEVICE_SECTIONS))
def test_cuda_asked_for_without_cuda_is_refused_when_params_load(tmp_path, section):
    (tmp_path / "params.yaml").write_text(TINY_YAML)
    edit(*DEVICE_SECTIONS[section])(tmp_path)
    with pytest.raises(ParamsError) as err:
        load_params(tmp_path / "params.yaml")
    assert str(err.value) == (f"{tmp_path / 'params.yaml'}: params key '{section}.device' is 'cuda' but {NO_CUDA} on "
                              "this machine (use 'auto' or 'cpu')")


def test_every_device_param_is_checked_against_the_machine():
    params = tiny_params()
    devices = {f"{section.name}.device" for section in dataclasses.fields(params)
               if dataclasses.is_dataclass(getattr(params, section.name))
               and "device" in {f.name for f in dataclasses.fields(getattr(params, section.name))}}
    assert devices == set(DEVICE_KEYS) == {f"{s}.device" for s in ("dump", *DEVICE_SECTIONS)}
