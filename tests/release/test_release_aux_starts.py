"""[sampler] start_source aux/mix in a signed release: the release ships a fixed pool of aux-generator
images (``aux_images.npz``, hashed in the manifest's ``aux_starts`` record, format 3), verify checks it
(missing, changed, reshaped or a forged record: one clear line), and the torch-free ``synthesize`` starts from
augmented copies of it (mix: even index within its class from the pool, odd from the central images)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from feta_release.config import load_preset  # noqa: E402
from feta_release.errors import ReleaseError  # noqa: E402
from feta_release.models.sampler import sample  # noqa: E402
from feta_release.policy.jobs import sign_job  # noqa: E402
from feta_release.release import starts as na  # noqa: E402
from feta_release.release.export_run import assemble_release  # noqa: E402
from feta_release.release.jobfiles import AUX_POOL_PER_CLASS  # noqa: E402
from feta_release.release.manifest import site_record  # noqa: E402
from feta_release.release.onnx_export import SamplerSettings  # noqa: E402
from feta_release.release.synthesize import synthesize  # noqa: E402
from feta_release.release.verify import verify_release  # noqa: E402
from tests.support.release import (  # noqa: E402
    CLASSES,
    IMAGE_SHAPE,
    attest,
    cli_process,
    load_signed,
    rehash,
    resign,
    signed_policy,
)
from tests.support.release import png_arrays as _arrays  # noqa: E402
from tests.support.release import png_hashes as _pngs  # noqa: E402
from tests.support.release import sdedit_central as _central  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


def _pool(per_class: int = AUX_POOL_PER_CLASS, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Stand-ins for aux-generator images: a blob per class, distinct from the central bars."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(CLASSES), dtype=np.int64), per_class)
    images = np.clip(
        rng.normal(0.5, 0.2, (len(labels), *IMAGE_SHAPE)) + labels[:, None, None, None] * 0.1, 0, 1
    )
    return images.astype(np.float32), labels


def _release(
    out: Path,
    den_onnx,
    keys,
    source: str = "mix",
    *,
    starts=True,
    pool=True,  # noqa: ANN001
    events=None,
) -> Path:  # noqa: ANN001
    cfg = load_preset("tiny").replace(sampler={"start_sigma": 0.5, "start_source": source})
    job = sign_job(cfg, keys.coordinator, f"job-{source}", ["a"])
    policy = signed_policy(keys, "a")
    att = attest(keys, "a", job, policy, events)
    return assemble_release(
        out,
        denoiser=den_onnx,
        classes=CLASSES,
        image_shape=IMAGE_SHAPE,
        sampler=SamplerSettings(steps=6, start_sigma=0.5, start_source=source),
        job_id=job["job"]["job_id"],
        config=job["job"]["config"],
        sites=[site_record(att)],
        coordinator_key=keys.coordinator,
        signed_policies={"a": policy},
        signed_job=job,
        enforce_policy=False,
        starts=_central() if starts else None,
        aux_pool=_pool() if pool is True else (pool or None),
    )


@pytest.fixture(scope="module")
def mix_release(tmp_path_factory, den_onnx, keys) -> Path:  # noqa: ANN001
    return _release(tmp_path_factory.mktemp("mix") / "rel", den_onnx, keys)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_mix_release_ships_the_hashed_pool_and_records_the_start_source(mix_release, keys) -> None:  # noqa: ANN001
    man = load_signed(mix_release)["manifest"]
    assert man["format_version"] == "feta-release/manifest/3"
    assert (
        man["generator"]["sampler"]["start_source"] == "mix"
        and man["generator"]["sampler"]["start_sigma"] == 0.5
    )
    rec = man["aux_starts"]
    assert rec["file"] == "aux_images.npz" and rec["per_class"] == [AUX_POOL_PER_CLASS] * 3
    assert "post-processing" in rec["privacy"] and "frequency release" in rec["source"]
    assert man["starts"]["file"] == "central_images.npz"  # mix: the central half ships too
    # the signed manifest says where a start comes from (review: it said "a released central image" for aux
    # too)
    assert "aux-generator pool" in man["generator"]["inputs"]["start"]["meaning"]
    assert "central image" in man["generator"]["inputs"]["start"]["meaning"]
    with np.load(mix_release / "aux_images.npz") as z:
        assert z["images"].dtype == np.float32 and z["labels"].dtype == np.int64
        assert np.array_equal(z["images"], _pool()[0])
    res = verify_release(mix_release, keys.trust())
    assert res.ok, res.reason()
    assert {c.name for c in res.checks if c.status == "pass"} >= {"aux images", "central images"}


def test_mix_synthesis_round_trip_is_the_torch_sdedit_of_the_mixed_starts(
    mix_release, keys, tmp_path, den
) -> None:  # noqa: ANN001
    """export -> verify -> synthesize: even index within its class starts from the pool, odd from the central
    images, augmented from one stream in image order; the PNGs are torch's sample(init=starts), batch-free."""
    a = synthesize(
        mix_release,
        tmp_path / "a",
        keys.trust(),
        per_class=[3, 2, 1],
        seed=5,
        batch=2,
        progress=False,
        threads=1,
    )
    synthesize(
        mix_release,
        tmp_path / "b",
        keys.trust(),
        per_class=[3, 2, 1],
        seed=5,
        batch=4,
        progress=False,
        threads=1,
    )
    assert a.source == "release" and _pngs(tmp_path / "a") == _pngs(tmp_path / "b")
    labels, first = np.array([0, 0, 0, 1, 1, 2]), np.array([0, 1, 2, 0, 1, 0])
    noise = np.random.Generator(np.random.PCG64(5)).standard_normal((6, *IMAGE_SHAPE), dtype=np.float32)
    srng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(5, spawn_key=(1,))))
    starts = na.mixed_start_images(_central(), _pool(), "mix", labels, first, srng, n_ops=2, magnitude_max=3)
    ref = sample(
        den,
        torch.from_numpy(labels),
        torch.from_numpy(noise),
        steps=6,
        sigma_max=0.5,
        init=torch.from_numpy(starts),
    ).numpy()
    assert np.abs(_arrays(tmp_path / "a")[:, None] - ref).max() <= 0.5 / 255 + 1e-4
    start = json.loads((tmp_path / "a" / "certificate.json").read_text())["certificate"]["generation"][
        "start"
    ]
    assert (
        start["start_source"] == "mix"
        and start["aux_images"]["sha256"] == load_signed(mix_release)["manifest"]["aux_starts"]["sha256"]
    )
    assert "central_images" in start and "post-processing" in start["privacy"]


