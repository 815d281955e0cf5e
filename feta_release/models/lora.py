"""Low-rank adapters (LoRA, Hu et al. 2022) on the denoiser's convolutions and linear layers (``[dpsgd]
trainable = "lora"``): DP-SGD trains only the adapters, the layers keep their (public or released) values.

Each ``nn.Conv2d`` / ``nn.Linear`` of the model gets two plain layers of its own kind: ``lora_down`` (the
layer's input to ``rank`` channels: a convolution with the layer's kernel, stride, padding and dilation, or
a linear map) and ``lora_up`` (``rank`` to the layer's outputs: a 1x1 convolution or a linear map), both
without bias; a forward hook adds ``lora_up(lora_down(x))`` to the layer's output. ``lora_up`` starts at
zero, so attaching changes no output; ``lora_down`` starts from a fixed PUBLIC seed. The adapters are
ordinary ``nn.Conv2d`` / ``nn.Linear`` modules with the library's forward, so both per-example engines
handle them (``training.ghost_clip``'s layer rules and torch.func), and the base layers' own weights are
frozen (no per-example gradient, no noise).

Privacy: unchanged. DP-SGD clips each example's gradient of the TRAINED vector (the adapters' entries) to C
and adds N(0, sigma^2 C^2) per adapter entry: the subsampled Gaussian mechanism on that vector, the event
(sigma, q, 1). The frozen base weights are public when DP-SGD starts and are not released by the step; the
merged weights W + up . down are a function of them and the noisy adapters (post-processing).

:func:`merge_lora` folds the adapters into the layers' weights and removes them: what leaves the trainer (a
federated round's weights, the released EMA model, the ONNX export) is the plain denoiser with merged
weights.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

LORA_SEED = 0x10AA  # public: the adapters' starting point is the same at every site and in every run
_DOWN, _UP = "lora_down", "lora_up"


def _lora_forward(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
    """The hook: the layer's output plus its adapters' (read from the module, so a deep copy uses its own)."""
    return output + getattr(module, _UP)(getattr(module, _DOWN)(inputs[0]))


def _targets(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)) and not _is_adapter(m)]


def _is_adapter(m: nn.Module) -> bool:
    return bool(getattr(m, "_lora_adapter", False))


def _adapters(m: nn.Module, rank: int, gen: torch.Generator) -> tuple[nn.Module, nn.Module]:
    w = m.weight
    if isinstance(m, nn.Conv2d):
        down: nn.Module = nn.Conv2d(
            m.in_channels, rank, m.kernel_size, m.stride, m.padding, m.dilation, bias=False
        )  # type: ignore[arg-type]
        up: nn.Module = nn.Conv2d(rank, m.out_channels, 1, bias=False)
    else:
        assert isinstance(m, nn.Linear)
        down, up = nn.Linear(m.in_features, rank, bias=False), nn.Linear(rank, m.out_features, bias=False)
    fan_in = math.prod(down.weight.shape[1:])
    with torch.no_grad():
        down.weight.copy_(torch.randn(down.weight.shape, generator=gen) / math.sqrt(fan_in))
        up.weight.zero_()
    for a in (down, up):
        a.to(device=w.device, dtype=w.dtype)
        a._lora_adapter = True  # type: ignore[assignment]
    return down, up


def attach_lora(model: nn.Module, rank: int) -> int:
    """Give every conv/linear layer of ``model`` rank-``rank`` adapters, freeze everything else; returns the
    number of trainable scalars (the adapters'). Attaching twice is refused (merge first)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if has_lora(model):
        raise ValueError("the model already carries LoRA adapters; merge them first (merge_lora)")
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(LORA_SEED)
    for m in _targets(model):
        down, up = _adapters(m, rank, gen)
        m.add_module(_DOWN, down)
        m.add_module(_UP, up)
        m.register_forward_hook(_lora_forward)  # found again by merge_lora (a deep copy carries its own)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def has_lora(model: nn.Module) -> bool:
    return any(_is_adapter(m) for m in model.modules())


def _delta(m: nn.Module) -> Tensor:
    down, up = getattr(m, _DOWN).weight, getattr(m, _UP).weight
    if isinstance(m, nn.Conv2d):
        return torch.einsum("or,rikl->oikl", up[:, :, 0, 0], down)
    return up @ down


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each layer's adapters into its weight (W + up . down: the same function of the input) and remove
    the adapters and their hooks; every parameter is trainable again (a model's default). Returns
    ``model``."""
    if not has_lora(model):
        return model
    for m in [m for m in model.modules() if isinstance(getattr(m, _DOWN, None), nn.Module)]:
        with torch.no_grad():
            m.weight.add_(_delta(m).to(m.weight.dtype))
        for key in [k for k, hook in m._forward_hooks.items() if hook is _lora_forward]:
            del m._forward_hooks[key]
        delattr(m, _DOWN)
        delattr(m, _UP)
    for p in model.parameters():
        p.requires_grad_(True)
    return model
