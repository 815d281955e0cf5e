"""``feta-release report``: one self-contained HTML page, checked as text and rendered in a REAL headless
Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")  # only to BUILD the test release; the report itself needs no torch

from feta_release.cli import cli  # noqa: E402
from feta_release.errors import ConfigError, ReleaseError  # noqa: E402
from feta_release.release.onnx_export import export_denoiser  # noqa: E402
from feta_release.release.report import SECTIONS, write_report  # noqa: E402
from tests.support.release import (  # noqa: E402
    IMAGE_SHAPE,
    load_signed,
    make_release,
    new_keys,
    signed_policy,
    small_denoiser,
)

AUDIT = {
    "kind": "feta-release/audit/1",
    "audits": [
        {
            "mechanism": "central mean",
            "claimed_epsilon": 1.0,
            "lower_bound": 0.61,
            "confidence": 0.95,
            "trials": 2000,
            "method": "Clopper-Pearson",
            "event": {"stage": "central", "sigma": 5.0, "q": 1.0, "steps": 1},
        },
        {
            "mechanism": "broken central mean",
            "claimed_epsilon": 1.0,
            "lower_bound": 2.5,
            "confidence": 0.95,
            "trials": 2000,
            "method": "Clopper-Pearson",
        },
    ],
}
EVALUATION = {
    "accuracy": 0.8123,
    "fd": 12.5,
    "fd_name": "FD (classifier features)",
    "chance_accuracy": 0.1,
    "n_synthetic": 600,
    "n_real": 500,
    "n_fd": 500,
    "classifier_epochs": 5,
    "feature_net_epochs": 3,
    "synthetic_fingerprint": "ab" * 32,
}


@pytest.fixture(scope="module")
def keys():
    return new_keys()


@pytest.fixture(scope="module")
def release(tmp_path_factory, keys):
    root = tmp_path_factory.mktemp("report")
    return make_release(
        root / "release", export_denoiser(small_denoiser(), IMAGE_SHAPE), keys, policy=signed_policy(keys)
    )


@pytest.fixture(scope="module")
def page(release, keys, tmp_path_factory):
    out = tmp_path_factory.mktemp("page") / "report.html"
    path, res = write_report(release, out, keys.trust(), evaluation=EVALUATION, audit=AUDIT, per_class=4)
    assert res.ok, res.reason()
    return path


class _Collect(HTMLParser):
    """Headings, every URL-bearing attribute, and whether scripts appear."""

    def __init__(self) -> None:
        super().__init__()
        self.h2: list[str] = []
        self.urls: list[tuple[str, str, str]] = []
        self.tags: list[str] = []
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):  # type: ignore[no-untyped-def]
        self.tags.append(tag)
        self._in_h2 = tag == "h2"
        for k, v in attrs:
            if k in ("src", "href", "srcset", "action", "data", "poster", "xlink:href") and v:
                self.urls.append((tag, k, v))

    def handle_endtag(self, tag):  # type: ignore[no-untyped-def]
        self._in_h2 = False if tag == "h2" else self._in_h2

    def handle_data(self, data):  # type: ignore[no-untyped-def]
        if self._in_h2:
            self.h2.append(data.strip())


def _parse(html: str) -> _Collect:
    p = _Collect()
    p.feed(html)
    return p


def test_page_has_every_section_inline_figures_and_nothing_external(page):
    html = page.read_text("utf-8")
    p = _parse(html)
    assert p.h2 == list(SECTIONS)
    assert "script" not in p.tags and "iframe" not in p.tags
    assert all(v.startswith("data:image/png;base64,") for _, _, v in p.urls), p.urls  # only the inline grid
    assert sum(1 for t, k, _ in p.urls if t == "img") == 1
    assert "<svg" in html and "privacy budget chart" in html
    assert "default-src 'none'" in html  # the CSP forbids any fetch even if a URL slipped in
    assert "Release VERIFIED" in html


def test_page_states_privacy_per_site_caps_mechanisms_utility_and_audit(page, release):
    html = page.read_text("utf-8")
    site = load_signed(release)["manifest"]["sites"][0]
    assert f"{float(site['epsilon']):.4g}" in html and "1e-05" in html
    assert "add or remove one image of one site" in html
    # per-job and lifetime caps of the policy
    assert "ε ≤ 5, δ ≤ 1e-05" in html and "ε ≤ 20, δ ≤ 1e-05" in html
    for word in (
        "central images",
        "frequency features",
        "DP-SGD fine-tuning",
        "L2 sensitivity",
        "clipped to L2 norm",
    ):
        assert word in html
    assert "0.8123" in html and "FD (classifier features)" in html
    assert "CLAIM VIOLATED" in html and "consistent" in html and "LOWER bound" in html
    assert "σ = 5, q = 1, 1 step(s); the σ of this release" in html  # tests.support.release's central σ is 5
    for name in ("manifest.json", "generator.onnx", "policies/a.signed.json"):
        assert f"<code>{name}</code>" in html
    # no other local paths
    assert str(release.parent) not in html.replace(str(release / "generator.onnx"), "")


def test_refused_release_says_so_first_and_draws_no_samples(release, keys, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    data = bytearray((bad / "generator.onnx").read_bytes())
    data[-1] ^= 1
    (bad / "generator.onnx").write_bytes(bytes(data))
    path, res = write_report(bad, tmp_path / "r.html", keys.trust())
    html = path.read_text("utf-8")
    assert not res.ok
    assert html.index("Release REFUSED") < html.index("<h2>")
    assert "data:image/png" not in html and "nothing is drawn from an unverified generator" in html
    assert _parse(html).h2 == list(SECTIONS)


def test_cli_report_writes_the_page_and_fails_on_a_refused_release(release, keys, tmp_path):
    coord_pub, site_pub, admin_pub = keys.pub_files(tmp_path / "keys")
    (tmp_path / "audit.json").write_text(json.dumps(AUDIT))
    out = tmp_path / "r.html"
    args = [
        "report",
        str(release),
        "--out",
        str(out),
        "--audit",
        str(tmp_path / "audit.json"),
        "--per-class",
        "2",
    ]
    r = CliRunner().invoke(cli, args + ["--trusted", f"a={admin_pub}", "--coordinator", coord_pub])
    assert r.exit_code == 0, r.output
    assert "VERIFIED" in r.output and out.is_file()
    assert "site a administrator" in out.read_text("utf-8") and "coordinator " in out.read_text("utf-8")
    # Role-bound: the coordinator's (or the site's own) key in the administrator's role does not verify.
    for wrong in (coord_pub, site_pub):
        r = CliRunner().invoke(cli, args + ["--trusted", f"a={wrong}"])
        assert isinstance(r.exception, ReleaseError) and "did not verify" in str(r.exception)
        assert "Release REFUSED" in out.read_text("utf-8")
    r = CliRunner().invoke(cli, args + ["--trusted", admin_pub])  # a key with no role: one clear line
    assert isinstance(r.exception, ConfigError) and "SITE_ID=ADMIN_KEY.pub" in str(r.exception)
    (tmp_path / "audit.json").write_text("[1, 2]")
    r = CliRunner().invoke(cli, args + ["--trusted", f"a={admin_pub}"])
    assert "must be a JSON object" in str(r.exception)


def test_flat_key_list_is_refused_not_trusted_for_every_role(release, keys, tmp_path):
    path, res = write_report(release, tmp_path / "r.html", keys.public())
    assert not res.ok and "Release REFUSED" in path.read_text("utf-8")
    assert "bound to roles" in res.reason()


def test_lifetime_spend_is_shown_beside_the_jobs(keys, tmp_path):
    """A site that spent on the same images in an earlier job: the page shows both figures."""
    from feta_release.accounting import PrivacyEvent
    from feta_release.policy.document import SitePolicy
    from feta_release.release.manifest import build_attestation
    from feta_release.signing import canonical_json, sha256_hex
    from tests.support.release import EVENTS, assemble, signed_job

    job, pol = signed_job(keys.coordinator, "job-life", ["a"]), signed_policy(keys, "a")
    att = build_attestation(
        "a",
        "job-life",
        EVENTS,
        1e-5,
        "rdp",
        SitePolicy.from_document(pol["policy"], None).digest,
        keys.site,
        job_sha256=sha256_hex(canonical_json(job["job"])),
        lifetime_events=[PrivacyEvent("dpsgd", 1.2, 0.05, 300)] + EVENTS,
        lifetime_delta=1e-5,
    )
    rel = assemble(
        tmp_path / "r",
        export_denoiser(small_denoiser(), IMAGE_SHAPE),
        keys.coordinator,
        job,
        [att],
        {"a": pol},
    )
    path, res = write_report(rel, tmp_path / "r.html", keys.trust(), per_class=1)
    assert res.ok, res.reason()
    html = path.read_text("utf-8")
    job_eps, life = att["statement"]["epsilon"], att["statement"]["lifetime"]["epsilon"]
    assert life > job_eps
    section = html[html.index('id="privacy-statement"') :]
    row = section[section.index("<td>a</td>") :]
    row = row[: row.index("</tr>")]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells[1] == f"{job_eps:.4g}" and cells[3] == f"{life:.4g}"  # this job's ε, then the lifetime ε
    assert "ε lifetime (all jobs)" in html and "the site&#x27;s ledger" in html
    assert "this release attests this job's spend only" not in html  # the old, now false, sentence
    # The budget chart draws the lifetime beside the job, per stage and in total, with the signed lifetime
    # cap.
    from feta_release.accounting import epsilon_breakdown

    svg = html[html.index("<svg") : html.index("</svg>") + 6]
    titles = re.findall(r"<title>(.*?)</title>", svg)
    life_dpsgd = epsilon_breakdown([PrivacyEvent("dpsgd", 1.2, 0.05, 300)] + EVENTS, 1e-5)["dpsgd"]
    assert f"DP-SGD, lifetime: ε {life_dpsgd:.4g}" in titles
    assert (
        f"total (composed), lifetime: ε {life:.4g}" in titles
        and f"total (composed), this job: ε {job_eps:.4g}" in titles
    )
    assert "lifetime cap 20" in svg and "per-job cap 5" in svg


def test_page_shows_no_exact_count_and_no_plain_data_hash(page, release):
    """Only the public nominal size and a keyed commitment ever leave a site; the page shows neither more nor
    the commitment (a DPO has no use for it), and states the sensitivity in terms of the public size."""
    html = page.read_text("utf-8")
    pol = json.loads((release / "policies" / "a.signed.json").read_text())["policy"]
    ds = pol["dataset"]
    for v in ds.values():
        if isinstance(v, str) and len(v) >= 16:
            assert v not in html, "a dataset commitment/hash appears in the report"
    assert "fingerprint" not in json.dumps(ds)  # the policy itself carries no plain fingerprint any more
    assert "public nominal size" in html and "never the exact count" in html


# -- a real browser
# ---------------------------------------------------------------------------------------------

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
NO_BROWSER = (
    "Chromium is not installed here (apt-get install -y chromium; .ci/run installs it): "
    "the report cannot be rendered in a real browser"
)


def _chromium(url: str, tmp: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run headless Chromium on ``url``; returns (process, URLs the PAGE asked for, from Chromium's net
    log)."""
    log = tmp / f"net-{len(list(tmp.glob('net-*')))}.json"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        f"--user-data-dir={tmp / 'profile'}",
        f"--log-net-log={log}",
        *extra,
        url,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    doc = json.loads(log.read_text("utf-8"))
    start = doc["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    # Chromium's own background fetches carry no initiator ("not an origin"); the page's requests do.
    asked = [
        e["params"]["url"]
        for e in doc["events"]
        if e["type"] == start and e.get("params", {}).get("initiator", "not an origin") != "not an origin"
    ]
    return proc, [u for u in asked if not u.startswith(("data:", "file:"))]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason=NO_BROWSER)
