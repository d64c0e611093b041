"""Helpers shared by the fault catalogue's files (tests/faults/) and by the dump-killing tests of tests/pipeline/test_distributed.py."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from conftest import TINY_OVERRIDES, compose

from ced_csa2 import assets
from ced_csa2.pipeline.paths import (
    DUMP_PATH,
)
from ced_csa2.pipeline.stage_runner import DEBUG_ENV

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = compose(TINY_OVERRIDES)


def edit(old: str, new: str):
    """A hand edit of ``params.yaml``: replace the one occurrence of ``old``."""
    def apply(workdir: Path) -> None:
        path = workdir / "params.yaml"
        text = path.read_text()
        assert text.count(old) == 1, f"anchor {old!r} must occur once in the tiny params.yaml"
        path.write_text(text.replace(old, new))
    return apply


def write(rel: str, content: bytes | str):
    def apply(workdir: Path) -> None:
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return apply


def remove(rel: str):
    return lambda workdir: (workdir / rel).unlink()


def local_model(path: str, *before, pinned: bool = False):
    """Hand edits of ``params.yaml``: the model becomes ``kind: local`` at ``path``, pinned to zeros
    (or, ``pinned``, to the digest of what ``before`` put there)."""
    def apply(workdir: Path) -> None:
        for step in before:
            step(workdir)
        sha256 = assets.digest(workdir / path) if pinned else ZEROS
        edit("  name: tiny_qwen3_5\n  kind: tiny\n", "  name: tiny_qwen3_5\n  kind: local\n")(workdir)
        edit("  local: null\n", f"  local:\n    path: {path}\n    sha256: '{sha256}'\n")(workdir)
    return apply


NO_CUDA = "torch.cuda.is_available() is false"


ZEROS = "0" * 64


# What a stage says when Ctrl-C ends it (exit status 130).
INTERRUPTED_LINE = ("{stage}: interrupted; every output is its complete old or new file (none is left half-written): "
                    "run the stage again to finish")


def snapshot(workdir: Path) -> dict[str, str]:
    """``{path: sha256}`` of every file under ``workdir`` but ``params.yaml`` (new files show too)."""
    return {p.relative_to(workdir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(workdir.rglob("*")) if p.is_file() and p.name != "params.yaml"}


def stage_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, "CED_CSA2_RECORD_READS")}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def run_stage_process(workdir: Path, stage: str, prelude: str = "") -> subprocess.CompletedProcess:
    """``python -m ced_csa2.stages.<stage>``, or with ``prelude`` (a fault injected) run before its ``main()``."""
    cmd = [sys.executable, "-m", f"ced_csa2.stages.{stage}"] if not prelude else [
        sys.executable, "-c", f"{prelude}\nimport ced_csa2.stages.{stage} as stage_module\nstage_module.main()\n"]
    return subprocess.run(cmd, cwd=workdir, env=stage_env(), capture_output=True, text=True, timeout=600,
                          check=False)


@contextlib.contextmanager
def one_thread():
    """Intra-op threads as a stage's own process has them (``OMP_NUM_THREADS=1``: :func:`stage_env`, torchrun's
    workers), for a run in this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_stage_here(workdir: Path, stage: str) -> None:
    """Stage ``stage``'s own ``run()`` on ``workdir/params.yaml``, in this process on one thread: the outputs of
    :func:`run_stage_process` (whose exit status and error line are not asked for) without a new interpreter's
    imports."""
    from ced_csa2.config import load_params

    with one_thread():
        importlib.import_module(f"ced_csa2.stages.{stage}").run(load_params(workdir / "params.yaml"), workdir)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The stage ended with exit status 2 and exactly one ``error:`` line, last, no traceback or crash noise."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    for noise in ("Traceback", "Exception ignored", "Segmentation fault"):
        assert noise not in done.stderr, done.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), done.stderr[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1, done.stderr[-3000:]
    return lines[-1]


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def flip_bytes(name: str, chunk: int, at: int = 1000, n: int = 64):
    """Invert ``n`` bytes at offset ``at`` inside chunk ``chunk`` of dataset ``name``, in place."""
    def apply(workdir: Path) -> None:
        path = workdir / DUMP_PATH
        with h5py.File(path, "r") as f:
            offset = f[name].id.get_chunk_info(chunk).byte_offset + at
        with open(path, "r+b") as fh:
            fh.seek(offset)
            data = fh.read(n)
            fh.seek(offset)
            fh.write(bytes(b ^ 0xFF for b in data))
    return apply


COMMITTED = re.compile(r"(\S+): (\d+) of (\d+) records committed")  # the dump's line after each batch


def committed(text: str) -> dict[str, tuple[int, int]]:
    """``{partial file: (records committed, records of that file)}``: the latest dump line per file (per rank)."""
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in COMMITTED.finditer(text)}


