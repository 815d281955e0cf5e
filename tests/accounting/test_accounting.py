"""Whole-history accounting: events, heterogeneous composition, cross-checks, calibration, torch-free
import."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.accounting import (
    RDP_ORDERS,
    PrivacyEvent,
    calibrate_noise_multiplier,
    epsilon,
    epsilon_breakdown,
    events_from_list,
    events_to_list,
)
from feta_release.errors import PrivacyError

# Heterogeneous histories shaped like real jobs: central rounds, an unsampled frequency release, DP-SGD.
HISTORIES = [
    [
        PrivacyEvent("central", 5.0, 0.1, 5),
        PrivacyEvent("frequency", 26.6, 1.0, 1),
        PrivacyEvent("dpsgd", 3.5, 0.064, 157),
    ],
    [PrivacyEvent("central", 5.0, 6000 / 55000, 50), PrivacyEvent("dpsgd", 13.2, 4096 / 55000, 1790)],
    [
        PrivacyEvent("frequency", 7.4, 1.0, 1),
        PrivacyEvent("dpsgd", 1.2, 0.01, 500),
        PrivacyEvent("dpsgd", 2.0, 0.05, 40),
    ],
    [
        PrivacyEvent("central", 10.0, 0.05, 250),
        PrivacyEvent("frequency", 49.6, 1.0, 1),
        PrivacyEvent("dpsgd", 1.9, 0.02, 1500),
    ],
]


def test_event_round_trip_and_validation() -> None:
    ev = PrivacyEvent("dpsgd", 2, 0.5, 10)
    assert ev.sigma == 2.0 and isinstance(ev.sigma, float)
    assert PrivacyEvent.from_dict(json.loads(json.dumps(ev.to_dict()))) == ev
    assert events_from_list(events_to_list(HISTORIES[0])) == HISTORIES[0]
    np_ev = PrivacyEvent("dpsgd", np.float32(2.0), np.float64(0.5), np.int64(10))  # numpy scalars normalised
    assert np_ev == ev and type(np_ev.steps) is int and json.dumps(np_ev.to_dict())
    for bad in [
        dict(sigma=0.0),
        dict(sigma=-1.0),
        dict(sigma=float("nan")),
        dict(q=0.0),
        dict(q=1.5),
        dict(steps=-1),
        dict(steps=1.5),
        dict(stage=""),
        dict(sigma=True),
    ]:
        kwargs = {"stage": "dpsgd", "sigma": 1.0, "q": 0.1, "steps": 1, **bad}
        with pytest.raises(PrivacyError):
            PrivacyEvent(**kwargs)
    with pytest.raises(PrivacyError, match="lacks"):
        PrivacyEvent.from_dict({"stage": "dpsgd", "sigma": 1.0, "q": 0.1})
    with pytest.raises(PrivacyError, match="unknown"):
        PrivacyEvent.from_dict({"stage": "dpsgd", "sigma": 1.0, "q": 0.1, "steps": 1, "eps": 3})


def test_orders_are_opacus_defaults() -> None:
    assert RDP_ORDERS[0] == pytest.approx(1.1) and RDP_ORDERS[98] == pytest.approx(10.9)
    assert RDP_ORDERS[99:] == tuple(float(a) for a in range(12, 64))


def test_composition_basics() -> None:
    assert epsilon([], 1e-5) == 0.0
    assert epsilon([PrivacyEvent("dpsgd", 1.0, 0.1, 0)], 1e-5) == 0.0  # zero steps cost nothing
    h = HISTORIES[0]
    total = epsilon(h, 1e-5)
    parts = epsilon_breakdown(h, 1e-5)
    assert parts["total"] == pytest.approx(total)
    # Composition: the whole costs more than any part, and (RDP is sub-additive in eps) at most their sum.
    assert all(total > parts[s] for s in ("central", "frequency", "dpsgd"))
    assert total <= parts["central"] + parts["frequency"] + parts["dpsgd"]
    # Order of events does not matter; more steps, smaller delta or less noise cost more.
    assert epsilon(list(reversed(h)), 1e-5) == pytest.approx(total)
    assert epsilon(h, 1e-7) > total
    assert epsilon(h + [PrivacyEvent("dpsgd", 3.5, 0.064, 1)], 1e-5) > total
    with pytest.raises(PrivacyError):
        epsilon(h, 0.0)
    with pytest.raises(PrivacyError):
        epsilon(h, 1e-5, accountant="moments")  # type: ignore[arg-type]


@pytest.mark.parametrize("history", HISTORIES)
def test_rdp_matches_dp_accounting(history: list[PrivacyEvent]) -> None:
    """Independent implementation: Google's dp-accounting RDP accountant with the same orders.

    Its RDP -> (eps, delta) conversion (Canonne-Kamath-Steinke 2020) is algebraically the same bound as
    Balle et al. 2020 Thm 21 (log((a-1)/a) = log1p(-1/a)), so the two must agree to numerical precision.
    """
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(orders=list(RDP_ORDERS))
    for e in history:
        event = dp_accounting.PoissonSampledDpEvent(e.q, dp_accounting.GaussianDpEvent(e.sigma))
        acc.compose(event, e.steps)
    theirs = acc.get_epsilon(1e-5)
    assert epsilon(history, 1e-5) == pytest.approx(theirs, rel=1e-4)


@pytest.mark.parametrize("history", HISTORIES[:3])
def test_prv_matches_prv_accountant(history: list[PrivacyEvent]) -> None:
    """Independent PRV implementation (Microsoft's prv-accountant): our upper bound must lie within the
    error band its own discretisation guarantees (eps_error = 0.01 on both sides), and be at most RDP's."""
    prv_accountant = pytest.importorskip("prv_accountant")
    prvs = [prv_accountant.PoissonSubsampledGaussianMechanism(e.q, e.sigma) for e in history]
    counts = [e.steps for e in history]
    acc = prv_accountant.PRVAccountant(
        prvs=prvs, max_self_compositions=counts, eps_error=0.01, delta_error=1e-8
    )
    lower, _, upper = acc.compute_epsilon(delta=1e-5, num_self_compositions=counts)
    ours = epsilon(history, 1e-5, accountant="prv")
    assert lower - 0.02 <= ours <= upper + 0.02
    assert ours <= epsilon(history, 1e-5, accountant="rdp") + 0.02  # PRV is the tighter accountant


@contextlib.contextmanager
def _opacus_notices_hidden() -> Iterator[None]:
    """Opacus is only the reference here; two notices from inside it say nothing about the figures compared:
    its PRV takes log(1 - q), which numpy flags at q = 1 before opacus masks it, and its RDP notes when the
    best order is an end of the grid (it is given RDP_ORDERS, the grid our accountant uses too)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "divide by zero encountered in log", RuntimeWarning, r"opacus\.")
        warnings.filterwarnings(
            "ignore", "Optimal order is the (smallest|largest) alpha", UserWarning, r"opacus\."
        )
        yield


def _opacus_rdp(history: list[PrivacyEvent], delta: float) -> float:
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    rdp = sum(
        compute_rdp(q=e.q, noise_multiplier=e.sigma, steps=e.steps, orders=list(RDP_ORDERS)) for e in history
    )
    with _opacus_notices_hidden():
        return float(get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)[0])


@pytest.mark.parametrize("history", HISTORIES)
def test_same_numbers_as_opacus_accountants(history: list[PrivacyEvent]) -> None:
    """The analysis moved from Opacus' source to dp-accounting / prv-accountant: the figures did not move."""
    pytest.importorskip("opacus")
    from opacus.accountants import PRVAccountant

    assert epsilon(history, 1e-5) == pytest.approx(_opacus_rdp(history, 1e-5), rel=1e-6)
    acc = PRVAccountant()
    acc.history = [(e.sigma, e.q, e.steps) for e in history]
    with _opacus_notices_hidden():
        reference = acc.get_epsilon(1e-5)
    assert epsilon(history, 1e-5, "prv") == pytest.approx(reference, rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    sigma=st.floats(0.5, 60.0),
    q=st.floats(1e-4, 1.0),
    steps=st.integers(1, 5000),
    delta=st.sampled_from([1e-5, 1e-6, 1e-7]),
)
def test_rdp_agrees_with_opacus_on_any_event(sigma: float, q: float, steps: int, delta: float) -> None:
    """Any single event, q = 1 included: the figure a release states is the one Opacus gave before the move,
    to the 1e-6 that verify re-composes to (so releases made with Opacus' analysis still verify)."""
    pytest.importorskip("opacus")
    ev = [PrivacyEvent("dpsgd", sigma, q, steps)]
    assert epsilon(ev, delta) == pytest.approx(_opacus_rdp(ev, delta), rel=1e-6)


def test_prv_falls_back_to_rdp_where_prv_accountant_cannot_discretise() -> None:
    """sigma 0.8 at q 0.5 for 1,000 steps: prv-accountant refuses its discretisation; the figure is RDP's
    bound."""
    ev = [PrivacyEvent("dpsgd", 0.8, 0.5, 1000)]
    assert epsilon(ev, 1e-5, "prv") == epsilon(ev, 1e-5, "rdp") > 100


def test_calibration_brackets_the_target() -> None:
    prior = HISTORIES[0][:2]
    q, steps = 0.064, 157
    sigma = calibrate_noise_multiplier(prior, q, steps, 1.0, 1e-5)
    assert epsilon(prior + [PrivacyEvent("dpsgd", sigma, q, steps)], 1e-5) <= 1.0
    # Within the tolerance 0.01: noise 0.01 lower no longer fits.
    assert epsilon(prior + [PrivacyEvent("dpsgd", sigma - 0.01, q, steps)], 1e-5) > 1.0
    # Warm-up events make DP-SGD noisier than without them.
    assert calibrate_noise_multiplier([], q, steps, 1.0, 1e-5) < sigma
    # sigma below 1 (no doubling) is bracketed too.
    small = calibrate_noise_multiplier([], 0.01, 10, 8.0, 1e-5)
    assert small < 1.0
    assert epsilon([PrivacyEvent("dpsgd", small, 0.01, 10)], 1e-5) <= 8.0
    assert epsilon([PrivacyEvent("dpsgd", small - 0.01, 0.01, 10)], 1e-5) > 8.0


def test_calibration_prv_option() -> None:
    sigma_rdp = calibrate_noise_multiplier([], 0.05, 200, 2.0, 1e-5, accountant="rdp")
    sigma_prv = calibrate_noise_multiplier([], 0.05, 200, 2.0, 1e-5, accountant="prv")
    assert sigma_prv <= sigma_rdp  # the tighter accountant needs no more noise
    assert epsilon([PrivacyEvent("dpsgd", sigma_prv, 0.05, 200)], 1e-5, "prv") <= 2.0


def test_calibration_refuses_infeasible() -> None:
    heavy = [PrivacyEvent("central", 1.0, 0.5, 100)]
    with pytest.raises(PrivacyError, match="warm-up stages alone.*central"):
        calibrate_noise_multiplier(heavy, 0.1, 100, 1.0, 1e-5)
    with pytest.raises(PrivacyError, match="does not fit"):
        calibrate_noise_multiplier([], 1.0, 10**6, 0.01, 1e-5, max_sigma=50.0)
    with pytest.raises(PrivacyError, match="q must be"):
        calibrate_noise_multiplier([], 1.5, 10, 1.0, 1e-5)
    with pytest.raises(PrivacyError, match="tolerance"):
        calibrate_noise_multiplier([], 0.1, 10, 1.0, 1e-5, tol=0.1)


def test_importable_and_usable_without_torch() -> None:
    """Offline verification runs where torch and opacus are absent: block both, compute epsilon in a fresh
    interpreter."""
    code = textwrap.dedent(
        """
        import sys

        class NoTorch:  # any 'import torch' raises, as on a machine without torch
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "opacus"):
                    raise ImportError(f"{name} is blocked in this test")
                return None

        sys.meta_path.insert(0, NoTorch())
        from feta_release.accounting import PrivacyEvent, epsilon
        h = [PrivacyEvent("central", 5.0, 0.1, 5), PrivacyEvent("dpsgd", 3.5, 0.064, 157)]
        print(epsilon(h, 1e-5), epsilon(h, 1e-5, "prv"))
        assert not [m for m in sys.modules if "opacus" in m or m.split(".")[0] == "torch"], "opacus/torch loaded"
        """  # noqa: E501
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rdp, prv = map(float, out.stdout.split())
    assert rdp == pytest.approx(
        epsilon([PrivacyEvent("central", 5.0, 0.1, 5), PrivacyEvent("dpsgd", 3.5, 0.064, 157)], 1e-5)
    )
    assert 0 < prv <= rdp + 0.02