def test_chromium_renders_every_section_and_makes_no_request(page, tmp_path):
    from PIL import Image

    proc, asked = _chromium(page.as_uri(), tmp_path, "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = _parse(proc.stdout)
    assert dom.h2 == list(SECTIONS)  # the rendered DOM, after the browser parsed the page
    assert "privacy budget chart" in proc.stdout and "data:image/png;base64," in proc.stdout
    assert asked == []

    shot = tmp_path / "shot.png"
    proc, asked = _chromium(page.as_uri(), tmp_path, "--window-size=1000,2400", f"--screenshot={shot}")
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    assert asked == []
    with Image.open(shot) as im:
        grey = im.convert("L")
        lo, hi = grey.getextrema()
        dark = sum(grey.histogram()[:100]) / (grey.width * grey.height)
    assert hi - lo > 200 and 0.005 < dark < 0.5, "the screenshot is blank or all dark"


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason=NO_BROWSER)
def test_request_detector_has_power(tmp_path):
    """The same check sees a page that does fetch something (else `asked == []` above would prove nothing)."""
    leaky = tmp_path / "leaky.html"
    leaky.write_text('<html><body><h2>x</h2><img src="http://127.0.0.1:9/leak.png"></body></html>')
    _, asked = _chromium(leaky.as_uri(), tmp_path, "--dump-dom")
    assert asked == ["http://127.0.0.1:9/leak.png"]


