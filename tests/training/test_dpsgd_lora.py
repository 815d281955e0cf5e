"""DP-SGD of low-rank adapters (``[dpsgd] trainable = "lora"``, models/lora.py): attaching changes no output,
only the adapters are clipped, noised and updated, both per-example engines agree on them, and what leaves
(a federated round's weights, the ONNX export) is the plain denoiser with the adapters merged in."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from feta_release.config import JobConfig
from feta_release.errors import ConfigError
from feta_release.models.edm import build_denoiser
from feta_release.models.lora import attach_lora, has_lora, merge_lora
from feta_release.models.trainable import trainable_names
from feta_release.training.dpsgd import DPSGDTrainer

SHAPE = (1, 8, 8)
MODEL = {"channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [4]}


def _job(**dpsgd) -> JobConfig:
    base = {
        "batch": 4,
        "steps": 3,
        "physical_batch": 4,
        "noise_multiplicity": 1,
        "clip": 1.0,
        "lr": 1e-2,
        "trainable": "lora",
        "lora_rank": 2,
    }
    return JobConfig().replace(model=MODEL, dpsgd={**base, **dpsgd})


def _model(cfg: JobConfig) -> nn.Module:
    torch.manual_seed(0)
    m = build_denoiser(cfg.model, SHAPE, 3)
    with torch.no_grad():  # off the zero-initialised output layers, as pretraining leaves them
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def _data(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, *SHAPE, generator=g) * 2 - 1, torch.randint(0, 3, (n,), generator=g)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, *SHAPE, generator=g), torch.tensor([0.3, 1.0, 4.0]), torch.tensor([0, 2, 3])


@settings(max_examples=3, deadline=None)
@given(st.integers(1, 5), st.integers(0, 1000))
def test_adapters_change_nothing_at_attach_and_merge_into_the_same_function(rank, seed):
    m = _model(_job()).eval()
    x, s, y = _inputs()
    before = m(x, s, y)
    n = attach_lora(m, rank)
    assert torch.equal(before, m(x, s, y))  # lora_up starts at zero
    assert n == sum(p.numel() for p in m.parameters() if p.requires_grad) > 0
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".lora_up." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    adapted = m(x, s, y)
    merged = merge_lora(copy.deepcopy(m))
    assert not has_lora(merged) and has_lora(m)  # a copy merges on its own
    plain = build_denoiser(_job().model, SHAPE, 3).eval()
    plain.load_state_dict(merged.state_dict())  # strict: the plain denoiser's keys and shapes
    assert torch.allclose(plain(x, s, y), adapted, atol=1e-5)


def test_dpsgd_trains_and_noises_the_adapters_only():
    cfg = _job()
    m = _model(cfg)
    frozen = {n: p.detach().clone() for n, p in m.named_parameters()}
    tr = DPSGDTrainer(m, cfg, 2.0, 0.5, torch.Generator().manual_seed(2), image_shape=SHAPE, n_classes=3)
    adapters = trainable_names(m, "lora")
    assert adapters and tr.noise_dimension == sum(p.numel() for n, p in m.named_parameters() if n in adapters)
    assert tr.noise_dimension < 0.5 * sum(frozen[n].numel() for n in frozen)
    assert [n for n, p in m.named_parameters() if p.requires_grad] == adapters
    x, y = _data()
    tr.run(x, y, 3)
    for n, p in m.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # the base weights move only by the merge
    assert any(not torch.equal(p, torch.zeros_like(p)) for n, p in m.named_parameters() if ".lora_up." in n)


def test_the_layer_hooks_take_the_adapters_and_agree_with_torch_func():
    """``auto`` picks the hooks (cross-checked against torch.func on a public dummy batch); one step with
    either engine and the same private stream gives the same adapters."""
    x, y = _data()
    out = {}
    for engine in ("hooks", "vmap"):
        cfg = _job(per_example=engine)
        m = _model(cfg)
        tr = DPSGDTrainer(m, cfg, 2.0, 0.5, torch.Generator().manual_seed(2), image_shape=SHAPE, n_classes=3)
        assert tr.engine == engine
        tr.run(x, y, 1)
        out[engine] = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    auto = _model(_job())
    tr = DPSGDTrainer(auto, _job(), 2.0, 0.5, torch.Generator(), image_shape=SHAPE, n_classes=3)
    assert tr.engine == "hooks"
    for n, v in out["hooks"].items():
        assert torch.allclose(v, out["vmap"][n], atol=1e-5), n


@pytest.mark.slow  # a padded site round
def test_a_federated_round_returns_the_plain_models_tensors_with_the_adapters_merged():
    from edge.releases import dpsgd_round
    from feta_release.accounting import PrivacyEvent
    from feta_release.data import ImageDataset
    from feta_release.federation.messages import split_ema

    cfg = _job()
    m = _model(cfg)
    weights = {k: v.numpy().copy() for k, v in m.state_dict().items()}
    x, y = _data()
    ds = ImageDataset(images=((x + 1) / 2).numpy(), labels=y.numpy(), class_names=("a", "b", "c"))
    out = dpsgd_round(
        ds, cfg, weights, PrivacyEvent("dpsgd", 2.0, 0.5, 2), torch.Generator().manual_seed(4), n_public=12
    )
    out, ema = split_ema(out)
    assert set(out) == set(weights) == set(ema)  # the plain model's tensors, of the weights and of their EMA
    assert all(out[k].shape == weights[k].shape and np.isfinite(out[k]).all() for k in out)
    assert all(ema[k].shape == weights[k].shape and np.isfinite(ema[k]).all() for k in ema)
    assert any(not np.array_equal(out[k], weights[k]) for k in out if k.endswith("weight"))


def test_the_onnx_export_carries_the_merged_weights():
    ort = pytest.importorskip("onnxruntime")
    from feta_release.release.onnx_export import export_denoiser

    m = _model(_job()).eval()
    attach_lora(m, 2)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".lora_up." in name:
                p.normal_(0, 0.1)
    x, s, y = _inputs()
    want = m(x, s, y).detach().numpy()
    model = export_denoiser(merge_lora(m), SHAPE)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, dict(zip(names, [x.numpy(), s.numpy(), y.numpy()])))[0]
    assert np.abs(got - want).max() < 1e-4


def test_the_config_names_lora_and_its_rank_and_hashes_as_before_without_it():
    assert "lora_rank" not in JobConfig().to_dict()["dpsgd"]
    assert _job().to_dict()["dpsgd"]["lora_rank"] == 2
    with pytest.raises(ConfigError, match="lora_rank must be >= 1"):
        _job(lora_rank=0)
    with pytest.raises(ConfigError, match='"lora" is not wired into FedSGD'):
        _job().replace(federation={"fedsgd": True, "secure_aggregation": True, "sites": ["a", "b"]})
