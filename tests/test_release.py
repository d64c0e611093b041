"""The release (issue 64): written from real map files, loaded in a new process it scores what models/ scores, bit for
bit; a changed file, another base model, another plan are refused in one line naming the file, before any module is
built; the card's front matter is YAML, its tables are Markdown, and every number in it is the metrics files'."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from conftest import ROOT, tiny_params
from torch import nn

from ced_csa2 import release as rel
from ced_csa2.ced_runtime import CEDParts, SinkKV, save_parts
from ced_csa2.config import to_dict
from ced_csa2.csa2 import CSA2Adapters, save_adapters
from ced_csa2.eval.model_card import model_card, read_groups_tsv
from ced_csa2.model_utils import build_tiny_model, load_model_and_tokenizer
from ced_csa2.pipeline import paths
from ced_csa2.pipeline.atomic_files import read_json, write_json
from ced_csa2.pipeline.checkpoint import checkpoint_meta
from ced_csa2.pipeline.map_roles import MAIN, MODE_A
from ced_csa2.plan import LayerPlan, load_plan
from ced_csa2.projector import KVProjector, ProjectorBank, save_projector
from ced_csa2.stages import release as release_stage
from ced_csa2.stages import storage

PARAMS = tiny_params()  # mode_a: trained maps through a bank, sink mean
PLAN, GEO = load_plan(PARAMS.plan, PARAMS.model)
GROUPS = ["baseline", "ced", "csa2", "ced_csa2"]
SEQS = [[5, 17, 33, 2, 90, 41, 7, 66, 12, 3, 8, 120], [9, 4, 77, 31, 2, 50, 18, 6, 44, 21]]  # the tiny eval set
# The card's protocol lines, as the eval stages record them (those files are DVC-cached: not in a clone).
PROTOCOLS = {
    paths.PPL_METRICS: {"protocol": {"model": "tiny_qwen3_5", "dtype": "float32", "device": "cpu", "records": 32,
                                     "data": "tiny", "domain": "tiny", "tokens_scored": 13836},
                        "domains": {"code": {}, "math": {}}},
    paths.GSM8K_METRICS: {"protocol": {"label": "GSM8K-100", "n": 100, "num_fewshot": 0}},
    paths.GENERATION_METRICS: {"protocol": {"prompts": 32, "prompt_tokens": 63, "new_tokens": 32}},
    paths.RETRIEVAL_METRICS: {"protocol": {"records": 8, "length": 1024}},
}


def write_maps(workdir):
    """Random maps of the tiny plan, saved as train_projector, train_adapters and tune_mode_a save theirs."""
    torch.manual_seed(0)
    main = checkpoint_meta(PARAMS, PLAN, GEO, PARAMS.model, PARAMS.plan, role=MAIN)
    mode_a = checkpoint_meta(PARAMS, PLAN, GEO, PARAMS.model, PARAMS.plan, PARAMS.mode_a, role=MODE_A)

    def adapters():
        a = CSA2Adapters(PLAN.targets, GEO.kv_dim)
        for p in a.parameters():  # the MLP's last layer starts at zero; make it count
            nn.init.normal_(p, std=0.05)
        return a

    save_projector(workdir / paths.projector_path(PLAN.source), KVProjector(GEO.hidden_size, GEO.kv_dim),
                   main["projector"])
    save_adapters(workdir / paths.ADAPTERS_PATH, adapters(), main["adapters"])
    bank = ProjectorBank(GEO.hidden_size, GEO.kv_dim, PLAN.projected, 8)
    parts = CEDParts(adapters=adapters(), bank=bank, sink=SinkKV(PLAN.kv_layers, GEO.kv_dim))
    nn.init.normal_(parts.sink.k), nn.init.normal_(parts.sink.v)
    save_parts(workdir / paths.MODE_A_MODELS, parts, PLAN, mode_a)


def write_metrics(workdir):
    """The committed headline (metrics/summary.json, groups.tsv: in git), the tiny storage table, the protocols."""
    (workdir / "metrics").mkdir(parents=True, exist_ok=True)
    for name in (paths.SUMMARY, paths.GROUPS_TABLE):
        shutil.copy(ROOT / name, workdir / name)
    storage.run(PARAMS, workdir)
    for path, content in PROTOCOLS.items():
        write_json(workdir / path, content)


@pytest.fixture(scope="module")
def released(tmp_path_factory, tiny_model):
    workdir = tmp_path_factory.mktemp("run")
    write_maps(workdir)
    write_metrics(workdir)
    config = release_stage.run(PARAMS, workdir, model=tiny_model[0])
    return workdir, config


SCORE = textwrap.dedent("""
    import json, sys
    from ced_csa2.config import Params, from_dict
    from ced_csa2.eval.perplexity import groups_ppl, mode_a_prefix
    from ced_csa2.model_utils import geometry, load_model_and_tokenizer
    from ced_csa2.release import base_model_config, load_release, load_release_mode_a, release_plan
    {load}
    params = from_dict(Params, json.loads(sys.argv[1]))
    seqs = json.loads(sys.argv[2])
    model, tok = load_model_and_tokenizer(base_model_config(sys.argv[3]) if sys.argv[3] else params.model)
    geo = geometry(model.config)
    parts, mode_a, plan = load(sys.argv[3], params, model, geo)
    out = {{"groups": groups_ppl(model, plan, {groups}, parts, seqs, params, tok.pad_token_id),
           "mode_a": mode_a_prefix(model, plan, geo, mode_a, seqs, 0.5, params.seed, timing_records=None,
                                   sink=params.mode_a.sink)}}
    print(json.dumps(out))
