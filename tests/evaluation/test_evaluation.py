"""Evaluation: the classifier (local findings, early stopping), the real-data ceiling, FD (classifier
features), precision/recall/density/coverage, evaluate(), the sample grid and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.data import ImageDataset, load_embedded, save_npz, train_heldout_split
from feta_release.errors import DataError
from feta_release.eval_classifier import validation_split
from feta_release.evaluation import (
    FD_NAME,
    accuracy,
    downstream_accuracy,
    evaluate,
    extract_features,
    frechet_distance,
    frechet_distance_from_features,
    per_class_accuracy,
    prdc_from_features,
    train_classifier,
)
from feta_release.viz import grid_array, save_grid
from tests.support.finding_images import finding_images


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The small CNN gains nothing from a second thread, and on a shared 2-core machine OpenMP
    # barriers under oversubscription made these tests many times slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def split() -> tuple[ImageDataset, ImageDataset]:
    return train_heldout_split(load_embedded(), 0.2, seed=0)


@pytest.fixture(scope="module")
def feature_net(split):
    return train_classifier(split[1], epochs=5, seed=0)


# -- the Fréchet distance itself ----------------------------------------------------------------
def test_fd_matches_closed_form_for_gaussians() -> None:
    rng = np.random.default_rng(0)
    d, n = 4, 200_000
    m, s = np.array([1.0, -2.0, 0.0, 0.5]), 2.0
    f1 = rng.standard_normal((n, d))
    f2 = m + s * rng.standard_normal((n, d))
    exact = (m**2).sum() + d * (1 - s) ** 2  # N(0, I) vs N(m, s^2 I)
    assert frechet_distance_from_features(f1, f2) == pytest.approx(exact, rel=0.02)
    assert frechet_distance_from_features(f1, f1) == pytest.approx(0.0, abs=1e-6)


def test_fd_agrees_with_scipy_sqrtm() -> None:
    from scipy import linalg

    rng = np.random.default_rng(1)
    a = rng.standard_normal((500, 6)) @ rng.standard_normal((6, 6))
    b = rng.standard_normal((400, 6)) @ rng.standard_normal((6, 6)) + 0.3
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    ref = ((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(s1 + s2 - 2 * linalg.sqrtm(s1 @ s2).real)
    assert frechet_distance_from_features(a, b) == pytest.approx(ref, rel=1e-6)
    assert frechet_distance_from_features(a, b) == pytest.approx(
        frechet_distance_from_features(b, a), rel=1e-9
    )
    with pytest.raises(DataError, match="at least 2"):
        frechet_distance_from_features(a[:1], b)


# -- sanity on real data ------------------------------------------------------------------------
def test_classifier_on_real_data_beats_chance(split) -> None:
    train, heldout = split
    # Small batches and a higher lr than the defaults: more steps from few images keeps the test fast.
    net = train_classifier(train.subset(np.arange(0, train.n, 4)), epochs=3, seed=0, batch_size=16, lr=2e-3)
    acc = accuracy(net, heldout)
    assert acc > 0.7, acc  # chance is 0.1


def test_fd_real_vs_real_small_noise_large(split, feature_net) -> None:
    train, heldout = split
    rng = np.random.default_rng(0)
    other_real = train.images[rng.choice(train.n, heldout.n, replace=False)]
    noise = rng.random(other_real.shape, dtype=np.float32)
    noisy = np.clip(other_real + rng.normal(0, 0.3, other_real.shape), 0, 1).astype(np.float32)
    ref = extract_features(feature_net, heldout.images)
    fd_real, fd_noisy, fd_noise = (
        frechet_distance_from_features(ref, extract_features(feature_net, x))
        for x in (other_real, noisy, noise)
    )
    assert fd_real < fd_noisy < fd_noise
    assert fd_real < 0.05 * fd_noise, (fd_real, fd_noise)
    assert frechet_distance(heldout, other_real, feature_net) == pytest.approx(fd_real, rel=1e-9)


def test_training_is_deterministic_and_leaves_global_rng(split) -> None:
    small = split[1].subset(np.arange(0, 1000, 10))
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = train_classifier(small, epochs=1, seed=5)
    after = torch.rand(1)
    b = train_classifier(small, epochs=1, seed=5)
    c = train_classifier(small, epochs=1, seed=6)
    assert torch.equal(before, after)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


# -- evaluate() ---------------------------------------------------------------------------------
def test_evaluate_report_and_grid(split, feature_net, tmp_path: Path) -> None:
    train, heldout = split
    synth = train.subset(np.arange(0, train.n, 8))  # "perfect synthesizer": 500 real training images
    fast = dict(classifier_epochs=3, feature_net=feature_net, batch_size=16, lr=2e-3)
    report = evaluate(synth, heldout, seed=0, grid_path=tmp_path / "g.png", **fast)
    assert report.fd_name == FD_NAME and "FID" not in report.fd_name
    assert report.chance_accuracy == pytest.approx(0.1)
    assert report.n_fd == 500 and report.n_synthetic == 500 and report.n_real == 1000
    assert report.synthetic_class_counts == {str(i): int(c) for i, c in enumerate(synth.class_counts())}
    assert report.real_fingerprint == heldout.fingerprint()
    assert set(report.per_class_accuracy) == set(heldout.class_names)
    assert Path(report.grid_path).is_file()
    json.dumps(report.to_dict())  # JSON-ready
    # No real training set given: the ceiling is cross-fitted on the two halves of the held-out set.
    assert "cross-fitted halves" in report.ceiling_protocol and report.n_ceiling_train == 500
    assert report.ceiling_accuracy is not None and report.ceiling_accuracy > 0.6
    assert (
        set(report.ceiling_per_class_accuracy) == set(heldout.class_names) and len(report.ceiling_fits) == 2
    )
    assert report.precision > 0.5 and report.recall > 0.5 and report.coverage > 0.5, report
    # Every figure resting on too little says so: 500 images per side < 5 x the 128-d features, a 5-epoch
    # feature network, classifiers cut at 3 epochs.
    said = " | ".join(report.warnings)
    assert "rest on only 500 images per side (< 640" in said and "trained only 5 epochs" in said
    assert "stopped at its cap of 3 epochs" in said
    # Uniform noise labelled like the real data: chance-level accuracy, a far larger FD, no fidelity.
    rng = np.random.default_rng(1)
    junk = ImageDataset(
        rng.random(synth.images.shape, dtype=np.float32), synth.labels, synth.class_names, "noise"
    )
    bad = evaluate(junk, heldout, seed=0, ceiling=False, **fast)
    assert report.accuracy > 0.6 and bad.accuracy < 0.3
    assert bad.fd > 10 * report.fd
    assert bad.precision < 0.1 and bad.coverage < 0.1, bad
    assert bad.ceiling_accuracy is None and any("no real-data ceiling" in w for w in bad.warnings)


def test_class_names_and_shapes_must_match(split) -> None:
    _, heldout = split
    renamed = ImageDataset(heldout.images, heldout.labels, tuple(f"d{i}" for i in range(10)), "renamed")
    with pytest.raises(DataError, match=r"class names differ.*'d0'.*'0'"):
        downstream_accuracy(renamed, heldout, epochs=1)
    small = ImageDataset(heldout.images[:, :, :14, :14].copy(), heldout.labels, heldout.class_names, "small")
    with pytest.raises(DataError, match="image shapes differ"):
        evaluate(small, heldout)


# -- sample grid --------------------------------------------------------------------------------
def test_grid_layout_one_row_per_class() -> None:
    imgs = np.zeros((5, 1, 2, 2), np.float32)
    imgs[:, 0] = np.arange(1, 6, dtype=np.float32)[:, None, None] / 5
    labels = np.array([1, 0, 1, 1, 0])
    g = grid_array(imgs, labels, per_class=2, n_classes=3, pad=1, scale=1)
    assert g.shape == (3 * 3 + 1, 2 * 3 + 1, 3) and g.dtype == np.uint8
    cell = lambda r, c: g[1 + 3 * r, 1 + 3 * c, 0]  # noqa: E731
    # class 0 -> images 1, 4; class 1 -> images 0, 2 (first per_class, in order); class 2 empty.
    assert [cell(0, 0), cell(0, 1), cell(1, 0), cell(1, 1)] == [102, 255, 51, 153]
    assert cell(2, 0) == 128  # blank cell keeps the background


def test_save_grid_png(tmp_path: Path) -> None:
    from PIL import Image

    imgs = np.random.default_rng(0).random((7, 3, 4, 4), dtype=np.float32)
    p = save_grid(imgs, None, tmp_path / "sub" / "grid.png", columns=3, scale=2, pad=2)
    with Image.open(p) as im:
        assert im.size == ((3 * 6 + 2) * 2, (3 * 6 + 2) * 2) and im.mode == "RGB"
    with pytest.raises(DataError):
        save_grid(np.zeros((2, 2, 4, 4)), None, tmp_path / "x.png")


# -- CLI ----------------------------------------------------------------------------------------
def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    from feta_release.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_evaluate_run_dir_and_real_npz(split, tmp_path: Path, capsys) -> None:
    train, heldout = split
    save_npz(train.subset(np.arange(0, train.n, 20)), tmp_path / "run" / "synthetic.npz")
    save_npz(heldout.subset(np.arange(0, heldout.n, 5)), tmp_path / "real.npz")
    code, out, err = run_cli(
        [
            "evaluate",
            str(tmp_path / "run"),
            "--real",
            str(tmp_path / "real.npz"),
            "--epochs",
            "1",
            "--feature-epochs",
            "1",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    info = json.loads(out)
    assert info["n_synthetic"] == 200 and info["n_real"] == 200 and info["fd_name"] == FD_NAME
    assert info["ceiling_accuracy"] is not None and info["n_ceiling_train"] == 100  # halves of the 200
    assert all(0.0 <= info[k] <= 1.0 for k in ("precision", "recall", "coverage"))
    assert (tmp_path / "run" / "evaluation" / "samples.png").is_file()
    shared = json.loads((tmp_path / "run" / "evaluation" / "evaluation.json").read_text())
    assert shared["fd"] == info["fd"] and "not differentially private" in shared["not_dp"]
    for key in (
        "n_real",
        "n_fd",
        "real_class_counts",
        "per_class_accuracy",
        "real_fingerprint",
        "real_source",
    ):
        assert key not in shared, key  # the shareable file holds no held-out statistic but accuracy and FD
    private = tmp_path / "run" / "evaluation" / "evaluation-private.json"
    assert private.stat().st_mode & 0o077 == 0  # the evaluator's own record: owner-only
    full = json.loads(private.read_text())
    assert (
        full["n_real"] == 200
        and full["real_fingerprint"] == heldout.subset(np.arange(0, heldout.n, 5)).fingerprint()
    )
    from feta_release.evaluation import heldout_commitment

    assert shared["real_commitment"] == heldout_commitment(
        full["real_fingerprint"], bytes.fromhex(full["commitment_salt"])
    )


def test_cli_evaluate_default_real_says_so_and_errors(split, tmp_path: Path, capsys) -> None:
    train, _ = split
    folder = tmp_path / "synth"
    from PIL import Image

    for i in range(10):  # folder of class sub-folders, 3 real digits each
        (folder / str(i)).mkdir(parents=True)
        for j, img in enumerate(train.images[train.labels == i][:3]):
            Image.fromarray(np.rint(img[0] * 255).astype(np.uint8), "L").save(folder / str(i) / f"{j}.png")
    code, out, err = run_cli(
        ["evaluate", str(folder), "--epochs", "1", "--feature-epochs", "1", "--out", str(tmp_path / "ev")],
        capsys,
    )
    assert code == 0, err
    assert "held-out split of the embedded data" in err and "FD (classifier features)" in out
    report = json.loads((tmp_path / "ev" / "evaluation-private.json").read_text())  # the evaluator's own copy
    assert report["n_ceiling_train"] == 4000 and "real training images" in report["ceiling_protocol"]
    shared = json.loads((tmp_path / "ev" / "evaluation.json").read_text())
    assert "n_ceiling_train" not in shared and "real training images" in shared["ceiling_protocol"]
    (folder / "9").rename(folder / "nine")
    code, _, err = run_cli(["evaluate", str(folder), "--epochs", "1"], capsys)
    assert code == 3 and "not the embedded digits'" in err and "give --real" in err
    code, _, err = run_cli(["evaluate", str(tmp_path / "missing")], capsys)
    assert code == 3 and "no such file" in err


# -- a classifier that keeps local evidence -----------------------------------------------------
@pytest.mark.slow
def test_classifier_recognises_a_small_local_finding() -> None:
    """One class differs from "normal" only by a 2x2 bright spot at a random place on a noisy textured 48x48
    background: an averaging classifier (the former SmallCNN: 63 % on it, 34 % on normal) cannot learn it; one
    with global max pooling must, early-stopped on its own training images."""
    train, test = finding_images(200, 48, seed=0), finding_images(100, 48, seed=1)
    net = train_classifier(train, seed=0)
    per_class = per_class_accuracy(net, test)
    assert per_class["finding"] >= 0.9 and per_class["normal"] >= 0.8, per_class  # found, and not everywhere
    log = net.fit_log
    assert log is not None and log.converged and log.n_validation == 60 and log.best_epoch <= log.epochs


@settings(max_examples=40, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    fraction=st.sampled_from([0.1, 0.5]),
    seed=st.integers(0, 1000),
)
def test_validation_part_is_stratified_and_leaves_every_class_in_training(
    counts: list[int], fraction: float, seed: int
) -> None:
    shuffled = np.random.default_rng(seed).permutation(np.repeat(np.arange(len(counts)), counts))
    mask = validation_split(shuffled, len(counts), fraction, seed)
    for c, n_c in enumerate(counts):
        held = int(mask[shuffled == c].sum())
        if n_c < 2:
            assert held == 0  # a lone image stays in training
        else:
            assert 1 <= held <= n_c - 1 and abs(held - fraction * n_c) <= 1


# -- precision / recall / density / coverage ----------------------------------------------------
def _prdc_by_definition(real: np.ndarray, fake: np.ndarray, k: int) -> dict[str, float]:
    """The four figures straight from the papers' formulas, with explicit loops."""

    def radius(x: np.ndarray, i: int) -> float:
        return float(np.sort(np.linalg.norm(x - x[i], axis=1))[k])  # index k: the 0 to itself is index 0

    rr = [radius(real, i) for i in range(len(real))]
    fr = [radius(fake, j) for j in range(len(fake))]
    d = np.array([[np.linalg.norm(r - f) for f in fake] for r in real])
    return {
        "precision": np.mean([any(d[i, j] <= rr[i] for i in range(len(real))) for j in range(len(fake))]),
        "recall": np.mean([any(d[i, j] <= fr[j] for j in range(len(fake))) for i in range(len(real))]),
        "density": np.mean([sum(d[i, j] <= rr[i] for i in range(len(real))) for j in range(len(fake))]) / k,
        "coverage": np.mean([d[i].min() <= rr[i] for i in range(len(real))]),
    }


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n_real=st.integers(8, 40), n_fake=st.integers(8, 40), d=st.integers(1, 6))
def test_prdc_equals_the_papers_formulas(seed: int, n_real: int, n_fake: int, d: int) -> None:
    rng = np.random.default_rng(seed)
    real, fake = rng.standard_normal((n_real, d)), rng.standard_normal((n_fake, d)) + rng.uniform(0, 2)
    got, want = prdc_from_features(real, fake, k=3), _prdc_by_definition(real, fake, 3)
    assert got == pytest.approx(want, abs=1e-12)


