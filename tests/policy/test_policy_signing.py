"""Signed policies: every tampered byte, wrong key, validity window, replay, data change are refused."""

from __future__ import annotations

import copy
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release import signing
from feta_release.errors import PolicyError
from feta_release.policy import PolicyViolation, load_site_policy, open_signed_policy, sign_policy
from feta_release.policy.envelope import write_json
from tests.support.policy import FP, NOW, keys, policy_doc, signed_policy, tamper_cases

K = keys()
SIGNED = signed_policy(K)
CASES = tamper_cases(SIGNED)


def test_untampered_policy_verifies() -> None:
    pol = open_signed_policy(copy.deepcopy(SIGNED), [K["site"].public_key()])
    assert pol.site_id == "site-a" and pol.signer == signing.fingerprint(K["site"])
    assert pol.mechanisms["dpsgd"].min_sigma == 1.0 and pol.mechanisms["dpsgd"].caps["max_clip"] == 1.0
    assert pol.job_epsilon == 1.5 and pol.lifetime_epsilon == 3.0


def test_tamper_cases_cover_every_field() -> None:
    described = " ".join(d for d, _ in CASES)
    for field in (
        "version",
        "site_id",
        "dataset.commitment",
        "dataset.size",
        "budget.per_job.epsilon",
        "budget.lifetime.delta",
        "accountant",
        "mechanisms.dpsgd.min_sigma",
        "mechanisms.central.max_rounds",
        "mechanisms.frequency.max_features",
        "mechanisms.dpsgd.max_clip",
        "coordinators.0",
        "app_bundles.0",
        "not_before",
        "expires",
        "signature.signature",
        "signature.public_key",
        "signature.signer",
        "signature.alg",
    ):
        assert f"alter policy.{field} " in described or f"alter {field} " in described, field
    assert len(CASES) > 100


@pytest.mark.parametrize("desc,doc", CASES, ids=[d for d, _ in CASES])
def test_any_tampering_is_refused(desc: str, doc: dict) -> None:
    with pytest.raises(PolicyError):
        open_signed_policy(doc, [K["site"].public_key()])


def test_tampered_file_byte_refused(tmp_path) -> None:
    # Flip one byte of the canonical body inside the file: refused even though the JSON still parses.
    path = write_json(tmp_path / "p.json", SIGNED)
    text = path.read_text()
    assert '"site-a"' in text
    path.write_text(text.replace('"site-a"', '"site-b"'))
    with pytest.raises(PolicyViolation) as exc:
        load_site_policy(path, [K["site"].public_key()], now=NOW)
    assert exc.value.rule == "signature.valid"


def _write(tmp_path, signed, name="p.signed.json"):
    return write_json(tmp_path / name, signed)


def test_wrong_key_is_unknown_signer(tmp_path) -> None:
    path = _write(tmp_path, SIGNED)
    with pytest.raises(PolicyViolation) as exc:
        load_site_policy(path, [K["other"].public_key()], now=NOW)
    assert exc.value.rule == "signature.signer" and "unknown key" in str(exc.value)


def test_signed_by_untrusted_key_with_forged_signer_field(tmp_path) -> None:
    forged = sign_policy(policy_doc(K), K["other"])
    forged["signature"]["signer"] = signing.fingerprint(K["site"])
    with pytest.raises(PolicyViolation) as exc:
        load_site_policy(_write(tmp_path, forged), [K["site"].public_key()], now=NOW)
    assert exc.value.rule == "signature.valid"


def test_unsigned_policy_refused(tmp_path) -> None:
    plain = _write(tmp_path, policy_doc(K), "plain.json")
    with pytest.raises(PolicyViolation) as exc:
        load_site_policy(plain, [K["site"].public_key()], now=NOW)
    assert exc.value.rule == "signature.required"
    toml = tmp_path / "p.toml"
    toml.write_text("version = 1\n")
    with pytest.raises(PolicyViolation) as exc:
        load_site_policy(toml, [K["site"].public_key()], now=NOW)
    assert exc.value.rule == "signature.required"


@pytest.mark.parametrize(
    "now,rule",
    [
        ("2025-12-31T23:59:59Z", "not_before"),
        ("2027-01-01T00:00:00Z", "expires"),
        ("2027-06-01T00:00:00Z", "expires"),
    ],
)
def test_validity_window(tmp_path, now: str, rule: str) -> None:
    path = _write(tmp_path, signed_policy(K, valid_days=365))
    with pytest.raises(PolicyViolation) as exc:
        load_site_policy(path, [K["site"].public_key()], now=now)
    assert exc.value.rule == rule
    assert load_site_policy(path, [K["site"].public_key()], now="2026-01-01T00:00:00Z").version == 1


def test_replayed_old_version_refused(tmp_path) -> None:
    v1 = _write(tmp_path, signed_policy(K, version=1), "v1.json")
    v2 = _write(tmp_path, signed_policy(K, version=2), "v2.json")
    trusted = [K["site"].public_key()]
    assert load_site_policy(v2, trusted, now=NOW, last_seen_version=1).version == 2
    assert load_site_policy(v2, trusted, now=NOW, last_seen_version=2).version == 2
    with pytest.raises(PolicyViolation) as exc:
        load_site_policy(v1, trusted, now=NOW, last_seen_version=2)
    assert exc.value.rule == "version" and "replayed" in str(exc.value)