""")
FROM_RELEASE = textwrap.dedent("""
    def load(folder, params, model, geo):
        return load_release(folder, model), load_release_mode_a(folder, model)[0], release_plan(folder)
""")
FROM_MODELS = textwrap.dedent("""
    from pathlib import Path
    from ced_csa2.ced_runtime import load_mode_a_parts, load_parts
    from ced_csa2.pipeline.map_roles import MAIN
    from ced_csa2.plan import load_plan

    def load(workdir, params, model, geo):
        plan, _ = load_plan(params.plan, params.model)
        return (load_parts(Path(WORKDIR) / "models", params, plan, geo, role=MAIN, extra_sources=False),
                load_mode_a_parts(WORKDIR, params, plan, geo), plan)
""")


def score_in_new_process(script: str, folder: str, workdir) -> dict:
    done = subprocess.run([sys.executable, "-c", script, json.dumps(to_dict(PARAMS)), json.dumps(SEQS), folder],
                          capture_output=True, text=True, cwd=workdir,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_release_loaded_in_a_new_process_scores_what_models_scores_bit_for_bit(released):
    workdir, _ = released
    from_release = score_in_new_process(SCORE.format(load=FROM_RELEASE, groups=GROUPS), str(workdir / "release"),
                                        workdir)
    from_models = score_in_new_process(SCORE.format(load=FROM_MODELS.replace("WORKDIR", repr(str(workdir))),
                                                    groups=GROUPS), "", workdir)
    # The release stores the pipeline's own FP16 values and both build float32 modules: equal, not close.
    assert from_release == from_models
    assert from_release["groups"]["ced_csa2"]["ppl"] != from_release["groups"]["baseline"]["ppl"]  # the maps count


def test_the_release_holds_fp16_safetensors_with_their_metadata_and_a_manifest(released):
    workdir, config = released
    folder = workdir / "release"
    manifest = read_json(folder / rel.MANIFEST)
    assert sorted(manifest["files"]) == sorted(
        ["README.md", "config.json", "projector_k20v20.safetensors", "mode_a/projector_bank.safetensors",
         "mode_a/sink.safetensors", *(f"{p}adapters/layer{t}.safetensors" for p in ("", "mode_a/")
                                      for t in PLAN.targets)])
    from safetensors import safe_open

    with safe_open(str(folder / "adapters/layer28.safetensors"), framework="pt") as f:
        header = f.metadata()
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
        assert sorted({k.split(".")[1] for k in f.keys()}) == ["28"]
    assert json.loads(header["role"]) == {"branch": "main", "pair": None} and json.loads(header["layers"]) == [28]
    assert json.loads(header["plan"]) == rel.plan_record(PLAN) and header["dtype"] == "float16"
    assert json.loads(header["base_model"])["fingerprint"] == config["base_model"]["fingerprint"]
    assert "provenance" in json.loads(header["meta"])  # the params as applied
    assert config["maps"]["mode_a"]["sink"] == "mode_a/sink.safetensors"


def refused(call, monkeypatch) -> str:
    built = []
    monkeypatch.setattr(rel, "_fill", lambda path, *a, **k: built.append(path))
    with pytest.raises(rel.ReleaseError) as err:
        call()
    assert built == []  # refused before any module was built
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_changed_file_is_refused_naming_it(released, tmp_path, tiny_model, monkeypatch):
    folder = shutil.copytree(released[0] / "release", tmp_path / "release")
    target = folder / "adapters" / "layer24.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 1
    target.write_bytes(bytes(data))
    message = refused(lambda: rel.load_release(folder, tiny_model[0]), monkeypatch)
    assert message.startswith(f"{target}: sha256 is ") and "changed after the release was written" in message
    (folder / "extra.safetensors").write_bytes(b"x")
    target.unlink()
    assert refused(lambda: rel.load_release(folder, tiny_model[0]), monkeypatch).startswith(f"{target}: listed in")


def test_another_base_model_is_refused(released, tiny_model, monkeypatch):
    folder = released[0] / "release"
    other = build_tiny_model(dataclasses.replace(PARAMS.model.tiny, seed=1), len(tiny_model[1]))  # same geometry
    message = refused(lambda: rel.load_release(folder, other), monkeypatch)
    assert message.startswith(f"{folder / 'config.json'}: the model given is not the base model")
    wider = build_tiny_model(dataclasses.replace(PARAMS.model.tiny, hidden_size=32), len(tiny_model[1]))
    assert "hidden_size = 64" in refused(lambda: rel.load_release_mode_a(folder, wider), monkeypatch)


def test_another_plan_is_refused(released, tiny_model, monkeypatch):
    folder = released[0] / "release"
    message = refused(lambda: rel.load_release(folder, tiny_model[0], plan=LayerPlan(16, 20, (24, 28))), monkeypatch)
    assert message.startswith(f"{folder / 'config.json'}: the release's maps are for plan ")


def test_the_same_weights_in_bfloat16_pass_the_base_model_check(released):
    model, _ = load_model_and_tokenizer(PARAMS.model, dtype=torch.bfloat16)
    rel.load_release(released[0] / "release", model)


# ----------------------------------------------------------------------------- the card

def card_metrics(workdir) -> dict:
    protocols = {key: read_json(workdir / path) for key, path in
                 (("ppl", paths.PPL_METRICS), ("gsm8k", paths.GSM8K_METRICS),
                  ("generation", paths.GENERATION_METRICS), ("retrieval", paths.RETRIEVAL_METRICS))}
    return {"summary": read_json(workdir / paths.SUMMARY),
            "groups": read_groups_tsv((workdir / paths.GROUPS_TABLE).read_text()),
            "storage": read_json(workdir / paths.STORAGE_METRICS),
            **{k: v["protocol"] for k, v in protocols.items()}, "domains": sorted(protocols["ppl"]["domains"])}


def split_card(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    matter, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(matter), body


def test_the_card_is_regenerated_from_the_metrics_and_renders(released):
    workdir, config = released
    folder = workdir / "release"
    card = (folder / rel.CARD).read_text()
    manifest = read_json(folder / rel.MANIFEST)
    manifest["files"].pop(rel.CARD)  # the card lists the files written before it
    assert model_card(read_json(folder / rel.CONFIG), manifest, card_metrics(workdir)) == card
    matter, body = split_card(card)
    assert matter["license"] == "apache-2.0" and matter["library_name"] == "ced_csa2"
    assert matter["tags"] and matter["datasets"] == ["tiny", "tiny-math"]
    assert "NOT a Qwen3.5-4B result" in body
    tables = re.findall(r"((?:^\|.*\|\n)+)", body, re.M)
    assert len(tables) == 2
    for table in tables:
        rows = [r for r in table.splitlines()]
        widths = {len(re.findall(r"(?<!\\)\|", r)) for r in rows}
        assert len(widths) == 1, table  # every row as many cells as the header
        assert re.fullmatch(r"\|(?:-+:?\|)+", rows[1])


NUMBER = re.compile(r"(?<![\w.\-/])([+\-−]?\d[\d,]*(?:\.\d+)?)(?![\w.]*\w)")
STATED = {95.0}  # the intervals' level, a protocol constant, not a measured number


def flat_numbers(obj) -> list[float]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in flat_numbers(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in flat_numbers(v)]
    return []


def test_every_number_in_the_card_is_a_value_of_the_metrics_files_or_the_release(released):
    workdir, _ = released
    folder = workdir / "release"
    _, body = split_card((folder / rel.CARD).read_text())
    body = re.sub(r"```.*?```", "", body, flags=re.S)  # the usage snippet
    body = re.sub(r"`[^`]*`", "", body)  # file names, digests, ids
    known = set(flat_numbers([card_metrics(workdir), read_json(folder / rel.CONFIG),
                              read_json(folder / rel.MANIFEST)])) | STATED
    found = NUMBER.findall(body)
    assert len(found) > 100
    for text in found:
        value = float(text.replace(",", "").replace("−", "-"))
        decimals = len(text.split(".")[1]) if "." in text else 0
        half = 0.5 * 10 ** -decimals * (1 + 1e-9)
        assert any(abs(value - v) <= half for v in known), text


def test_a_safetensors_file_is_the_same_bytes_in_every_process():
    """safetensors orders its header from a per-process hash map; the release's files must not change with it."""
    code = ("import hashlib, sys, torch; from ced_csa2.release import safetensors_bytes; "
            "b = safetensors_bytes({'w': torch.arange(6.).view(2, 3), 'b': torch.ones(3)}, "
            "{k: k * 3 for k in 'abcdefghij'}); sys.stdout.write(hashlib.sha256(b).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
               for _ in range(4)}
    assert len(digests) == 1
    from safetensors.torch import load

    from ced_csa2.release import safetensors_bytes
    raw = safetensors_bytes({"w": torch.arange(6.).view(2, 3)}, {"é": "ü", "a": "b"})
    assert torch.equal(load(raw)["w"], torch.arange(6.).view(2, 3))
    n = int.from_bytes(raw[:8], "little")
    assert json.loads(raw[8:8 + n])["__metadata__"] == {"a": "b", "é": "ü"}


