"""`privacy plan --policy` of a secure-aggregation job states what the site's node charges and the coordinator
plans: the SkellamEvents of ``planning.secure_site_events`` (the one planner of a secure site), with its
total and worst case, never the Gaussian form of each stage."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feta_release.accounting import SkellamEvent, epsilon, worst_case_epsilon
from feta_release.config import load_job
from feta_release.data.declared import DataDeclaration
from feta_release.federation.secure_collect import secure_plan
from feta_release.mechanisms.count import size_event
from feta_release.planning import SecureSite, plan, stage_event
from feta_release.policy.document import SitePolicy, make_policy
from feta_release.signing import generate_keypair, load_public_key, public_key_pem
from tests.support.federation import tiny_job

SHAPE, CLASSES, SIZE, DELTA = (1, 28, 28), 10, 4000, 1e-5
PRESET = Path(__file__).resolve().parents[2] / "feta_release" / "presets" / "cpu-eps1.toml"


@pytest.fixture(scope="module")
def peer_pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("peers")
    return {
        sid: public_key_pem(load_public_key(generate_keypair(root / sid, "site")[1]))
        for sid in ("site-b", "site-c", "site-d", "site-e")
    }


def _policy_doc(peers: dict[str, str], colluders: int = 0, per_job: float = 1.0) -> dict[str, Any]:
    return make_policy(
        "site-a",
        "0" * 64,
        SIZE,
        ["a" * 64],
        per_job=(per_job, DELTA),
        lifetime=(4.0 * per_job, DELTA),
        secure_aggregation={"peers": peers, "max_colluders": colluders},
        declared=DataDeclaration(tuple(f"c{i}" for i in range(CLASSES)), SHAPE),
    )


def _coordinator_charges(cfg: Any, pol: Any, n_sites: int, counted: list[Any]) -> list[Any]:
    """What the coordinator plans and its check charges at the site (``secure_collect.secure_plan``)."""
    driver = SimpleNamespace(cfg=cfg, job=SimpleNamespace(sites=[f"s{i}" for i in range(n_sites)]))
    site = SimpleNamespace(policy=pol, size=SIZE, image_shape=SHAPE, n_classes=CLASSES)
    return secure_plan(driver, site, counted)[1]  # type: ignore[arg-type]


def test_privacy_plan_of_a_secure_job_totals_the_skellam_events_the_coordinator_charges(
    tmp_path: Path, peer_pems: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from feta_release.cli import main

    peers = {k: peer_pems[k] for k in ("site-b", "site-c")}
    (path := tmp_path / "policy.json").write_text(json.dumps(_policy_doc(peers)))
    main(["privacy", "plan", str(PRESET), "--policy", str(path), "--json"])
    out = json.loads(capsys.readouterr().out)
    # cpu-eps1 sets no [federation] secure_aggregation: three sites (this one and its two pinned peers) sum;
    # its rates become the batches the coordinator signs for this site's public size
    pol = SitePolicy.from_document(_policy_doc(peers), None)
    charged = _coordinator_charges(load_job(PRESET).with_secure_default(3).for_size(SIZE), pol, 3, [])
    assert out["secure_aggregation"] is True and out["sites"] == 3
    assert any(isinstance(e, SkellamEvent) for e in charged)
    assert out["history"] == [e.to_dict() for e in charged]
    assert out["epsilon"] == pytest.approx(epsilon(charged, DELTA), rel=1e-9)
    assert out["epsilon"] <= 1.0 + 1e-9
    assert out["worst_case_epsilon"] == pytest.approx(worst_case_epsilon(charged, DELTA), rel=1e-9)
    rows = {r["stage"]: r for r in out["stages"]}
    for stage in ("central", "frequency"):
        alone = epsilon([stage_event(charged, stage)], DELTA)  # type: ignore[list-item]
        assert rows[stage]["epsilon"] == pytest.approx(alone, rel=1e-9)
        assert "secure sum (Skellam)" in rows[stage]["note"]
    main(["privacy", "plan", str(PRESET), "--policy", str(path)])
    table = capsys.readouterr().out
    assert "secure aggregation over 3 sites" in table and "worst case" in table


def test_privacy_plan_with_sites_one_keeps_the_per_site_gaussian_plan(
    tmp_path: Path, peer_pems: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from feta_release.cli import main

    (path := tmp_path / "policy.json").write_text(json.dumps(_policy_doc({"site-b": peer_pems["site-b"]})))
    main(["privacy", "plan", str(PRESET), "--policy", str(path), "--sites", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["secure_aggregation"] is False and "worst_case_epsilon" not in out
    assert all("kind" not in e for e in out["history"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_sites=st.integers(2, 5),
    colluders=st.integers(0, 4),
    fedsgd=st.booleans(),
    drawn=st.booleans(),
)
def test_the_plan_of_a_secure_site_is_the_history_the_coordinator_charges(
    peer_pems: dict[str, str], n_sites: int, colluders: int, fedsgd: bool, drawn: bool
) -> None:
    peers = dict(list(peer_pems.items())[: n_sites - 1])
    # a configured noise multiplier: no calibration, so many shapes of federation are quick to plan
    cfg = tiny_job(
        privacy={"epsilon": 60.0},
        central={"rounds": 1, "batch": 10, "sigma": 5.0},
        frequency={"sigma": 26.6, "features": 200},
        dpsgd={"noise_multiplier": 2.0},
        federation={"secure_aggregation": True, "fedsgd": fedsgd, "min_sites": 2},
    )
    pol = SitePolicy.from_document(_policy_doc(peers, min(colluders, n_sites - 1), per_job=60.0), None)
    counted = [size_event()] if drawn else []
    p = plan(
        cfg,
        SIZE,
        federated=True,
        image_shape=SHAPE,
        n_classes=CLASSES,
        size=counted or None,
        secure=SecureSite(n_sites, pol),
    )
    charged = _coordinator_charges(cfg, pol, n_sites, counted)
    assert list(p.history) == counted + charged
    assert p.epsilon == pytest.approx(epsilon(counted + charged, DELTA), rel=1e-12)
    assert p.worst_case_epsilon == pytest.approx(worst_case_epsilon(counted + charged, DELTA), rel=1e-12)
    assert p.stage("dpsgd").steps == cfg.federated_rounds * (1 if fedsgd else cfg.federation.local_steps)
