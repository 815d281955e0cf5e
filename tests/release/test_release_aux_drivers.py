"""Both drivers ship the aux-generator pool of a ``[sampler] start_source = "mix"`` job: the federated
coordinator the pool of the aux generator its warm-up fitted to the sites' combined frequency releases (bound
to the job id), and a ``train`` run, a federation of one, the pool of the aux generator fitted the same way to
its site's frequency release."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.setup import sign_job_file
from feta_release.errors import ReleaseError
from feta_release.release.jobdir import build_release
from feta_release.release.synthesize import synthesize
from feta_release.release.verify import verify_release
from feta_release.signing import load_public_key
from feta_release.stages.freq_warmup import aux_pool
from tests.support.federation import SignedTrain, harness, make_federation, tiny_job
from tests.support.federation import run_harness_job as _run

MIX = {
    "central": {"rounds": 1, "batch": 10, "sigma": 5.0},
    "frequency": {"sigma": 10.0, "features": 64, "chunk": 256},
    "warmup": {"spatial_iterations": 2, "spatial_batch": 8, "frequency_images": 20, "frequency_epochs": 0},
    "auxgen": {"z_dim": 8, "width": 8, "batch": 20, "epochs": 1, "iterations_per_epoch": 2},
    "dpsgd": {"steps": 0},
    "sampler": {"steps": 2, "start_sigma": 0.5, "start_source": "mix"},
}


def test_a_federated_mix_release_ships_the_coordinators_aux_pool(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from feta_release.federation import job as fjob
    from feta_release.release import jobdir

    seen: dict = {}
    real = fjob.warm_up

    def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        seen["aux"] = real(*args, **kw)
        return seen["aux"]

    monkeypatch.setattr(fjob, "warm_up", spy)
    fed = make_federation(tmp_path / "fed")
    cfg = tiny_job(**MIX)
    signed, _ = sign_job_file(fed, cfg, "job-mix")
    out = tmp_path / "out"
    _run(fed, harness(fed), signed, out)
    # draws as synthesize does (mix starts), the coordinator's finalize step
    jobdir.sample_grid(out, per_class=2)
    rel = build_release(out, fed.coordinator_key)
    trust = {s.site_id: load_public_key(s.policy_pub) for s in fed.sites}
    res = verify_release(rel, trust)
    assert res.ok, res.reason()
    man = res.manifest
    assert man is not None and man["generator"]["sampler"]["start_source"] == "mix" and "starts" in man
    with np.load(rel / "aux_images.npz") as z:
        shipped = z["images"], z["labels"]
    # exactly the public draw of the aux generator the coordinator's warm-up fitted
    want = aux_pool(seen["aux"], cfg)
    assert np.array_equal(shipped[0], want[0]) and np.array_equal(shipped[1], want[1])
    assert synthesize(rel, tmp_path / "syn", trust, num=6, progress=False, threads=1).source == "release"
    # a stale pool of another job in the same directory is never shipped under this one
    with np.load(out / "released" / "aux_images.npz") as z:
        arrays = dict(z)
    np.savez(out / "released" / "aux_images.npz", **{**arrays, "job_id": np.array("job-other")})
    with pytest.raises(ReleaseError, match="is job 'job-other''s, not job 'job-mix''s aux-generator images"):
        _rebuild(out, fed.coordinator_key)


def _rebuild(out: Path, key) -> Path:  # noqa: ANN001
    import shutil

    shutil.rmtree(out / "release")
    return build_release(out, key)


@pytest.mark.slow  # a whole tiny `train` run and its release: about a minute on a loaded machine
def test_train_mix_release_ships_the_aux_pool_its_warm_up_fitted(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`train` is a federation of one: its mix release ships the public draw of the aux generator the
    coordinator's warm-up fitted to the site's frequency release, bound to the job's id."""
    import json

    from feta_release.config import JobConfig, load_preset
    from feta_release.federation import job as fjob

    seen: dict = {}
    real = fjob.warm_up

    def spy(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        seen["aux"] = real(*args, **kw)
        return seen["aux"]

    monkeypatch.setattr(fjob, "warm_up", spy)
    kit = SignedTrain(tmp_path, 'start_sigma = 0.5\nstart_source = "mix"\n')
    assert load_preset("tiny").sampler.start_source == "central"
    run = kit.run
    kit.train()
    trust = kit.trust()
    res = verify_release(run / "release", trust)
    assert res.ok, res.reason()
    cfg = JobConfig.from_dict(json.loads((run / "signed_job.json").read_text())["job"]["config"])
    want = aux_pool(seen["aux"], cfg)
    with np.load(run / "release" / "aux_images.npz") as r:
        assert np.array_equal(r["images"], want[0]) and np.array_equal(r["labels"], want[1])
    assert (
        synthesize(run / "release", tmp_path / "syn", trust, num=10, progress=False, threads=1).source
        == "release"
    )
    # a stale pool of another job in the run directory is never shipped under this one
    with np.load(run / "released" / "aux_images.npz") as z:
        arrays = dict(z)
    np.savez(run / "released" / "aux_images.npz", **{**arrays, "job_id": np.array("job-other")})
    with pytest.raises(ReleaseError, match="job-other"):
        _rebuild(run, kit.keys["coordinator"][0])