def test_mixed_starts_take_even_indices_from_the_pool() -> None:
    """Without augmentation the starts are the sources themselves: pool row k // 2 for even k, central for
    odd."""
    central, pool = _central(per_class=2), _pool(per_class=3)
    labels, first = np.array([1, 1, 1, 1, 1]), np.arange(5)
    got = na.mixed_start_images(
        central, pool, "mix", labels, first, np.random.default_rng(0), n_ops=0, magnitude_max=1
    )
    p1, c1 = pool[0][pool[1] == 1], central[0][central[1] == 1]
    want = np.stack([p1[0], c1[0], p1[1], c1[1], p1[2]])
    assert np.array_equal(got, na.quantize(want))
    only = na.mixed_start_images(
        central, pool, "aux", labels, first, np.random.default_rng(0), n_ops=0, magnitude_max=1
    )
    assert np.array_equal(only, na.quantize(p1[[0, 1, 2, 0, 1]]))


def test_an_aux_only_release_ships_no_central_images_and_synthesizes(den_onnx, keys, tmp_path) -> None:  # noqa: ANN001
    rel = _release(tmp_path / "rel", den_onnx, keys, "aux", starts=False)
    man = load_signed(rel)["manifest"]
    assert "starts" not in man and not (rel / "central_images.npz").exists() and "aux_starts" in man
    meaning = man["generator"]["inputs"]["start"]["meaning"]
    assert "aux-generator pool" in meaning and "central" not in meaning
    res = verify_release(rel, keys.trust())
    assert res.ok, res.reason()
    rep = synthesize(rel, tmp_path / "o", keys.trust(), num=3, progress=False, threads=1)
    assert rep.source == "release"


