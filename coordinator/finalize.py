"""After a federated job: sample grid, privacy report, and the signed release (ONNX generator + manifest).

The code is the job directory's (``feta_release.release.jobdir``): a ``train`` run (a federation of one) is
finished by the same functions, so every release is one format.
"""

from __future__ import annotations

from feta_release.progress_events import job_log
from feta_release.release.jobdir import build_release, load_model, privacy_report, sample_grid

__all__ = ["build_release", "job_log", "load_model", "privacy_report", "sample_grid"]
