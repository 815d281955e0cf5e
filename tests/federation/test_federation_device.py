"""``--device auto|cpu|cuda`` of the federated drivers (``coordinator run``, ``node start``) on a CPU-only
machine.

A GPU that is not there is refused in one line before anything is signed, written or started (as ``train
--device cuda``, tests/training/test_device.py); ``cpu`` and ``auto`` without a GPU compute exactly what the
default does, byte for byte, since only the arithmetic would move. The CUDA path itself runs on a GPU machine:
``tests/e2e/test_cuda_path.py::test_federated_job_on_cuda``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coordinator.setup import prepare_federation, sign_job_file
from feta_release.cli import main
from feta_release.errors import ConfigError
from tests.support.federation import full_job, harness, run_harness_job, tiny_job, tiny_sites

TINY_JOB = Path(__file__).resolve().parents[2] / "feta_release" / "presets" / "tiny.toml"  # read only


@pytest.fixture()
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _refused_in_one_line(exc: pytest.ExceptionInfo[SystemExit], capsys: pytest.CaptureFixture[str]) -> None:
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def _coordinator_key(tmp_path: Path) -> Path:
    from feta_release.signing import generate_keypair

    return generate_keypair(tmp_path / "keys", "coordinator")[0]


def _fake_submit(seen: list[str]):  # noqa: ANN202 - flwr run's stand-in
    """``flwr run``'s stand-in: records the device the ServerApp would find, then leaves a finished job's
    summary."""
    from feta_release.federation.job import saved_device

    def submit(app_dir: Path, home: Path, run_config: dict[str, str], **kw: Any) -> int:
        out = Path(run_config["out-dir"])
        seen.append(saved_device(out))
        summary = {"job_id": "j", "site_epsilon": {}, "rounds": 0, "skipped": {}, "timings": {}}
        (out / "job_summary.json").write_text(json.dumps(summary), "utf-8")
        return 0

    return submit


# -- coordinator run
# ---------------------------------------------------------------------------------------------


def test_coordinator_run_refuses_cuda_without_a_gpu_before_signing_or_submitting(
    no_gpu: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from coordinator import runner

    seen: list[str] = []
    monkeypatch.setattr(runner, "submit", _fake_submit(seen))
    key, out = _coordinator_key(tmp_path), tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "coordinator",
                "run",
                str(TINY_JOB),
                "--sites",
                "site-a",
                "--key",
                str(key),
                "--out",
                str(out),
                "--device",
                "cuda",
                "--no-progress",
            ]
        )
    _refused_in_one_line(exc, capsys)
    assert not out.exists() and seen == []  # nothing signed, written or submitted


def test_coordinator_run_hands_the_resolved_device_to_the_serverapp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` becomes what this machine has (the ServerApp computes where this check looked); the default is
    cpu, written too, so that no device file of an earlier submit to the same --out is what the ServerApp
    finds."""
    from coordinator import runner
    from feta_release.federation.job import save_device

    seen: list[str] = []
    monkeypatch.setattr(runner, "submit", _fake_submit(seen))
    key = _coordinator_key(tmp_path)
    for i, (gpu, device, want) in enumerate(
        ((True, "auto", "cuda"), (False, "auto", "cpu"), (True, None, "cpu"))
    ):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        out = tmp_path / f"out{i}"
        out.mkdir()
        save_device(out, "stale")
        main(
            [
                "coordinator",
                "run",
                str(TINY_JOB),
                "--sites",
                "site-a",
                "--key",
                str(key),
                "--out",
                str(out),
                "--no-release",
                "--no-progress",
                *(["--device", device] if device else []),
            ]
        )  # returns on success
        assert seen[-1] == want, (gpu, device)


def test_the_serverapp_runs_the_job_on_the_saved_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from feta_release.federation import job as fjob
    from feta_release.federation.job import save_device, saved_device

    seen: list[str] = []
    monkeypatch.setattr(fjob, "_run", lambda d, signed, device, public: seen.append(device.type))
    fed = prepare_federation(tmp_path / "fed", tiny_sites(n_sites=2))
    signed, _ = sign_job_file(fed, tiny_job(), "job-saved")
    out = tmp_path / "out"
    out.mkdir()
    assert saved_device(out) == "cpu"  # none saved (a job submitted otherwise): the CPU, as before the option
    run_harness_job(fed, harness(fed), signed, out)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    save_device(out, "cuda")
    run_harness_job(fed, harness(fed), signed, out)
    assert seen == ["cpu", "cuda"]


