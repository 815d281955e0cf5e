"""SDEdit from the released central images inside a signed release (``[sampler] start_sigma``): the release
ships the central images (hashed in the signed manifest), ``synthesize`` starts from augmented copies of them
(numpy-only augmentation, deterministic given the seed), ``--from noise`` and old releases sample from
noise."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from feta_release.errors import ConfigError, ReleaseError  # noqa: E402
from feta_release.models.sampler import sample  # noqa: E402
from feta_release.release import starts as na  # noqa: E402
from feta_release.release.synthesize import synthesize  # noqa: E402
from feta_release.release.verify import verify_release  # noqa: E402
from feta_release.training import augment as ta  # noqa: E402
from tests.support.release import IMAGE_SHAPE, cli_process, make_release  # noqa: E402
from tests.support.release import png_arrays as _arrays  # noqa: E402
from tests.support.release import png_hashes as _pngs  # noqa: E402
from tests.support.release import sdedit_central as _central  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


@pytest.fixture(scope="module")
def sd_release(tmp_path_factory, den_onnx, keys):
    return make_release(
        tmp_path_factory.mktemp("sd") / "rel", den_onnx, keys, start_sigma=0.5, starts=_central()
    )


# -- the numpy augmentation
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 3, 10])
def test_numpy_ops_are_the_torch_warmup_ops(m: int) -> None:
    """Each op of the numpy port equals training.augment's on the same images, strength and signs (a 1/255
    step on under 0.1 % of pixels is float rounding of the sharpen kernel)."""
    from feta_release.data import load_embedded

    x = na.quantize(load_embedded().images[:48].astype(np.float32))
    s = np.where(np.random.default_rng(m).random(48) < 0.5, -1.0, 1.0).astype(np.float32)
    f = m / 30
    for name in na.OP_NAMES:
        ref = ta._quantize(ta.OPS[name](torch.from_numpy(x.copy()), f, torch.from_numpy(s))).numpy()
        got = na.quantize(na.OPS[name](x.copy(), np.full(48, f, np.float32), s))
        diff = np.abs(ref - got)
        assert diff.max() <= 1 / 255 + 1e-6 and (diff > 1e-6).mean() < 1e-3, name
    assert tuple(ta.OPS) == na.OP_NAMES  # the op index drawn means the same op on both sides


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cut=st.integers(0, 9), ops=st.integers(0, 3), mag=st.integers(1, 5))
def test_rand_augment_is_deterministic_and_batch_independent(seed: int, cut: int, ops: int, mag: int) -> None:
    x, _ = _central(4)
    x = x[:10]
    whole = na.rand_augment(x, np.random.default_rng(seed), n_ops=ops, magnitude_max=mag)
    rng = np.random.default_rng(seed)
    parts = np.concatenate(
        [
            na.rand_augment(x[:cut], rng, n_ops=ops, magnitude_max=mag),
            na.rand_augment(x[cut:], rng, n_ops=ops, magnitude_max=mag),
        ]
    )
    assert np.array_equal(whole, parts)
    assert whole.dtype == np.float32 and whole.min() >= 0 and whole.max() <= 1
    assert np.array_equal(np.round(whole * 255) / 255, whole)  # uint8 steps, as the torch bag


def test_start_images_cycle_over_the_class_and_refuse_a_missing_class() -> None:
    imgs, labels = _central(2)
    want = np.array([1, 1, 1, 0])
    got = na.start_images(
        imgs, labels, want, np.array([0, 1, 2, 0]), np.random.default_rng(0), n_ops=0, magnitude_max=1
    )
    assert np.array_equal(got, na.quantize(imgs[[2, 3, 2, 0]]))
    with pytest.raises(ReleaseError, match="no image of class 2"):
        na.start_images(
            imgs[labels < 2],
            labels[labels < 2],
            np.array([2]),
            np.array([0]),
            np.random.default_rng(0),
            n_ops=0,
            magnitude_max=1,
        )


# -- the release
# -------------------------------------------------------------------------------------------------


def test_release_ships_hashed_central_images_and_says_what_they_are(sd_release, keys) -> None:
    man = json.loads((sd_release / "manifest.json").read_text())["manifest"]
    rec = man["starts"]
    assert rec["file"] == "central_images.npz" and (sd_release / rec["file"]).is_file()
    assert rec["sha256"] == hashlib.sha256((sd_release / rec["file"]).read_bytes()).hexdigest()
    assert rec["images"] == 3 and rec["per_class"] == [1, 1, 1]  # tiny preset: rounds 1 x cells 1 per class
    assert man["generator"]["sampler"]["start_sigma"] == 0.5 and "from_release" in man["generator"]["inputs"]
    # a data-protection officer reads that the release contains the noisy central images, with their epsilon
    assert "CONTAINS the noisy central images" in rec["privacy"] and "post-processing" in rec["privacy"]
    assert set(rec["central_epsilon_alone"]) == {"a"} and 0 < rec["central_epsilon_alone"]["a"] < 10
    res = verify_release(sd_release, keys.trust())
    assert res.ok, res.reason()
    assert any(c.name == "central images" and c.status == "pass" for c in res.checks)


def test_tampered_central_images_are_refused_in_one_line(sd_release, keys, tmp_path) -> None:
    import shutil

    rel = tmp_path / "rel"
    shutil.copytree(sd_release, rel)
    imgs, labels = _central()
    # e.g. swapped for other images
    np.savez(rel / "central_images.npz", images=np.ones_like(imgs), labels=labels)
    res = verify_release(rel, keys.trust())
    assert not res.ok and [c.name for c in res.failures] == ["central images"]
    assert "file changed" in res.reason()
    with pytest.raises(ReleaseError, match="central images"):
        synthesize(rel, tmp_path / "out", keys.trust(), num=3, progress=False)
    assert not (tmp_path / "out").exists()
    # through the CLI: exit code of ReleaseError, one line naming the file, no traceback
    proc = cli_process(["verify", str(rel), *keys.trusted_args(tmp_path / "keys")])
    assert proc.returncode == ReleaseError.exit_code
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "central_images.npz" in errors[0] and "file changed" in errors[0]
    (rel / "central_images.npz").unlink()
    assert "missing or unreadable" in verify_release(rel, keys.trust()).reason()


def test_sdedit_synthesis_is_deterministic_and_differs_from_noise(sd_release, keys, tmp_path) -> None:
    def run(name, **kw):
        return synthesize(sd_release, tmp_path / name, keys.trust(), num=9, progress=False, threads=1, **kw)

    a, b = run("a", seed=3), run("b", seed=3, batch=2)
    assert a.source == b.source == "release"  # the signed release's default
    assert _pngs(tmp_path / "a") == _pngs(tmp_path / "b")  # same seed, any batch size: the same images
    run("c", seed=4)
    assert _pngs(tmp_path / "a") != _pngs(tmp_path / "c")
    noise = run("n", seed=3, source="noise")
    assert noise.source == "noise"
    diff = np.abs(_arrays(tmp_path / "a") - _arrays(tmp_path / "n"))
    assert diff.mean() > 0.05
    cert_a = json.loads((tmp_path / "a" / "certificate.json").read_text())
    cert_n = json.loads((tmp_path / "n" / "certificate.json").read_text())
    start = cert_a["certificate"]["generation"]["start"]
    assert start["from"] == "release" and start["start_sigma"] == 0.5
    assert (
        start["central_images"]["sha256"]
        == json.loads((sd_release / "manifest.json").read_text())["manifest"]["starts"]["sha256"]
    )
    assert "already charged" in start["privacy"]
    assert cert_n["certificate"]["generation"]["start"]["from"] == "noise"


def test_sdedit_synthesis_is_the_torch_sdedit_of_its_starts(sd_release, keys, tmp_path, den) -> None:
    """The PNGs are torch's sample(init=starts) at sigma_max = start_sigma on the same noise and the same
    start images (recomputed from the certificate's documented streams), up to the PNG's 8-bit rounding."""
    synthesize(
        sd_release,
        tmp_path / "o",
        keys.trust(),
        per_class=[2, 2, 1],
        seed=5,
        batch=2,
        progress=False,
        threads=1,
    )
    labels = np.array([0, 0, 1, 1, 2])
    noise = np.random.Generator(np.random.PCG64(5)).standard_normal((5, *IMAGE_SHAPE), dtype=np.float32)
    srng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(5, spawn_key=(1,))))
    imgs, rel_labels = _central()
    starts = na.start_images(
        imgs, rel_labels, labels, np.array([0, 1, 0, 1, 0]), srng, n_ops=2, magnitude_max=3
    )
    ref = sample(
        den,
        torch.from_numpy(labels),
        torch.from_numpy(noise),
        steps=6,
        sigma_max=0.5,
        init=torch.from_numpy(starts),
    ).numpy()
    got = _arrays(tmp_path / "o")[:, None]
    assert np.abs(got - ref).max() <= 0.5 / 255 + 1e-4


def test_old_release_without_central_images_samples_from_noise(release, keys, tmp_path, den) -> None:
    """A release made before (or without) start_sigma: format-1 generator, two inputs, noise by default;
    asking for --from release says why not."""
    man = json.loads((release / "manifest.json").read_text())["manifest"]
    assert "starts" not in man and "start_sigma" not in man["generator"]["sampler"]
    rep = synthesize(
        release, tmp_path / "o", keys.trust(), per_class=[1, 1, 1], seed=2, progress=False, threads=1
    )
    assert rep.source == "noise"
    noise = np.random.Generator(np.random.PCG64(2)).standard_normal((3, *IMAGE_SHAPE), dtype=np.float32)
    ref = sample(den, torch.arange(3), torch.from_numpy(noise), steps=6).numpy()
    assert np.abs(_arrays(tmp_path / "o")[:, None] - ref).max() <= 0.5 / 255 + 1e-4
    with pytest.raises(ConfigError, match="--from noise"):
        synthesize(release, tmp_path / "r", keys.trust(), num=3, progress=False, source="release")


def test_start_sigma_without_central_images_is_released_as_the_noise_sampler(
    den_onnx, keys, tmp_path
) -> None:
    rel = make_release(tmp_path / "rel", den_onnx, keys, start_sigma=0.5, starts=None)
    man = json.loads((rel / "manifest.json").read_text())["manifest"]
    assert "starts" not in man and "start_sigma" not in man["generator"]["sampler"]
    assert verify_release(rel, keys.trust()).ok


def test_cli_synthesize_from_release_without_torch(sd_release, keys, tmp_path) -> None:
    out = tmp_path / "out"
    args = [
        "synthesize",
        "--release",
        str(sd_release),
        "--num",
        "3",
        "--out",
        str(out),
        "--no-progress",
        "--threads",
        "1",
        *keys.trusted_args(tmp_path / "keys"),
    ]
    proc = cli_process(args, without_torch=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "started from: the release's noisy central images" in proc.stdout
    proc = cli_process(
        [*args[:-2], "--from", "noise", "--out", str(tmp_path / "n"), *keys.trusted_args(tmp_path / "keys")],
        without_torch=True,
    )
    assert proc.returncode == 0 and "started from: pure noise" in proc.stdout, proc.stderr


def test_dpo_report_says_the_release_contains_the_central_images_and_draws_as_synthesize(
    sd_release, keys, tmp_path
) -> None:
    from feta_release.release.report import write_report

    path, res = write_report(sd_release, tmp_path / "r.html", keys.trust(), per_class=2)
    html = path.read_text("utf-8")
    assert res.ok and "CONTAINS the noisy central images" in html and "SDEdit" in html


# -- Format versions, the starts record's claims --------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_sdedit_release_bumps_the_manifest_format_so_an_old_verifier_refuses_it(
    sd_release, release, keys, tmp_path
) -> None:
    """S3: an old verifier (format 1 only) refuses a release it cannot fully check; the new one refuses a
    downgraded format string re-signed by the coordinator."""
    from tests.support.release import load_signed, resign

    assert (
        json.loads((sd_release / "manifest.json").read_text())["manifest"]["format_version"]
        == "feta-release/manifest/2"
    )
    assert (
        json.loads((release / "manifest.json").read_text())["manifest"]["format_version"]
        == "feta-release/manifest/1"
    )  # a noise release stays readable by old verifiers
    rel = _copy(sd_release, tmp_path / "rel")
    signed = load_signed(rel)
    signed["manifest"]["format_version"] = "feta-release/manifest/1"
    resign(rel, signed, keys.coordinator)
    res = verify_release(rel, keys.trust())
    assert not res.ok and "manifest format" in [c.name for c in res.failures]


def test_verify_checks_the_generator_format_against_the_sampler(sd_release, keys, tmp_path) -> None:
    """S3: the generator's feta.format must be format 2 iff the signed sampler has start_sigma."""
    import onnx

    from tests.support.release import load_signed, rehash, resign

    rel = _copy(sd_release, tmp_path / "rel")
    model = onnx.load(str(rel / "generator.onnx"))
    for p in model.metadata_props:
        if p.key == "feta.format":
            p.value = "feta-release-generator/1"
    onnx.save(model, str(rel / "generator.onnx"))
    signed = load_signed(rel)
    rehash(signed["manifest"]["generator"], rel / "generator.onnx")
    resign(rel, signed, keys.coordinator)
    res = verify_release(rel, keys.trust())
    assert not res.ok and "feta.format" in res.reason()


@pytest.mark.parametrize(
    "field,value",
    [
        ("central_epsilon_alone", {"a": 0.001}),
        ("central_epsilon_alone", {}),
        ("per_class", [1, 1, 5]),
        ("images", 3000),
        ("privacy", "These images carry epsilon 0.001."),
        ("source", "the sites' raw images"),
        ("augmentation", {"kind": "x", "ops": 0, "magnitude_max": 3}),
        ("extra", "a field verify does not know"),
    ],
)
def test_a_coordinator_signed_starts_claim_that_the_signed_inputs_do_not_make_is_refused(
    sd_release, keys, tmp_path, field, value
) -> None:
    """S1: every claim of the starts record is recomputed from the signed job and the site-signed histories; a
    forged one (re-signed by the trusted coordinator) fails verify in one line naming the field, and
    synthesize refuses it."""
    from tests.support.release import load_signed, resign

    rel = _copy(sd_release, tmp_path / "rel")
    signed = load_signed(rel)
    signed["manifest"]["starts"][field] = value
    resign(rel, signed, keys.coordinator)
    res = verify_release(rel, keys.trust())
    assert not res.ok and [c.name for c in res.failures] == ["central images"]
    assert f"starts.{field}" in res.reason() and "\n" not in res.reason()
    with pytest.raises(ReleaseError, match=f"starts.{field}"):
        synthesize(rel, tmp_path / "out", keys.trust(), num=3, progress=False)


def test_certificate_takes_the_recomputed_central_epsilon(sd_release, keys, tmp_path) -> None:
    from feta_release.accounting import epsilon_breakdown, events_from_list

    synthesize(sd_release, tmp_path / "o", keys.trust(), num=3, progress=False, threads=1)
    start = json.loads((tmp_path / "o" / "certificate.json").read_text())["certificate"]["generation"][
        "start"
    ]
    st = json.loads((sd_release / "manifest.json").read_text())["manifest"]["sites"][0]["attestation"][
        "statement"
    ]
    want = epsilon_breakdown(events_from_list(st["events"]), st["delta"], st["accountant"])["central"]
    assert start["central_epsilon_alone"] == {"a": want}
    assert start["augmentation"]["ops"] == 2 and start["augmentation"]["magnitude_max"] == 3


def test_central_images_without_a_central_event_in_the_site_history_are_refused(
    den_onnx, keys, tmp_path, monkeypatch
) -> None:
    """S2: a release cannot ship central images that no site's signed history released: export refuses, and
    verify refuses one built anyway (here: a record computed from another history)."""
    from feta_release.accounting import PrivacyEvent
    from feta_release.release import export_run

    only_dpsgd = [PrivacyEvent("dpsgd", 1.5, 0.05, 200)]
    with pytest.raises(ReleaseError, match="no 'central' event"):
        make_release(tmp_path / "r1", den_onnx, keys, events=only_dpsgd, start_sigma=0.5, starts=_central())
    from tests.support.release import EVENTS

    def with_central(sites):  # noqa: ANN001, ANN202
        return [{**s, "events": [e.to_dict() for e in EVENTS]} for s in sites]

    real_rec, real_claims = export_run.starts_record, export_run.starts_claims
    monkeypatch.setattr(
        export_run, "starts_record", lambda r, f, c, s, n: real_rec(r, f, c, with_central(s), n)
    )
    monkeypatch.setattr(export_run, "starts_claims", lambda c, s, n: real_claims(c, with_central(s), n))
    rel = make_release(tmp_path / "r2", den_onnx, keys, events=only_dpsgd, start_sigma=0.5, starts=_central())
    res = verify_release(rel, keys.trust())
    assert not res.ok and "no 'central' event" in res.reason()


def test_central_image_counts_must_be_what_the_signed_job_releases(
    den_onnx, sd_release, keys, tmp_path
) -> None:
    """S2: rounds x cells images per class (tiny: 1); a file with other counts is refused at export and,
    swapped in with a re-signed hash, at verify."""
    from feta_release.release.starts import starts_bytes
    from tests.support.release import load_signed, rehash, resign

    with pytest.raises(ReleaseError, match="per class"):
        make_release(tmp_path / "r1", den_onnx, keys, start_sigma=0.5, starts=_central(2))
    rel = _copy(sd_release, tmp_path / "rel")
    (rel / "central_images.npz").write_bytes(starts_bytes(*_central(2)))
    signed = load_signed(rel)
    rehash(signed["manifest"]["starts"], rel / "central_images.npz")
    resign(rel, signed, keys.coordinator)
    res = verify_release(rel, keys.trust())
    assert not res.ok and "per class" in res.reason()


def test_a_stale_central_file_of_another_job_is_not_shipped(tmp_path) -> None:
    """S2: the federated coordinator's released/central.npz is bound to its job id; a file of an earlier job
    in the same --out (or one with no job id) is refused, not shipped under the new job."""
    from feta_release.release.export_run import released_central

    imgs, labels = _central()
    (tmp_path / "released").mkdir()
    np.savez(tmp_path / "released" / "central.npz", images=imgs, labels=labels, job_id=np.array("job-old"))
    with pytest.raises(ReleaseError, match="job-old"):
        released_central(tmp_path, "job-new")
    got = released_central(tmp_path, "job-old")
    assert got is not None and np.array_equal(got[1], labels)
    np.savez(tmp_path / "released" / "central.npz", images=imgs, labels=labels)
    with pytest.raises(ReleaseError, match="no job id"):
        released_central(tmp_path, "job-new")


def test_augmentation_sizes_are_bounded_before_any_allocation() -> None:
    """S6: a signed record (or job) with augmentation.ops = 10**9 is refused in one line, not a
    MemoryError."""
    from feta_release.config import load_preset
    from feta_release.release.manifest import starts_claims
    from tests.support.release import EVENTS

    x, _ = _central()
    with pytest.raises(ReleaseError, match="ops"):
        na.rand_augment(x, np.random.default_rng(0), n_ops=10**9, magnitude_max=3)
    cfg = load_preset("tiny").to_dict()
    cfg["warmup"]["augment_ops"] = 10**9
    site = {"site_id": "a", "events": [e.to_dict() for e in EVENTS], "delta": 1e-5, "accountant": "rdp"}
    with pytest.raises(ReleaseError, match="augment_ops"):
        starts_claims(cfg, [site], 3)


def test_dpo_wording_states_unit_scope_worst_case_and_lifetime() -> None:
    """S4: the DPO reads the unit (per image; k x ε per patient by group privacy), that the figure is this
    job's central stage under the collusion assumption, the worst case when secure aggregation was used, and
    where the lifetime total is."""
    from feta_release.accounting import SkellamEvent, epsilon_breakdown
    from feta_release.config import load_preset
    from feta_release.release.manifest import starts_claims

    cfg = load_preset("tiny").to_dict()
    sk = [SkellamEvent("central", 0.5, 1, 10.0, 10.0, mu=200.0, mu_worst=100.0)]
    site = {"site_id": "a", "events": [e.to_dict() for e in sk], "delta": 1e-5, "accountant": "rdp"}
    c = starts_claims(cfg, [site], 3)
    worst = epsilon_breakdown(sk, 1e-5, "rdp", view="worst_case")["central"]
    assert c["unit"] == "image" and worst > c["central_epsilon_alone"]["a"]
    assert c["central_epsilon_worst_case"] == {"a": worst}
    text = c["privacy"]
    assert "per IMAGE" in text and "group privacy" in text and "collude" in text and "lifetime" in text
    assert f"{worst:.3f}" in text
    plain = {**site, "events": [e.to_dict() for e in EVENTS_PLAIN]}
    c2 = starts_claims(cfg, [plain], 3)
    assert c2["central_epsilon_worst_case"] == {} and "collude" not in c2["privacy"]


EVENTS_PLAIN = __import__("tests.support.release", fromlist=["EVENTS"]).EVENTS