def test_same_version_with_other_content_refused(tmp_path) -> None:
    trusted = [K["site"].public_key()]
    first = load_site_policy(_write(tmp_path, signed_policy(K, version=3), "a.json"), trusted, now=NOW)
    again = load_site_policy(
        _write(tmp_path, signed_policy(K, version=3), "b.json"),
        trusted,
        now=NOW,
        last_seen_version=3,
        last_seen_digest=first.digest,
    )
    assert again.digest == first.digest
    looser = _write(tmp_path, signed_policy(K, version=3, per_job=(3.0, 1e-5)), "c.json")
    with pytest.raises(PolicyViolation) as exc:
        load_site_policy(looser, trusted, now=NOW, last_seen_version=3, last_seen_digest=first.digest)
    assert exc.value.rule == "version"


def test_dataset_commitment_mismatch(tmp_path) -> None:
    path = _write(tmp_path, SIGNED)
    trusted = [K["site"].public_key()]
    assert load_site_policy(path, trusted, now=NOW, dataset_commitment=FP).dataset_commitment == FP
    with pytest.raises(PolicyViolation) as exc:
        load_site_policy(path, trusted, now=NOW, dataset_commitment="cd" * 32)
    assert exc.value.rule == "dataset.commitment" and "data" in str(exc.value)


def test_trusted_keys_accept_paths_and_pem(tmp_path) -> None:
    priv, pub = signing.generate_keypair(tmp_path / "k", "site")
    key = signing.load_private_key(priv)
    path = _write(tmp_path, sign_policy(policy_doc(K), key))
    for trusted in ([pub], [str(pub)], [pub.read_text()], [pub.read_bytes()], pub):
        assert load_site_policy(path, trusted, now=NOW).signer == signing.fingerprint(key)


def test_signed_file_is_not_json(tmp_path) -> None:
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(PolicyError, match="not JSON"):
        load_site_policy(p, [K["site"].public_key()], now=NOW)


# -- canonical JSON properties ---------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_docs = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


def _reorder(obj, rnd):
    if isinstance(obj, dict):
        items = list(obj.items())
        rnd.shuffle(items)
        return {k: _reorder(v, rnd) for k, v in items}
    if isinstance(obj, list):
        return [_reorder(v, rnd) for v in obj]
    return obj


@settings(max_examples=150, deadline=None)
@given(doc=json_docs, rnd=st.randoms(use_true_random=False))
def test_canonical_json_stable_under_key_reordering(doc, rnd) -> None:
    a = signing.canonical_json(doc)
    b = signing.canonical_json(_reorder(doc, rnd))
    assert a == b
    # a fixed point: parse + re-canonicalize
    assert signing.canonical_json(json.loads(a.decode("utf-8"))) == a


SIGNER = Ed25519PrivateKey.generate()


@settings(max_examples=150, deadline=None)
@given(doc=st.dictionaries(st.text(max_size=6), json_docs, min_size=1, max_size=4), data=st.data())
def test_any_single_byte_change_breaks_verification(doc, data) -> None:
    sig = signing.sign_document(doc, SIGNER)
    raw = bytearray(signing.canonical_json(doc))
    i = data.draw(st.integers(0, len(raw) - 1), label="index")
    b = data.draw(st.integers(0, 255).filter(lambda v: v != raw[i]), label="byte")
    raw[i] = b
    try:
        changed = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return  # no longer a document at all: nothing to verify
    with pytest.raises((PolicyError, ValueError)):
        signing.verify_document(changed, sig, [SIGNER.public_key()])


def _sign_cli(tmp_path, over: dict, *accept: str):  # noqa: ANN001, ANN202
    """``policy sign`` on a policy with ``over`` merged into its budget, as a user runs it."""
    from click.testing import CliRunner
    from cryptography.hazmat.primitives import serialization

    from feta_release.cli import cli
    from feta_release.policy import make_policy

    doc = make_policy("s", "ab" * 32, 1000, [K["coord"].public_key()], app_bundles=["cd" * 32], **over)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    (tmp_path / "admin.key").write_bytes(
        K["site"].private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (tmp_path / "admin.key").chmod(0o600)
    args = [
        "policy",
        "sign",
        str(tmp_path / "p.json"),
        "--key",
        str(tmp_path / "admin.key"),
        "--out",
        str(tmp_path / "s.json"),
    ]
    return CliRunner().invoke(cli, args + [a for r in accept for a in ("--accept-risk", r)])


@pytest.mark.parametrize(
    ("over", "risk"),
    [
        ({"per_job": (1e9, 1e-6), "lifetime": (1e9, 1e-6)}, "job-epsilon"),
        ({"per_job": (1.0, 1e-2), "lifetime": (4.0, 1e-2)}, "delta"),
        (
            {
                "per_job": (1.0, 1e-6),
                "lifetime": (4.0, 1e-6),
                "not_before": "2020-01-01T00:00:00Z",
                "valid_days": 30,
            },
            "expired",
        ),
    ],
)
def test_sign_refuses_a_nonsense_budget_unless_the_risk_is_accepted(tmp_path, over, risk) -> None:  # noqa: ANN001
    res = _sign_cli(tmp_path, over)
    assert (
        res.exit_code != 0
        and f"--accept-risk {risk}" in str(res.exception)
        and not (tmp_path / "s.json").exists()
    )
    res = _sign_cli(tmp_path, over, risk, "lifetime-epsilon")
    assert res.exit_code == 0, res.output
    assert f"accepted: --accept-risk {risk}" in res.output and (tmp_path / "s.json").exists()


def test_accept_risk_choices_are_the_review_risks() -> None:
    from edge.kit import RISKS
    from feta_release.cli.policy_cmd import policy_sign

    opt = next(p for p in policy_sign.params if p.name == "accept_risk")
    assert tuple(opt.type.choices) == RISKS  # type: ignore[attr-defined]
