"""The node's private site cache (edge/site_cache.py): a per-message open reads the site opened at
node start instead of decoding N images, with work padded to the public size; what it returns is the site a
fresh open verifies, and a cache not written by this node for exactly these files is never trusted."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.setup import prepare_federation
from edge import site_cache
from edge.site import Site, forget_sites
from feta_release.data.commitment import load_secret, public_rows
from feta_release.errors import PolicyError
from tests.support.federation import tiny_sites
from tests.support.patients import CAP, PATIENT_SITE
from tests.support.patients import patient_federation as _federation
from tests.support.sites import BASE_LABELS
from tests.support.sites import csv_site as _csv_site


def _site_fed(tmp: Path, n: int) -> Any:
    return prepare_federation(
        tmp / "fed",
        {"site-a": _csv_site(tmp / "data", BASE_LABELS[:n]), "site-b": tiny_sites()["site-b"]},
        public_sizes={"site-a": 20},
    )


def _decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import feta_release.data.loading as loading

    seen: list[int] = []
    real = loading._read_pixels

    def counted(*a: Any, **k: Any) -> Any:
        seen.append(1)
        return real(*a, **k)

    monkeypatch.setattr(loading, "_read_pixels", counted)
    return seen


def _open(cfg: dict[str, Any]) -> Site:
    forget_sites()
    site = Site.open(cfg)
    site.ledger.close()
    return site


def test_a_cached_open_is_the_site_a_decoding_open_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _site_fed(tmp_path, 18).site("site-a").node_config()
    decoded = _decodes(monkeypatch)
    fresh = _open(cfg)  # node start: decodes and verifies, writes the cache
    assert len(decoded) == 18
    cached = _open(cfg)  # a per-message process
    assert len(decoded) == 18, "a per-message open decoded the images again"
    assert np.array_equal(fresh.data.images, cached.data.images) and cached.data.images.dtype == np.float32
    assert np.array_equal(fresh.data.labels, cached.data.labels) and cached.data.n == 18
    assert cached.data.class_names == fresh.data.class_names and cached.data.source == fresh.data.source
    assert cached.policy.dataset_size == 20 and cached.patients is None


def test_the_cache_is_private_and_its_size_is_the_public_bucket(tmp_path: Path) -> None:
    """The file holds images: 0600 in the 0700 work dir. Sites of 18 and 20 images at public size 20 write the
    same number of rows (and bytes): reading and MACing it costs the public bucket, never N."""
    sizes = []
    for n in (18, 20):
        cfg = _site_fed(tmp_path / str(n), n).site("site-a").node_config()
        site = _open(cfg)
        path = site.work_dir / site_cache.CACHE_NAME
        assert (
            stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(site.work_dir.stat().st_mode) == 0o700
        )
        cached = site_cache.load(
            site.work_dir, site_cache.cache_key(cfg, 20, site.policy.digest), load_secret(cfg["data-secret"])
        )
        assert cached is not None and cached["images"].shape[0] == public_rows(n, 20) == 20
        sizes.append(path.stat().st_size)
    assert sizes[0] == sizes[1]


def test_a_patient_sites_cached_open_has_the_same_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed, _ = _federation(tmp_path)
    cfg = fed.site(PATIENT_SITE).node_config()
    fresh = _open(cfg)
    decoded = _decodes(monkeypatch)
    cached = _open(cfg)
    assert decoded == [] and cached.patients is not None and fresh.patients is not None
    assert np.array_equal(cached.patients.ids, fresh.patients.ids) and cached.patients.cap == CAP
    assert cached.patients.n_public == fresh.patients.n_public
    assert len(cached.patients.rows) == len(fresh.patients.rows)
    assert all(
        np.array_equal(a.numpy(), b.numpy()) for a, b in zip(cached.patients.rows, fresh.patients.rows)
    )


def test_changed_data_is_verified_afresh_not_read_from_the_cache(tmp_path: Path) -> None:
    """Another image written in place of one the policy committed to: the stamp changes, the cache is a miss,
    and the open decodes the new file and refuses it (the policy's commitment no longer matches)."""
    from PIL import Image

    cfg = _site_fed(tmp_path, 18).site("site-a").node_config()
    _open(cfg)
    before = site_cache.site_stamp(cfg, 20)
    Image.fromarray(np.zeros((28, 28), dtype=np.uint8), mode="L").save(tmp_path / "data" / "000.png")
    assert site_cache.site_stamp(cfg, 20) != before  # the warm worker's per-request check sees it too
    with pytest.raises(PolicyError):
        _open(cfg)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), how=st.sampled_from(["flip", "truncate", "other-key"]))
