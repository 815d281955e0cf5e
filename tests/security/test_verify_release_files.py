"""What ``verify``, ``synthesize`` and ``report`` read of a release directory that someone else supplied.

A release is unpacked from a coordinator's archive or a share. Its manifest's signature is checked FIRST
(after the site policies that name the allowed coordinator keys, read capped); only then are the files it
names read, each a regular file reached through no symbolic link, of the size its signed record states and
under a hard cap; an ``.npz`` is never inflated past the images its signed record releases. Every refusal is
one line.
"""

from __future__ import annotations

import io
import json
import resource
import shutil
import tracemalloc
import zipfile

import numpy as np
import pytest

pytest.importorskip("torch")

from feta_release.errors import ReleaseError  # noqa: E402
from feta_release.release.verify import verify_release  # noqa: E402
from tests.support.release import (  # noqa: E402
    CLASSES,
    IMAGE_SHAPE,
    cli_process,
    load_signed,
    make_release,
    rehash,
    resign,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


def _central() -> tuple[np.ndarray, np.ndarray]:
    """One released central image per class (the tiny preset: 1 round x 1 cell)."""
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, (len(CLASSES), *IMAGE_SHAPE)).astype(np.float32)
    return images, np.arange(len(CLASSES), dtype=np.int64)


@pytest.fixture(scope="module")
def sd_pristine(tmp_path_factory, den_onnx, keys):
    return make_release(
        tmp_path_factory.mktemp("sd") / "rel", den_onnx, keys, start_sigma=0.5, starts=_central()
    )


@pytest.fixture
def sd_release(sd_pristine, tmp_path):
    dst = tmp_path / "rel"
    shutil.copytree(sd_pristine, dst)
    return dst


def _bomb(n_images: int) -> bytes:
    """A central-images file whose deflated zeros inflate to n_images x 256 bytes (about 1000x)."""
    buf = io.BytesIO()
    np.savez_compressed(
        buf, images=np.zeros((n_images, *IMAGE_SHAPE), np.float32), labels=np.zeros(n_images, np.int64)
    )
    return buf.getvalue()


