"""Parameter-efficient DP-SGD (``[dpsgd] trainable``): frozen parameters take no clip share, no noise, no
update."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from feta_release.config import JobConfig
from feta_release.errors import ConfigError
from feta_release.models.edm import build_denoiser
from feta_release.models.trainable import set_trainable, trainable_names
from feta_release.models.unet import SelfAttention
from feta_release.training.dpsgd import DPSGDTrainer

SHAPE = (1, 8, 8)


def _job(**dpsgd) -> JobConfig:
    base = {
        "batch": 4,
        "steps": 3,
        "physical_batch": 4,
        "noise_multiplicity": 1,
        "clip": 1.0,
        "lr": 1e-2,
        "trainable": "norm_attention",
    }
    return JobConfig().replace(
        model={"channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [4]},
        dpsgd={**base, **dpsgd},
    )


def _model(cfg: JobConfig) -> nn.Module:
    """A denoiser whose zero-initialised output layers are moved off zero (as pretraining leaves them): at
    init only the output convolution has a gradient."""
    torch.manual_seed(0)
    m = build_denoiser(cfg.model, SHAPE, 3)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def _data(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, *SHAPE, generator=g) * 2 - 1, torch.randint(0, 3, (n,), generator=g)


def test_norm_attention_trains_norms_attention_and_conditioning_only():
    m = _model(_job())
    names = set(trainable_names(m, "norm_attention"))
    attention = [n for n, mod in m.named_modules() if isinstance(mod, SelfAttention)]
    assert attention, "the test model has an attention block"
    for n, _ in m.named_parameters():
        leaf = n.rsplit(".", 2)[-2]
        want = (
            leaf.startswith("norm")
            or leaf in ("map0", "map1", "class_embed", "affine")
            or any(n.startswith(a + ".") for a in attention)
        )
        assert (n in names) == want, n
    assert trainable_names(m, "all") == [n for n, _ in m.named_parameters()]


def test_noise_dimension_is_the_trainable_parameter_count():
    cfg = _job()
    m = _model(cfg)
    total = sum(p.numel() for p in m.parameters())
    sigma, q, n = 50.0, 0.5, 12
    tr = DPSGDTrainer(m, cfg, sigma, q, torch.Generator().manual_seed(2), image_shape=SHAPE, n_classes=3)
    trainable = {k for k, p in m.named_parameters() if p.requires_grad}
    assert tr.noise_dimension == sum(p.numel() for p in m.parameters() if p.requires_grad) < total / 2
    noisy, _ = tr.noisy_gradient(*_data(n))
    assert set(noisy) == trainable  # no noise (and no gradient) for a frozen parameter
    values = torch.cat([v.flatten() for v in noisy.values()])
    assert values.numel() == tr.noise_dimension
    # the signal (<= q*N clipped vectors of norm C, divided by q*N) is tiny next to sigma*C/(q*N) per
    # coordinate
    assert float(values.std()) == pytest.approx(sigma * cfg.dpsgd.clip / (q * n), rel=0.1)


def test_a_frozen_parameter_never_changes_during_dpsgd():
    cfg = _job()
    m = _model(cfg)
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    tr = DPSGDTrainer(m, cfg, 1.0, 0.5, torch.Generator().manual_seed(3), image_shape=SHAPE, n_classes=3)
    tr.run(*_data(), 3)
    frozen = [k for k, p in m.named_parameters() if not p.requires_grad]
    assert frozen
    for k, p in m.named_parameters():
        assert torch.equal(p.detach(), before[k]) == (k in frozen), k
    ema = tr.ema_model()
    for k, p in ema.named_parameters():
        if k in frozen:
            assert torch.equal(p.detach(), before[k]), k


def test_the_clip_bounds_the_trainable_vector_alone():
    """One example, q = 1, no noise to speak of: the update is that example's TRAINABLE gradient clipped to C.
    Had the frozen gradient counted in the norm, the trainable part would be clipped below C."""
    clip = 1e-3  # far below any gradient's norm: every example is clipped
    cfg = _job(clip=clip, batch=1)
    m = _model(cfg)
    tr = DPSGDTrainer(
        m, cfg, 1e-9, 1.0, torch.Generator().manual_seed(4), image_shape=SHAPE, n_classes=3, n_public=1
    )
    x, y = _data(1)
    noisy, stats = tr.noisy_gradient(x, y)
    assert stats.batch_size == 1 and stats.clipped_fraction == 1.0
    norm = torch.linalg.vector_norm(torch.cat([v.flatten() for v in noisy.values()]))
    assert float(norm) == pytest.approx(clip, rel=1e-4)


@pytest.mark.parametrize("engine", ["hooks", "vmap"])
def test_both_engines_give_the_same_trainable_gradients(engine):
    cfg = _job(per_example=engine, noise_multiplicity=2)
    ref_cfg = _job(per_example="vmap", noise_multiplicity=2)
    got, _ = DPSGDTrainer(
        _model(cfg), cfg, 1e-9, 1.0, torch.Generator().manual_seed(5), image_shape=SHAPE, n_classes=3
    ).noisy_gradient(*_data(4))
    ref, _ = DPSGDTrainer(
        _model(ref_cfg), ref_cfg, 1e-9, 1.0, torch.Generator().manual_seed(5), image_shape=SHAPE, n_classes=3
    ).noisy_gradient(*_data(4))
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-7)


def test_all_leaves_the_model_alone_and_unknown_modes_are_refused():
    m = nn.Linear(2, 2)
    m.bias.requires_grad_(False)
    assert set_trainable(m, "all") == 4  # a caller's own freezing is kept
    with pytest.raises(ValueError):
        set_trainable(m, "lora?")
    with pytest.raises(ConfigError, match="trainable"):
        JobConfig().replace(dpsgd={"trainable": "some"})
    with pytest.raises(ConfigError, match="FedSGD"):
        JobConfig().replace(
            dpsgd={"trainable": "norm_attention", "steps": 5},
            federation={"fedsgd": True, "secure_aggregation": True, "sites": ["a", "b"]},
        )
