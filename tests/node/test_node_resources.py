"""What one signed job may make a node allocate: the policy's ``resources`` caps, refused from the job's
config before anything is built, decoded or charged (feta_release/policy/enforce.py,
feta_release/model_size.py, edge/resources.py)."""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.setup import sign_job_file
from feta_release.config import ModelSection, load_preset
from feta_release.federation import messages as fm
from feta_release.ledger import Ledger
from feta_release.model_size import denoiser_parameters
from feta_release.policy.enforce import DEFAULT_RESOURCES, check_resources
from feta_release.policy.errors import PolicyViolation
from feta_release.signing import canonical_json
from tests.support.architectures import denoiser_architectures
from tests.support.federation import harness, make_federation, tiny_job

PRESETS = sorted(p.stem for p in (Path(__file__).parents[2] / "feta_release" / "presets").glob("*.toml"))


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    return make_federation(tmp_path_factory.mktemp("resources") / "fed")


@pytest.fixture(scope="module")
def policy(fed):
    from edge.site import Site

    site = Site.open(fed.sites[0].node_config())
    site.ledger.close()
    return site.policy


# -- the count
# -------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(arch=denoiser_architectures())
def test_the_count_equals_the_built_models_for_any_architecture(arch):
    from feta_release.models import build_denoiser, count_parameters

    cfg, shape, classes = arch
    assert denoiser_parameters(cfg, shape, classes) == count_parameters(build_denoiser(cfg, shape, classes))


def test_the_count_does_not_walk_the_blocks_a_job_names():
    cfg = ModelSection(channels=8, channel_mult=(1,), num_res_blocks=10**12, attn_resolutions=())
    assert denoiser_parameters(cfg, (1, 8, 8), 10) > 10**15  # closed form: returns at once


def test_the_defaults_admit_every_shipped_preset_and_the_demos_job(policy):
    from coordinator.demo import demo_config

    jobs = {name: load_preset(name) for name in PRESETS}
    jobs["demo --quick"] = demo_config("cpu-eps1", 1.0, 1000, 2, 2, quick=True)
    jobs["demo"] = demo_config("cpu-eps1", 1.0, 1000, 2, 2, quick=False)
    jobs["tests' tiny job"] = tiny_job()
    assert {"paper-mnist", "xray64-eps10", "tiny"} <= set(jobs)
    for name, cfg in jobs.items():
        side = cfg.job.image_size or 28
        declared = dataclasses.replace(policy.declared, image_shape=(3, side, side))
        check_resources(
            dataclasses.replace(policy, declared=declared), SimpleNamespace(config=cfg, job_id=name)
        )


# -- the attack: a 2 KB signed job that makes the node allocate gigabytes
# -------------------------------------------


def _refuses_building(monkeypatch):
    """Any model built from here on fails the test (the old node built the job's model to check the
    weights)."""
    import feta_release.models.unet as unet

    def refuse(*args, **kwargs):
        raise AssertionError("the node built the job's model")

    monkeypatch.setattr(unet.UNet, "__init__", refuse)


@pytest.mark.parametrize("mtype", [fm.HELLO, fm.TRAIN])
def test_a_2kb_job_with_a_huge_model_is_refused_before_anything_is_built(fed, monkeypatch, mtype):
    cfg = tiny_job(
        model={"channels": 1024, "channel_mult": [2, 2], "num_res_blocks": 2, "attn_resolutions": [14]}
    )
    signed, _ = sign_job_file(fed, cfg, f"job-huge-{mtype}")
    assert len(canonical_json(signed)) < 4096
    _refuses_building(monkeypatch)
    grid = harness(fed)
    (rep,) = grid.send_and_receive(
        [grid.create_message(fm.make_payload({"job": signed, "round": 0}), mtype, 100, "t")]
    )
    assert rep.has_error(), "the job was answered"
    reason = rep.error.reason
    assert "resources.max_model_parameters" in reason and "cap 20,000,000" in reason, reason
    with Ledger(fed.sites[0].ledger) as led:
        assert led.requests(f"job-huge-{mtype}") == []  # nothing charged


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(physical=st.integers(1, 2048), draws=st.integers(1, 64))
def test_the_physical_batch_and_the_rows_of_a_pass_are_capped(policy, physical, draws):
    cfg = tiny_job(dpsgd={"physical_batch": physical, "noise_multiplicity": draws})
    job = SimpleNamespace(config=cfg, job_id="j")
    if physical > DEFAULT_RESOURCES["max_physical_batch"]:
        rule = "resources.max_physical_batch"
    elif physical * draws > DEFAULT_RESOURCES["max_pass_rows"]:
        rule = "resources.max_pass_rows"
    else:
        check_resources(policy, job)
        return
    with pytest.raises(PolicyViolation) as exc:
        check_resources(policy, job)
    assert exc.value.rule == rule and "\n" not in str(exc.value) and rule in str(exc.value)