def _mixture(rng: np.random.Generator, n_per: int, centres: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    labels = np.repeat(np.arange(len(centres)), n_per)
    return centres[labels] + rng.standard_normal((len(labels), centres.shape[1])), labels


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), d=st.integers(4, 32), n_classes=st.integers(2, 6))
def test_prdc_sees_identity_collapse_and_shift(seed: int, d: int, n_classes: int) -> None:
    rng = np.random.default_rng(seed)
    centres = 6.0 * rng.standard_normal((n_classes, d))
    real, labels = _mixture(rng, 60, centres)
    same = prdc_from_features(real, real.copy())
    assert same["precision"] == same["recall"] == same["coverage"] == 1.0
    # Collapsed to one prototype per class (a single exemplar of each class, repeated): every synthetic image
    # is faithful, but a real image is covered only if the exemplar is among its k nearest neighbours.
    protos = np.stack([real[rng.choice(np.flatnonzero(labels == c))] for c in range(n_classes)])[labels]
    collapsed = prdc_from_features(real, protos)
    assert collapsed["precision"] == 1.0 and collapsed["recall"] <= 0.05 and collapsed["coverage"] <= 0.4, (
        collapsed
    )
    # Shifted far from the real data: no fidelity.
    shifted = prdc_from_features(real, _mixture(rng, 60, centres)[0] + 8.0)
    assert shifted["precision"] <= 0.05 and shifted["density"] <= 0.05, shifted
    fresh = prdc_from_features(real, _mixture(rng, 60, centres)[0])  # a new sample of the same distribution
    assert min(fresh["precision"], fresh["recall"], fresh["coverage"]) >= 0.6, fresh


