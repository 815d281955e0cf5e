"""A site whose images do not fit the memory its policy gives the computing processes
(``resources.max_worker_memory_mb``, their RLIMIT_DATA) is refused when the node opens it, before any image is
read, in one line naming the bytes needed against the limit: a 100,000-image 256x256 site would otherwise fail
part-way through an open or a charged release."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.setup import prepare_federation
from edge.site import CFG_DEVICE, Site, forget_sites
from feta_release.data.dataset import MEMORY_ENV, ImageDataset, site_memory_bytes
from feta_release.errors import DataError
from tests.support.federation import tiny_sites


def _config(tmp: Path, size: int, side: int, resources: dict[str, Any] | None = None) -> dict[str, Any]:
    """A site of 18 grey images of ``side`` px whose signed policy declares ``size`` public images of it."""
    rng = np.random.default_rng(0)
    data = ImageDataset(
        rng.random((18, 1, side, side), dtype=np.float32),
        np.arange(18, dtype=np.int64) % 2,
        ("benign", "malignant"),
    )
    over = {"site-a": {"resources": resources}} if resources is not None else None
    fed = prepare_federation(
        tmp / "fed",
        {"site-a": data, "site-b": tiny_sites()["site-b"]},
        public_sizes={"site-a": size},
        policy_overrides=over,
    )
    return fed.site("site-a").node_config()


def _no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    import edge.site

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("the site's data were read before the memory check")

    monkeypatch.setattr(edge.site, "load_site_data_report", refuse)


def test_a_256px_site_of_100000_images_is_refused_over_the_worker_memory_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path, 100_000, 256)
    monkeypatch.setenv(
        MEMORY_ENV, str(10**7)
    )  # a machine with the memory: the policy's limit is what refuses
    _no_decoding(monkeypatch)
    forget_sites()
    with pytest.raises(DataError) as err:
        Site.open(cfg)
    msg = str(err.value)
    assert "\n" not in msg and "(dataset.size, dataset.image_shape)" in msg
    assert "100,000 images of 1x256x256 need 25.41 GiB" in msg, msg
    assert "> resources.max_worker_memory_mb 16,384 MiB" in msg and "--image-size" in msg


def test_a_site_within_a_stated_limit_opens_and_one_past_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_mb = site_memory_bytes(20, 28 * 28) // 2**20 + 1  # MiB, rounded up
    cfg = _config(tmp_path / "fits", 20, 28, {"max_worker_memory_mb": need_mb})
    forget_sites()
    Site.open(cfg).ledger.close()
    cfg = _config(tmp_path / "over", 20, 28, {"max_worker_memory_mb": need_mb - 1})
    _no_decoding(monkeypatch)
    forget_sites()
    with pytest.raises(DataError, match="resources.max_worker_memory_mb"):
        Site.open(cfg)


def test_a_gpu_node_is_held_only_to_a_limit_its_policy_states(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As edge.resources.limit_memory: on a GPU the CUDA driver's host mappings were not measured against the
    default limit, so only a limit the policy states applies there."""
    import feta_release.policy.enforce as enforce

    monkeypatch.setattr(
        enforce, "DEFAULT_RESOURCES", {**enforce.DEFAULT_RESOURCES, "max_worker_memory_mb": 1}
    )
    cfg = _config(tmp_path, 20, 28)
    forget_sites()
    with pytest.raises(DataError, match="resources.max_worker_memory_mb 1 MiB"):
        Site.open(cfg)
    forget_sites()
    Site.open({**cfg, CFG_DEVICE: "cuda"}).ledger.close()
