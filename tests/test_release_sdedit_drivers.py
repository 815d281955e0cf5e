"""Both drivers ship the central images their warm-up used inside a ``[sampler] start_sigma`` release: a federation
the sites' combined central images (post-processed as the coordinator's warm-up used them), a ``train`` run its own
central release, which must be byte for byte the answer its site ledger recorded."""

from __future__ import annotations

import json
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

from .federation_fixtures import harness, make_federation, tiny_job
from .federation_fixtures import run_harness_job as _run

SDEDIT = {"central": {"rounds": 1, "batch": 10, "sigma": 5.0}, "warmup": {"spatial_iterations": 2, "spatial_batch": 8},
          "dpsgd": {"steps": 0}, "sampler": {"steps": 2, "start_sigma": 0.5}}


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
    assert man is not None and man["starts"]["images"] == 10 and "3 sites' releases combined" in man["starts"]["source"]
    assert set(man["starts"]["central_epsilon_alone"]) == {s.site_id for s in fed.sites}
    with np.load(rel / "central_images.npz") as z:
        shipped = z["images"], z["labels"]
    # exactly the images the coordinator's warm-up trained on: the sites' releases it received, combined
    pooled = pooled_central(seen["central"], seen["sizes"], cfg)
    assert np.array_equal(shipped[0], pooled[0]) and np.array_equal(shipped[1], pooled[1])
    rep = synthesize(rel, tmp_path / "syn", _trust(fed), num=10, progress=False, threads=1)
    assert rep.source == "release"


@pytest.mark.slow  # a whole tiny `train` run and its release: about a minute on a loaded machine
def test_train_release_ships_its_ledger_recorded_central_images(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from feta_release.cli import main
    from feta_release.training import local_job
    from feta_release.config import load_preset
    from feta_release.data import load_embedded, save_npz
    from feta_release.policy import make_policy, sign_policy
    from feta_release.release.export_run import export_run
    from feta_release.signing import generate_keypair, load_private_key

    full = load_embedded()
    rng = np.random.default_rng(3)
    idx = np.concatenate([rng.choice(np.flatnonzero(full.labels == c), 20, replace=False) for c in range(10)])
    save_npz(full.subset(np.sort(idx)), tmp_path / "small.npz")
    keys = {n: generate_keypair(tmp_path / "keys", n) for n in ("coordinator", "site", "admin")}
    doc = make_policy("hosp-a", "1" * 64, 200, [load_private_key(keys["coordinator"][0]).public_key()],
                      per_job=(10.0, 1e-5), lifetime=(20.0, 1e-5), site_key=load_private_key(keys["site"][0]).public_key())
    (tmp_path / "policy.json").write_text(json.dumps(sign_policy(doc, load_private_key(keys["admin"][0]))))
    root = Path(__file__).resolve().parent.parent
    job = (root / "feta_release" / "presets" / "tiny.toml").read_text("utf-8")
    (tmp_path / "job.toml").write_text(job.replace("[sampler]\n", "[sampler]\nstart_sigma = 0.5\n"))
    assert load_preset("tiny").sampler.start_sigma is None
    run = tmp_path / "run"
    checked: dict = {}
    real_build = local_job.build_release

    def swap_then_build(rd, *args, **kw):  # noqa: ANN001, ANN202
        """S5 (review s6): a local user swaps the file after attest_run checked it against the ledger."""
        with np.load(rd / "released" / "central.npz") as z:
            checked.update(z)
        np.savez(rd / "released" / "central.npz", **{**checked, "images": np.ones_like(checked["images"])})
        return real_build(rd, *args, **kw)

    monkeypatch.setattr(local_job, "build_release", swap_then_build)
    try:
        main(["train", str(tmp_path / "job.toml"), "--data", str(tmp_path / "small.npz"), "--out", str(run),
              "--synthetic", "10", "--no-progress", "--site-key", str(keys["site"][0]), "--policy",
              str(tmp_path / "policy.json"), "--trusted", str(keys["admin"][1]), "--coordinator-key",
              str(keys["coordinator"][0])])
    except SystemExit as exc:
        assert not exc.code
    trust = {"hosp-a": load_public_key(keys["admin"][1])}
    res = verify_release(run / "release", trust)
    assert res.ok, res.reason()
    with np.load(run / "release" / "central_images.npz") as r:  # the bytes checked, not the swapped file
        assert np.array_equal(checked["images"], r["images"]) and np.array_equal(checked["labels"], r["labels"])
    assert not np.array_equal(checked["images"], np.ones_like(checked["images"]))
    assert synthesize(run / "release", tmp_path / "syn", trust, num=10, progress=False, threads=1).source == "release"
    # a run directory whose central release was edited after the run is refused (it is not what the ledger recorded)
    with np.load(run / "released" / "central.npz") as z:
        arrays = dict(z)
    arrays["images"] = np.clip(arrays["images"] * 1.5, 0, 1)
    np.savez(run / "released" / "central.npz", **arrays)
    with pytest.raises(ReleaseError, match="not the central release the site ledger recorded"):
        export_run(run, tmp_path / "rel2", coordinator_key=load_private_key(keys["coordinator"][0]),
                   site_key=load_private_key(keys["site"][0]),
                   signed_policy=json.loads((tmp_path / "policy.json").read_text()))


def test_the_job_directory_sample_grid_draws_as_the_release_does(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """samples.png of a start_sigma job: SDEdit from the released central images (the sampler gets start images at
    sigma start_sigma), as `synthesize` draws by default; without central images, the noise sampler."""
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
