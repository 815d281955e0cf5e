"""Procedural image sets (feta_release.data.procedural): deterministic, well-formed, balanced as declared, and
with the class structure they exist to test (a finding invisible in the class mean, classes visible in it,
colour)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feta_release.cli import main
from feta_release.data import load_dataset
from feta_release.data import procedural as P
from feta_release.errors import ConfigError, DataError

FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
kinds = st.sampled_from(P.KINDS)


def _size(kind: str, data: st.DataObject) -> int:
    lo, hi = P.SIZE_RANGE[kind]
    return data.draw(st.integers(lo, min(hi, 48)))


@FAST
@given(kind=kinds, n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_the_same_arguments_give_the_same_images_and_another_seed_other_images(kind, n, seed, data):
    size = _size(kind, data)
    a = P.generate_dataset(kind, n, size=size, seed=seed)
    b = P.generate_dataset(kind, n, size=size, seed=seed)
    assert a.fingerprint() == b.fingerprint()
    c = P.generate_dataset(kind, n, size=size, seed=seed + 1)
    assert not np.array_equal(a.images, c.images)


@FAST
@given(kind=kinds, n=st.integers(1, 40), seed=st.integers(0, 1000), data=st.data())
def test_images_have_the_asked_shape_and_lie_in_the_unit_range(kind, n, seed, data):
    size = _size(kind, data)
    # ImageDataset itself refuses NaN, inf and values off [0, 1]
    ds = P.generate_dataset(kind, n, size=size, seed=seed)
    assert ds.images.shape == (n, P.CHANNELS[kind], size, size) and ds.images.dtype == np.float32
    assert ds.class_names == P.CLASSES[kind]
    assert float(ds.images.std()) > 0.05  # not a blank image set


def test_generation_spans_several_blocks_without_repeating_a_block():
    ds = P.generate_dataset("medical", 2 * P.BLOCK + 7, size=28, seed=5)
    first, second = ds.images[: P.BLOCK], ds.images[P.BLOCK : 2 * P.BLOCK]
    assert not np.allclose(first, second)
    assert len({ds.images[i].tobytes() for i in range(ds.n)}) == ds.n


@FAST
@given(kind=kinds, n=st.integers(1, 3000), seed=st.integers(0, 1000))
def test_population_a_and_rgb_are_balanced_to_one_image(kind, n, seed):
    counts = P.generate_dataset(kind, n, size=P.SIZE_RANGE[kind][0], seed=seed).class_counts()
    assert counts.sum() == n and counts.max() - counts.min() <= 1


@FAST
@given(n=st.integers(1, 3000), seed=st.integers(0, 1000))
def test_population_b_follows_its_own_class_balance(n, seed):
    counts = P.generate_dataset("medical", n, size=28, seed=seed, population="B").class_counts()
    shares = np.asarray(P.ACQUISITION["B"].class_shares)
    assert counts.sum() == n
    assert np.all(np.abs(counts - n * shares / shares.sum()) < 1.0)


def _rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean()))


@pytest.mark.parametrize("population", ["A", "B"])
def test_the_finding_class_mean_nearly_coincides_with_normal_while_visible_classes_do_not(population):
    ds = P.generate_dataset("medical", 8000, size=32, seed=11, population=population)
    mean = [ds.images[ds.labels == c].mean(0) for c in range(ds.n_classes)]
    normal, finding, effusion, opacity = (P.MEDICAL_CLASSES.index(k) for k in P.MEDICAL_CLASSES)
    # ~ the sampling noise of the means (~0.003 at 2,000/class)
    assert _rms(mean[finding], mean[normal]) < 0.008
    assert _rms(mean[effusion], mean[normal]) > 0.018
    assert _rms(mean[opacity], mean[normal]) > 0.012


@pytest.mark.parametrize("size", [28, 64, 128])
def test_a_finding_changes_only_a_few_pixels_of_the_same_patient_inside_a_lung(size):
    """The same seed with other labels gives the same anatomy, acquisition and noise: the finding is the only
    difference, a compact bright spot of a few pixels (up to ~70 at 128x128, the same anatomical size), on the
    dark lung field; an effusion or an opacity changes far more."""
    n = 60
    normal = P.medical(n, size=size, seed=3, labels=np.zeros(n, np.int64)).images[:, 0]
    finding = P.medical(n, size=size, seed=3, labels=np.ones(n, np.int64)).images[:, 0]
    diff = finding - normal
    changed = (np.abs(diff) > 0.03).sum(axis=(1, 2))
    assert changed.min() >= 3 and changed.max() <= max(16, 0.006 * size * size)
    # brighter, never darker (noise unchanged)
    assert diff.min() > -0.03 and diff.max(axis=(1, 2)).min() > 0.1
    spot = diff.reshape(n, -1).argmax(axis=1)
    at_spot = normal.reshape(n, -1)[np.arange(n), spot]
    # on the dark lung, not on tissue
    assert np.all(at_spot < np.percentile(normal.reshape(n, -1), 70, axis=1))
    for sign in (2, 3):
        other = P.medical(n, size=size, seed=3, labels=np.full(n, sign, np.int64)).images[:, 0]
        assert np.median((np.abs(other - normal) > 0.03).sum(axis=(1, 2))) > 2 * changed.max()


def test_population_b_is_rendered_differently_from_a():
    a = P.generate_dataset("medical", 2000, size=32, seed=1, population="A")
    b = P.generate_dataset("medical", 2000, size=32, seed=1, population="B")
    na, nb = a.images[a.labels == 0, 0], b.images[b.labels == 0, 0]
    assert _rms(na.mean(0), nb.mean(0)) > 0.02  # other exposure and gamma
    assert nb.mean(0).std() < 0.9 * na.mean(0).std()  # flatter contrast

    # the 3x3 corner is background: its pixel steps are detector noise
    def corner_noise(x: np.ndarray) -> float:
        return float(np.abs(np.diff(x[:, :3, :3], axis=-1)).mean())

    assert corner_noise(nb) > 1.5 * corner_noise(na)


def test_rgb_colour_family_is_in_the_object_colour():
    ds = P.generate_dataset("rgb", 4000, size=32, seed=2)
    centre = ds.images[:, :, 14:18, 14:18].mean(axis=(2, 3))  # disks and squares always cover the centre
    warm_minus_blue = centre[:, 0] - centre[:, 2]
    for shape in ("disk", "square"):
        warm = ds.labels == P.RGB_CLASSES.index(f"{shape}-warm")
        cool = ds.labels == P.RGB_CLASSES.index(f"{shape}-cool")
        assert warm_minus_blue[warm].mean() > warm_minus_blue[cool].mean() + 0.3


def test_written_npz_and_folder_load_back_with_the_same_images(tmp_path):
    ds = P.generate_dataset("rgb", 30, size=16, seed=4)
    z, _ = load_dataset(P.write_dataset(ds, tmp_path / "s.npz"))
    assert z.class_names == ds.class_names and np.array_equal(z.labels, ds.labels)
    assert np.abs(z.images - ds.images).max() <= 0.5 / 255 + 1e-6
    csv_path = P.write_dataset(ds, tmp_path / "folder")
    names = np.array(ds.class_names)[ds.labels]
    by_class = np.concatenate([np.flatnonzero(names == c) for c in sorted(ds.class_names)])
    # the CSV keeps the rows' order; the class folders are read class by class (both sort the class names)
    for (loaded, _), order in (
        (load_dataset(csv_path), np.arange(ds.n)),
        (load_dataset(tmp_path / "folder" / "images"), by_class),
    ):
        assert list(np.array(loaded.class_names)[loaded.labels]) == list(names[order])
        assert np.abs(loaded.images - ds.images[order]).max() <= 0.5 / 255 + 1e-6


def test_the_writer_refuses_to_write_into_a_folder_that_holds_files(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not an empty folder"):
        P.write_dataset(P.generate_dataset("rgb", 3, size=16), tmp_path / "x")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("xray", 10, None, "A"), "unknown data kind"),
        (("medical", 0, None, "A"), "n must be"),
        (("medical", 10, 27, "A"), "28..128"),
        (("medical", 10, 129, "A"), "28..128"),
        (("rgb", 10, 8, "A"), "16..128"),
        (("medical", 10, None, "C"), "population must be"),
        (("rgb", 10, None, "B"), "medical kind only"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(args, match):
    with pytest.raises(ConfigError, match=match):
        P.checked_size(*args)


def test_cli_generates_a_loadable_set(tmp_path, capsys):
    out = tmp_path / "chest.npz"
    main(
        [
            "data",
            "generate",
            "medical",
            "--n",
            "40",
            "--size",
            "32",
            "--seed",
            "3",
            "--population",
            "B",
            "--out",
            str(out),
        ]
    )
    assert "40 medical images, 1x32x32, seed 3" in capsys.readouterr().out
    ds, _ = load_dataset(out)
    ref = P.generate_dataset("medical", 40, size=32, seed=3, population="B")
    assert np.array_equal(ds.labels, ref.labels) and ds.class_names == ref.class_names


@pytest.mark.parametrize(
    "argv",
    [
        ["xray", "--out", "x.npz"],
        ["medical", "--size", "500", "--out", "x.npz"],
        ["rgb", "--population", "B", "--out", "x.npz"],
    ],
)
def test_cli_bad_input_is_one_line_with_the_config_exit_code(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(["data", "generate", *argv[:-1], str(tmp_path / argv[-1])])
    err = capsys.readouterr().err
    assert exc.value.code == ConfigError.exit_code
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x.npz").exists()


def test_strokes_are_thin_bright_ink_on_a_dark_ground_and_name_no_digit():
    ds = P.generate_dataset("strokes", 400, seed=3)
    assert ds.images.shape == (400, 1, 28, 28)
    ink = ds.images > 0.5
    share = ink.mean(axis=(1, 2, 3))
    assert 0.01 < float(share.min()) and float(share.max()) < 0.4  # every image has a stroke, none is a blob
    assert float(np.median(ds.images)) < 0.05  # dark ground
    assert not set(ds.class_names) & {str(d) for d in range(10)}  # public classes that stand for no digit
