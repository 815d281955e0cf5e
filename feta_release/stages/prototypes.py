"""Public cell prototypes for ``[central] cell_rule = "aux"``: k-means centres of aux-generator images.

The aux generator is fitted to the RELEASED frequency statistics only, and its images are drawn from the job's
PUBLIC seed, so the prototypes are post-processing of that release: the central release may split each class
by them (``mechanisms.central.prototype_cells``) at no privacy cost beyond its own event. Plain Lloyd
iterations written here because they are a few lines over a few hundred public images (no library dependency
for it).

Measured (validation, epsilon = 10 central setting, 2 noise seeds, release-only classifier): 4 prototype cells
0.859 vs 4 slant cells 0.834 (docs/evaluation.md).
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import JobConfig
from ..mechanisms.central import nearest
from ..models.auxgen import AuxModel
from ..progress_events import PROTOTYPES, Meter, Sink
from ..training.frequency import aux_draw
from .context import public_generator

PER_CLASS = 256  # aux images per class the centres are fitted to
ITERATIONS = 30


def kmeans(x: np.ndarray, k: int, rng: np.random.Generator, iterations: int = ITERATIONS) -> np.ndarray:
    """(k, d) centres of the rows of ``x`` (m >= k, d): k-means++ seeding, then Lloyd iterations; an empty
    cluster keeps its centre."""
    centres = [x[rng.integers(len(x))]]
    for _ in range(1, k):
        d2 = np.min(((x[:, None, :] - np.asarray(centres)[None]) ** 2).sum(-1), axis=1)
        p = d2 / d2.sum() if d2.sum() > 0 else np.full(len(x), 1.0 / len(x))
        centres.append(x[rng.choice(len(x), p=p)])
    c = np.asarray(centres, dtype=np.float64)
    for _ in range(iterations):
        near = nearest(x, c)
        c = np.asarray([x[near == j].mean(0) if (near == j).any() else c[j] for j in range(k)])
    return c


def cell_prototypes(aux: AuxModel, cfg: JobConfig, sink: Sink | None = None) -> np.ndarray:
    """(n_classes, cells, C*H*W) float64 prototypes in [0, 1]: per class, ``cells`` k-means centres of
    :data:`PER_CLASS` aux-generator images drawn from the public generator ``cell-prototypes``; the classes
    done reported to ``sink``."""
    n, cells = aux.n_classes, cfg.central.cells
    meter = Meter(sink, PROTOTYPES, "classes", n, f"from the aux generator ({cells} per class)")
    labels = np.repeat(np.arange(n, dtype=np.int64), PER_CLASS)
    images = aux_draw(aux, labels, public_generator(cfg, "cell-prototypes")).reshape(n, PER_CLASS, -1)
    rng = np.random.default_rng(
        int(torch.randint(0, 2**31 - 1, (1,), generator=public_generator(cfg, "kmeans")))
    )
    centres = []
    for k in range(n):
        centres.append(kmeans(images[k].numpy().astype(np.float64), cells, rng))
        meter(k + 1)
    meter.end()
    return np.stack(centres)
