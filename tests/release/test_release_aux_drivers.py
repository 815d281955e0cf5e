"""Both drivers ship the aux-generator pool of a ``[sampler] start_source = "mix"`` job: the federated
coordinator the pool of the aux generator its warm-up fitted to the sites' combined frequency releases (bound
to the job id), and a ``train`` run, a federation of one, the pool of the aux generator fitted the same way to
its site's frequency release."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feta_release.errors import ReleaseError
from feta_release.release.jobdir import build_release
from feta_release.release.synthesize import synthesize
from feta_release.release.verify import verify_release
from feta_release.stages.freq_warmup import aux_pool
from tests.support.federation import (
    SignedTrain,
    federated_run,
    released_by_another_job,
    spy_warm_up,
    tiny_job,
)

MIX: dict[str, dict[str, Any]] = {
    "central": {"rounds": 1, "batch": 10, "sigma": 5.0},
    "frequency": {"sigma": 10.0, "features": 64, "chunk": 256},
    "warmup": {"spatial_iterations": 2, "spatial_batch": 8, "frequency_images": 20, "frequency_epochs": 0},
    "auxgen": {"z_dim": 8, "width": 8, "batch": 20, "epochs": 1, "iterations_per_epoch": 2},
    "dpsgd": {"steps": 0},
    "sampler": {"steps": 2, "start_sigma": 0.5, "start_source": "mix"},
}


def test_a_federated_mix_release_ships_the_coordinators_aux_pool(tmp_path: Path) -> None:
    from feta_release.release import jobdir

    run = federated_run(tmp_path, tiny_job(**MIX), "job-mix")
    out = run.out
    # draws as synthesize does (mix starts), the coordinator's finalize step
    jobdir.sample_grid(out, per_class=2)
    rel = build_release(out, run.fed.coordinator_key)
    res = verify_release(rel, run.trust())
    assert res.ok, res.reason()
    man = res.manifest
    assert man is not None and man["generator"]["sampler"]["start_source"] == "mix" and "starts" in man
    with np.load(rel / "aux_images.npz") as z:
        shipped = z["images"], z["labels"]
    # exactly the public draw of the aux generator the coordinator's warm-up fitted
    want = aux_pool(run.warm_up["fitted"], run.cfg)
    assert np.array_equal(shipped[0], want[0]) and np.array_equal(shipped[1], want[1])
    assert (
        synthesize(rel, tmp_path / "syn", run.trust(), num=6, progress=False, threads=1).source == "release"
    )
    # a stale pool of another job in the same directory is never shipped under this one
    released_by_another_job(out, "aux_images.npz")
    with pytest.raises(ReleaseError, match="is job 'job-other''s, not job 'job-mix''s aux-generator images"):
        build_release(out, run.fed.coordinator_key)


@pytest.mark.slow  # a whole tiny `train` run and its release: about a minute on a loaded machine
def test_train_mix_release_ships_the_aux_pool_its_warm_up_fitted(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`train` is a federation of one: its mix release ships the public draw of the aux generator the
    coordinator's warm-up fitted to the site's frequency release, bound to the job's id."""
    from feta_release.config import load_preset

    seen = spy_warm_up(monkeypatch)
    kit = SignedTrain(tmp_path, 'start_sigma = 0.5\nstart_source = "mix"\n')
    assert load_preset("tiny").sampler.start_source == "central"
    run = kit.run
    kit.train()
    trust = kit.trust()
    res = verify_release(run / "release", trust)
    assert res.ok, res.reason()
    want = aux_pool(seen["fitted"], kit.signed_config())
    with np.load(run / "release" / "aux_images.npz") as r:
        assert np.array_equal(r["images"], want[0]) and np.array_equal(r["labels"], want[1])
    assert (
        synthesize(run / "release", tmp_path / "syn", trust, num=10, progress=False, threads=1).source
        == "release"
    )
    # a stale pool of another job in the run directory is never shipped under this one
    released_by_another_job(run, "aux_images.npz")
    with pytest.raises(ReleaseError, match="job-other"):
        build_release(run, kit.keys["coordinator"][0])