def test_prdc_does_not_depend_on_the_distance_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    import feta_release.evaluation as ev

    rng = np.random.default_rng(0)
    real, fake = rng.standard_normal((300, 5)), rng.standard_normal((250, 5)) + 0.3
    whole = prdc_from_features(real, fake)
    monkeypatch.setattr(ev, "CHUNK", 7)  # blocks that do not divide either size
    assert (
        prdc_from_features(real, fake)
        == whole
        == pytest.approx(_prdc_by_definition(real, fake, 5), abs=1e-12)
    )


def test_prdc_needs_more_than_k_samples() -> None:
    with pytest.raises(DataError, match="more than k = 5"):
        prdc_from_features(np.zeros((5, 2)), np.zeros((10, 2)))


def test_cli_evaluate_writes_the_report_beside_an_npz_and_checks_the_real_training_set(
    split, tmp_path: Path, capsys
) -> None:
    train, heldout = split
    save_npz(train.subset(np.arange(0, train.n, 40)), tmp_path / "syn.npz")
    save_npz(heldout.subset(np.arange(0, heldout.n, 5)), tmp_path / "real.npz")
    save_npz(train.subset(np.arange(1, train.n, 40)), tmp_path / "real-train.npz")
    base = [
        "evaluate",
        str(tmp_path / "syn.npz"),
        "--real",
        str(tmp_path / "real.npz"),
        "--epochs",
        "1",
        "--feature-epochs",
        "1",
        "--no-progress",
    ]
    code, out, err = run_cli([*base, "--real-train", str(tmp_path / "real-train.npz")], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "syn-evaluation" / "evaluation-private.json").read_text())
    assert report["n_ceiling_train"] == 100 and "real training images" in report["ceiling_protocol"]
    assert "real-data ceiling" in out and "precision / recall" in out and "warning:" in out
    assert (tmp_path / "syn-evaluation" / "evaluation.json").is_file()  # the shareable figures
    assert any("rest on only 100 images per side" in w for w in report["warnings"])
    # A real training set that shares images with the held-out set would score the ceiling on what it saw.
    code, _, err = run_cli([*base, "--real-train", str(tmp_path / "real.npz")], capsys)
    assert code == 3 and "shares images with --real" in err


