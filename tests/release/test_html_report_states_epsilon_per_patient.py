"""The HTML report of a release from a PATIENT-level site states every ε in the site's unit, per patient (the
figure its ledger caps and its statement signs): the spend table's job and lifetime columns, each stage alone,
the budget chart and the sample grid's title. They read the statement's figures composed as if each event
protected one image, several times smaller than what one patient can lose."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("torch")  # only to BUILD the test release; the report itself needs no torch

from feta_release.accounting import PrivacyEvent, epsilon, epsilon_breakdown, patient_epsilon  # noqa: E402
from feta_release.release.onnx_export import export_denoiser  # noqa: E402
from feta_release.release.report import write_report  # noqa: E402
from tests.support.release import IMAGE_SHAPE, new_keys, patient_release, small_denoiser  # noqa: E402

DELTA, CAP = 1e-5, 4
EVENTS = [PrivacyEvent("central", 6.0, 1.0, 1), PrivacyEvent("dpsgd", 20.0, 0.05, 200, unit="patient")]
LIFE = EVENTS + EVENTS  # two jobs on the same patients


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """The report's HTML and the titles of the sample grids it drew."""
    root, keys = tmp_path_factory.mktemp("phtml"), new_keys()
    rel = patient_release(root / "rel", export_denoiser(small_denoiser(), IMAGE_SHAPE), keys, EVENTS, LIFE)
    titles: list[str] = []
    import feta_release.viz as viz

    draw = viz.labelled_grid_image

    def spy(*args: Any, **kw: Any) -> Any:
        titles.append(str(kw.get("title")))
        return draw(*args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(viz, "labelled_grid_image", spy)
        path, res = write_report(rel, root / "r.html", keys.trust(), per_class=1)
    assert res.ok, res.reason()
    return path.read_text("utf-8"), titles


def _row(html: str, section_id: str, first_cell: str) -> list[str]:
    section = html[html.index(f'id="{section_id}"') :]
    row = section[section.index(f"<td>{first_cell}</td>") :]
    return re.findall(r"<td[^>]*>(.*?)</td>", row[: row.index("</tr>")])


def test_the_spend_table_states_the_job_and_lifetime_per_patient(page: tuple[str, list[str]]) -> None:
    """Its lifetime column read 0.973 (the lifetime events per image) where one patient can lose 5.15."""
    job, life = patient_epsilon(EVENTS, DELTA, CAP), patient_epsilon(LIFE, DELTA, CAP)
    assert life > 2 * epsilon(LIFE, DELTA)
    cells = _row(page[0], "privacy-statement", "a")
    assert cells[1] == f"{job:.4g} per patient", cells
    assert cells[3] == f"{life:.4g} per patient", cells
    assert f"{epsilon(LIFE, DELTA):.4g}" not in cells


def test_each_stage_alone_and_the_budget_chart_are_per_patient(page: tuple[str, list[str]]) -> None:
    html = page[0]
    alone = epsilon_breakdown(EVENTS, DELTA, patient_cap=CAP)
    cells = _row(html, "privacy-statement", "central images")
    assert cells[-1] == f"{alone['central']:.4g}", cells
    svg = html[html.index("<svg") : html.index("</svg>") + 6]
    titles = re.findall(r"<title>(.*?)</title>", svg)
    life = patient_epsilon(LIFE, DELTA, CAP)
    assert f"total (composed), this job: ε {alone['total']:.4g}" in titles, titles
    assert f"total (composed), lifetime: ε {life:.4g}" in titles, titles
    assert "(ε per patient)" in svg


def test_the_sample_grids_title_states_epsilon_per_patient(page: tuple[str, list[str]]) -> None:
    """It read "ε per site a: 0.668 ... (unit: a patient (DP-SGD) / an image (warm-up) of one site)"."""
    per = patient_epsilon(EVENTS, DELTA, CAP)
    (title,) = page[1]
    assert f"a: {per:.3g}" in title and "per patient" in title, title
    assert f"{epsilon(EVENTS, DELTA):.3g}" not in title, title
