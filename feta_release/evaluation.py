"""Utility, fidelity and diversity of a synthetic dataset, measured against REAL held-out images.

Protocol (``evaluate``; DPImageBench's rule: nothing is chosen on the real held-out images):

- Downstream accuracy: the evaluation classifier (:mod:`feta_release.eval_classifier`: a small ResNet with
  global max + mean pooling, so a few-pixel finding is not averaged away) is trained on the synthetic images,
  early-stopped on a stratified 10 % validation part of the SYNTHETIC images, and scored once on the real
  held-out images (overall and per class).
- Real-data ceiling, reported beside every accuracy: the same classifier trained on REAL images and scored on
  real images it never saw. With ``real_train`` (real training images disjoint from the held-out set, e.g. the
  split the synthesizer was trained on) it is trained there and scored on the whole held-out set: the directly
  comparable figure. Without it the held-out set is split in two stratified halves and the classifier is
  cross-fitted (trained on one half, scored on the other, both ways; every held-out image is scored once, by
  the net that did not see it). That ceiling is trained on only half the held-out images, so it is a LOW
  estimate of what real data of the synthetic set's size would give, and says so in its protocol field.
- ``FD (classifier features)``: Fréchet distance between real held-out and synthetic images in the pooled
  features of the same kind of network trained on the real held-out images. No Inception weights exist
  offline, so this is NOT FID and is never called that; its scale depends on the feature network, so compare
  figures only when produced with the same real data, seed and sample size. Both sides are subsampled to the
  same n (FD grows as samples shrink).
- Precision / recall (Kynkäänniemi et al. 2019) and density / coverage (Naeem et al. 2020) with k = 5 nearest
  neighbours, in the same features and on the same equal-n samples: precision and density measure fidelity (do
  synthetic images fall where real ones lie?), recall and coverage diversity (is every part of the real
  distribution reached?). Written here with torch (pairwise distances): no installed library computes them.

Warnings name every figure that rests on too little: FD / PRDC on fewer than max(500, 5 x feature dimension)
images per side, a feature network trained fewer than ``MIN_FEATURE_EPOCHS`` epochs or not converged, a
classifier that hit its epoch cap before its validation loss settled, missing classes.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .data import ImageDataset
from .errors import DataError
from .eval_classifier import (
    DEFAULT_BATCH,
    DEFAULT_LR,
    FitLog,
    ResNetClassifier,
    random_shift,
    train_classifier,
    validation_split,
)
from .training.progress import Reporter
from .viz import save_grid

__all__ = [
    "FD_NAME",
    "ResNetClassifier",
    "accuracy",
    "evaluate",
    "extract_features",
    "frechet_distance",
    "frechet_distance_from_features",
    "prdc_from_features",
    "random_shift",
    "real_ceiling",
    "train_classifier",
]

FD_NAME = "FD (classifier features)"
PRDC_K = 5
MIN_FEATURE_EPOCHS = 10  # fewer: the feature space is barely trained, FD / PRDC may be insensitive
# and at least 5 x the feature dimension (the covariance needs many more samples than dims)
MIN_FD_IMAGES = 500


def predict(net: nn.Module, images: np.ndarray, batch_size: int = 500) -> np.ndarray:
    """Predicted labels (int64) for float32 images (N, C, H, W) in [0, 1]."""
    net.eval()
    # a block, not torch's decorator, which made this function Any to mypy and left its callers unchecked
    # (torch is skipped by mypy); inference mode: the labels leave as numpy, nothing differentiates them
    with torch.inference_mode():
        out = [
            net(torch.from_numpy(np.ascontiguousarray(images[i : i + batch_size]))).argmax(1)
            for i in range(0, len(images), batch_size)
        ]
        return torch.cat(out).numpy().astype(np.int64)


def accuracy(net: nn.Module, ds: ImageDataset) -> float:
    return float((predict(net, ds.images) == ds.labels).mean())


def per_class_accuracy(net: nn.Module, ds: ImageDataset) -> dict[str, float]:
    return _per_class(predict(net, ds.images), ds)


def _per_class(pred: np.ndarray, ds: ImageDataset) -> dict[str, float]:
    return {
        name: float((pred[ds.labels == c] == c).mean()) if (ds.labels == c).any() else float("nan")
        for c, name in enumerate(ds.class_names)
    }


def check_compatible(synthetic: ImageDataset, real: ImageDataset) -> None:
    """Same class names (same order) and image shape, else a DataError that shows both."""
    if synthetic.class_names != real.class_names:
        raise DataError(
            f"class names differ: synthetic {synthetic.source or '<synthetic>'} has "
            f"{list(synthetic.class_names)}, real {real.source or '<real>'} has {list(real.class_names)}; "
            "they must match (same names, same order)"
        )
    if synthetic.image_shape != real.image_shape:
        raise DataError(
            f"image shapes differ: synthetic {synthetic.image_shape} vs real {real.image_shape} (C, H, W); "
            "load the real data with the same image_size / colour mode"
        )


def downstream_accuracy(
    synthetic: ImageDataset,
    real_heldout: ImageDataset,
    *,
    epochs: int | None = None,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
) -> float:
    """Accuracy on ``real_heldout`` of a classifier trained on ``synthetic`` only."""
    check_compatible(synthetic, real_heldout)
    net = train_classifier(synthetic, epochs, seed, batch_size=batch_size, lr=lr)
    return accuracy(net, real_heldout)


def extract_features(feature_net: nn.Module, images: np.ndarray, batch_size: int = 500) -> np.ndarray:
    """float64 (N, D) penultimate features (``feature_net.features`` if it has one, else its output)."""
    feature_net.eval()
    fn = getattr(feature_net, "features", feature_net)
    # a block, not the decorator (see predict); the features leave as numpy: inference mode
    with torch.inference_mode():
        chunks = [
            fn(torch.from_numpy(np.ascontiguousarray(images[i : i + batch_size], dtype=np.float32))).double()
            for i in range(0, len(images), batch_size)
        ]
        return torch.cat(chunks).reshape(len(images), -1).numpy()


def _sqrt_psd(m: np.ndarray) -> np.ndarray:
    vals, vecs = np.linalg.eigh((m + m.T) / 2)
    return (vecs * np.sqrt(np.clip(vals, 0.0, None))) @ vecs.T


def frechet_distance_from_features(f1: np.ndarray, f2: np.ndarray) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^1/2) between Gaussians fitted to two feature sets.

    Tr((S1 S2)^1/2) is computed as the sum of square roots of the eigenvalues of the symmetric PSD
    matrix S1^1/2 S2 S1^1/2 (same eigenvalues as S1 S2): real arithmetic, no complex sqrtm residue.
    """
    if len(f1) < 2 or len(f2) < 2:
        raise DataError(f"Fréchet distance needs at least 2 samples per side; got {len(f1)} and {len(f2)}")
    mu1, mu2 = f1.mean(0), f2.mean(0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    r1 = _sqrt_psd(s1)
    cross = np.linalg.eigvalsh(r1 @ s2 @ r1)
    tr_sqrt = float(np.sqrt(np.clip(cross, 0.0, None)).sum())
    fd = float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2.0 * tr_sqrt)
    return max(fd, 0.0)


