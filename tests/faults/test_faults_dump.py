"""The dump under faults: corrupted bytes and non-finite values refused by its consumers
naming file, dataset and rows; NaN, a full disk and a size limit while dumping; the writer
in process; ``dump`` and ``train_projector`` SIGKILLed at observed points resume to the
uninterrupted bytes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from faults_common import (
    INTERRUPTED_LINE,
    TINY_YAML,
    committed,
    dump_contents,
    edit,
    flip_bytes,
    one_error_line,
    run_stage_here,
    run_stage_process,
    sha,
    snapshot,
    stage_env,
    wait_until,
    write,
)

from ced_csa2.data.dump_file import BlockCrc, DumpError, DumpLayout, DumpReader, DumpWriter
from ced_csa2.pipeline.paths import (
    ADAPTERS_METRICS,
    ADAPTERS_PATH,
    DUMP_METRICS,
    DUMP_PARTIAL,
    DUMP_PATH,
    PROJECTOR_CURVES,
    PROJECTOR_METRICS,
    PROJECTORS_EXTRA,
    RIDGE_PATH,
    projector_path,
)

# ----------------------------------------------------------------------------- dump integrity and I/O faults

DUMP, PARTIAL = str(DUMP_PATH), str(DUMP_PARTIAL)
DUMP_PRIOR = {  # stand-ins for the trainers' earlier good outputs
    projector_path(20): b"prior projector", PROJECTORS_EXTRA: b"prior extra projectors",
    ADAPTERS_PATH: b"prior adapters", PROJECTOR_METRICS: b'{"prior": true}\n', ADAPTERS_METRICS: b'{"prior": true}\n',
}


@pytest.fixture(scope="module")
def dumped_workdir(tmp_path_factory) -> Path:
    """A folder after good ``prepare``, ``dump`` and ``ridge`` runs (tiny profile), plus trainer stand-ins."""
    workdir = tmp_path_factory.mktemp("dumped")
    (workdir / "params.yaml").write_text(TINY_YAML)
    for stage in ("prepare", "dump", "ridge"):
        run_stage_here(workdir, stage)
    for rel, content in DUMP_PRIOR.items():
        write(str(rel), content)(workdir)
    with h5py.File(workdir / DUMP_PATH, "r") as f:  # the geometry the cases below rely on
        assert f.attrs["checksum_rows"] == 4096 and f["h_split"].chunks[0] == 2048 and f["k_24"].shape == (4601, 32)
    return workdir


def nan_with_valid_checksum(name: str, row: int):
    """A NaN written into the dump with its block's checksum recomputed: only the finiteness check can see it."""
    def apply(workdir: Path) -> None:
        with h5py.File(workdir / DUMP_PATH, "r+") as f:
            ds, block = f[name], int(f.attrs["checksum_rows"])
            data = ds[row:row + 1]
            data[0, 3] = np.nan
            ds[row:row + 1] = data
            covered, crcs = BlockCrc.decode(ds.attrs["checksums"])
            j = row // block
            crcs = crcs.copy()
            crcs[j] = zlib.crc32(np.ascontiguousarray(ds[j * block:min((j + 1) * block, covered)]))
            ds.attrs["checksums"] = np.array([covered, *crcs], dtype=np.uint64)
    return apply


def h5_edit(fn):
    def apply(workdir: Path) -> None:
        with h5py.File(workdir / DUMP_PATH, "r+") as f:
            fn(f)
    return apply


def truncate_to(rel: str, fraction: float):
    def apply(workdir: Path) -> None:
        path = workdir / rel
        path.write_bytes(path.read_bytes()[:int(path.stat().st_size * fraction)])
    return apply


def nothing(workdir: Path) -> None:
    pass


def fsize_limit(nbytes: int) -> str:
    """A file-size limit (RLIMIT_FSIZE): a write past it fails with EFBIG, as a full disk fails with ENOSPC."""
    return f"import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, ({nbytes}, {nbytes}))"


