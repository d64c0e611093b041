"""The ``release`` stage: the maps the headline uses, as a folder a user can load and publish (issue 64).

    python -m ced_csa2.stages.release       # what `dvc repro release` runs

Reads the map files the headline's groups run with -- ``models/projector_k{s}v{s}.pt`` and
``models/adapters.pt`` (``ced``, ``csa2``, ``ced_csa2`` and their FP4 twins), Mode A's (``models/mode_a/``
under ``mode_a.maps: trained``, else the main maps and ``models/projectors_extra.pt``; the sink under
``mode_a.sink: mean``) -- each through the pipeline's own checks (role, tensors' sha256, model, layers, geometry,
plan, and the params as applied: :func:`ced_csa2.pipeline.checkpoint.load_checkpoint`,
:func:`~ced_csa2.pipeline.checkpoint.check_meta_provenance`), and the metrics the card quotes.  Writes
``release/`` (:mod:`ced_csa2.release`): each map file's FP16 state as safetensors with its metadata in the
header, ``config.json``, the model card ``README.md`` (:mod:`ced_csa2.eval.model_card`) and ``manifest.json``.
Before the folder replaces the previous one, it is loaded back (:func:`ced_csa2.release.load_release`, with
every check) and each module compared with what :func:`ced_csa2.ced_runtime.load_parts` builds from
``models/``: equal tensors, or the stage fails.  No params of its own: it reads ``model``, ``plan`` and
``mode_a`` (which files; the params the files record are checked, not read).  The model is loaded for the
base-model fingerprint only (seconds on the embedded default).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import release as rel
from ..ced_runtime import BANK_FILE, SINK_KIND, load_mode_a_parts, load_parts
from ..config import Params
from ..csa2 import KIND as ADAPTERS_KIND
from ..eval.model_card import model_card, read_groups_tsv
from ..model_utils import load_model_and_tokenizer
from ..pipeline.atomic_files import atomic_write_bytes, atomic_write_text, read_json
from ..pipeline.checkpoint import SAVE_DTYPE, check_meta_provenance, expected_meta, load_checkpoint, state_digest
from ..pipeline.map_roles import MAIN, MODE_A, Role
from ..pipeline.paths import (ADAPTERS_PATH, GENERATION_METRICS, GROUPS_TABLE, GSM8K_METRICS, MODE_A_MODELS,
                              MODE_A_SINK, MODELS, PPL_METRICS, PROJECTORS_EXTRA, RETRIEVAL_METRICS, STORAGE_METRICS,
                              SUMMARY, projector_path)
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import load_plan
from ..projector import KIND as PROJECTOR_KIND
from ..projector import KIND_BANK, KIND_MANY

log = logging.getLogger(__name__)

# format tag -> the key of expected_meta() its files are checked against
EXPECT_KEY = {PROJECTOR_KIND: "projector", KIND_MANY: "projectors", ADAPTERS_KIND: "adapters", KIND_BANK: "bank",
              SINK_KIND: "sink"}
WHY_FP16 = ("the pipeline writes every map file in FP16 (the seed's format) and its loaders widen them to float32 "
            "exactly, so these files hold the very values the pipeline scored with, bit for bit, at half the bytes "
            "of float32; `load_release` builds float32 modules by default, as `load_parts` does.")


def components(params: Params, plan, with_mode_a: bool) -> dict[str, dict[str, tuple[Path, str, Role]]]:
    """``{"main" | "mode_a": {slot: (source .pt, format tag, role)}}``: the files each part of the headline reads."""
    main = {"projector": (projector_path(plan.source), PROJECTOR_KIND, MAIN), "adapters": (ADAPTERS_PATH, ADAPTERS_KIND, MAIN)}
    out = {"main": main}
    if not with_mode_a:
        return out
    if params.mode_a.maps == "main":
        mode_a = dict(main)
        if plan.extra_sources:
            mode_a["projectors_extra"] = (PROJECTORS_EXTRA, KIND_MANY, MAIN)
    elif params.mode_a.train.rank > 0:
        mode_a = {"projector_bank": (MODE_A_MODELS / BANK_FILE, KIND_BANK, MODE_A),
                  "adapters": (MODE_A_MODELS / ADAPTERS_PATH.name, ADAPTERS_KIND, MODE_A)}
    else:
        mode_a = {"projector": (projector_path(plan.source, MODE_A_MODELS), PROJECTOR_KIND, MODE_A),
                  "adapters": (MODE_A_MODELS / ADAPTERS_PATH.name, ADAPTERS_KIND, MODE_A)}
        if plan.extra_sources:
            mode_a["projectors_extra"] = (MODE_A_MODELS / PROJECTORS_EXTRA.name, KIND_MANY, MODE_A)
    if params.mode_a.sink == "mean":
        mode_a["sink"] = (MODE_A_SINK, SINK_KIND, MODE_A)
    out["mode_a"] = mode_a
    return out


def release_name(source: Path, role: Role) -> str:
    """Where a source ``.pt`` goes in the release: ``mode_a/`` for Mode A's branch, the stem as ``.safetensors``."""
    return ("mode_a/" if role == MODE_A else "") + source.with_suffix(".safetensors").name


