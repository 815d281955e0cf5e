"""A synthetic folder anyone can check: signed certificate, relative paths, PNG provenance,
verify-synthetic."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from PIL import Image

pytest.importorskip("torch")

from feta_release.cli import cli  # noqa: E402
from feta_release.errors import ConfigError  # noqa: E402
from feta_release.release.certificate import png_info, verify_synthetic  # noqa: E402
from feta_release.release.onnx_export import export_denoiser  # noqa: E402
from feta_release.release.synthesize import synthesize  # noqa: E402
from feta_release.release.verify import describe_site  # noqa: E402
from feta_release.signing import public_key_pem, sign_document  # noqa: E402
from tests.support.release import IMAGE_SHAPE, make_release, new_keys, signed_policy, small_denoiser  # noqa: E402


@pytest.fixture(scope="module")
def keys():
    return new_keys()


@pytest.fixture(scope="module")
def synth_key():
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, keys, synth_key):
    """A release and a synthetic folder made from it, side by side (certificate path is relative)."""
    root = tmp_path_factory.mktemp("cert")
    rel = make_release(
        root / "release", export_denoiser(small_denoiser(), IMAGE_SHAPE), keys, policy=signed_policy(keys)
    )
    synthesize(
        rel,
        root / "synthetic",
        keys.trust(),
        per_class=[2, 1, 2],
        seed=5,
        batch=5,
        progress=False,
        threads=1,
        key=synth_key,
        signer_name="Dr. Example, DPO office",
    )
    return root


@pytest.fixture
def root(pristine, tmp_path):
    dst = tmp_path / "w"
    shutil.copytree(pristine, dst)
    return dst


@pytest.fixture
def trusted(keys, synth_key):
    """Two roles: the release's role-bound roots (site a's administrator key) and the certificate signer's
    key."""
    return keys.trust(), [synth_key.public_key()]


def _failed(res) -> set[str]:
    return {c.name for c in res.failures}


def test_pristine_folder_verifies(root, trusted):
    res = verify_synthetic(root / "synthetic", *trusted)
    assert res.ok, res.reason()
    names = {c.name for c in res.checks}
    assert {
        "certificate signature",
        "images unchanged",
        "no added files",
        "no missing images",
        "release verifies",
        "release is the certified one",
    } <= names
    sig = next(c for c in res.checks if c.name == "certificate signature")
    assert "Dr. Example, DPO office" in sig.detail


def test_certificate_has_no_absolute_path_and_names_signer(root, synth_key):
    text = (root / "synthetic" / "certificate.json").read_text()
    assert str(root) not in text and str(root.resolve()) not in text
    cert = json.loads(text)
    assert cert["certificate"]["release"]["path"] == "../release"
    assert cert["certificate"]["signer"]["name"] == "Dr. Example, DPO office"
    assert cert["signature"]["public_key"] == public_key_pem(synth_key)


def test_png_carries_synthetic_marker_manifest_hash_and_epsilon(root):
    cert = json.loads((root / "synthetic" / "certificate.json").read_text())
    man_sha = cert["certificate"]["release"]["manifest_sha256"]
    eps = cert["certificate"]["privacy"][0]["epsilon"]
    for rel in cert["files"]:
        with Image.open(root / "synthetic" / rel) as im:
            text = dict(im.text)
        assert text["Synthetic"] == "true"
        assert "synthetic" in text["Description"]
        assert text["feta:manifest_sha256"] == man_sha
        assert f"epsilon={eps:.4g}" in text["feta:privacy"]


def test_tampered_image_is_caught(root, trusted):
    p = next((root / "synthetic" / "zero").glob("*.png"))
    im = Image.open(p)
    im.load()
    px = im.getpixel((0, 0))
    im.putpixel((0, 0), (px + 1) % 256)
    im.save(p, pnginfo=png_info(dict(im.text)))  # the pixels changed, the text kept
    res = verify_synthetic(root / "synthetic", *trusted)
    assert not res.ok and _failed(res) == {"images unchanged"}


def test_added_image_is_caught(root, trusted):
    src = next((root / "synthetic" / "zero").glob("*.png"))
    shutil.copy(src, root / "synthetic" / "one" / "real_patient.png")
    res = verify_synthetic(root / "synthetic", *trusted)
    assert _failed(res) == {"no added files"}
    assert "one/real_patient.png" in res.reason()


def test_removed_image_is_caught(root, trusted):
    next((root / "synthetic" / "two").glob("*.png")).unlink()
    res = verify_synthetic(root / "synthetic", *trusted)
    assert _failed(res) == {"no missing images"}


def test_edited_file_list_is_caught(root, trusted):
    """Someone swaps an image AND rewrites its hash in the list: the signed list digest no longer matches."""
    path = root / "synthetic" / "certificate.json"
    doc = json.loads(path.read_text())
    victim = sorted(doc["files"])[0]
    other = sorted(doc["files"])[-1]
    shutil.copy(root / "synthetic" / other, root / "synthetic" / victim)
    doc["files"][victim] = doc["files"][other]
    path.write_text(json.dumps(doc))
    res = verify_synthetic(root / "synthetic", *trusted)
    assert _failed(res) == {"file list"}


def test_certificate_with_a_duplicate_key_is_refused(root, trusted):
    """A second "certificate" object placed before the signed one: a lenient parser keeps the last (signed)
    one and verifies, while another reader may show the first. Refused: the signed document must parse one way
    only."""
    path = root / "synthetic" / "certificate.json"
    doc = json.loads(path.read_text())
    fake = {**doc["certificate"], "statement": "forged"}
    path.write_text('{"certificate": ' + json.dumps(fake) + ", " + json.dumps(doc)[1:])
    res = verify_synthetic(root / "synthetic", *trusted)
    assert _failed(res) == {"certificate"} and "duplicate" in res.reason()


def test_forged_certificate_is_caught(root, keys, synth_key):
    """A forger re-signs an edited certificate with their own key: not trusted, refused; and an edit without
    re-signing breaks the signature."""
    path = root / "synthetic" / "certificate.json"
    doc = json.loads(path.read_text())
    doc["certificate"]["privacy"][0]["epsilon"] = 0.01
    path.write_text(json.dumps(doc))
    trusted = keys.trust(), [synth_key.public_key()]
    res = verify_synthetic(root / "synthetic", *trusted)
    assert "certificate signature" in _failed(res) and "bad signature" in res.reason()

    forger = Ed25519PrivateKey.generate()
    doc["certificate"]["signer"] = {"name": "Dr. Example, DPO office", "fingerprint": "x"}
    doc["signature"] = sign_document(doc["certificate"], forger)
    path.write_text(json.dumps(doc))
    res = verify_synthetic(root / "synthetic", *trusted)
    assert "certificate signature" in _failed(res) and "unknown key" in res.reason()


def test_unsigned_certificate_fails(root, keys, tmp_path):
    synthesize(root / "release", tmp_path / "u", keys.trust(), num=3, progress=False, threads=1)
    res = verify_synthetic(tmp_path / "u", keys.trust(), [], release_dir=root / "release")
    assert "certificate signature" in _failed(res) and "unsigned" in res.reason()


def test_release_changed_or_swapped_is_caught(root, trusted, keys, tmp_path):
    g = root / "release" / "generator.onnx"
    data = bytearray(g.read_bytes())
    data[200] ^= 0xFF
    g.write_bytes(bytes(data))
    res = verify_synthetic(root / "synthetic", *trusted)
    assert {"release verifies", "release is the certified one"} <= _failed(res)
    other = make_release(
        tmp_path / "other",
        export_denoiser(small_denoiser(seed=3), IMAGE_SHAPE),
        keys,
        policy=signed_policy(keys),
    )
    res = verify_synthetic(root / "synthetic", *trusted, release_dir=other)
    assert _failed(res) == {"release is the certified one"}


def test_cli_verify_synthetic(root, keys, synth_key, tmp_path):
    coord_pub, _, admin_pub = keys.pub_files(tmp_path / "k")
    sp = tmp_path / "k" / "synth.pub"
    sp.write_text(public_key_pem(synth_key))
    base = ["verify-synthetic", str(root / "synthetic"), "--json"]
    args = base + ["--certificate-key", str(sp), "--trusted", f"a={admin_pub}", "--coordinator", coord_pub]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["ok"] is True
    # no certificate signer: one clear line
    r = CliRunner().invoke(cli, base + ["--trusted", f"a={admin_pub}"])
    assert isinstance(r.exception, ConfigError) and "--certificate-key" in str(r.exception)
    # a key with no role
    r = CliRunner().invoke(cli, base + ["--certificate-key", str(sp), "--trusted", str(sp)])
    assert isinstance(r.exception, ConfigError) and "SITE_ID=ADMIN_KEY.pub" in str(r.exception)
    next((root / "synthetic" / "zero").glob("*.png")).unlink()
    r = CliRunner().invoke(cli, args)
    assert r.exit_code != 0 and "missing" in str(r.exception)


def test_certificate_signer_and_release_roots_are_separate_roles(root, keys, synth_key):
    """The certificate signer's key vouches for the images only; the release's roots for the release only.
    (Before: one flat pool, so any trusted key, e.g. the coordinator's, could sign a certificate, and the
    certificate signer's key counted as a release root.)"""
    folder = root / "synthetic"
    res = verify_synthetic(folder, keys.trust(), [keys.coordinator.public_key(), keys.policy.public_key()])
    assert _failed(res) == {"certificate signature"} and "unknown key" in res.reason()
    # The certificate signer named as site a's administrator does not make the release verify.
    res = verify_synthetic(folder, {"a": synth_key.public_key()}, [synth_key.public_key()])
    assert {"release verifies"} <= _failed(res) and "certificate signature" not in _failed(res)
    # A flat key list for the release is refused outright, not trusted for every role.
    res = verify_synthetic(folder, keys.public(), [synth_key.public_key()])  # type: ignore[arg-type]
    assert not res.ok and "bound to roles" in res.reason()
    res = verify_synthetic(folder, keys.trust(), [synth_key.public_key()])
    assert res.ok and any(t.startswith("certificate signer ") for t in res.trusted)


def test_describe_site_merges_repeated_rounds():
    """A federated ledger writes one DP-SGD event per round; the words name the stage once with the total."""
    ev = {"stage": "dpsgd", "sigma": 1.2, "q": 0.01, "steps": 25}
    site = {
        "site_id": "a",
        "epsilon": 3.0,
        "delta": 1e-5,
        "accountant": "rdp",
        "events": [{"stage": "central", "sigma": 5.0, "q": 1.0, "steps": 1}, ev, ev, ev, ev],
    }
    text = describe_site(site)
    assert text.count("DP-SGD") == 1 and "100 steps" in text
    assert "2 stage(s)" in text