# h5py writes 9 datasets + input_ids + record_offsets per append: fail from the 2nd write of the 4th append on.
ENOSPC_PRELUDE = f"""
import errno, h5py
_setitem, _calls = h5py.Dataset.__setitem__, [0]
def _full_disk(self, key, value):
    _calls[0] += 1
    if _calls[0] >= {3 * 11 + 2}:
        raise OSError(errno.ENOSPC, "No space left on device")
    return _setitem(self, key, value)
h5py.Dataset.__setitem__ = _full_disk
"""
NAN_PRELUDE = """
import numpy as np
import ced_csa2.data.dumping as _dump
_forward, _calls = _dump.forward_batch, [0]
def _forward_nan(*args, **kwargs):
    out = _forward(*args, **kwargs)
    _calls[0] += 1
    if _calls[0] == 2:  # the second batch of 8 records: row 5 of record 8
        out["k_24"][5, 3] = np.nan
    return out
_dump.forward_batch = _forward_nan
"""


def row_of_record_8(workdir: Path) -> str:
    with h5py.File(workdir / DUMP_PATH, "r") as f:
        row = int(f["record_offsets"][8]) + 5
    return f"rows [{row}, {row + 1})"


# (id, stage, fault applied to a copy of dumped_workdir, prelude run before the stage, pieces of the one error line)
DUMP_CASES = [
    # bytes corrupted inside the dump: each consumer names the file, the dataset and the rows
    ("k24-bytes-flipped", "ridge", flip_bytes("k_24", 0), "",
     [DUMP, "dataset 'k_24' rows [0, 4096) fail their crc32 checksum", "dvc checkout -f"]),
    ("h_split-bytes-flipped", "train_projector", flip_bytes("h_split", 2), "",
     [DUMP, "dataset 'h_split' rows [4096, 4601) fail their crc32 checksum"]),
    ("v28-bytes-flipped", "train_adapters", flip_bytes("v_28", 0), "",
     [DUMP, "dataset 'v_28' rows [0, 4096) fail their crc32 checksum"]),
    ("input-ids-flipped", "ridge", flip_bytes("input_ids", 0), "",
     [DUMP, "dataset 'input_ids' rows [0, 4096) fail their crc32 checksum"]),
    ("record-offsets-flipped", "train_projector", flip_bytes("record_offsets", 0, at=8, n=16), "",
     [DUMP, "dataset 'record_offsets' rows [0, 49) fail their crc32 checksum"]),
    ("nan-with-valid-checksum", "ridge", nan_with_valid_checksum("v_28", 123), "",
     [DUMP, "dataset 'v_28' holds non-finite values (NaN/Inf) at rows [123, 124)"]),
    ("checksums-stripped", "train_adapters", h5_edit(lambda f: f["k_20"].attrs.__delitem__("checksums")), "",
     [DUMP, "dataset 'k_20' has no readable 'checksums' attribute"]),
    ("format-1-dump", "ridge", h5_edit(lambda f: f.attrs.__setitem__("format_version", 1)), "",
     [DUMP, "format_version 1, expected 2"]),
    ("dump-truncated", "ridge", truncate_to(DUMP, 0.5), "", [DUMP, "not a readable HDF5 file"]),
    # faults while writing: one line, prior outputs kept, and a clean resume
    ("nan-at-dump-time", "dump", nothing, NAN_PRELUDE,
     [DUMP, "refusing to write non-finite values (NaN/Inf) to dataset 'k_24'", row_of_record_8, "(records 8..8)",
      f"the partial dump {PARTIAL} was removed"]),
    ("enospc-in-dump", "dump", nothing, ENOSPC_PRELUDE,
     [DUMP, f"writing {PARTIAL} failed: [Errno 28] No space left on device", "keeps 24 complete records"]),
    ("fsize-limit-in-dump", "dump", nothing, fsize_limit(6_000_000),
     [DUMP, f"writing {PARTIAL} failed: [Errno 27] File too large"]),
    ("fsize-limit-at-checkpoint", "ridge", nothing, fsize_limit(4096),
     ["[Errno 27] File too large", f"'{RIDGE_PATH}'"]),
]