def test_the_card_says_which_maps_each_row_reads_from_the_group_s_flags():
    from ced_csa2.eval.model_card import reads
    from ced_csa2.groups import GROUPS

    assert reads("mode_a") == "mode_a/" and reads("baseline") == "–" and reads("share_plain") == "–"
    assert reads("ced_sink") == "projector" and reads("csa2_fp4_rot") == "adapters"
    assert reads("ced_csa2_sink") == "projector + adapters"
    for name, spec in GROUPS.items():
        assert ("projector" in reads(name)) == spec.projected_source and ("adapters" in reads(name)) == spec.adapters


def test_a_hub_id_needs_a_pinned_revision_and_a_reachable_hub(released, tiny_model, tmp_path):
    """``release_folder``: a local folder as is (no revision); a hub id only with a revision; an offline hub (this
    machine has none) one ReleaseError naming the id and revision, nothing loaded."""
    folder = released[0] / "release"
    assert rel.release_folder(folder) == folder
    with pytest.raises(rel.ReleaseError, match="a local release folder has no revision"):
        rel.load_release(folder, tiny_model[0], revision="main")
    with pytest.raises(rel.ReleaseError, match=r"^someone/maps: a hub id needs revision=<commit>"):
        rel.load_release("someone/maps", tiny_model[0])
    with pytest.raises(rel.ReleaseError, match="no such release folder, and not a hub id"):
        rel.release_folder(tmp_path / "missing" / "deeper")
    code = ("import sys; from ced_csa2 import release as rel\n"
            "try:\n    rel.release_folder('someone/maps', revision='0123abc')\n"
            "except rel.ReleaseError as e:\n    print(e); sys.exit(3)\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("someone/maps@0123abc: the release could not be downloaded (")
    assert len(done.stdout.strip().splitlines()) == 1


def test_a_missing_map_file_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    """``models/missing.pt`` looks like ``owner/name``: the loaders say the file is missing, not that a hub id needs a
    revision; an ``owner/name`` without a checkpoint suffix, or with a revision, is still a hub id."""
    from ced_csa2.csa2 import load_adapters
    from ced_csa2.pipeline.checkpoint import CheckpointError
    from ced_csa2.projector import load_projector

    monkeypatch.chdir(tmp_path)
    for load, kind in ((load_projector, "projector"), (load_adapters, "adapters")):
        with pytest.raises(CheckpointError, match=rf"^models/missing.pt: {kind} checkpoint not found"):
            load("models/missing.pt", role=None)
    assert not rel.is_release("models/missing.pt") and rel.is_release("models/missing.pt", revision="0123abc")
    assert rel.is_release("Qwen/Qwen3.5-4B") and rel.is_release(tmp_path)
    (tmp_path / "file.pt").write_bytes(b"")
    assert not rel.is_release(tmp_path / "file.pt")


def test_the_seed_s_loaders_take_the_release_folder(released, tiny_model, monkeypatch, tmp_path):
    """``load_projector`` / ``load_adapters`` on a release folder give ``load_release``'s modules, after its checks:
    a wrong role or metadata is refused naming the file, a changed file by the manifest."""
    from ced_csa2.csa2 import load_adapters
    from ced_csa2.pipeline.map_roles import MAIN, MODE_A
    from ced_csa2.projector import load_projector

    folder = released[0] / "release"
    parts = rel.load_release(folder, tiny_model[0])
    projector, meta = load_projector(folder, role=MAIN, expect={"layer": meta_layer(folder)})
    adapters = load_adapters(folder, role=MAIN)
    for got, want in ((projector, parts.projector), (adapters, parts.adapters)):
        assert got.state_dict().keys() == want.state_dict().keys()
        assert all(torch.equal(got.state_dict()[k], want.state_dict()[k]) for k in got.state_dict())
    assert meta["role"] == MAIN.as_meta()
    with pytest.raises(rel.ReleaseError, match=r"projector_k\d+v\d+\.safetensors: holds the projector of role"):
        load_projector(folder, role=MODE_A)
    with pytest.raises(rel.ReleaseError, match=r"\.safetensors: kv_dim = \d+, expected 7$"):
        load_adapters(folder, role=MAIN, expect={"kv_dim": 7})
    changed = shutil.copytree(folder, tmp_path / "release")
    target = next(changed.glob("projector_*.safetensors"))
    target.write_bytes(target.read_bytes()[:-1] + bytes([target.read_bytes()[-1] ^ 1]))
    with pytest.raises(rel.ReleaseError, match="changed after the release was written"):
        load_projector(changed, role=MAIN)


def meta_layer(folder) -> int:
    """The projector's layer as the release's config.json records its plan (the source)."""
    return json.loads((folder / "config.json").read_text())["plan"]["source"]
