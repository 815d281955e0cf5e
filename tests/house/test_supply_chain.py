"""The site node's install is pinned by hash (docs/supply-chain.md): the lock covers pyproject's dependencies
inside their ranges, every line carries sha256 hashes, torch is the CPU build, and the Dockerfile installs
from the lock only (``--require-hashes``, then the project with no dependency or build-backend download)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging")
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import Version  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements-node.lock"


def _locked() -> dict[str, tuple[Version, list[str]]]:
    """name -> (pinned version, its sha256 hashes), from the lock's ``name==version \\ --hash=sha256:...``
    entries."""
    text = LOCK.read_text("utf-8")
    out: dict[str, tuple[Version, list[str]]] = {}
    for entry in re.split(r"\n(?=[A-Za-z0-9])", text):
        head = entry.split(" \\", 1)[0].strip()
        if not head or head.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?==(\S+)", head)
        assert m, f"requirements-node.lock: {head!r} is not name==version"
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})\b", entry)
        out[canonicalize_name(m.group(1))] = (Version(m.group(3)), hashes)
    return out


def test_every_locked_distribution_is_pinned_with_sha256_hashes() -> None:
    locked = _locked()
    assert len(locked) > 40
    unhashed = sorted(n for n, (_, hashes) in locked.items() if not hashes)
    assert not unhashed, f"no sha256 for {unhashed}"
    assert not re.search(
        r"^\s*(-e|--index-url|--extra-index-url|--find-links|-f)\b", LOCK.read_text(), re.M
    ), (
        "the lock must name no index, link folder or editable path: where files come from is the installer's "
        "choice"
    )


def test_the_lock_pins_every_project_dependency_inside_its_range() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]["dependencies"]
    locked = _locked()
    for dep in map(Requirement, deps):
        name = canonicalize_name(dep.name)
        assert name in locked, f"{dep.name} (pyproject) is not in requirements-node.lock"
        version = locked[name][0]
        # "torch==2.13.0" admits the local build 2.13.0+cpu (PEP 440: a local label matches the public
        # version)
        assert dep.specifier.contains(version, prereleases=True), (
            f"{dep.name} {version} is outside {dep.specifier}"
        )
    torch = locked["torch"][0]
    assert torch.local == "cpu" and not any(n.startswith("nvidia-") for n in locked), (
        "the lock must not pull CUDA"
    )
    assert "setuptools" in locked  # the build backend, for --no-build-isolation


def test_the_dockerfile_installs_from_the_lock_only() -> None:
    runs = [
        ln for ln in (REPO / "Dockerfile").read_text("utf-8").splitlines() if ln.startswith("RUN pip install")
    ]
    assert runs[0].startswith("RUN pip install --require-hashes --no-deps -r requirements-node.lock")
    assert all("--require-hashes" in r or ("--no-deps" in r and "--no-build-isolation" in r) for r in runs), (
        runs
    )
    assert "COPY requirements-node.lock" in (REPO / "Dockerfile").read_text("utf-8")