@pytest.mark.parametrize("case", ["changed", "missing", "shape"])
def test_a_tampered_pool_is_refused_in_one_line(mix_release, keys, tmp_path, case: str) -> None:  # noqa: ANN001
    rel = _copy(mix_release, tmp_path / "rel")
    images, labels = _pool()
    if case == "changed":  # e.g. swapped for other (private) images
        np.savez(rel / "aux_images.npz", images=np.ones_like(images), labels=labels)
        want = "file changed"
    elif case == "missing":
        (rel / "aux_images.npz").unlink()
        want = "missing or unreadable"
    # a re-shaped pool the trusted coordinator re-signed with its hash: the shape check still refuses it
    else:
        (rel / "aux_images.npz").write_bytes(na.starts_bytes(images[:, :, :4, :4], labels))
        signed = load_signed(rel)
        rehash(signed["manifest"]["aux_starts"], rel / "aux_images.npz")
        resign(rel, signed, keys.coordinator)
        want = "expected float32"
    res = verify_release(rel, keys.trust())
    assert not res.ok and [c.name for c in res.failures] == ["aux images"], res.reason()
    assert want in res.reason() and "\n" not in res.reason()
    with pytest.raises(ReleaseError, match="aux images"):
        synthesize(rel, tmp_path / "out", keys.trust(), num=3, progress=False)
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_a_changed_pool_in_one_line(mix_release, keys, tmp_path) -> None:  # noqa: ANN001
    rel = _copy(mix_release, tmp_path / "rel")
    images, labels = _pool()
    np.savez(rel / "aux_images.npz", images=np.zeros_like(images), labels=labels)
    proc = cli_process(["verify", str(rel), *keys.trusted_args(tmp_path / "keys")])
    assert proc.returncode == ReleaseError.exit_code and "Traceback" not in proc.stderr + proc.stdout
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "aux_images.npz" in errors[0] and "file changed" in errors[0]


@pytest.mark.parametrize(
    "edit", ["privacy", "per_class", "extra", "drop_record", "format2", "source_central"]
)
def test_a_coordinator_signed_aux_record_the_signed_inputs_do_not_make_is_refused(
    mix_release, keys, tmp_path, edit: str
) -> None:  # noqa: ANN001
    rel = _copy(mix_release, tmp_path / "rel")
    signed = load_signed(rel)
    man = signed["manifest"]
    if edit == "privacy":
        man["aux_starts"]["privacy"] = "These are public images."
    elif edit == "per_class":
        man["aux_starts"]["per_class"] = [1, 1, 190]
    elif edit == "extra":
        man["aux_starts"]["note"] = "unknown"
    elif edit == "drop_record":  # an old-style manifest that never names the pool
        del man["aux_starts"]
    # an old verifier (format 2) would not hash the pool: the new one refuses the downgrade
    elif edit == "format2":
        man["format_version"] = "feta-release/manifest/2"
    else:
        del man["generator"]["sampler"]["start_source"]
    resign(rel, signed, keys.coordinator)
    res = verify_release(rel, keys.trust())
    assert not res.ok
    if edit in ("privacy", "per_class", "extra"):
        assert [c.name for c in res.failures] == [
            "aux images"
        ] and f"aux_starts.{edit if edit != 'extra' else 'note'}" in res.reason()