@pytest.mark.parametrize("case,stage,fault,prelude,expected", DUMP_CASES, ids=[c[0] for c in DUMP_CASES])
def test_dump_fault_is_one_line_exit_2_and_loses_nothing(dumped_workdir, tmp_path, caplog, case, stage, fault,
                                                        prelude, expected):
    workdir = tmp_path / "work"
    shutil.copytree(dumped_workdir, workdir)
    fault(workdir)
    before = snapshot(workdir)

    line = one_error_line(run_stage_process(workdir, stage, prelude))

    for piece in expected:
        piece = piece(dumped_workdir) if callable(piece) else piece
        assert piece in line, f"{piece!r} not in {line!r}"
    after = snapshot(workdir)
    kept = after.pop(PARTIAL, None)  # a partial dump that still opens is kept for the resume
    assert after == before  # prior outputs byte-identical, nothing new, no temp file
    assert (kept is not None) == ("keeps" in line), line
    if stage == "dump":  # the next run (fault gone) resumes or starts over and ends with the same datasets
        caplog.set_level("INFO")
        run_stage_here(workdir, "dump")
        assert ("resuming" in caplog.text) == (kept is not None), caplog.text[-3000:]
        assert dump_contents(workdir / DUMP_PATH) == dump_contents(dumped_workdir / DUMP_PATH)
        assert not (workdir / DUMP_PARTIAL).exists()


FUZZ = r"""
import sys, shutil, numpy as np
from ced_csa2.data.dump_file import DumpError, DumpReader
good_path, offsets = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
def contents(path):
    with DumpReader(path) as r:
        r.verify()
        return {name: r.rows(name, 0, r.n_tokens).tobytes() for name in r.layout.widths()} | {
            "input_ids": r.f["input_ids"][:].tobytes(), "record_offsets": r.record_offsets.tobytes()}
good = contents(good_path)
for offset in offsets:
    shutil.copy(good_path, "fuzz.h5")
    with open("fuzz.h5", "r+b") as f:
        f.seek(offset); data = f.read(16); f.seek(offset); f.write(bytes(b ^ 0x5A for b in data))
    try:
        print(offset, "same" if contents("fuzz.h5") == good else "DIFFERENT", flush=True)
    except DumpError as exc:
        print(offset, "refused", str(exc).split(":")[1][:60], flush=True)
    except Exception as exc:
        print(offset, "OTHER", type(exc).__name__, str(exc)[:200], flush=True)
"""


