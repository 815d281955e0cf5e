"""EDM preconditioning (Karras et al. 2022) around the UNet, and the EDM training loss.

Pixels are in [-1, 1] here. ``D(x; sigma, y) = c_skip x + c_out F(c_in x, c_noise, y)`` with
``c_skip = sd^2/(sigma^2+sd^2)``, ``c_out = sigma sd / sqrt(sigma^2+sd^2)``, ``c_in = 1/sqrt(sigma^2+sd^2)``,
``c_noise = ln(sigma)/4`` and ``sd = sigma_data = sqrt(1/3)`` (the std of uniform pixels in [-1, 1]).

Loss (per example, method-details §4): ``ln sigma ~ N(-1.2, 1.2^2)``, ``n = sigma * eps``,
``lambda(sigma) = (sigma^2+sd^2)/(sigma sd)^2``, ``loss = mean_pixels lambda * (D(x0+n; sigma, y') - x0)^2``,
where ``y'`` is the null label with probability ``label_dropout``; K noise draws per example are
AVERAGED into one per-example loss (noise multiplicity: the DP-SGD engine clips the gradient of
that average, so privacy cost is unchanged).

Randomness is separated from computation so that ``torch.func.vmap`` can be used (vmap cannot draw
per-example random numbers from a ``torch.Generator``): :func:`draw_loss_randomness` draws every
random tensor, :func:`edm_loss_from_randomness` / :func:`edm_loss_single` are pure functions of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..config import ModelSection
from ..errors import ConfigError
from ..model_size import check_architecture
from .unet import UNet

SIGMA_DATA = math.sqrt(1.0 / 3.0)
P_MEAN = -1.2
P_STD = 1.2

DenoiseFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class EDMDenoiser(nn.Module):
    """D(x; sigma, y) with EDM preconditioning. ``n_classes`` is also the null label."""

    def __init__(self, net: UNet, sigma_data: float = SIGMA_DATA) -> None:
        super().__init__()
        self.net = net
        self.sigma_data = float(sigma_data)
        self.n_classes = net.n_classes
        self.image_shape = (net.img_channels, net.img_size, net.img_size)

    @property
    def null_label(self) -> int:
        return self.n_classes

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        sd = self.sigma_data
        sigma = sigma.to(x.dtype).reshape(-1, 1, 1, 1)
        c_skip = sd**2 / (sigma**2 + sd**2)
        c_out = sigma * sd / (sigma**2 + sd**2).sqrt()
        c_in = 1.0 / (sd**2 + sigma**2).sqrt()
        c_noise = sigma.log().reshape(-1) / 4.0
        f = self.net(c_in * x, c_noise, labels)
        return c_skip * x + c_out * f


# -- construction and (de)serialisation --------------------------------------------------------------


def denoiser_spec(
    model_cfg: ModelSection, image_shape: tuple[int, int, int], n_classes: int
) -> dict[str, Any]:
    """Plain-JSON description from which :func:`denoiser_from_spec` rebuilds the same architecture."""
    c, h, w = (int(v) for v in image_shape)
    if h != w:
        raise ConfigError(
            f"[model] the UNet needs square images, got {h}x{w}; set [job] image_size to resize"
        )
    return {
        "kind": "edm-unet",
        "version": 1,
        "img_channels": c,
        "img_size": h,
        "n_classes": int(n_classes),
        "channels": int(model_cfg.channels),
        "channel_mult": [int(m) for m in model_cfg.channel_mult],
        "num_res_blocks": int(model_cfg.num_res_blocks),
        "attn_resolutions": [int(r) for r in model_cfg.attn_resolutions],
        "dropout": float(model_cfg.dropout),
        "sigma_data": SIGMA_DATA,
    }


def denoiser_from_spec(spec: dict[str, Any]) -> EDMDenoiser:
    if spec.get("kind") != "edm-unet" or spec.get("version") != 1:
        raise ConfigError(
            f"unsupported denoiser spec kind={spec.get('kind')!r} version={spec.get('version')!r}"
        )
    net = UNet(
        img_channels=spec["img_channels"],
        img_size=spec["img_size"],
        n_classes=spec["n_classes"],
        channels=spec["channels"],
        channel_mult=tuple(spec["channel_mult"]),
        num_res_blocks=spec["num_res_blocks"],
        attn_resolutions=tuple(spec["attn_resolutions"]),
        dropout=spec["dropout"],
    )
    return EDMDenoiser(net, sigma_data=spec["sigma_data"])


def build_denoiser(model_cfg: ModelSection, image_shape: tuple[int, int, int], n_classes: int) -> EDMDenoiser:
    """The denoiser a job's ``[model]`` section describes, for images of ``(C, H, W)``."""
    spec = denoiser_spec(model_cfg, image_shape, n_classes)
    check_architecture(model_cfg, image_shape)  # the one rule of what builds, shared with the size count
    return denoiser_from_spec(spec)


