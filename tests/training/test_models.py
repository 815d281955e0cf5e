"""UNet / EDM denoiser / loss / auxiliary generator: shapes, sizes, behaviour, torch.func and ONNX."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from feta_release.config import ModelSection
from feta_release.errors import ConfigError
from feta_release.models import (
    AuxGenerator,
    UNet,
    build_denoiser,
    count_parameters,
    denoiser_from_spec,
    denoiser_spec,
    draw_loss_randomness,
    edm_loss,
    edm_loss_from_randomness,
    edm_loss_single,
)
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)
from tests.support.training import TINY, tiny_denoiser


def test_default_unet_size_and_shapes() -> None:
    d = build_denoiser(ModelSection(), (1, 28, 28), 10)
    n = count_parameters(d)
    assert 1.3e6 < n < 1.6e6, n  # the paper's 28px network has 1.49M
    x = torch.randn(3, 1, 28, 28)
    out = d(x, torch.tensor([0.01, 1.0, 80.0]), torch.tensor([0, 9, 10]))
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert not list(d.buffers())  # nothing that DP-SGD / functional_call would have to carry
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in d.modules())


@pytest.mark.parametrize(
    "cfg,shape",
    [
        (ModelSection(channel_mult=(2, 4), attn_resolutions=(16,)), (3, 32, 32)),
        (ModelSection(channels=16, channel_mult=(1, 2), num_res_blocks=1, attn_resolutions=()), (1, 28, 28)),
        (
            ModelSection(channels=16, channel_mult=(1, 2, 2), num_res_blocks=1, attn_resolutions=(7,)),
            (1, 28, 28),
        ),
    ],
)
def test_other_configs_work(cfg: ModelSection, shape: tuple[int, int, int]) -> None:
    d = build_denoiser(cfg, shape, 10)
    x = torch.randn(2, *shape)
    assert d(x, torch.tensor([0.5, 2.0]), torch.tensor([1, 10])).shape == x.shape


def test_spec_round_trip_rebuilds_same_function() -> None:
    d = tiny_denoiser()
    spec = denoiser_spec(TINY, (1, 16, 16), 3)
    d2 = denoiser_from_spec(spec)
    d2.load_state_dict(d.state_dict())
    x = torch.randn(2, 1, 16, 16)
    s, y = torch.tensor([0.3, 3.0]), torch.tensor([0, 3])
    assert torch.equal(d(x, s, y), d2(x, s, y))
    with pytest.raises(ConfigError):
        denoiser_from_spec({**spec, "kind": "other"})
    with pytest.raises(ConfigError):
        build_denoiser(TINY, (1, 16, 12), 3)


def test_preconditioning_limits() -> None:
    # At tiny sigma, c_skip -> 1 and c_out -> 0: D(x) ~ x whatever the network says.
    d = tiny_denoiser()
    x = torch.rand(2, 1, 16, 16) * 2 - 1
    out = d(x, torch.full((2,), 1e-4), torch.tensor([0, 1]))
    assert torch.allclose(out, x, atol=1e-3)
    # The network sees ln(sigma)/4 and labels: different sigma/labels give different outputs.
    a = d(x, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    b = d(x, torch.tensor([1.0, 1.0]), torch.tensor([1, 1]))
    assert not torch.allclose(a, b)


def test_loss_randomness_distribution_and_label_dropout_rate() -> None:
    g = torch.Generator().manual_seed(0)
    rnd = draw_loss_randomness(4000, (1, 2, 2), noise_multiplicity=5, label_dropout=0.1, generator=g)
    assert (
        rnd.noise.shape == (4000, 5, 1, 2, 2) and rnd.sigma.shape == (4000, 5) and rnd.drop.shape == (4000, 5)
    )
    rate = rnd.drop.float().mean().item()
    assert abs(rate - 0.1) < 0.01, rate  # 20000 draws: std of the rate ~0.002
    ln = rnd.sigma.log()
    assert abs(ln.mean().item() + 1.2) < 0.05 and abs(ln.std().item() - 1.2) < 0.05
    none = draw_loss_randomness(100, (1, 2, 2), label_dropout=0.0, generator=g)
    assert not none.drop.any()


def test_label_dropout_uses_null_label() -> None:
    seen: list[torch.Tensor] = []

    def fake_denoise(x, s, y):  # records labels the loss hands to the denoiser
        seen.append(y.clone())
        return x * 0

    x0 = torch.zeros(6, 1, 4, 4)
    rnd = draw_loss_randomness(6, (1, 4, 4), noise_multiplicity=2, generator=torch.Generator().manual_seed(1))
    rnd.drop[:] = torch.tensor([[True, False]] * 6)
    edm_loss_from_randomness(fake_denoise, x0, torch.arange(6) % 3, rnd, null_label=3, sigma_data=0.5)
    y = seen[0].reshape(6, 2)
    assert (y[:, 0] == 3).all() and torch.equal(y[:, 1], torch.arange(6) % 3)


def test_loss_finite_and_decreases_when_overfitting() -> None:
    torch.manual_seed(0)
    d = build_denoiser(TINY, (1, 8, 8), 2)
    x0 = torch.rand(4, 1, 8, 8) * 2 - 1
    y = torch.tensor([0, 1, 0, 1])
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    # Fixed randomness: an exact measure of progress on the same draws.
    rand = draw_loss_randomness(
        4, (1, 8, 8), noise_multiplicity=8, generator=torch.Generator().manual_seed(9)
    )
    with torch.no_grad():
        before = edm_loss_from_randomness(d, x0, y, rand).mean().item()
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        loss = edm_loss(d, x0, y, noise_multiplicity=2, label_dropout=0.1, generator=g)
        assert loss.shape == (4,) and torch.isfinite(loss).all()
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
    with torch.no_grad():
        after = edm_loss_from_randomness(d, x0, y, rand).mean().item()
    assert after < 0.8 * before, (before, after)


def test_single_loss_matches_batched_loss() -> None:
    d = tiny_denoiser()
    x0 = torch.rand(3, 1, 16, 16) * 2 - 1
    y = torch.tensor([0, 1, 2])
    rnd = draw_loss_randomness(
        3, (1, 16, 16), noise_multiplicity=4, generator=torch.Generator().manual_seed(2)
    )
    batched = edm_loss_from_randomness(d, x0, y, rnd)
    singles = torch.stack(
        [
            edm_loss_single(d, x0[i], y[i], rnd.noise[i], rnd.sigma[i], rnd.drop[i], null_label=3)
            for i in range(3)
        ]
    )
    assert torch.allclose(batched, singles, atol=1e-5)


def test_torch_func_per_example_grads_match_loop() -> None:
    d = tiny_denoiser()
    params = {k: v.detach() for k, v in d.named_parameters()}
    x0 = torch.rand(3, 1, 16, 16) * 2 - 1
    y = torch.tensor([0, 2, 1])
    rnd = draw_loss_randomness(
        3, (1, 16, 16), noise_multiplicity=2, generator=torch.Generator().manual_seed(3)
    )

    def loss_one(p, x, yy, noise, sigma, drop):
        fn = lambda a, s, lab: torch.func.functional_call(d, p, (a, s, lab))  # noqa: E731
        return edm_loss_single(fn, x, yy, noise, sigma, drop, null_label=d.null_label)

    grads = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0, 0, 0, 0))(
        params, x0, y, rnd.noise, rnd.sigma, rnd.drop
    )
    for i in range(3):
        d.zero_grad()
        edm_loss_single(d, x0[i], y[i], rnd.noise[i], rnd.sigma[i], rnd.drop[i], null_label=3).backward()
        for name, p in d.named_parameters():
            assert torch.allclose(grads[name][i], p.grad, atol=1e-5, rtol=1e-4), name


def test_onnx_export_matches_torch(tmp_path) -> None:
    ort = pytest.importorskip("onnxruntime")
    import onnx

    from feta_release.release.onnx_export import export_denoiser

    d = tiny_denoiser().eval()
    path = tmp_path / "d.onnx"
    onnx.save(export_denoiser(d, (1, 16, 16)), path)  # the release's own export path
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x3, s3, y3 = torch.randn(3, 1, 16, 16), torch.tensor([0.01, 1.0, 60.0]), torch.tensor([0, 2, 3])
    got = sess.run(None, {"x": x3.numpy(), "sigma": s3.numpy(), "labels": y3.numpy()})[0]
    with torch.no_grad():
        want = d(x3, s3, y3).numpy()
    assert np.max(np.abs(got - want)) < 1e-4


def test_aux_generator_shapes_and_size() -> None:
    g = AuxGenerator(1, 28, 10)
    assert 1.3e6 < count_parameters(g) < 1.8e6
    out = g(torch.randn(5, 60), torch.tensor([0, 1, 2, 3, 9]))
    assert out.shape == (5, 1, 28, 28) and out.min() >= 0 and out.max() <= 1
    g3 = AuxGenerator(3, 32, 4, width=16)
    assert g3(torch.randn(4, 60), torch.arange(4)).shape == (4, 3, 32, 32)
    assert AuxGenerator.from_spec(g3.spec()).spec() == g3.spec()
    with pytest.raises(ConfigError):
        AuxGenerator(1, 4, 10)


def test_unet_rejects_nothing_silently_for_odd_sizes() -> None:
    # 28 -> 14 -> 7 -> 4 and back to 7 -> 14 -> 28: upsampling sizes are fixed at build time.
    net = UNet(1, 28, 2, channels=8, channel_mult=(1, 1, 1, 1), num_res_blocks=1, attn_resolutions=())
    out = net(torch.randn(1, 1, 28, 28), torch.zeros(1), torch.zeros(1, dtype=torch.long))
    assert out.shape == (1, 1, 28, 28)
    assert math.isfinite(out.abs().sum().item())
