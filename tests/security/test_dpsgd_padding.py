"""The per-site DP-SGD step's work is padded to a public row count (latency side channel, like FedSGD's F2).

Attack: the coordinator times each site's DP-SGD round reply (and another local user reads the worker's CPU
time): both grew with the realised Poisson batches, whose sum over a round is an un-noised count of the site's
private rows (over rounds: its exact size N). Padded, the rows and calls of every step are functions of the
PUBLIC size, rate and physical batch only, and the released update is bit-identical to the unpadded one."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import feta_release.training.dpsgd as dp
from feta_release.accounting import PrivacyEvent
from feta_release.privacy_unit import group_patient_rows
from feta_release.training.padding import padding_chunks, public_batch_bound
from tests.support.dpsgd import SHAPE, TinyDenoiser, patient_layout_bound, patient_layouts_work, random_site
from tests.support.dpsgd import dpsgd_batch as _data
from tests.support.dpsgd import dpsgd_job as _cfg
from tests.support.federation import tiny_job


class DropoutDenoiser(TinyDenoiser):
    """With dropout: vmap draws it from the GLOBAL RNG, which the padding must leave as it found it."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.drop(super().forward(x, sigma, labels))


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every per-example-gradient call (the work that takes time), in order."""
    seen: list[int] = []
    real = dp.per_example_grads

    def counted(model: Any, loss: Any, x: torch.Tensor, *a: Any, **k: Any) -> Any:
        seen.append(int(x.shape[0]))
        return real(model, loss, x, *a, **k)

    monkeypatch.setattr(dp, "per_example_grads", counted)
    return seen


def _train(model_cls: type[nn.Module], seed: int, n: int, steps: int, pad_to: int | None) -> nn.Module:
    torch.manual_seed(1234)  # the same global RNG for both runs (dropout)
    model = model_cls()
    x, y = _data(n, seed=seed)
    cfg = _cfg(batch=4, physical_batch=3)
    tr = dp.DPSGDTrainer(
        model,
        cfg,
        1.3,
        4 / 12,
        torch.Generator().manual_seed(seed),
        image_shape=SHAPE,
        n_classes=3,
        n_public=12,
        pad_to=pad_to,
    )
    tr.run(x, y, steps)
    return tr.ema_model()


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(4, 20), dropout=st.booleans())
def test_a_padded_step_releases_bit_identically_the_unpadded_update(seed, n, dropout):
    cls = DropoutDenoiser if dropout else TinyDenoiser
    bound = public_batch_bound(12, 4 / 12, 3)
    plain = _train(cls, seed, n, 3, None)
    padded = _train(cls, seed, n, 3, bound)
    for (name, a), (_, b) in zip(plain.state_dict().items(), padded.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_rows_and_calls_of_a_step_depend_only_on_public_values(monkeypatch):
    seen = _counting(monkeypatch)
    bound = public_batch_bound(12, 4 / 12, 3)
    per_step = []
    for seed in range(6):
        for n in (8, 12, 16):  # the exact size differs; the public size (12) does not
            seen.clear()
            _train(TinyDenoiser, seed, n, 1, bound)
            per_step.append((sum(seen), len(seen)))
    assert set(per_step) == {(bound, -(-bound // 3) + 1)}, sorted(set(per_step))


def test_without_padding_the_rows_counted_the_sample(monkeypatch):
    """What the padding removes: unpadded, the rows of a step are the realised Poisson batch."""
    seen = _counting(monkeypatch)
    sizes = set()
    for seed in range(12):
        seen.clear()
        _train(TinyDenoiser, seed, 12, 1, None)
        sizes.add(sum(seen))
    assert len(sizes) > 1


@given(
    real=st.integers(0, 400), chunk=st.integers(1, 64), n_public=st.integers(1, 2000), q=st.floats(1e-3, 1.0)
)
def test_padding_chunks_fill_the_public_bound_in_a_public_number_of_calls(real, chunk, n_public, q):
    bound = public_batch_bound(n_public, q, chunk)
    assert bound % chunk == 0 and bound >= q * n_public
    sizes = padding_chunks(real, bound, chunk)
    assert all(1 <= s <= chunk for s in sizes)
    if real >= bound:
        assert sizes == []
        return
    assert real + sum(sizes) == bound
    calls = -(-real // chunk) + len(sizes)
    if bound - real >= -(-bound // chunk) + 1:
        assert calls == -(-bound // chunk) + 1


def test_the_bound_is_exceeded_rarely():
    n, q, chunk = 1333, 64 / 1333, 16
    bound = public_batch_bound(n, q, chunk)
    from scipy.stats import binom

    assert binom.sf(bound, n, q) < 3e-7 and bound < q * n + 6 * math.sqrt(n * q) + chunk


def test_the_nodes_dpsgd_round_processes_a_public_number_of_rows(monkeypatch):
    """``edge.releases.dpsgd_round`` (the per-site round the coordinator times): the same rows whatever the
    site's exact count, for a fixed public size and plan."""
    from edge.releases import dpsgd_round

    seen = _counting(monkeypatch)
    converted: list[int] = []
    from_numpy = torch.from_numpy

    def counted(a: np.ndarray) -> torch.Tensor:
        if a.shape[1:] == (1, 16, 16):  # image arrays (not weights or labels)
            converted.append(int(a.shape[0]))
        return from_numpy(a)

    monkeypatch.setattr(torch, "from_numpy", counted)
    cfg = tiny_job(dpsgd={"batch": 4, "physical_batch": 4})
    event = PrivacyEvent("dpsgd", 1.5, 4 / 20, 1)
    rows = set()
    for n, seed in ((10, 0), (17, 2)):
        ds, weights = random_site(n, seed, cfg)
        seen.clear()
        converted.clear()
        dpsgd_round(ds, cfg, copy.deepcopy(weights), event, torch.Generator().manual_seed(seed), 20)
        rows.add((sum(seen), sum(converted)))
    # steps: the public step bound; the images converted: the rows those steps index (the same public bound),
    # never a pass over the exact N
    bound = public_batch_bound(20, 4 / 20, 4)
    assert rows == {(bound, bound)}