def test_any_corrupted_byte_region_is_refused_or_harmless(dumped_workdir, tmp_path):
    """16 bytes inverted anywhere (metadata every 256 B of the first 4 KiB, then 48 seeded offsets): the reader
    refuses the file with a DumpError or reads exactly the good data (unused chunk space) -- never other data,
    never another exception, never a crash (a subprocess, so a segfault would show as its exit status)."""
    size = (dumped_workdir / DUMP_PATH).stat().st_size
    offsets = [*range(0, 4096, 256), *sorted(np.random.default_rng(16).integers(4096, size - 16, 48).tolist())]
    done = subprocess.run([sys.executable, "-c", FUZZ, str(dumped_workdir / DUMP_PATH), ",".join(map(str, offsets))],
                          cwd=tmp_path, env=stage_env(), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = [line.split(" ", 2) for line in done.stdout.splitlines()]
    assert len(outcomes) == len(offsets), done.stdout
    assert all(o[1] in ("refused", "same") for o in outcomes), done.stdout
    assert sum(o[1] == "refused" for o in outcomes) >= len(offsets) // 2, done.stdout  # most bytes matter


# ----------------------------------------------------------------------------- the dump writer, in process

LAYOUT = DumpLayout(hidden_size=8, kv_dim=4, kv_layers=(1,))


def batches(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        lengths = [int(x) for x in rng.integers(5, 40, 3)]
        rows = sum(lengths)
        arrays = {"h_split": rng.standard_normal((rows, 8), dtype=np.float32),
                  "k_1": rng.standard_normal((rows, 4), dtype=np.float32),
                  "v_1": rng.standard_normal((rows, 4), dtype=np.float32)}
        yield arrays, rng.integers(0, 100, rows).astype(np.int32), lengths


def writer(tmp_path: Path, name: str, storage_dtype: str = "float32") -> DumpWriter:
    layout = dataclasses.replace(LAYOUT, storage_dtype=storage_dtype)
    return DumpWriter(tmp_path / name / "dump.h5", tmp_path / name / "dump.partial.h5", layout, chunk_kib=1,
                      attrs={"fingerprint": "f"})


@pytest.fixture
def reference_dump(tmp_path) -> dict:
    w = writer(tmp_path, "ref")
    for batch in batches(8):
        w.append(*batch)
    return dump_contents(w.finalize())


def test_resume_after_a_kill_between_checksums_and_record_count(tmp_path, reference_dump):
    """The checksums of a batch are written before ``n_records``: a kill in between leaves them covering rows
    that the resume drops; the block those rows fall in is recomputed and the end result is the same file."""
    w = writer(tmp_path, "run")
    assert w.block == 64  # 64 rows: several batches per block, so the partial block is exercised
    for batch in list(batches(8))[:5]:
        w.append(*batch)
    w.f.attrs["n_records"] = 12  # as if killed after the 5th batch's checksums, before its record count
    w.close()
    w = writer(tmp_path, "run")
    assert w.n_records == 12
    for batch in list(batches(8))[4:]:
        w.append(*batch)
    assert dump_contents(w.finalize()) == reference_dump


def test_a_partial_dump_that_fails_its_checksums_is_started_over(tmp_path, reference_dump, caplog):
    w = writer(tmp_path, "run")
    for batch in list(batches(8))[:5]:
        w.append(*batch)
    w.f["h_split"][3, 0] += 1.0  # bytes changed on disk behind the writer's back
    w.close()
    caplog.set_level("WARNING")
    w = writer(tmp_path, "run")
    assert w.n_records == 0 and "fails its checksums" in caplog.text and "'h_split' rows [0, 64)" in caplog.text
    for batch in batches(8):
        w.append(*batch)
    assert dump_contents(w.finalize()) == reference_dump


@pytest.mark.parametrize("storage_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_rows_are_refused_before_anything_is_written(tmp_path, storage_dtype, bad):
    w = writer(tmp_path, "run", storage_dtype)
    first, second = list(batches(2))
    to_disk = {"float32": lambda a: a, "float16": lambda a: a.astype(np.float16),
               "bfloat16": lambda a: (a.view(np.uint32) >> 16).astype(np.uint16)}[storage_dtype]
    w.append({k: to_disk(v) for k, v in first[0].items()}, *first[1:])
    arrays = {k: v.copy() for k, v in second[0].items()}
    arrays["v_1"][7, 2] = bad
    start, record = sum(first[2]), 3 + int(np.searchsorted(np.cumsum(second[2]), 7, side="right"))
    with pytest.raises(DumpError) as err:
        w.append({k: to_disk(v) for k, v in arrays.items()}, *second[1:])
    assert (f"refusing to write non-finite values (NaN/Inf) to dataset 'v_1' at rows [{start + 7}, {start + 8}) "
            f"(records {record}..{record})") in str(err.value), str(err.value)
    assert not w.partial_path.exists() and w.f is None  # nothing written, nothing left


def test_reader_verifies_each_block_once_and_names_the_rows(tmp_path):
    w = writer(tmp_path, "run")
    for batch in batches(8):
        w.append(*batch)
    path = w.finalize()
    with DumpReader(path) as r:
        assert r.checksum_rows == r.block_rows == 64 and not r._verified["k_1"].any()
        r.rows("k_1", 70, 75)  # an unaligned read verifies the whole block it falls in
        assert r._verified["k_1"].tolist()[:2] == [False, True]
        r.verify()
        assert all(v.all() for v in r._verified.values())
    with h5py.File(path, "r+") as f:
        f["v_1"][65, 0] = 1.0e3  # changed without updating the checksum
    with DumpReader(path) as r:
        r.rows("v_1", 0, 64)  # the first block is intact
        with pytest.raises(DumpError, match=r"dataset 'v_1' rows \[64, 128\) fail their crc32 checksum"):
            r.rows("v_1", 64, 128)
    with DumpReader(path, verify=False) as r:  # the benchmarks' switch: corrupt bytes get through
        assert r.rows("v_1", 65, 66)[0, 0] == 1.0e3


# ----------------------------------------------------------------------------- kills

def start_stage(workdir: Path, stage: str, log: Path) -> subprocess.Popen:
    """The stage as its own process, SIGINT at its default: a suite started in the background of a
    non-interactive shell (`make test &`) ignores SIGINT, and a child would inherit that, so Ctrl-C's
    signal would never reach it."""
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", f"ced_csa2.stages.{stage}"], cwd=workdir, env=stage_env(),
                                stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(proc: subprocess.Popen, log: Path, pattern: str, timeout: float = 900) -> re.Match:
    """Wait until ``pattern`` appears in ``log``; its first match."""
    return wait_until(proc, log, lambda text: re.search(pattern, text), f"{pattern!r} appeared", timeout)




def test_dump_killed_at_three_seeded_points_resumes_to_the_same_datasets(dumped_workdir, tmp_path):
    one_record_batches = edit("  batch_size: 8\n  storage_dtype", "  batch_size: 1\n  storage_dtype")
    ref, work = tmp_path / "ref", tmp_path / "work"
    for folder in (ref, work):
        shutil.copytree(dumped_workdir / "data" / "corpus", folder / "data" / "corpus")
        shutil.copy(dumped_workdir / "params.yaml", folder / "params.yaml")
        one_record_batches(folder)
    run_stage_here(ref, "dump")  # uninterrupted

    rng, resumed_from = np.random.default_rng(16), []
    for kill in range(3):
        log = tmp_path / f"run{kill}.log"
        proc = start_stage(work, "dump", log)
        todo, done_before = map(int, wait_for(proc, log, r"dumping (\d+) records \((\d+) already done\)").groups())
        resumed_from.append(done_before)
        # A seeded point inside the writing loop: this run has committed that many more records.
        kill_at = done_before + max(1, round(rng.uniform(0.1, 0.7) * todo))
        wait_until(proc, log, lambda text: any(n >= kill_at for n, _ in committed(text).values()),
                   f"record {kill_at} committed")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, f"run {kill} finished before its kill point"
        assert not (work / DUMP_PATH).exists()
    run_stage_here(work, "dump")
    resumed_from.append(json.loads((work / DUMP_METRICS).read_text())["resumed_from_record"])

    print(f"dump runs started from record {resumed_from} (48 records)")
    assert any(n > 0 for n in resumed_from), f"no run resumed real progress: {resumed_from}"
    assert dump_contents(work / DUMP_PATH) == dump_contents(ref / DUMP_PATH), resumed_from
    assert sorted(p.relative_to(work).as_posix() for p in (work / "data").rglob("*") if p.is_file()) == [
        *(f"data/corpus/{name}.{ext}" for name in ("domains/reports_a", "domains/reports_b", "eval", "train")
          for ext in ("jsonl", "provenance.json")),  # the tiny profile's corpus, each file with its record
        "data/dump/dump.h5"]


def test_dump_interrupted_by_ctrl_c_says_so_in_one_line_then_resumes(dumped_workdir, tmp_path):
    """SIGINT, as Ctrl-C sends it, after a committed record: one line, exit 130, the partial dump kept to resume."""
    work = tmp_path / "work"
    shutil.copytree(dumped_workdir / "data" / "corpus", work / "data" / "corpus")
    shutil.copy(dumped_workdir / "params.yaml", work / "params.yaml")
    edit("  batch_size: 8\n  storage_dtype", "  batch_size: 1\n  storage_dtype")(work)  # a commit per record
    log = tmp_path / "interrupted.log"
    proc = start_stage(work, "dump", log)
    wait_until(proc, log, lambda text: any(n >= 2 for n, _ in committed(text).values()), "record 2 committed")
    proc.send_signal(signal.SIGINT)

    assert proc.wait(timeout=300) == 130, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert text.splitlines()[-1] == INTERRUPTED_LINE.format(stage="dump"), text[-3000:]
    assert not (work / DUMP_PATH).exists() and (work / DUMP_PARTIAL).exists()
    run_stage_here(work, "dump")  # "run the stage again to finish": it resumes
    assert json.loads((work / DUMP_METRICS).read_text())["resumed_from_record"] >= 2


def test_train_projector_killed_mid_epoch_keeps_the_old_checkpoint_then_writes_the_same_bytes(dumped_workdir,
                                                                                               tmp_path):
    anchor = "  epochs: 12\n  batch_size: 256\n"  # train_projector
    base, ref, work = tmp_path / "base", tmp_path / "ref", tmp_path / "work"
    shutil.copytree(dumped_workdir, base)
    edit(anchor, "  epochs: 1\n  batch_size: 256\n")(base)
    run_stage_here(base, "train_projector")  # the old, complete output
    (base / "params.yaml").write_text(TINY_YAML)
    edit(anchor, "  epochs: 3\n  batch_size: 4\n")(base)
    shutil.copytree(base, ref)
    shutil.copytree(base, work)
    ckpt = projector_path(20)
    run_stage_here(ref, "train_projector")  # uninterrupted
    old, new = sha(base / ckpt), sha(ref / ckpt)
    assert old != new

    seen, stop = set(), threading.Event()

    def watch():  # what a reader of the output sees, every few milliseconds (not a busy loop: the trainer needs the core)
        while not stop.wait(0.005):
            try:
                seen.add(sha(work / ckpt))
            except FileNotFoundError:
                seen.add(None)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        log = tmp_path / "killed.log"
        proc = start_stage(work, "train_projector", log)
        wait_for(proc, log, r"train_projector epoch 1/3")
        # A seeded step inside epoch 2, as the trainer's progress bar (steps of all 3 epochs) counts it.
        total = int(wait_for(proc, log, r"\d+/(\d+) \[").group(1))
        per_epoch = total // 3
        kill_at = per_epoch + max(1, round(np.random.default_rng(16).uniform(0.2, 0.7) * per_epoch))
        wait_until(proc, log, lambda text: any(int(n) >= kill_at for n in re.findall(r"(\d+)/\d+ \[", text)),
                   f"step {kill_at} of {total}")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        assert "epoch 2/3" not in log.read_text(), "killed after epoch 2, not in it"
        assert sha(work / ckpt) == old and seen == {old}
        rerun = run_stage_process(work, "train_projector")
        assert rerun.returncode == 0, rerun.stderr[-3000:]
    finally:
        stop.set()
        watcher.join()
    assert seen <= {old, new} and new in seen  # complete old or complete new, never anything else
    for rel in (ckpt, PROJECTORS_EXTRA, PROJECTOR_CURVES):
        assert (work / rel).read_bytes() == (ref / rel).read_bytes(), rel
    assert not [p for p in work.rglob("*") if ".tmp" in p.name]
