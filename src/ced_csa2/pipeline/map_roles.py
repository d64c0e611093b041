"""Which branch of the pipeline a map file belongs to -- its *role*: the one vocabulary of writers and loaders.

The branches' map files have the same shapes: the main projector and the seed-literal one,
the main adapters and an objective's or Mode A's, an objective's two pairs.  Model, layers,
geometry and plan cannot tell them apart, so every map file records its role
(``meta["role"]``, written by :func:`ced_csa2.pipeline.checkpoint.checkpoint_meta`) and every
loader asks for the role it needs (:func:`ced_csa2.pipeline.checkpoint.load_checkpoint` refuses
another one before any weight is read).  A role is a branch and, inside an objective's
branch, a pair:

* ``main`` -- ``models/``: ``train_projector``, ``extra_projectors``, ``train_adapters``, ``fit_xkv``;
* ``seed_init`` -- ``models/projector_seed_init/``: ``train_projector``'s reference, the seed's
  projector recipe read literally (:data:`SEED_INIT_RECIPE`);
* ``objective:<name>`` -- ``models/objectives/<name>/``, written by ``tune@<name>``: pair ``csa2``
  (the folder itself: the maps the ``ced`` and ``csa2`` groups run with) or ``ced_csa2`` (its
  ``ced_csa2/``: the pair trained for the groups that project the source and adapt it);
* ``mode_a`` -- ``models/mode_a/``, written by ``tune_mode_a`` (the sink included).

A branch that trains with other values than ``params.yaml``'s (``seed_init``) records the
params as applied in its provenance, and its reader checks the file against the same
(:func:`applied`).  Each adapters file maps the source (``meta["source"]``) to the targets
``meta["layers"]``; its entries are keyed by their target layer (``k.<t>``, ``v.<t>``), so an
entry of another target cannot load in its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..config import replaced
from .paths import SEED_INIT

if TYPE_CHECKING:
    from ..config import Params

OBJECTIVE_PREFIX = "objective:"
PAIRS = ("csa2", "ced_csa2")  # an objective branch's two pairs of maps (stage tune@<objective>)
# The seed's projector recipe read literally: PyTorch's random init, the last epoch's weights.
SEED_INIT_RECIPE = {"init": "random", "keep": "last"}
# The stage of the main branch that writes each kind of map file (the format tags of the loaders).
MAIN_WRITERS = {"projector": "train_projector", "projectors": "extra_projectors", "adapters": "train_adapters",
                "xkv": "fit_xkv"}


@dataclass(frozen=True)
class Role:
    """The branch a map file belongs to, and (objective branches only) its pair.

    Attributes
    ----------
    branch
        ``"main"``, ``"seed_init"``, ``"objective:<name>"`` or ``"mode_a"``.
    pair
        ``"csa2"`` or ``"ced_csa2"`` for an objective branch (:data:`PAIRS`), else ``None``.
    """

    branch: str
    pair: str | None = None

    def __post_init__(self):
        objective = self.branch.startswith(OBJECTIVE_PREFIX) and len(self.branch) > len(OBJECTIVE_PREFIX)
        if not objective and self.branch not in ("main", SEED_INIT, "mode_a"):
            raise ValueError(f"unknown map branch {self.branch!r}: 'main', {SEED_INIT!r}, 'mode_a' or "
                             f"'{OBJECTIVE_PREFIX}<name>'")
        if (self.pair not in PAIRS) if objective else (self.pair is not None):
            raise ValueError(f"branch {self.branch!r} with pair {self.pair!r}: an objective branch names one of "
                             f"{list(PAIRS)}, the others none")

    def __str__(self) -> str:
        return f"branch {self.branch!r}" + (f", pair {self.pair!r}" if self.pair else "")

    def as_meta(self) -> dict:
        """What a file of this role records as ``meta["role"]``."""
        return {"branch": self.branch, "pair": self.pair}

    def writer(self, kind: str) -> str:
        """The stage that writes this role's file of format ``kind`` (for ``dvc repro <stage>``)."""
        if self.branch.startswith(OBJECTIVE_PREFIX):
            return f"tune@{self.branch.removeprefix(OBJECTIVE_PREFIX)}"
        if self.branch == "main":
            return MAIN_WRITERS[kind]
        return {SEED_INIT: "train_projector", "mode_a": "tune_mode_a"}[self.branch]


MAIN = Role("main")
SEED_INIT_ROLE = Role(SEED_INIT)
MODE_A = Role("mode_a")


def objective(name: str, pair: str) -> Role:
    """The role of ``tune@<name>``'s ``pair`` (:data:`PAIRS`)."""
    return Role(OBJECTIVE_PREFIX + name, pair)


def describe(recorded: Mapping | None) -> str:
    """A file's recorded ``meta["role"]`` in words (as ``str(Role)``), or ``no role``."""
    if not isinstance(recorded, Mapping):
        return "no role"
    try:
        return str(Role(**recorded))
    except (TypeError, ValueError):  # a role this version does not know: shown as recorded
        return f"role {dict(recorded)!r}"


def applied(params: Params, role: Role) -> Params:
    """``params`` as ``role``'s branch applies them: what its writer records and its reader checks.

    ``seed_init`` trains the projector with :data:`SEED_INIT_RECIPE` over ``train_projector``; the
    other branches apply ``params`` as they are.
    """
    if role != SEED_INIT_ROLE:
        return params
    return replaced(params, train_projector=replaced(params.train_projector, **SEED_INIT_RECIPE))
