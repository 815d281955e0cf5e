"""``train --policy`` read the site's policy file three times: verified for its schema, then read WITHOUT
verifying for the public size the job is planned and signed for and for the site id it is signed to, then
verified again when the site was opened over the images. A file replaced in between (both versions validly
signed, or the second not signed at all) had the job planned, derived and signed for one public size while
the site ran, and charged, under another policy. ``train`` now verifies the file once and takes the size, the
site id and the site's policy from that one object."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import coordinator.local_run as local_run
from feta_release.config import load_preset
from feta_release.data.commitment import dataset_commitment, ensure_secret
from feta_release.data.declared import DataDeclaration
from feta_release.policy import make_policy, sign_policy, write_signed_policy
from feta_release.signing import generate_keypair, load_private_key
from tests.support.training import embedded_subset, train_run


class _Opened(Exception):
    """The run's site was opened: stops the run before any release."""


def test_a_policy_replaced_after_the_job_is_sized_is_not_the_one_the_site_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = embedded_subset()
    admin, admin_pub = generate_keypair(tmp_path / "k", "admin")
    coord, _ = generate_keypair(tmp_path / "k", "coordinator")
    secret, _ = ensure_secret(tmp_path / "k" / "data.secret")
    declared = DataDeclaration(tuple(data.class_names), tuple(data.image_shape))
    doc = make_policy(
        "hosp",
        dataset_commitment(data, secret),
        data.n,
        [load_private_key(coord).public_key()],
        per_job=(10.0, 1e-5),
        lifetime=(20.0, 1e-5),
        declared=declared,
    )
    pol = write_signed_policy(tmp_path / "site.signed.json", sign_policy(doc, load_private_key(admin)))
    signed = json.loads(pol.read_bytes())
    # the same site and data, validly signed, a newer version: twice the public size
    other = sign_policy(
        {**doc, "version": 2, "dataset": {**doc["dataset"], "size": 2 * data.n}}, load_private_key(admin)
    )
    sized: list[int] = []
    real_plan = local_run._plan

    def plan_then_replace(cfg: Any, data: Any, n_pub: int, *args: Any, **kwargs: Any) -> Any:
        sized.append(int(n_pub))  # the public size the job is derived, planned and signed for
        pol.write_text(json.dumps(other), "utf-8")  # replaced once the job is sized
        return real_plan(cfg, data, n_pub, *args, **kwargs)

    opened: list[Any] = []

    def hold(name: str, site: Any) -> None:
        opened.append(site)
        site.ledger.close()
        raise _Opened

    monkeypatch.setattr(local_run, "_plan", plan_then_replace)
    monkeypatch.setattr(local_run, "hold_site", hold)
    with pytest.raises(_Opened):
        train_run(
            load_preset("tiny"),
            data,
            tmp_path / "run",
            policy=pol,
            trusted=admin_pub,
            data_secret=tmp_path / "k" / "data.secret",
            coordinator_key=coord,
        )
    (site,) = opened
    job = json.loads((tmp_path / "run" / "signed_job.json").read_bytes())["job"]
    assert sized == [data.n]
    # the site runs (and charges under) the policy the job was sized for, not the file put there since
    assert site.policy.dataset_size == sized[0], (
        f"the job was signed for {sized[0]} images, the site runs a policy of {site.policy.dataset_size}"
    )
    assert site.policy.signed == signed
    assert job["sites"] == [site.site_id]