def test_a_bad_device_file_ends_as_the_jobs_error_event(tmp_path: Path) -> None:
    """The ServerApp's device comes from OUT/coordinator_device.json: an unreadable one is a one-line error
    event in progress.jsonl (what `coordinator run` prints), not a traceback, and no site is asked
    anything."""
    from feta_release.federation.job import DEVICE_FILE

    fed = prepare_federation(tmp_path / "fed", tiny_sites(n_sites=2))
    signed, _ = sign_job_file(fed, tiny_job(), "job-badfile")
    out = tmp_path / "out"
    out.mkdir()
    grid = harness(fed)
    for text in ("{not json", '{"gpu": "cuda"}', '{"device": "tpu"}'):
        (out / DEVICE_FILE).write_text(text)
        with pytest.raises(ConfigError):
            run_harness_job(fed, grid, signed, out)
        last = json.loads((out / "progress.jsonl").read_text().splitlines()[-1])
        assert last["phase"] == "error" and (
            "coordinator_device.json" in last["message"] or "tpu" in last["message"]
        )
    assert grid.sent == []


def test_run_job_refuses_cuda_without_a_gpu_before_asking_any_site(no_gpu: None, tmp_path: Path) -> None:
    fed = prepare_federation(tmp_path / "fed", tiny_sites(n_sites=2))
    signed, _ = sign_job_file(fed, tiny_job(), "job-nogpu")
    grid = harness(fed)
    with pytest.raises(ConfigError, match="no CUDA device"):
        run_harness_job(fed, grid, signed, tmp_path / "out", device="cuda")
    assert grid.sent == []
    last = json.loads((tmp_path / "out" / "progress.jsonl").read_text().splitlines()[-1])
    assert last["phase"] == "error" and "no CUDA device" in last["message"]  # what `coordinator run` prints


# -- node start
# --------------------------------------------------------------------------------------------------


def test_node_start_refuses_cuda_without_a_gpu_before_anything_is_opened_or_started(
    no_gpu: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import edge.launch as launch

    started: list[Any] = []
    monkeypatch.setattr(launch, "ManagedProcess", lambda *a, **kw: started.append(a))
    files = {}
    for opt in ("--data", "--policy", "--trusted", "--site-key", "--data-secret"):
        files[opt] = tmp_path / opt.strip("-")
        files[opt].write_text("not read: the device is checked first")
    site = tmp_path / "site"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "node",
                "start",
                *[w for o, p in files.items() for w in (o, str(p))],
                "--ledger",
                str(site / "ledger.db"),
                "--work-dir",
                str(site / "work"),
                "--insecure",
                "--device",
                "cuda",
            ]
        )
    _refused_in_one_line(exc, capsys)
    assert not site.exists() and started == []  # no ledger, no work directory, no process


def test_the_node_config_carries_a_non_cpu_device_to_the_site(tmp_path: Path) -> None:
    from edge.kit import read_node_toml
    from edge.launch import NodeSettings
    from edge.site import CFG_DEVICE

    paths = dict.fromkeys(
        ("data", "policy", "trusted_policy_key", "ledger", "site_key", "data_secret"), tmp_path / "f"
    )
    # a CPU node's config (and cache key) as before
    assert CFG_DEVICE not in NodeSettings(**paths).node_config()
    assert NodeSettings(**paths, device="auto").node_config()[CFG_DEVICE] == "auto"
    toml = tmp_path / "node.toml"
    toml.write_text("[node]\n" + "".join(f'{k} = "f"\n' for k in paths) + 'device = "cuda"\n')
    assert read_node_toml(toml)["device"] == "cuda"  # node.toml may hold it too, as every node start option


