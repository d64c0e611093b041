"""Files that cannot lie: strict JSON, atomic writes that leave nothing behind, DVC's cache
surviving in-place edits of outputs, and the asset cache refetching a bad wheel once.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import AMP_OVERRIDES, TINY_OVERRIDES, project_copy
from faults_common import (
    flip_bytes,
    one_error_line,
    run_stage_process,
    sha,
    stage_env,
)

from ced_csa2 import assets
from ced_csa2.assets import fetch_member
from ced_csa2.config import WheelPin
from ced_csa2.data.dump_file import DumpReader
from ced_csa2.pipeline import atomic_files
from ced_csa2.pipeline.atomic_files import atomic_write_bytes, atomic_write_text, nonfinite_keys, write_json
from ced_csa2.pipeline.paths import (
    DUMP_PATH,
    RIDGE_PATH,
)
from ced_csa2.pipeline.stage_runner import run_stage

# ----------------------------------------------------------------------------- strict JSON

def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name) if folder.exists() else []


@pytest.mark.parametrize("bad,where", [
    (math.nan, "'ppl.ced' = nan"), (math.inf, "'ppl.ced' = inf"), (-math.inf, "'ppl.ced' = -inf")])
def test_write_json_refuses_non_finite_naming_file_and_key(tmp_path, bad, where):
    path = tmp_path / "metrics" / "ppl.json"
    with pytest.raises(ValueError) as err:
        write_json(path, {"ppl": {"baseline": 20.9, "ced": bad}})
    assert str(path) in str(err.value) and where in str(err.value)
    assert not path.exists() and _leftovers(path.parent) == []


def test_write_json_refusal_keeps_the_prior_file(tmp_path):
    path = tmp_path / "ridge.json"
    write_json(path, {"k": {"r2": 0.61}})
    prior = path.read_bytes()
    with pytest.raises(ValueError, match=r"'k.r2' = nan, 'layers.1.cos' = inf"):
        write_json(path, {"k": {"r2": math.nan}, "layers": [{"cos": 1.0}, {"cos": math.inf}]})
    assert path.read_bytes() == prior and _leftovers(tmp_path) == []


def test_write_json_never_writes_bare_nan_tokens(tmp_path):
    path = tmp_path / "m.json"
    write_json(path, {"a": [1.0, 2], "b": {"c": None, "d": "NaN"}})  # a string "NaN" is fine
    text = path.read_text()
    assert json.loads(text) == {"a": [1.0, 2], "b": {"c": None, "d": "NaN"}} and text.endswith("}\n")
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}")) is not None


def test_nonfinite_keys_walks_nested_containers():
    assert [k for k, _ in nonfinite_keys({"a": [1.0, {"b": math.nan}], "c": (math.inf,)})] == ["a.1.b", "c.0"]
    assert nonfinite_keys(math.nan)[0][0] == "<root>" and nonfinite_keys({"x": 1, "y": "nan"}) == []


def test_write_json_unencodable_object_names_the_file_and_writes_nothing(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{"prior": true}\n')
    with pytest.raises(TypeError, match=rf"{path}: Object of type object is not JSON serializable"):
        write_json(path, {"x": object()})
    assert path.read_text() == '{"prior": true}\n' and _leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- atomic writes

@pytest.fixture
def prior_file(tmp_path):
    path = tmp_path / "out" / "model.pt"
    atomic_write_bytes(path, b"prior good bytes")
    assert path.read_bytes() == b"prior good bytes" and _leftovers(path.parent) == []
    return path


@pytest.mark.parametrize("where,exc", [
    ("replace", KeyboardInterrupt()), ("replace", OSError(28, "No space left on device")),
    ("fsync", OSError(28, "No space left on device")), ("fsync", KeyboardInterrupt()),
], ids=["ctrl-c-at-rename", "enospc-at-rename", "enospc-at-fsync", "ctrl-c-at-fsync"])
def test_failed_atomic_write_leaves_no_temp_and_the_destination_unchanged(prior_file, monkeypatch, where, exc):
    def fail(*args, **kwargs):
        assert _leftovers(prior_file.parent), "the temp file exists while writing"
        raise exc

    monkeypatch.setattr(atomic_files.os, where, fail)
    with pytest.raises(type(exc)):
        atomic_write_bytes(prior_file, b"new bytes that must not land")
    monkeypatch.undo()
    assert prior_file.read_bytes() == b"prior good bytes"
    assert _leftovers(prior_file.parent) == []


def test_write_onto_a_directory_leaves_no_temp(tmp_path):
    (tmp_path / "metrics.json").mkdir()
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "metrics.json", "{}\n")
    assert (tmp_path / "metrics.json").is_dir() and _leftovers(tmp_path) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_write_into_read_only_folder_fails_cleanly(prior_file):
    folder = prior_file.parent
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            atomic_write_bytes(prior_file, b"new")
        assert prior_file.read_bytes() == b"prior good bytes" and _leftovers(folder) == []
    finally:
        folder.chmod(0o755)


def test_successful_atomic_write_replaces_and_cleans_up(prior_file):
    atomic_write_bytes(prior_file, b"new")
    assert prior_file.read_bytes() == b"new" and _leftovers(prior_file.parent) == []


def test_a_killed_writers_temp_file_is_removed_by_the_next_write(prior_file):
    """SIGKILL cannot be caught: the temp file of a killed writer goes at the next write of that file."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)  # a process that has exited
    stale = prior_file.with_name(f".{prior_file.name}.tmp{dead}")
    busy = prior_file.with_name(f".{prior_file.name}.tmp{os.getppid()}")  # a live writer: not ours to remove
    stale.write_bytes(b"half a checkpoint")
    busy.write_bytes(b"being written")
    atomic_write_bytes(prior_file, b"new")
    assert prior_file.read_bytes() == b"new" and not stale.exists() and busy.read_bytes() == b"being written"


