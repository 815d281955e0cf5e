"""``coordinator run`` into the same ``--out``: the signed job is resumed, not re-signed, when the job file is
the same, including a job file that leaves ``[federation] secure_aggregation`` to its default (signing states
it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from feta_release.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _key(tmp_path: Path) -> Path:
    from feta_release.signing import generate_keypair

    return generate_keypair(tmp_path / "keys", "coordinator")[0]


@pytest.mark.parametrize("sites", [["site-a"], ["site-a", "site-b"]])
def test_the_same_job_file_resumes_when_secure_aggregation_is_left_to_its_default(tmp_path, sites):
    from coordinator.runner import sign_or_resume

    job = tmp_path / "job.toml"
    # no secure_aggregation key
    job.write_text((ROOT / "feta_release" / "presets" / "tiny.toml").read_text("utf-8"))
    key, out = _key(tmp_path), tmp_path / "out"
    first = sign_or_resume(job, sites, key, out, "job-1")
    signed = first.read_bytes()
    again = sign_or_resume(job, sites, key, out, None)
    assert again == first and again.read_bytes() == signed  # resumed: the same signed document, not re-signed


def test_another_job_file_or_site_list_is_still_refused(tmp_path):
    from coordinator.runner import sign_or_resume

    job = tmp_path / "job.toml"
    text = (ROOT / "feta_release" / "presets" / "tiny.toml").read_text("utf-8")
    job.write_text(text)
    key, out = _key(tmp_path), tmp_path / "out"
    sign_or_resume(job, ["site-a", "site-b"], key, out, "job-1")
    with pytest.raises(ConfigError, match="another config or site list"):
        sign_or_resume(job, ["site-a", "site-c"], key, out, None)
    job.write_text(text.replace("epsilon = 10.0", "epsilon = 9.0"))
    with pytest.raises(ConfigError, match="another config or site list"):
        sign_or_resume(job, ["site-a", "site-b"], key, out, None)
    job.write_text(text + "\n[federation]\nsecure_aggregation = false\n")  # explicit opt-out: another job
    with pytest.raises(ConfigError, match="another config or site list"):
        sign_or_resume(job, ["site-a", "site-b"], key, out, None)
