"""Both drivers ship the central images their warm-up used inside a ``[sampler] start_sigma`` release: a
federation the sites' combined central images (post-processed as the coordinator's warm-up used them), and a
``train`` run, a federation of one, its site's central release post-processed the same way; either bound to
its job's id."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from coordinator.setup import sign_job_file
from feta_release.errors import ReleaseError
from feta_release.federation.warmup import pooled_central
from feta_release.release.jobdir import build_release
from feta_release.release.synthesize import synthesize
from feta_release.release.verify import verify_release
from feta_release.signing import load_public_key
from tests.support.federation import SignedTrain, harness, make_federation, tiny_job
from tests.support.federation import run_harness_job as _run

SDEDIT = {
    "central": {"rounds": 1, "batch": 10, "sigma": 5.0},
    "warmup": {"spatial_iterations": 2, "spatial_batch": 8},
    "dpsgd": {"steps": 0},
    "sampler": {"steps": 2, "start_sigma": 0.5},
}


def _trust(fed) -> dict:  # noqa: ANN001
    return {s.site_id: load_public_key(s.policy_pub) for s in fed.sites}


def test_a_federated_release_ships_the_combined_central_images(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from feta_release.federation import job as fjob

    seen: dict = {}
    real = fjob.warm_up

    def spy(model, central, *args, **kw):  # noqa: ANN001, ANN202
        seen["central"], seen["sizes"] = central, args[2]
        return real(model, central, *args, **kw)

    monkeypatch.setattr(fjob, "warm_up", spy)
    fed = make_federation(tmp_path / "fed")
    cfg = tiny_job(**SDEDIT)
    signed, _ = sign_job_file(fed, cfg, "job-sd")
    out = tmp_path / "out"
    _run(fed, harness(fed), signed, out)
    rel = build_release(out, fed.coordinator_key)
    res = verify_release(rel, _trust(fed))
    assert res.ok, res.reason()
    man = res.manifest
    assert (
        man is not None
        and man["starts"]["images"] == 10
        and "3 sites' releases combined" in man["starts"]["source"]
    )
    assert set(man["starts"]["central_epsilon_alone"]) == {s.site_id for s in fed.sites}
    with np.load(rel / "central_images.npz") as z:
        shipped = z["images"], z["labels"]
    # exactly the images the coordinator's warm-up trained on: the sites' releases it received, combined
    pooled = pooled_central(seen["central"], seen["sizes"], cfg)
    assert np.array_equal(shipped[0], pooled[0]) and np.array_equal(shipped[1], pooled[1])
    rep = synthesize(rel, tmp_path / "syn", _trust(fed), num=10, progress=False, threads=1)
    assert rep.source == "release"


@pytest.mark.slow  # a whole tiny `train` run and its release: about a minute on a loaded machine
def test_train_release_ships_the_central_images_its_warm_up_trained_on(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`train` is a federation of one: its release ships what the coordinator's warm-up trained on, the
    site's central release post-processed (``pooled_central`` of one site), bound to the job's id."""
    from feta_release.config import JobConfig, load_preset
    from feta_release.federation import job as fjob

    seen: dict = {}
    real = fjob.warm_up

    def spy(model, central, *args, **kw):  # noqa: ANN001, ANN202
        seen["central"], seen["sizes"] = central, args[2]
        return real(model, central, *args, **kw)

    monkeypatch.setattr(fjob, "warm_up", spy)
    kit = SignedTrain(tmp_path, "start_sigma = 0.5\n")
    assert load_preset("tiny").sampler.start_sigma is None
    run = kit.run
    kit.train()
    trust = kit.trust()
    res = verify_release(run / "release", trust)
    assert res.ok, res.reason()
    assert res.manifest is not None and res.manifest["starts"]["images"] == 10
    assert set(res.manifest["starts"]["central_epsilon_alone"]) == {"hosp-a"}
    cfg = JobConfig.from_dict(json.loads((run / "signed_job.json").read_text())["job"]["config"])
    pooled = pooled_central(seen["central"], seen["sizes"], cfg)
    assert set(seen["sizes"]) == {"hosp-a"}
    with np.load(run / "release" / "central_images.npz") as r:
        assert np.array_equal(pooled[0], r["images"]) and np.array_equal(pooled[1], r["labels"])
    assert (
        synthesize(run / "release", tmp_path / "syn", trust, num=10, progress=False, threads=1).source
        == "release"
    )
    # a stale central release of another job in the run directory is never shipped under this one
    with np.load(run / "released" / "central.npz") as z:
        arrays = dict(z)
    np.savez(run / "released" / "central.npz", **{**arrays, "job_id": np.array("job-other")})
    shutil.rmtree(run / "release")
    with pytest.raises(ReleaseError, match="job-other"):
        build_release(run, kit.keys["coordinator"][0])


def test_the_job_directory_sample_grid_draws_as_the_release_does(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """samples.png of a start_sigma job: SDEdit from the released central images (the sampler gets start
    images at sigma start_sigma), as `synthesize` draws by default; without central images, the noise
    sampler."""
    from feta_release.release import jobdir

    fed = make_federation(tmp_path / "fed")
    signed, _ = sign_job_file(fed, tiny_job(**SDEDIT), "job-grid")
    out = tmp_path / "out"
    _run(fed, harness(fed), signed, out)
    calls: list = []
    real = jobdir.generate

    def spy(model, labels, seed, scfg, **kw):  # noqa: ANN001, ANN202
        calls.append((scfg.sigma_max, kw.get("init")))
        return real(model, labels, seed, scfg, **kw)

    monkeypatch.setattr(jobdir, "generate", spy)
    jobdir.sample_grid(out, per_class=2)
    assert calls[-1][0] == 0.5 and calls[-1][1] is not None and tuple(calls[-1][1].shape) == (20, 1, 28, 28)
    (out / "released" / "central.npz").unlink()
    jobdir.sample_grid(out, per_class=2)
    assert calls[-1][1] is None and calls[-1][0] == 80.0
