"""``[central] cell_rule = "aux"`` over the node: the coordinator sends the public cell prototypes with the
central request, and the node takes them as public input only after checking them, before the charge (the
declared classes x cells x pixels, finite, in [0, 1]); a slant job's request carries no array at all."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.clientapp import _central_fits
from edge.protocol import Request
from edge.releases import release_central
from feta_release.accounting import PrivacyEvent
from feta_release.config import load_preset
from feta_release.errors import PolicyError, PrivacyError
from tests.support.training import embedded_subset


def _job(rule: str = "aux", cells: int = 2) -> Any:
    cfg = load_preset("tiny").replace(central={"cells": cells, "cell_rule": rule})
    return SimpleNamespace(config=cfg)


def _site() -> Any:
    declared = SimpleNamespace(n_classes=10, image_shape=(1, 28, 28))
    return SimpleNamespace(policy=SimpleNamespace(declared=declared))


def _request(arrays: dict[str, np.ndarray]) -> Request:
    return Request("job:central:0", 0, PrivacyEvent("central", 5.0, 0.1, 1), {}, arrays)


def test_a_slant_central_request_carrying_arrays_is_refused_before_the_charge() -> None:
    _central_fits(_site(), _job("slant", 1), _request({}))
    with pytest.raises(PolicyError, match="takes none"):
        _central_fits(_site(), _job("slant", 1), _request({"prototypes": np.zeros((10, 1, 784))}))


def test_aux_cells_take_exactly_the_declared_prototypes() -> None:
    good = np.full((10, 2, 784), 0.5)
    _central_fits(_site(), _job(), _request({"prototypes": good}))
    with pytest.raises(PolicyError, match="takes only 'prototypes'"):
        _central_fits(_site(), _job(), _request({}))
    with pytest.raises(PolicyError, match="takes only 'prototypes'"):
        _central_fits(_site(), _job(), _request({"prototypes": good, "images": good}))
    with pytest.raises(PrivacyError, match="shape"):
        _central_fits(_site(), _job(), _request({"prototypes": np.full((10, 3, 784), 0.5)}))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([np.nan, np.inf, -0.01, 1.01, 255.0]), st.integers(0, 10 * 2 * 784 - 1))
def test_a_prototype_that_is_not_an_image_is_refused(value: float, where: int) -> None:
    bad = np.full((10, 2, 784), 0.5)
    bad.flat[where] = value
    with pytest.raises((PolicyError, PrivacyError)):
        _central_fits(_site(), _job(), _request({"prototypes": bad}))


def test_the_release_follows_the_job_s_rule_never_a_missing_or_stray_prototype() -> None:
    data = embedded_subset(100)
    cfg = _job().config.for_size(100)
    with pytest.raises(PrivacyError, match="needs the coordinator's public cell prototypes"):
        release_central(data, cfg, 100, np.random.default_rng(0))
    slant = _job("slant", 2).config.for_size(100)
    with pytest.raises(PrivacyError, match="takes no prototypes"):
        release_central(data, slant, 100, np.random.default_rng(0), np.full((10, 2, 784), 0.5))
    arrays, events = release_central(data, cfg, 100, np.random.default_rng(0), np.full((10, 2, 784), 0.5))
    assert [e.stage for e in events] == ["central"] and arrays
