"""The stage layer: a run is these stages in order, each a small object with ``enabled(cfg)`` and ``run(ctx)``
over one typed :class:`RunContext`. Drivers (``feta_release.training.pipeline`` for ``train``) build the
context and loop; the privacy events every stage charges come from ``feta_release.planning``.
"""

from __future__ import annotations

from .account import RunAccount, run_budget
from .base import Stage
from .central import CentralStage
from .context import RunContext, RunDir, seed_from
from .dpsgd import DpsgdTraining, SimulatedKill
from .freq_warmup import FrequencyWarmup, mix_central
from .frequency import FrequencyStage
from .pretrain import PublicInputs, PublicPretraining
from .spatial import SpatialWarmup
from .synthesis import Synthesis

# The frequency release runs first only for [central] cell_rule = "aux" (its prototypes come from the aux
# generator). Public pretraining comes first: the model knows the public set before any private image.
STAGES: tuple[Stage, ...] = (
    PublicPretraining(),
    FrequencyStage(early=True),
    CentralStage(),
    SpatialWarmup(),
    FrequencyStage(),
    FrequencyWarmup(),
    DpsgdTraining(),
    Synthesis(),
)

__all__ = [
    "STAGES",
    "PublicInputs",
    "RunAccount",
    "RunContext",
    "RunDir",
    "SimulatedKill",
    "Stage",
    "mix_central",
    "run_budget",
    "seed_from",
]
