"""Class-conditional UNet (DDPM++/NCSN++ in spirit, compact) used as the EDM network F.

Constraints this module keeps on purpose, because other parts of the system rely on them:

* DP-SGD computes per-example gradients with ``torch.func.vmap(grad(...))`` (and possibly Opacus):
  only GroupNorm (never BatchNorm), no buffers, no in-place ops on inputs, no data-dependent Python
  control flow.
* The release exports the denoiser to ONNX with the TorchScript exporter (opset 17) inside an ONNX
  ``Loop``: attention is written as 1x1 convolutions + ``matmul`` (no ``nn.MultiheadAttention``), the
  upsampling target sizes are fixed at construction time, and the Fourier frequencies of the noise
  embedding are rebuilt from ``arange`` so the traced graph holds them as constants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _groups(ch: int) -> int:
    # As in EDM: at most 32 groups with at least 4 channels each; small widths still get >1 group.
    g = min(32, max(1, ch // 4))
    while ch % g:
        g -= 1
    return g


def _zero(module: nn.Module) -> nn.Module:
    # Zero-initialised output layers make every residual branch start as the identity (stable start).
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


class PositionalEmbedding(nn.Module):
    """Sinusoidal embedding of the scalar noise condition c_noise = ln(sigma)/4 (no parameters)."""

    def __init__(self, num_channels: int, max_positions: int = 10000) -> None:
        super().__init__()
        assert num_channels % 2 == 0
        self.num_channels = num_channels
        self.max_positions = max_positions

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.num_channels // 2
        freqs = torch.arange(half, dtype=torch.float32, device=t.device) / half
        freqs = (1.0 / self.max_positions) ** freqs
        arg = t.to(torch.float32).unsqueeze(-1) * freqs.unsqueeze(0)
        return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, emb_ch: int, dropout: float, attention: bool) -> None:
        super().__init__()
        self.norm0 = nn.GroupNorm(_groups(in_ch), in_ch, eps=1e-6)
        self.conv0 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.affine = nn.Linear(emb_ch, out_ch)
        self.norm1 = nn.GroupNorm(_groups(out_ch), out_ch, eps=1e-6)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.conv1 = _zero(nn.Conv2d(out_ch, out_ch, 3, padding=1))
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()
        self.attn = SelfAttention(out_ch) if attention else None

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv0(F.silu(self.norm0(x)))
        h = h + self.affine(emb).unsqueeze(-1).unsqueeze(-1)
        h = self.conv1(self.dropout(F.silu(self.norm1(h))))
        # 1/sqrt(2) keeps the activation scale constant through the residual sum (EDM's skip_scale).
        x = (h + self.skip(x)) * math.sqrt(0.5)
        if self.attn is not None:
            x = self.attn(x)
        return x


class SelfAttention(nn.Module):
    """Single-head spatial self-attention: 1x1 conv q/k/v, matmul, softmax, 1x1 conv out."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(_groups(ch), ch, eps=1e-6)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.proj = _zero(nn.Conv2d(ch, ch, 1))
        self.scale = 1.0 / math.sqrt(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        attn = torch.softmax(torch.matmul(q.transpose(1, 2), k) * self.scale, dim=-1)  # (b, hw, hw)
        out = torch.matmul(v, attn.transpose(1, 2)).reshape(b, c, h, w)
        return (x + self.proj(out)) * math.sqrt(0.5)


class Downsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    # The target size is fixed at construction so odd sizes (7 -> 4 -> 7) round-trip and the exported
    # graph holds constants instead of shape arithmetic.
    def __init__(self, ch: int, size: int) -> None:
        super().__init__()
        self.size = size
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, size=(self.size, self.size), mode="nearest"))


class UNet(nn.Module):
    """F(x, c_noise, y): the raw network inside the EDM preconditioning.

    ``class_labels`` are int64 in ``[0, n_classes]``; the value ``n_classes`` is the null label used
    for classifier-free guidance (its embedding is learned like the others).
    """

    def __init__(
        self,
        img_channels: int,
        img_size: int,
        n_classes: int,
        channels: int = 32,
        channel_mult: Sequence[int] = (2, 2),
        num_res_blocks: int = 2,
        attn_resolutions: Sequence[int] = (14,),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.img_channels = img_channels
        self.img_size = img_size
        self.n_classes = n_classes
        emb_ch = channels * 4
        self.noise_embed = PositionalEmbedding(channels)
        self.map0 = nn.Linear(channels, emb_ch)
        self.map1 = nn.Linear(emb_ch, emb_ch)
        # As DDPM++: the class embedding is added to the sinusoidal noise features BEFORE the embedding
        # MLP, at the same O(1) scale (N(0, 1) rows), so the MLP mixes noise level and class
        # non-linearly from the first step.
        self.class_embed = nn.Embedding(n_classes + 1, channels)
        nn.init.normal_(self.class_embed.weight, std=1.0)

        attn_res = set(attn_resolutions)
        self.conv_in = nn.Conv2d(img_channels, channels, 3, padding=1)
        self.down = nn.ModuleList()
        skips = [channels]
        ch = channels
        res = img_size
        sizes = []
        for level, mult in enumerate(channel_mult):
            if level > 0:
                self.down.append(Downsample(ch))
                sizes.append(res)
                res = (res + 1) // 2
                skips.append(ch)
            for _ in range(num_res_blocks):
                out = channels * mult
                self.down.append(ResBlock(ch, out, emb_ch, dropout, res in attn_res))
                ch = out
                skips.append(ch)
        # Mid-level attention follows the switch: an empty attn_resolutions turns attention off entirely.
        self.mid0 = ResBlock(ch, ch, emb_ch, dropout, bool(attn_res))
        self.mid1 = ResBlock(ch, ch, emb_ch, dropout, False)
        self.up = nn.ModuleList()
        for level in reversed(range(len(channel_mult))):
            mult = channel_mult[level]
            for _ in range(num_res_blocks + 1):
                out = channels * mult
                self.up.append(ResBlock(ch + skips.pop(), out, emb_ch, dropout, res in attn_res))
                ch = out
            if level > 0:
                res = sizes.pop()
                self.up.append(Upsample(ch, res))
        assert not skips and res == img_size
        self.norm_out = nn.GroupNorm(_groups(ch), ch, eps=1e-6)
        self.conv_out = _zero(nn.Conv2d(ch, img_channels, 3, padding=1))

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, class_labels: torch.Tensor) -> torch.Tensor:
        emb = self.noise_embed(c_noise) + self.class_embed(class_labels)
        emb = F.silu(self.map1(F.silu(self.map0(emb))))
        h = self.conv_in(x)
        hs = [h]
        for block in self.down:
            h = block(h, emb) if isinstance(block, ResBlock) else block(h)
            hs.append(h)
        h = self.mid1(self.mid0(h, emb), emb)
        for block in self.up:
            if isinstance(block, ResBlock):
                h = block(torch.cat([h, hs.pop()], dim=1), emb)
            else:
                h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
