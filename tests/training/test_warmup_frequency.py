"""Frequency warm-up: auxiliary generator fit to RFF statistics, its images, denoiser warm-up on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feta_release.errors import ConfigError, DataError
from feta_release.mechanisms.frequency import rff_features
from feta_release.models import AuxGenerator, build_denoiser
from feta_release.training.frequency import (
    embedding_of_batch,
    fit_aux_generator,
    frequency_warmup,
    generate_aux_images,
    run_frequency_stage,
    shuffled_balanced_labels,
)
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)
from tests.support.training import AUX, TINY, bars, fixed_noise_loss, job
from tests.support.training import frequency_release as _release


def _mmd(emb: torch.Tensor, omega: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> float:
    phi = rff_features(images.reshape(len(images), -1), omega)
    return float(((emb - embedding_of_batch(phi, labels, emb.shape[1])) ** 2).sum())


def test_batch_embedding_matches_reference_formula_for_balanced_batches() -> None:
    phi = torch.randn(12, 5)
    y = torch.tensor([0, 1, 2] * 4)
    ref = phi.T @ torch.nn.functional.one_hot(y, 3).float() / 12
    assert torch.allclose(embedding_of_batch(phi, y, 3), ref, atol=1e-6)


def test_balanced_labels() -> None:
    g = torch.Generator().manual_seed(0)
    counts = shuffled_balanced_labels(23, 5, g).bincount(minlength=5)
    assert counts.sum() == 23 and counts.max() - counts.min() <= 1


def test_fit_reduces_mmd_and_eval_images_match() -> None:
    rel, x, y = _release()
    emb, omega = torch.from_numpy(rel.embedding), rel.omega()
    cfg = job(auxgen=AUX)
    res = fit_aux_generator(
        emb, omega, (1, 8, 8), 2, cfg, 6, generator=torch.Generator().manual_seed(0), return_result=True
    )
    assert res.steps == 90 and len(res.losses) == 90
    assert np.mean(res.losses[-10:]) < 0.3 * res.losses[0]
    # Fresh images from the fitted generator (eval mode, what the warm-up uses) match the statistic too.
    imgs, labels = generate_aux_images(res.generator, 200, torch.Generator().manual_seed(1))
    assert imgs.shape == (200, 1, 8, 8) and imgs.min() >= 0 and imgs.max() <= 1
    assert torch.equal(labels.bincount(), torch.tensor([100, 100]))
    untrained = AuxGenerator(1, 8, 2, z_dim=8, width=8)
    untrained.train()
    with torch.no_grad():
        lab0 = shuffled_balanced_labels(200, 2, torch.Generator())
        base = _mmd(emb, omega, untrained(torch.randn(200, 8), lab0), lab0)
    assert _mmd(emb, omega, imgs, labels) < 0.3 * base


def test_fit_is_deterministic_given_generator() -> None:
    rel, _, _ = _release()
    cfg = job(auxgen={**AUX, "epochs": 1, "iterations_per_epoch": 3})
    outs = []
    for _ in range(2):
        gen = fit_aux_generator(
            rel.embedding, rel.omega(), (1, 8, 8), 2, cfg, 6, generator=torch.Generator().manual_seed(3)
        )
        outs.append(generate_aux_images(gen, 10, torch.Generator().manual_seed(4))[0])
    assert torch.equal(outs[0], outs[1])


def test_the_fit_adds_a_guide_term_each_step_and_without_one_is_unchanged() -> None:
    """``guide(images, labels)`` is added to every step's loss: a zero guide leaves the fit bit-identical, and
    a guide that rewards bright pixels makes the generator's images brighter."""
    rel, _, _ = _release()
    cfg = job(auxgen={**AUX, "epochs": 1, "iterations_per_epoch": 20})
    calls: list[tuple[int, ...]] = []

    def fit(guide):  # noqa: ANN001, ANN202
        gen = fit_aux_generator(
            rel.embedding,
            rel.omega(),
            (1, 8, 8),
            2,
            cfg,
            6,
            generator=torch.Generator().manual_seed(3),
            guide=guide,
        )
        return generate_aux_images(gen, 50, torch.Generator().manual_seed(4))[0]

    plain = fit(None)
    zero = fit(lambda x, y: calls.append((x.shape[0], y.shape[0])) or 0.0 * x.sum())
    assert torch.equal(plain, zero) and calls == [(20, 20)] * 20
    bright = fit(lambda x, y: -x.mean())
    assert float(bright.mean()) > float(plain.mean()) + 0.05


def test_fit_refuses_mismatched_statistics() -> None:
    rel, _, _ = _release()
    cfg = job(auxgen=AUX)
    g = torch.Generator()
    with pytest.raises(DataError, match="omega"):
        fit_aux_generator(rel.embedding, rel.omega(), (1, 16, 16), 2, cfg, 6, generator=g)
    with pytest.raises(DataError, match="embedding"):
        fit_aux_generator(rel.embedding[:, :1], rel.omega(), (1, 8, 8), 2, cfg, 6, generator=g)
    with pytest.raises(DataError, match="features"):
        fit_aux_generator(rel.embedding[:10], rel.omega(), (1, 8, 8), 2, cfg, 6, generator=g)
    with pytest.raises(ConfigError):
        fit_aux_generator(rel.embedding, rel.omega(), (1, 8, 4), 2, cfg, 6, generator=g)


def test_frequency_warmup_trains_denoiser() -> None:
    torch.manual_seed(0)
    x, y = bars(3)  # stand-in for generator images: 16x16, two classes
    d = build_denoiser(TINY, (1, 16, 16), 2)
    cfg = job(warmup={"frequency_epochs": 30, "frequency_batch": 4, "lr": 2e-3, "ema": 0.99})
    before = fixed_noise_loss(d, x, y)
    res = frequency_warmup(d, x, y, cfg, generator=torch.Generator().manual_seed(0))
    assert res.steps == 30 * 2 and res.stage == "frequency"
    assert fixed_noise_loss(d, x, y) < 0.7 * before
    with pytest.raises(ConfigError):
        frequency_warmup(d, torch.zeros(2, 1, 8, 8), y[:2], cfg, generator=torch.Generator())


def test_run_frequency_stage_end_to_end() -> None:
    rel, _, _ = _release()
    d = build_denoiser(TINY, (1, 8, 8), 2)
    cfg = job(
        auxgen={**AUX, "epochs": 1, "iterations_per_epoch": 5},
        warmup={"frequency_images": 40, "frequency_epochs": 1, "frequency_batch": 20},
    )
    fit_calls: list[int] = []
    res, gen = run_frequency_stage(
        d,
        rel.embedding,
        rel.omega(),
        cfg,
        6,
        generator=torch.Generator().manual_seed(0),
        fit_progress=lambda s, t, loss: fit_calls.append(t),
    )
    assert fit_calls == [5] * 5 and res.steps == 2 and isinstance(gen, AuxGenerator)


def test_frequency_warmup_from_release() -> None:
    from feta_release.training.frequency import frequency_warmup_from_release

    rel, _, _ = _release()
    d = build_denoiser(TINY, (1, 8, 8), 2)
    cfg = job(
        auxgen={**AUX, "epochs": 1, "iterations_per_epoch": 2},
        warmup={"frequency_images": 20, "frequency_epochs": 1, "frequency_batch": 20},
    )
    res, _ = frequency_warmup_from_release(d, rel, cfg, generator=torch.Generator().manual_seed(0))
    assert res.steps == 1
    with pytest.raises(DataError, match="images"):
        frequency_warmup_from_release(
            build_denoiser(TINY, (1, 16, 16), 2), rel, cfg, generator=torch.Generator()
        )
