"""The size of a job's denoiser, from its ``[model]`` section alone: no module is built, no tensor allocated.

Why: a node refuses a job whose model exceeds its policy's ``resources.max_model_parameters`` BEFORE it builds
anything (a 2 KB signed job with ``channels = 1024`` made a node allocate 6 GB just to check the coordinator's
weights against it). The count follows ``models.unet.UNet`` layer by layer
(``tests/node/test_node_resources.py`` holds it equal to the built model's for any architecture), in closed
form per level, so a job's own numbers (e.g. ``num_res_blocks = 10**9``) cannot make the count itself slow.
Torch-free: ``policy check`` runs it on an administrator's machine without the training stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import ConfigError


def check_architecture(model_cfg: Any, image_shape: Sequence[int]) -> int:
    """The image side the UNet runs at, or a ``ConfigError`` for an architecture it cannot build."""
    _, h, w = (int(v) for v in image_shape)
    if h != w:
        raise ConfigError(
            f"[model] the UNet needs square images, got {h}x{w}; set [job] image_size to resize"
        )
    if h < 2 ** (len(model_cfg.channel_mult) - 1):
        raise ConfigError(f"[model] channel_mult has too many levels for {h}px images")
    g = max(1, min(32, int(model_cfg.channels) // 4))
    if int(model_cfg.channels) % g:
        raise ConfigError(f"[model] channels must be a multiple of 4 (got {model_cfg.channels})")
    return h


def _conv(cin: int, cout: int, k: int) -> int:
    return cin * cout * k * k + cout


def _linear(cin: int, cout: int) -> int:
    return cin * cout + cout


def _attention(ch: int) -> int:
    return 2 * ch + _conv(ch, 3 * ch, 1) + _conv(ch, ch, 1)  # GroupNorm, qkv, proj


def _res_block(cin: int, cout: int, emb: int, attention: bool) -> int:
    n = 2 * cin + _conv(cin, cout, 3) + _linear(emb, cout) + 2 * cout + _conv(cout, cout, 3)
    n += _conv(cin, cout, 1) if cin != cout else 0  # the skip projection
    return n + (_attention(cout) if attention else 0)


def denoiser_parameters(model_cfg: Any, image_shape: Sequence[int], n_classes: int) -> int:
    """The number of parameters of ``models.build_denoiser(model_cfg, image_shape, n_classes)``."""
    size = check_architecture(model_cfg, image_shape)
    img_ch, c, blocks = int(image_shape[0]), int(model_cfg.channels), int(model_cfg.num_res_blocks)
    mult = [int(m) for m in model_cfg.channel_mult]
    attn = {int(r) for r in model_cfg.attn_resolutions}
    emb = 4 * c
    n = _linear(c, emb) + _linear(emb, emb) + (int(n_classes) + 1) * c + _conv(img_ch, c, 3)
    # widths[l]: channels after level l going down; sides[l]: its side
    res, ch, widths, sides = size, c, [], []
    for level, m in enumerate(mult):
        if level > 0:
            n += _conv(ch, ch, 3)  # Downsample
            res = (res + 1) // 2
        if blocks:
            n += _res_block(ch, c * m, emb, res in attn) + (blocks - 1) * _res_block(
                c * m, c * m, emb, res in attn
            )
            ch = c * m
        widths.append(ch)
        sides.append(res)
    n += _res_block(ch, ch, emb, bool(attn)) + _res_block(ch, ch, emb, False)  # middle
    for level in reversed(range(len(mult))):
        out, at = c * mult[level], sides[level] in attn
        below = widths[level - 1] if level > 0 else c  # the skip saved before this level's blocks
        if blocks:  # the first block meets a block skip, the last the skip from below, the others block skips
            n += _res_block(ch + out, out, emb, at) + (blocks - 1) * _res_block(2 * out, out, emb, at)
            n += _res_block(out + below, out, emb, at)
        else:
            n += _res_block(ch + below, out, emb, at)
        ch = out
        if level > 0:
            n += _conv(ch, ch, 3)  # Upsample
    return n + 2 * ch + _conv(ch, img_ch, 3)  # GroupNorm and the output convolution
