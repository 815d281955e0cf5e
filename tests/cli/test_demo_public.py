"""``feta-release demo --public strokes[:N]|PATH``: the public set the demo's coordinator pretrains on. The
run itself over real processes is in tests/e2e/test_demo_public_pretraining.py; here, what is decided before
any process starts: the set, its refusals and the job's pretraining settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.demo import DIGITS_SHAPE, demo_config
from coordinator.demo_public import STROKES_SEED, demo_public, strokes_count
from feta_release import job_rules
from feta_release.config import load_preset
from feta_release.data import load_dataset, save_npz
from feta_release.data.procedural import generate_dataset
from tests.support.cli import run_cli_merged


def _bad_sets(tmp: Path) -> dict[str, tuple[str, str]]:
    """--public value -> (what the one line must name, the fix it must give)."""
    (tmp / "corrupt.npz").write_bytes(b"not an npz")
    save_npz(generate_dataset("medical", 8, size=32, seed=0), tmp / "chest32.npz", dtype="uint8")
    return {
        str(tmp / "absent.npz"): (f"{tmp / 'absent.npz'}: no such file or folder", "strokes[:N]"),
        str(tmp / "corrupt.npz"): (f"{tmp / 'corrupt.npz'}: not a readable .npz", "give --public a readable"),
        str(tmp / "chest32.npz"): ("public images are [1, 32, 32]", "give a set of 1x28x28 images"),
        "strokes:0": ("--public strokes:0", "e.g. strokes:10000"),
        "strokes:many": ("--public strokes:many", "e.g. strokes:10000"),
    }


def test_a_bad_demo_public_set_is_refused_in_one_line_before_anything_is_written(tmp_path):
    for i, (spec, (names, fix)) in enumerate(_bad_sets(tmp_path).items()):
        out = tmp_path / f"out-{i}"
        code, text = run_cli_merged(["demo", "--out", str(out), "--quick", "--public", spec])
        assert code in (2, 3), (spec, code, text)
        assert names in text and fix in text, (spec, text)
        assert "Traceback" not in text and len(text.strip().splitlines()) == 1, (spec, text)
        assert not out.exists(), spec  # no federation, keys or processes for a set that cannot be used


def test_a_public_description_without_a_public_set_is_refused(tmp_path):
    code, text = run_cli_merged(["demo", "--out", str(tmp_path / "o"), "--public-description", "pen strokes"])
    assert code == 2 and "give --public too" in text and len(text.strip().splitlines()) == 1


def test_demo_public_strokes_are_the_generators_set_written_into_the_demo_folder(tmp_path):
    cfg = load_preset("cpu-eps1-nodpsgd")
    public = demo_public("strokes:40", "", tmp_path / "out", cfg, DIGITS_SHAPE, quick=False)
    assert public is not None and public.path == tmp_path / "out" / "public" / "strokes-40.npz"
    # the same images `data generate strokes --n 40 --seed 7 --out X.npz` writes, read back as the loader does
    save_npz(generate_dataset("strokes", 40, size=28, seed=STROKES_SEED), tmp_path / "cli.npz", dtype="uint8")
    expected = load_dataset(tmp_path / "cli.npz")[0]
    assert public.record()["sha256"] == expected.fingerprint() and public.record()["count"] == 40
    assert "no digit set is their source" in public.description
    words = public.words()
    assert expected.fingerprint()[:16] in words and "40 images 1x28x28" in words and "no epsilon" in words


def test_demo_public_path_keeps_the_given_set_and_description(tmp_path):
    ds = generate_dataset("strokes", 12, size=28, seed=3)
    save_npz(ds, tmp_path / "mine.npz", dtype="uint8")
    cfg = load_preset("cpu-eps1-nodpsgd")
    public = demo_public(str(tmp_path / "mine.npz"), "my strokes", tmp_path / "out", cfg, DIGITS_SHAPE, False)
    assert public is not None and public.description == "my strokes" and public.data.n == 12
    assert not (tmp_path / "out").exists()  # a given set is read where it is, nothing copied


@pytest.mark.parametrize(("spec", "quick", "n"), [("strokes", False, 10_000), ("strokes:7", True, 7)])
def test_strokes_default_to_the_measured_size(spec, quick, n):
    assert strokes_count(spec, quick) == n
    assert strokes_count("strokes-dir/labels.csv", quick) is None  # a path, not the generator


def test_the_demo_job_pretrains_as_the_derived_job_of_train_public_does():
    facts = job_rules.PublicFacts(10_000, (1, 28, 28), ("line", "arc", "loop", "curve"))
    cfg = demo_config("cpu-eps1", 1.0, 1000, 4, 10, quick=False, public=facts)
    derived = job_rules.public_section(
        job_rules.DataFacts(3000, 28, 28, 1, 10, 1.0, federated=True, public=facts)
    )
    assert cfg.public.pretrain_iterations == derived["pretrain_iterations"] == 3125  # ~20 passes of 64
    assert (cfg.public.pretrain_batch, cfg.public.pretrain_lr) == (64, derived["pretrain_lr"])
    assert cfg.dpsgd.trainable == "norm_attention"  # DP-SGD rounds keep the pretrained convolutions
    assert not cfg.public.enabled  # the set itself is named only when the job is signed with it
    quick = demo_config("cpu-eps1", 1.0, 1000, 4, 10, quick=True, public=facts)
    assert 0 < quick.public.pretrain_iterations < 50


def test_without_public_the_demo_job_is_unchanged():
    plain = demo_config("cpu-eps1-nodpsgd", 1.0, 1000, 4, 10, quick=False)
    assert "public" not in plain.to_dict() and plain.dpsgd.trainable == "all"


def test_demo_help_says_public_pretraining_is_off_by_default_and_why():
    code, text = run_cli_merged(["demo", "--help"])
    flat = "".join(text.split())  # the help is wrapped to the terminal, also inside a path
    assert code == 0 and "strokes[:N]|PATH" in flat and "Offbydefault" in flat
    assert "docs/explanation/public-pretraining.md" in flat and "0.714with,0.773without" in flat
