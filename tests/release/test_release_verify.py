"""Release manifest, attestations and offline verification: every tampering and trust failure is caught."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

pytest.importorskip("torch")

from feta_release.accounting import PrivacyEvent, epsilon  # noqa: E402
from feta_release.release.manifest import build_attestation, site_record  # noqa: E402
from feta_release.release.verify import describe_site, verify_release  # noqa: E402
from feta_release.signing import sign_document  # noqa: E402
from tests.support.release import (  # noqa: E402
    EVENTS,
    IMAGE_SHAPE,
    load_signed,
    make_release,
    new_keys,
    rehash,
    resign,
    signed_policy,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


def _failed(res) -> set[str]:
    return {c.name for c in res.failures}


def test_valid_release_verifies(release, keys):
    res = verify_release(release, keys.trust())
    assert res.ok, res.reason()
    names = {c.name for c in res.checks if c.status == "pass"}
    assert {
        "manifest signature",
        "generator hash",
        "generator metadata",
        "site a attestation",
        "site a epsilon",
        "site a policy",
    } <= names
    man = res.manifest
    site = man["sites"][0]
    assert site["epsilon"] == pytest.approx(epsilon(EVENTS, 1e-5, "rdp"), rel=1e-12)
    assert site["events"] == [e.to_dict() for e in EVENTS]
    assert site["policy_sha256"] and len(site["policy_sha256"]) == 64
    assert set(man["software"]) == {"feta_release", "torch", "onnx", "onnxruntime", "flwr", "opacus"}
    assert man["generator"]["sampler"]["solver"] == "heun"
    assert (release / "policies" / "a.signed.json").is_file()
    text = describe_site(site)
    assert (
        "Site a: ε = " in text and "δ = 1e-05" in text and "3 stage(s)" in text and "central images" in text
    )


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,))
    else:
        yield path


def _tampered(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1 if value == 0 else value * 1.5
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return "x"
    return ["x"]


def test_tampering_any_manifest_field_fails(release, keys):
    """Change each leaf of the signed manifest in turn (signature kept): verification must fail every time."""
    signed = load_signed(release)
    paths = list(_leaves(signed["manifest"]))
    assert len(paths) > 50
    trusted = keys.trust()
    for path in paths:
        doc = copy.deepcopy(signed)
        node = doc["manifest"]
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = _tampered(node[path[-1]])
        (release / "manifest.json").write_text(json.dumps(doc))
        res = verify_release(release, trusted)
        assert not res.ok, f"tampering manifest{list(path)} went unnoticed"
        assert "manifest signature" in _failed(res), path


def test_generator_byte_flip_refused(release, keys):
    gen = release / "generator.onnx"
    data = bytearray(gen.read_bytes())
    data[len(data) // 2] ^= 0x01
    gen.write_bytes(bytes(data))
    res = verify_release(release, keys.trust())
    assert not res.ok and "generator hash" in _failed(res)
    assert res.generator_bytes is None  # nothing unverified is handed to synthesis


def test_missing_generator_or_manifest_refused(release, keys):
    (release / "generator.onnx").unlink()
    res = verify_release(release, keys.trust())
    assert not res.ok and "generator file" in _failed(res)
    (release / "manifest.json").unlink()
    res = verify_release(release, keys.trust())
    assert not res.ok and "manifest" in _failed(res)


def test_unknown_signers_refused(release, keys):
    # The administrator key given for site a is not the one that signed its policy.
    res = verify_release(release, {"a": keys.coordinator.public_key()})
    assert not res.ok and "site a policy" in _failed(res) and "unknown key" in res.reason()
    # A manifest re-signed by someone else entirely.
    mallory = new_keys()
    resign(release, load_signed(release), mallory.coordinator)
    res = verify_release(release, keys.trust())
    assert not res.ok and "manifest signature" in _failed(res)


def test_no_trusted_keys_refused(release, keys):
    res = verify_release(release, {})
    assert not res.ok and "trusted keys" in _failed(res)
    # A flat pool of keys, trusted for every role, is refused outright.
    res = verify_release(release, keys.public())
    assert not res.ok and "bound to roles" in res.reason()


def test_coordinator_cannot_change_site_figures(release, keys):
    """A trusted coordinator re-signing a manifest with a smaller epsilon is caught by the site's
    signature."""
    signed = load_signed(release)
    signed["manifest"]["sites"][0]["epsilon"] = 0.1
    resign(release, signed, keys.coordinator)
    res = verify_release(release, keys.trust())
    assert "site a attestation" in _failed(res)
    assert "differ from the signed statement in: epsilon" in res.reason()


def test_stated_epsilon_must_match_history(release, keys):
    """Even a site-signed statement is checked: its epsilon must be what its events compose to."""
    signed = load_signed(release)
    site = signed["manifest"]["sites"][0]
    st = copy.deepcopy(site["attestation"]["statement"])
    st["epsilon"] = st["epsilon"] * 0.9
    att = {"statement": st, "signature": sign_document(st, keys.site)}
    signed["manifest"]["sites"][0] = site_record(att)
    # The generator binds the privacy statement: a changed statement also breaks the generator metadata.
    resign(release, signed, keys.coordinator)
    res = verify_release(release, keys.trust())
    assert {"site a epsilon", "generator metadata"} <= _failed(res)


def test_generator_from_another_job_refused(tmp_path, den_onnx, keys, release):
    other = make_release(tmp_path / "other", den_onnx, keys, job_id="job-2")
    shutil.copy(other / "generator.onnx", release / "generator.onnx")
    signed = load_signed(release)
    rehash(signed["manifest"]["generator"], release / "generator.onnx")
    resign(release, signed, keys.coordinator)
    res = verify_release(release, keys.trust())
    assert _failed(res) == {"generator metadata"}
    assert "feta.statement_sha256" in res.reason()


def test_assemble_refuses_over_policy(tmp_path, den_onnx, keys):
    from feta_release.config import JobConfig
    from feta_release.errors import ReleaseError
    from feta_release.release.export_run import assemble_release
    from feta_release.release.onnx_export import SamplerSettings

    att = build_attestation("a", "job-1", EVENTS, 1e-5, "rdp", None, keys.site)
    with pytest.raises(ReleaseError, match="outside its signed policy"):
        assemble_release(
            tmp_path / "r",
            denoiser=den_onnx,
            classes=["a", "b", "c"],
            image_shape=IMAGE_SHAPE,
            sampler=SamplerSettings(steps=2),
            job_id="job-1",
            config=JobConfig().to_dict(),
            sites=[site_record(att)],
            coordinator_key=keys.coordinator,
            signed_policies={"a": signed_policy(keys, per_job_eps=0.5)},
        )
    assert not (tmp_path / "r").exists()


def test_over_policy_release_refused(tmp_path, den_onnx, keys):
    # epsilon over the per-job cap
    rel = make_release(tmp_path / "r1", den_onnx, keys, policy=signed_policy(keys, per_job_eps=0.5))
    res = verify_release(rel, keys.trust())
    assert _failed(res) == {"site a policy"} and "exceeds the per-job cap 0.5" in res.reason()
    # DP-SGD sigma below the policy minimum
    rel = make_release(tmp_path / "r2", den_onnx, keys, policy=signed_policy(keys, dpsgd_min_sigma=2.0))
    res = verify_release(rel, keys.trust())
    assert _failed(res) == {"site a policy"} and "below the policy minimum 2.0" in res.reason()
    # a stage the policy does not allow
    events = EVENTS + [PrivacyEvent("mystery", 10.0, 0.01, 1)]
    rel = make_release(tmp_path / "r3", den_onnx, keys, policy=signed_policy(keys), events=events)
    res = verify_release(rel, keys.trust())
    assert "not allowed by the policy" in res.reason()


def test_policy_swapped_or_untrusted_refused(release, keys, tmp_path):
    # Another (validly signed) policy put in place of the one the site attested.
    other = signed_policy(keys, per_job_eps=9.0)
    (release / "policies" / "a.signed.json").write_text(json.dumps(other))
    res = verify_release(release, keys.trust())
    assert _failed(res) == {"site a policy"} and "the site attested" in res.reason()
    # The site's own (attestation) key given as its administrator key.
    res = verify_release(release, {"a": keys.site.public_key()})
    assert "site a policy" in _failed(res)


def test_release_without_policy_refused(tmp_path, den_onnx, keys):
    """Without the site's signed policy neither its key nor its caps can be checked: refused, not a
    warning."""
    rel = make_release(tmp_path / "r", den_onnx, keys, policy=None)
    res = verify_release(rel, keys.trust())
    assert not res.ok and "site a policy" in _failed(res) and "not in the release" in res.reason()


def test_attestation_builder_computes_epsilon(keys):
    att = build_attestation("b", "job-9", EVENTS[:2], 1e-5, "rdp", None, keys.site)
    assert att["statement"]["epsilon"] == pytest.approx(epsilon(EVENTS[:2], 1e-5))
    assert att["statement"]["site_id"] == "b" and att["statement"]["job_id"] == "job-9"
    assert att["signature"]["signer"]


def test_cli_verify(release, keys, tmp_path):
    from click.testing import CliRunner

    from feta_release.cli import cli

    pubs = keys.pub_files(tmp_path / "keys")
    ok = CliRunner().invoke(cli, ["verify", str(release), *keys.trusted_args(tmp_path / "keys"), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["ok"] is True
    # A key without a role is refused before anything is read.
    bad = CliRunner().invoke(cli, ["verify", str(release), "--trusted", pubs[2]])
    assert bad.exit_code != 0 and "say whose key it is" in str(bad.exception)
    # The coordinator's key given as site a's administrator key.
    bad = CliRunner().invoke(cli, ["verify", str(release), "--trusted", f"a={pubs[0]}"])
    assert bad.exit_code != 0 and "unknown key" in str(bad.exception)
    # Pinning a coordinator that is not the manifest's signer.
    bad = CliRunner().invoke(
        cli, ["verify", str(release), "--trusted", f"a={pubs[2]}", "--coordinator", pubs[1]]
    )
    assert bad.exit_code != 0 and "manifest signature" in str(bad.exception)
