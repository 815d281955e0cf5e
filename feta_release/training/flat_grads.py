"""The containers that let a DP-SGD call's clip touch its per-example gradients once, and its sums in one
operation.

A call of the derived 28 px job (32 examples) makes ~20 MB of per-example gradients in 105 tensors; every pass
of the clip over them from memory costs about what the rest of the clip does. The clip needs three: each
example's norm, the zeroing of non-finite entries (branch-free, so that a non-finite example costs what any
other does), and the weighted sum of the rows. ``ScreenedGrads`` moves the first two into the layer hooks
(``training.ghost_clip.hook_grads(screen=True)``), which run them on each parameter's gradient the moment its
rule has made it, while it is in cache; the clip (``training.dpsgd.clip_and_sum``) then makes the one pass
left, the weighted sums, and writes them side by side into one ``FlatGrads`` vector, so that a step adds a
call's clipped sum into its total in one operation (``add_into``) instead of one per parameter.

Nothing about WHAT is computed changes: the norms are those of the same vectors, taken before any entry is
zeroed, in the same order of operations (so the clipped sums are bit-identical to the clip's own passes); a
non-finite example still gets factor 0 and zeroed entries.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["FlatGrads", "ScreenedGrads", "add_into", "flat_zeros", "layout_of"]

Layout = tuple[tuple[str, int, int, tuple[int, ...]], ...]  # (name, offset, numel, shape) per parameter


class _Views(dict[str, Tensor]):
    """A dict whose tensors were handed over together; ``intact`` tells whether any was replaced since."""

    def __init__(self, items: Iterable[tuple[str, Tensor]]) -> None:
        super().__init__(items)
        self._ptrs = [v.data_ptr() for v in self.values()]

    def intact(self) -> bool:
        """Whether every entry is still the tensor it was made with (none replaced, added or removed)."""
        return len(self) == len(self._ptrs) and all(
            v.data_ptr() == p for v, p in zip(self.values(), self._ptrs, strict=True)
        )


class ScreenedGrads(_Views):
    """Per-example gradients (name -> (B, *shape)) whose non-finite entries are ALREADY zeroed, with
    ``norms`` (B,): each example's L2 norm over all of them taken BEFORE that (inf or NaN for an example
    with a non-finite entry). Only the clip may read them (``training.dpsgd.clip_and_sum``, which takes its
    factors from ``norms``): anything that reads the entries as the raw gradients (the patient-level
    ``group_sum``, FedSGD's ``clipped_rows``) would take a non-finite example for a finite one."""

    def __init__(self, grads: dict[str, Tensor], norms: Tensor) -> None:
        super().__init__(grads.items())
        self.norms = norms


class FlatGrads(_Views):
    """name -> tensor (``shape``), every tensor a view of the one vector ``flat`` (D,), the parameters'
    blocks side by side in the dict's order (``layout``)."""

    def __init__(self, flat: Tensor, layout: Layout) -> None:
        super().__init__((name, flat[o : o + k].view(shape)) for name, o, k, shape in layout)
        self.flat = flat
        self.layout = layout


def layout_of(named: Iterable[tuple[str, Tensor]]) -> Layout:
    """The blocks of ``named`` tensors side by side, in order."""
    out, o = [], 0
    for name, p in named:
        out.append((name, o, p.numel(), tuple(p.shape)))
        o += p.numel()
    return tuple(out)


def flat_zeros(named: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """Zeros shaped like the ``named`` tensors: one ``FlatGrads`` when they share a dtype and a device, else
    one tensor each."""
    if not named or len({(p.dtype, p.device) for _, p in named}) != 1:
        return {n: torch.zeros_like(p) for n, p in named}
    layout = layout_of(named)
    d = layout[-1][1] + layout[-1][2]
    return FlatGrads(named[0][1].new_zeros(d), layout)


def add_into(total: dict[str, Tensor], part: dict[str, Tensor]) -> None:
    """``total[name] += part[name]`` for every name of ``total``: one addition when both are intact
    ``FlatGrads`` of the same layout, else one per parameter."""
    if (
        isinstance(total, FlatGrads)
        and isinstance(part, FlatGrads)
        and total.layout == part.layout
        and total.intact()
        and part.intact()
    ):
        total.flat += part.flat
        return
    for name in total:
        total[name] += part[name]
