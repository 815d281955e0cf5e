"""The size of a job's denoiser, from its ``[model]`` section alone: no module is built, no tensor allocated.

Why: a node refuses a job whose model exceeds its policy's ``resources.max_model_parameters`` BEFORE it builds
anything (a 2 KB signed job with ``channels = 1024`` made a node allocate 6 GB just to check the coordinator's
weights against it). The count follows ``models.unet.UNet`` layer by layer
(``tests/node/test_node_resources.py`` holds it equal to the built model's for any architecture), in closed
form per level, so a job's own numbers (e.g. ``num_res_blocks = 10**9``) cannot make the count itself slow.
Torch-free: ``policy check`` runs it on an administrator's machine without the training stack.

The same layer list gives the dimension DP-SGD trains (:func:`dpsgd_dimension`, ``[dpsgd] trainable``): the
derived job's DP-SGD rule and the planner's DP-SGD figure weigh the noise in the coordinates it is drawn in
(``tests/training/test_dpsgd_dimension.py`` holds it equal to ``models.trainable.set_trainable``'s count).
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


# One layer of the UNet: (kind, inputs, outputs, kernel side, whether ``[dpsgd] trainable = "norm_attention"``
# trains it). Kinds: "conv" (with bias), "linear" (with bias), "embedding" (rows x width, no bias), "norm"
# (GroupNorm: a scale and a shift per channel).
Layer = tuple[str, int, int, int, bool]


def _layer_parameters(layer: Layer) -> int:
    kind, cin, cout, k, _ = layer
    if kind == "norm":
        return 2 * cin
    if kind == "embedding":
        return cin * cout
    return cin * cout * k * k + cout  # conv and linear (k = 1): weight and bias


def _lora_parameters(layer: Layer, rank: int) -> int:
    """The adapters ``models.lora.attach_lora`` gives the layer: down (its inputs and kernel to ``rank``)
    and a 1x1 up (``rank`` to its outputs), no bias; none on a norm or the class embedding."""
    kind, cin, cout, k, _ = layer
    return rank * (cin * k * k + cout) if kind in ("conv", "linear") else 0


def _attention(ch: int) -> list[Layer]:
    return [("norm", ch, ch, 1, True), ("conv", ch, 3 * ch, 1, True), ("conv", ch, ch, 1, True)]  # qkv, proj


def _res_block(cin: int, cout: int, emb: int, attention: bool) -> list[Layer]:
    out: list[Layer] = [
        ("norm", cin, cin, 1, True),
        ("conv", cin, cout, 3, False),
        ("linear", emb, cout, 1, True),  # the block's projection of the embedding: conditioning
        ("norm", cout, cout, 1, True),
        ("conv", cout, cout, 3, False),
    ]
    out += [("conv", cin, cout, 1, False)] if cin != cout else []  # the skip projection
    return out + (_attention(cout) if attention else [])


def _blocks(first: list[Layer], rest: list[Layer], blocks: int) -> list[tuple[Layer, int]]:
    """A level's ``blocks`` residual blocks, the ``blocks - 1`` alike counted once (closed form)."""
    return [(layer, 1) for layer in first] + [(layer, blocks - 1) for layer in rest]


def _layers(model_cfg: Any, image_shape: Sequence[int], n_classes: int) -> list[tuple[Layer, int]]:
    """The layers of ``models.build_denoiser(model_cfg, image_shape, n_classes)`` with how many of each."""
    size = check_architecture(model_cfg, image_shape)
    img_ch, c, blocks = int(image_shape[0]), int(model_cfg.channels), int(model_cfg.num_res_blocks)
    mult = [int(m) for m in model_cfg.channel_mult]
    attn = {int(r) for r in model_cfg.attn_resolutions}
    emb = 4 * c
    top: list[Layer] = [("linear", c, emb, 1, True), ("linear", emb, emb, 1, True)]  # the noise-level map
    top += [("embedding", int(n_classes) + 1, c, 1, True), ("conv", img_ch, c, 3, False)]
    n = [(layer, 1) for layer in top]
    # widths[l]: channels after level l going down; sides[l]: its side
    res, ch, widths, sides = size, c, [], []
    for level, m in enumerate(mult):
        if level > 0:
            n.append((("conv", ch, ch, 3, False), 1))  # Downsample
            res = (res + 1) // 2
        if blocks:
            n += _blocks(
                _res_block(ch, c * m, emb, res in attn), _res_block(c * m, c * m, emb, res in attn), blocks
            )
            ch = c * m
        widths.append(ch)
        sides.append(res)
    n += [
        (layer, 1) for layer in _res_block(ch, ch, emb, bool(attn)) + _res_block(ch, ch, emb, False)
    ]  # middle
    for level in reversed(range(len(mult))):
        out, at = c * mult[level], sides[level] in attn
        below = widths[level - 1] if level > 0 else c  # the skip saved before this level's blocks
        if blocks:  # the first block meets a block skip, the last the skip from below, the others block skips
            n += _blocks(_res_block(ch + out, out, emb, at), _res_block(2 * out, out, emb, at), blocks)
            n += [(layer, 1) for layer in _res_block(out + below, out, emb, at)]
        else:
            n += [(layer, 1) for layer in _res_block(ch + below, out, emb, at)]
        ch = out
        if level > 0:
            n.append((("conv", ch, ch, 3, False), 1))  # Upsample
    return n + [(("norm", ch, ch, 1, True), 1), (("conv", ch, img_ch, 3, False), 1)]  # the output norm, conv


def denoiser_parameters(model_cfg: Any, image_shape: Sequence[int], n_classes: int) -> int:
    """The number of parameters of ``models.build_denoiser(model_cfg, image_shape, n_classes)``."""
    return dpsgd_dimension(model_cfg, image_shape, n_classes, "all", 1)


def dpsgd_dimension(
    model_cfg: Any, image_shape: Sequence[int], n_classes: int, trainable: str, lora_rank: int
) -> int:
    """The number of scalars DP-SGD trains, the dimension its noise is drawn in: what
    ``models.trainable.set_trainable(build_denoiser(...), trainable, lora_rank)`` leaves trainable ("all":
    every parameter; "norm_attention": the norms, the attention blocks and the conditioning layers; "lora":
    the adapters alone)."""
    layers = _layers(model_cfg, image_shape, n_classes)
    if trainable == "lora":
        return sum(_lora_parameters(layer, int(lora_rank)) * k for layer, k in layers)
    if trainable not in ("all", "norm_attention"):
        raise ConfigError(f'[dpsgd] trainable must be "all", "norm_attention" or "lora", got {trainable!r}')
    return sum(_layer_parameters(layer) * k for layer, k in layers if trainable == "all" or layer[4])