# ----------------------------------------------------------------------------- DVC cache

def sh(cwd: Path, *cmd: str) -> str:
    env = dict(stage_env(), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               DVC_NO_ANALYTICS="1")
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_dvc_cache_survives_in_place_edits_of_outputs(tmp_path):
    """Outputs are copies (``cache.type = reflink,copy``), not hard links into ``.dvc/cache``: patching the dump
    and truncating a checkpoint in place leave the cache intact, ``dvc status`` reports both and
    ``dvc checkout -f`` restores the good bytes."""
    repo = project_copy(tmp_path / "repo")
    sh(repo, sys.executable, "-m", "ced_csa2.compose", *TINY_OVERRIDES, *AMP_OVERRIDES)
    sh(repo, "dvc", "repro", "ridge")  # prepare, dump, ridge
    outs = [DUMP_PATH, RIDGE_PATH]
    good = {rel: sha(repo / rel) for rel in outs}
    for rel in outs:  # a copy of the cached file, not the cached file itself
        assert not (repo / rel).is_symlink() and (repo / rel).stat().st_nlink == 1, rel

    flip_bytes("k_24", 0)(repo)  # in place, same size
    line = one_error_line(run_stage_process(repo, "ridge"))  # the consumer refuses the patched dump
    assert f"{DUMP_PATH}: dataset 'k_24' rows [0, 4096) fail their crc32 checksum" in line
    with open(repo / RIDGE_PATH, "r+b") as f:
        f.truncate(100)
    status = json.loads(sh(repo, "dvc", "status", "--json", "--with-deps", "ridge"))  # ridge and its upstream
    assert {"changed outs": {"data/dump": "modified"}} in status["dump"], status
    assert {"changed outs": {str(RIDGE_PATH): "modified"}} in status["ridge"], status

    sh(repo, "dvc", "checkout", "-f", "ridge", "dump")
    assert {rel: sha(repo / rel) for rel in outs} == good
    assert json.loads(sh(repo, "dvc", "status", "--json", "--with-deps", "ridge")) == {}
    with DumpReader(repo / DUMP_PATH) as reader:
        reader.verify()


# ----------------------------------------------------------------------------- asset cache

ASSET_MEMBER = "demo_pkg/data/blob.bin"
ASSET_BLOB = b"pinned payload\n" * 200
ASSET_WHEEL = "demo_pkg-1.0-py3-none-any.whl"