def test_a_site_above_its_public_size_pads_to_its_bucket_not_to_the_public_size(monkeypatch):
    """The step bound came from the public size even for a site holding more images; its samples then
    exceeded the bound about half the time, were processed whole, and their time counted |B| (so N). The bound
    now comes from ``public_rows`` (the bucket the padded whole-dataset passes already reveal): constant
    rows."""
    from edge.releases import dpsgd_round
    from feta_release.training.padding import public_rows

    seen = _counting(monkeypatch)
    cfg = tiny_job(dpsgd={"batch": 4, "physical_batch": 4})
    event = PrivacyEvent("dpsgd", 1.5, 4 / 20, 12)
    totals = set()
    for n, seed in ((75, 0), (80, 1), (78, 2)):
        ds, weights = random_site(n, seed, cfg)
        seen.clear()
        dpsgd_round(ds, cfg, copy.deepcopy(weights), event, torch.Generator().manual_seed(seed), 20)
        totals.add(sum(seen))
    assert totals == {12 * public_batch_bound(public_rows(80, 20), 4 / 20, 4)}


def _train_patients(seed: int, n: int, pad_to: int | None) -> tuple[nn.Module, int]:
    """Patient-level: patients of 1..3 images (a private layout), 6 public patients, at most 3 images each."""
    torch.manual_seed(99)
    g = torch.Generator().manual_seed(seed)
    sizes = (torch.randint(1, 4, (n,), generator=g)).tolist()
    ids = torch.repeat_interleave(torch.arange(n), torch.tensor(sizes))
    x, y = _data(int(ids.numel()), seed=seed)
    tr = dp.DPSGDTrainer(
        TinyDenoiser(),
        _cfg(batch=2, physical_batch=3),
        1.3,
        2 / 6,
        torch.Generator().manual_seed(seed),
        image_shape=SHAPE,
        n_classes=3,
        n_public=6,
        patient_rows=group_patient_rows(ids.numpy()),
        images_per_patient=3,
        pad_to=pad_to,
    )
    tr.run(x, y, 2)
    return tr.ema_model(), int(ids.numel())


