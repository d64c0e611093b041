"""What the Hugging Face hub refused, on one line: the full profile loads its model and data from it.

transformers and datasets wrap each hub failure in errors of their own, of several lines; the
``huggingface_hub`` error in the exception's chain (``__cause__``, ``__context__``) says which
failure it was.  A hub that gives no answer (offline, unreachable) is told apart by what the
local cache holds: nothing of the repository, other revisions only, or a download cut short;
a download that failed on the disk (full, read-only) names the cache folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from .atomic_files import DISK_ERRNOS



def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from or while handling, each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def hub_refusal(repo_id: str, revision: str | None, exc: BaseException, keys: tuple[str, str],
                repo_type: str = "model") -> str:
    """``<repo_id>@<revision>: <what was refused>: <what to do>``, one line.

    Parameters
    ----------
    repo_id, revision
        What was asked for (``revision`` ``None``: the default branch, ``main``).
    exc
        What the loading library raised.
    keys
        The params keys of the id and the revision (``("model.hf_id", "model.revision")``): what to change.
    repo_type
        ``model`` or ``dataset``: where the hub cache keeps the repository.
    """
    from huggingface_hub import constants, errors

    id_key, revision_key = keys
    revision = revision or "main"
    raised = list(_chain(exc))

    def found(*classes) -> bool:
        return any(isinstance(e, classes) for e in raised)

    disk = next((e.errno for e in raised if isinstance(e, OSError) and e.errno in DISK_ERRNOS), None)
    if disk is not None:
        what = (f"writing the hub cache {constants.HF_HUB_CACHE} failed ({os.strerror(disk)}): free space there, or "
                "set HF_HOME to a folder on a disk with room that you can write, then run again")
    elif found(errors.GatedRepoError):
        what = (f"the repository is gated: accept its terms at https://huggingface.co/"
                f"{'datasets/' if repo_type == 'dataset' else ''}{repo_id}, then log in (hf auth login, or HF_TOKEN)")
    elif found(errors.RepositoryNotFoundError):
        what = (f"the hub has no such repository (or it is private): check the spelling of {id_key}, or log in "
                "(hf auth login, or HF_TOKEN) for a private one")
    elif found(errors.RevisionNotFoundError):
        what = (f"the repository has no revision {revision!r} (deleted, or mistyped): set {revision_key} to a commit, "
                "branch or tag it has")
    elif constants.HF_HUB_OFFLINE or found(errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled,
                                           ConnectionError):
        unreachable = "the hub is offline (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else \
            f"the hub ({constants.ENDPOINT}) cannot be reached"
        repo = Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}"
        partial = sorted(repo.glob("blobs/*.incomplete"))
        held = sorted(p.relative_to(repo / "refs").as_posix() for p in (repo / "refs").rglob("*") if p.is_file())
        if partial:
            what = (f"its download was cut short ({len(partial)} partial file(s) in {repo / 'blobs'}) and "
                    f"{unreachable}: run again with network access to finish it")
        elif held:
            what = (f"the hub cache {repo} holds no revision {revision!r} (it holds {', '.join(held)}) and "
                    f"{unreachable}: download it with network access, or set {revision_key} to one the cache holds")
        else:
            what = (f"the hub cache {constants.HF_HUB_CACHE} does not hold it and {unreachable}: download it once with "
                    f"network access, or check the spelling of {id_key}")
    else:
        what = f"the hub refused it ({type(raised[-1]).__name__}: {' '.join(str(raised[-1]).split())})"
    return f"{repo_id}@{revision}: {what}"
