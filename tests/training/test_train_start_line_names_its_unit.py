"""`train`'s first line ("planned epsilon ... at delta ...") named the unit only at a patient-level site
("planned epsilon per patient 1.000") and gave the image-level figure bare. It now names the unit beside
the figure either way, in the words every line that states a site's ε uses (``accounting.per_unit``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from feta_release.training.progress import Reporter


@pytest.mark.parametrize(("cap", "unit"), [(None, "image"), (4, "patient")])
def test_the_start_line_names_the_planned_epsilons_unit(cap: int | None, unit: str) -> None:
    from coordinator.local_run import _log_start

    console = Console(record=True, width=400)
    cfg = SimpleNamespace(
        job=SimpleNamespace(name="knee", method="feta-pro"), privacy=SimpleNamespace(delta=1e-5)
    )
    plan = SimpleNamespace(event=lambda stage: None, patient_cap=cap, epsilon=0.998, noise_multiplier=None)
    data = SimpleNamespace(n=100, n_classes=2)
    files = SimpleNamespace(ledger=Path("ledger.sqlite"))
    _log_start(Reporter(console=console), cfg, data, plan, files, False)  # type: ignore[arg-type]
    assert f"planned epsilon 0.998 per {unit} at delta 1e-05" in console.export_text(), console.export_text()
