"""Site onboarding: `site init` kit, node.toml, sign-time review, and `policy check` = the node's
enforcement."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest

from feta_release.errors import ConfigError
from tests.support.cli import run_cli_merged as _invoke
from tests.support.dicom import PHI, write_dicom
from tests.support.policy import NOW, keys, policy_doc, signed_policy


def _dicom_site(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for c in ("normal", "effusion"):
        for i in range(4):
            write_dicom(
                root / c / f"{i}.dcm",
                rng.integers(0, 4096, (12, 12)).astype(np.uint16),
                patient_id=f"PID-{c}-{i // 2}",
            )
    return root


@pytest.fixture()
def kit(tmp_path: Path) -> Path:
    data = _dicom_site(tmp_path / "dicom")
    code, out = _invoke(["keys", "generate", "--out", str(tmp_path / "coord"), "--name", "coordinator"])
    assert code == 0, out
    code, out = _invoke(
        [
            "site",
            "init",
            str(tmp_path / "kit"),
            "--data",
            str(data),
            "--site-id",
            "st-mary",
            "--resize",
            "crop",
            "--image-size",
            "8",
            "--superlink",
            "coord.example:9092",
            "--patient-cap",
            "2",
        ]
    )
    assert code == 0, out
    assert (
        "8 images, 4 patients (unit of privacy: the patient, at most 2 image(s) each)" in out
        and "node-auth.pub" in out
    )
    return tmp_path


def test_kit_files_keys_private_and_no_phi(kit: Path) -> None:
    k = kit / "kit"
    for name in ("policy-admin.key", "site-signing.key", "node-auth"):
        mode = stat.S_IMODE((k / "keys" / name).stat().st_mode)
        assert mode & 0o077 == 0, (name, oct(mode))
        assert (k / "keys" / (name.removesuffix(".key") + ".pub")).exists()
    assert (k / "keys" / "node-auth.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    text = "".join(p.read_text("utf-8", "replace") for p in k.rglob("*") if p.is_file())
    for v in list(PHI.values()) + ["PID-normal", "Doe", "Johanna"]:
        assert v not in text, v


def test_node_toml_round_trip(kit: Path) -> None:
    from edge.kit import read_node_toml
    from edge.launch import NodeSettings
    from edge.site import load_options
    from feta_release.data import LoadOptions

    s = NodeSettings(**read_node_toml(kit / "kit" / "node.toml"))
    assert s.superlink == "coord.example:9092" and s.port == 9101 and s.root_certificates is None
    assert s.load == LoadOptions("crop", 8, "auto", patient_cap=2) and s.site_key == (
        kit / "kit" / "keys" / "site-signing.key"
    )
    assert load_options(s.node_config()) == s.load
    bad = kit / "bad.toml"
    bad.write_text('[node]\ndata = "x"\nsuperlnk = "typo"\n')
    with pytest.raises(ConfigError, match="node.superlnk"):
        read_node_toml(bad)


def test_node_start_config_reaches_preflight(kit: Path) -> None:
    code, out = _invoke(["node", "start", "--config", str(kit / "kit" / "node.toml")])
    assert code != 0 and "--root-certificates" in out and "Traceback" not in out
    # An option on the command line overrides node.toml; the policy is not signed yet: refused, naming it.
    ca = kit / "ca.crt"
    ca.write_text("placeholder")
    code, out = _invoke(
        ["node", "start", "--config", str(kit / "kit" / "node.toml"), "--root-certificates", str(ca)]
    )
    assert code != 0 and "policy.signed.json" in out and "Traceback" not in out


def test_draft_refused_until_coordinator_then_signed_with_warnings(kit: Path) -> None:
    k = kit / "kit"
    code, out = _invoke(["policy", "sign", str(k / "policy.toml"), "--key", str(k / "keys/policy-admin.key")])
    assert code != 0 and "coordinators: empty" in out and not (k / "policy.signed.json").exists()
    pem = (kit / "coord" / "coordinator.pub").read_text()
    draft = (k / "policy.toml").read_text().replace("coordinators = []", f'coordinators = ["""{pem}"""]')
    (k / "policy.toml").write_text(draft)
    code, out = _invoke(
        [
            "policy",
            "sign",
            str(k / "policy.toml"),
            "--key",
            str(k / "keys/policy-admin.key"),
            "--out",
            str(k / "policy.signed.json"),
        ]
    )
    assert code == 0, out
    assert "app_bundles: empty" in out and (k / "policy.signed.json").exists()


def test_signing_review_examples_and_ceilings() -> None:
    import tomllib

    from edge.kit import review_or_refuse, signing_review
    from feta_release.policy import make_policy

    root = Path(__file__).resolve().parents[2] / "policies"
    for name in ("strict-hospital.toml", "research.toml"):
        doc = tomllib.loads((root / name).read_text())
        r = signing_review(
            json.loads(json.dumps(doc, default=lambda t: t.isoformat().replace("+00:00", "Z")))
        )
        assert any("EXAMPLE coordinator key" in e for e in r.errors), name
    k = keys()
    doc = make_policy(
        "s",
        "ab" * 32,
        1000,
        [k["coord"].public_key()],
        lifetime=(1e8, 1e-2),
        per_job=(1e8, 1e-2),
        not_before="2020-01-01T00:00:00Z",
        valid_days=30,
    )
    from edge.kit import RISKS
    from feta_release.errors import PolicyError

    with pytest.raises(PolicyError) as exc:
        review_or_refuse(doc, "p", now=NOW)
    for risk in ("expired", "job-epsilon", "lifetime-epsilon", "delta"):
        assert f"--accept-risk {risk}" in str(exc.value), risk
    w = " | ".join(review_or_refuse(doc, "p", now=NOW, accept=set(RISKS)))
    for needle in (
        "expires:",
        "budget.per_job.epsilon = 1e+08",
        "budget.lifetime.epsilon",
        "not below 1/N",
        "app_bundles: empty",
    ):
        assert needle in w, needle
    ok = policy_doc(k)
    assert review_or_refuse(ok, "p", now=NOW) == []


# -- policy check: the node's path ------------------------------------------------------------------
def _files(tmp_path: Path, k, pol: dict, cfg_over: dict) -> tuple[Path, Path, Path]:  # noqa: ANN001
    from cryptography.hazmat.primitives import serialization

    from feta_release.config import load_preset
    from feta_release.policy import sign_job

    cfg = load_preset("tiny").replace(**cfg_over)
    (tmp_path / "p.json").write_text(json.dumps(pol))
    (tmp_path / "j.json").write_text(json.dumps(sign_job(cfg, k["coord"], "job-1", ["site-a"])))
    pub = tmp_path / "site.pub"
    pub.write_bytes(
        k["site"]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return tmp_path / "p.json", tmp_path / "j.json", pub


def test_policy_check_lists_every_failing_rule(tmp_path: Path) -> None:
    k = keys()
    pol, job, pub = _files(
        tmp_path,
        k,
        signed_policy(k),
        {"central": {"sigma": 1.0, "rounds": 9}, "frequency": {"sigma": 2.0, "features": 5000}},
    )
    code, out = _invoke(["policy", "check", str(pol), str(job), "--trusted", str(pub)])
    assert code != 0 and "REFUSED" in out
    for rule in ("mechanisms.central.min_sigma", "mechanisms.frequency.min_sigma"):
        assert rule in out, out
    code, out2 = _invoke(["job", "verify", str(job), "--policy", str(pol), "--trusted", str(pub)])
    assert code != 0 and "mechanisms.central.min_sigma" in out2 and "accepted" not in out2


def test_policy_check_agrees_with_node_handler(tmp_path: Path) -> None:
    """The handler's request is built by the same function and checked by the same check_request."""
    from edge.admission import admit, request_for
    from feta_release.policy import open_signed_policy, verify_job
    from feta_release.policy.enforce import check_request
    from feta_release.policy.errors import PolicyViolation

    k = keys()
    pol_doc = signed_policy(k)
    pol = open_signed_policy(pol_doc, [k["site"].public_key()])
    pol_path, job_path, _ = _files(tmp_path, k, pol_doc, {"central": {"sigma": 1.0}})
    signed_job = json.loads(job_path.read_text())
    res = admit(pol, signed_job, now=NOW)
    job = verify_job(signed_job, pol)
    _, req = request_for("central", job, pol, pol.dataset_size)
    with pytest.raises(PolicyViolation) as exc:
        check_request(pol, req, now=NOW)
    assert (exc.value.rule, str(exc.value)) in res.failures


def test_shipped_presets_fit_the_site_init_draft(tmp_path: Path) -> None:
    """A site that signs the `site init` draft (with its coordinator key) can serve the shipped presets."""
    import tomllib

    from edge.admission import admit
    from edge.kit import _policy_draft
    from feta_release.config import load_preset
    from feta_release.policy import open_signed_policy, sign_job, sign_policy
    from feta_release.policy.document import _normalize, validate_policy
    from feta_release.signing import public_key_pem

    k = keys()
    doc = _normalize(
        tomllib.loads(
            _policy_draft(
                "site-a",
                "ab" * 32,
                4000,
                public_key_pem(k["coord"].public_key()),
                public_key_pem(k["site"].public_key()),
            )
        )
    )
    doc["app_bundles"] = ["cd" * 32]
    validate_policy(doc)
    pol = open_signed_policy(sign_policy(doc, k["site"]), [k["site"].public_key()])
    for preset in ("cpu-eps1", "tiny", "xray64-eps10"):
        cfg = load_preset(preset).for_size(4000)  # rates -> batches for the public size
        res = admit(pol, sign_job(cfg, k["coord"], "j", ["site-a"]))
        assert res.accepted, (preset, res.failures)
