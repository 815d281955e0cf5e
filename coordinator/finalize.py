"""After a federated job: sample grid, privacy report, and the signed release (ONNX generator + manifest).

The code is the job directory's (``feta_release.release.jobdir``): a single-site ``train`` run writes the same
layout with the same functions, so both drivers' releases are one format.
"""

from __future__ import annotations

from feta_release.release.jobdir import build_release, load_model, privacy_report, sample_grid

__all__ = ["build_release", "load_model", "privacy_report", "sample_grid"]
