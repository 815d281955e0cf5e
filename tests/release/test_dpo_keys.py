"""The key a data-protection officer trusts for a site has ONE name everywhere (``policy-admin.pub``), the
site administrator is told to hand it over with its fingerprint, and a demo folder can be moved or sent: each
copy verifies its own release files, never the original's."""

from __future__ import annotations

import io
import os
import re
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

pytest.importorskip("torch")  # only to BUILD the test release

from feta_release.cli import main  # noqa: E402
from feta_release.release.verify import verify_release  # noqa: E402
from tests.support.release import make_release  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


def _invoke(args: list[str]) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf), redirect_stderr(buf):
        try:
            main(args)
        except SystemExit as exc:
            return int(exc.code or 0), buf.getvalue()
    return 0, buf.getvalue()


def test_site_init_tells_the_admin_to_send_policy_admin_pub_to_the_dpo_with_its_fingerprint(
    tmp_path: Path,
) -> None:
    import numpy as np

    from feta_release.data import load_embedded, save_npz

    full = load_embedded()
    idx = np.concatenate([np.flatnonzero(full.labels == c)[:6] for c in range(10)])
    save_npz(full.subset(np.sort(idx)), tmp_path / "data.npz")
    code, out = _invoke(
        ["site", "init", str(tmp_path / "kit"), "--data", str(tmp_path / "data.npz"), "--site-id", "st-mary"]
    )
    assert code == 0, out
    pub = tmp_path / "kit" / "keys" / "policy-admin.pub"
    assert pub.is_file()
    m = re.search(r"data-protection officer.*\n\s*(\S*policy-admin\.pub)\s+fingerprint ([0-9a-f]{16})", out)
    assert m and Path(m.group(1)) == pub, out
    code, shown = _invoke(["keys", "show", str(pub)])
    assert code == 0 and m.group(2) in shown
    assert "feta-release keys show" in out


def test_demo_federation_names_each_admin_key_policy_admin_pub(tmp_path: Path) -> None:
    from tests.support.federation import make_federation

    fed = make_federation(tmp_path)
    for s in fed.sites:
        assert Path(s.policy_pub).name == "policy-admin.pub"
        assert Path(s.policy_pub).parent == tmp_path / "sites" / s.site_id / "keys"


def test_a_moved_demo_folder_verifies_its_own_copy_of_the_release(tmp_path: Path, den_onnx, keys) -> None:
    from coordinator.demo import link_release

    demo = tmp_path / "demo-out"
    release = make_release(demo / "job" / "release", den_onnx, keys)
    link = link_release(demo, release)
    assert not os.path.isabs(os.readlink(link))
    # an archive keeps the link as is
    sent = shutil.copytree(demo, tmp_path / "sent" / "demo-out", symlinks=True)
    moved = tmp_path / "moved"
    demo.rename(moved)
    assert verify_release(moved / "release", keys.trust()).ok
    # the copy reads its own files: damage in the other copy does not show in it, and its own damage does
    (moved / "job" / "release" / "generator.onnx").write_bytes(b"not the generator")
    assert verify_release(sent / "release", keys.trust()).ok
    assert not verify_release(moved / "release", keys.trust()).ok