def test_a_cache_not_written_for_these_files_is_a_miss(
    tmp_path_factory: pytest.TempPathFactory, where: float, how: str
) -> None:
    """Any byte changed, a truncated file, or a file MACed for another stamp: ``load`` returns None (the site
    is decoded and verified again), never a parse of bytes this node did not write for exactly these files."""
    tmp = tmp_path_factory.mktemp("cache")
    ds = tiny_sites()["site-a"]
    secret = os.urandom(32)
    site_cache.save(tmp, "k1", secret, ds, None, "c" * 64, 40)
    assert site_cache.load(tmp, "k1", secret) is not None
    path = tmp / site_cache.CACHE_NAME
    raw = bytearray(path.read_bytes())
    at = int(where * len(raw))
    if how == "flip":
        raw[at] ^= 0x01
        path.write_bytes(bytes(raw))
    elif how == "truncate":
        path.write_bytes(bytes(raw[:at]))
    key = "k2" if how == "other-key" else "k1"
    assert site_cache.load(tmp, key, secret) is None


def test_a_changed_loader_makes_the_cache_key_change(monkeypatch) -> None:
    """The key covered the node config and the files, not the code that decodes them; after an
    upgrade that changes decoding, a node kept serving data the old code had decoded."""
    import edge.site_cache as sc

    cfg = {"policy-file": "/nonexistent"}
    monkeypatch.setattr(sc, "site_stamp", lambda node_config, n_public: "stamp")
    before = sc.cache_key(cfg, 10, "policy digest")
    monkeypatch.setattr(sc, "_loader_code", lambda: b"other loader code")
    assert sc.cache_key(cfg, 10, "policy digest") != before


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    eight_bit=st.booleans(), n=st.integers(1, 5000), extra=st.integers(0, 3000), seed=st.integers(0, 2**31)
)
def test_the_cache_gives_back_the_loader_bits_exactly(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    eight_bit: bool,
    n: int,
    extra: int,
    seed: int,
) -> None:
    """8-bit sources are cached one byte per pixel, anything else as float32; either way a cached open returns
    the very float32 bits the loader gave (across the chunks the cache is written and read in), the labels and
    ids."""
    from feta_release.data.dataset import ImageDataset

    tmp = tmp_path_factory.mktemp("bits")
    # 7 rows a chunk: chunk edges inside the real rows
    monkeypatch.setattr(site_cache, "_CHUNK_BYTES", 48 * 7)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, 1, 4, 3), dtype=np.uint8)
    images = (
        raw.astype(np.float32) / np.float32(255) if eight_bit else rng.random((n, 1, 4, 3), dtype=np.float32)
    )
    ds = ImageDataset(images=images, labels=rng.integers(0, 3, n), class_names=("a", "b", "c"), source="s")
    ids = rng.integers(0, 50, n)
    secret = os.urandom(32)
    site_cache.save(tmp, "k", secret, ds, ids, "c" * 64, n + extra)
    cached = site_cache.load(tmp, "k", secret)
    assert cached is not None and cached["images"].dtype == (np.uint8 if eight_bit else np.float32)
    assert cached["images"].shape[0] == public_rows(n, n + extra)
    back, back_ids, commitment = site_cache.cached_site(cached)
    assert back.images.tobytes() == ds.images.tobytes() and np.array_equal(back.labels, ds.labels)
    assert np.array_equal(back_ids, ids) and commitment == "c" * 64 and back.class_names == ds.class_names


def test_a_node_refuses_a_public_size_over_the_memory_limit_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's open checks the policy's PUBLIC size x declared shape x 4 bytes against the limit before it
    decodes or reads the cache: one line naming the policy and the figure."""
    from feta_release.data.dataset import MEMORY_ENV
    from feta_release.errors import DataError

    cfg = _site_fed(tmp_path, 18).site("site-a").node_config()
    decoded = _decodes(monkeypatch)
    monkeypatch.setenv(MEMORY_ENV, str(20 * 784 * 4 / 2**20 * 0.99))  # public size 20 of 1x28x28: just over
    with pytest.raises(DataError) as err:
        _open(cfg)
    assert "dataset.size" in str(err.value) and "20 images of 784 values" in str(err.value) and not decoded
