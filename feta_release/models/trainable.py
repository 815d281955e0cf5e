"""Which of the denoiser's parameters DP-SGD trains (``[dpsgd] trainable``), the rest frozen.

Why freezing is sound: a frozen parameter holds a PUBLIC value (the public seed's init, public pretraining, or
a released warm-up, all fixed before DP-SGD), so a DP-SGD step releases only the noisy update of the trainable
vector. The engine (``training.dpsgd``) takes per-example gradients of the trainable parameters only, clips
each example's trainable gradient to L2 norm C (the sensitivity of the sum, under add/remove of one example)
and adds one Gaussian draw per trainable coordinate: the same subsampled-Gaussian event (sigma, q, 1) in fewer
dimensions, so the noise norm sigma * C * sqrt(d) shrinks with d (DP-LDM: fine-tune only the attention
modules).
"""

from __future__ import annotations

from torch import nn

from .lora import attach_lora
from .unet import SelfAttention

MODES = ("all", "norm_attention", "lora")  # lora: low-rank adapters on every conv/linear layer (models.lora)
# conditioning layers by their attribute name in the UNet: the noise-level map, the class embedding, each
# residual block's projection of the embedding
_CONDITIONING = ("map0", "map1", "class_embed", "affine")


def _selected(name: str, module: nn.Module, inside_attention: bool) -> bool:
    return inside_attention or isinstance(module, nn.GroupNorm) or name.rsplit(".", 1)[-1] in _CONDITIONING


def trainable_names(model: nn.Module, mode: str) -> list[str]:
    """The names of the parameters ``mode`` trains, in ``named_parameters`` order."""
    if mode not in MODES:
        raise ValueError(f"trainable mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "all":
        return [n for n, _ in model.named_parameters()]
    if mode == "lora":  # the adapters, once attached (set_trainable)
        return [n for n, _ in model.named_parameters() if ".lora_down." in n or ".lora_up." in n]
    keep: set[int] = set()
    attention = [name for name, m in model.named_modules() if isinstance(m, SelfAttention)]
    for name, module in model.named_modules():
        inside = any(name == a or name.startswith(a + ".") for a in attention)
        if _selected(name, module, inside):
            keep.update(id(p) for p in module.parameters(recurse=False))
    return [n for n, p in model.named_parameters() if id(p) in keep]


def set_trainable(model: nn.Module, mode: str, rank: int = 4) -> int:
    """Freeze every parameter ``mode`` does not train (``requires_grad = False``); returns how many scalars
    stay trainable (the dimension DP-SGD's noise is drawn in). ``all`` leaves the model as it is; ``lora``
    attaches rank-``rank`` adapters (``models.lora.attach_lora``) and trains them alone."""
    if mode == "lora":
        return attach_lora(model, rank)
    names = set(trainable_names(model, mode))
    if mode != "all":
        for n, p in model.named_parameters():
            p.requires_grad_(n in names)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