def _datasets(params: Params) -> list[str]:
    data = params.data
    return [d for d in (data.hub_id or data.name, data.math.hub_id or data.math.label) if d]


def _metrics(workdir: Path, names) -> dict:
    out = {}
    for key, path in names.items():
        out[key] = read_json(workdir / path) if (workdir / path).is_file() else {}
    return out


def build(params: Params, workdir: Path, model) -> tuple[dict[str, bytes], dict]:
    """Every file of the release but the card and the manifest (``{relpath: bytes}``) and ``config.json``'s dict."""
    plan, geo = load_plan(params.plan, params.model)
    summary = read_json(workdir / SUMMARY)
    base = rel.base_model_record(params.model, model, plan)
    expect = expected_meta(params, plan, geo)
    files: dict[str, bytes] = {}
    described: dict[str, dict] = {}
    maps: dict[str, dict] = {}
    done: dict[Path, str | dict[str, str]] = {}
    for part, slots in components(params, plan, "mode_a" in summary).items():
        maps[part] = {}
        for slot, (source, kind, role) in slots.items():
            path = workdir / source
            if source not in done:
                state, meta = load_checkpoint(path, kind, expect[EXPECT_KEY[kind]], role=role)
                check_meta_provenance(source, meta, params, role)
                digest = state_digest(state)
                record = {"kind": kind, "role": meta["role"], "source": source.as_posix(),
                          "params_hash": meta["params_hash"], "params": meta["provenance"]}
                if kind == ADAPTERS_KIND:  # one file per target
                    per = {}
                    for t, sub in rel.adapters_by_target(state, meta["layers"]).items():
                        name = ("mode_a/" if role == MODE_A else "") + f"adapters/layer{t}.safetensors"
                        files[name] = rel.safetensors_bytes(sub, rel.header(kind, meta, [t], base, source.as_posix(),
                                                                            digest))
                        described[name] = {**record, "layers": [t]}
                        per[str(t)] = name
                    done[source] = per
                else:
                    name = release_name(source, role)
                    layers = meta.get("layers") or [meta["layer"]]
                    files[name] = rel.safetensors_bytes(state, rel.header(kind, meta, layers, base, source.as_posix(),
                                                                          digest))
                    described[name] = {**record, "layers": layers}
                    done[source] = name
            maps[part][slot] = done[source]
    config = {"format": rel.FORMAT, "format_version": rel.FORMAT_VERSION, "base_model": base,
              "geometry": rel.geometry_record(geo), "plan": rel.plan_record(plan),
              "dtype": {"stored": str(SAVE_DTYPE).removeprefix("torch."), "compute": params.model.dtype,
                        "why": WHY_FP16},
              "kv_format": params.kv_format, "maps": maps, "files": described,
              "mode_a": {"maps": params.mode_a.maps, "sink": params.mode_a.sink, "replay": params.mode_a.replay},
              "datasets": _datasets(params)}
    return files, config


