"""The policy `site init` drafts admits the coordinator's standard multi-site job, and a refusal names its
cause.

A draft signed as written must accept the job a coordinator derives for the declared sites (secure
aggregation, each site adding sigma / sqrt(n) of the noise, where the drafts pin each other; each site adding
the whole noise where they pin no peer). Without the other sites' keys pinned, no other noise share of a
secure job counts: its refusal must say so and how to fix it, not blame [privacy] epsilon or a min_sigma the
admin never chose.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.cli import run_cli_merged as _invoke

SITES = ("st-mary", "st-luke", "st-paul")


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 generated scans, the coordinator's key, and each site's site-signing key (what its admin sends)."""
    d = tmp_path_factory.mktemp("fed")
    code, out = _invoke(["data", "generate", "medical", "--n", "300", "--out", str(d / "data")])
    assert code == 0, out
    for who, name in [("coord", "coordinator"), *[(s, "site-signing") for s in SITES]]:
        code, out = _invoke(["keys", "generate", "--out", str(d / who), "--name", name])
        assert code == 0, out
    return d


def _kit(d: Path, name: str, *extra: str) -> Path:
    code, out = _invoke(
        [
            "site",
            "init",
            str(d / name),
            "--data",
            str(d / "data" / "labels.csv"),
            "--site-id",
            "st-mary",
            "--coordinator-key",
            str(d / "coord" / "coordinator.pub"),
            "--app-bundle",
            "ab" * 32,
            *extra,
        ]
    )
    assert code == 0, out
    code, out = _invoke(
        [
            "policy",
            "sign",
            str(d / name / "policy.toml"),
            "--key",
            str(d / name / "keys" / "policy-admin.key"),
            "--out",
            str(d / name / "policy.signed.json"),
        ]
    )
    assert code == 0, out
    return d / name


def _standard_job(d: Path, kit: Path, secure: bool = False) -> Path:
    """The coordinator's derived job for three sites declaring what st-mary declares, signed; ``secure``: with
    ``[federation] secure_aggregation = true`` set by the coordinator, whatever the sites pin."""
    drafts = []
    for s in SITES:
        p = d / f"{kit.name}-{s}.toml"
        p.write_text((kit / "policy.toml").read_text().replace('site_id = "st-mary"', f'site_id = "{s}"'))
        drafts += ["--policy", str(p)]
    job = d / f"{kit.name}-job.toml"
    code, out = _invoke(["coordinator", "derive-job", *drafts, "--epsilon", "1", "--out", str(job)])
    assert code == 0, out
    if secure:
        text = job.read_text()
        assert "secure_aggregation = false" in text, text  # drafts pinning no peers: each site adds the noise
        job.write_text(text.replace("secure_aggregation = false", "secure_aggregation = true"))
    code, out = _invoke(
        [
            "job",
            "sign",
            str(job),
            "--key",
            str(d / "coord" / "coordinator.key"),
            "--job-id",
            "j-1",
            "--sites",
            ",".join(SITES),
            "--out",
            str(job.with_suffix(".signed.json")),
        ]
    )
    assert code == 0, out
    return job.with_suffix(".signed.json")


def _check(d: Path, kit: Path, job: Path) -> tuple[int, str]:
    return _invoke(
        [
            "policy",
            "check",
            str(kit / "policy.signed.json"),
            str(job),
            "--trusted",
            f"st-mary={kit / 'keys' / 'policy-admin.pub'}",
            "--data",
            str(d / "data" / "labels.csv"),
        ]
    )


def test_signed_draft_with_pinned_peers_admits_the_derived_three_site_job(federation: Path) -> None:
    d = federation
    kit = _kit(d, "pinned", *[a for s in SITES[1:] for a in ("--peer", f"{s}={d / s / 'site-signing.pub'}")])
    assert "[secure_aggregation.peers]" in (kit / "policy.toml").read_text()
    code, out = _check(d, kit, _standard_job(d, kit))
    assert code == 0 and "ACCEPTED" in out, out


def test_draft_without_peers_is_refused_naming_the_missing_peers_and_the_fix(federation: Path) -> None:
    d = federation
    kit = _kit(d, "alone")
    code, out = _check(d, kit, _standard_job(d, kit))
    assert code == 0, out  # the derived job: each site adds the whole noise, which the draft admits
    code, out = _check(d, kit, _standard_job(d, kit, secure=True))
    assert code == 6, out
    assert "no peers pinned" in out and "--peer SITE_ID=FILE" in out, out
    assert "min_sigma" not in out and "raise [privacy] epsilon" not in out, out
    assert len(re.findall(r"^  \S+: ", out, re.M)) == 1, out  # one failing rule, said once


def test_peer_naming_this_site_is_refused(federation: Path) -> None:
    d = federation
    code, out = _invoke(
        [
            "site",
            "init",
            str(d / "self"),
            "--data",
            str(d / "data" / "labels.csv"),
            "--site-id",
            "st-mary",
            "--peer",
            f"st-mary={d / 'st-luke' / 'site-signing.pub'}",
        ]
    )
    assert code != 0 and "--peer st-mary=" in out and "Traceback" not in out, out


def test_admin_key_elsewhere_writes_no_admin_private_key_and_says_how_to_sign(federation: Path) -> None:
    d = federation
    code, out = _invoke(
        [
            "site",
            "init",
            str(d / "offline"),
            "--data",
            str(d / "data" / "labels.csv"),
            "--site-id",
            "st-mary",
            "--admin-key-elsewhere",
        ]
    )
    assert code == 0, out
    assert not list((d / "offline").rglob("policy-admin*"))
    assert "--passphrase-prompt" in out and "bring back only policy.signed.json" in out, out
    assert "NOT on this node" in (d / "offline" / "policy.toml").read_text()


def test_admin_key_made_on_the_node_with_a_passphrase_is_encrypted(federation: Path) -> None:
    d = federation
    (d / "pp.txt").write_text("correct horse battery\n")
    code, out = _invoke(
        [
            "site",
            "init",
            str(d / "encrypted"),
            "--data",
            str(d / "data" / "labels.csv"),
            "--site-id",
            "st-mary",
            "--coordinator-key",
            str(d / "coord" / "coordinator.pub"),
            "--app-bundle",
            "ab" * 32,
            "--admin-passphrase-file",
            str(d / "pp.txt"),
        ]
    )
    assert code == 0 and "--passphrase-prompt" in out, out
    key = d / "encrypted" / "keys" / "policy-admin.key"
    assert b"ENCRYPTED" in key.read_bytes()
    sign = ["policy", "sign", str(d / "encrypted" / "policy.toml"), "--key", str(key)]
    code, out = _invoke(sign)
    assert code != 0 and "Traceback" not in out, out
    code, out = _invoke([*sign, "--passphrase-file", str(d / "pp.txt")])
    assert code == 0, out


def test_trusted_bound_to_another_site_is_refused(federation: Path) -> None:
    d = federation
    kit = d / "pinned" if (d / "pinned" / "policy.signed.json").exists() else _kit(d, "bound")
    code, out = _invoke(
        [
            "policy",
            "verify",
            str(kit / "policy.signed.json"),
            "--trusted",
            f"st-luke={kit / 'keys' / 'policy-admin.pub'}",
        ]
    )
    assert code != 0 and "bound to site 'st-luke'" in out, out
    code, out = _invoke(
        [
            "policy",
            "verify",
            str(kit / "policy.signed.json"),
            "--trusted",
            f"st-mary={kit / 'keys' / 'policy-admin.pub'}",
        ]
    )
    assert code == 0, out
