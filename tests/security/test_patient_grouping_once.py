"""Patient-level DP-SGD grouped the site's PRIVATE patient ids (a stable sort, a count, a split; and a
``np.unique`` for the draw's size) in every request's trainer, so that work, and its time, depending on the
exact number and layout of the patients, ran once per DP-SGD round request. The ids are now grouped ONCE, when
the site's data is opened (``PatientIndex``), and every request reuses the grouped rows."""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.accounting import PrivacyEvent
from feta_release.data.loading import LoadReport, policy_data
from tests.support.federation import tiny_job

CAP = 3
SORTS = (
    (np, "argsort"),
    (np, "unique"),
    (np, "bincount"),
    (torch, "argsort"),
    (torch, "unique"),
    (torch, "bincount"),
)


def _spy_sorts(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count every call of the functions a grouping of ids uses (numpy's and torch's)."""
    calls: Counter[str] = Counter()
    for mod, name in SORTS:
        real = getattr(mod, name)

        def spy(*a: Any, _real: Any = real, _key: str = f"{mod.__name__}.{name}", **k: Any) -> Any:
            calls[_key] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, spy)
    return calls


def _site(seed: int) -> tuple[Any, Any]:
    """A patient-level site as ``Site.open`` makes it: data and the ``PatientIndex`` from ``policy_data``."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, CAP + 1, 9)
    ids = np.repeat(np.arange(len(sizes)), sizes)
    n = len(ids)
    ds = SimpleNamespace(
        images=rng.random((n, 1, 16, 16), dtype=np.float32),
        labels=rng.integers(0, 10, n),
        image_shape=(1, 16, 16),
        n_classes=10,
        n=n,
    )
    pol = SimpleNamespace(privacy_unit="patient", patients=10, patient_cap=CAP)
    report = LoadReport(source="csv", kind="csv", n_images=n, patients=ids, patient_cap=CAP)
    return policy_data(pol, ds, report, data_source="labels.csv", policy_source="policy.toml")


def test_two_dpsgd_requests_on_one_opened_site_group_the_ids_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from edge.releases import dpsgd_round
    from feta_release.models import build_denoiser

    calls = _spy_sorts(monkeypatch)
    ds, index = _site(0)  # the site opens: its ids are grouped here
    assert index is not None
    at_open = sum(calls.values())
    assert at_open >= 1, "the patient ids were not grouped when the site's data was opened"
    cfg = tiny_job(dpsgd={"batch": 4, "physical_batch": 4})
    weights = {k: v.numpy() for k, v in build_denoiser(cfg.model, ds.image_shape, 10).state_dict().items()}
    calls.clear()
    for seed in (1, 2):  # two DP-SGD round requests on the same opened site
        dpsgd_round(
            ds,
            cfg,
            copy.deepcopy(weights),
            PrivacyEvent("dpsgd", 1.5, 4 / 10, 1, "patient"),
            torch.Generator().manual_seed(seed),
            20,
            index,
        )
    assert sum(calls.values()) == 0, f"the requests regrouped the private patient ids: {dict(calls)}"


def _old_grouping(ids: np.ndarray) -> list[torch.Tensor]:
    """The grouping the trainer did per request before the fix (``training.dpsgd._patient_rows``)."""
    t = torch.as_tensor(ids, dtype=torch.int64).flatten()
    order = torch.argsort(t, stable=True)
    counts = torch.bincount(t) if t.numel() else torch.zeros(0, dtype=torch.int64)
    return [r for r in torch.split(order, counts.tolist()) if r.numel()]


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 40), max_size=120))
def test_the_grouping_at_open_is_the_old_per_request_grouping(ids: list[int]) -> None:
    from feta_release.privacy_unit import PatientIndex

    a = np.asarray(ids, dtype=np.int64)
    got = PatientIndex(a, 5, 2).rows
    want = _old_grouping(a)
    assert len(got) == len(want) == len(set(ids))
    for g, w in zip(got, want):
        assert g.dtype == torch.int64 and g.tolist() == w.tolist()


def test_a_trainer_from_the_index_does_not_regroup(monkeypatch: pytest.MonkeyPatch) -> None:
    """A site's DP-SGD round builds its trainer from the same grouped rows
    (``edge.releases``, ``PatientIndex.trainer_kwargs``): no sort either."""
    from feta_release.config import JobConfig
    from feta_release.training.dpsgd import DPSGDTrainer
    from tests.support.dpsgd import DotLoss, Weights

    _, index = _site(3)
    assert index is not None
    calls = _spy_sorts(monkeypatch)
    cfg = JobConfig().replace(dpsgd={"batch": 2, "steps": 1, "physical_batch": 4, "clip": 1.0})
    n = len(index.ids)
    tr = DPSGDTrainer(
        Weights(4), cfg, 1.0, 0.5, torch.Generator().manual_seed(0), loss=DotLoss(), **index.trainer_kwargs()
    )
    tr.noisy_gradient(torch.randn(n, 4), torch.zeros(n, dtype=torch.int64))
    assert sum(calls.values()) == 0, dict(calls)


def test_negative_patient_ids_are_refused_at_open() -> None:
    from feta_release.errors import DataError
    from feta_release.privacy_unit import PatientIndex

    with pytest.raises(DataError, match="patient indices must be >= 0"):
        PatientIndex(np.array([0, -1, 2]), 3, 1)
