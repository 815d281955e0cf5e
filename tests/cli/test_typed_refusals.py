"""Places where mypy (run over the whole library and both drivers, tests/house/test_lint.py) found a None that
the code used as a number: each now either works or refuses in one clear line, and these tests pin that."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.demo import demo_config
from feta_release.config import load_preset
from feta_release.data.dicom import Window, window_sixteen_bit
from feta_release.errors import ConfigError


def test_the_demo_adapts_a_preset_that_gives_dpsgd_in_epochs() -> None:
    # paper-mnist sets [dpsgd] epochs, not steps: the demo compared steps (None) with 0 and crashed with
    # TypeError.
    assert load_preset("paper-mnist").dpsgd.steps is None
    cfg = demo_config("paper-mnist", 10.0, 1000, rounds=3, local_steps=5, quick=True)
    assert (cfg.dpsgd.steps, cfg.dpsgd.epochs) == (15, None)


def test_the_demo_keeps_a_preset_without_dpsgd_without_it() -> None:
    assert demo_config("cpu-eps1-nodpsgd", 1.0, 1000, rounds=3, local_steps=5, quick=True).dpsgd.steps == 0


@pytest.mark.parametrize(
    ("window", "needs"), [(Window("bits"), "bit depth"), (Window("linear", center=40.0), "width")]
)
def test_a_hand_built_window_without_its_numbers_is_refused_in_one_line(window: Window, needs: str) -> None:
    # parse_window never builds these; a hand-built one used to fail deep in numpy (int(None), None
    # arithmetic).
    raw = np.arange(64, dtype=np.uint16).reshape(8, 8)
    with pytest.raises(ConfigError, match=needs):
        window_sixteen_bit(raw, window)


def test_a_complete_window_scales_as_before() -> None:
    raw = np.array([[0, 4095]], dtype=np.uint16)
    x, how = window_sixteen_bit(raw, Window("bits", bits=12))
    assert x.tolist() == [[0.0, 1.0]] and "12-bit" in how
    x, _ = window_sixteen_bit(raw, Window("linear", center=2048.0, width=4096.0))
    assert x.min() == 0.0 and x.max() > 0.99