def check_round_trip(folder: Path, params: Params, workdir: Path, model, with_mode_a: bool) -> None:
    """The release, loaded with every check, gives the modules ``load_parts`` builds from ``models/``, tensor for tensor."""
    plan, geo = load_plan(params.plan, params.model)
    pairs = [(rel.load_release(folder, model), load_parts(workdir / MODELS, params, plan, geo, role=MAIN,
                                                          extra_sources=False), "main")]
    if with_mode_a:
        pairs.append((rel.load_release_mode_a(folder, model)[0], load_mode_a_parts(workdir, params, plan, geo), "mode_a"))
    for got, want, part in pairs:
        for slot in ("projector", "adapters", "bank", "sink"):
            a, b = getattr(got, slot), getattr(want, slot)
            if (a is None) != (b is None):
                raise ValueError(f"{folder}: the release's {part} {slot} is {a is not None}, models/ has {b is not None}")
            if a is not None:
                sa, sb = a.state_dict(), b.state_dict()
                if sa.keys() != sb.keys() or any(not torch.equal(sa[k], sb[k]) for k in sa):
                    raise ValueError(f"{folder}: the release's {part} {slot} differs from what load_parts builds")
        if set(got.extra) != set(want.extra) or any(
                any(not torch.equal(x, y) for x, y in zip(got.extra[k].state_dict().values(),
                                                           want.extra[k].state_dict().values())) for k in got.extra):
            raise ValueError(f"{folder}: the release's {part} extra projectors differ from models/'")


def run(params: Params, workdir: Path = Path("."), *, model=None) -> dict:
    """Write ``release/`` under ``workdir`` (see the module doc); returns ``config.json``'s dict."""
    workdir = Path(workdir)
    if model is None:
        model, _ = load_model_and_tokenizer(params.model)
    files, config = build(params, workdir, model)
    summary = read_json(workdir / SUMMARY)
    metrics = _metrics(workdir, {"storage": STORAGE_METRICS, "ppl": PPL_METRICS, "gsm8k": GSM8K_METRICS,
                                 "generation": GENERATION_METRICS, "retrieval": RETRIEVAL_METRICS})
    card_metrics = {"summary": summary, "groups": read_groups_tsv((workdir / GROUPS_TABLE).read_text(encoding="utf-8")),
                    "storage": metrics["storage"], "ppl": metrics["ppl"].get("protocol", {}),
                    "gsm8k": metrics["gsm8k"].get("protocol", {}),
                    "generation": metrics["generation"].get("protocol", {}),
                    "retrieval": metrics["retrieval"].get("protocol", {}),
                    "domains": sorted(metrics["ppl"].get("domains", {}))}
    out = workdir / rel.RELEASE
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        files[rel.CONFIG] = (json_text(config)).encode()
        manifest = {"format": rel.FORMAT, "files": {}}
        for name, data in sorted(files.items()):
            atomic_write_bytes(tmp / name, data)
        manifest["files"] = {name: {"sha256": rel.file_sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
                             for name in sorted(files)}
        card = model_card(config, manifest, card_metrics)
        atomic_write_text(tmp / rel.CARD, card)
        manifest["files"][rel.CARD] = {"sha256": rel.file_sha256(tmp / rel.CARD),
                                       "bytes": (tmp / rel.CARD).stat().st_size}
        atomic_write_text(tmp / rel.MANIFEST, json_text(manifest))
        check_round_trip(tmp, params, workdir, model, "mode_a" in config["maps"])
        old = out.with_name(f".{out.name}.old{os.getpid()}")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    for name, f in manifest["files"].items():
        log.info("release/%s: %s bytes", name, f"{f['bytes']:,}")
    return config


def json_text(obj) -> str:
    import json

    return json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
