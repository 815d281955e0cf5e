"""Per-example gradients from ONE ordinary batched forward/backward (layer hooks), for the DP-SGD engine.

``training.dpsgd.per_example_grads`` computes, for each example of a chunk, the gradient of that example's
loss (the MEAN of its loss over the K noise draws / augmented copies) with respect to every trainable
parameter. The torch.func path does it with ``vmap(grad(...))``; this module does the same computation the way
the book-keeping method of Bu et al. (2023) does: one batched forward over the B*K rows with forward hooks
that keep each layer's input and put a tap (``_Tap``) on its output, one backward of the summed loss that
computes the layers' OUTPUT gradients only (so autograd never computes the batch weight gradients, which the
per-example ones replace), and, per layer, the per-example weight gradient from (input, output gradient),
computed by the tap as soon as autograd has that output gradient:

* ``Linear``: ``G_i = sum_t g_it a_it^T`` over the example's positions t (its K rows and any sequence axis);
* ``Conv2d``: the same over the input patches, as one grouped-conv weight gradient (examples as groups); a
  conv with at most 2 output channels at stride 1 by batched matmuls over shifted slices of its padded input,
  one with few input taps (C_in*kh*kw <= 36, e.g. the image's input conv) by one batched matmul over its
  unfolded patches, one with at most 4 output channels by a loop over examples, a 1x1 conv by batched
  matmuls (``_conv_grads``);
* ``GroupNorm``: ``sum_t g_it * xhat_it``, bias ``sum_t g_it``, by the native GroupNorm backward with the
  forward's own mean and 1/std (``_group_norm``);
* ``Embedding``: the output gradients scattered to the rows of the looked-up indices;
* a LoRA layer (``models.lora``: one call with the summed weight ``W + up . down``): its layer's rule gives
  the summed weight's ``G_i``, and the adapters' gradients are ``G_i down^T`` and ``up^T G_i``
  (``_adapter_grads``); the adapter layers never run, so their weights belong to the adapted layer
  (``_owners``).

Rows are K-major (``BatchedLoss``): row k*B + i is copy k of example i, so a layer's (B*K, ...) tensor
reshapes to (K, B, ...) and, for a conv, to the (K, B*C, H, W) of the grouped weight gradient without a copy
(example-major rows needed a transpose copy of every layer's input and output gradient, 10-20% of the conv
rule).

The K copies of one example are treated as extra positions of that example (summed inside its gradient BEFORE
the norm), which is exactly the torch.func semantic: one clipped vector per example, the gradient of its
K-draw mean.

Why instantiate and not the ghost norm: the ghost norm ``||G_i||^2 = sum_{t,s} (a_t.a_s)(g_t.g_s)`` costs
~2T^2 per example against T*d_in*d_out for ``G_i`` itself (T positions), so it wins when 2T^2 < d_in*d_out (Bu
et al.'s per-layer rule). On the cpu-eps1 UNet no conv qualifies: T = K*H*W >= 196 gives 2T^2 >= 76,832
against d_in*d_out <= 576*32 = 18,432. The embedding MLP's Linear layers (T = K, d_in*d_out <= 64*64) do
qualify, but all of them together took ~2 ms of a ~500 ms step (measured, B = 16, K = 4): the ghost norm would
save nothing measurable, and instantiating yields the per-example gradients that the rest of the engine
already consumes (``clip_and_sum``, the patient ``group_sum``, FedSGD's per-record ``clipped_rows``, the
padding): nothing downstream changes, and the norm is computed from the very same vectors. For a conv,
instantiating costs the FLOPs of the weight gradient an ordinary backward computes (which the backward here
skips).

Why not Opacus (1.6 installed): its ghost mode (``grad_sample_mode="ghost"``) clips each ROW, and the norm of
a K-row mean is not a function of the K row norms, so it cannot keep the K-multiplicity semantic; its
``GradSampleModule`` hooks materialise one gradient per ROW (K times more) and measured 3.08x the non-private
step in ``bench/bench_dpsgd.py`` (this module's figure: docs/evaluation.md, "DP-SGD step cost").

Privacy argument (unchanged, see ``training.dpsgd``): each sampled example contributes one gradient vector,
clipped to L2 norm C over all trainable parameters together; the clipped sum gets N(0, (sigma C)^2) noise once
per step. This module only changes HOW the per-example vectors are computed, so it must compute the same
vectors: ``tests/training/test_ghost_clip.py`` checks them against the torch.func path on the real denoiser (K
= 1 and 4, clipped and unclipped examples) and on random small layers. The decomposition ``per-example
gradient = sum over the example's rows`` holds only when the model treats rows independently (no BatchNorm, no
op across the batch axis): the modules that would mix rows are refused (``unsupported``) and the caller falls
back to torch.func, never skipping a parameter. A model whose own code mixes rows by other means (e.g.
``x.mean(0)``) must not use this engine: the UNet keeps that constraint for vmap already (``models.unet``).

The rules see a parameter only through its own module's forward (input, output gradient), so they also hold
only when every use of the parameter IS that forward, the library's, with options the rule implements (the
former engine returned other vectors than torch.func, silently, for weight tying through ``F.linear(h,
emb.weight)``, ``Embedding(scale_grad_by_freq=True)``, a subclass's own forward, a forward hook, an extra
parameter such as the old ``weight_norm``'s, and a layer over rows that are not the batch's). What the module
tree shows is refused by ``unsupported`` (shared parameters, options, subclasses, hooks, unknown parameters);
the rest only shows when the model runs, so the engine's choice (``training.dpsgd.select_engine(check=True)``:
the trainer's build, a FedSGD round) also runs ``cross_check`` once: uses of each parameter counted in the
autograd graph against its module's calls, then the hooks' per-example gradients against each example's own
backward, on a 2-example dummy batch from a fixed public generator and a scrambled copy of the model. Most of
these errors leave each vector a function of its own example (wrong, still clipped: the sum's sensitivity
stays C); rows that are not the batch's do not (an "example" gradient then sums other examples' rows, and the
clip no longer bounds one example).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from functools import partial
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..models.lora import LoRAConv2d, LoRALinear

__all__ = ["BatchedLoss", "K_MAJOR", "batched_form", "unsupported", "hook_grads", "cross_check"]

_ROW_MIXING = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.SyncBatchNorm)


K_MAJOR = "k-major"


@runtime_checkable
class BatchedLoss(Protocol):
    """A per-example loss that also has a batched form: ``batched(model, x (B,...), y (B,), rand)`` returns
    the B per-example losses from ONE call of ``model`` over R = B*r rows, row k*B + i holding copy k (0 <= k
    < r) of example i (K-major: the B examples' first copies, then their second copies, ...), and equals
    ``loss(model, x[i], y[i], rand_i)`` for each i.

    ``row_order`` must be ``"k-major"`` (``K_MAJOR``): the declaration that ``batched`` lays its rows out that
    way. The engine reads row k*B + i as example i's; a loss laid out otherwise (e.g. example-major, the
    layout before this one) would have each "example" gradient sum rows of several examples, so one example
    could reach several clipped vectors (sensitivity above C). A loss without the declaration is never given
    to these hooks (``training.dpsgd.select_engine`` falls back to torch.func)."""

    row_order: str

    def batched(
        self, model: Callable[..., Tensor], x: Tensor, y: Tensor, rand: dict[str, Tensor]
    ) -> Tensor: ...


def batched_form(loss: object) -> bool:
    """Whether ``loss`` has a batched form these hooks may use (``BatchedLoss`` with K-major rows
    declared)."""
    return isinstance(loss, BatchedLoss) and getattr(loss, "row_order", None) == K_MAJOR


def _options_problem(m: nn.Module) -> str | None:
    """A module option no rule implements (None: the rule computes exactly what the module's backward
    would)."""
    if isinstance(m, nn.Conv2d) and (
        m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str)
    ):
        return "Conv2d with groups, a padding mode or string padding"
    if isinstance(m, nn.Embedding):
        # scale_grad_by_freq divides by each index's count in the WHOLE batch of rows: the rule would have to
        # count per example (torch.func's semantic); max_norm renormalises the weight in the forward; sparse:
        # no rule
        bad = [
            o
            for o, on in (
                ("max_norm", m.max_norm is not None),
                ("sparse", m.sparse),
                ("scale_grad_by_freq", m.scale_grad_by_freq),
            )
            if on
        ]
        return f"Embedding with {' and '.join(bad)}" if bad else None
    return None


def _module_problem(m: nn.Module) -> str | None:
    """Why this module's own trainable parameters cannot be handled here (None: they can). The rules see a
    module only through its forward's input and output, so they hold only for the library's own forward (a
    subclass's may use the weight otherwise), with no forward hook (a hook's changed output is what the tap
    would differentiate), for the parameters the rule knows (``weight``, ``bias``: not e.g. the old
    ``weight_norm``'s ``weight_g``)."""
    base = next((cls for cls in _RULES if isinstance(m, cls)), None)
    if base is None:
        return f"no per-example rule for {type(m).__name__}"
    if type(m).forward is not base.forward:
        return f"{type(m).__name__} has its own forward (the {base.__name__} rule assumes the library's)"
    if m._forward_hooks:
        return "a forward hook (the rule would take the gradient at the output the hook returns)"
    known = ("weight",) if base is nn.Embedding else ("weight", "bias")
    extra = [n for n, p in m.named_parameters(recurse=False) if p.requires_grad and n not in known]
    if extra:
        return (
            f"parameter(s) {', '.join(extra)} that no rule computes (e.g. the old weight_norm's "
            "weight_g/weight_v)"
        )
    return _options_problem(m)


def _shared(model: nn.Module) -> list[str]:
    """Trainable parameters registered in more than one place (weight tying between modules): refused, because
    which uses reach a parameter is not something a module's rule can see (one module registered under two
    names is one owner: its calls add up, as for any module called twice)."""
    owners: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        for attr, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                owners.setdefault(id(p), []).append(f"{name}.{attr}" if name else attr)
    return [
        f"{' = '.join(o)}: one parameter shared by several modules (weight tying); untie it or use "
        'per_example = "vmap"'
        for o in owners.values()
        if len(o) > 1
    ]


def _covered(m: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters ``m``'s rule computes, by their path from ``m``: its own, and a LoRA layer's adapter
    weights too (the layer's forward uses them, the adapter layers never run: ``models.lora``)."""
    own = [(n, p) for n, p in m._parameters.items() if p is not None]
    if isinstance(m, (LoRAConv2d, LoRALinear)):
        own += [(f"{a}.weight", getattr(m, a).weight) for a in ("lora_down", "lora_up")]
    return own


def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """id of each trainable parameter -> (name, module) of the module whose rule computes it: its own, or the
    LoRA layer that uses an adapter's weight (a parent comes before its children in ``named_modules``)."""
    out: dict[int, tuple[str, nn.Module]] = {}
    for name, m in model.named_modules():
        for _, p in _covered(m):
            if p.requires_grad and id(p) not in out:
                out[id(p)] = (name, m)
    return out


def unsupported(model: nn.Module) -> list[str]:
    """Reasons this engine cannot compute ``model``'s per-example gradients (empty: it can, as far as the
    module tree shows; a parameter used outside its module's forward shows only when the model runs:
    ``cross_check``)."""
    out = _shared(model)
    if nn.modules.module._global_forward_hooks:
        out.append(
            "a global forward hook (nn.modules.module.register_module_forward_hook) changes layer outputs"
        )
    owners = {id(m) for _, m in _owners(model).values()}
    for name, m in model.named_modules():
        if isinstance(m, _ROW_MIXING):
            out.append(f"{name or 'model'}: {type(m).__name__} mixes the rows of a batch")
            continue
        if id(m) in owners:
            why = _module_problem(m)
            if why is not None:
                out.append(f"{name or 'model'}: {why}")
    return out


def _by_copy(t: Tensor, b: int) -> Tensor:
    """(R, ...) rows -> (R/B, B, ...): K-major rows (row k*B + i = copy k of example i), so a view, never a
    copy."""
    r = t.shape[0] // b
    if r * b != t.shape[0]:
        raise ValueError(
            f"per-example hooks: a layer saw {t.shape[0]} rows, not a multiple of the {b} examples"
        )
    return t.reshape(r, b, *t.shape[1:])


def _linear(m: nn.Linear, a: Tensor, g: Tensor, b: int) -> dict[str, Tensor]:
    # (B, positions, d): a copy when K > 1, but the Linear layers are the embedding MLP's (a few ms a step)
    a = _by_copy(a, b).transpose(0, 1).reshape(b, -1, a.shape[-1])
    g = _by_copy(g, b).transpose(0, 1).reshape(b, -1, g.shape[-1])
    out = {"weight": torch.bmm(g.transpose(1, 2), a)}
    if m.bias is not None:
        out["bias"] = g.sum(1)
    return out


_LOOP_MAX_OUT = 4  # convs with at most this many output channels take the per-example loop (see _conv_grads)
_SHIFT_MAX_OUT = 2  # ... and of those, at stride 1, at most this many the shifted slices (_shifted_weight)
_UNFOLD_MAX_TAPS = 36  # convs with at most this many input taps (C_in*kh*kw) unfold them (_unfolded_weight)


def _shifted_weight(m: nn.Conv2d, a: Tensor, g: Tensor, b: int) -> Tensor:
    """(B, *weight.shape) per-example weight gradients of a stride-1 conv with very few output channels, as
    kh*kw batched matmuls: tap (u, v) of example i is ``g[i]`` times ``a_pad[i]`` shifted by (u*dh, v*dw),
    summed over positions. With the padded input flattened row by row (width w2), every shift is ONE
    contiguous slice of it, a strided view that the batched matmul reads in place (no im2col copy); ``g`` is
    padded from its width to w2 with zero columns, which cancel the slices' wrap-around into the next row.
    One extra zero row at the bottom keeps the last slice inside the buffer.

    The output gradient is the LEFT operand, (O, L) @ (L, C_in) with the slice read transposed: the UNet's
    output conv (16 -> 1, 3x3, 28x28, B = 32, K = 1) took 0.8 ms, against 2.2 ms with the slice on the left
    ((C_in, L) @ (L, O): MKL's matrix-vector path for one output column), 3.6 ms in the grouped kernel and 1.1
    ms for the batched (non-private) weight gradient (1 thread, measured). With more output channels the
    grouped kernel wins (16 -> 16: 1.2 vs 2.6 ms)."""
    (kh, kw), (ph, pw), (dh, dw) = m.kernel_size, m.padding, m.dilation
    r, c, o = a.shape[0] // b, a.shape[1], g.shape[1]
    w2 = a.shape[3] + 2 * pw
    ap = nn.functional.pad(a, (pw, pw, ph, ph + 1)).reshape(r, b, c, -1)  # (r, B, C, (h2 + 1) * w2)
    gp = nn.functional.pad(g, (0, w2 - g.shape[3])).reshape(r, b, o, -1)  # (r, B, O, L)
    n = gp.shape[3]  # L = H' * w2 output positions, the padding columns' zero gradients included
    out = a.new_empty((kh, kw, b, o, c))
    for u in range(kh):
        for v in range(kw):
            s = u * dh * w2 + v * dw
            torch.bmm(gp[0], ap[0, :, :, s : s + n].transpose(1, 2), out=out[u, v])
            for k in range(1, r):  # the example's other rows (K-major: copy k)
                out[u, v].baddbmm_(gp[k], ap[k, :, :, s : s + n].transpose(1, 2))
    return out.permute(2, 3, 4, 0, 1).contiguous()


def _unfolded_weight(m: nn.Conv2d, a: Tensor, g: Tensor, b: int) -> Tensor:
    """(B, *weight.shape) per-example weight gradients of a conv with few input taps (C_in*kh*kw), as one
    batched matmul per copy k: ``g_i (C_out, L) @ cols_i^T (L, C_in*kh*kw)``, ``cols`` the unfolded patches
    of the padded input (im2col), gathered by one strided view of it (any stride and dilation) and one copy.
    With few taps that copy is small (the UNet's 1 -> 16 input conv: 9 floats a position) and the matmul's
    inner dimension is the L output positions: 0.30 ms against 1.5 ms for the grouped kernel (28x28, B = 84,
    K = 1, 2 threads), 0.95 vs 1.9 ms at 4 -> 16; ``F.unfold`` took 1.1 ms. At 16 input channels the copy
    is 16 x 9 floats a position and the grouped kernel wins (measured)."""
    (kh, kw), (ph, pw), (dh, dw), (sh, sw) = m.kernel_size, m.padding, m.dilation, m.stride
    r, c, o = a.shape[0] // b, a.shape[1], g.shape[1]
    ap = nn.functional.pad(a, (pw, pw, ph, ph))  # a fresh contiguous tensor: the strides below are its own
    s0, s1, s2, s3 = ap.stride()
    cols = ap.as_strided(
        (a.shape[0], c, kh, kw, g.shape[2], g.shape[3]), (s0, s1, dh * s2, dw * s3, sh * s2, sw * s3)
    ).reshape(r, b, c * kh * kw, -1)  # (r, B, C_in*kh*kw, L): the one copy
    g3 = g.reshape(r, b, o, -1)  # (r, B, C_out, L)
    out = torch.bmm(g3[0], cols[0].transpose(1, 2))
    for k in range(1, r):  # the example's other rows (K-major: copy k)
        out.baddbmm_(g3[k], cols[k].transpose(1, 2))
    return out.reshape(b, *m.weight.shape)


def _pointwise_weight(a: Tensor, g: Tensor, b: int) -> Tensor:
    """(B, C_out, C_in) per-example weight gradients of a 1x1 conv (stride 1, no padding): one batched matmul
    per copy k, accumulated. A grouped 1x1 convolution_backward falls back to one small kernel per group
    on CPU: 0.85 vs 0.61 ms (the UNet's 32 -> 16 skip conv at 28x28, B = 16, K = 4), 0.37 vs 0.30 ms at B =
    32, K = 1."""
    r = a.shape[0] // b
    a3, g3 = a.reshape(r, b, a.shape[1], -1), g.reshape(r, b, g.shape[1], -1)  # (r, B, C, HW): views
    out = torch.bmm(g3[0], a3[0].transpose(1, 2))
    for k in range(1, r):
        out.baddbmm_(g3[k], a3[k].transpose(1, 2))
    return out


def _bias(m: nn.Conv2d, g: Tensor, b: int) -> Tensor | None:
    """(B, C_out) per-example bias gradients (None without a bias): sums over each example's rows and
    pixels."""
    if m.bias is None:
        return None
    r = g.shape[0] // b
    return g.reshape(r, b * m.out_channels, -1).sum(2).reshape(r, b, -1).sum(0)


class _ZeroPool:
    """One zero-filled buffer whose leading part stands in, as a contiguous view, for any grouped weight whose
    values the kernel never reads (``_conv_grads``): one fill per chunk of the largest such weight, instead
    of one per layer (the UNet's 19 grouped convs at B = 84: ~54 MB of zeros a chunk). Nothing ever writes to
    it (it is only ever an input), so every view stays zero; a larger request gets a fresh buffer and leaves
    the views already handed out on the old one."""

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    def zeros(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        n = math.prod(shape)
        buf = self._buf
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buf = torch.zeros(n, dtype=like.dtype, device=like.device)
        return buf[:n].view(shape)


def _conv_grads(
    m: nn.Conv2d, a: Tensor, g: Tensor, b: int, pool: _ZeroPool | None = None
) -> tuple[Tensor, Tensor | None]:
    """Each example's weight gradient (B, *weight.shape) and bias gradient (B, C_out) (None without a bias),
    summed over its r = R/B rows. ``pool``: where the grouped kernel's zero weight comes from (a fresh
    one without)."""
    args = (list(m.stride), list(m.padding), list(m.dilation), False, [0, 0])
    r = a.shape[0] // b
    if m.out_channels <= _SHIFT_MAX_OUT and m.stride == (1, 1):
        return _shifted_weight(m, a, g, b), _bias(m, g, b)
    if m.in_channels * m.kernel_size[0] * m.kernel_size[1] <= _UNFOLD_MAX_TAPS and m.kernel_size != (1, 1):
        return _unfolded_weight(m, a, g, b), _bias(m, g, b)  # (a 1x1 conv's patches are its input: below)
    if m.out_channels <= _LOOP_MAX_OUT:
        # The grouped kernel is at its worst with very few output channels per group: 16 -> 1, 2 or 4
        # channels, 3x3, 28x28 took 4.3-4.5 ms grouped vs 1.9-2.0 ms in this loop at B = 16, K = 4, and
        # 2.1-2.2 vs 1.0-1.4 ms at B = 32, K = 1 (1 thread, best of 5 runs). From 8 output channels the loop's
        # B small kernels lose (16 -> 8: 1.2 grouped vs 2.0 ms; the UNet's 16 -> 16: 1.2 vs 2.0 ms in place);
        # a small C_in does not help the loop (the UNet's 1 -> 16 input conv: 0.65 grouped vs 0.84 ms).
        a5, g5 = _by_copy(a, b), _by_copy(g, b)
        return torch.stack(
            [
                torch.ops.aten.convolution_backward(
                    g5[:, i], a5[:, i], m.weight.detach(), None, *args, 1, [False, True, False]
                )[1]
                for i in range(b)
            ]
        ), _bias(m, g, b)
    if m.kernel_size == (1, 1) and m.stride == (1, 1) and m.padding == (0, 0):
        return _pointwise_weight(a, g, b).reshape(b, *m.weight.shape), _bias(m, g, b)
    # The per-example weight gradient of a conv IS a weight gradient: that of a grouped conv with one group
    # per example, over a "batch" of the example's r rows. K-major rows make (r, B*C, H, W) a view of the
    # layer's own tensors (no copy), and one convolution_backward computes all B gradients in the native
    # kernel: im2col + a batched GEMM measured 3x slower on CPU (the unfolded patches are kh*kw times the
    # input). The grouped weight's VALUES never enter a weight gradient (only its shape does): a zero buffer
    # instead of B copies of the weight (a copy as large as the per-example gradients themselves); zeros, not
    # uninitialised memory, so that a backend which did read it would give a wrong-but-deterministic result
    # the cross-check against torch.func catches, never NaN bits the clip would silently drop. The bias
    # gradient comes from the same call (per group = per example): 32.8 vs 34.3 ms for the UNet's grouped
    # convs with a separate sum (B = 16, K = 4).
    w, has_bias = (
        (pool or _ZeroPool()).zeros((b * m.out_channels, *m.weight.shape[1:]), a),
        m.bias is not None,
    )
    _, gw, gb = torch.ops.aten.convolution_backward(
        g.reshape(r, -1, *g.shape[2:]),
        a.reshape(r, -1, *a.shape[2:]),
        w,
        [b * m.out_channels] if has_bias else None,
        *args,
        b,
        [False, True, has_bias],
    )
    return gw.reshape(b, *m.weight.shape), gb.reshape(b, -1) if has_bias else None


def _conv2d(m: nn.Conv2d, a: Tensor, g: Tensor, b: int, pool: _ZeroPool) -> dict[str, Tensor]:
    weight, bias = _conv_grads(m, a, g, b, pool)
    return {"weight": weight} if bias is None else {"weight": weight, "bias": bias}


def _group_norm_stats(m: nn.GroupNorm, a: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
    """The forward's own per-(row, group) mean and 1/std, (R, G) each, taken from the autograd node that saved
    them for the backward (free, and exactly the values the forward normalised with); recomputed by the same
    native op if that node is not there (another dispatch path)."""
    fn = out.grad_fn
    if fn is not None and fn.name() == "NativeGroupNormBackward0":
        return fn._saved_result1.detach(), fn._saved_result2.detach()
    n, c = a.shape[:2]
    _, mean, rstd = torch.ops.aten.native_group_norm(
        a, None, None, n, c, a[0, 0].numel(), m.num_groups, m.eps
    )
    return mean, rstd


def _group_norm(
    m: nn.GroupNorm, a: Tensor, g: Tensor, b: int, mean: Tensor, rstd: Tensor
) -> dict[str, Tensor]:
    # Each example's weight gradient sum_t g_t * xhat_t (bias: sum_t g_t) IS a GroupNorm weight gradient: that
    # of the (r, B*C, HW) view of the K-major rows with B*G groups, whose per-(row, group) statistics are the
    # forward's (R, G) ones reshaped. The native backward computes it from (g, input, mean, rstd) in one pass,
    # without the normalised input (recomputing it with F.group_norm took ~4x as long, measured).
    r, c, hw = a.shape[0] // b, a.shape[1], a[0, 0].numel()
    want = [False, m.weight is not None, m.bias is not None]
    # the native kernel reads its inputs as contiguous rows (an output gradient can come strided: measured
    # wrong)
    _, gw, gb = torch.ops.aten.native_group_norm_backward(
        g.contiguous().reshape(r, b * c, hw),
        a.contiguous().reshape(r, b * c, hw),
        mean.contiguous().reshape(r, -1),
        rstd.contiguous().reshape(r, -1),
        a.new_ones(b * c),
        r,
        b * c,
        hw,
        b * m.num_groups,
        want,
    )
    out = {}
    if want[1]:
        out["weight"] = gw.reshape(b, c)
    if want[2]:
        out["bias"] = gb.reshape(b, c)
    return out


def _embedding(m: nn.Embedding, idx: Tensor, g: Tensor, b: int) -> dict[str, Tensor]:
    n, d = m.weight.shape
    idx = _by_copy(idx, b).reshape(-1, b, idx[0].numel())  # (r, B, positions): example i is column i
    flat = (idx + torch.arange(b, device=idx.device)[None, :, None] * n).flatten()
    w = (
        torch.zeros(b * n, d, dtype=g.dtype, device=g.device)
        .index_add_(0, flat, g.reshape(-1, d))
        .reshape(b, n, d)
    )
    if m.padding_idx is not None:  # torch never updates the padding row
        w[:, m.padding_idx] = 0
    return {"weight": w}


def _adapter_grads(m: nn.Module, gw: Tensor, b: int) -> dict[str, Tensor]:
    """A LoRA layer's adapters' per-example gradients from those of its summed weight ``W + up . down``,
    ``gw`` (B, *weight.shape): ``G_i down^T`` for ``up``, ``up^T G_i`` for ``down`` (the chain rule through
    the product; rank x C_out x C_in x kh x kw multiply-adds an example)."""
    down, up = m.lora_down.weight.detach(), m.lora_up.weight.detach()  # type: ignore[union-attr]
    g2 = gw.reshape(b, gw.shape[1], -1)  # (B, C_out, C_in*kh*kw)
    return {
        "lora_up.weight": (g2 @ down.reshape(down.shape[0], -1).t()).reshape(b, *up.shape),
        "lora_down.weight": (up.reshape(up.shape[0], -1).t() @ g2).reshape(b, *down.shape),
    }


def _lora_conv2d(m: LoRAConv2d, a: Tensor, g: Tensor, b: int, pool: _ZeroPool) -> dict[str, Tensor]:
    out = _conv2d(m, a, g, b, pool)  # the summed weight's: the layer's own conv rule
    return {**out, **_adapter_grads(m, out["weight"], b)}


def _lora_linear(m: LoRALinear, a: Tensor, g: Tensor, b: int) -> dict[str, Tensor]:
    out = _linear(m, a, g, b)
    return {**out, **_adapter_grads(m, out["weight"], b)}


# the LoRA layers first: they are Conv2d / Linear subclasses, and the first class that matches is the rule
_RULES: dict[type[nn.Module], Callable[..., dict[str, Tensor]]] = {
    LoRAConv2d: _lora_conv2d,
    LoRALinear: _lora_linear,
    nn.Linear: _linear,
    nn.Conv2d: _conv2d,
    nn.GroupNorm: _group_norm,
    nn.Embedding: _embedding,
}


def _rule(m: nn.Module) -> Callable[..., dict[str, Tensor]]:
    return next(f for cls, f in _RULES.items() if isinstance(m, cls))


class _Tap(torch.autograd.Function):
    """Identity on a layer's output whose backward hands the output gradient to ``fn`` the moment autograd has
    it.

    Why: asking ``torch.autograd.grad`` for every layer output returns them all at once, ~150 MB alive
    together for a 16-example chunk with K = 4; the allocator then gave those pages back to the OS and faulted
    them in again every chunk (38,000 minor faults a chunk, as much system time as compute, measured).
    Consumed inside the backward, each gradient is freed when its rule is done, as in an ordinary backward,
    and read while in cache. The extra input ``root`` (a scalar leaf) is what the backward is taken with
    respect to: every tap leads to it, so autograd runs every tap and every layer's input-gradient node, and
    still no weight gradient. The output is a view made inside a custom Function, so torch refuses a model
    that changes it in place (``F.silu(conv(x), inplace=True)``): asking autograd for the gradient of such an
    output (the former way) gave that of the changed values, and silently wrong per-example gradients."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, out: Tensor, root: Tensor, fn: Callable[[Tensor], None]
    ) -> Tensor:
        ctx.fn = fn  # type: ignore[attr-defined]
        return out.view_as(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, g: Tensor) -> tuple[Tensor, None, None]:
        ctx.fn(g)  # type: ignore[attr-defined]
        return g, None, None


def hook_grads(
    model: nn.Module, loss: BatchedLoss, x: Tensor, y: Tensor, rand: dict[str, Tensor]
) -> tuple[dict[str, Tensor], Tensor]:
    """Per-example gradients (name -> (B, *shape), every trainable parameter) and per-example losses (B,),
    from one batched forward and one backward to the layer outputs. The caller has checked
    ``unsupported(model) == []``."""
    b = x.shape[0]
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in trained}
    grads: dict[str, Tensor] = {}
    root = torch.zeros((), device=x.device, requires_grad=True)
    pool = _ZeroPool()  # the grouped convs' zero weights, one buffer for the chunk

    # each hooked module's rule and the trained parameters it computes (attribute path -> name), once a chunk
    # (``get_parameter`` per returned gradient was ~0.1 ms of Python a chunk)
    owned = _owners(model)
    hooked = {id(m): m for _, m in owned.values()}
    plan = {
        k: (_rule(m), {attr: names[id(p)] for attr, p in _covered(m) if owned.get(id(p), ("", None))[1] is m})
        for k, m in hooked.items()
    }

    def rule(m: nn.Module, a: Tensor, extra: tuple[object, ...], g: Tensor) -> None:
        f, targets = plan[id(m)]
        for attr, gi in f(m, a, g, b, *extra).items():
            n = targets.get(attr)
            if n is not None:  # a module called twice (shared) adds its calls' contributions
                grads[n] = grads[n] + gi if n in grads else gi

    def tap(m: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        a = inputs[0].detach()
        extra: tuple[object, ...] = ()
        if isinstance(m, nn.GroupNorm):
            extra = _group_norm_stats(m, a, output)
        elif isinstance(m, nn.Conv2d):
            extra = (pool,)
        return _Tap.apply(output, root, partial(rule, m, a, extra))

    handles = [m.register_forward_hook(tap) for m in hooked.values()]
    try:
        values = loss.batched(model, x, y, rand)
    finally:
        for h in handles:
            h.remove()
    # a tap the loss does not reach never runs: a zero contribution. Under no_grad this raises (loud,
    if hooked:
        # as the former autograd.grad to the outputs did) rather than returning all-zero gradients
        torch.autograd.grad(values.sum(), root, allow_unused=True)
    # the zeros only for a parameter no tap reached (``grads.get(n, zeros)`` would fill a B-row buffer for
    # every parameter, ~1/3 of the clip's cost, and drop it)
    full = {
        n: grads[n] if n in grads else torch.zeros((b, *p.shape), dtype=p.dtype, device=p.device)
        for n, p in trained
    }
    return full, values.detach()


# -- the cross-check (once, when an engine is chosen: training.dpsgd.select_engine)
# ---------------------------------

# the dummy batch's and the scrambled weights' generator: fixed and public, never site data
_CHECK_SEED = 20261124
# per parameter, relative to its own norm / to the whole gradient's (rounding: ~1e-7)
_RTOL, _ATOL = 1e-2, 1e-4


def _scrambled(model: nn.Module, gen: torch.Generator) -> nn.Module:
    """A copy of ``model`` with every parameter redrawn from ``gen`` (fan-in scaled) and dropout off, in train
    mode: the check then depends on the model's structure only (not its weights, not the site's data), no
    branch hides behind a zero-initialised layer, and the two engines' dropout draws cannot differ."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_((torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)).to(p.device, p.dtype))
    for m in twin.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return twin.train()


def _graph_uses(out: Tensor) -> dict[int, int]:
    """How many times each leaf tensor enters the autograd graph of ``out`` (edges into its AccumulateGrad
    node)."""
    uses: dict[int, int] = {}
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and hasattr(nxt, "variable"):  # AccumulateGrad: the edge to a leaf
                uses[id(nxt.variable)] = uses.get(id(nxt.variable), 0) + 1
            else:
                todo.append(nxt)
    return uses


def _outside_uses(
    model: nn.Module, loss: BatchedLoss, x: Tensor, y: Tensor, rand: dict[str, Tensor]
) -> str | None:
    """A trainable parameter the forward uses more often than its module runs is also used OUTSIDE its module
    (weight tying through ``F.linear(h, emb.weight)``): that use's gradient no rule sees. Each supported
    module's forward uses each of its parameters once (one edge into the parameter's graph leaf per call)."""
    owner = _owners(model)
    calls: dict[int, int] = {}

    def count(m: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        calls[id(m)] = calls.get(id(m), 0) + 1

    handles = [m.register_forward_hook(count) for _, m in {id(m): (n, m) for n, m in owner.values()}.values()]
    try:
        uses = _graph_uses(loss.batched(model, x, y, rand).sum())
    finally:
        for h in handles:
            h.remove()
    for name, p in model.named_parameters():
        if p.requires_grad and uses.get(id(p), 0) > calls.get(id(owner[id(p)][1]), 0):
            return (
                f"{name} is used {uses[id(p)]} time(s) in the forward but its module ran "
                f"{calls.get(id(owner[id(p)][1]), 0)}: a use outside the module (weight tying, e.g. "
                "F.linear(h, emb.weight)) that no rule sees"
            )
    return None


def _one_by_one(
    model: nn.Module, loss: Callable[..., Tensor], x: Tensor, y: Tensor, rand: dict[str, Tensor]
) -> dict[str, Tensor]:
    """The definition the hooks must meet: each example's own loss (``PerExampleLoss.__call__``, the one
    torch.func differentiates) through an ordinary backward, one example at a time. Not torch.func itself: its
    first call in a process costs ~0.8 s of warm-up (measured), the check's whole budget ten times over."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = [
        torch.autograd.grad(
            loss(model, x[i], y[i], {k: v[i] for k, v in rand.items()}),
            [p for _, p in named],
            allow_unused=True,
        )
        for i in range(x.shape[0])
    ]
    return {
        n: torch.stack([r[j] if r[j] is not None else torch.zeros_like(p) for r in rows])
        for j, (n, p) in enumerate(named)
    }


def _mismatch(got: dict[str, Tensor], ref: dict[str, Tensor]) -> str | None:
    """The first parameter whose per-example gradients differ from the reference's beyond rounding (None:
    none)."""
    if list(got) != list(ref):
        return f"the hooks gave gradients for {sorted(got)}, not for {sorted(ref)}"
    total = math.sqrt(sum(float(r.double().pow(2).sum()) for r in ref.values()))
    for n, r in ref.items():
        err, size = float((got[n].double() - r.double()).norm()), float(r.double().norm())
        if not err <= _RTOL * size + _ATOL * total:  # a NaN fails too
            return (
                f"{n}: the hooks' per-example gradient is {err / max(size, 1e-30):.3g} (relative) off the "
                "true one"
            )
    return None


def cross_check(model: nn.Module, loss: object, n: int = 2) -> str | None:
    """Why the hooks' per-example gradients of ``model`` are not the true ones (each example's loss through
    its own ordinary backward: ``_one_by_one``) on an ``n``-example dummy batch (None: they are, within float
    rounding). The batch is ``loss.example(n, generator)`` and
    ``loss.draw`` from a fixed public generator, on a scrambled copy of the model (``_scrambled``): never site
    data, never the model's own weights or generators, and the model itself is not touched.

    What it catches that ``unsupported`` cannot: a parameter used outside its module (exactly, by counting
    uses in the autograd graph), and a layer applied to rows that are not the batch's (e.g. positions folded
    into the row axis: one example's "gradient" then sums other examples' rows, which the clip no longer
    bounds)."""
    example, draw = getattr(loss, "example", None), getattr(loss, "draw", None)
    if not batched_form(loss) or not callable(example) or not callable(draw) or not callable(loss):
        return (
            f"the loss {type(loss).__name__} gives no public dummy example (example(n, generator)) to "
            "cross-check the hooks on"
        )
    assert isinstance(loss, BatchedLoss)
    gen = torch.Generator().manual_seed(_CHECK_SEED)
    try:
        twin = _scrambled(model, gen)
    except RuntimeError as err:  # e.g. a non-leaf weight (the old weight_norm) that deepcopy refuses
        return f"the model cannot be copied to check it ({str(err).splitlines()[0]})"
    dev = next((p.device for p in twin.parameters()), torch.device("cpu"))
    x, y = (t.to(dev) for t in example(n, gen))
    rand = {k: v.to(dev) for k, v in draw(n, gen).items()}
    try:  # a failure is a reason like the others: "auto" then takes torch.func, which fails loudly if it must
        why = _outside_uses(twin, loss, x, y, rand)
        if why is not None:
            return why
        got, _ = hook_grads(twin, loss, x, y, rand)
        return _mismatch(got, _one_by_one(twin, loss, x, y, rand))
    except (RuntimeError, ValueError, IndexError, TypeError) as err:  # e.g. an output changed in place (_Tap)
        return f"the check failed on the dummy batch ({type(err).__name__}: {str(err).splitlines()[0]})"
