"""feta-release: differentially private synthetic image release (DP-FETA / FETA-Pro).

The library API; the ``feta-release`` commands are built on the same functions. ``import feta_release`` loads
this module only: each name below imports its module on first use, so a verifier's light install (no torch,
Flower, opacus or onnx) reaches the planner, the accountant and :func:`verify_release` from here too.

Plan a job derived from public facts (:mod:`feta_release.job_rules`) with the one planner
(:mod:`feta_release.planning`), which calibrates every stage against the budget:

>>> from feta_release import DataFacts, derive_job, plan
>>> facts = DataFacts(size=4000, height=28, width=28, channels=1, n_classes=10, epsilon=1.0)
>>> job = derive_job(facts)
>>> p = plan(job, facts.size)
>>> p.epsilon <= facts.epsilon
True
>>> [(s.stage, f"{s.epsilon:.2f}") for s in p.stages if s.enabled]
[('central', '0.80'), ('frequency', '0.55')]

Release noisy central images (:mod:`feta_release.mechanisms.central`): the mechanism returns the released
value AND the privacy event it cost. A fixed seed keeps the example reproducible; a real release draws its
noise from the OS (:func:`feta_release.randomness.os_numpy_generator`).

>>> import numpy as np
>>> from feta_release import central_images
>>> rng = np.random.default_rng(0)
>>> images = rng.random((40, 1, 8, 8), dtype=np.float32)
>>> labels = np.arange(40) % 2
>>> release, event = central_images(
...     images, labels, 2, rounds=1, batch=20, sigma=2.0, clip=1.0, n_public=40, rng=rng
... )
>>> release.values.shape, release.labels.tolist()
((2, 1, 4, 4), [0, 1])
>>> event
PrivacyEvent(stage='central', sigma=2.0, q=0.5, steps=1, unit='image')

Account a history (:mod:`feta_release.accounting`): every stage composed, with either accountant:

>>> from feta_release import PrivacyEvent, epsilon
>>> history = [event, PrivacyEvent("dpsgd", sigma=3.5, q=0.064, steps=157)]
>>> f"{epsilon(history, delta=1e-5):.2f}", f"{epsilon(history, delta=1e-5, accountant='prv'):.2f}"
('1.81', '1.63')

Verify a release offline (:mod:`feta_release.release.verify`) against role-bound trust roots (each site's
administrator key); it never raises for a bad release, it says what failed:

>>> import tempfile
>>> from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
>>> from feta_release import verify_release
>>> admin = Ed25519PrivateKey.generate().public_key()
>>> with tempfile.TemporaryDirectory() as release_dir:
...     result = verify_release(release_dir, {"st-mary": admin})
>>> result.ok
False
>>> print(result.reason())  # doctest: +ELLIPSIS
manifest: .../manifest.json: cannot read the manifest: missing or unreadable; ...
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module (under feta_release) that defines it; imported on first access (module __getattr__)
_EXPORTS = {
    "FetaError": "errors",
    "ConfigError": "errors",
    "DataError": "errors",
    "PrivacyError": "errors",
    "BudgetExceededError": "errors",
    "PolicyError": "errors",
    "ReleaseError": "errors",
    "JobConfig": "config",
    "load_job": "config",
    "load_preset": "config",
    "DataFacts": "job_rules",
    "Derivation": "job_rules",
    "derive": "job_rules",
    "derive_job": "job_rules",
    "job_toml": "job_rules",
    "PrivacyPlan": "planning",
    "Target": "planning",
    "plan": "planning",
    "stage_events": "planning",
    "PrivacyEvent": "accounting",
    "SkellamEvent": "accounting",
    "calibrate_noise_multiplier": "accounting",
    "epsilon": "accounting",
    "epsilon_breakdown": "accounting",
    "CentralRelease": "mechanisms.central",
    "central_images": "mechanisms.central",
    "combine_central": "mechanisms.central",
    "postprocess_central": "mechanisms.central",
    "FrequencyRelease": "mechanisms.frequency",  # torch
    "frequency_statistics": "mechanisms.frequency",  # torch
    "TrustRoots": "release.verify",
    "VerificationResult": "release.verify",
    "verify_release": "release.verify",
}

__all__ = [
    "__version__",
    "FetaError",
    "ConfigError",
    "DataError",
    "PrivacyError",
    "BudgetExceededError",
    "PolicyError",
    "ReleaseError",
    "JobConfig",
    "load_job",
    "load_preset",
    "DataFacts",
    "Derivation",
    "derive",
    "derive_job",
    "job_toml",
    "PrivacyPlan",
    "Target",
    "plan",
    "stage_events",
    "PrivacyEvent",
    "SkellamEvent",
    "calibrate_noise_multiplier",
    "epsilon",
    "epsilon_breakdown",
    "CentralRelease",
    "central_images",
    "combine_central",
    "postprocess_central",
    "FrequencyRelease",
    "frequency_statistics",
    "TrustRoots",
    "VerificationResult",
    "verify_release",
]

if TYPE_CHECKING:  # the real types for type checkers; at run time __getattr__ imports them on demand
    from .accounting import (
        PrivacyEvent,
        SkellamEvent,
        calibrate_noise_multiplier,
        epsilon,
        epsilon_breakdown,
    )
    from .config import JobConfig, load_job, load_preset
    from .errors import (
        BudgetExceededError,
        ConfigError,
        DataError,
        FetaError,
        PolicyError,
        PrivacyError,
        ReleaseError,
    )
    from .job_rules import DataFacts, Derivation, derive, derive_job, job_toml
    from .mechanisms.central import CentralRelease, central_images, combine_central, postprocess_central
    from .mechanisms.frequency import FrequencyRelease, frequency_statistics
    from .planning import PrivacyPlan, Target, plan, stage_events
    from .release.verify import TrustRoots, VerificationResult, verify_release


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first access, so ``import feta_release`` stays light."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    """The module's names, the ones not imported yet included."""
    return sorted(set(globals()) | set(__all__))
