"""The ``--device cuda`` path end to end, on a GPU machine. CI is CPU-only: every test here skips
there and says why; ``tests/training/test_device.py`` and ``tests/federation/test_federation_device.py`` cover
the device resolution and refusals that need no GPU.

Run on a GPU machine: ``python -m pytest tests/e2e/test_cuda_path.py tests/training/test_device.py -v``.

What is checked: a whole ``train --device cuda`` job (every stage, DP-SGD included, the ONNX export run by
onnxruntime on the CPU, the site's ledger and the privacy report); a federated job with ``coordinator run
--device cuda`` and ``node start --device cuda`` (in process: warm-up, FedAvg and FedSGD steps, the sites'
rounds, the release); that the arithmetic moved to the GPU computes the same function as on the CPU (DP-SGD's
clipped per-example gradient sum, the sampler with SDEdit starts), since the randomness is drawn on the CPU on
every device (``feta_release.training.device``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CI is CPU-only; run this file on a GPU machine)"
)

SHAPE = (1, 12, 12)


def _model():
    from feta_release.config import load_preset
    from feta_release.models.edm import build_denoiser

    torch.manual_seed(0)
    return build_denoiser(load_preset("tiny").model, SHAPE, 3)  # 8 channels, [1, 2], no attention


def _train(args: list[str]) -> None:
    from feta_release.cli import main

    try:
        main(args)
    except SystemExit as exc:  # click's standalone mode ends with SystemExit(0) on success
        assert exc.code in (0, None), f"train exited {exc.code}"


def test_train_tiny_job_on_cuda_end_to_end(tmp_path: Path) -> None:
    import onnxruntime as ort

    out = tmp_path / "run"
    _train(["train", "--preset", "tiny", "--device", "cuda", "--out", str(out), "--no-progress"])
    assert (out / "COMPLETE").exists()
    (site,) = json.loads((out / "privacy_report.json").read_text())["sites"].values()
    steps = {e["stage"]: e["steps"] for e in site["events"]}
    assert steps["dpsgd"] == 4 and 0 < site["epsilon_total"] <= 10.0 + 1e-9
    z = np.load(out / "synthetic.npz")
    assert z["images"].dtype == np.float32 and np.isfinite(z["images"]).all()
    assert z["images"].min() >= 0.0 and z["images"].max() <= 1.0
    sess = ort.InferenceSession(str(out / "release" / "generator.onnx"), providers=["CPUExecutionProvider"])
    assert sess.get_inputs(), "the exported generator has inputs"


def test_train_with_sdedit_mix_starts_on_cuda(tmp_path: Path) -> None:
    """The sampler's SDEdit starts (aux-generator + central images, made on the CPU) meet the model on the
    GPU."""
    from feta_release.config import load_preset
    from feta_release.data import load_embedded
    from tests.support.training import train_run

    data = load_embedded()
    data = data.subset(np.arange(0, data.n, 10))
    cfg = load_preset("tiny").replace(
        sampler={"start_sigma": 0.7, "start_source": "mix"}, warmup={"frequency_mix_central": True}
    )
    res = train_run(cfg, data, tmp_path / "run", n_synthetic=60, device="cuda")
    z = np.load(tmp_path / "run" / "synthetic.npz")
    assert len(z["labels"]) == 60 and np.isfinite(z["images"]).all() and res.epsilon > 0


def test_dpsgd_clipped_sum_on_cuda_matches_cpu() -> None:
    from feta_release.models.edm import EDMLoss
    from feta_release.training.dpsgd import clipped_gradient_sum

    cpu = _model()
    gpu = copy.deepcopy(cpu).cuda()
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(20, *SHAPE, generator=g) * 2 - 1, torch.randint(0, 3, (20,), generator=g)
    idx = torch.arange(20)
    loss = EDMLoss(SHAPE, 3, noise_multiplicity=2, label_dropout=0.1)
    got = {}
    for name, model in (("cpu", cpu), ("cuda", gpu)):
        summed, _, clipped = clipped_gradient_sum(
            model, loss, x, y, idx, 0.5, 8, torch.Generator().manual_seed(9)
        )
        got[name] = ({k: v.detach().cpu().double() for k, v in summed.items()}, clipped)
    assert got["cpu"][1] == got["cuda"][1]
    for k, ref in got["cpu"][0].items():
        err = float((got["cuda"][0][k] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 1e-3, f"{k}: relative error {err:.2e} between CUDA and CPU"  # tf32 convs land near 3e-4


def test_sampler_on_cuda_matches_cpu_with_sdedit_starts() -> None:
    from feta_release.config import SamplerSection
    from feta_release.models.sampler import generate

    cpu = _model()
    gpu = copy.deepcopy(cpu).cuda()
    cfg = SamplerSection(solver="heun", steps=4)
    init = torch.rand(12, *SHAPE, generator=torch.Generator().manual_seed(5))
    labels = [0, 1, 2] * 4
    a, la = generate(cpu, labels, 7, cfg, init=init)
    b, lb = generate(gpu, labels, 7, cfg, init=init)
    assert b.device.type == "cpu" and torch.equal(la, lb)
    assert float((a - b).abs().max()) < 1e-2


def test_evaluation_classifier_trains_on_cuda_and_returns_a_cpu_network() -> None:
    """``train_classifier(device="cuda")``: the benchmarks' evaluator on the GPU scores as well as on the CPU
    and hands back a CPU network, so ``accuracy`` / ``per_class_accuracy`` take it as they are."""
    from feta_release.data.procedural import generate_dataset
    from feta_release.evaluation import accuracy, per_class_accuracy, train_classifier

    data = generate_dataset("medical", 600, size=28, seed=3)
    train, test = data.subset(np.arange(400)), data.subset(np.arange(400, 600))
    acc = {}
    for device in ("cpu", "cuda"):
        net = train_classifier(train, epochs=6, seed=0, device=device)
        assert {p.device.type for p in net.parameters()} == {"cpu"}
        assert net.fit_log is not None and net.fit_log.epochs >= 1
        acc[device] = accuracy(net, test)
    assert set(per_class_accuracy(net, test)) == set(test.class_names)
    assert acc["cuda"] > 1.5 / test.n_classes and abs(acc["cuda"] - acc["cpu"]) < 0.15, acc


@pytest.mark.parametrize("fedsgd", [False, True], ids=["fedavg", "fedsgd"])
def test_federated_job_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fedsgd: bool) -> None:
    """``coordinator run --device cuda`` and ``node start --device cuda``, in process: the coordinator's
    warm-up and FedAvg / FedSGD steps and every site's DP-SGD or FedSGD gradients run on the GPU; the released
    model, its sample grid and ONNX release come out as on the CPU, and the GPU-written checkpoints load on
    the CPU."""
    import edge.fedsgd as node_fedsgd
    from coordinator.setup import prepare_federation, sign_job_file
    from feta_release.federation import checkpoint_io
    from feta_release.federation import fedsgd as coord_fedsgd
    from feta_release.federation import job as fjob
    from feta_release.models.model_file import read_model_file
    from feta_release.release.jobdir import build_release, sample_grid
    from feta_release.release.verify import verify_release
    from feta_release.signing import load_public_key
    from feta_release.stages.context import initial_denoiser
    from feta_release.training import dpsgd
    from tests.support.federation import full_job, harness, run_harness_job, tiny_sites

    where: set[str] = set()

    # record the device of the model each call gets
    def spy(module: object, name: str, model_at: int) -> None:
        real = getattr(module, name)
        monkeypatch.setattr(
            module,
            name,
            lambda *a, **kw: (
                where.add(f"{name}:{next(a[model_at].parameters()).device.type}") or real(*a, **kw)
            ),
        )

    spy(fjob, "warm_up", 0)
    spy(coord_fedsgd, "coordinator_step", 0)
    spy(dpsgd, "batch_gradients", 0)  # DPSGDTrainer's (per-site rounds)
    spy(node_fedsgd, "batch_gradients", 0)  # a FedSGD round's
    fed = prepare_federation(tmp_path / "fed", tiny_sites(n_sites=2))
    cfg = full_job(federation={"secure_aggregation": True, "fedsgd": True} if fedsgd else {})
    signed, _ = sign_job_file(fed, cfg, "job-cuda")
    out = tmp_path / "out"
    res = run_harness_job(
        fed, harness(fed, devices={s.site_id: "cuda" for s in fed.sites}), signed, out, device="cuda"
    )
    assert res.rounds_done == cfg.federated_rounds and res.skipped == {}
    assert where == {
        "warm_up:cuda",
        "batch_gradients:cuda",
        *(["coordinator_step:cuda"] if fedsgd else []),
    }, where
    weights = read_model_file(out / "model.pt")["state_dict"]
    assert all(v.device.type == "cpu" and torch.isfinite(v).all() for v in weights.values())
    sample_grid(out, per_class=2, device="cuda")
    trust = {s.site_id: load_public_key(s.policy_pub) for s in fed.sites}
    res_v = verify_release(build_release(out, fed.coordinator_key), trust)
    assert res_v.ok, res_v.reason()
    # the GPU-written checkpoints load where no GPU is (map_location cpu), into a CPU model (a resume on the
    # CPU)
    ck = checkpoint_io.load_round(out / "state")
    assert ck is not None and ck["round"] == cfg.federated_rounds
    initial_denoiser(cfg, (1, 28, 28), 10).load_state_dict(ck["model"])
