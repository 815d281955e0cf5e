"""Attacks on a release that verify / synthesize / verify-synthetic let through before.

A generator whose tensors name EXTERNAL data files: onnxruntime, given the model's bytes, reads them from the
current directory of whoever runs synthesize (a site key, patient files under it) and the "synthetic" images
carry them out, under a certificate that says differentially private. A coordinator the sites allow can sign
such a file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402

from feta_release.errors import ReleaseError  # noqa: E402
from feta_release.release.synthesize import make_session  # noqa: E402
from feta_release.release.verify import verify_release  # noqa: E402
from tests.support.release import load_signed, rehash, resign  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py

SECRET = np.arange(16, dtype=np.float32)


def _external(name: str, location: str, n: int = 16) -> TensorProto:
    """A float tensor of ``n`` values whose bytes onnxruntime reads from the file ``location``."""
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[n], data_location=TensorProto.EXTERNAL)
    for k, v in (("location", location), ("offset", "0"), ("length", str(4 * n))):
        t.external_data.add(key=k, value=v)
    return t


def _reader_model() -> bytes:
    """y = x + W, W read from ``secret.bin`` beside wherever the model is run."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])], "g", [x], [y], [_external("W", "secret.bin")]
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_session_never_reads_files_from_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "secret.bin").write_bytes(SECRET.tobytes())
    monkeypatch.chdir(tmp_path)
    try:
        sess = make_session(_reader_model(), threads=1)
    except Exception as exc:  # refused at load: what the fix must do  # noqa: BLE001
        assert "external" in str(exc).lower() or "does not exist" in str(exc).lower()
        return
    out = sess.run(None, {"x": np.zeros(16, np.float32)})[0]
    pytest.fail(f"the generator read secret.bin from the current directory: {out[:4]}...")


def test_verify_refuses_a_generator_with_external_data(release, keys):
    gen = release / "generator.onnx"
    model = onnx.load_model_from_string(gen.read_bytes())
    model.graph.initializer.append(_external("leak", "keys/site.key", 8))
    data = model.SerializeToString()
    gen.write_bytes(data)
    signed = load_signed(release)
    rehash(signed["manifest"]["generator"], release / "generator.onnx")
    resign(release, signed, keys.coordinator)  # the coordinator every site's policy allows signs it
    res = verify_release(release, keys.trust())
    assert not res.ok
    assert "external" in res.reason(), json.dumps(res.to_dict(), indent=1)[:2000]


def test_a_subgraph_with_external_data_is_refused_too():
    from feta_release.release.verify import refuse_external_data

    body = helper.make_graph(
        [helper.make_node("Identity", ["W"], ["o"])],
        "body",
        [],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [16])],
        [_external("W", "a.bin")],
    )
    node = helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body)
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])],
    )
    with pytest.raises(ReleaseError, match="external"):
        refuse_external_data(helper.make_model(g), "generator.onnx")


# -- the certificate's privacy figures -----------------------------------------------------------------------
# Attack: whoever ran synthesize (a trusted certificate signer, or anyone holding that key) signs a
# certificate whose privacy section (and PNG text) says ε = 0.01 for a release whose sites attested far more.
# verify-synthetic checked the signature, the images and the release, but not that the certificate's figures
# are the release's: it said OK.


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, pristine, keys):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from feta_release.release.synthesize import synthesize

    signer = Ed25519PrivateKey.generate()
    out = tmp_path_factory.mktemp("m3") / "synthetic"
    synthesize(
        pristine,
        out,
        keys.trust(),
        per_class=[1, 1, 1],
        seed=1,
        batch=3,
        progress=False,
        threads=1,
        key=signer,
        signer_name="DPO",
    )
    return out, signer


@pytest.mark.parametrize("edit", ["epsilon", "lifetime", "statement", "png_metadata"])
def test_certified_privacy_must_be_the_releases(synthetic, pristine, keys, tmp_path, edit):
    import shutil

    from feta_release.release.certificate import CERTIFICATE_FILE, verify_synthetic
    from feta_release.signing import sign_document

    folder, signer = synthetic
    work = tmp_path / "synthetic"
    shutil.copytree(folder, work)
    path = work / CERTIFICATE_FILE
    doc = json.loads(path.read_text())
    cert = doc["certificate"]
    if edit == "epsilon":
        cert["privacy"][0]["epsilon"] = 0.01
    elif edit == "lifetime":
        cert["privacy"][0]["lifetime"]["epsilon"] = 0.01
    elif edit == "statement":
        cert["privacy"][0]["statement"] = "Site a: ε = 0.01 at δ = 1e-05."
    else:
        cert["png_metadata"]["feta:privacy"] = "site a: epsilon=0.01, delta=1e-05"
    doc["signature"] = sign_document(cert, signer)  # the trusted certificate signer signs the edit
    path.write_text(json.dumps(doc))
    res = verify_synthetic(work, keys.trust(), [signer.public_key()], release_dir=pristine)
    assert not res.ok and "certified privacy" in {c.name for c in res.failures}, res.reason()


def test_an_honest_certificate_still_verifies(synthetic, pristine, keys):
    from feta_release.release.certificate import verify_synthetic

    folder, signer = synthetic
    res = verify_synthetic(folder, keys.trust(), [signer.public_key()], release_dir=pristine)
    assert res.ok, res.reason()


def test_a_function_constant_with_external_data_is_refused():
    from onnx import FunctionProto

    from feta_release.release.verify import refuse_external_data

    const = helper.make_node("Constant", [], ["o"], value=_external("W", "a.bin"))
    fn = FunctionProto(
        name="leak",
        domain="local",
        input=[],
        output=["o"],
        node=[const],
        opset_import=[helper.make_opsetid("", 17)],
    )
    g = helper.make_graph(
        [helper.make_node("leak", [], ["y"], domain="local")],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])],
    )
    model = helper.make_model(
        g, functions=[fn], opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    )
    with pytest.raises(ReleaseError, match="external"):
        refuse_external_data(model, "generator.onnx")


def test_a_light_install_without_onnx_refuses_it_too(release, keys, tmp_path, monkeypatch):
    """Where only onnxruntime is installed, verify reads the metadata through a session: that session is
    sealed, so a generator whose external file sits in the current directory does not load (before: it loaded
    and verified)."""
    import sys

    gen = release / "generator.onnx"
    model = onnx.load_model_from_string(gen.read_bytes())
    w = next(t for t in model.graph.initializer if len(t.raw_data) >= 64)  # a weight the graph uses
    (tmp_path / "w.bin").write_bytes(w.raw_data)  # its bytes, in the directory synthesize runs from
    w.external_data.extend(
        [
            onnx.StringStringEntryProto(key="location", value="w.bin"),
            onnx.StringStringEntryProto(key="length", value=str(len(w.raw_data))),
        ]
    )
    w.data_location, w.raw_data = TensorProto.EXTERNAL, b""
    data = model.SerializeToString()
    gen.write_bytes(data)
    signed = load_signed(release)
    rehash(signed["manifest"]["generator"], release / "generator.onnx")
    resign(release, signed, keys.coordinator)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError: the light install
    res = verify_release(release, keys.trust())
    assert not res.ok and "not a loadable ONNX model" in res.reason(), res.reason()
