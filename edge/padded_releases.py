"""One-shot releases (central images, frequency statistics) padded to the site's PUBLIC size.

Their work grows with the site's exact count N (every image is downsampled and clipped, or mapped to its
random features) and with the realised Poisson samples (central images): the reply's latency, which the
coordinator sees, and the worker's CPU time, which other local users see, would count private rows. After
the real release, the same computation runs once more, on P - N dummy rows (blank images, classes in turn),
with FRESH randomness of its own, and its result is dropped:

  * rows: N + (P - N) = P, public (P = the policy's nominal size, or, for a site holding more images than
    that, the nominal size doubled until it covers them: only that bucket is then revealed);
  * sampled rows: Binomial(N, q) + Binomial(P - N, q) has the law Binomial(P, q) whatever N is, because the
    dummy rows are sampled with fresh secret randomness (a fixed seed would let an observer subtract them);
  * the release itself is untouched (the real computation, its generator and its output are the unpadded
    ones).

The padding runs the SAME function as the release (for the per-site releases, the very function the handler
called), so it follows that function's cost whatever it becomes.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np

from feta_release.mechanisms import secure_sums as ss
from feta_release.randomness import os_numpy_generator
from feta_release.training.padding import public_rows

T = TypeVar("T")


def dummy_data(ds: Any, rows: int) -> SimpleNamespace:
    """``rows`` blank images of ``ds``'s shape, classes in turn: the same cost per row as real images."""
    shape = tuple(int(v) for v in np.asarray(ds.images).shape[1:])
    k = int(ds.n_classes)
    return SimpleNamespace(
        images=np.zeros((rows, *shape), dtype=np.float32),
        labels=np.arange(rows, dtype=np.int64) % k,
        n_classes=k,
        image_shape=shape,
        n=rows,
        class_names=list(getattr(ds, "class_names", [])),
        patients=None,
    )


def padded(release: Callable[..., T], ds: Any, cfg: Any, n_public: int, rng: np.random.Generator) -> T:
    """``release(ds, cfg, n_public, rng)``, then the same on the dummy rows that make the work public."""
    out = release(ds, cfg, n_public, rng)
    rows = public_rows(len(ds.images), n_public) - len(ds.images)
    if rows > 0:
        release(dummy_data(ds, rows), cfg, n_public, os_numpy_generator())  # dropped: work only
    return out


def pad_secure(ds: Any, cfg: Any, n_public: int, phase: str, n_sites: int, modulus_bits: int = 64) -> int:
    """The padding of a site's secure-sum contribution for ``phase``: the SAME contribution function as the
    charged release (``secure_sums.job_contribution``, cells included) on the dummy rows, result dropped.
    Returns the dummy rows processed."""
    rows = public_rows(len(ds.images), n_public) - len(ds.images)
    if rows <= 0:
        return 0
    d = dummy_data(ds, rows)
    ss.job_contribution(
        phase,
        d.images,
        d.labels,
        d.n_classes,
        cfg,
        n_public=n_public,
        n_sites=n_sites,
        modulus_bits=modulus_bits,
        rng=os_numpy_generator(),
    )
    return rows
