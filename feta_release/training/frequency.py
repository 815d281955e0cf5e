"""Frequency warm-up (FETA-Pro stage 2): fit a one-step generator to the noisy RFF statistics, then
train the denoiser on that generator's images (method-details §3).

Generator fit: minimise ``|| E_noisy - E_hat ||_F^2`` over the (features x n_classes) embedding, where
``E_noisy = sum_i phi(x_i) onehot(y_i)^T / N + noise`` was released by
``feta_release.mechanisms.frequency`` and ``E_hat`` is the same statistic of a generator batch.

Labels: BALANCED. Why: E's column c equals p_c * mean_{class c} phi, with p_c the class proportion,
but the class counts are not released (releasing them would cost budget), so the generator cannot
know p_c; the shipped data is balanced; and the DP-SGD stage on real data corrects any residual
class imbalance. Consistently with that choice, every generator batch holds each class equally
often (up to one image when the batch is not a multiple of n_classes) and ``E_hat``'s column c is
``(1 / n_classes) * mean_{b: y_b = c} phi(G(z_b, c))``, i.e. the batch statistic a perfectly balanced
batch would give (for batches that are a multiple of n_classes this is exactly
``sum_b phi(G(z_b, y_b)) onehot(y_b)^T / B``). On imbalanced data the fit therefore matches each
class's mean embedding up to the factor n_classes * p_c, which the generator can only partly absorb
(||phi|| = 1 bounds the per-class mean), and the warm-up images stay balanced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..allocator import release_freed_pages
from ..config import JobConfig
from ..errors import ConfigError, DataError
from ..mechanisms.feature_map import FeatureMap
from ..mechanisms.frequency import rff_features
from ..models.auxgen import AuxEnsemble, AuxGenerator, AuxModel
from ..models.edm import EDMDenoiser
from .augment import to_model_range
from .warmup_loop import Progress, WarmupResult, as_image_tensors, train_denoiser


def _omega_tensor(omega, dim: int, device: torch.device) -> torch.Tensor:
    w = torch.as_tensor(np.asarray(omega) if not isinstance(omega, torch.Tensor) else omega)
    w = w.to(device=device, dtype=torch.float32)
    if w.dim() != 2 or w.shape[0] != dim:
        raise DataError(
            f"frequency warm-up: omega has shape {tuple(w.shape)}, expected ({dim}, features/2) for these "
            "images"
        )
    return w


class _PixelOmega:
    """The pixel map of an explicit omega (callers and tests that pass the frequencies themselves)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.features = w, 2 * w.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rff_features(x.reshape(x.shape[0], -1), self.w)


def _feature_fn(omega, dim: int, device: torch.device) -> FeatureMap | _PixelOmega:
    """The map to fit through: a ``FeatureMap`` as given, or the pixel map of an omega array (dim, F/2)."""
    return omega if isinstance(omega, FeatureMap) else _PixelOmega(_omega_tensor(omega, dim, device))


def embedding_of_batch(phi: torch.Tensor, labels: torch.Tensor, n_classes: int) -> torch.Tensor:
    """(features, n_classes): column c = (1/n_classes) * mean of phi over the batch rows of class c."""
    onehot = torch.nn.functional.one_hot(labels, n_classes).to(phi.dtype)  # (B, K)
    counts = onehot.sum(0).clamp_min(1.0)
    return (phi.T @ onehot) / counts / n_classes


def shuffled_balanced_labels(n: int, n_classes: int, generator: torch.Generator) -> torch.Tensor:
    """n labels, each class floor(n/K) or ceil(n/K) times, in random order."""
    base = torch.arange(n) % n_classes
    # Which classes get the remainder rotates at random, so no class is systematically short.
    shift = int(torch.randint(0, n_classes, (1,), generator=generator).item())
    return ((base + shift) % n_classes)[torch.randperm(n, generator=generator)]


