"""The EMA of the released model is per DP-SGD step wherever the steps run (docs/architecture.md): a site
continues the coordinator's EMA over its round's steps, its warm-up counted in job steps, and the coordinator
FedAvgs the sites' EMAs. A one-fold-per-round EMA (``d ** local_steps``) made a one-round job's model mostly
the warmed-up start: not the model ``train``'s per-step EMA releases."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from feta_release.accounting import PrivacyEvent
from feta_release.federation import messages as fm
from feta_release.federation.driver import JobDriver, global_ema
from feta_release.models import build_denoiser
from feta_release.training.dpsgd import DPSGDTrainer
from tests.support.federation import tiny_job


def _site(n: int = 12, seed: int = 0) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    return SimpleNamespace(
        images=rng.random((n, 1, 16, 16), dtype=np.float32),
        labels=rng.integers(0, 10, n),
        image_shape=(1, 16, 16),
        n_classes=10,
    )


def _recorded_iterates(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """The model's weights after every DP-SGD step the trainer takes."""
    seen: list[dict[str, torch.Tensor]] = []
    step = DPSGDTrainer.step

    def recording(self: DPSGDTrainer, images: torch.Tensor, labels: torch.Tensor) -> object:
        out = step(self, images, labels)
        seen.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return out

    monkeypatch.setattr(DPSGDTrainer, "step", recording)
    return seen


@pytest.mark.parametrize("first_step", [0, 6])
def test_a_sites_round_returns_the_per_step_ema_of_its_iterates_continuing_the_global_one(
    monkeypatch, first_step
):
    from edge.releases import dpsgd_round

    cfg = tiny_job(dpsgd={"batch": 4, "physical_batch": 4, "ema": 0.95})
    torch.manual_seed(1)
    weights = {k: v.numpy() for k, v in build_denoiser(cfg.model, (1, 16, 16), 10).state_dict().items()}
    given = {k: (v + 0.25).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in weights.items()}
    iterates = _recorded_iterates(monkeypatch)
    out = dpsgd_round(
        _site(),
        cfg,
        fm.with_ema(copy.deepcopy(weights), given),
        PrivacyEvent("dpsgd", 1.5, 4 / 12, 3),
        torch.Generator().manual_seed(0),
        12,
        first_step=first_step,
    )
    new_weights, ema = fm.split_ema(out)
    assert len(iterates) == 3 and set(ema) == set(new_weights) == set(weights)
    shadow = {k: torch.from_numpy(np.array(v)) for k, v in given.items()}
    for t, w in enumerate(iterates, start=first_step):  # training.ema.EMA's warm-up, counted in job steps
        d = min(0.95, (1 + t) / (10 + t))
        for k, v in w.items():
            shadow[k] = shadow[k] * d + v * (1 - d) if v.dtype.is_floating_point else v.clone()
    for k, v in shadow.items():
        assert np.allclose(ema[k], v.numpy(), rtol=1e-5, atol=1e-6), k
    assert all(np.array_equal(new_weights[k], iterates[-1][k].numpy()) for k in weights)


def test_a_round_without_an_ema_starts_it_from_the_weights_as_the_trainer_does(monkeypatch):
    """Round 0 of one site: the returned EMA is ``DPSGDTrainer``'s own (the one ``train``'s stage
    releases)."""
    from edge.releases import dpsgd_round

    cfg = tiny_job(dpsgd={"batch": 4, "physical_batch": 4, "ema": 0.95})
    torch.manual_seed(1)
    weights = {k: v.numpy() for k, v in build_denoiser(cfg.model, (1, 16, 16), 10).state_dict().items()}
    event = PrivacyEvent("dpsgd", 1.5, 4 / 12, 2)
    plain = dpsgd_round(_site(), cfg, copy.deepcopy(weights), event, torch.Generator().manual_seed(0), 12)
    sent = dpsgd_round(
        _site(),
        cfg,
        fm.with_ema(copy.deepcopy(weights), copy.deepcopy(weights)),
        event,
        torch.Generator().manual_seed(0),
        12,
    )
    assert set(plain) == set(sent) and all(np.array_equal(plain[k], sent[k]) for k in plain)


def test_a_round_whose_ema_does_not_fit_the_model_is_refused_before_the_charge():
    """Attack: an EMA with NaN (or of another shape) beside honest weights: the round's check refuses it (it
    runs before the node charges), as it refuses such weights."""
    from edge.releases import check_round
    from feta_release.errors import PrivacyError

    cfg = tiny_job()
    weights = {k: v.numpy() for k, v in build_denoiser(cfg.model, (1, 16, 16), 10).state_dict().items()}
    check_round(cfg, (1, 16, 16), 10, fm.with_ema(weights, weights))
    first = sorted(weights)[0]
    for bad in ({**weights, first: np.full_like(weights[first], np.nan)}, {first: weights[first]}):
        with pytest.raises(PrivacyError):
            check_round(cfg, (1, 16, 16), 10, fm.with_ema(weights, bad))


def test_the_coordinator_fedavgs_the_sites_emas_with_the_models_weights():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    cfg = SimpleNamespace(
        federation=SimpleNamespace(min_sites=1, local_steps=4), dpsgd=SimpleNamespace(ema=0.9, public_batch=0)
    )
    ema = global_ema(model, cfg)  # type: ignore[arg-type]
    start = {k: v.clone() for k, v in ema.shadow.items()}
    shift = {1: 1.0, 2: 4.0}  # site a (node 1, size 100) moves everything by 1, site b (size 300) by 4

    class Grid:
        def send_and_receive(self, msgs, timeout):
            out = []
            for m in msgs:
                _, arrays = fm.read_payload(m.content)
                c = shift[m.metadata.dst_node_id]
                out.append(
                    SimpleNamespace(
                        metadata=SimpleNamespace(src_node_id=m.metadata.dst_node_id),
                        has_error=lambda: False,
                        content=fm.make_payload({}, {k: v + c for k, v in arrays.items()}),
                    )
                )
            return out

    drv = JobDriver.__new__(JobDriver)
    drv.grid, drv.signed_job, drv.query_timeout, drv.cfg = Grid(), {}, 1.0, cfg
    drv.sites = {"a": SimpleNamespace(node_id=1, size=100), "b": SimpleNamespace(node_id=2, size=300)}
    drv.planned_dpsgd, drv.skipped, drv.emit = {}, {}, lambda *a, **k: None
    assert drv._round(2, model, ema) == ["a", "b"]
    for k, v in ema.shadow.items():
        assert torch.allclose(v, start[k] + 0.25 * 1.0 + 0.75 * 4.0), k
    # rounds 0..2 of 4 local steps: the next round's warm-up continues from here
    assert ema.num_updates == 3 * 4