def _peak_bytes(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_unsigned_manifest_naming_a_decompression_bomb_is_refused_before_the_bomb_is_read(
    sd_release, keys
):
    """Anyone (no key) swaps in a deflate bomb and writes its hash into the manifest: the signature fails
    first, and the bomb is never inflated (it took verify to 1.57 GB)."""
    bomb = _bomb(400_000)  # ~0.1 GB of arrays in ~0.1 MB
    (sd_release / "central_images.npz").write_bytes(bomb)
    signed = load_signed(sd_release)
    rehash(signed["manifest"]["starts"], sd_release / "central_images.npz")
    (sd_release / "manifest.json").write_text(json.dumps(signed))  # not re-signed
    res, peak = _peak_bytes(lambda: verify_release(sd_release, keys.trust()))
    assert not res.ok and "manifest signature" in {c.name for c in res.failures}
    assert res.starts_bytes is None
    assert peak < 30e6, f"verify took {peak / 1e6:.0f} MB for a manifest whose signature failed"
    assert any(c.name == "release files" and "not read" in c.detail for c in res.checks)


def test_a_signed_bomb_is_refused_from_its_array_headers_before_inflating(sd_release, keys):
    """The trusted coordinator itself signs a bomb's hash and size: the signed record releases 3 images, the
    header declares 400,000, so nothing is inflated."""
    (sd_release / "central_images.npz").write_bytes(_bomb(400_000))
    signed = load_signed(sd_release)
    rehash(signed["manifest"]["starts"], sd_release / "central_images.npz")
    resign(sd_release, signed, keys.coordinator)
    res, peak = _peak_bytes(lambda: verify_release(sd_release, keys.trust()))
    assert [c.name for c in res.failures] == ["central images"], res.reason()
    assert "400000 images, but the signed job releases 3" in res.reason() and "\n" not in res.reason()
    assert peak < 30e6, f"verify took {peak / 1e6:.0f} MB for a bomb the signed record excludes"


def test_verify_refuses_a_release_file_that_is_a_symbolic_link_and_shows_no_hash_of_its_target(
    release, keys, tmp_path
):
    """A link to a file of the verifier's machine: never followed, so its hash (prefix) is in no check, and
    the shareable report holds nothing of it."""
    from feta_release.release.report import render_report
    from feta_release.signing import sha256_file

    secret = tmp_path / "site.key"
    secret.write_bytes(b"-----BEGIN PRIVATE KEY----- not to be shared -----END PRIVATE KEY-----\n")
    (release / "generator.onnx").unlink()
    (release / "generator.onnx").symlink_to(secret)
    res = verify_release(release, keys.trust())
    assert [c.name for c in res.failures] == ["generator file"]
    assert "is a symbolic link, not a regular file" in res.reason()
    digest = sha256_file(secret)
    html = render_report(release, res)
    for text in (json.dumps(res.to_dict()), html):
        assert digest[:16] not in text and digest not in text


def test_verify_refuses_a_link_to_dev_zero_in_one_line_without_reading_it(release, keys, tmp_path):
    """It crashed with a MemoryError traceback. Run as the CLI under an address-space limit, so that reading
    the link could never take this machine's memory."""
    (release / "generator.onnx").unlink()
    (release / "generator.onnx").symlink_to("/dev/zero")
    limit = 3 << 30

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = cli_process(
        ["verify", str(release), *keys.trusted_args(tmp_path / "keys")], timeout=300, preexec_fn=cap
    )
    assert proc.returncode == ReleaseError.exit_code, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout and "MemoryError" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "generator.onnx" in lines[0] and "symbolic link" in lines[0]


def test_a_policy_file_that_is_a_link_is_refused(release, keys, tmp_path):
    pol = release / "policies" / "a.signed.json"
    real = tmp_path / "elsewhere.json"
    shutil.move(pol, real)
    pol.symlink_to(real)
    res = verify_release(release, keys.trust())
    assert "site a policy" in {c.name for c in res.failures} and "symbolic link" in res.reason()


def test_a_release_file_of_another_size_than_signed_is_refused_before_it_is_read(release, keys):
    """The manifest signs each file's size: a file grown by anyone is refused from its fstat, unread."""
    signed = load_signed(release)
    size = signed["manifest"]["generator"]["size"]
    assert size == (release / "generator.onnx").stat().st_size
    with open(release / "generator.onnx", "ab") as fh:
        fh.truncate(size + (64 << 20))  # 64 MiB more, sparse
    res, peak = _peak_bytes(lambda: verify_release(release, keys.trust()))
    assert [c.name for c in res.failures] == ["generator file"]
    assert f"the signed manifest says {size:,}" in res.reason()
    assert peak < 30e6


def test_a_release_without_signed_sizes_is_held_to_the_hard_caps(release, keys, monkeypatch):
    """A manifest written before sizes were signed: the caps alone bound what is read."""
    import feta_release.release.verify as verify

    signed = load_signed(release)
    del signed["manifest"]["generator"]["size"]
    resign(release, signed, keys.coordinator)
    assert verify_release(release, keys.trust()).ok
    monkeypatch.setattr(verify, "MAX_GENERATOR_BYTES", 1000)
    res = verify_release(release, keys.trust())
    assert [c.name for c in res.failures] == ["generator file"] and "over the limit of 1,000" in res.reason()


def test_synthesize_and_report_refuse_a_linked_release_file_in_one_line(sd_release, keys, tmp_path):
    from feta_release.release.report import write_report
    from feta_release.release.synthesize import synthesize

    real = tmp_path / "elsewhere.npz"
    shutil.move(sd_release / "central_images.npz", real)
    (sd_release / "central_images.npz").symlink_to(real)
    with pytest.raises(ReleaseError, match="symbolic link") as err:
        synthesize(sd_release, tmp_path / "out", keys.trust(), num=3, progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    _, res = write_report(sd_release, tmp_path / "report.html", keys.trust(), per_class=1)
    html = (tmp_path / "report.html").read_text()
    assert not res.ok and "Release REFUSED" in html and "symbolic link, not followed or read" in html


def test_an_npz_member_listed_twice_is_refused(sd_release, keys):
    """Two members of one name: numpy reads one, a zip tool shows the other."""
    images, labels = _central()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, arr in (("images", images), ("labels", labels), ("images", np.zeros_like(images))):
            member = io.BytesIO()
            np.save(member, arr)
            zf.writestr(f"{name}.npy", member.getvalue())
    (sd_release / "central_images.npz").write_bytes(buf.getvalue())
    signed = load_signed(sd_release)
    rehash(signed["manifest"]["starts"], sd_release / "central_images.npz")
    resign(sd_release, signed, keys.coordinator)
    res = verify_release(sd_release, keys.trust())
    assert [c.name for c in res.failures] == ["central images"] and "more than once" in res.reason()
