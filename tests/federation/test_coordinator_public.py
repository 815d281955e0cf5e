"""``coordinator run --public PATH``: the coordinator reads the public set with `train`'s loader and checks,
the signed job names it by hash, the ServerApp finds it in --out (only the coordinator reads it), and a resume
or another set is checked against the signed job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from feta_release.data import save_npz
from feta_release.data.procedural import generate_dataset
from feta_release.errors import ConfigError, DataError
from feta_release.job_rules import job_toml
from tests.support.cli import run_cli
from tests.support.federation import tiny_job


def _public(tmp_path: Path, seed: int = 9) -> tuple[Path, object]:
    ds = generate_dataset("strokes", 40, size=28, seed=seed)
    return save_npz(ds, tmp_path / f"public-{seed}.npz"), ds


def _job_file(tmp_path: Path, **public: object) -> Path:
    path = tmp_path / "job.toml"
    cfg = tiny_job(public={"pretrain_iterations": 2, "pretrain_batch": 8, **public})
    path.write_text(job_toml(cfg), "utf-8")
    return path


def _key(tmp_path: Path) -> Path:
    from feta_release.signing import generate_keypair

    return generate_keypair(tmp_path / "keys", "coordinator")[0]


def test_the_signed_job_names_the_public_set_and_a_resume_checks_it(tmp_path):
    from coordinator.runner import PublicOption, sign_or_resume

    path, ds = _public(tmp_path)
    job, key, out = _job_file(tmp_path), _key(tmp_path), tmp_path / "out"
    signed = sign_or_resume(job, ["site-a", "site-b"], key, out, "job-1", PublicOption(str(path), "strokes"))
    pub = json.loads(signed.read_text())["job"]["config"]["public"]
    assert pub["sha256"] == ds.fingerprint()  # type: ignore[attr-defined]
    assert pub["count"] == 40 and pub["shape"] == [1, 28, 28]
    assert pub["description"] == "strokes"
    again = sign_or_resume(job, ["site-a", "site-b"], key, out, None, PublicOption(str(path), "strokes"))
    assert again.read_bytes() == signed.read_bytes()  # resumed, not re-signed
    with pytest.raises(ConfigError, match="give the same --public PATH"):
        sign_or_resume(job, ["site-a", "site-b"], key, out, None)
    other, _ = _public(tmp_path, seed=10)
    with pytest.raises(ConfigError, match="another config"):
        sign_or_resume(job, ["site-a", "site-b"], key, out, None, PublicOption(str(other), "strokes"))


def test_a_selection_job_without_a_public_set_is_refused_before_signing(tmp_path):
    from coordinator.runner import sign_or_resume

    job = _job_file(tmp_path, selection=True, selection_groups=3)
    with pytest.raises(ConfigError, match=r"give the public set \(--public PATH\)"):
        sign_or_resume(job, ["site-a"], _key(tmp_path), tmp_path / "out", "job-1")
    assert not (tmp_path / "out" / "signed_job.json").exists()


def test_a_public_set_of_another_shape_than_the_sites_is_refused_before_any_release(tmp_path):
    from coordinator.runner import PublicOption, sign_or_resume
    from feta_release.federation.job import save_public
    from tests.support.federation import harness, ledger_requests, make_federation, run_harness_job

    fed = make_federation(tmp_path / "fed")
    small = save_npz(generate_dataset("strokes", 40, size=16, seed=3), tmp_path / "small.npz")
    job, out = _job_file(tmp_path), tmp_path / "out"
    option = PublicOption(str(small))
    signed = sign_or_resume(job, ["site-a", "site-b", "site-c"], fed.coordinator_key, out, "job-16", option)
    save_public(out, option.path, "", None, option.options(tiny_job()))
    with pytest.raises(DataError, match="private data's"):
        run_harness_job(fed, harness(fed), json.loads(signed.read_text()), out)
    assert ledger_requests(fed, "site-a", "job-16") == []


@pytest.mark.slow
def test_the_serverapp_pretrains_on_the_set_coordinator_run_left_in_out(tmp_path):
    """What `coordinator run --public` hands the ServerApp (a file in --out, as its --device): the job runs
    with public pretraining."""
    from coordinator.runner import PublicOption, sign_or_resume
    from feta_release.federation.job import save_public
    from tests.support.federation import harness, make_federation, run_harness_job

    fed = make_federation(tmp_path / "fed")
    path, _ = _public(tmp_path)
    job, out = _job_file(tmp_path), tmp_path / "out"
    option = PublicOption(str(path), "strokes")
    signed = sign_or_resume(job, ["site-a", "site-b", "site-c"], fed.coordinator_key, out, "job-pub", option)
    save_public(out, option.path, option.description, None, option.options(tiny_job()))
    res = run_harness_job(fed, harness(fed), json.loads(signed.read_text()), out)
    assert res.rounds_done == 2
    log = (out / "progress.jsonl").read_text()
    assert "public pretraining: 2 steps" in log
    save_public(out / "again", None, "", None, option.options(tiny_job()))  # no --public: no file
    assert not (out / "again" / "coordinator_public.json").exists()


def test_coordinator_run_takes_public_and_hands_it_to_the_serverapp(tmp_path, monkeypatch, capsys):
    import coordinator.runner as runner

    path, ds = _public(tmp_path)
    job, key, out = _job_file(tmp_path), _key(tmp_path), tmp_path / "out"
    seen = {}

    def submitted(signed_path, key_path, out_dir, superlink, **kw):
        seen["public"] = kw["public"]
        runner.save_public(
            out_dir,
            kw["public"].path,
            kw["public"].description,
            kw["public"].pretrained,
            kw["public"].options(runner.load_job_of(signed_path)),
        )
        return {"job_id": "j", "site_epsilon": {}, "rounds": 0, "skipped": {}, "timings": {}}

    monkeypatch.setattr(runner, "run_signed_job", submitted)
    code, _, err = run_cli(
        [
            "coordinator",
            "run",
            str(job),
            "--sites",
            "site-a,site-b",
            "--key",
            str(key),
            "--out",
            str(out),
            "--insecure",
            "--no-release",
            "--public",
            str(path),
            "--public-description",
            "pen strokes",
        ],
        capsys,
    )
    assert code == 0, err
    assert seen["public"].path == str(path) and seen["public"].description == "pen strokes"
    signed = json.loads((out / "signed_job.json").read_text())
    assert signed["job"]["config"]["public"]["sha256"] == ds.fingerprint()  # type: ignore[attr-defined]
    saved = json.loads((out / "coordinator_public.json").read_text())
    assert saved["path"] == str(path.resolve()) and saved["load"]["resize"] == "refuse"
    code, _, err = run_cli(
        [
            "coordinator",
            "run",
            str(job),
            "--sites",
            "site-a,site-b",
            "--key",
            str(key),
            "--out",
            str(tmp_path / "o2"),
            "--insecure",
            "--no-release",
            "--public",
            str(tmp_path / "missing.npz"),
        ],
        capsys,
    )
    assert code != 0 and "missing.npz" in err and "Traceback" not in err