# -- loss ------------------------------------------------------------------------------------------------


@dataclass
class LossRandomness:
    """All random draws of one loss evaluation, for B examples with K noise draws each."""

    noise: torch.Tensor  # (B, K, C, H, W) standard normal
    sigma: torch.Tensor  # (B, K) log-normal noise levels
    drop: torch.Tensor  # (B, K) bool: replace the label by the null label for this draw


def draw_loss_randomness(
    batch: int,
    image_shape: tuple[int, ...],
    *,
    noise_multiplicity: int = 1,
    label_dropout: float = 0.1,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LossRandomness:
    k = int(noise_multiplicity)
    noise = torch.randn((batch, k, *image_shape), generator=generator, device=device, dtype=dtype)
    sigma = (torch.randn((batch, k), generator=generator, device=device, dtype=dtype) * P_STD + P_MEAN).exp()
    drop = torch.rand((batch, k), generator=generator, device=device) < label_dropout
    return LossRandomness(noise, sigma, drop)


def _weighted_mse(
    denoise: DenoiseFn,
    x0: torch.Tensor,
    labels: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    drop: torch.Tensor,
    null_label: int,
    sigma_data: float,
) -> torch.Tensor:
    """x0 (M,C,H,W), labels/sigma/drop (M,), noise (M,C,H,W) -> weighted per-row loss (M,)."""
    y = torch.where(drop, torch.full_like(labels, null_label), labels)
    s = sigma.reshape(-1, 1, 1, 1)
    d = denoise(x0 + s * noise, sigma, y)
    weight = (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2
    return weight * ((d - x0) ** 2).flatten(1).mean(1)


def edm_loss_single(
    denoise: DenoiseFn,
    x: torch.Tensor,
    y: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    drop: torch.Tensor,
    *,
    null_label: int,
    sigma_data: float = SIGMA_DATA,
) -> torch.Tensor:
    """Loss of ONE example averaged over its K noise draws; pure, so ``vmap``-able.

    ``denoise(x (K,C,H,W), sigma (K,), labels (K,))`` is the batched denoiser, e.g.
    ``lambda a, s, l: torch.func.functional_call(denoiser, params, (a, s, l))``.
    Shapes: x (C,H,W), y () int64, noise (K,C,H,W), sigma (K,), drop (K,) bool -> scalar.
    Under ``vmap`` over examples the inner batch of K draws is an ordinary batch dimension.
    """
    k = noise.shape[0]
    xk = x.unsqueeze(0).expand(k, *x.shape)
    yk = y.reshape(1).expand(k)
    return _weighted_mse(denoise, xk, yk, noise, sigma, drop, null_label, sigma_data).mean()


def edm_loss_from_randomness(
    denoiser: DenoiseFn,
    x0: torch.Tensor,
    labels: torch.Tensor,
    rnd: LossRandomness,
    *,
    null_label: int | None = None,
    sigma_data: float | None = None,
    k_major: bool = False,
) -> torch.Tensor:
    """Batched form of :func:`edm_loss_single` (one forward over B*K rows) -> per-example loss (B,).

    Row order of that forward: example-major by default (row i*K + k is draw k of example i); ``k_major`` puts
    draw k of example i at row k*B + i instead (the DP-SGD hook engine's layout: there a layer's (B*K, ...)
    rows reshape to (K, B, ...) with no copy). The per-example losses are the same either way."""
    b, k = rnd.sigma.shape
    if null_label is None:
        null_label = denoiser.null_label  # type: ignore[attr-defined]
    if sigma_data is None:
        sigma_data = getattr(denoiser, "sigma_data", SIGMA_DATA)
    shape = x0.shape[1:]
    if k_major:
        xk = x0.unsqueeze(0).expand(k, b, *shape).reshape(b * k, *shape)
        yk = labels.unsqueeze(0).expand(k, b).reshape(-1)
        noise, sigma, drop = rnd.noise.transpose(0, 1), rnd.sigma.t(), rnd.drop.t()
    else:
        xk = x0.unsqueeze(1).expand(b, k, *shape).reshape(b * k, *shape)
        yk = labels.unsqueeze(1).expand(b, k).reshape(-1)
        noise, sigma, drop = rnd.noise, rnd.sigma, rnd.drop
    rows = _weighted_mse(
        denoiser,
        xk,
        yk,
        noise.reshape(b * k, *shape),
        sigma.reshape(-1),
        drop.reshape(-1),
        int(null_label),
        float(sigma_data),
    )
    return rows.reshape(k, b).mean(0) if k_major else rows.reshape(b, k).mean(1)


def edm_loss(
    denoiser: EDMDenoiser,
    x0: torch.Tensor,
    labels: torch.Tensor,
    *,
    noise_multiplicity: int = 1,
    label_dropout: float = 0.1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Per-example EDM loss (B,) of images x0 in [-1, 1] with K noise draws averaged per example."""
    rnd = draw_loss_randomness(
        x0.shape[0],
        tuple(x0.shape[1:]),
        noise_multiplicity=noise_multiplicity,
        label_dropout=label_dropout,
        generator=generator,
        device=generator.device if generator is not None else x0.device,
        dtype=x0.dtype,
    )
    # Drawn on the generator's device (a CPU generator keeps runs reproducible across devices).
    rnd = LossRandomness(rnd.noise.to(x0.device), rnd.sigma.to(x0.device), rnd.drop.to(x0.device))
    return edm_loss_from_randomness(denoiser, x0, labels, rnd)


class EDMLoss:
    """The DP-SGD engine's ``PerExampleLoss`` (``training.dpsgd``) for an ``EDMDenoiser``: K noise draws and
    label dropout per example.

    The loss itself and its randomness are this module's (``draw_loss_randomness`` / ``edm_loss_single``:
    lambda(sigma)-weighted x0-MSE averaged over the K draws); this class only reshapes the randomness into the
    dict the engine slices per example. The null label is ``n_classes``.
    """

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        n_classes: int,
        noise_multiplicity: int = 1,
        label_dropout: float = 0.1,
        sigma_data: float | None = None,
    ) -> None:
        if noise_multiplicity < 1:
            raise ConfigError(f"[dpsgd] noise_multiplicity must be >= 1, got {noise_multiplicity}")
        self.image_shape = tuple(int(v) for v in image_shape)
        self.n_classes = int(n_classes)
        self.k = int(noise_multiplicity)
        self.label_dropout = float(label_dropout)
        self.sigma_data = SIGMA_DATA if sigma_data is None else float(sigma_data)

    def draw(self, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        r = draw_loss_randomness(
            n,
            self.image_shape,
            noise_multiplicity=self.k,
            label_dropout=self.label_dropout,
            generator=generator,
        )
        return {"noise": r.noise, "sigma": r.sigma, "drop": r.drop}

    def __call__(self, model: Callable[..., Tensor], x: Tensor, y: Tensor, rand: dict[str, Tensor]) -> Tensor:
        return edm_loss_single(
            model,
            x,
            y,
            rand["noise"],
            rand["sigma"],
            rand["drop"],
            null_label=self.n_classes,
            sigma_data=self.sigma_data,
        )

    row_order = "k-major"  # batched's rows: training.ghost_clip.BatchedLoss (its K_MAJOR)

    def example(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``n`` dummy examples (uniform images in [-1, 1], uniform labels) for the engine's cross-check
        (``ghost_clip.cross_check``), from the caller's fixed public generator: never site data."""
        return (
            torch.rand(n, *self.image_shape, generator=generator) * 2 - 1,
            torch.randint(0, max(self.n_classes, 1), (n,), generator=generator),
        )  # 0 classes: the null label

    def batched(self, model: Callable[..., Tensor], x: Tensor, y: Tensor, rand: dict[str, Tensor]) -> Tensor:
        """The B per-example losses from one call of ``model`` over the B*K rows, row k*B + i holding draw k
        of example i (K-major: ``BatchedLoss``)."""
        rnd = LossRandomness(rand["noise"], rand["sigma"], rand["drop"])
        return edm_loss_from_randomness(
            model, x, y, rnd, null_label=self.n_classes, sigma_data=self.sigma_data, k_major=True
        )
