"""A federation whose site "site-c" holds patients (a ``path,label,patient_id`` CSV) and a patient-level
policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from coordinator.setup import prepare_federation
from tests.support.federation import tiny_sites

PATIENT_SITE = "site-c"
CAP = 4


def patient_sizes(n: int, seed: int) -> list[int]:
    """Images per patient summing to ``n``: 1 to 8 each (many-image patients included)."""
    rng, out = np.random.default_rng(seed), []
    while sum(out) < n:
        out.append(int(min(rng.integers(1, 9), n - sum(out))))
    return out


def write_patient_csv(ds: Any, folder: Path, sizes: list[int]) -> Path:
    """The dataset as PNG files and a ``path,label,patient_id`` CSV (patient ids as a hospital would write
    them)."""
    folder.mkdir(parents=True)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    lines = ["path,label,patient_id"]
    for i, (img, lab) in enumerate(zip(ds.images, ds.labels)):
        Image.fromarray(np.round(img[0] * 255).astype(np.uint8)).save(folder / f"{i}.png")
        lines.append(f"{i}.png,{ds.class_names[int(lab)]},MRN-{1000 + int(owner[i])}")
    (folder / "labels.csv").write_text("\n".join(lines) + "\n")
    return folder / "labels.csv"


def noise_patient_csv(folder: Path, patients: int, scans: int) -> Path:
    """``patients`` patients with ``scans`` 28x28 noise scans each (labels ``a`` / ``b`` by patient) as PNG
    files in ``folder`` and a ``path,label,patient_id`` CSV beside them."""
    rng, rows = np.random.default_rng(0), ["path,label,patient_id"]
    for p in range(patients):
        for j in range(scans):
            Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(folder / f"p{p}_{j}.png")
            rows.append(f"p{p}_{j}.png,{'ab'[p % 2]},pat{p}")
    (folder / "labels.csv").write_text("\n".join(rows) + "\n")
    return folder / "labels.csv"


def patient_federation(tmp: Path, public_patients: int | None = None, **budget: Any) -> tuple[Any, int]:
    """``budget``: the patient site's ``per_job`` / ``lifetime`` (make_policy's), when the job needs more than
    1 per patient (a warm-up per image counts up to CAP times per patient)."""
    sites: dict[str, Any] = tiny_sites()
    sizes = patient_sizes(sites[PATIENT_SITE].n, seed=3)
    sites[PATIENT_SITE] = write_patient_csv(sites[PATIENT_SITE], tmp / "csv", sizes)
    p = public_patients or len(sizes)
    over = {PATIENT_SITE: {"patient_level": (p, CAP), **budget}}
    return prepare_federation(tmp / "fed", sites, policy_overrides=over), p