def test_cli_evaluate_help_names_the_protocol(capsys) -> None:
    code, out, _ = run_cli(["evaluate", "--help"], capsys)
    assert code == 0
    for phrase in (
        "--real-train",
        "--progress / --no-progress",
        "cross-fitted",
        "Epoch cap",
        "precision/recall",
        "evaluation.json",
    ):
        assert phrase in out, phrase


# -- the real-data ceiling ----------------------------------------------------------------------
class _Memoriser(torch.nn.Module):
    """A "classifier" that knows the label of every image it was trained on and nothing else (class 0
    otherwise)."""

    def __init__(self, ds: ImageDataset) -> None:
        super().__init__()
        self.seen = {img.tobytes(): int(label) for img, label in zip(ds.images, ds.labels)}
        self.n_classes = ds.n_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(x), self.n_classes)
        for i, img in enumerate(x.numpy()):
            if img.tobytes() in self.seen:
                out[i, self.seen[img.tobytes()]] = 1.0
        return out


def test_ceiling_never_scores_an_image_its_classifier_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    """A memorising classifier gets credit only for images it was trained on; no held-out image has class 0,
    so the ceiling must be exactly 0 both cross-fitted and with a real training set (and 1 if it were scored
    on its own training images)."""
    import feta_release.evaluation as ev

    monkeypatch.setattr(ev, "train_classifier", lambda ds, *a, **k: _Memoriser(ds))
    rng = np.random.default_rng(0)
    labels = rng.integers(1, 4, 120)
    real = ImageDataset(rng.random((120, 1, 8, 8), dtype=np.float32), labels, ("0", "1", "2", "3"), "real")
    crossed = ev.real_ceiling(real, seed=3)
    assert crossed.accuracy == 0.0 and crossed.n_train >= 55 and "cross-fitted" in crossed.protocol
    other = ImageDataset(
        rng.random((50, 1, 8, 8), dtype=np.float32), rng.integers(1, 4, 50), real.class_names, "t"
    )
    assert ev.real_ceiling(real, other).accuracy == 0.0
    assert ev.real_ceiling(real, real).accuracy == 1.0  # the memoriser does score what it saw


@pytest.mark.parametrize(
    ("shape", "n_classes", "dim"),
    [
        ((1, 28, 28), 10, 128),
        ((3, 32, 32), 2, 128),
        ((1, 64, 64), 4, 128),
        ((3, 128, 96), 100, 256),
        ((1, 48, 48), 30, 192),
    ],
)
def test_network_adapts_to_image_size_channels_and_classes(
    shape: tuple[int, int, int], n_classes: int, dim: int
) -> None:
    from feta_release.eval_classifier import ResNetClassifier

    net = ResNetClassifier(shape[0], n_classes, shape[1:]).eval()
    x = torch.rand(2, *shape)
    with torch.no_grad():
        assert net(x).shape == (2, n_classes) and net.features(x).shape == (2, dim) == (2, net.feature_dim)
