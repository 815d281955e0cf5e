"""`policy check POLICY JOB` without --data judged a secure-aggregation job in its Gaussian form but printed
the node's verdict ("ACCEPTED ... admits job", "planned ε") as if it had checked what the node charges.

The charged form cannot be computed from public values: its Skellam sensitivities (and a FedSGD job's gradient
length) depend on the data's image shape and classes, which neither the signed policy nor the signed job
states (the ε moves in the 4th digit from 16x16 to 3x32x32 images here). So without --data the output now says
exactly what it checked and what it did not (the charged ε, the worst-case cap), and exits 8, not 0
(tests/policy/test_partial_check_exit.py); with --data it is the node's verdict: the
same ε ``secure_admit`` computes (tests/federation/test_fedsgd.py: the ε the node charged) and the worst-case
cap applied."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from coordinator.setup import sign_job_file
from edge.admission import admit
from feta_release.cli import cli
from feta_release.data import load_dataset
from feta_release.policy import load_site_policy
from feta_release.policy.document import sign_policy, write_signed_policy
from feta_release.signing import load_private_key
from tests.support.federation import make_federation, tiny_job


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("l5")
    f = make_federation(tmp / "fed")
    cfg = tiny_job(
        central={"rounds": 1, "batch": 8}, frequency={"sigma": 8.0}, federation={"secure_aggregation": True}
    )
    signed, path = sign_job_file(f, cfg, "job-l5")
    site = f.sites[0]
    ds, _ = load_dataset(Path(site.data))
    return SimpleNamespace(
        fed=f, site=site, signed=signed, job=path, shape=(tuple(ds.image_shape), ds.n_classes)
    )


def _check(policy: Path, job: Path, pub: Path, *extra: str) -> Any:
    return CliRunner().invoke(cli, ["policy", "check", str(policy), str(job), "--trusted", str(pub), *extra])


def test_without_data_the_output_says_it_checked_the_gaussian_form_only(fed: SimpleNamespace) -> None:
    res = _check(fed.site.policy, fed.job, fed.site.policy_pub)
    assert res.exit_code == 8, res.output  # a partial check, never exit 0
    pol = load_site_policy(fed.site.policy, [fed.site.policy_pub])
    gaussian = admit(pol, fed.signed).job_epsilon
    out = " ".join(res.output.split())
    assert "ACCEPTED" not in out and "admits job" not in out and "planned" not in out
    assert out.startswith("PASSED IN THE GAUSSIAN FORM ONLY") and f"Gaussian-form ε={gaussian:.4g}" in out
    assert "NOT checked: the ε the node charges" in out and "worst-case cap" in out and "--data DATA" in out


def test_with_data_it_states_the_epsilon_the_node_charges(fed: SimpleNamespace) -> None:
    res = _check(fed.site.policy, fed.job, fed.site.policy_pub, "--data", str(fed.site.data))
    assert res.exit_code == 0, res.output
    pol = load_site_policy(fed.site.policy, [fed.site.policy_pub])
    skellam = admit(pol, fed.signed, data_shape=fed.shape).job_epsilon
    assert skellam != pytest.approx(admit(pol, fed.signed).job_epsilon, rel=1e-6)
    assert res.output.startswith("ACCEPTED") and f"planned ε={skellam:.4g}" in res.output
    assert "Skellam form the node charges" in res.output


def test_a_worst_case_cap_the_gaussian_form_cannot_see_is_not_reported_as_accepted(
    fed: SimpleNamespace, tmp_path: Path
) -> None:
    """A policy whose worst-case cap the job breaks: the node refuses it; without --data the check could not
    see the cap, and its output no longer reads as an acceptance."""
    doc = json.loads(Path(fed.site.policy).read_text())["policy"]
    doc["secure_aggregation"] = {**doc.get("secure_aggregation", {}), "max_worst_case_epsilon": 1.01}
    strict = write_signed_policy(
        tmp_path / "strict.signed.json",
        sign_policy(doc, load_private_key(Path(fed.site.policy_pub).with_suffix(".key"))),
    )
    exact = _check(strict, fed.job, fed.site.policy_pub, "--data", str(fed.site.data))
    assert exact.exit_code != 0 and "secure_aggregation.max_worst_case_epsilon" in exact.output + str(
        exact.exception
    )
    blind = _check(strict, fed.job, fed.site.policy_pub)
    assert blind.exit_code == 8 and "ACCEPTED" not in blind.output and "worst-case cap" in blind.output


def test_job_verify_with_a_policy_says_gaussian_form_only_for_a_secure_job(fed: SimpleNamespace) -> None:
    res = CliRunner().invoke(
        cli,
        [
            "job",
            "verify",
            str(fed.job),
            "--policy",
            str(fed.site.policy),
            "--trusted",
            str(fed.site.policy_pub),
        ],
    )
    assert res.exit_code == 8, res.output  # It was 0
    assert (
        res.output.startswith("PASSED IN THE GAUSSIAN FORM ONLY")
        and "policy check POLICY JOB --data DATA" in res.output
    )
