"""The policy `site init` drafts comes from the site's public facts by the derived job's rules: its delta,
caps and memory limit are `job_rules.site_caps`, a draft signed as written admits the job the rules derive for
the site at its per-job budget, and its min_sigma admits this site's share of that job's noise in a secure sum
of up to 16 sites."""

from __future__ import annotations

import math
import tomllib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge.admission import admit
from edge.kit import _policy_draft, signing_review
from feta_release.errors import ConfigError
from feta_release.job_rules import DRAFT_SHARE_SITES, DataFacts, default_delta, derive, site_caps
from feta_release.policy import open_signed_policy, sign_job, sign_policy
from feta_release.policy.document import _normalize, validate_policy
from feta_release.signing import public_key_pem
from tests.support.policy import keys

SHAPES = st.tuples(st.sampled_from([1, 3]), st.integers(28, 128)).map(lambda t: (t[0], t[1], t[1]))


def _draft(n: int, shape: tuple[int, int, int], classes: int, patients: int | None = None, k=None) -> dict:
    k = k or keys()
    text = _policy_draft(
        "site-a",
        "ab" * 32,
        n,
        public_key_pem(k["coord"].public_key()),
        public_key_pem(k["site"].public_key()),
        shape=shape,
        n_classes=classes,
        patients=patients,
    )
    doc = _normalize(tomllib.loads(text))
    doc["app_bundles"] = ["cd" * 32]
    validate_policy(doc)
    return doc


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(300, 100_000), shape=SHAPES, classes=st.integers(2, 100))
def test_signed_draft_holds_the_rules_caps_and_admits_the_derived_job(n, shape, classes) -> None:
    k = keys()
    doc, caps = _draft(n, shape, classes, k=k), site_caps(n, shape, classes)
    b, m = doc["budget"], doc["mechanisms"]
    assert b["per_job"]["delta"] == b["lifetime"]["delta"] == default_delta(n) < 1 / n
    assert m["central"]["max_batch"] == n and m["frequency"]["max_features"] == caps.max_features
    assert (m["dpsgd"]["max_batch"], m["dpsgd"]["max_steps"]) == (caps.dpsgd_max_batch, caps.dpsgd_max_steps)
    assert doc["resources"]["max_worker_memory_mb"] * 2**20 >= n * math.prod(shape) * 4 + 2**30
    assert not signing_review(doc).errors
    if caps.job is None:
        assert "below the floor" in caps.floor
        return
    pol = open_signed_policy(sign_policy(doc, k["site"]), [k["site"].public_key()])
    cfg = caps.job.cfg.for_size(n).replace(
        central={"rate": None}, dpsgd={"rate": None}
    )  # a signed job's batches
    res = admit(pol, sign_job(cfg, k["coord"], "j", ["site-a"]), data_shape=(shape, classes))
    assert res.accepted, res.failures


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(300, 100_000),
    shape=SHAPES,
    classes=st.integers(2, 100),
    sites=st.integers(2, DRAFT_SHARE_SITES),
)
def test_min_sigma_admits_this_sites_share_of_a_derived_federation(n, shape, classes, sites) -> None:
    caps = site_caps(n, shape, classes)
    facts = DataFacts(sites * n, shape[1], shape[2], shape[0], classes, 1.0, federated=True)
    try:
        cfg = derive(facts).cfg
    except ConfigError:
        return  # below the floor: no job to admit
    assert cfg.central.sigma / math.sqrt(sites) >= caps.min_sigma
    assert cfg.frequency.sigma is None or cfg.frequency.sigma / math.sqrt(sites) >= caps.min_sigma


def test_draft_for_a_hundred_thousand_images_signs_without_the_delta_risk() -> None:
    doc = _draft(100_000, (1, 64, 64), 4)
    assert doc["budget"]["per_job"]["delta"] == 1e-6
    assert not [e for e in signing_review(doc).errors if "delta" in e]


def test_draft_memory_limit_holds_the_sites_images() -> None:
    assert _draft(4000, (1, 28, 28), 10)["resources"]["max_worker_memory_mb"] == 16384  # the default
    assert _draft(100_000, (3, 128, 128), 10)["resources"]["max_worker_memory_mb"] == 20480  # 18.31 GiB + 1


def test_patient_level_draft_sizes_dpsgd_by_the_public_patients() -> None:
    doc = _draft(40_000, (1, 64, 64), 4, patients=2_000)
    assert doc["mechanisms"]["dpsgd"]["max_batch"] == 500  # a quarter of 2,000 patients
    assert doc["mechanisms"]["dpsgd"]["max_steps"] == 100


def test_draft_below_the_floor_says_why_in_its_comment() -> None:
    k = keys()
    text = _policy_draft(
        "site-a",
        "ab" * 32,
        300,
        None,
        public_key_pem(k["site"].public_key()),
        shape=(3, 32, 32),
        n_classes=100,
    )
    assert "# is refused at this budget: derived job: below the floor: 300 images in 100 classes" in text
    assert all(len(line) <= 120 for line in text.splitlines() if line.startswith("#"))