def test_aux_images_need_a_frequency_release_in_every_site_history(den_onnx, keys, tmp_path) -> None:  # noqa: ANN001
    from feta_release.accounting import PrivacyEvent

    events = [PrivacyEvent("central", 5.0, 0.1, 5), PrivacyEvent("dpsgd", 1.5, 0.05, 200)]
    with pytest.raises(ReleaseError, match="no 'frequency' event"):
        _release(tmp_path / "rel", den_onnx, keys, events=events)


def test_export_refuses_aux_starts_without_the_pool_or_with_a_wrong_one(den_onnx, keys, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ReleaseError, match="no aux-generator pool was given"):
        _release(tmp_path / "a", den_onnx, keys, pool=False)
    with pytest.raises(ReleaseError, match="no released central images for the other half"):
        _release(tmp_path / "b", den_onnx, keys, starts=False)
    with pytest.raises(ReleaseError, match=r"holds \[5, 5, 5\] images per class"):
        _release(tmp_path / "c", den_onnx, keys, pool=_pool(per_class=5))
    assert not any(p.name in ("a", "b", "c") for p in tmp_path.iterdir())


def test_the_dpo_report_names_the_aux_images_and_draws_as_synthesize(
    mix_release,
    keys,
    tmp_path,  # noqa: ANN001
    monkeypatch,
) -> None:
    from feta_release.release import report
    from feta_release.release import synthesize as syn

    seen: list = []
    real = syn.mixed_start_images

    def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        seen.append(args[2])
        return real(*args, **kw)

    monkeypatch.setattr(syn, "mixed_start_images", spy)
    path, res = report.write_report(mix_release, tmp_path / "r.html", keys.trust(), per_class=2)
    html = path.read_text("utf-8")
    assert res.ok and "aux-generator images (also released)" in html and "post-processing" in html
    assert "aux-generator image (even index in its class)" in html and seen == ["mix"]


