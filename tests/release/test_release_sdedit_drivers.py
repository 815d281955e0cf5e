"""Both drivers ship the central images their warm-up used inside a ``[sampler] start_sigma`` release: a
federation the sites' combined central images (post-processed as the coordinator's warm-up used them), and a
``train`` run, a federation of one, its site's central release post-processed the same way; either bound to
its job's id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feta_release.errors import ReleaseError
from feta_release.federation.warmup import pooled_central
from feta_release.release.jobdir import build_release
from feta_release.release.synthesize import synthesize
from feta_release.release.verify import verify_release
from tests.support.federation import (
    FederatedRun,
    SignedTrain,
    federated_run,
    released_by_another_job,
    spy_warm_up,
    tiny_job,
)

SDEDIT: dict[str, dict[str, Any]] = {
    "central": {"rounds": 1, "batch": 10, "sigma": 5.0},
    "warmup": {"spatial_iterations": 2, "spatial_batch": 8},
    "dpsgd": {"steps": 0},
    "sampler": {"steps": 2, "start_sigma": 0.5},
}


@pytest.fixture(scope="module")
def sdedit_run(tmp_path_factory: pytest.TempPathFactory) -> FederatedRun:
    """One federated start_sigma job for the module's tests; a test that writes into its job directory works
    on a copy."""
    return federated_run(tmp_path_factory.mktemp("sdedit"), tiny_job(**SDEDIT), "job-sd")


def test_a_federated_release_ships_the_combined_central_images(
    tmp_path: Path, sdedit_run: FederatedRun
) -> None:
    fed, seen = sdedit_run.fed, sdedit_run.warm_up
    out = sdedit_run.copy(tmp_path / "out")
    rel = build_release(out, fed.coordinator_key)
    res = verify_release(rel, sdedit_run.trust())
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
    pooled = pooled_central(seen["central"], seen["sizes"], sdedit_run.cfg)
    assert np.array_equal(shipped[0], pooled[0]) and np.array_equal(shipped[1], pooled[1])
    rep = synthesize(rel, tmp_path / "syn", sdedit_run.trust(), num=10, progress=False, threads=1)
    assert rep.source == "release"


@pytest.mark.slow  # a whole tiny `train` run and its release: about a minute on a loaded machine
def test_train_release_ships_the_central_images_its_warm_up_trained_on(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`train` is a federation of one: its release ships what the coordinator's warm-up trained on, the
    site's central release post-processed (``pooled_central`` of one site), bound to the job's id."""
    from feta_release.config import load_preset

    seen = spy_warm_up(monkeypatch)
    kit = SignedTrain(tmp_path, "start_sigma = 0.5\n")
    assert load_preset("tiny").sampler.start_sigma is None
    run = kit.run
    kit.train()
    trust = kit.trust()
    res = verify_release(run / "release", trust)
    assert res.ok, res.reason()
    assert res.manifest is not None and res.manifest["starts"]["images"] == 10
    assert set(res.manifest["starts"]["central_epsilon_alone"]) == {"hosp-a"}
    pooled = pooled_central(seen["central"], seen["sizes"], kit.signed_config())
    assert set(seen["sizes"]) == {"hosp-a"}
    with np.load(run / "release" / "central_images.npz") as r:
        assert np.array_equal(pooled[0], r["images"]) and np.array_equal(pooled[1], r["labels"])
    assert (
        synthesize(run / "release", tmp_path / "syn", trust, num=10, progress=False, threads=1).source
        == "release"
    )
    # a stale central release of another job in the run directory is never shipped under this one
    released_by_another_job(run, "central.npz")
    with pytest.raises(ReleaseError, match="job-other"):
        build_release(run, kit.keys["coordinator"][0])


def test_the_job_directory_sample_grid_draws_as_the_release_does(
    tmp_path: Path,
    monkeypatch,  # noqa: ANN001
    sdedit_run: FederatedRun,
) -> None:
    """samples.png of a start_sigma job: SDEdit from the released central images (the sampler gets start
    images at sigma start_sigma), as `synthesize` draws by default; without central images, the noise
    sampler."""
    from feta_release.release import jobdir

    out = sdedit_run.copy(tmp_path / "out")
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