def test_a_patient_level_step_is_padded_to_a_public_image_count_and_releases_the_same_update(monkeypatch):
    from feta_release.training.padding import step_bound

    seen = _counting(monkeypatch)
    bound = step_bound(12, 2 / 6, 3, SimpleNamespace(cap=3))  # 12: the public nominal image count
    rows = set()
    for seed, n in ((0, 4), (1, 6), (2, 8)):
        seen.clear()
        padded, _ = _train_patients(seed, n, bound)
        rows.add(sum(seen))
        plain, _ = _train_patients(seed, n, None)
        for (name, a), (_, b) in zip(plain.state_dict().items(), padded.state_dict().items()):
            assert torch.equal(a, b), name
    assert rows == {2 * bound}


def test_a_patient_level_steps_clip_work_is_the_public_bound_whatever_the_patients(monkeypatch):
    """The clip: each real call clips one group row per image (its patients' sums, the rest zero), the
    padding calls one per dummy row, so the rows clipped per step total the public bound, not a count of the
    sampled patients (whose number is an un-noised function of the data), for any layout of the same
    images."""
    clipped: list[int] = []
    real = dp.clip_and_sum

    def counted(grads: dict[str, torch.Tensor], clip: float, **kw: Any) -> Any:
        clipped.append(int(next(iter(grads.values())).shape[0]))
        return real(grads, clip, **kw)

    monkeypatch.setattr(dp, "clip_and_sum", counted)
    bound = patient_layout_bound()
    seen = patient_layouts_work(clipped, seeds=3)
    assert seen == {(bound, -(-bound // 3) + 1)}, sorted(seen)


def _train_from(images: Any, labels: torch.Tensor, seed: int, pad_to: int) -> nn.Module:
    torch.manual_seed(1234)
    tr = dp.DPSGDTrainer(
        TinyDenoiser(),
        _cfg(batch=4, physical_batch=3),
        1.3,
        4 / 12,
        torch.Generator().manual_seed(seed),
        image_shape=SHAPE,
        n_classes=3,
        n_public=12,
        pad_to=pad_to,
    )
    tr.run(images, labels, 3)
    return tr.ema_model()


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(4, 20))
def test_rows_converted_per_batch_train_bit_identically_to_the_whole_set_converted(seed, n):
    """The node no longer holds a [-1, 1] copy of its whole site (3.2 GB more at 100,000 images of 64x64):
    each indexed batch is converted with the same arithmetic, so the released update is the same bits."""
    from feta_release.training.padding import model_range, model_range_rows

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(n, *SHAPE)).astype(np.float32) / np.float32(255)
    labels = torch.from_numpy(rng.integers(0, 3, n))
    bound = public_batch_bound(12, 4 / 12, 3)
    whole = _train_from(model_range(pixels, 12), labels, seed, bound)
    rows = _train_from(model_range_rows(pixels), labels, seed, bound)
    for (name, a), (_, b) in zip(whole.state_dict().items(), rows.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_rows_converted_in_a_step_are_the_public_bound_whatever_the_site_size(monkeypatch):
    """Conversion happens only for indexed rows: the Poisson batch plus the padding rows, i.e. the step's
    public bound, for a site of 6 or of 20 images (no pass over the N rows left to time)."""
    from feta_release.training import padding

    bound = public_batch_bound(12, 4 / 12, 3)
    counts = []
    for n in (6, 20):
        seen: list[int] = []
        rows = padding.model_range_rows(np.zeros((n, *SHAPE), dtype=np.float32))
        real = padding.ModelRangeRows.__getitem__
        monkeypatch.setattr(
            padding.ModelRangeRows,
            "__getitem__",
            lambda self, idx, real=real, seen=seen: (seen.append(int(idx.numel())), real(self, idx))[1],
        )
        _train_from(rows, torch.arange(n) % 3, 7, bound)
        counts.append(sum(seen))
    assert counts[0] == counts[1] == 3 * bound