def test_missing_release_still_gets_a_page_that_says_why(keys, tmp_path):
    path, res = write_report(tmp_path / "nothing-here", tmp_path / "r.html", keys.trust())
    html = path.read_text("utf-8")
    assert not res.ok and "Release REFUSED" in html and "cannot read" in html
    assert html.count("No readable manifest") == 4 and "cannot be shown" not in html
    assert _parse(html).h2 == list(SECTIONS)


def test_caps_shown_are_the_verified_policys_even_if_the_file_changes_after_verify(release, keys, tmp_path):
    """The report re-read the site's policy file after verify, so a file swapped in between (no
    signature checked) set the caps the page shows. The page must show the policy verify checked."""
    import json
    import shutil

    from feta_release.release.report import render_report
    from feta_release.release.verify import verify_release

    rd = tmp_path / "release"
    shutil.copytree(release, rd)
    res = verify_release(rd, keys.trust())
    assert res.ok, res.reason()
    files = list((rd / "policies").glob("*.json"))
    assert files
    for p in files:
        doc = json.loads(p.read_text("utf-8"))
        doc["policy"]["budget"]["per_job"]["epsilon"] = 777.0  # unsigned edit after verify
        p.write_text(json.dumps(doc), "utf-8")
    html = render_report(rd, res, per_class=1)
    assert "ε ≤ 777" not in html
    assert "ε ≤ 5, δ ≤ 1e-05" in html  # the signed per-job cap (tests/support/release.signed_policy)
