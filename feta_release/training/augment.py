"""RandAugment-style augmentation bag for the spatial warm-up (method-details §2), in pure torch.

Each image gets ``n_ops`` operations drawn uniformly (with replacement) from the bag; one magnitude
``m`` uniform in ``{1..M}`` is drawn per call (the warm-up calls once per epoch, so it is re-drawn
every epoch). Magnitudes follow torchvision's RandAugment scale (31 bins, so strength = m / 30 of the
op's range: rotate 30 deg, shear 0.3, translate 150/331 of the side, enhance factors 0.9, posterize
down to 4 bits, solarize threshold down to 0); signed ops get a random sign per image.

Images are float tensors in [0, 1] that stand for uint8 images: the result is quantised to 1/255
steps after every op, as the reference works on uint8. Map to the model's [-1, 1] with
:func:`to_model_range`. Everything is a function of the given ``torch.Generator``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError

N_BINS = 31  # torchvision RandAugment's default number of magnitude bins


def _quantize(x: torch.Tensor) -> torch.Tensor:
    return (x.clamp(0.0, 1.0) * 255.0).round() / 255.0


def _grey(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 3:
        w = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype, device=x.device).reshape(1, 3, 1, 1)
        return (x * w).sum(1, keepdim=True)
    return x.mean(1, keepdim=True)


def _blend(img: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return (other + factor.reshape(-1, 1, 1, 1) * (img - other)).clamp(0.0, 1.0)


def _affine(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    # Zero fill (black), nearest sampling as torchvision's default; theta maps output to input coords.
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="nearest", padding_mode="zeros", align_corners=False)


def _eye(n: int, x: torch.Tensor) -> torch.Tensor:
    return torch.eye(2, 3, dtype=x.dtype, device=x.device).unsqueeze(0).repeat(n, 1, 1)


# Each op: (x (n,C,H,W), strength f in [0,1], sign (n,) in {-1,+1}) -> x'
def op_identity(x, f, s):
    return x


def op_rotate(x, f, s):
    a = s * math.radians(30.0 * f)
    theta = _eye(x.shape[0], x)
    theta[:, 0, 0], theta[:, 0, 1] = torch.cos(a), -torch.sin(a)
    theta[:, 1, 0], theta[:, 1, 1] = torch.sin(a), torch.cos(a)
    return _affine(x, theta)


def op_shear_x(x, f, s):
    theta = _eye(x.shape[0], x)
    theta[:, 0, 1] = s * 0.3 * f
    return _affine(x, theta)


def op_shear_y(x, f, s):
    theta = _eye(x.shape[0], x)
    theta[:, 1, 0] = s * 0.3 * f
    return _affine(x, theta)


def op_translate_x(x, f, s):
    theta = _eye(x.shape[0], x)
    theta[:, 0, 2] = s * 2.0 * (150.0 / 331.0) * f  # affine_grid coordinates span 2 per side
    return _affine(x, theta)


def op_translate_y(x, f, s):
    theta = _eye(x.shape[0], x)
    theta[:, 1, 2] = s * 2.0 * (150.0 / 331.0) * f
    return _affine(x, theta)


def op_brightness(x, f, s):
    return _blend(x, torch.zeros_like(x), 1.0 + s * 0.9 * f)


def op_contrast(x, f, s):
    mean = _grey(x).mean(dim=(1, 2, 3), keepdim=True).expand_as(x)
    return _blend(x, mean, 1.0 + s * 0.9 * f)


def op_sharpness(x, f, s):
    c = x.shape[1]
    k = (
        torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]], dtype=x.dtype, device=x.device)
        / 13.0
    )
    smooth = F.conv2d(x, k.expand(c, 1, 3, 3), padding=1, groups=c)
    # As PIL/torchvision: the border keeps its original pixels.
    smooth[..., 0, :], smooth[..., -1, :] = x[..., 0, :], x[..., -1, :]
    smooth[..., :, 0], smooth[..., :, -1] = x[..., :, 0], x[..., :, -1]
    return _blend(x, smooth, 1.0 + s * 0.9 * f)


def op_posterize(x, f, s):
    bits = 8 - int(round(f * 4.0))
    step = 2 ** (8 - bits)
    return torch.floor(torch.round(x * 255.0) / step) * step / 255.0


def op_solarize(x, f, s):
    thr = 1.0 - f
    return torch.where(x >= thr, 1.0 - x, x)


def op_autocontrast(x, f, s):
    lo = x.amin(dim=(2, 3), keepdim=True)
    hi = x.amax(dim=(2, 3), keepdim=True)
    span = hi - lo
    out = (x - lo) / span.clamp_min(1e-8)
    return torch.where(span > 0, out, x)


def op_equalize(x, f, s):
    n, c, h, w = x.shape
    v = torch.round(x * 255.0).long().clamp(0, 255).reshape(n * c, h * w)
    offs = torch.arange(n * c, device=x.device).unsqueeze(1) * 256
    hist = torch.bincount((v + offs).reshape(-1), minlength=n * c * 256).reshape(n * c, 256)
    cdf = hist.cumsum(1).to(x.dtype)
    cdf_min = torch.where(hist > 0, cdf, torch.full_like(cdf, float(h * w))).amin(1, keepdim=True)
    denom = float(h * w) - cdf_min
    lut = torch.round((cdf - cdf_min) / denom.clamp_min(1.0) * 255.0).clamp(0, 255)
    out = torch.gather(lut, 1, v) / 255.0
    # A constant channel has nothing to equalise.
    out = torch.where(denom > 0, out, v.to(x.dtype) / 255.0)
    return out.reshape(n, c, h, w)


def op_color(x, f, s):
    if x.shape[1] != 3:
        return x
    return _blend(x, _grey(x).expand_as(x), 1.0 + s * 0.9 * f)


OPS: dict[str, Callable[[torch.Tensor, float, torch.Tensor], torch.Tensor]] = {
    "identity": op_identity,
    "rotate": op_rotate,
    "shear_x": op_shear_x,
    "shear_y": op_shear_y,
    "translate_x": op_translate_x,
    "translate_y": op_translate_y,
    "brightness": op_brightness,
    "contrast": op_contrast,
    "sharpness": op_sharpness,
    "posterize": op_posterize,
    "solarize": op_solarize,
    "autocontrast": op_autocontrast,
    "equalize": op_equalize,
    "color": op_color,
}


def rand_augment(
    images: torch.Tensor,
    *,
    n_ops: int = 2,
    magnitude_max: int = 3,
    generator: torch.Generator,
    ops: tuple[str, ...] | None = None,
) -> tuple[torch.Tensor, int]:
    """Augment ``images`` (N,C,H,W) in [0,1]; returns (augmented images in [0,1], the magnitude drawn)."""
    if images.dim() != 4:
        raise ConfigError(f"augmentation needs images of shape (N, C, H, W), got {tuple(images.shape)}")
    if not 1 <= magnitude_max < N_BINS:
        raise ConfigError(f"[warmup] augment_magnitude must be in 1..{N_BINS - 1}, got {magnitude_max}")
    if n_ops < 0:
        raise ConfigError(f"[warmup] augment_ops must be >= 0, got {n_ops}")
    names = ops if ops is not None else tuple(OPS)
    unknown = [o for o in names if o not in OPS]
    if unknown:
        raise ConfigError(f"unknown augmentation op(s) {unknown}; known: {', '.join(OPS)}")
    dev = images.device
    m = int(torch.randint(1, magnitude_max + 1, (1,), generator=generator).item())
    f = m / (N_BINS - 1)
    x = _quantize(images.to(torch.float32))
    n = x.shape[0]
    for _ in range(n_ops):
        which = torch.randint(0, len(names), (n,), generator=generator).to(dev)
        sign = (torch.randint(0, 2, (n,), generator=generator) * 2 - 1).to(device=dev, dtype=x.dtype)
        out = x.clone()
        for j, name in enumerate(names):
            idx = (which == j).nonzero(as_tuple=True)[0]
            if idx.numel():
                out[idx] = _quantize(OPS[name](x[idx], f, sign[idx]))
        x = out
    return x, m


def to_model_range(x: torch.Tensor) -> torch.Tensor:
    """[0, 1] pixels -> the diffusion model's [-1, 1]."""
    return x * 2.0 - 1.0
