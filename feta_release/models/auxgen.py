"""One-step conditional ResNet generator (BigGAN-like) used by the frequency warm-up (FETA-Pro).

It is fitted to released (already private) RFF statistics only, never DP-trained, so conditional
BatchNorm is fine here. z (z_dim) and a class embedding feed a linear layer to a (4w, s, s) map with
s = img_size/4 (rounded up), then two upsampling residual blocks with class-conditional BatchNorm,
then BN-ReLU-conv3x3-tanh; the output is mapped to [0, 1].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

CLASS_CODE = 16


class ConditionalBatchNorm(nn.Module):
    def __init__(self, ch: int, n_classes: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(ch, affine=False)
        self.gain = nn.Embedding(n_classes, ch)
        self.bias = nn.Embedding(n_classes, ch)
        nn.init.zeros_(self.gain.weight)  # gain is 1 + embedding: starts as plain BatchNorm
        nn.init.zeros_(self.bias.weight)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = 1.0 + self.gain(y)[:, :, None, None]
        b = self.bias(y)[:, :, None, None]
        return self.bn(x) * g + b


class UpBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, n_classes: int, size: int) -> None:
        super().__init__()
        self.size = size
        self.bn0 = ConditionalBatchNorm(in_ch, n_classes)
        self.conv0 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.bn1 = ConditionalBatchNorm(out_ch, n_classes)
        self.conv1 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.skip = nn.Conv2d(in_ch, out_ch, 1)

    def _up(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, size=(self.size, self.size), mode="nearest")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.conv0(self._up(F.relu(self.bn0(x, y))))
        h = self.conv1(F.relu(self.bn1(h, y)))
        return h + self.skip(self._up(x))


class AuxGenerator(nn.Module):
    def __init__(
        self, img_channels: int, img_size: int, n_classes: int, z_dim: int = 60, width: int = 64
    ) -> None:
        super().__init__()
        if img_size < 8:
            raise ConfigError(f"[auxgen] images of {img_size}px are too small for the generator (>= 8)")
        if width < 4 or z_dim < 1:
            raise ConfigError(f"[auxgen] width must be >= 4 and z_dim >= 1, got {width}, {z_dim}")
        self.img_channels, self.img_size, self.n_classes = img_channels, img_size, n_classes
        self.z_dim, self.width = z_dim, width
        mid = (img_size + 1) // 2
        self.base = (mid + 1) // 2
        # A short class code joins z at the input (as BigGAN's shared embedding); most class information
        # enters through the conditional BatchNorms.
        self.class_embed = nn.Embedding(n_classes, CLASS_CODE)
        self.fc = nn.Linear(z_dim + CLASS_CODE, 4 * width * self.base * self.base)
        self.block0 = UpBlock(4 * width, 2 * width, n_classes, mid)
        self.block1 = UpBlock(2 * width, width, n_classes, img_size)
        self.bn_out = nn.BatchNorm2d(width)
        self.conv_out = nn.Conv2d(width, img_channels, 3, padding=1)

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] (B, C, H, W) for latent z (B, z_dim) and labels y (B,) in [0, n_classes)."""
        h = self.fc(torch.cat([z, self.class_embed(y)], dim=1))
        h = h.reshape(z.shape[0], 4 * self.width, self.base, self.base)
        h = self.block1(self.block0(h, y), y)
        h = torch.tanh(self.conv_out(F.relu(self.bn_out(h))))
        return (h + 1.0) / 2.0

    def spec(self) -> dict[str, Any]:
        return {
            "kind": "auxgen",
            "version": 1,
            "img_channels": self.img_channels,
            "img_size": self.img_size,
            "n_classes": self.n_classes,
            "z_dim": self.z_dim,
            "width": self.width,
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> AuxGenerator:
        if spec.get("kind") != "auxgen" or spec.get("version") != 1:
            raise ConfigError(f"unsupported aux generator spec {spec.get('kind')!r} v{spec.get('version')!r}")
        return cls(spec["img_channels"], spec["img_size"], spec["n_classes"], spec["z_dim"], spec["width"])


class AuxEnsemble(nn.Module):
    """Several aux generators fitted to the same release (``[auxgen] restarts`` / ``keep``), used as one: a
    row whose label occurs for the j-th time in the call is drawn by member j mod k, so every member draws
    every class evenly whatever the order of the labels (class-sorted pools, class-interleaved synthetic
    sets). Eval use only (each member was fitted on its own); a function of the release and public randomness,
    like each member."""

    def __init__(self, members: list[AuxGenerator]) -> None:
        super().__init__()
        if len(members) < 2 or any(m.spec() != members[0].spec() for m in members):
            raise ConfigError("an aux ensemble needs >= 2 generators of the same shape")
        self.members = nn.ModuleList(members)
        first = members[0]
        self.img_channels, self.img_size, self.n_classes = first.img_channels, first.img_size, first.n_classes
        self.z_dim, self.width = first.z_dim, first.width

    def forward(self, z: torch.Tensor, y: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """``seen[c]``: occurrences of class c in earlier passes of the same draw, so that a draw split into
        passes gives every row the member one call would (the pass size changes no image)."""
        onehot = F.one_hot(y, self.n_classes)
        # occurrence of the row's label (counting the earlier passes'), mod k
        which = (onehot.cumsum(0) * onehot).sum(1) - 1
        if seen is not None:
            which = which + seen.to(which.device)[y]
        which = which % len(self.members)
        out = z.new_empty((z.shape[0], self.img_channels, self.img_size, self.img_size))
        for j, member in enumerate(self.members):
            rows = which == j
            if bool(rows.any()):
                out[rows] = member(z[rows], y[rows])
        return out


AuxModel = AuxGenerator | AuxEnsemble


def new_aux_model(
    img_channels: int, img_size: int, n_classes: int, *, z_dim: int, width: int, members: int = 1
) -> AuxModel:
    """An unfitted aux model of this shape: one generator, or an ensemble of ``members`` (to load a checkpoint
    into)."""
    gens = [AuxGenerator(img_channels, img_size, n_classes, z_dim=z_dim, width=width) for _ in range(members)]
    return gens[0] if members == 1 else AuxEnsemble(gens)
