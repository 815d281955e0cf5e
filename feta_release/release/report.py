"""``feta-release report``: one self-contained HTML page a data-protection officer reads and prints.

Everything is inline (CSS, the SVG budget chart, the sample grid as a PNG data URI); there is no script, no
font, no stylesheet and no image fetched from anywhere, so the file opens offline and prints to PDF as is.

Every figure in it comes from the release itself, after ``verify_release`` checked it: the per-site (ε, δ) are
the sites' own signed statements re-composed from their events, the caps come from the signed policies, and
the sample grid is drawn by the very generator bytes that were hashed. A release that does not verify still
gets a report (the DPO needs to see why it failed), but no samples are drawn from an unverified generator and
the page says, in its first line, that the release is REFUSED.

Imports neither torch nor flwr: it runs on a verifier's light install (numpy, Pillow, onnxruntime).
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from ..accounting import epsilon_breakdown, events_from_list, unit_name
from ..errors import ReleaseError
from ..files import hash_regular
from ..privacy_unit import figures_in_unit, lifetime_in_unit, statement_patient_cap
from .manifest import MANIFEST_FILE, patient_figures, patient_words
from .summary import SiteSummary, site_summaries, trust_assumption, verdict_line
from .verify import (
    STAGE_WORDS,
    TrustRoots,
    VerificationResult,
    describe_site,
    merged_events,
    public_words,
    verify_release,
)

# The headings, in order; the browser test checks that each is in the rendered page.
SECTIONS = (
    "At a glance",
    "What was released",
    "Privacy statement",
    "Threat model",
    "Limitations",
    "Verification checklist",
    "Sample images",
    "Privacy budget",
    "Utility",
    "Empirical privacy audit",
    "Files and hashes",
)

CSS = """
body{font-family:Helvetica,Arial,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#1d2230;line-height:1.45}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{border-bottom:2px solid #27306e;padding-bottom:.2rem;margin-top:2rem}
table{border-collapse:collapse;width:100%;margin:.6rem 0;font-size:.92rem}
th,td{border:1px solid #c9cfdc;padding:.3rem .5rem;text-align:left;vertical-align:top}th{background:#eef1f7}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}code,.hash{font-family:monospace;font-size:.85rem;word-break:break-all}
.banner{padding:.7rem 1rem;border-radius:4px;font-weight:bold;margin:1rem 0}
.ok{background:#e3f4e5;border:1px solid #2e7d32;color:#1b5e20}.bad{background:#fde8e8;border:1px solid #c62828;color:#8e0000}
.pass{color:#1b5e20;font-weight:bold}.fail{color:#8e0000;font-weight:bold}.warn{color:#8a5a00;font-weight:bold}
.note{color:#4a5163;font-size:.9rem}figure{margin:1rem 0}figcaption{font-size:.9rem;color:#4a5163}
img.grid{image-rendering:pixelated;max-width:100%;border:1px solid #c9cfdc}
@media print{body{margin:0;max-width:none}h2{break-after:avoid}figure,table{break-inside:avoid}}
"""  # noqa: E501


def _h(text: Any) -> str:
    return escape(str(text), quote=True)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> str:
    """An HTML table; cells are already-escaped HTML."""
    th = "".join(f"<th>{_h(c)}</th>" for c in head)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _signed_policy(rd: Path, sid: str, res: VerificationResult) -> dict[str, Any] | None:
    """The site's policy document as verify checked it (signature, attested hash), only when that check
    passed; never the file read again (a file swapped after verify would set the caps shown)."""
    if not any(c.name == f"site {sid} policy" and c.status == "pass" for c in res.checks):
        return None
    return res.policies.get(sid)


# -- sections ------------------------------------------------------------------------------------------------


def _shipped_images_row(
    what: str, record: Any, claims: dict[str, Any] | None, man: dict[str, Any], stage: str
) -> list[tuple[str, str]]:
    """The row of images the release also ships (``record``, its manifest entry): their privacy words, or that
    they did not pass verify; none when the manifest names none. A format 2/3 record (verified as signed)
    states ``stage`` per image only: the figures per patient of its patient-level sites are added, recomputed
    from their signed statements as verify does."""
    if not record:
        return []
    if not claims:
        return [(f"{what} (also released)", _h(f"the release names {what} that did NOT pass verify"))]
    words = claims["privacy"]
    if f"{stage}_epsilon_per_patient" not in claims:
        words += patient_words(
            patient_figures([s["attestation"]["statement"] for s in man["sites"]], stage), stage
        )
    return [(f"{what} (also released)", _h(words))]


def _released(man: dict[str, Any], res: VerificationResult) -> str:
    gen, job = man["generator"], man["job"]
    signer = next(
        (c.detail for c in res.checks if c.name == "manifest signature" and c.status == "pass"),
        "NOT signed by a trusted key",
    )
    rows = [
        ("job", _h(job["job_id"])),
        ("method", _h(job["config"].get("job", {}).get("method", "?"))),
        *(
            [("seen before any private image", _h(public_words(job["config"]["public"])))]
            if job["config"].get("public")
            else []
        ),
        ("created", _h(man.get("created", "?"))),
        ("sites", _h(", ".join(s["site_id"] for s in man["sites"]))),
        (
            "what is released",
            f"a generator ({_h(gen['file'])}, ONNX) that maps noise and a class label to a "
            f"synthetic image of shape {_h(' x '.join(map(str, gen['image_shape'])))}; "
            f"classes: {_h(', '.join(map(str, gen['classes'])))}",
        ),
        *_shipped_images_row("central images", man.get("starts"), res.starts_claims, man, "central"),
        *_shipped_images_row("aux-generator images", man.get("aux_starts"), res.aux_claims, man, "frequency"),
        ("released by", _h(f"the coordinator: manifest {signer}")),
        ("manifest sha256", f'<span class="hash">{_h(res.manifest_sha256)}</span>'),
        ("generator sha256", f'<span class="hash">{_h(gen["sha256"])}</span>'),
        ("software", _h(", ".join(f"{k} {v}" for k, v in sorted(man.get("software", {}).items()) if v))),
    ]
    return _table(("item", "value"), rows)


def _site_cap(site: dict[str, Any]) -> int | None:
    """The images-per-patient cap of a patient-level site's signed statement (None: an image-level site):
    every ε the page shows for such a site is PER PATIENT, the figure its ledger's caps bound."""
    return statement_patient_cap((site.get("attestation") or {}).get("statement") or {})


def _mechanism_rows(site: dict[str, Any], cfg: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per stage: what was released, its L2 sensitivity, σ, q, steps and ε of that stage alone (in
    the site's unit)."""
    alone = epsilon_breakdown(
        events_from_list(site["events"]),
        float(site["delta"]),
        site["accountant"],
        patient_cap=_site_cap(site),
    )
    c, d = cfg.get("central", {}), cfg.get("dpsgd", {})
    sens = {
        "size": "noisy count of the site's images (a run without a declared size draws its public size from "
        "it); L2 sensitivity 1 image",
        "central": (
            f"noisy per-class {c.get('kind', 'mean')} images; L2 sensitivity "
            + (
                f"C = {c.get('clip') or 'sqrt(pixels)'} (clipped image)"
                if c.get("kind", "mean") == "mean"
                else "sqrt(number of pixel values) (one histogram bin per pixel)"
            )
        ),
        "frequenc"
        "y": "noisy per-class mean of random Fourier features; L2 sensitivity 1/N (N the site's public "
        "nominal size fixed by its signed policy, never the exact count; every feature vector has "
        "norm 1)",
        "selection": "noisy histogram of the public groups the site's images are nearest to (which public "
        "images pretraining uses); L2 sensitivity 1 image (2^10 integer units when summed by secure "
        "aggregation)",
        "dpsgd": f"DP-SGD model updates; per-example gradients clipped to L2 norm C = {d.get('clip', '?')} "
        "(the sensitivity), Poisson-sampled batches",
    }
    rows: list[tuple[str, ...]] = []
    for e in merged_events(site["events"]):
        if e["steps"] == 0:
            continue
        rows.append(
            (
                _h(STAGE_WORDS.get(e["stage"], e["stage"])),
                _h(sens.get(e["stage"], "see the job config")),
                f"{e['sigma']:.4g}" if "sigma" in e else _skellam_sigma(e),
                f"{e['q']:.4g}",
                str(e["steps"]),
                f"{alone.get(e['stage'], math.nan):.4g}",
            )
        )
    return rows


def _skellam_sigma(e: dict[str, Any]) -> str:
    """A secure-aggregation release's noise as σ (noise std / L2 sensitivity): the site's own Skellam share
    (what holds if every other site colludes) and all the shares its trust assumption counts."""
    own = math.sqrt(float(e.get("mu_worst") or e["mu"])) / float(e["l2"])
    counted = math.sqrt(float(e["mu"])) / float(e["l2"])
    return (
        f"{own:.4g} own share; {counted:.4g} with the honest sites' shares (Skellam noise, summed by secure "
        "aggregation)"
    )


def _spend_row(rd: Path, s: dict[str, Any], res: VerificationResult) -> tuple[str, ...]:
    """This job's (ε, δ) beside the site's signed LIFETIME spend on the same images, and both caps, every ε
    in the site's unit: per patient at a patient-level site (``privacy_unit.lifetime_in_unit``, the figures
    its caps bound), whose statement's own figures compose the events as if each protected one image."""
    pol = _signed_policy(rd, s["site_id"], res)
    cap_life = pol["budget"]["lifetime"] if pol else None
    cap_job = pol["budget"]["per_job"] if pol else None
    st = (s.get("attestation") or {}).get("statement") or {}
    life = lifetime_in_unit(st)
    per = " per patient" if _site_cap(s) is not None else ""
    job = float(st["privacy_unit"]["epsilon_per_patient"]) if per else float(s["epsilon"])
    source = str(st.get("history", "?"))
    unchecked = "not checked (no verified policy)"
    return (
        _h(s["site_id"]),
        f"{job:.4g}{per}",
        f"{float(s['delta']):g}",
        f"{life['epsilon']:.4g}{per}" if life else "not stated",
        f"{life['delta']:g}" if life else "not stated",
        _h(s["accountant"].upper()),
        _h(f"ε ≤ {cap_job['epsilon']:g}, δ ≤ {cap_job['delta']:g}") if cap_job else unchecked,
        _h(f"ε ≤ {cap_life['epsilon']:g}, δ ≤ {cap_life['delta']:g}") if cap_life else unchecked,
        _h(
            "the site's ledger"
            if source == "site-ledger"
            else "the run directory (unsigned while training: weaker)"
            if source == "run-directory"
            else source
        ),
    )


def _unit_paragraph(sites: list[dict[str, Any]]) -> str:
    from ..privacy_unit import unit_phrase

    patient_sites = [str(s.get("site_id")) for s in sites if "patient" in unit_phrase(s.get("events", ()))]
    if patient_sites and len(patient_sites) < len(sites):  # a federation that mixes units: say it per site
        image_sites = [str(s.get("site_id")) for s in sites if str(s.get("site_id")) not in patient_sites]
        return (
            "<p><b>Unit of privacy, per site:</b> at "
            + _h(", ".join(patient_sites))
            + " one PATIENT for DP-SGD "
            "(patients are sampled and each patient's summed gradient is clipped, so the figure holds per "
            "patient without group privacy) and one image for the other stages (a patient with k images: "
            "group privacy over k); at "
            + _h(", ".join(image_sites))
            + " one image for every stage (those sites declare no "
            "patient ids: a person with k images there is protected only by group privacy, (k·ε, "
            "k·e^((k-1)ε)·δ)). <b>Neighbouring relation:</b> add or remove one patient (DP-SGD at the "
            "patient-level sites) or one image. Each site's (ε, δ) is that site's own signed statement, "
            "re-composed from its event history by verify.</p>"
        )
    if not patient_sites:
        return (
            "<p><b>Unit of privacy:</b> one image of one site. <b>Neighbouring relation:</b> add or remove "
            "one image of one site's dataset (every mechanism below is calibrated to that change). Each "
            "site's (ε, δ) is that site's own signed statement, re-composed from its event history by "
            "verify.</p>"
        )
    return (
        "<p><b>Unit of privacy:</b> for DP-SGD, one PATIENT of one site (patients are sampled and each "
        "patient's summed gradient is clipped, so the figure holds per patient without group privacy); for "
        "the other stages one image (a patient with k images: group privacy over k). <b>Neighbouring "
        "relation:</b> add or remove one patient (DP-SGD) or one image (other stages). Each site's (ε, δ) is "
        "that site's own signed statement, re-composed from its event history by verify.</p>"
    )


def _privacy(rd: Path, man: dict[str, Any], res: VerificationResult) -> str:
    cfg = man["job"]["config"]
    out = [_unit_paragraph(man["sites"])]
    rows = [_spend_row(rd, s, res) for s in man["sites"]]
    out.append(
        _table(
            (
                "site",
                "ε this job (per patient at a patient-level site)",
                "δ this job",
                "ε lifetime (all jobs)",
                "δ lifetime",
                "accountant",
                "per-job cap (signed policy)",
                "lifetime cap (signed policy)",
                "spend read from",
            ),
            rows,
            numeric=(1, 2, 3, 4),
        )
    )
    out.append(
        '<p class="note">Lifetime: each site signs, beside this job\'s spend, its spend on the same images '
        "over ALL its jobs (composed from its ledger; verify re-composes it and checks it against the "
        "lifetime cap). A model trained on an earlier job's release depends on both, so the lifetime figure "
        "is the one that bounds what these images reveal. Stage figures below are each stage alone; "
        "composition is sub-additive, the total is what counts. Every ε is in the unit the site's caps "
        "bound: per patient at a patient-level site (all of one patient's images), per image elsewhere. "
        "Under secure aggregation these are the figures under each site's trust assumption; the worst case "
        "is in At a glance.</p>"
    )
    for s in man["sites"]:
        out.append(f"<h3>Site {_h(s['site_id'])}: mechanisms</h3>")
        out.append(
            _table(
                (
                    "stage",
                    "what is released and its sensitivity",
                    "σ (noise multiplier)",
                    "q (sampling)",
                    "steps",
                    "ε of this stage alone",
                ),
                _mechanism_rows(s, cfg),
                numeric=(2, 3, 4, 5),
            )
        )
        out.append(f"<p>{_h(describe_site(s))}</p>")
    return "\n".join(out)


# Kept in line with docs/federation.md "Threat model": keys are bound to roles, and only the site
# administrators' keys are roots of trust for a verifier.
THREAT_MODEL = (
    (
        "the site administrator (policy key)",
        "the ONLY key you trust, bound to its site id: it signs the site's "
        "policy, which sets the caps (per-job and lifetime ε/δ, minimum σ, allowed mechanisms), names the "
        "site key that may sign the site's spend and the coordinator keys (by full key) the site accepts",
    ),
    (
        "the site (its node and ledger)",
        "trusted with its own images; it runs every mechanism, adds all noise "
        "locally with fresh randomness, charges its hash-chained ledger before anything leaves and signs a "
        "final spend statement (this job and lifetime) with the site key its policy names; it sends only "
        "noised values, the public nominal size from its policy (never the exact count) and a keyed "
        "commitment to its data (never a plain hash)",
    ),
    (
        "anyone with the release",
        "may do anything with the generator and its images: post-processing of a DP "
        "release cannot increase ε",
    ),
    (
        "the verifier (you)",
        "needs no trust in the coordinator: signatures, hashes, ε recomputation (job and "
        "lifetime) and policy caps are checked offline against the site administrator keys you chose to "
        "trust",
    ),
)


def coordinator_trust(sites: Sequence[SiteSummary]) -> str:
    """What the coordinator is trusted with, derived from the release: secure aggregation used or not, and the
    collusion each site's signed policy assumes."""
    common = (
        "It cannot sign or change a site's spend statement, drop a site from the release, or sign with a key "
        "that any one site's policy does not allow; trusted for the quality of training."
    )
    secure = [s for s in sites if s.colluders is not None]
    if not secure:
        return (
            "NOT trusted with privacy: no secure aggregation was used; every site adds all of its noise "
            "before anything leaves it, so the coordinator only ever receives noised releases and each ε "
            "holds whatever it does, with or without other sites. " + common
        )
    per_site = "; ".join(
        f"{s.site_id}: ε {s.job.text()} {s.assumption}, worst case {s.worst.text()}"
        for s in secure
        if s.worst is not None
    )
    return (
        "TRUSTED NOT TO COLLUDE, within limits: secure aggregation was used, so each site adds only a share "
        "of the noise and the coordinator sees the sum. The stated ε holds only if the coordinator does not "
        "collude with more other sites than each site's signed policy allows (max_colluders); if every other "
        "site colluded with it, the worst-case ε applies (that site's own noise share only), which the "
        f"policy also caps ({per_site}). " + common
    )


def _threat_model(res: VerificationResult) -> str:
    keys = "; ".join(res.trusted) or "none"
    rows = list(THREAT_MODEL)
    rows.insert(2, ("the coordinator", coordinator_trust(site_summaries(res))))
    return (
        _table(("party", "trusted for"), [(_h(a), _h(b)) for a, b in rows])
        + f'<p class="note">Keys trusted for this report, with their roles (fingerprints): '
        f'<span class="hash">{_h(keys)}</span></p>'
    )


def _glance_row(s: SiteSummary) -> tuple[str, ...]:
    unit = "patient (all of their images)" if s.unit == "patient" else "image"
    none = "no secure aggregation: not applicable"
    return (
        _h(s.site_id),
        _h(unit),
        _h(f"{s.delta:g}"),
        _h(s.job.text()),
        _h(s.lifetime.text()),
        _h(s.worst.text()) if s.worst else _h(none),
        _h(s.lifetime_worst.text()) if s.lifetime_worst else _h(none),
        _h(
            s.assumption
            + ("" if s.policy_verified else "; caps NOT checked (the site's policy did not verify)")
        ),
    )


def _glance(res: VerificationResult) -> str:
    """The first screen: may I publish this, ε per site under which trust assumption, what is not
    guaranteed."""
    sites = site_summaries(res)
    if not sites:
        return '<p class="fail">No site figures can be shown: see the verification checklist.</p>'
    table = _table(
        (
            "site",
            "ε per",
            "δ",
            "ε this job (cap)",
            "ε lifetime, all jobs (cap)",
            "worst case: ε this job if every other site colludes (cap)",
            "worst case, lifetime (cap)",
            "this job's ε holds",
        ),
        [_glance_row(s) for s in sites],
        numeric=(3, 4, 5, 6),
    )
    return (
        f"<p><b>Trust assumption:</b> {_h(trust_assumption(sites))}</p>{table}"
        "<p><b>Not guaranteed</b> (see Limitations):</p><ul>"
        "<li>a person with several images at an image-level site: only group privacy protects them;</li>"
        "<li>the stated ε if the coordinator colludes with more sites than assumed (the worst case "
        "applies);</li><li>exactness of the floating-point noise the accountant treats as exact;</li>"
        "<li>the utility figures: of real held-out data, not differentially private.</li></ul>"
    )


def _limitations(res: VerificationResult) -> str:
    sites = site_summaries(res)
    secure = any(s.colluders is not None for s in sites)
    items = [
        "Floating-point noise: the Gaussian (and Skellam) noise is drawn in floating point, while the "
        "accountant assumes the exact real-valued (integer) mechanism; floating-point attacks on the noise's "
        "low bits are not ruled out by the proof.",
        (
            "The coordinator is trusted not to collude with more other sites than each site's policy assumes "
            "(secure aggregation was used); beyond that, the worst-case ε in the table applies. It is also "
            "trusted for the quality of training and, in a federation, for combining released central images "
            "(no site signs the combination)."
            if secure
            else "The coordinator is not trusted with privacy (no secure aggregation: every site adds all "
            "its noise); it is trusted for the quality of training and, in a federation, for combining "
            "released central images (no site signs the combination)."
        ),
        "The unit of privacy is what each site declared: one image, or one patient. At an image-level site a "
        "person with k images is protected only by group privacy, (k·ε, k·e^((k-1)ε)·δ).",
        "What the audit cannot show: an empirical audit gives a LOWER bound on ε on canary data; it can "
        "reveal a mechanism that leaks more than claimed, never prove that it leaks less. The guarantee "
        "rests on the accounting and on the sites' software doing what it says.",
        "Utility figures (accuracy, FD) are computed without noise on real held-out images: they are NOT "
        "differentially private, not covered by the release's ε and not signed.",
        "Verification checks signatures, hashes, recomputed ε and the signed caps against the administrator "
        "keys you chose to trust: it is only as good as the out-of-band check of those keys' fingerprints.",
    ]
    return "<ul>" + "".join(f"<li>{_h(i)}</li>" for i in items) + "</ul>"


def _checklist(res: VerificationResult) -> str:
    rows = [
        (_h(c.name), f'<span class="{c.status}">{_h(c.status.upper())}</span>', _h(c.detail))
        for c in res.checks
    ]
    return _table(("check", "result", "detail"), rows)


def _png_data_uri(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def sample_grid_image(man: dict[str, Any], res: VerificationResult, per_class: int = 8, seed: int = 0) -> Any:
    """A labelled grid of ``per_class`` images per class drawn by the VERIFIED generator bytes
    (onnxruntime)."""
    from ..viz import epsilon_title, labelled_grid_image
    from .synthesize import generator_feed, make_session, release_starts, start_source

    if not res.ok or res.generator_bytes is None:
        raise ReleaseError("no samples from a release that did not verify")
    classes = [str(c) for c in man["generator"]["classes"]]
    c, h, w = (int(v) for v in man["generator"]["image_shape"])
    labels = np.repeat(np.arange(len(classes), dtype=np.int64), per_class)
    noise = np.random.Generator(np.random.PCG64(seed)).standard_normal(
        (len(labels), c, h, w), dtype=np.float32
    )
    sess = make_session(res.generator_bytes, threads=1)
    # As `synthesize` draws by default: SDEdit from the shipped central images when the signed sampler says
    # so.
    starts = release_starts(res, seed) if start_source(None, res) == "release" else None
    first = np.tile(np.arange(per_class, dtype=np.int64), len(classes))
    images = sess.run(["images"], generator_feed(sess, noise, labels, first, starts))[0]
    # each site's verified statement, its ε in its unit (per patient at a patient-level site)
    eps, delta, unit = figures_in_unit(
        {s["site_id"]: (s.get("attestation") or {}).get("statement") or s for s in man["sites"]}
    )
    title = epsilon_title("samples from the released generator", eps, delta, unit)
    scale = max(1, 64 // max(h, w))  # small images are enlarged so a printed page shows them
    return labelled_grid_image(
        images,
        labels,
        class_names=classes,
        title=title,
        per_class=per_class,
        n_classes=len(classes),
        scale=scale,
    )


def _samples(man: dict[str, Any], res: VerificationResult, per_class: int, seed: int) -> str:
    if not res.ok:
        return (
            '<p class="bad banner">No samples: the release did not verify, and nothing is drawn from an '
            "unverified generator.</p>"
        )
    img = sample_grid_image(man, res, per_class, seed)
    return (
        f'<figure><img class="grid" alt="labelled sample grid: {per_class} synthetic images per class" '
        f'src="{_png_data_uri(img)}" width="{img.width}" height="{img.height}">'
        f"<figcaption>One row per class (its name on the left), {per_class} images each, drawn with noise "
        f"seed {seed} by the generator whose hash verify checked"
        + _start_words(man)
        + ". Every image is synthetic.</figcaption></figure>"
    )


def _start_words(man: dict[str, Any]) -> str:
    """How the grid's images started (as synthesize draws by default: the signed sampler's start_source)."""
    src = man["generator"]["sampler"].get("start_source", "central")
    if src == "aux" and man.get("aux_starts"):
        return (
            ", each denoised from an augmented aux-generator image of its class (SDEdit, as synthesize does)"
        )
    if src == "mix" and man.get("aux_starts"):
        return (
            ", each denoised from an augmented aux-generator image (even index in its class) or released "
            "central image (odd) of its class (SDEdit, as synthesize does)"
        )
    return (
        ", each denoised from an augmented released central image of its class (SDEdit, as synthesize does "
        "by default)"
        if man.get("starts")
        else ""
    )


def _lifetime_by_stage(statement: dict[str, Any]) -> dict[str, float] | None:
    """ε per stage alone and composed over the site's signed LIFETIME history (all its jobs on these
    images), in the site's unit."""
    life = statement.get("lifetime")
    if not isinstance(life, dict) or not isinstance(life.get("events"), list):
        return None
    return epsilon_breakdown(
        events_from_list(life["events"]),
        float(life["delta"]),
        statement["accountant"],
        patient_cap=statement_patient_cap(statement),
    )


def _budget(rd: Path, man: dict[str, Any], res: VerificationResult) -> str:
    from ..viz import budget_svg

    chart = {}
    for s in man["sites"]:
        pol = _signed_policy(rd, s["site_id"], res)
        st = (s.get("attestation") or {}).get("statement") or {}
        cap = _site_cap(s)
        chart[s["site_id"]] = {
            "by_stage": epsilon_breakdown(
                events_from_list(s["events"]), float(s["delta"]), s["accountant"], patient_cap=cap
            ),
            "lifetime_by_stage": _lifetime_by_stage({**st, "accountant": s["accountant"]}),
            "delta": s["delta"],
            "cap": pol["budget"]["per_job"]["epsilon"] if pol else None,
            "lifetime_cap": pol["budget"]["lifetime"]["epsilon"] if pol else None,
            "unit": unit_name(cap),
        }
    return (
        f"<figure>{budget_svg(chart)}<figcaption>ε per site and stage (each stage alone) and the composed "
        "total: this job's spend (solid) beside the site's signed lifetime spend on the same images over all "
        "its jobs (pale); the dashed and dotted lines are the per-job and lifetime caps of the site's "
        "verified signed policy.</figcaption></figure>"
    )


def _utility(evaluation: dict[str, Any] | None) -> str:
    if not evaluation:
        return (
            "<p>No evaluation was supplied (<code>feta-release evaluate</code> writes one; pass it with "
            "--evaluation).</p>"
        )
    return _not_dp_heading() + _utility_rows(evaluation) + _utility_note(evaluation)


NOT_DP_HEADING = "Not differentially private: statistics of real held-out data"


def _not_dp_heading() -> str:
    return (
        f'<h3 class="warn">{_h(NOT_DP_HEADING)}</h3><p><strong>The figures below are computed without noise '
        "on "
        "real held-out images of whoever ran <code>feta-release evaluate</code> (a site's or the evaluator's "
        "own real data, never the released synthetic set alone). They are NOT covered by the release's ε, "
        "nor by its signatures.</strong> The held-out set's size, class counts, per-class accuracies and "
        "plain hash are left out of this page on purpose.</p>"
    )


def _utility_rows(e: dict[str, Any]) -> str:
    """Accuracy and FD only, whatever else the supplied file holds (an evaluation.json of an older evaluate
    kept the held-out size, class counts and plain hash: never shown)."""
    rows = [
        (
            "downstream accuracy",
            f"{float(e['accuracy']):.4f}",
            _h(
                f"a classifier trained on {e.get('n_synthetic', '?')} synthetic images for "
                f"{e.get('classifier_epochs', '?')} epochs, tested on the real held-out images (chance "
                f"{float(e.get('chance_accuracy', 0)):.3f})"
            ),
        ),
        (
            _h(e.get("fd_name", "FD")),
            f"{float(e['fd']):.4g}",
            _h(
                "Fréchet distance between synthetic and real held-out images (equal numbers per side) in the "
                f"features of a classifier trained {e.get('feature_net_epochs', '?')} epochs on the held-out "
                "images (lower is closer)"
            ),
        ),
    ]
    return _table(("measure", "value", "protocol"), rows, numeric=(1,))


def _utility_note(e: dict[str, Any]) -> str:
    commitment = e.get("real_commitment")
    held = (
        " Held-out set commitment (salted; the evaluator can open it) <span "
        f'class="hash">{_h(commitment)}</span>.'
        if commitment
        else ""
    )
    return (
        '<p class="note">Supplied by whoever ran the evaluation; not covered by the release\'s signatures. '
        f'Synthetic set fingerprint <span class="hash">{_h(e.get("synthetic_fingerprint", ""))}</span>.'
        f"{held}</p>"
    )


AUDIT_CAVEAT = (
    "An empirical audit gives a LOWER bound on ε: it can show that a mechanism leaks MORE than claimed "
    "(a bug), never that it leaks less. It does not prove privacy; the proof is the accounting above."
)


def _audit_config(a: dict[str, Any], released: dict[str, set[float]]) -> str:
    """What was audited (σ, q, steps) and whether that σ is the one this release's sites ran at."""
    ev = a.get("event") or {}
    if not ev:
        return "?"
    what = f"σ = {float(ev['sigma']):.4g}, q = {float(ev['q']):.4g}, {ev['steps']} step(s)"
    sigmas = released.get(str(ev.get("stage")), set())
    same = any(math.isclose(float(ev["sigma"]), s, rel_tol=1e-6) for s in sigmas)
    return _h(what + ("; the σ of this release" if same else "; NOT this release's σ" if sigmas else ""))


def _audit(audit: dict[str, Any] | None, man: dict[str, Any]) -> str:
    if not audit:
        return (
            f"<p>No audit was supplied (<code>feta-release audit</code> writes one). {_h(AUDIT_CAVEAT)}</p>"
        )
    released: dict[str, set[float]] = {}
    for s in man.get("sites", []):
        for e in s.get("events", []):
            if "sigma" in e:  # a secure-aggregation (Skellam) release has no per-site sigma to audit
                released.setdefault(str(e["stage"]), set()).add(float(e["sigma"]))
    rows = []
    for a in audit["audits"]:
        ok = float(a["lower_bound"]) <= float(a["claimed_epsilon"]) * (1 + 1e-9)
        runs = (
            f"one run, {a['detail']['canaries']} canaries"
            if "canaries" in a.get("detail", {})
            else f"{a['trials']} runs per neighbour"
        )
        rows.append(
            (
                _h(a["mechanism"]),
                _audit_config(a, released),
                f"{float(a['claimed_epsilon']):.4g}",
                f"{float(a['lower_bound']):.4g}",
                _h(f"{a['method']}; {runs}; {float(a['confidence']):.0%} confidence"),
                '<span class="pass">consistent</span>' if ok else '<span class="fail">CLAIM VIOLATED</span>',
            )
        )
    src = _h(f"job {audit.get('job', '?')}, public dataset size {audit.get('dataset_size', '?')}")
    return (
        f"<p>Audit of {src}, on canary data only (no site's images).</p>"
        + _table(
            ("mechanism", "audited configuration", "claimed ε", "measured ε lower bound", "method", "result"),
            rows,
            numeric=(2, 3),
        )
        + _audit_scope(audit)
        + f"<p>{_h(AUDIT_CAVEAT)}</p>"
    )


def _audit_scope(audit: dict[str, Any]) -> str:
    """What a "consistent" row covers (always the library's statement, whatever the supplied file says: the
    audits are the library's games) and what of the audited job no row covers."""
    from ..audit import SCOPE

    missing = [str(m) for m in audit.get("not_audited", [])]
    return f"<p><strong>{_h(SCOPE)}</strong></p>" + (
        f"<p>Not audited in this job: {_h('; '.join(missing))}.</p>" if missing else ""
    )


def _files(rd: Path) -> str:
    """Every plain file of the release with its size and hash. A symbolic link is listed, never followed: a
    release unpacked from a coordinator's archive could point one at a file of the verifier's machine (a
    secret, a large dataset), whose size and hash would otherwise land in a page meant to be shared."""
    rows = []
    for p in sorted(q for q in rd.rglob("*") if not q.is_dir() or q.is_symlink()):
        name = f"<code>{_h(p.relative_to(rd).as_posix())}</code>"
        try:  # opened below rd through no link, hashed in 1 MiB chunks: never a file outside the release
            size, digest = hash_regular(p, root=rd, error=ReleaseError, what="release file")
        except ReleaseError:
            kind = "symbolic link" if p.is_symlink() else "not a regular file"
            rows.append(
                (
                    name,
                    "-",
                    f'<span class="fail">{kind}, not followed or read (a release holds regular files)</span>',
                )
            )
            continue
        rows.append((name, f"{size:,}", f'<span class="hash">{digest}</span>'))
    return _table(("file (relative to the release)", "bytes", "sha256"), rows, numeric=(1,))


def _section(title: str, render: Any) -> str:
    """One section; a malformed (tampered) manifest spoils that section only, and says so."""
    try:
        body = render()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OSError, ReleaseError) as exc:
        body = f'<p class="fail">This section cannot be shown: {_h(type(exc).__name__)}: {_h(exc)}</p>'
    slug = title.lower().replace(" ", "-")
    return f'<section id="{slug}"><h2>{_h(title)}</h2>\n{body}\n</section>'


def render_report(
    release_dir: str | Path,
    res: VerificationResult,
    *,
    evaluation: dict[str, Any] | None = None,
    audit: dict[str, Any] | None = None,
    per_class: int = 8,
    seed: int = 0,
) -> str:
    """The whole page as one HTML string (see the module docstring)."""
    rd = Path(release_dir)
    man = res.manifest or {}
    job = _h(man.get("job", {}).get("job_id", "?")) if isinstance(man.get("job"), dict) else "?"
    verdict = verdict_line(res).replace("VERIFIED: the release is", "VERIFIED:", 1)
    banner = f'<div class="banner {"ok" if res.ok else "bad"}">Release {_h(verdict)}</div>'
    bodies = {
        "At a glance": lambda: _glance(res),
        "What was released": lambda: _released(man, res),
        "Privacy statement": lambda: _privacy(rd, man, res),
        "Threat model": lambda: _threat_model(res),
        "Limitations": lambda: _limitations(res),
        "Verification checklist": lambda: _checklist(res),
        "Sample images": lambda: _samples(man, res, per_class, seed),
        "Privacy budget": lambda: _budget(rd, man, res),
        "Utility": lambda: _utility(evaluation),
        "Empirical privacy audit": lambda: _audit(audit, man),
        "Files and hashes": lambda: _files(rd),
    }
    if res.manifest is None:  # nothing to describe but why: every manifest-based section says so
        for t in ("What was released", "Privacy statement", "Sample images", "Privacy budget"):
            bodies[t] = lambda: '<p class="fail">No readable manifest: see the verification checklist.</p>'
    sections = "\n".join(_section(t, bodies[t]) for t in SECTIONS)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        # No network: a CSP that forbids every fetch, so even a stray URL in a field could not load.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'\">"
        f"<title>Release report: job {job}</title><style>{CSS}</style></head><body>\n"
        f"<h1>Differentially private synthetic image release: job {job}</h1>\n"
        f'<p class="note">Release directory <code>{_h(rd.name)}</code>; report by feta-release from '
        f"{_h(MANIFEST_FILE)} and the files beside it.</p>\n{banner}\n{sections}\n</body></html>\n"
    )


def write_report(
    release_dir: str | Path,
    out: str | Path,
    trust: TrustRoots | Mapping[str, Any],
    *,
    evaluation: dict[str, Any] | None = None,
    audit: dict[str, Any] | None = None,
    per_class: int = 8,
    seed: int = 0,
) -> tuple[Path, VerificationResult]:
    """Verify ``release_dir`` and write the report to ``out`` (atomically); returns (path, verification).

    ``trust``: role-bound roots, as for :func:`verify_release` (a flat key list is refused there)."""
    res = verify_release(release_dir, trust)
    html = render_report(release_dir, res, evaluation=evaluation, audit=audit, per_class=per_class, seed=seed)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(html, "utf-8")
    tmp.replace(path)
    return path, res
