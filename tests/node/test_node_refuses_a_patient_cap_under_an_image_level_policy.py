"""A node whose SIGNED policy makes the image the unit of privacy (no ``dataset.privacy_unit = "patient"``)
but whose node.toml sets ``[data] patient_cap``: the node dropped every patient's images past the first K
while DP-SGD still sampled images and every ε stayed per image, silently. `train` refuses that combination;
the node refuses it the same way (``data.loading.check_cap_for_policy``), when it opens the site, before its
ledger, its cache or any image is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.setup import prepare_federation
from edge.site import Site, forget_sites
from feta_release.data import LoadOptions
from feta_release.errors import ConfigError
from tests.support.cli import run_cli
from tests.support.federation import node_settings
from tests.support.patients import noise_patient_csv

SITE = "st-mary"


def _image_level_site(tmp: Path, committed_cap: int | None = None) -> Any:
    """A site whose 6 patients have 3 scans each, under a policy its administrator signed image-level.
    ``committed_cap``: the policy commits to the first K scans of each patient (the images a node under that
    cap hashes), so that the commitment check cannot be what stops such a node."""
    from feta_release.data.commitment import dataset_commitment, load_secret
    from feta_release.data.loading import load_dataset
    from feta_release.policy import sign_policy, write_signed_policy
    from feta_release.signing import load_private_key

    (tmp / "scans").mkdir()
    fed = prepare_federation(tmp / "fed", {SITE: noise_patient_csv(tmp / "scans", patients=6, scans=3)})
    site = fed.site(SITE)
    if committed_cap is not None:
        doc = json.loads(Path(site.policy).read_text())["policy"]
        ds, _ = load_dataset(site.data, patient_cap=committed_cap)
        doc["dataset"]["commitment"] = dataset_commitment(ds, load_secret(site.data_secret))
        admin = load_private_key(Path(site.policy_pub).with_suffix(".key"))
        write_signed_policy(site.policy, sign_policy(doc, admin))
    return site


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every read of the site's images or ledger (none may happen)."""
    import edge.site as site_mod

    read: list[Any] = []
    monkeypatch.setattr(site_mod, "load_dataset", lambda *a, **k: read.append(a) or 1 / 0)
    monkeypatch.setattr(site_mod, "_opened_ledger", lambda *a, **k: read.append(a) or 1 / 0)
    return read


def test_a_node_refuses_a_cap_its_image_level_policy_does_not_declare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old node opened this site on 12 of its 18 images (2 of each patient's 3) with every ε per image."""
    import feta_release.data.loading as loading

    site = _image_level_site(tmp_path, committed_cap=2)
    cfg = node_settings(site, load=LoadOptions(patient_cap=2)).node_config()
    decoded: list[Any] = []
    real = loading._read_pixels
    monkeypatch.setattr(loading, "_read_pixels", lambda *a, **k: decoded.append(a) or real(*a, **k))
    forget_sites()
    with pytest.raises(ConfigError) as exc:
        Site.open(cfg).ledger.close()
    msg = str(exc.value)
    assert decoded == [] and "\n" not in msg
    policy = Path(site.policy).resolve()
    assert msg.startswith(f"{policy}: the policy makes the IMAGE the unit of privacy"), msg
    assert "node.toml [data] patient_cap = 2" in msg and "drop the patient cap" in msg
    assert 'dataset.privacy_unit = "patient", patient_cap = 2' in msg


def test_a_node_refuses_another_cap_than_its_patient_level_policys_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A patient-level policy's cap of another value was refused only after every image was decoded under the
    wrong cap; now before anything is read, in the same words."""
    from tests.support.patients import CAP, PATIENT_SITE, patient_federation

    fed, _ = patient_federation(tmp_path)
    cfg = node_settings(fed.site(PATIENT_SITE), load=LoadOptions(patient_cap=CAP + 1)).node_config()
    read = _reads(monkeypatch)
    forget_sites()
    with pytest.raises(ConfigError, match=rf"dataset.patient_cap = {CAP} but node.toml \[data\] patient_cap"):
        Site.open(cfg)
    assert read == []


def test_an_image_level_node_without_a_cap_opens_every_image(tmp_path: Path) -> None:
    site = _image_level_site(tmp_path)
    forget_sites()
    opened = Site.open(node_settings(site).node_config())
    opened.ledger.close()
    assert opened.data.n == 18 and opened.patients is None


def test_node_start_refuses_it_in_one_line_before_anything_is_started(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import edge.launch as launch

    site = _image_level_site(tmp_path, committed_cap=2)
    toml = tmp_path / "node.toml"
    files = {
        "data": site.data,
        "policy": site.policy,
        "trusted_policy_key": site.policy_pub,
        "ledger": site.ledger,
        "site_key": site.site_key,
        "data_secret": site.data_secret,
    }
    toml.write_text(
        "[node]\n"
        + "".join(f'{k} = "{Path(v).resolve()}"\n' for k, v in files.items())
        + "insecure = true\n[data]\npatient_cap = 2\n"
    )
    started: list[Any] = []
    monkeypatch.setattr(launch, "ManagedProcess", lambda *a, **kw: started.append(a))
    read = _reads(monkeypatch)
    code, _, err = run_cli(["node", "start", "--config", str(toml)], capsys)
    assert code != 0 and read == [] and started == []
    # the one line beside --insecure's warning
    refusal = [line for line in err.strip().splitlines() if not line.startswith("WARNING: --insecure")]
    assert "Traceback" not in err and len(refusal) == 1, err
    assert "the policy makes the IMAGE the unit of privacy" in refusal[0] and "patient_cap = 2" in refusal[0]