def aux_iterations(cfg: JobConfig, n_public: int) -> int:
    """Steps per epoch of one aux fit: ``[auxgen] iterations_per_epoch``, else the PUBLIC size over the
    batch."""
    a = cfg.auxgen
    return a.iterations_per_epoch if a.iterations_per_epoch is not None else max(1, n_public // a.batch)


@dataclass
class AuxFitResult:
    generator: AuxGenerator
    losses: list[float] = field(default_factory=list)
    steps: int = 0


def fit_aux_generator(
    embedding_noisy,
    omega,
    image_shape: tuple[int, int, int],
    n_classes: int,
    cfg: JobConfig,
    n_public: int,
    *,
    generator: torch.Generator,
    progress: Progress | None = None,
    device: torch.device | str = "cpu",
    return_result: bool = False,
    guide: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
):
    """Fit the auxiliary generator to ``embedding_noisy`` (features, n_classes); returns the generator
    in eval mode (or an :class:`AuxFitResult` with the loss curve when ``return_result``).

    ``guide(images, labels)``: an extra loss term added each step (a function of released values only, so the
    fit stays post-processing)."""
    a = cfg.auxgen
    c, h, w = (int(v) for v in image_shape)
    if h != w:
        raise ConfigError(f"frequency warm-up: images must be square, got {h}x{w}")
    if a.batch < 1 or a.epochs < 0 or a.lr <= 0 or not 0 < a.gamma <= 1:
        raise ConfigError(f"[auxgen] need batch >= 1, epochs >= 0, lr > 0, 0 < gamma <= 1; got {a}")
    dev = torch.device(device)
    dim = c * h * w
    e = torch.as_tensor(
        np.asarray(embedding_noisy) if not isinstance(embedding_noisy, torch.Tensor) else embedding_noisy
    ).to(device=dev, dtype=torch.float32)
    if e.dim() != 2 or e.shape[1] != n_classes:
        raise DataError(
            f"frequency warm-up: released embedding has shape {tuple(e.shape)}, expected (features, "
            f"{n_classes})"
        )
    phi_of = _feature_fn(omega, dim, dev)
    if e.shape[0] != phi_of.features:
        raise DataError(
            f"frequency warm-up: embedding has {e.shape[0]} features but omega gives {phi_of.features}"
        )
    iters = aux_iterations(cfg, n_public)

    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # initial weights follow the stage's generator
        gen = AuxGenerator(c, h, n_classes, z_dim=a.z_dim, width=a.width).to(dev)
    opt = torch.optim.Adam(gen.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=a.gamma)
    result = AuxFitResult(generator=gen)
    total = a.epochs * iters
    gen.train()
    for _epoch in range(a.epochs):
        for _ in range(iters):
            y = shuffled_balanced_labels(a.batch, n_classes, generator).to(dev)
            z = torch.randn((a.batch, a.z_dim), generator=generator).to(dev)
            x = gen(z, y)
            loss = ((e - embedding_of_batch(phi_of(x), y, n_classes)) ** 2).sum()  # the release's own map
            if guide is not None:
                loss = loss + guide(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            result.steps += 1
            result.losses.append(float(loss.detach()))
            if progress is not None:
                progress(result.steps, total, result.losses[-1])
        sched.step()
    gen.eval()
    release_freed_pages()  # the fit's blocks back before the next stage (feta_release.allocator)
    return result if return_result else gen


def fit_aux_restarts(
    embedding_noisy,
    omega,
    image_shape: tuple[int, int, int],
    n_classes: int,
    cfg: JobConfig,
    n_public: int,
    *,
    generator: torch.Generator,
    progress: Progress | None = None,
    device: torch.device | str = "cpu",
) -> AuxModel:
    """``[auxgen] restarts`` fits of the same release, each from the next start ``generator`` gives; the
    ``keep`` with the lowest final loss (mean over the last epoch) are returned, one generator or
    an :class:`AuxEnsemble`.

    Privacy: the losses, and so the choice, are functions of the released embedding and public randomness
    only: post-processing. Why: the start alone moved the aux images' downstream accuracy by up to 0.085 on
    the same release, and images mixed from four starts beat the single fit on every seed measured
    (docs/evaluation.md, "an ensemble of aux-generator fits")."""
    a = cfg.auxgen
    if a.restarts < 1 or not 1 <= a.keep <= a.restarts:
        raise ConfigError(
            f"[auxgen] need restarts >= 1 and 1 <= keep <= restarts, got {a.restarts}, {a.keep}"
        )
    iters = aux_iterations(cfg, n_public)
    per_fit = a.epochs * iters
    fits: list[tuple[float, AuxGenerator]] = []
    for r in range(a.restarts):
        res = fit_aux_generator(
            embedding_noisy,
            omega,
            image_shape,
            n_classes,
            cfg,
            n_public,
            generator=generator,
            device=device,
            return_result=True,
            progress=_offset(progress, r * per_fit, a.restarts * per_fit),
        )
        # no epochs: all tie, first kept
        final = float(np.mean(res.losses[-iters:])) if res.losses else math.inf
        fits.append((final if math.isfinite(final) else math.inf, res.generator))  # a diverged fit sorts last
    kept = [g for _, g in sorted(fits, key=lambda f: f[0])[: a.keep]]  # stable: ties keep the earlier start
    return kept[0] if a.keep == 1 else AuxEnsemble(kept).eval()


def _offset(progress: Progress | None, done: int, total: int) -> Progress | None:
    """One fit's progress as steps ``done + i`` of ``total`` over all the restarts."""
    if progress is None:
        return None
    return lambda i, _n, loss: progress(done + i, total, loss)


# Images per forward pass of an aux-generator draw (the fit's own batch, ``[auxgen] batch``): its activations
# are what a draw holds at once. A draw of the cell prototypes' 1,024 64 px images in one pass held ~4 GiB
# (width 32: 1,024 x 32 x 64 x 64 floats = 537 MB per activation), the peak of a whole 64 px job; at 100 it
# holds a tenth, and the result does not depend on it (eval mode, one latent per label drawn up front, an
# ensemble's member per row counted over the whole draw).
AUX_DRAW_BATCH = 100


def aux_draw(gen: AuxModel, labels: np.ndarray | torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Images of ``labels`` from the fitted generator, one latent per label drawn from ``generator``, in eval
    mode (BatchNorm running statistics: an image does not depend on the others of its batch) and without
    gradients; CPU float32 in [0, 1] (the generator's tanh is mapped there; the clamp only guards
    rounding). A stage of its own (the cell prototypes, the release's pool): its pages go back at its end."""
    images = _aux_forward(gen, labels, generator)
    release_freed_pages()  # the draw's activations back before the next stage (feta_release.allocator)
    return images


def _aux_forward(
    gen: AuxModel, labels: np.ndarray | torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """:func:`aux_draw` without the trim: the latents drawn at once, the images in passes of
    :data:`AUX_DRAW_BATCH`."""
    dev = next(gen.parameters()).device
    was_training = gen.training
    gen.eval()
    try:
        with torch.no_grad():
            z = torch.randn((len(labels), gen.z_dim), generator=generator)
            y = torch.as_tensor(labels, dtype=torch.long)
            parts = [
                _aux_pass(gen, z[i : i + AUX_DRAW_BATCH], y, i, dev)
                for i in range(0, max(1, len(y)), AUX_DRAW_BATCH)  # an empty draw: one empty pass, as before
            ]
            x = parts[0] if len(parts) == 1 else torch.cat(parts)
    finally:
        gen.train(was_training)
    return x.float().clamp(0, 1)


def _aux_pass(gen: AuxModel, z: torch.Tensor, y: torch.Tensor, start: int, dev: torch.device) -> torch.Tensor:
    """Rows ``start ..`` of a draw of labels ``y``: an ensemble counts each label's rows before ``start`` so
    that every row goes to the member one call over all of ``y`` gives it (``AuxEnsemble.forward``)."""
    part = y[start : start + len(z)].to(dev)
    if isinstance(gen, AuxEnsemble):
        seen = torch.bincount(y[:start], minlength=gen.n_classes)
        return gen(z.to(dev), part, seen=seen).cpu()
    return gen(z.to(dev), part).cpu()


def generate_aux_images(
    gen: AuxModel,
    n: int,
    generator: torch.Generator,
    batch: int = 500,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images in [0, 1] (CPU float32) with balanced labels, from the fitted generator (eval mode);
    ``progress(images done, n)`` after each ``batch`` (its latents drawn together); the pages of the draw go
    back at its end."""
    labels = shuffled_balanced_labels(n, gen.n_classes, generator)
    out = []
    for start in range(0, n, batch):
        out.append(_aux_forward(gen, labels[start : start + batch], generator))
        if progress is not None:
            progress(start + len(out[-1]), n)
    images = torch.cat(out) if out else torch.zeros((0, gen.img_channels, gen.img_size, gen.img_size))
    del out  # the batches' own copies freed before the trim, so that their pages go back too
    release_freed_pages()  # the draw's activations back before the next stage (feta_release.allocator)
    # Quantise like stored images so the warm-up sees what a saved set would hold.
    return (images * 255.0).round() / 255.0, labels


def _epoch_batches(x: torch.Tensor, y: torch.Tensor, batch: int, generator: torch.Generator):
    n = x.shape[0]
    while True:
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n, batch):
            idx = perm[start : start + batch]
            yield to_model_range(x[idx]), y[idx]


def frequency_warmup(
    denoiser: EDMDenoiser,
    images,
    labels,
    cfg: JobConfig,
    *,
    generator: torch.Generator,
    progress: Progress | None = None,
) -> WarmupResult:
    """Train ``denoiser`` in place on generator images (N, C, H, W) in [0, 1] for
    ``cfg.warmup.frequency_epochs`` epochs of batch ``cfg.warmup.frequency_batch``; EMA weights end up in
    it."""
    wcfg = cfg.warmup
    if wcfg.frequency_batch < 1:
        raise ConfigError(f"[warmup] frequency_batch must be >= 1, got {wcfg.frequency_batch}")
    x, y = as_image_tensors(images, labels, denoiser.n_classes, "frequency warm-up (generator images)")
    if tuple(x.shape[1:]) != tuple(denoiser.image_shape):
        raise ConfigError(
            f"frequency warm-up: images are {tuple(x.shape[1:])}, model expects {denoiser.image_shape}"
        )
    steps = wcfg.frequency_epochs * math.ceil(x.shape[0] / wcfg.frequency_batch)
    return train_denoiser(
        denoiser,
        _epoch_batches(x, y, wcfg.frequency_batch, generator),
        steps,
        stage="frequency",
        lr=wcfg.lr,
        ema_decay=wcfg.ema,
        label_dropout=cfg.model.label_dropout,
        generator=generator,
        progress=progress,
    )


def run_frequency_stage(
    denoiser: EDMDenoiser,
    embedding_noisy,
    omega,
    cfg: JobConfig,
    n_public: int,
    *,
    generator: torch.Generator,
    fit_progress: Progress | None = None,
    train_progress: Progress | None = None,
) -> tuple[WarmupResult, AuxModel]:
    """Fit the generator, draw ``cfg.warmup.frequency_images`` images, warm the denoiser up on them."""
    dev = next(denoiser.parameters()).device
    gen = fit_aux_restarts(
        embedding_noisy,
        omega,
        denoiser.image_shape,
        denoiser.n_classes,
        cfg,
        n_public,
        generator=generator,
        progress=fit_progress,
        device=dev,
    )
    images, labels = generate_aux_images(gen, cfg.warmup.frequency_images, generator)
    result = frequency_warmup(denoiser, images, labels, cfg, generator=generator, progress=train_progress)
    return result, gen


def frequency_warmup_from_release(
    denoiser: EDMDenoiser,
    release,
    cfg: JobConfig,
    *,
    generator: torch.Generator,
    fit_progress: Progress | None = None,
    train_progress: Progress | None = None,
) -> tuple[WarmupResult, AuxModel]:
    """:func:`run_frequency_stage` from a ``mechanisms.frequency.FrequencyRelease`` (one site's or the
    federation's ``combine_frequency`` result): omega is rebuilt from the release's public seed."""
    c, h, w = denoiser.image_shape
    if release.image_shape is not None and tuple(release.image_shape) != (c, h, w):
        raise DataError(
            f"frequency release is for images {tuple(release.image_shape)}, the model for {(c, h, w)}"
        )
    if release.n_classes != denoiser.n_classes:
        raise DataError(f"frequency release has {release.n_classes} classes, the model {denoiser.n_classes}")
    # the model's shape when unrecorded
    fmap = dataclasses.replace(release, image_shape=(c, h, w)).feature_map()
    return run_frequency_stage(
        denoiser,
        release.embedding,
        fmap,
        cfg,
        release.n_public,
        generator=generator,
        fit_progress=fit_progress,
        train_progress=train_progress,
    )