def wheel_bytes(member: bytes | None = ASSET_BLOB, *, stored: bool = False) -> bytes:
    """A real minimal wheel of demo-pkg 1.0 (zip), holding ``member`` at ASSET_MEMBER unless ``None``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("demo_pkg/__init__.py", "")
        if member is not None:
            zf.writestr(ASSET_MEMBER, member)
        zf.writestr("demo_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n")
        zf.writestr("demo_pkg-1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("demo_pkg-1.0.dist-info/RECORD", "")
    return buf.getvalue()


def _crc_broken() -> bytes:
    data = bytearray(wheel_bytes(stored=True))
    data[data.index(ASSET_BLOB[:64]) + 100] ^= 0xFF  # the member's bytes, not its CRC
    return bytes(data)


GOOD_WHEEL = wheel_bytes()
BAD_WHEELS = {
    "truncated": GOOD_WHEEL[:len(GOOD_WHEEL) // 2],
    "not-a-zip": b"<html>503 Service Unavailable</html>\n",
    "member-sha256-wrong": wheel_bytes(b"a re-published payload\n"),
    "member-crc-broken": _crc_broken(),
    "member-missing": wheel_bytes(None),
}
UNRELATED_WHEELS = {  # other packages, versions and names that are not wheel names: never read, never touched
    "junk.whl": b"not a wheel", "other_pkg-2.0-py3-none-any.whl": GOOD_WHEEL,
    "demo_pkg-9.9-py3-none-any.whl": b"corrupt", "demo_pkg.whl": b"x", "demo_pkg-1.0.whl": b"y",
}
STILL_BAD = ["{wheel}", "was downloaded again and is still bad: delete it and retry with network access to PyPI"]
# (id, wheel already in the cache or None, what each fetch delivers (None: the fetch fails), error pieces or None)
ASSET_CASES = [
    *[(f"cached-{kind}-refetched", bad, [GOOD_WHEEL], None) for kind, bad in BAD_WHEELS.items()],
    *[(f"cached-{kind}-still-bad", bad, [bad], STILL_BAD) for kind, bad in BAD_WHEELS.items()],
    ("cached-bad-fetch-fails", BAD_WHEELS["truncated"], [None],
     ["Could not download the wheel of demo-pkg==1.0", "The cached wheel {wheel} was bad and has been deleted",
      "Check the network"]),
    ("downloaded-bad-then-good", None, [BAD_WHEELS["member-crc-broken"], GOOD_WHEEL], None),
    ("no-cached-wheel", None, [GOOD_WHEEL], None),
]


class FakePip:
    """Stands in for ``pip download``: each call delivers the next wheel into ``-d`` (no network)."""

    def __init__(self, deliveries):
        self.deliveries, self.calls = list(deliveries), 0

    def __call__(self, cmd):
        self.calls += 1
        data = self.deliveries.pop(0)
        if data is None:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for demo-pkg==1.0")
        (Path(cmd[cmd.index("-d") + 1]) / ASSET_WHEEL).write_bytes(data)
        return subprocess.CompletedProcess(cmd, 0, "Saved", "")


@pytest.mark.parametrize("case,cached,deliveries,expected", ASSET_CASES, ids=[c[0] for c in ASSET_CASES])
def test_bad_cached_wheel_is_fetched_once_more_then_named(in_tiny_folder, tmp_path, monkeypatch, capsys, case,
                                                          cached, deliveries, expected):
    cache = tmp_path / "cache"
    monkeypatch.setenv("CED_CSA2_CACHE", str(cache))
    wheels, target = cache / "wheels", cache / "files" / "demo-pkg-1.0" / ASSET_MEMBER
    wheels.mkdir(parents=True)
    for name, data in UNRELATED_WHEELS.items():
        (wheels / name).write_bytes(data)
    if cached is not None:
        (wheels / ASSET_WHEEL).write_bytes(cached)
    before = {name: sha(wheels / name) for name in UNRELATED_WHEELS}
    pip = FakePip(deliveries)
    monkeypatch.setattr(assets, "_run_pip", pip)
    pin = WheelPin(package="demo-pkg", version="1.0", member=ASSET_MEMBER,
                   sha256=hashlib.sha256(ASSET_BLOB).hexdigest(), python_version=None)

    if expected is None:
        got = []
        run_stage(lambda params: got.append(fetch_member(pin)))
        assert got == [target] and target.read_bytes() == ASSET_BLOB
        assert (wheels / ASSET_WHEEL).read_bytes() == GOOD_WHEEL
    else:
        with pytest.raises(SystemExit) as end:
            run_stage(lambda params: fetch_member(pin))
        assert end.value.code == 2
        # the fault is one line; the refetch's warning may precede it (logged above tqdm's bars, onto stderr)
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
        err = errors[0]
        for piece in expected:
            assert piece.format(wheel=wheels / ASSET_WHEEL) in err, (piece, err)
        assert not target.exists()
    assert pip.calls == len(deliveries) and not pip.deliveries  # one more fetch at most, no loop
    assert {name: sha(wheels / name) for name in UNRELATED_WHEELS} == before
    assert not [p for p in cache.rglob("*") if ".tmp" in p.name]


def _full_disk_pip(cmd):
    """``pip download`` on a full disk: part of the wheel copied, then pip's own OSError (exit 1)."""
    (Path(cmd[cmd.index("-d") + 1]) / ASSET_WHEEL).write_bytes(GOOD_WHEEL[:100])
    return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not install packages due to an OSError: "
                                                   f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}")