def test_a_site_may_raise_its_caps_in_its_policy(policy):
    cfg = tiny_job(
        model={"channels": 1024, "channel_mult": [2, 2], "num_res_blocks": 2, "attn_resolutions": [14]}
    )
    job = SimpleNamespace(config=cfg, job_id="big")
    with pytest.raises(PolicyViolation, match="max_model_parameters"):
        check_resources(policy, job)
    check_resources(dataclasses.replace(policy, resources={"max_model_parameters": 10**10}), job)


def test_the_policy_check_names_the_rule(fed, policy):
    from edge.admission import admit

    cfg = tiny_job(
        model={"channels": 1024, "channel_mult": [2, 2], "num_res_blocks": 2, "attn_resolutions": [14]}
    )
    signed, _ = sign_job_file(fed, cfg, "job-huge-check")
    res = admit(policy, signed)
    assert [rule for rule, _ in res.failures] == ["resources.max_model_parameters"]


def test_a_policy_resources_section_is_schema_checked(fed):
    from feta_release.errors import PolicyError
    from feta_release.policy.document import validate_policy

    doc = json.loads(Path(fed.sites[0].policy).read_text())["policy"]
    validate_policy({**doc, "resources": {"max_model_parameters": 5_000_000, "max_worker_memory_mb": 0}})
    with pytest.raises(PolicyError, match="resources"):
        validate_policy({**doc, "resources": {"max_gpus": 1}})
    with pytest.raises(PolicyError, match="resources"):
        validate_policy({**doc, "resources": {"max_physical_batch": 0}})


# -- one message, and the memory of the processes that compute
# --------------------------------------------------


def test_a_message_over_the_size_cap_is_refused_before_its_arrays_are_read(fed, monkeypatch):
    import edge.clientapp as ca
    import feta_release.policy.enforce as enforce

    monkeypatch.setitem(enforce.DEFAULT_RESOURCES, "max_message_mb", 0.5)
    read = []
    real_read = ca.fm.read_payload
    monkeypatch.setattr(ca.fm, "read_payload", lambda rd: read.append(1) or real_read(rd))
    signed, _ = sign_job_file(fed, tiny_job(), "job-big-message")
    weights = {"w": np.zeros(2**18, dtype=np.float32)}  # 1 MiB
    grid = harness(fed)
    (rep,) = grid.send_and_receive(
        [grid.create_message(fm.make_payload({"job": signed}, weights), fm.HELLO, 100, "t")]
    )
    assert (
        rep.has_error()
        and "resources.max_message_mb" in rep.error.reason
        and "cap 0.5 MiB" in rep.error.reason
    )
    assert read == []


def test_the_in_process_harness_leaves_its_hosts_memory_limit_alone(fed):
    before = resource.getrlimit(resource.RLIMIT_DATA)
    signed, _ = sign_job_file(fed, tiny_job(), "job-hello")
    grid = harness(fed)
    (rep,) = grid.send_and_receive(
        [grid.create_message(fm.make_payload({"job": signed}), fm.HELLO, 100, "t")]
    )
    assert not rep.has_error(), rep.error.reason
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


LIMITED = r"""
import json, sys
from types import SimpleNamespace
import numpy as np
from edge.resources import limit_memory

got = {"limit": limit_memory(SimpleNamespace(resources={"max_worker_memory_mb": int(sys.argv[1])}))}
small = np.ones(2**24)  # 128 MiB: under the limit
try:
    big = np.ones(2**28)  # 2 GiB: over it
    big[:] = 2
    got["big"] = "allocated"
except MemoryError:
    got["big"] = "MemoryError"
print(json.dumps(got))
"""


def test_the_memory_limit_makes_an_allocation_past_it_fail_in_that_process():
    out = subprocess.run(
        [sys.executable, "-c", LIMITED, "1024"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"limit": 1024 * 2**20, "big": "MemoryError"}


def test_the_research_example_policy_states_the_defaults():
    from feta_release.policy.document import read_policy_document

    doc = read_policy_document(Path(__file__).parents[2] / "policies" / "research.toml")
    assert doc["resources"] == DEFAULT_RESOURCES


def test_a_gpu_node_applies_only_a_memory_limit_its_policy_states():
    from edge.resources import limit_memory

    unset = SimpleNamespace(resources={})
    before = resource.getrlimit(resource.RLIMIT_DATA)
    assert limit_memory(unset, "cuda") is None and limit_memory(unset, "auto") is None
    assert limit_memory(SimpleNamespace(resources={"max_worker_memory_mb": 0}), "cpu") is None
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