def dump_contents(path: Path) -> dict:
    """Every dataset (dtype, shape, sha256 of its bytes) and every attribute of a dump file."""
    def plain(v):
        return np.asarray(v).tolist() if not isinstance(v, (str, bytes)) else v

    with h5py.File(path, "r") as f:
        out = {f"@{k}": plain(v) for k, v in f.attrs.items()}
        for name, ds in f.items():
            data = ds[()]
            out[name] = (str(ds.dtype), ds.shape, hashlib.sha256(data.tobytes()).hexdigest())
            out.update({f"{name}@{k}": plain(v) for k, v in ds.attrs.items()})
    return out


def wait_until(proc: subprocess.Popen, log: Path, seen, what: str, timeout: float = 900):
    """Poll ``log`` (the stderr of the running ``proc``) until ``seen(text)`` is truthy; return that value.

    Kill points are states the test observes in the log, not times: however loaded the
    machine, the process is where the test means it to be when the signal goes out.  The
    timeout only catches a hang, so it is generous: a loaded machine is slow, not wrong.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = seen(log.read_text(errors="replace"))
        if found:
            return found
        assert proc.poll() is None, f"ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.002)
    raise AssertionError(f"{what} did not happen in {timeout} s")


# ----------------------------------------------------------------------------- the Hugging Face hub, offline and online

def hub_cache_with(hf_home: Path, hf_id: str, folder: Path, commit: str = "a" * 40) -> Path:
    """``folder``'s files as the hub cache under ``hf_home`` holds a download of ``hf_id``: a snapshot at
    ``commit``, ``refs/main`` pointing at it; returns the repository's cache folder."""
    repo = hf_home / "hub" / f"models--{hf_id.replace('/', '--')}"
    snapshot_dir = repo / "snapshots" / commit
    snapshot_dir.mkdir(parents=True)
    for path in folder.iterdir():
        (snapshot_dir / path.name).write_bytes(path.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo


class HubRefusals:
    """A local HTTP endpoint answering each repository as the hub answers a refused one, or serving a file.

    ``refusals`` maps a repository id to ``(status, X-Error-Code)``: ``(401, "GatedRepo")``,
    ``(401, "RepoNotFound")``, ``(404, "RevisionNotFound")`` are what huggingface.co sends; a
    client pointed here with ``HF_ENDPOINT`` meets the real refusal, not a mock of its exception.
    A repository mapped to bytes is served them as any file it is asked for (a download).
    """

    def __init__(self, refusals: dict[str, tuple[int, str] | bytes]):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def answer(self):
                repo = "/".join(self.path.strip("/").split("/")[:2])
                answer = refusals.get(repo, (500, "Unknown"))
                if isinstance(answer, bytes):  # the headers hf_hub_download reads the commit and blob name from
                    self.send_response(200)
                    self.send_header("X-Repo-Commit", "d" * 40)
                    self.send_header("ETag", f'"{hashlib.sha1(answer).hexdigest()}"')
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    if self.command == "GET":
                        self.wfile.write(answer)
                    return
                status, code = answer
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", f"{code} for {repo}")
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_GET = answer

            def log_message(self, *args):  # the test's output is the client's, not the server's
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# Runs in a subprocess with the hub's environment set (HF_HOME, HF_HUB_OFFLINE, HF_ENDPOINT are read
# when huggingface_hub is imported): loads each (what, id, revision) of argv[1] (JSON) as the stages do --
# a model's config, a WikiText split, a GSM8K split -- and prints each refusal as JSON, or "loaded".
HUB_PROBE = """
import json, sys
from conftest import tiny_params
from ced_csa2.config import replaced
from ced_csa2.data import readers
from ced_csa2.model_utils import load_config
LOADERS = {
    "model": lambda hub_id, revision: load_config(replaced(tiny_params().model, kind="hub", hf_id=hub_id,
                                                           revision=revision)),
    "wikitext": lambda hub_id, revision: readers.wikitext_lines(hub_id, "wikitext-2-raw-v1", "train", revision),
    "gsm8k": lambda hub_id, revision: readers.gsm8k_hub(hub_id, "main", "test", 8, revision),
}
for what, hub_id, revision in json.loads(sys.argv[1]):
    try:
        LOADERS[what](hub_id, revision)
        print(json.dumps("loaded"))
    except Exception as exc:
        print(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
"""


def probe_hub(cases: list[tuple[str, str, str | None]], prelude: str = "", **hub_env: str) -> list:
    """What :data:`HUB_PROBE` says of each ``(what, id, revision)`` with ``hub_env`` set (one subprocess), after
    ``prelude`` (a fault: a file-size limit)."""
    import json

    env = {k: v for k, v in stage_env().items() if not k.startswith("HF_")}
    env.update(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}", HF_HUB_DISABLE_TELEMETRY="1", **hub_env)
    done = subprocess.run([sys.executable, "-c", prelude + HUB_PROBE, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith(("{", '"'))]
