"""The computations on released statistics and public inputs that the coordinator runs for every job
(``feta_release.federation.job`` / ``warmup``): public pretraining (``pretrain``), the spatial warm-up
(``spatial``), the aux generator and frequency warm-up (``freq_warmup``), the public cell prototypes
(``prototypes``), and the one public seeding rule (``context``). Nothing here reads a site's images; the
releases they start from were charged at the sites (``edge.protocol``).
"""

from __future__ import annotations

from .context import seed_from
from .freq_warmup import mix_central
from .pretrain import PublicInputs

__all__ = ["PublicInputs", "mix_central", "seed_from"]