def frechet_distance(
    real: ImageDataset | np.ndarray, synth: ImageDataset | np.ndarray, feature_net: nn.Module
) -> float:
    """FD (classifier features) between two image sets (datasets or (N, C, H, W) arrays in [0, 1])."""
    a = real.images if isinstance(real, ImageDataset) else np.asarray(real, dtype=np.float32)
    b = synth.images if isinstance(synth, ImageDataset) else np.asarray(synth, dtype=np.float32)
    return frechet_distance_from_features(extract_features(feature_net, a), extract_features(feature_net, b))


CHUNK = 1024  # rows of a pairwise-distance block: 10,000 images per side never hold a 10,000 x 10,000 matrix


def _knn_radii(f: torch.Tensor, k: int) -> torch.Tensor:
    """Distance from each row of ``f`` to its k-th nearest OTHER row."""
    # k + 1: the smallest distance is the row to itself (0)
    return torch.cat(
        [torch.cdist(f[i : i + CHUNK], f).kthvalue(k + 1, dim=1).values for i in range(0, len(f), CHUNK)]
    )


def prdc_from_features(real: np.ndarray, fake: np.ndarray, k: int = PRDC_K) -> dict[str, float]:
    """Precision, recall (Kynkäänniemi et al. 2019), density and coverage (Naeem et al. 2020) with k-NN balls.

    With r_i the distance of real i to its k-th nearest real neighbour and s_j that of fake j among the fakes:
    precision = share of fakes inside some real ball; recall = share of reals inside some fake ball;
    density = mean over fakes of (number of real balls containing it) / k; coverage = share of reals whose
    ball contains at least one fake. Identical sets give precision = recall = coverage = 1.
    """
    if len(real) <= k or len(fake) <= k:
        raise DataError(
            f"precision/recall need more than k = {k} samples per side; got {len(real)} and {len(fake)}"
        )
    r = torch.from_numpy(np.asarray(real, np.float64))
    f = torch.from_numpy(np.asarray(fake, np.float64))
    r_rad, f_rad = _knn_radii(r, k), _knn_radii(f, k)
    fake_hits = torch.zeros(len(f), dtype=torch.float64)  # real balls containing each fake
    recalled, covered = [], []
    for i in range(0, len(r), CHUNK):
        d = torch.cdist(r[i : i + CHUNK], f)  # (chunk of reals, all fakes)
        fake_hits += (d <= r_rad[i : i + CHUNK, None]).double().sum(0)
        recalled.append((d <= f_rad[None, :]).any(1))
        covered.append(d.min(1).values <= r_rad[i : i + CHUNK])
    return {
        "precision": float((fake_hits > 0).double().mean()),
        "recall": float(torch.cat(recalled).double().mean()),
        "density": float(fake_hits.mean() / k),
        "coverage": float(torch.cat(covered).double().mean()),
    }


