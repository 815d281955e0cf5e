"""`verify-synthetic` reads every PNG's text chunks back and refuses an image whose text is not the
certificate's ``png_metadata``: a signer who rewrites an image's ``feta:privacy`` (here "epsilon=0.01" where
one patient can lose 3.43), re-hashes it and re-signs the certificate passed, since only the file hashes
and the certificate's own ``png_metadata`` field were compared."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

pytest.importorskip("torch")

from feta_release.accounting import PrivacyEvent  # noqa: E402
from feta_release.release.certificate import files_digest, png_info, verify_synthetic  # noqa: E402
from feta_release.signing import sign_document  # noqa: E402
from tests.support.release import patient_folders  # noqa: E402

EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]
FORGED = "site a: epsilon=0.01, delta=1e-05 (RDP, unit = one patient)"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Ed25519PrivateKey]:
    root = tmp_path_factory.mktemp("text")
    keys, signer = patient_folders(root, EVENTS, EVENTS, {"signed": ([1, 1, 0], True)})
    return root, keys, signer


def _rewrite_text(folder: Path, signer: Ed25519PrivateKey, key: str, value: str) -> str:
    """One image's text chunk ``key`` set to ``value``, the image re-hashed, the certificate re-signed."""
    from PIL import Image

    path = folder / "certificate.json"
    doc = json.loads(path.read_text("utf-8"))
    rel = sorted(r for r in doc["files"] if r.endswith(".png"))[0]
    with Image.open(folder / rel) as im:
        im.load()
        im.save(folder / rel, pnginfo=png_info({**dict(im.text), key: value}))
    doc["files"][rel] = hashlib.sha256((folder / rel).read_bytes()).hexdigest()
    doc["certificate"]["files"]["sha256"] = files_digest(doc["files"].items())
    doc["signature"] = sign_document(doc["certificate"], signer)
    path.write_text(json.dumps(doc), "utf-8")
    return rel


def test_the_certified_images_text_passes(made: Any) -> None:
    res = verify_synthetic(made[0] / "signed", made[1].trust(), [made[2].public_key()])
    assert res.ok, res.reason()
    assert any(c.name == "image text" and c.status == "pass" for c in res.checks)


@pytest.mark.parametrize(("key", "value"), [("feta:privacy", FORGED), ("feta:note", "reviewed")])
def test_an_image_whose_text_was_rewritten_and_resigned_is_refused(
    made: Any, tmp_path: Path, key: str, value: str
) -> None:
    shutil.copytree(made[0], tmp_path / "w")
    rel = _rewrite_text(tmp_path / "w" / "signed", made[2], key, value)
    res = verify_synthetic(tmp_path / "w" / "signed", made[1].trust(), [made[2].public_key()])
    failed = {c.name: c.detail for c in res.failures}
    assert set(failed) == {"image text"} and rel in failed["image text"], res.reason()