def _full_disk_copy(src, out, length=0):
    """``shutil.copyfileobj`` on a full disk: some bytes written, then ENOSPC (an OSError that names no file)."""
    out.write(src.read(10))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("when", ["download", "extract"])
def test_a_full_disk_names_the_file_and_the_space_left_not_the_network(in_tiny_folder, tmp_path, monkeypatch,
                                                                       capsys, when):
    cache = tmp_path / "cache"
    monkeypatch.setenv("CED_CSA2_CACHE", str(cache))
    wheels, target = cache / "wheels", cache / "files" / "demo-pkg-1.0" / ASSET_MEMBER
    if when == "download":
        monkeypatch.setattr(assets, "_run_pip", _full_disk_pip)
        written = wheels / "demo_pkg-1.0-*.whl"
    else:
        wheels.mkdir(parents=True)
        (wheels / ASSET_WHEEL).write_bytes(GOOD_WHEEL)
        monkeypatch.setattr(assets.shutil, "copyfileobj", _full_disk_copy)
        written = target
    pin = WheelPin(package="demo-pkg", version="1.0", member=ASSET_MEMBER,
                   sha256=hashlib.sha256(ASSET_BLOB).hexdigest(), python_version=None)
    with pytest.raises(SystemExit) as end:
        run_stage(lambda params: fetch_member(pin))
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: {written}: the disk is full (") and " MiB free in " in err, err
    assert f"in the asset cache {cache} or set CED_CSA2_CACHE to a folder on a disk with room" in err, err
    assert "network" not in err.lower(), err
    # nothing partial stays: not the wheel pip had begun, not the member's temporary file
    assert [p.name for p in cache.rglob("*") if p.is_file()] == ([] if when == "download" else [ASSET_WHEEL])


@pytest.mark.parametrize("below", ["", "/cache"], ids=["names-the-file", "a-folder-under-the-file"])
def test_an_asset_cache_that_is_a_file_is_one_line(in_tiny_folder, tmp_path, monkeypatch, capsys, below):
    """``CED_CSA2_CACHE`` naming a file (or a folder under one): one line naming the variable, not ENOTDIR's traceback."""
    in_the_way = tmp_path / "cache.tar"
    in_the_way.write_bytes(b"a file, not a folder")
    monkeypatch.setenv("CED_CSA2_CACHE", f"{in_the_way}{below}")
    pin = WheelPin(package="demo-pkg", version="1.0", member=ASSET_MEMBER,
                   sha256=hashlib.sha256(ASSET_BLOB).hexdigest(), python_version=None)

    with pytest.raises(SystemExit) as end:
        run_stage(lambda params: fetch_member(pin))

    assert end.value.code == 2
    assert capsys.readouterr().err == (
        f"error: CED_CSA2_CACHE={in_the_way}{below}: {in_the_way} is a file, not a folder: point CED_CSA2_CACHE at a "
        "folder (it holds the downloaded wheels and the files taken out of them)\n")
    assert in_the_way.read_bytes() == b"a file, not a folder"