@dataclass
class Ceiling:
    """The evaluation classifier trained on REAL images, scored on real held-out images it never saw."""

    accuracy: float
    per_class_accuracy: dict[str, float]
    protocol: str  # how it was obtained (real-train set, or cross-fitted halves of the held-out set)
    n_train: int  # real training images per classifier
    fits: list[dict] = field(default_factory=list)  # FitLog of each classifier


def real_ceiling(
    real_heldout: ImageDataset,
    real_train: ImageDataset | None = None,
    seed: int = 0,
    *,
    epochs: int | None = None,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    reporter: Reporter | None = None,
    device: str = "cpu",
) -> Ceiling:
    """Real-data ceiling (module docstring): trained on ``real_train`` if given, else cross-fitted halves;
    ``device``: where the classifiers train."""
    kw: dict[str, Any] = dict(batch_size=batch_size, lr=lr, reporter=reporter, device=device)
    if real_train is not None:
        check_compatible(real_train, real_heldout)
        net = train_classifier(
            real_train, epochs, seed, what="ceiling: classifier on real training images", **kw
        )
        pred = predict(net, real_heldout.images)
        return Ceiling(
            float((pred == real_heldout.labels).mean()),
            _per_class(pred, real_heldout),
            f"trained on the {real_train.n:,} real training images, scored on the real held-out set",
            real_train.n,
            [_fit_dict(net)],
        )
    a, b = _halves(real_heldout, seed)
    pred = np.empty(real_heldout.n, np.int64)
    fits = []
    for fit_idx, score_idx in ((a, b), (b, a)):
        net = train_classifier(
            real_heldout.subset(fit_idx),
            epochs,
            seed,
            what="ceiling: classifier on half the real held-out images",
            **kw,
        )
        pred[score_idx] = predict(net, real_heldout.images[score_idx])
        fits.append(_fit_dict(net))
    return Ceiling(
        float((pred == real_heldout.labels).mean()),
        _per_class(pred, real_heldout),
        "cross-fitted halves of the real held-out set (trained on one half, scored on the other, both "
        "ways): a low estimate, trained on half the held-out images",
        min(len(a), len(b)),
        fits,
    )


