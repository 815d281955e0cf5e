"""DP mechanisms. Each returns its released value AND the ``PrivacyEvent`` it cost.

``central`` needs only numpy; ``frequency`` uses torch (its features are differentiated by the auxiliary
generator), so it is imported lazily: importing this package does not import torch.
"""

from __future__ import annotations

from typing import Any

from .central import CentralRelease, central_images, combine_central, postprocess_central

__all__ = [
    "CentralRelease",
    "central_images",
    "combine_central",
    "postprocess_central",
    "FrequencyRelease",
    "frequency_statistics",
    "combine_frequency",
    "rff_features",
    "rff_frequencies",
]

_LAZY = {"FrequencyRelease", "frequency_statistics", "combine_frequency", "rff_features", "rff_frequencies"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import frequency

        return getattr(frequency, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