def test_a_round_is_refused_before_its_charge_when_the_nodes_gpu_is_gone(no_gpu: None) -> None:
    """The rounds' admissions (run before the ledger charge) resolve the node's device: a GPU that vanished
    after the node started refuses the round instead of charging for a computation that cannot run."""
    from types import SimpleNamespace

    from edge import clientapp
    from feta_release.models import build_denoiser

    cfg = tiny_job()
    weights = {k: v.numpy() for k, v in build_denoiser(cfg.model, (1, 28, 28), 10).state_dict().items()}
    site = SimpleNamespace(data=SimpleNamespace(image_shape=(1, 28, 28), n_classes=10), device="cuda")
    job, req = SimpleNamespace(config=cfg), SimpleNamespace(arrays=weights, doc={})
    with pytest.raises(ConfigError, match="no CUDA device"):
        clientapp._fitting_weights(site, job, req)  # type: ignore[arg-type]
    site.device = "auto"
    clientapp._fitting_weights(site, job, req)  # type: ignore[arg-type]
    assert clientapp.site_device(site) == torch.device("cpu")  # type: ignore[arg-type]


def test_a_gpu_that_is_listed_but_cannot_compute_refuses_the_round_in_a_fixed_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``is_available`` reads a cached device count: a GPU left broken by an earlier CUDA error (or out of
    memory) still says True. The admission makes it run one small operation; its failure refuses the round
    before the charge, in a fixed line (the CUDA error's own text stays on the site). Here torch says a GPU is
    there and there is none (a CPU build), so the operation fails as a broken one would."""
    from types import SimpleNamespace

    from edge import clientapp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    site = SimpleNamespace(device="cuda")
    with pytest.raises(ConfigError) as exc:
        clientapp.site_device(site)  # type: ignore[arg-type]
    assert str(exc.value) == (
        "--device cuda: the node's GPU failed a test operation (broken CUDA state or out of "
        "memory); nothing charged for this round; restart the node or use --device cpu"
    )


# -- cpu / auto compute what the default does
# ----------------------------------------------------------------------


def _seed_release_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fixed generators in place of the OS-seeded ones (fresh for each run): two runs then draw the same
    noise."""
    from edge import protocol

    seeds = itertools.count()
    monkeypatch.setattr(protocol.ReleaseRng, "torch", lambda self: torch.Generator().manual_seed(next(seeds)))
    monkeypatch.setattr(protocol.ReleaseRng, "numpy", lambda self: np.random.default_rng(next(seeds)))


def _released_weights(
    root: Path, monkeypatch: pytest.MonkeyPatch, devices: dict[str, str] | None = None, **device: str
) -> dict[str, torch.Tensor]:
    from feta_release.models.model_file import read_model_file

    _seed_release_noise(monkeypatch)
    fed = prepare_federation(root / "fed", tiny_sites(n_sites=2))
    signed, _ = sign_job_file(fed, tiny_job(federation={"rounds": 1, "local_steps": 1}), "job-device")
    res = run_harness_job(fed, harness(fed, devices=devices), signed, root / "out", **device)
    assert res.rounds_done == 1 and res.skipped == {}
    return read_model_file(root / "out" / "model.pt")["state_dict"]


def test_cpu_and_auto_without_a_gpu_release_byte_identical_weights(
    no_gpu: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from feta_release.stages.context import initial_denoiser

    default = _released_weights(tmp_path / "default", monkeypatch)
    chosen = _released_weights(
        tmp_path / "chosen", monkeypatch, {"site-a": "cpu", "site-b": "auto"}, device="auto"
    )
    assert default.keys() == chosen.keys()
    for k, v in default.items():
        assert v.device.type == "cpu" and v.dtype == chosen[k].dtype
        assert v.numpy().tobytes() == chosen[k].numpy().tobytes(), k
    init = initial_denoiser(tiny_job(), (1, 28, 28), 10).state_dict()
    # the round did train (not a vacuous check)
    assert any(not torch.equal(v, init[k]) for k, v in default.items())


def test_the_nodes_rounds_on_cpu_are_byte_identical_to_the_default(tmp_path: Path) -> None:
    """``dpsgd_round`` and ``gradient_contribution`` with ``device="cpu"``: the same generators, the same
    output."""
    from edge.fedsgd import gradient_contribution
    from edge.protocol import Request, planned
    from edge.releases import dpsgd_round
    from edge.site import site_for
    from feta_release.models import build_denoiser
    from feta_release.policy.jobs import verify_job

    fed = prepare_federation(tmp_path / "fed", tiny_sites(n_sites=2))
    for cfg in (tiny_job(), full_job(federation={"secure_aggregation": True, "fedsgd": True, "rounds": 1})):
        signed, _ = sign_job_file(fed, cfg, f"job-{cfg.federation.fedsgd}")
        site = site_for(fed.sites[0].node_config())
        job = verify_job(signed, site.policy, source="test")
        event, _ = planned(site, job, "dpsgd")
        weights = {k: v.numpy() for k, v in build_denoiser(cfg.model, (1, 28, 28), 10).state_dict().items()}
        out = []
        for device in ((), ("cpu",)):
            gen = torch.Generator().manual_seed(7)
            if cfg.federation.fedsgd:
                req = Request("r", 0, event, {}, weights)
                out.append(
                    {"sum": gradient_contribution(site, job, req, np.random.default_rng(3), gen, *device)}
                )
            else:
                out.append(dpsgd_round(site.data, cfg, weights, event, gen, site.n_public, None, *device))
        assert out[0].keys() == out[1].keys()
        assert all(out[0][k].tobytes() == out[1][k].tobytes() for k in out[0]), cfg.federation.fedsgd


# -- demo
# --------------------------------------------------------------------------------------------------------


def test_demo_refuses_cuda_without_a_gpu_before_anything_is_written(
    no_gpu: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--out", str(out), "--quick", "--device", "cuda", "--no-progress"])
    _refused_in_one_line(exc, capsys)
    assert not out.exists()  # no keys, policies or data split written, no process started


def test_demo_hands_its_device_to_the_nodes_the_coordinator_and_the_sample_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` resolves once (here to the CPU) and every part computes there: each site node's settings, the
    ServerApp's device file (via ``run_signed_job``) and the final sample grid."""
    from types import SimpleNamespace

    import coordinator.demo as demo
    import coordinator.finalize as finalize
    import edge.launch as launch

    seen: dict[str, list[str]] = {"node": [], "job": [], "grid": []}
    sites = [
        SimpleNamespace(
            site_id="site-a",
            data=tmp_path / "d",
            policy=tmp_path / "p",
            policy_pub=tmp_path / "pp",
            ledger=tmp_path / "l",
            site_key=tmp_path / "k",
            data_secret=tmp_path / "s",
        )
    ]
    monkeypatch.setattr(demo, "start_superlink", lambda settings: SimpleNamespace(pid=1, stop=lambda: None))
    monkeypatch.setattr(
        launch,
        "start_node",
        lambda ns: seen["node"].append(ns.device) or SimpleNamespace(pid=2, stop=lambda: None),
    )
    address = demo._start_processes(
        tmp_path, SimpleNamespace(sites=sites), [], SimpleNamespace(log=print), "cpu"
    )
    assert address.startswith("127.0.0.1:") and seen["node"] == ["cpu"]

    monkeypatch.setattr(demo, "_prepare", lambda *a: (SimpleNamespace(sites=[], coordinator_pub="c"), None))
    monkeypatch.setattr(
        demo, "_start_processes", lambda out, fed, procs, console, device: seen["node"].append(device)
    )
    monkeypatch.setattr(demo, "_run_job", lambda *a, **k: seen["job"].append(a[-1]) or {})
    monkeypatch.setattr(
        finalize, "sample_grid", lambda out, device, sink=None: seen["grid"].append(device) or Path("x")
    )
    monkeypatch.setattr(finalize, "privacy_report", lambda out, sink=None: None)
    # stop there
    monkeypatch.setattr(demo, "_copy", lambda src, dst: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit):
        main(["demo", "--out", str(tmp_path / "demo"), "--quick", "--device", "auto", "--no-progress"])
    assert seen == {"node": ["cpu", "cpu"], "job": ["cpu"], "grid": ["cpu"]}
