"""The release report tells a data-protection officer, on its first screen, what the release it describes
relies on: the verdict, each site's ε under the trust assumption its signed policy states, the worst case if
the coordinator colludes with every other site, every figure beside its signed cap, and what is not
guaranteed."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")  # only to BUILD the test release; the report itself needs no torch

from feta_release.release.onnx_export import export_denoiser  # noqa: E402
from feta_release.release.report import render_report  # noqa: E402
from feta_release.release.verify import verify_release  # noqa: E402
from tests.support.release import IMAGE_SHAPE, make_release, secure_release, small_denoiser  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py


@pytest.fixture(scope="module")
def secure_page(tmp_path_factory) -> tuple[str, object]:
    root = tmp_path_factory.mktemp("secure")
    keys = secure_release(root / "release", export_denoiser(small_denoiser(), IMAGE_SHAPE))
    res = verify_release(root / "release", {s: k.policy.public_key() for s, k in keys.items()})
    assert res.ok, res.reason()
    return render_report(root / "release", res, per_class=1), res


def _section(html: str, slug: str) -> str:
    m = re.search(rf'<section id="{slug}">(.*?)</section>', html, re.S)
    assert m, slug
    return m.group(1)


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_threat_model_says_the_coordinator_is_trusted_not_to_collude_when_secure_aggregation_was_used(
    secure_page,
):
    html, _ = secure_page
    threat = _text(_section(html, "threat-model"))
    assert "no secure aggregation is used or needed" not in threat
    assert "TRUSTED NOT TO COLLUDE" in threat and "secure aggregation was used" in threat
    assert "max_colluders" in threat and "1.46 (cap 3)" in threat


def test_threat_model_says_the_coordinator_is_not_trusted_without_secure_aggregation(
    tmp_path, keys, den_onnx
):
    rel = make_release(tmp_path / "release", den_onnx, keys)
    res = verify_release(rel, keys.trust())
    threat = _text(_section(render_report(rel, res, per_class=1), "threat-model"))
    assert "NOT trusted with privacy: no secure aggregation was used" in threat
    assert "TRUSTED NOT TO COLLUDE" not in threat


def test_first_screen_gives_verdict_assumption_both_epsilons_and_every_cap_before_the_detail(secure_page):
    html, res = secure_page
    first = html.index("<h2>")
    assert "Release VERIFIED" in html[:first]
    glance = _text(_section(html, "at-a-glance"))
    assert (
        html.index('id="at-a-glance"')
        < html.index('id="what-was-released"')
        < html.index('id="privacy-statement"')
    )
    for site in ("st-mary", "st-luke"):
        assert site in glance
    # the job ε under the assumption, the worst case, lifetime and lifetime worst case, each with its signed
    # cap
    assert glance.count("1.07 (cap 2)") == 2 and glance.count("1.07 (cap 8)") == 2
    assert glance.count("1.46 (cap 3)") == 2 and glance.count("1.46 (cap 24)") == 2
    assert "holds if no other site colludes with the coordinator" in glance
    assert "Secure aggregation" in glance and "Not guaranteed" in glance


def test_limitations_name_float_noise_coordinator_trust_audit_and_non_dp_utility(secure_page):
    lim = _text(_section(secure_page[0], "limitations"))
    for words in (
        "Floating-point noise",
        "trusted not to collude",
        "What the audit cannot show",
        "NOT differentially private",
    ):
        assert words in lim, words


def test_secure_aggregation_noise_is_stated_as_sigma_of_the_sites_own_share(secure_page):
    html = secure_page[0]
    assert "secure sum (Skellam share)" not in html
    privacy = _text(_section(html, "privacy-statement"))
    own = 3e4**0.5 / 40.0  # sqrt(mu_worst) / l2 of tests/support/release.secure_events
    assert (
        f"{own:.4g} own share" in privacy
        and f"{(2 * 3e4) ** 0.5 / 40.0:.4g} with the honest sites' shares" in privacy
    )


def test_the_trust_assumption_is_a_note_never_a_pass(secure_page):
    _, res = secure_page
    notes = [c for c in res.checks if "colludes" in c.detail and c.status != "fail"]
    assert notes and all(c.status == "note" for c in notes)
    assert res.ok
