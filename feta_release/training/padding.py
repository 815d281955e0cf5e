"""Work padded to a public size: the time a site takes must not count its private sample.

A site's reply latency (seen by the coordinator per request), and the CPU time of its worker (seen by other
local users in ``/proc``), grow with the rows it processes. For a DP-SGD step that is the realised Poisson
batch |B|, an un-noised count: over many steps its mean gives the site's exact size N, which only the public
nominal size may stand for. So the work of each step is padded to a PUBLIC row count, the same bound FedSGD
uses (``edge.fedsgd.padded_sample``): whole physical chunks covering q·n_public + ``PAD_SIGMAS`` standard
deviations of Binomial(n_public, q), where a site holding more images than its public size uses
``public_rows`` (the public size doubled until it covers them: the bucket its padded whole-dataset passes
already reveal) in place of n_public (``training.step_rows.site_step_rows``: torch-free, so the job rules'
cost model charges a step this very count). A sample above the bound (probability < 3e-7 per step, since
N <= that n) is processed whole and takes longer.

Padding rows are dummy rows (copies of row 0) processed in their own calls after the real ones, through the
same per-example gradient and clip, with randomness from a fixed PUBLIC generator and the global RNG state
restored; their clipped gradients are dropped (weight 0). The real rows' computation, the private generator's
stream and so the released update are bit-identical to an unpadded step. The calls are split so that the
number of calls, like the number of rows, is public (``padding_chunks``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..data.commitment import public_rows  # torch-free (the node's site cache uses it); re-exported here
from .step_rows import public_batch_bound as public_batch_bound
from .step_rows import site_step_rows as site_step_rows
from .step_rows import step_bound as step_bound  # the bound: torch-free, read by the job rules' cost model

PAD_SEED = 0  # the padding rows' loss randomness: public, and never the private stream


def padding_chunks(real: int, bound: int, chunk: int) -> list[int]:
    """Sizes of the padding calls after ``real`` rows went through calls of ``chunk`` rows.

    Rows: real + sum = ``bound``. Calls: ceil(real / chunk) + len = ceil(bound / chunk) + 1, both public,
    unless fewer padding rows are left than calls (then one row per call) or ``real`` >= ``bound`` (no
    padding)."""
    rest = bound - real
    if rest <= 0:
        return []
    calls = max(1, min(rest, -(-bound // chunk) + 1 - (-(-real // chunk))))
    base, extra = divmod(rest, calls)
    return [base + 1] * extra + [base] * (calls - extra)


def fork_rng(model: nn.Module) -> AbstractContextManager[None]:
    """The global RNG(s) saved and restored around a block: the CPU's and, for a model on a GPU, that device's
    (``torch.manual_seed`` seeds both, so a CPU-only fork would leave the GPU's seeded from the block's
    seed)."""
    dev = next(model.parameters()).device
    return torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else [])


def pad_step(
    model: nn.Module,
    loss: object,
    images: Tensor,
    labels: Tensor,
    sizes: list[int],
    clip: float,
    chunk: int,
    batch_gradients: Callable[..., Any],
    clip_and_sum: Callable[..., Any],
) -> int:
    """Run per-example gradients and the clip (the trainer's own ``batch_gradients`` / ``clip_and_sum``,
    passed in: ``training.dpsgd`` imports this module) for the padding calls ``sizes`` (dummy rows), dropping
    the result.

    Returns the rows processed. Nothing here touches the real sum or the private generator: the padding rows
    contribute exactly zero to the released update."""
    if not sizes or images.shape[0] == 0:
        return 0
    gen = torch.Generator().manual_seed(PAD_SEED)
    done = 0
    # A real call also adds its clipped sum into the step's total, keeps its loss and counts its clipped rows:
    # a padding call does the same into dropped values, so that it costs what a real call costs (else a
    # step's time would still grow with its realised sample, i.e. with N).
    sink = {name: torch.zeros_like(p) for name, p in model.named_parameters() if p.requires_grad}
    dropped: list[Tensor] = []
    with fork_rng(model):  # a module with its own randomness (dropout) draws from the global RNG in vmap
        for m in sizes:
            idx = torch.zeros(m, dtype=torch.int64)
            for grads, value in batch_gradients(model, loss, images, labels, idx, max(chunk, m), gen):
                # as a real row's, weight 0: never added
                summed, norms = clip_and_sum(grads, clip, in_place=True)
                for name in sink:
                    sink[name] += summed[name]
                dropped.append(value.detach().cpu())
                int((norms > clip).sum())
            done += m
    return done


class ModelRangeRows:
    """The site's images as the model's float32 rows in [-1, 1], converted only when a batch is indexed.

    ``model_range`` converts the whole set once per round: a second float32 copy of the site (and, while
    ``x * 2 - 1`` runs, a third), 3.2 GB more at 100,000 images of 64x64. Here a batch ``rows[idx]`` converts
    just its rows with the same arithmetic (bit-identical). The rows converted are those a step indexes: the
    Poisson batch plus the padding rows up to the step's public bound (``pad_step`` indexes this object too),
    so the conversion's work is the padded step's, public; no pass over the N rows is left to time."""

    def __init__(self, images: np.ndarray) -> None:
        self._images = images
        self.shape = torch.Size(images.shape)
        self.device = torch.device("cpu")

    def __getitem__(self, idx: Tensor) -> Tensor:
        rows = np.ascontiguousarray(self._images[idx.cpu().numpy()], dtype=np.float32)
        return torch.from_numpy(rows) * 2.0 - 1.0


def model_range_rows(images: np.ndarray) -> Tensor:
    """``ModelRangeRows`` where the trainer takes a tensor (it only reads ``shape``, ``device`` and
    ``[idx]``)."""
    return ModelRangeRows(images)  # type: ignore[return-value]


def model_range(images: np.ndarray, n_public: int) -> Tensor:
    """The site's images in [0, 1] as the model's float32 tensor in [-1, 1], converted once per round, plus
    the same conversion of blank rows up to ``public_rows`` (dropped): a pass over all N rows costs about 0.6
    µs per 28x28 image, which over many rounds would time the exact N."""
    out = torch.from_numpy(np.asarray(images, dtype=np.float32)) * 2.0 - 1.0
    extra = public_rows(int(out.shape[0]), n_public) - int(out.shape[0])
    # always, zero rows included: a site at exactly its bucket size must not skip a call the others make (L3)
    torch.from_numpy(np.zeros((extra, *out.shape[1:]), dtype=np.float32)) * 2.0 - 1.0  # noqa: B018 - work only
    return out