def test_cli_synthesizes_a_mix_release_without_torch(mix_release, keys, tmp_path) -> None:  # noqa: ANN001
    args = [
        "synthesize",
        "--release",
        str(mix_release),
        "--num",
        "4",
        "--out",
        str(tmp_path / "o"),
        "--no-progress",
        "--threads",
        "1",
        *keys.trusted_args(tmp_path / "keys"),
    ]
    proc = cli_process(args, without_torch=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "started from: the release's aux-generator and noisy central images, alternating" in proc.stdout


def test_a_noise_certificate_names_the_unused_aux_pool(den_onnx, keys, tmp_path) -> None:  # noqa: ANN001
    """Review (low): `--from noise` on an aux-only release said nothing of the aux_images.npz it ships."""
    rel = _release(tmp_path / "rel", den_onnx, keys, "aux", starts=False)
    synthesize(rel, tmp_path / "n", keys.trust(), num=3, progress=False, threads=1, source="noise")
    start = json.loads((tmp_path / "n" / "certificate.json").read_text())["certificate"]["generation"][
        "start"
    ]
    assert start["from"] == "noise" and "aux-generator image pool, not used" in start["meaning"]


def _secure_site(stages: tuple[str, ...] = ("central", "frequency")) -> tuple[dict, dict[str, float]]:
    """A site whose central and frequency releases were summed by secure aggregation (Skellam events), and the
    worst-case ε of each stage alone (every other site colludes with the coordinator)."""
    from feta_release.accounting import SkellamEvent, epsilon_breakdown

    sk = [SkellamEvent(s, 0.5, 1, 10.0, 10.0, mu=200.0, mu_worst=100.0) for s in stages]
    site = {"site_id": "a", "events": [e.to_dict() for e in sk], "delta": 1e-5, "accountant": "rdp"}
    return site, {s: epsilon_breakdown([e], 1e-5, "rdp", view="worst_case")[s] for s, e in zip(stages, sk)}


def test_the_aux_record_states_unit_scope_worst_case_and_lifetime() -> None:
    """Review (aux pool, low): the aux_starts text lacked the caveats the central images' record carries: the
    unit (per image; k x ε per patient by group privacy), the frequency stage's figure, the worst case under
    collusion when it was summed by secure aggregation, and that each site's job and lifetime ε cover it."""
    from feta_release.release.manifest import aux_claims

    cfg = load_preset("tiny").replace(sampler={"start_sigma": 0.5, "start_source": "aux"}).to_dict()
    site, worst = _secure_site()
    c = aux_claims(cfg, [site], len(CLASSES))
    assert c["unit"] == "image" and c["frequency_epsilon_worst_case"] == {"a": worst["frequency"]}
    assert worst["frequency"] > c["frequency_epsilon_alone"]["a"]
    text = c["privacy"]
    assert "per IMAGE" in text and "group privacy" in text and "frequency stage alone" in text
    assert "collude" in text and f"{worst['frequency']:.3f}" in text and "lifetime" in text
    plain = aux_claims(
        cfg,
        [
            {
                **site,
                "events": [
                    e.to_dict() for e in __import__("tests.support.release", fromlist=["EVENTS"]).EVENTS
                ],
            }
        ],
        len(CLASSES),
    )
    assert plain["frequency_epsilon_worst_case"] == {} and "collude" not in plain["privacy"]
    assert f"{plain['frequency_epsilon_alone']['a']:.3f}" in plain["privacy"]


@pytest.mark.parametrize("source", ["aux", "mix"])
def test_an_aux_or_mix_certificate_states_unit_and_worst_case(source: str) -> None:
    """Review (aux pool, low): the certificate's start section of an aux/mix release named neither the unit
    nor the worst case under collusion (the central start does); a mix one carried only the pool's privacy
    words."""
    from feta_release.release.manifest import aux_claims, starts_claims
    from feta_release.release.synthesize import start_statement

    cfg = load_preset("tiny").replace(sampler={"start_sigma": 0.5, "start_source": source}).to_dict()
    site, worst = _secure_site()
    aux, central = aux_claims(cfg, [site], len(CLASSES)), starts_claims(cfg, [site], len(CLASSES))
    man = {
        "generator": {"sampler": {"start_sigma": 0.5, "start_source": source}},
        "sites": [{"attestation": {"statement": site}}],
        "aux_starts": {"file": "aux_images.npz", "sha256": "0" * 64},
        **({"starts": {"file": "central_images.npz", "sha256": "1" * 64}} if source == "mix" else {}),
    }
    start = start_statement("release", man, central if source == "mix" else None, aux)
    assert start["unit"] == "image" and start["frequency_epsilon_worst_case"] == {"a": worst["frequency"]}
    assert "collude" in start["privacy"] and "per IMAGE" in start["privacy"]
    if source == "mix":  # both sources' caveats
        assert start["central_epsilon_worst_case"] == {"a": worst["central"]}
        assert "central stage alone" in start["privacy"] and "frequency stage alone" in start["privacy"]


def test_a_synthesized_mix_certificate_carries_the_recomputed_aux_figures(
    mix_release, keys, tmp_path
) -> None:  # noqa: ANN001
    synthesize(mix_release, tmp_path / "o", keys.trust(), num=3, progress=False, threads=1)
    start = json.loads((tmp_path / "o" / "certificate.json").read_text())["certificate"]["generation"][
        "start"
    ]
    rec = load_signed(mix_release)["manifest"]["aux_starts"]
    assert start["unit"] == rec["unit"] == "image" and set(start["frequency_epsilon_alone"]) == {"a"}
    assert start["frequency_epsilon_alone"] == rec["frequency_epsilon_alone"]
    assert "per IMAGE" in start["privacy"] and "per IMAGE" in rec["privacy"]


def _released_as(
    out: Path,
    den_onnx,
    keys,
    job_sampler: dict,
    sampler: SamplerSettings,
    *,
    starts: bool,  # noqa: ANN001
    pool: bool,
) -> Path:
    """A release built by the real export step whose sampler may differ from the signed job's [sampler]."""
    cfg = load_preset("tiny").replace(sampler=job_sampler)
    job = sign_job(cfg, keys.coordinator, "job-s", ["a"])
    policy = signed_policy(keys, "a")
    return assemble_release(
        out,
        denoiser=den_onnx,
        classes=CLASSES,
        image_shape=IMAGE_SHAPE,
        sampler=sampler,
        job_id=job["job"]["job_id"],
        config=job["job"]["config"],
        sites=[site_record(attest(keys, "a", job, policy))],
        coordinator_key=keys.coordinator,
        signed_policies={"a": policy},
        signed_job=job,
        enforce_policy=False,
        starts=_central() if starts else None,
        aux_pool=_pool() if pool else None,
    )


MIX_JOB = {"start_sigma": 0.5, "start_source": "mix"}


@pytest.mark.parametrize("case", ["mix_as_aux", "start_sigma", "sigma_max", "guidance"])
def test_a_release_whose_sampler_is_not_the_signed_jobs_is_refused(
    den_onnx, keys, tmp_path, case: str
) -> None:  # noqa: ANN001
    """Review (aux pool, low): verify never compared the released sampler with the signed job's [sampler]: a
    job the sites ran as mix could be released as aux (or with another start sigma, noise schedule or
    guidance) and verify answered OK. Now only `export --solver/--steps` may differ."""
    job, field = MIX_JOB, "start_source"
    if case == "mix_as_aux":
        sampler, starts = SamplerSettings(steps=6, start_sigma=0.5, start_source="aux"), False
    elif case == "start_sigma":
        sampler, starts, field = (
            SamplerSettings(steps=6, start_sigma=0.9, start_source="mix"),
            True,
            "start_sigma",
        )
    elif case == "sigma_max":
        sampler, starts, field = (
            SamplerSettings(sigma_max=40.0, start_sigma=0.5, start_source="mix"),
            True,
            "sigma_max",
        )
    else:
        sampler, starts, field = (
            SamplerSettings(guidance=1.0, start_sigma=0.5, start_source="mix"),
            True,
            "guidance",
        )
    rel = _released_as(tmp_path / "rel", den_onnx, keys, job, sampler, starts=starts, pool=True)
    res = verify_release(rel, keys.trust())
    assert not res.ok and [c.name for c in res.failures] == ["sampler"], res.reason()
    why = res.reason()
    assert f"{rel / 'manifest.json'}: generator.sampler.{field} is" in why and "signed job's [sampler]" in why
    assert "export the release again" in why and "\n" not in why
    with pytest.raises(ReleaseError, match="sampler"):
        synthesize(rel, tmp_path / "out", keys.trust(), num=3, progress=False)


def test_the_signed_jobs_sampler_passes_with_export_overrides_and_the_central_normalisation(
    den_onnx,
    keys,  # noqa: ANN001
    tmp_path,
) -> None:
    """The honest cases: the job's mix sampler with steps/solver set at export, and a central-start job
    released without central images (export drops start_sigma: the noise sampler), both verify."""
    rel = _released_as(
        tmp_path / "a",
        den_onnx,
        keys,
        MIX_JOB,
        SamplerSettings(solver="heun", steps=6, start_sigma=0.5, start_source="mix"),
        starts=True,
        pool=True,
    )
    res = verify_release(rel, keys.trust())
    assert res.ok and any(c.name == "sampler" and c.status == "pass" for c in res.checks), res.reason()
    rel = _released_as(
        tmp_path / "b",
        den_onnx,
        keys,
        {"start_sigma": 0.5},
        SamplerSettings(start_sigma=0.5),
        starts=False,
        pool=False,
    )
    res = verify_release(rel, keys.trust())
    assert res.ok, res.reason()
    assert "start_sigma" not in load_signed(rel)["manifest"]["generator"]["sampler"]
