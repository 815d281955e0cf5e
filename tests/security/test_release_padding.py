"""The one-shot releases' work is padded to the site's public size (latency side channel).

Attack: the coordinator times a site's central-images or frequency reply (another local user reads the
worker's CPU time). Every image is prepared (central) or mapped to its random features (frequency), and the
central rounds sum a Poisson sample: the time counted the exact N and the realised samples. Padded, the rows
processed are the public size P and the sampled rows are Binomial(P, q) whatever N is; the release is
unchanged."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import edge.clientapp as ca
import feta_release.mechanisms.central as central_mod
import feta_release.mechanisms.feature_map as fmap_mod
import feta_release.mechanisms.frequency as freq_mod
import feta_release.mechanisms.secure_sums as ss
from edge.padded_releases import pad_secure, padded, public_rows
from edge.protocol import ReleaseRng
from edge.releases import release_central, release_frequency
from tests.support.federation import full_job

N_PUBLIC = 40


_NO_ARRAYS = SimpleNamespace(arrays={})  # a central request without cell prototypes (the slant rule)


def _ds(n: int, seed: int = 0) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    return SimpleNamespace(
        images=rng.random((n, 1, 28, 28), dtype=np.float32),
        labels=np.arange(n) % 10,
        n_classes=10,
        image_shape=(1, 28, 28),
        n=n,
        class_names=[str(i) for i in range(10)],
    )


def _site(n: int) -> SimpleNamespace:
    return SimpleNamespace(data=_ds(n), n_public=N_PUBLIC, site_id="site-a")


def _job() -> SimpleNamespace:
    return SimpleNamespace(config=full_job(), sites=["site-a", "site-b", "site-c"])


def _rows(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Rows of the first argument of every call of ``module.name``."""
    seen: list[int] = []
    real = getattr(module, name)

    def counted(x: Any, *a: Any, **k: Any) -> Any:
        seen.append(int(np.asarray(x).shape[0]))
        return real(x, *a, **k)

    monkeypatch.setattr(module, name, counted)
    return seen


@pytest.mark.parametrize("n", [12, 25, 40])
def test_the_central_release_prepares_the_public_number_of_rows(monkeypatch, n):
    seen = _rows(monkeypatch, central_mod, "_prepare")
    ca.central.__wrapped__(_site(n), _job(), _NO_ARRAYS, ReleaseRng())
    assert sum(seen) == N_PUBLIC


@pytest.mark.parametrize("n", [12, 25, 40])
def test_the_frequency_release_maps_the_public_number_of_rows(monkeypatch, n):
    seen = _rows(monkeypatch, freq_mod, "embedding_sum")
    ca.frequency.__wrapped__(_site(n), _job(), None, ReleaseRng())
    assert sum(seen) == N_PUBLIC


def test_the_central_samples_sum_to_a_binomial_of_the_public_size(monkeypatch):
    """Sampled rows (what the rounds' sums take time over), over many releases: mean q * P, not q * N."""
    seen = _rows(monkeypatch, central_mod, "_class_sums")
    cfg = full_job().central
    q, runs, n = cfg.batch / N_PUBLIC, 200, 8
    totals = []
    for _ in range(runs):
        seen.clear()
        ca.central.__wrapped__(_site(n), _job(), _NO_ARRAYS, ReleaseRng())
        totals.append(sum(seen))
    mean, want = float(np.mean(totals)), cfg.rounds * q * N_PUBLIC
    sd = math.sqrt(cfg.rounds * N_PUBLIC * q * (1 - q) / runs)
    assert abs(mean - want) < 5 * sd, (mean, want, sd)


@pytest.mark.parametrize("release", [release_central, release_frequency])
def test_padding_leaves_the_release_bit_identical(release):
    ds, cfg = _ds(17, seed=3), full_job()
    plain, ev_plain = release(ds, cfg, N_PUBLIC, np.random.default_rng(5))
    pad, ev_pad = padded(release, ds, cfg, N_PUBLIC, np.random.default_rng(5))
    assert ev_plain == ev_pad and plain.keys() == pad.keys()
    for k in plain:
        assert np.array_equal(plain[k], pad[k]), k


@pytest.mark.parametrize("phase,fn", [("central", "_prepare"), ("frequency", "rff_features")])
def test_a_secure_contribution_processes_the_public_number_of_rows(monkeypatch, phase, fn):
    """The masked handlers (secure aggregation): the contribution's rows plus the padding's are P."""
    # the map's own
    seen = _rows(monkeypatch, ss, fn) if phase == "central" else _rows(monkeypatch, fmap_mod, fn)

    def contribution(site: Any, job: Any, doc: Any, rng: Any) -> np.ndarray:  # what edge.secure computes
        d = site.data
        return ss.job_contribution(
            phase,
            d.images,
            d.labels,
            10,
            job.config,
            n_public=site.n_public,
            n_sites=3,
            modulus_bits=64,
            rng=rng,
        )

    monkeypatch.setattr(ca, "masked_contribution", contribution)
    handler = ca.central_masked if phase == "central" else ca.frequency_masked
    req = SimpleNamespace(doc={}, event=None)
    handler.__wrapped__(_site(13), _job(), req, ReleaseRng())
    assert sum(seen) == N_PUBLIC


def test_the_secure_central_padding_prepares_the_slant_cells_of_the_public_number_of_rows(monkeypatch):
    """With ``[central] cells > 1`` the real contribution computes each image's slant cell; the padding
    ran the contribution WITHOUT cells, so the dummy rows skipped that work and the time still counted N."""
    seen = _rows(monkeypatch, central_mod, "image_slant")  # only computed for cells > 1
    job = SimpleNamespace(
        config=full_job(central={"cells": 4, "kind": "mean"}), sites=["site-a", "site-b", "site-c"]
    )

    def contribution(site: Any, job: Any, doc: Any, rng: Any) -> np.ndarray:  # what edge.secure computes
        d = site.data
        return ss.job_contribution(
            "central",
            d.images,
            d.labels,
            10,
            job.config,
            n_public=site.n_public,
            n_sites=3,
            modulus_bits=64,
            rng=rng,
        )

    monkeypatch.setattr(ca, "masked_contribution", contribution)
    ca.central_masked.__wrapped__(_site(13), job, SimpleNamespace(doc={}, event=None), ReleaseRng())
    assert sum(seen) == N_PUBLIC


def test_a_site_holding_more_than_its_public_size_reveals_only_a_doubling_bucket():
    assert [public_rows(n, 40) for n in (1, 39, 40, 41, 80, 81)] == [40, 40, 40, 80, 80, 160]
    assert pad_secure(_ds(40), full_job(), 40, "central", 3) == 0
