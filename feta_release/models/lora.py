"""Low-rank adapters (LoRA, Hu et al. 2022) on the denoiser's convolutions and linear layers (``[dpsgd]
trainable = "lora"``): DP-SGD trains only the adapters, the layers keep their (public or released) values.

Each ``nn.Conv2d`` / ``nn.Linear`` of the model gets two adapter weights, held by two plain layers of its own
kind: ``lora_down`` (the layer's input to ``rank`` channels: a convolution with the layer's kernel, stride,
padding and dilation, or a linear map) and ``lora_up`` (``rank`` to the layer's outputs: a 1x1 convolution or
a linear map), both without bias. The adapted layer computes ``W x + b + up(down(x))`` as ONE call of its own
kind with the weight ``W + up . down`` (``LoRAConv2d`` / ``LoRALinear``: the layer's class is switched to
them in place, so names, parameters and the state dict stay those of the plain model plus the adapters).
``lora_up`` starts at zero, so attaching changes no output (``W + 0`` is ``W`` exactly); ``lora_down`` starts
from a fixed PUBLIC seed. The frozen base weights get no gradient, no per-example gradient and no noise.

Why one call with the summed weight, not the adapters as two more layers after the layer: the weight
``up . down`` costs rank x C_out x C_in x kh x kw multiply-adds a call, nothing beside a convolution over a
batch, while the two extra layers are a convolution with ``rank`` (4) output channels, which oneDNN runs about
as slowly as the layer itself (its forward, and its input and weight gradients in the backward), plus a 1x1
convolution: a LoRA step cost 1.5-1.6x the full fine-tuning step without privacy (``bench/bench_dpsgd.py``).
One call costs what the full step's layer costs: its input gradient, and the gradient of the summed weight,
from which autograd takes the adapters' by two small matrix products. The per-example engine does the same per
example (``training.ghost_clip``: the layer's per-example weight gradient ``G_i``, then ``G_i down^T`` and
``up^T G_i``); torch.func differentiates this forward as it is.

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
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError

__all__ = ["LORA_SEED", "LoRAConv2d", "LoRALinear", "attach_lora", "has_lora", "merge_lora", "lora_delta"]

LORA_SEED = 0x10AA  # public: the adapters' starting point is the same at every site and in every run
_DOWN, _UP = "lora_down", "lora_up"


def lora_delta(m: nn.Module) -> Tensor:
    """``up . down`` in the shape of ``m.weight``: what the adapters add to the layer's weight."""
    down, up = getattr(m, _DOWN).weight, getattr(m, _UP).weight
    return (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(m.weight.shape)


class LoRAConv2d(nn.Conv2d):
    """A ``nn.Conv2d`` carrying adapters (``attach_lora`` switches a layer's class to this): one convolution
    with the weight ``W + up . down``."""

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self.weight + lora_delta(self), self.bias)


class LoRALinear(nn.Linear):
    """A ``nn.Linear`` carrying adapters: one linear map with the weight ``W + up . down``."""

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.weight + lora_delta(self), self.bias)


_ADAPTED: dict[type[nn.Module], type[nn.Module]] = {nn.Conv2d: LoRAConv2d, nn.Linear: LoRALinear}


def _targets(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m) in _ADAPTED and not _is_adapter(m) and not _grouped(m)]


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
    """Give every plain conv/linear layer of ``model`` rank-``rank`` adapters, freeze everything else; returns
    the number of trainable scalars (the adapters'). Attaching twice is refused (merge first)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if has_lora(model):
        raise ValueError("the model already carries LoRA adapters; merge them first (merge_lora)")
    targets = _targets(model)
    _refuse_unadaptable(model, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(LORA_SEED)
    for m in targets:
        down, up = _adapters(m, rank, gen)
        m.add_module(_DOWN, down)
        m.add_module(_UP, up)
        adapted = _ADAPTED[type(m)]
        m.__class__ = adapted  # the same layer, its forward now the summed weight's (a copy keeps it)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _refuse_unadaptable(model: nn.Module, targets: list[nn.Module]) -> None:
    """Refuse, before anything is frozen, a model LoRA would adapt only in part: a grouped convolution (the
    summed weight W + up . down has no grouped form), a subclass of a conv or linear layer (its own forward
    would be replaced, or, as in ``nn.MultiheadAttention``, never called), or no layer at all (a DP-SGD
    stage that trains nothing would still spend its budget)."""
    bad = [
        f"{name or 'the model'} ({_kind(m)})"
        for name, m in model.named_modules()
        if isinstance(m, tuple(_ADAPTED)) and not _is_adapter(m) and (type(m) not in _ADAPTED or _grouped(m))
    ]
    if bad or not targets:
        what = "layers LoRA cannot adapt: " + ", ".join(bad) if bad else "no nn.Conv2d or nn.Linear layer"
        raise ConfigError(
            f'[dpsgd] trainable = "lora": the model has {what}; LoRA adapts plain nn.Conv2d (groups = 1) '
            'and nn.Linear layers: use trainable = "all" or "norm_attention" for this model'
        )


def _kind(m: nn.Module) -> str:
    return f"{type(m).__name__}, groups {m.groups}" if isinstance(m, nn.Conv2d) else type(m).__name__


def _grouped(m: nn.Module) -> bool:
    return isinstance(m, nn.Conv2d) and m.groups != 1


def has_lora(model: nn.Module) -> bool:
    return any(_is_adapter(m) for m in model.modules())


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each layer's adapters into its weight (W + up . down: the same function of the input) and remove
    the adapters; each layer is its plain class again and every parameter is trainable again (a model's
    default). Returns ``model``."""
    if not has_lora(model):
        return model
    for m in [m for m in model.modules() if isinstance(m, (LoRAConv2d, LoRALinear))]:
        with torch.no_grad():
            m.weight.add_(lora_delta(m).to(m.weight.dtype))
        delattr(m, _DOWN)
        delattr(m, _UP)
        m.__class__ = nn.Conv2d if isinstance(m, nn.Conv2d) else nn.Linear
    for p in model.parameters():
        p.requires_grad_(True)
    return model
