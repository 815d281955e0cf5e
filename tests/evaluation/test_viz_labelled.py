"""Labelled sample grids (class names, a title with ε) and the SVG privacy budget chart (budget.svg)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from PIL import Image

from feta_release.viz import budget_svg, epsilon_title, grid_array, labelled_grid_image, save_grid


def _imgs(n_classes: int = 3, per: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.random((n_classes * per, 1, 8, 8)), np.repeat(np.arange(n_classes), per)


def test_labelled_grid_adds_title_band_and_label_column():
    imgs, labs = _imgs()
    bare = grid_array(imgs, labs, per_class=4, scale=2)
    img = labelled_grid_image(
        imgs,
        labs,
        class_names=["zero", "one", "a-much-longer-name"],
        per_class=4,
        title=epsilon_title("samples", 1.0, 1e-5),
    )
    arr = np.asarray(img)
    assert arr.shape[0] > bare.shape[0] and arr.shape[1] > bare.shape[1]
    # The images themselves are unchanged, at the bottom, right of the label column (the title may be wider).
    grid_rows = arr[-bare.shape[0] :]
    offsets = [
        x
        for x in range(arr.shape[1] - bare.shape[1] + 1)
        if np.array_equal(grid_rows[:, x : x + bare.shape[1]], bare)
    ]
    assert len(offsets) == 1 and offsets[0] > 0, offsets
    left = offsets[0]
    top_band = arr[: arr.shape[0] - bare.shape[0]]
    left_col = grid_rows[:, :left]
    assert (top_band < 128).any(), "title text drawn"
    assert (left_col < 128).any(), "class names drawn"
    untitled = np.asarray(labelled_grid_image(imgs, labs, per_class=4, class_names=["a", "b", "c"]))
    assert untitled.shape[0] == bare.shape[0], "no title band without a title"


def test_save_grid_with_names_writes_png(tmp_path):
    imgs, labs = _imgs()
    p = save_grid(imgs, labs, tmp_path / "g.png", per_class=4, class_names=["a", "b", "c"], title="t")
    with Image.open(p) as im:
        assert im.mode == "RGB"


@pytest.mark.parametrize(
    "eps,expect",
    [(1.234, "ε = 1.23"), ({"b": 0.5, "a": 2.0}, "a: 2, b: 0.5"), (None, "no privacy budget spent")],
)
def test_epsilon_title(eps, expect):
    assert expect in epsilon_title("samples", eps, 1e-5)


def test_budget_svg_is_valid_xml_with_every_site_stage_and_cap():
    svg = budget_svg(
        {
            "a": {"by_stage": {"central": 0.4, "dpsgd": 0.8, "total": 1.0}, "cap": 2.0},
            "b<x>": {"by_stage": {"frequency": 0.1, "total": 0.1}},
        }
    )
    root = ET.fromstring(svg)
    text = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for word in (
        "site a",
        "site b<x>",
        "central images",
        "DP-SGD",
        "frequency statistics",
        "per-job cap 2",
        "0.8",
    ):
        assert word in text
    widths = {r.get("fill"): float(r.get("width")) for r in root.iter("{http://www.w3.org/2000/svg}rect")}
    assert widths["#27306e"] > 0  # the totals are drawn


def _bars(svg: str) -> dict[str, float]:
    """rect title ('<stage label>, <this job|lifetime>: ε v') -> drawn width."""
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    return {r.find(f"{ns}title").text: float(r.get("width")) for r in root.iter(f"{ns}rect")}


def test_budget_svg_draws_the_lifetime_beside_the_job_per_stage():
    svg = budget_svg(
        {
            "a": {
                "by_stage": {"central": 0.4, "dpsgd": 0.8, "total": 1.0},
                "cap": 2.0,
                "lifetime_cap": 6.0,
                "lifetime_by_stage": {"central": 0.4, "dpsgd": 2.5, "frequency": 0.3, "total": 3.1},
            }
        }
    )
    bars = _bars(svg)
    assert bars["DP-SGD, lifetime: ε 2.5"] > bars["DP-SGD, this job: ε 0.8"] > 0
    assert bars["total (composed), lifetime: ε 3.1"] > bars["total (composed), this job: ε 1"]
    # A stage spent on only in an earlier job still gets its row: 0 for this job, its lifetime figure beside.
    assert "frequency statistics, this job: ε 0" in bars and "frequency statistics, lifetime: ε 0.3" in bars
    assert bars["central images, lifetime: ε 0.4"] == bars["central images, this job: ε 0.4"]
    text = " ".join(t.text or "" for t in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text"))
    assert "lifetime cap 6" in text and "per-job cap 2" in text
    # Scale: the longest bar (lifetime total 3.1) and the lifetime cap (6) both fit the drawing.
    assert max(bars.values()) < 720


def test_budget_svg_without_a_lifetime_draws_no_lifetime_bar():
    bars = _bars(budget_svg({"a": {"by_stage": {"dpsgd": 0.8, "total": 0.8}}}))
    assert set(bars) == {"DP-SGD, this job: ε 0.8", "total (composed), this job: ε 0.8"}


def test_federated_privacy_report_writes_budget_svg_with_the_signed_cap(tmp_path):
    import json

    from coordinator.finalize import privacy_report

    events = [
        {"stage": "central", "sigma": 20.0, "q": 1.0, "steps": 1},
        {"stage": "dpsgd", "sigma": 1.2, "q": 0.01, "steps": 200},
    ]
    (tmp_path / "job_summary.json").write_text(
        json.dumps({"job_id": "j1", "rounds": 2, "skipped": {}, "timings": {}, "class_names": ["0", "1"]})
    )
    atts = {
        sid: {
            "statement": {
                "events": events,
                "epsilon": 0.9,
                "delta": 1e-5,
                "accountant": "rdp",
                "policy_sha256": "0" * 64,
            },
            "signature": {"signer": f"{sid}-key"},
        }
        for sid in ("site-a", "site-b")
    }
    (tmp_path / "attestations.json").write_text(json.dumps(atts))
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "site-a.signed.json").write_text(
        json.dumps({"policy": {"budget": {"per_job": {"epsilon": 1.5, "delta": 1e-5}}}})
    )
    privacy_report(tmp_path)
    root = ET.fromstring((tmp_path / "budget.svg").read_text("utf-8"))
    text = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "site site-a" in text and "site site-b" in text and "per-job cap 1.5" in text
    assert len(re.findall(r"per-job cap \d", text)) == 1  # site-b's policy is absent here: no invented cap

    # With a lifetime in the attestations, the chart draws it beside the job, with the lifetime cap.
    life_events = events + [{"stage": "dpsgd", "sigma": 1.0, "q": 0.02, "steps": 400}]
    for sid in atts:
        atts[sid]["statement"]["lifetime"] = {"events": life_events, "epsilon": 2.0, "delta": 1e-5}
    (tmp_path / "attestations.json").write_text(json.dumps(atts))
    (tmp_path / "policies" / "site-a.signed.json").write_text(
        json.dumps(
            {
                "policy": {
                    "budget": {
                        "per_job": {"epsilon": 1.5, "delta": 1e-5},
                        "lifetime": {"epsilon": 8.0, "delta": 1e-5},
                    }
                }
            }
        )
    )
    report = privacy_report(tmp_path)
    bars = _bars((tmp_path / "budget.svg").read_text("utf-8"))
    life_total = report["sites"]["site-a"]["lifetime"]["epsilon_by_stage_alone"]["total"]
    assert (
        bars[f"total (composed), lifetime: ε {life_total:.4g}"]
        > bars[
            "total (composed), this job: ε "
            f"{report['sites']['site-a']['epsilon_by_stage_alone']['total']:.4g}"
        ]
    )
    assert "lifetime cap 8" in (tmp_path / "budget.svg").read_text("utf-8")
    assert "lifetime on the same images (all jobs)" in (tmp_path / "privacy_report.txt").read_text("utf-8")


def test_the_privacy_report_states_the_worst_case_epsilon_of_a_secure_job(tmp_path):
    """A secure-aggregation job's ε rests on the site's trust assumption; the report a DPO reads says so and
    gives the figure the site signed for the case where every other site colludes with the coordinator."""
    import json

    from coordinator.finalize import privacy_report

    events = [{"stage": "dpsgd", "sigma": 1.2, "q": 0.01, "steps": 200}]
    (tmp_path / "job_summary.json").write_text(
        json.dumps({"job_id": "j2", "rounds": 1, "skipped": {}, "timings": {}})
    )
    sa = {"max_colluders": 0, "worst_case_epsilon": 1.2806, "lifetime_worst_case_epsilon": 1.2806}
    atts = {
        "site-a": {
            "statement": {
                "events": events,
                "epsilon": 0.99,
                "delta": 1e-5,
                "accountant": "rdp",
                "policy_sha256": "0" * 64,
                "secure_aggregation": sa,
            },
            "signature": {"signer": "k"},
        },
        "site-b": {
            "statement": {
                "events": events,
                "epsilon": 0.99,
                "delta": 1e-5,
                "accountant": "rdp",
                "policy_sha256": "0" * 64,
            },
            "signature": {"signer": "k"},
        },
    }
    (tmp_path / "attestations.json").write_text(json.dumps(atts))
    report = privacy_report(tmp_path)
    assert report["sites"]["site-a"]["secure_aggregation"]["worst_case_epsilon"] == 1.2806
    assert "secure_aggregation" not in report["sites"]["site-b"]
    text = (tmp_path / "privacy_report.txt").read_text("utf-8")
    assert text.count("if every other site colluded") == 1 and "ε per image = 1.281" in text
    assert "at most 0 other site(s) collude with the coordinator" in text