def _halves(ds: ImageDataset, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of two disjoint stratified halves of ``ds`` (a class with one image lies in one half only)."""
    mask = validation_split(ds.labels, ds.n_classes, 0.5, seed)
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def _fit_dict(net: nn.Module) -> dict:
    log = getattr(net, "fit_log", None)
    return log.to_dict() if isinstance(log, FitLog) else {}


@dataclass
class EvaluationReport:
    accuracy: float  # real held-out accuracy of a classifier trained on the synthetic data
    fd: float  # Fréchet distance in classifier features (see FD_NAME), equal n per side
    fd_name: str = FD_NAME
    chance_accuracy: float = 0.0
    per_class_accuracy: dict[str, float] = field(default_factory=dict)
    ceiling_accuracy: float | None = None  # the same classifier trained on real images (see ceiling_protocol)
    ceiling_per_class_accuracy: dict[str, float] = field(default_factory=dict)
    ceiling_protocol: str = ""
    n_ceiling_train: int = 0
    precision: float = float("nan")
    recall: float = float("nan")
    density: float = float("nan")
    coverage: float = float("nan")
    prdc_k: int = PRDC_K
    feature_dim: int = 0
    n_synthetic: int = 0
    n_real: int = 0
    n_fd: int = 0  # images per side in the FD and precision/recall/density/coverage (min of the two sizes)
    class_names: list[str] = field(default_factory=list)
    synthetic_class_counts: dict[str, int] = field(default_factory=dict)
    real_class_counts: dict[str, int] = field(default_factory=dict)
    synthetic_source: str = ""
    real_source: str = ""
    synthetic_fingerprint: str = ""
    real_fingerprint: str = ""
    classifier_epochs: int = 0  # epochs the synthetic-data classifier ran (early stopping)
    feature_net_epochs: int | None = None  # epochs the feature network ran (None: supplied without a FitLog)
    classifier_fit: dict = field(default_factory=dict)
    feature_net_fit: dict = field(default_factory=dict)
    ceiling_fits: list[dict] = field(default_factory=list)
    seed: int = 0
    grid_path: str | None = None
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        """Everything, for whoever ran the evaluation (they hold the held-out data): never the shareable
        file."""
        return asdict(self)

    def shareable(self, salt: bytes) -> dict:
        """What may go to a release report: no statistic of the held-out data but the accuracy and FD,
        labelled not differentially private. Dropped: the held-out size (``n_real``; ``n_fd`` is
        min(synthetic, held-out)), its class counts, per-class accuracies (their denominators are the class
        counts), its source path and its plain hash (whoever has a candidate set could test it); in its place
        a commitment salted with ``salt``, which the evaluator keeps (``heldout_commitment`` opens it)."""
        keep = (
            "accuracy",
            "fd",
            "fd_name",
            "chance_accuracy",
            "ceiling_accuracy",
            "ceiling_protocol",
            "precision",
            "recall",
            "density",
            "coverage",
            "prdc_k",
            "n_synthetic",
            "class_names",
            "synthetic_class_counts",
            "synthetic_source",
            "synthetic_fingerprint",
            "classifier_epochs",
            "feature_net_epochs",
            "seed",
            "warnings",
        )
        doc = {k: v for k, v in asdict(self).items() if k in keep}
        return {
            **doc,
            "not_dp": NOT_DP_STATEMENT,
            "real_commitment": heldout_commitment(self.real_fingerprint, salt),
        }


NOT_DP_STATEMENT = (
    "accuracy and FD are computed without noise on real held-out images of whoever ran the evaluation "
    "(not the released data): they are not differentially private and not covered by the release's "
    "epsilon or signatures"
)
COMMITMENT_SALT_BYTES = 32


def new_commitment_salt() -> bytes:
    return os.urandom(COMMITMENT_SALT_BYTES)


def heldout_commitment(fingerprint: str, salt: bytes) -> str:
    """SHA-256 over a domain tag, a secret salt and the held-out set's fingerprint: binds the evaluation to
    one held-out set (the evaluator opens it by showing the salt and the data) without letting anyone test a
    guess."""
    if len(salt) < 16:
        raise ValueError(f"a commitment salt needs >= 128 bits, got {len(salt) * 8}")
    return hashlib.sha256(b"feta-heldout-commitment-v1\n" + salt + fingerprint.encode("ascii")).hexdigest()


def _fit_warnings(what: str, fit: dict, option: str) -> list[str]:
    if fit.get("stopped") == "max_epochs":
        return [
            f"{what} stopped at its cap of {fit['max_epochs']} epochs before its validation loss settled "
            f"(not converged): raise the cap ({option})"
        ]
    if fit.get("stopped") == "no_validation":
        return [
            f"{what} had too few images for a validation part: no early stopping, trained {fit['epochs']} "
            "epochs"
        ]
    return []


def _warnings(
    synthetic: ImageDataset, n_fd: int, feature_dim: int, fits: dict[str, dict], ceiling: Ceiling | None
) -> list[str]:
    out: list[str] = []
    missing = [synthetic.class_names[c] for c in np.flatnonzero(synthetic.class_counts() == 0)]
    if missing:
        out.append(f"synthetic data has no images of class(es) {missing}; accuracy on them will be ~0")
    need = max(MIN_FD_IMAGES, 5 * feature_dim)
    if n_fd < need:
        out.append(
            f"FD, precision, recall, density and coverage rest on only {n_fd} images per side (< {need} = "
            f"max({MIN_FD_IMAGES}, 5 x the {feature_dim}-d features)): they are noisy and FD is inflated"
        )
    feat = fits.get("feature network", {})
    if feat and feat["epochs"] < MIN_FEATURE_EPOCHS:
        out.append(
            f"the feature network trained only {feat['epochs']} epochs (< {MIN_FEATURE_EPOCHS}): FD and "
            "precision/recall/density/coverage may not separate good from bad synthetic images"
        )
    if not feat:
        out.append("the feature network was supplied without a training log: its convergence is unknown")
    out += _fit_warnings("the classifier trained on synthetic images", fits["classifier"], "--epochs")
    out += _fit_warnings("the feature network", feat, "--feature-epochs")
    if ceiling is None:
        out.append("no real-data ceiling: the accuracy has no real-data reference")
    else:
        for fit in ceiling.fits:
            out += [
                w for w in _fit_warnings("a real-data ceiling classifier", fit, "--epochs") if w not in out
            ]
    return out


def _fidelity(
    synthetic: ImageDataset, real: ImageDataset, feature_net: nn.Module, seed: int
) -> tuple[int, int, float, dict[str, float]]:
    """(n per side, feature dim, FD, PRDC) on equal-size random subsamples of both sets."""
    n = min(synthetic.n, real.n)
    rng = np.random.default_rng(seed)
    fr = extract_features(feature_net, real.images[np.sort(rng.choice(real.n, n, replace=False))])
    fs = extract_features(feature_net, synthetic.images[np.sort(rng.choice(synthetic.n, n, replace=False))])
    prdc = (
        prdc_from_features(fr, fs)
        if n > PRDC_K
        else dict.fromkeys(("precision", "recall", "density", "coverage"), float("nan"))
    )
    return n, fr.shape[1], frechet_distance_from_features(fr, fs), prdc


def evaluate(
    synthetic: ImageDataset,
    real_heldout: ImageDataset,
    seed: int = 0,
    *,
    real_train: ImageDataset | None = None,
    ceiling: Ceiling | bool = True,
    classifier_epochs: int | None = None,
    feature_epochs: int | None = None,
    feature_net: nn.Module | None = None,
    grid_path: str | Path | None = None,
    per_class: int = 10,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    reporter: Reporter | None = None,
    device: str = "cpu",
) -> EvaluationReport:
    """Downstream accuracy + real-data ceiling + FD and precision/recall/density/coverage (+ a sample grid
    PNG).

    ``classifier_epochs`` / ``feature_epochs``: epoch caps (None: automatic; early stopping below the cap).
    ``real_train``: real training images for the ceiling (else cross-fitted halves of ``real_heldout``).
    ``ceiling``: True computes it, False skips it (a warning says so), a :class:`Ceiling` from
    :func:`real_ceiling` is reused (many evaluations against the same real data).
    ``feature_net``: a network already trained on ``real_heldout`` to reuse; trained here otherwise.
    ``device``: where the classifiers train ("cpu", "cuda"); they score on the CPU.
    """
    t0 = time.perf_counter()
    check_compatible(synthetic, real_heldout)
    if synthetic.n == 0:
        raise DataError(f"{synthetic.source}: no synthetic images to evaluate")
    kw: dict[str, Any] = dict(batch_size=batch_size, lr=lr, reporter=reporter, device=device)
    acc_net = train_classifier(
        synthetic, classifier_epochs, seed, what="classifier on synthetic images", **kw
    )
    pred = predict(acc_net, real_heldout.images)
    ceil = (
        ceiling
        if isinstance(ceiling, Ceiling)
        else (
            real_ceiling(real_heldout, real_train, seed, epochs=classifier_epochs, **kw) if ceiling else None
        )
    )
    if feature_net is None:
        feature_net = train_classifier(
            real_heldout, feature_epochs, seed, what="feature network on real held-out images", **kw
        )
    n_fd, dim, fd, prdc = _fidelity(synthetic, real_heldout, feature_net, seed)
    fits = {"classifier": _fit_dict(acc_net), "feature network": _fit_dict(feature_net)}
    grid = None
    if grid_path is not None:
        grid = str(
            save_grid(
                synthetic.images,
                synthetic.labels,
                grid_path,
                per_class=per_class,
                n_classes=synthetic.n_classes,
                class_names=synthetic.class_names,
                title=f"synthetic images evaluated (n = {synthetic.n}; ε: see the release's certificate)",
            )
        )
    return EvaluationReport(
        accuracy=float((pred == real_heldout.labels).mean()),
        fd=fd,
        chance_accuracy=1.0 / real_heldout.n_classes,
        per_class_accuracy=_per_class(pred, real_heldout),
        ceiling_accuracy=ceil.accuracy if ceil else None,
        ceiling_per_class_accuracy=ceil.per_class_accuracy if ceil else {},
        ceiling_protocol=ceil.protocol if ceil else "",
        n_ceiling_train=ceil.n_train if ceil else 0,
        precision=prdc["precision"],
        recall=prdc["recall"],
        density=prdc["density"],
        coverage=prdc["coverage"],
        feature_dim=dim,
        n_synthetic=synthetic.n,
        n_real=real_heldout.n,
        n_fd=n_fd,
        class_names=list(synthetic.class_names),
        synthetic_class_counts={n: int(c) for n, c in zip(synthetic.class_names, synthetic.class_counts())},
        real_class_counts={n: int(c) for n, c in zip(real_heldout.class_names, real_heldout.class_counts())},
        synthetic_source=synthetic.source,
        real_source=real_heldout.source,
        synthetic_fingerprint=synthetic.fingerprint(),
        real_fingerprint=real_heldout.fingerprint(),
        classifier_epochs=int(acc_net.fit_log.epochs) if acc_net.fit_log else 0,
        feature_net_epochs=fits["feature network"].get("epochs"),
        classifier_fit=fits["classifier"],
        feature_net_fit=fits["feature network"],
        ceiling_fits=ceil.fits if ceil else [],
        seed=seed,
        grid_path=grid,
        warnings=_warnings(synthetic, n_fd, dim, fits, ceil),
        seconds=time.perf_counter() - t0,
    )
