"""DP-SGD engine: Poisson sampling, per-example gradients (layer hooks or torch.func), clipping, Gaussian
noise, Adam, EMA.

Per-example gradients come from one of two engines that compute the same vectors (``select_engine``, ``[dpsgd]
per_example``): ``training.ghost_clip``'s layer hooks (one batched forward/backward over the B*K rows, then
each layer's per-example weight gradient from its input and output gradient; 1.23x a non-private step of
the cpu-eps1 model at 2 threads, 1.10x for the norm_attention subset, ``bench/bench_dpsgd.py``,
docs/evaluation.md "DP-SGD step cost"), used when every trainable parameter
sits in a layer it handles and a once-per-trainer cross-check on a public dummy batch agrees
(``ghost_clip.cross_check``), and torch.func's ``vmap(grad(...), chunk_size=...)`` (1.82x in an earlier run
at B = 64, K = 4), which accepts any ``nn.Module``. Both have no trouble with noise multiplicity: the
average over K noise draws BEFORE clipping is a mean inside the per-example loss (torch.func) or a sum over
the example's K rows inside its gradient (hooks). Opacus is not used (``ghost_clip`` says why).

The privacy argument the code keeps (unit = one image of one site; the patient-level variant follows):

* each step draws its batch by Poisson sampling with rate ``q`` from the site's ``N`` examples (variable,
  possibly empty batch) with the trainer's own ``torch.Generator``;
* each sampled example contributes ONE gradient vector, the mean of its loss over the K noise draws, clipped
  to L2 norm ``C`` over all trainable parameters together (sensitivity of the sum = C under add/remove);
* the sum gets ``N(0, (sigma*C)^2)`` noise once per logical step — also when the batch is empty — and is
  divided by the EXPECTED batch size ``q*N`` with N the PUBLIC size (``n_public``), never by the realised one;
* so one step is one subsampled-Gaussian event ``(sigma, q, 1)``; the caller charges it in ``before_step``
  before the step runs (``run``), so a step whose result exists has always been accounted.

Patient-level DP-SGD (unit = one PATIENT with all of their images; ``patient_rows`` given): each step
Poisson-samples PATIENTS with rate ``q`` (each independently, from the site's patients), takes at most
``images_per_patient`` of each sampled patient's images (a public cap; a uniform draw without replacement when
the patient has more), sums the per-image gradients of one patient and clips THAT sum to ``C``; the clipped
per-patient sums are added, noised with ``N(0, (sigma*C)^2)`` and divided by ``q * n_public`` with
``n_public`` the PUBLIC number of patients. Adding or removing one patient (however many images) adds or
removes one clipped vector of norm <= C, so the step is the same subsampled-Gaussian event ``(sigma, q, 1)``
with the patient as the unit: no group-privacy conversion. The image cap is not what bounds the sensitivity
(the per-patient clip does); it bounds a step's compute and memory (a patient with 500 slices would otherwise
cost 500 per-example gradients in one step) and keeps a many-image patient's sum from being clipped far harder
than a one-image patient's; being public, it reveals nothing. At a patient-level site these events compose
with the image-level warm-up releases into ONE per-patient figure (``accounting.patient_epsilon``: the warm-up
by group privacy over the loader's patient cap, these steps as they are), and the planner calibrates sigma so
that figure meets the site's per-patient budget.

All randomness the vectorised loss needs (noise levels, noise images, label-dropout masks) is drawn OUTSIDE
``vmap`` from the trainer's generator and passed in, so a step is reproducible from ``state_dict()``.

``PerExampleLoss`` is the interface between the engine and a model; ``models.edm.EDMLoss`` adapts an
``EDMDenoiser``.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ..allocator import keep_freed_pages
from ..config import JobConfig
from ..errors import ConfigError, DataError
from ..mechanisms._checks import check_clip
from ..mechanisms.poisson import poisson_mask
from ..models.edm import EDMLoss
from ..models.trainable import set_trainable
from .augment import rand_augment
from .ema import EMA
from .ghost_clip import BatchedLoss, batched_form, cross_check, hook_grads, unsupported
from .padding import fork_rng, pad_step, padding_chunks

__all__ = [
    "PerExampleLoss",
    "StepStats",
    "DPSGDTrainer",
    "poisson_sample",
    "clip_and_sum",
    "clipped_gradient_sum",
    "clipped_rows",
    "batch_gradients",
    "group_sum",
    "per_example_grads",
    "patient_batch",
    "PublicMix",
]


class PerExampleLoss(Protocol):
    """A loss the engine can differentiate per example.

    ``draw(n, generator)`` returns the randomness for ``n`` examples as a dict of tensors with leading dim
    ``n`` (drawn outside vmap); ``__call__(model, x, y, rand)`` gets ONE example (``x`` without batch dim,
    ``y`` a 0-d tensor, ``rand`` the example's slice) and ``model`` (a callable with the module's forward
    signature) and returns a scalar: the example's loss averaged over its K noise draws.
    """

    def draw(self, n: int, generator: torch.Generator) -> dict[str, Tensor]: ...

    def __call__(
        self, model: Callable[..., Tensor], x: Tensor, y: Tensor, rand: dict[str, Tensor]
    ) -> Tensor: ...


ENGINES = ("auto", "hooks", "vmap")


_WARNED: set[str] = set()  # cross-check fall-backs already reported in this process (warn once each)


def select_engine(model: nn.Module, loss: PerExampleLoss, engine: str = "auto", check: bool = False) -> str:
    """``"hooks"`` (``training.ghost_clip``: one batched backward) or ``"vmap"`` (torch.func) for this
    model/loss.

    ``auto`` takes the hooks when every trainable parameter sits in a module they handle
    (``ghost_clip.unsupported``) and the loss has a batched form, else torch.func (which accepts any module);
    ``hooks`` refuses rather than fall back. Never is a parameter skipped: the hooks return a gradient for
    every trainable parameter or are not used.

    ``check`` (once per engine choice: the trainer's build, a FedSGD round): the hooks must also pass
    ``ghost_clip.cross_check``, their per-example gradients against the true ones on a 2-example PUBLIC dummy
    batch (it sees what the module tree does not: a parameter used outside its module, rows that are not the
    batch's); ``auto`` then falls back to torch.func with a warning, ``hooks`` is refused. Cost on the
    cpu-eps1 denoiser, one thread: 0.04-0.07 s (K = 1), 0.08-0.12 s (K = 4), 0.1-0.3 s the first time in a
    process (measured), against ~0.9 s for one of its 60 DP-SGD steps (B ~ 250, K = 1)."""
    if engine not in ENGINES:
        raise ConfigError(f"[dpsgd] per_example must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "vmap":
        return "vmap"
    problems = unsupported(model)
    if not batched_form(loss):
        problems.append(
            f"the loss {type(loss).__name__} has no batched form with K-major rows (ghost_clip.BatchedLoss)"
        )
    failed = None
    if not problems and check:
        failed = cross_check(model, loss)
        if failed is not None:
            problems.append(f"their cross-check on a 2-example public dummy batch failed: {failed}")
    if not problems:
        return "hooks"
    if engine == "hooks":
        raise ConfigError(
            f'[dpsgd] per_example = "hooks" cannot handle this model ({"; ".join(problems)}); '
            'set per_example = "auto" or "vmap"'
        )
    if failed is not None and failed not in _WARNED:
        _WARNED.add(failed)
        warnings.warn(
            f'[dpsgd] per_example = "auto": per-example gradients by torch.func, not the layer hooks '
            f"({problems[-1]})",
            RuntimeWarning,
            stacklevel=2,
        )
    return "vmap"


@dataclass
class StepStats:
    step: int  # 1-based index of the step just taken (over the trainer's lifetime, resumes included)
    batch_size: int  # realised Poisson batch (may be 0): images, or PATIENTS in patient-level mode
    expected_batch: float  # q * N: the public divisor (N = public images, or public patients)
    loss: float  # mean per-example loss of the realised batch (nan when empty); not private, diagnostics only
    clipped_fraction: float  # fraction of examples (patients) whose gradient norm exceeded C (nan when empty)
    seconds: float


def poisson_sample(n: int, q: float, generator: torch.Generator, rows: int | None = None) -> Tensor:
    """Indices of a Poisson sample: each of ``n`` examples joins independently with probability ``q``.

    ``rows``: a PUBLIC count >= ``n`` (``training.padding.public_rows``) the draw is made over, the indices >=
    ``n`` then dropped: the same law over the real rows (independent uniforms, each below q), but the draw's
    work no longer times the exact ``n``; the drop runs over the Binomial(rows, q) drawn indices, whose law
    is public too. Each row joins with probability floor(q·2^53)/2^53 <= q (``mechanisms.poisson``: the
    float32 ``torch.rand(n) < q`` this replaced joined with probability up to 6e-8 above q)."""
    drawn = torch.nonzero(poisson_mask(max(n, rows or 0), q, generator), as_tuple=False).flatten()
    return drawn if rows is None else drawn[drawn < n]


def patient_batch(
    rows_of: Sequence[Tensor], q: float, cap: int, generator: torch.Generator, draw_rows: int | None = None
) -> tuple[Tensor, Tensor]:
    """A patient-level Poisson batch: (image indices, owner) where owner[i] in [0, B) numbers the sampled
    patient of image i. Each patient joins independently with probability ``q``; a sampled patient with more
    than ``cap`` images contributes a uniform draw of ``cap`` of them (without replacement)."""
    chosen = poisson_sample(len(rows_of), q, generator, draw_rows)  # draw_rows: public (see poisson_sample)
    rows: list[Tensor] = []
    owners: list[Tensor] = []
    for j, p in enumerate(chosen.tolist()):
        r = rows_of[p]
        if r.numel() > cap:
            r = r[torch.randperm(r.numel(), generator=generator)[:cap]]
        rows.append(r)
        owners.append(torch.full((r.numel(),), j, dtype=torch.int64))
    if not rows:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(rows), torch.cat(owners)


def group_sum(grads: dict[str, Tensor], owner: Tensor, n_groups: int) -> dict[str, Tensor]:
    """Per-group sums of per-example gradients: (B, *shape) -> (n_groups, *shape), row g = sum over owner ==
    g. A non-finite image gradient makes its group's sum non-finite, and ``clip_and_sum`` then drops the whole
    group (the patient contributes zero, never NaN)."""
    out = {}
    for n, g in grads.items():
        acc = torch.zeros((n_groups, *g.shape[1:]), dtype=g.dtype, device=g.device)
        out[n] = acc.index_add_(0, owner.to(g.device), g)
    return out


def per_example_grads(
    model: nn.Module,
    loss: PerExampleLoss,
    x: Tensor,
    y: Tensor,
    rand: dict[str, Tensor],
    chunk_size: int | None = None,
    engine: str = "auto",
    *,
    chosen: str | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Per-example gradients (dict name -> (B, *shape)) and per-example losses (B,), ``chunk_size`` examples
    at a time: by layer hooks on one batched backward, or by vmap(grad) (``select_engine``); the same vectors
    either way. ``chosen``: what ``select_engine(model, loss, engine)`` returned for this model earlier in
    the same step (``_Chooser``), not asked again."""
    if chosen is None:
        chosen = select_engine(model, loss, engine) if x.shape[0] else "vmap"
    return _grads_by(chosen, model, loss, x, y, rand, chunk_size)


class _Chooser:
    """``select_engine`` once per step, not once per chunk: its walk over the module tree
    (``ghost_clip.unsupported``) took ~1.6 ms of Python at the derived 28 px job's UNet, one step's 36 chunks
    ~4 % of the step. The tree does not change between the chunks of one step; a new step checks again."""

    def __init__(self, model: nn.Module, loss: PerExampleLoss, engine: str) -> None:
        self.model, self.loss, self.engine = model, loss, engine
        self.chosen: str | None = None

    def __call__(
        self, x: Tensor, y: Tensor, rand: dict[str, Tensor], chunk_size: int | None
    ) -> tuple[dict[str, Tensor], Tensor]:
        if self.chosen is None and x.shape[0]:
            self.chosen = select_engine(self.model, self.loss, self.engine)
        return per_example_grads(
            self.model, self.loss, x, y, rand, chunk_size, self.engine, chosen=self.chosen or "vmap"
        )


def _grads_by(
    chosen: str,
    model: nn.Module,
    loss: PerExampleLoss,
    x: Tensor,
    y: Tensor,
    rand: dict[str, Tensor],
    chunk_size: int | None,
) -> tuple[dict[str, Tensor], Tensor]:
    """``per_example_grads`` by the engine ``select_engine`` chose (``"hooks"`` or ``"vmap"``)."""
    if x.shape[0] and chosen == "hooks":
        assert isinstance(loss, BatchedLoss)
        step = x.shape[0] if not chunk_size else int(chunk_size)
        parts = [
            hook_grads(
                model, loss, x[s : s + step], y[s : s + step], {k: v[s : s + step] for k, v in rand.items()}
            )
            for s in range(0, x.shape[0], max(step, 1))
        ]
        if len(parts) == 1:
            return parts[0]
        return (
            {n: torch.cat([p[0][n] for p in parts]) for n in parts[0][0]},
            torch.cat([p[1] for p in parts]),
        )
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b for n, b in model.named_buffers()}

    def one(p: dict[str, Tensor], xi: Tensor, yi: Tensor, ri: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        def call(*args: Tensor) -> Tensor:
            return functional_call(model, (p, buffers), args)

        value = loss(call, xi, yi, ri)
        return value, value.detach()

    # randomness="different" only matters for modules with their own RNG (dropout); the loss's own noise is
    # passed in explicitly so steps stay reproducible from the generator.
    fn = vmap(grad(one, has_aux=True), in_dims=(None, 0, 0, 0), chunk_size=chunk_size, randomness="different")
    grads, losses = fn(params, x, y, rand)
    return grads, losses


def _clip_factors(norms: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """(finite, factor): which examples' norms are finite, and each one's clip factor min(1, C / norm), 0
    where the norm is not finite (NaN/inf in an entry, or an overflowing norm: such an example contributes
    nothing)."""
    finite = torch.isfinite(norms)
    return finite, torch.where(finite, (clip / (norms + 1e-12)).clamp(max=1.0), torch.zeros_like(norms))


def clip_and_sum(
    grads: dict[str, Tensor], clip: float, *, in_place: bool = False
) -> tuple[dict[str, Tensor], Tensor]:
    """Clip each example's gradient (L2 over ALL parameters together) to ``clip`` and sum over examples.

    Returns the summed clipped gradient and the per-example norms before clipping (``inf`` for an example
    whose gradient is not finite).

    An example whose gradient has a NaN or an infinite entry (or whose norm overflows) contributes ZERO: with
    crafted weights a coordinator can make the loss overflow for one chosen image only, and ``0 * inf = nan``
    would then turn the whole released update into NaN exactly when that image was sampled (a membership
    channel). Zero has norm <= C, so the sensitivity of the sum stays C under add/remove. How many examples
    were dropped is a function of the private batch: it is never released.

    ``in_place``: the caller hands ``grads`` over (fresh per-example gradients it never reads again): their
    non-finite entries are set to 0 in place, instead of the rows being selected into a copy. Either way the
    same operations run whatever the batch (no data-dependent branch), and a non-finite row's factor is 0.
    Measured at the cpu-eps1 model, 32 examples, 2 threads: 3.0 vs 4.9 ms a chunk (with the norms by
    ``vector_norm`` rather than ``pow(2).sum``: 6.1 ms before), the DP-SGD step's largest cost outside the
    backward.
    """
    clip = check_clip(clip, "DP-SGD clip_and_sum")  # a subnormal clip rounds up to ~2x itself
    flat = [g.reshape(g.shape[0], -1) for g in grads.values()]
    norms = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(f, dim=1) for f in flat]), dim=0)
    finite, factor = _clip_factors(norms, clip)
    summed = {}
    for (n, g), f in zip(grads.items(), flat, strict=True):
        # finite rows are left as they are; a non-finite row has factor 0, and its entries must be finite for
        # 0 * x to be 0 (a scalar where and mv instead of a zeros_like buffer and an einsum: measured faster)
        f = (
            torch.nan_to_num_(f, nan=0.0, posinf=0.0, neginf=0.0)
            if in_place
            else torch.where(finite[:, None], f, 0.0)
        )
        summed[n] = torch.mv(f.t(), factor).reshape(g.shape[1:])
    return summed, torch.where(finite, norms, torch.full_like(norms, math.inf))


def batch_gradients(
    model: nn.Module,
    loss: PerExampleLoss,
    images: Tensor,
    labels: Tensor,
    idx: Tensor,
    chunk: int,
    generator: torch.Generator,
    engine: str = "auto",
) -> Iterator[tuple[dict[str, Tensor], Tensor]]:
    """Per-example gradients and losses of the examples ``idx``, one physical chunk at a time (virtual
    batches: the logical Poisson batch is processed in chunks so memory is bounded by chunk x parameters
    whatever its size). The loss randomness is drawn from ``generator`` chunk by chunk, in order (on the CPU:
    the same stream on any device), so a step is reproducible from the generator's state. The model is in
    train mode while it runs."""
    dev = next(model.parameters()).device
    was_training = model.training
    keep_freed_pages()  # each chunk's per-example gradients reuse the last chunk's pages (allocator)
    model.train()
    grads_of = _Chooser(model, loss, engine)
    try:
        for start in range(0, idx.numel(), chunk):
            part = idx[start : start + chunk]
            rand = {k: v.to(dev) for k, v in loss.draw(part.numel(), generator).items()}
            xs, ys = images[part.to(images.device)].to(dev), labels[part.to(labels.device)].to(dev)
            yield grads_of(xs, ys, rand, chunk)
    finally:
        model.train(was_training)


def clipped_gradient_sum(
    model: nn.Module,
    loss: PerExampleLoss,
    images: Tensor,
    labels: Tensor,
    idx: Tensor,
    clip: float,
    chunk: int,
    generator: torch.Generator,
    engine: str = "auto",
) -> tuple[dict[str, Tensor], list[Tensor], int]:
    """The sum over the batch ``idx`` of the per-example gradients clipped to ``clip`` (sensitivity ``clip``
    under add/remove of one example), no noise: (sum by parameter name, per-chunk losses, how many were
    clipped). The one computation of a DP-SGD step's signal, for the local trainer and the federated (FedSGD)
    sites. Losses and the clipped count are functions of the private batch: diagnostics that never leave a
    site."""
    total = {name: torch.zeros_like(p) for name, p in model.named_parameters() if p.requires_grad}
    losses: list[Tensor] = []
    n_clipped = 0
    for grads, value in batch_gradients(model, loss, images, labels, idx, chunk, generator, engine):
        summed, norms = clip_and_sum(grads, clip, in_place=True)  # fresh per chunk, never read again
        for name in total:
            total[name] += summed[name]
        losses.append(value.detach().cpu())
        n_clipped += int((norms > clip).sum())
    return total, losses, n_clipped


def clipped_rows(grads: dict[str, Tensor], names: list[str], clip: float) -> Tensor:
    """Each example's gradient clipped to L2 norm ``clip`` (over all parameters together) as one flat row (B,
    D), the parameters in ``names`` order; an example with a non-finite gradient is a zero row (as in
    :func:`clip_and_sum`: its contribution never turns the release into NaN). For mechanisms that need the
    records one by one (per-record conditional rounding of the Skellam mechanism)."""
    flat = torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in names], dim=1)
    finite, factor = _clip_factors(flat.pow(2).sum(1).sqrt(), clip)
    return torch.where(finite[:, None], flat, torch.zeros_like(flat)) * factor[:, None]


def _patient_cap(n_public: int | None, cap: int | None, default_cap: int) -> int:
    """The per-step image cap of patient-level DP-SGD, checked (and that the public patient count is
    given)."""
    if n_public is None:
        raise ConfigError(
            "patient-level DP-SGD needs the PUBLIC number of patients (n_public): dividing by the exact "
            "count would scale the released noise by a private number"
        )
    cap = default_cap if cap is None else cap
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ConfigError(f"patient-level DP-SGD: images per patient must be an integer >= 1, got {cap!r}")
    return cap


def _patient_chunks(rows: Tensor, owner: Tensor, size: int) -> list[tuple[Tensor, Tensor, int, bool]]:
    """Split a patient batch into physical chunks of exactly ``size`` images (the last one: the rest), as the
    image-level step does, so that the number and sizes of the real calls are ceil(rows / size) and ``size``:
    a function of the row count alone, never of how the sampled patients' images fall into chunks (
    packing WHOLE patients took more calls the more their image counts wasted each chunk, a private layout
    seen in latency). A patient may now straddle chunks; the per-patient clip stays exact because a straddling
    patient's partial sum is carried into the next chunk (``_carry_patients``) and clipped only once complete.

    Each entry: (rows, owner renumbered 0..k-1 within the chunk, k, whether owner k-1 continues into the next
    chunk)."""
    out: list[tuple[Tensor, Tensor, int, bool]] = []
    n = int(rows.numel())
    for start in range(0, n, size):
        end = min(start + size, n)
        own = owner[start:end] - owner[start]
        continues = end < n and bool(owner[end] == owner[end - 1])
        out.append((rows[start:end], own, int(own.max()) + 1, continues))
    return out


def _carry_patients(
    sums: dict[str, Tensor], carry: dict[str, Tensor] | None, last: int, continues: bool
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Complete per-patient sums of one chunk (rows 0..``last`` hold its patients): the previous chunk's carry
    added to row 0, and row ``last`` held back as the new carry (zeroed in the sums) when that patient goes on
    in the next chunk (``continues``). Returns (the sums to clip now, the carry).

    The same operations run whatever the layout (a branch per straddling patient made the work per
    step count the sampled patients' private image counts): the carry is ALWAYS added (zeros when the previous
    chunk's last patient ended there, or for the first chunk) and row ``last`` ALWAYS selected into the carry
    or left in place. Adding +0.0 is exact, so the sums are bit-identical to the branching form."""
    goes_on = torch.tensor(bool(continues))
    held = {}
    for name, g in sums.items():
        g[0] += carry[name] if carry is not None else torch.zeros_like(g[0])
        # selects, not products: a non-finite partial sum (dropped whole at its own clip) must never reach the
        # NEXT patient's row as 0 * inf = NaN, which would drop that other patient too (sensitivity 2C)
        held[name] = torch.where(goes_on, g[last], 0.0)
        g[last] = torch.where(goes_on, 0.0, g[last])
    return sums, held


@dataclass
class PublicMix:
    """Already-released examples added to every DP-SGD step (``[dpsgd] public_batch``), free in epsilon.

    Why no privacy cost: ``draw(n, generator)`` returns ``n`` examples (images in [-1, 1], labels) built ONLY
    from values the site has already released and paid for (the central images, RandAugment-ed with
    ``generator``, a PUBLIC generator). Their clipped gradients are computed at the current weights
    (themselves a function of the earlier noisy steps) and added to the noisy sum, the divisor growing by
    ``batch`` (public). So a step's output is a function of (noisy private sum, released data, earlier
    outputs): post-processing of the same subsampled-Gaussian event (sigma, q, 1), whose sensitivity stays C.
    Clipped like private examples so that one public example weighs what a private one does.
    """

    draw: Callable[[int, torch.Generator], tuple[Tensor, Tensor]]
    batch: int
    generator: torch.Generator


def released_mix(
    cfg: JobConfig, central: tuple[Any, Any] | None, generator: torch.Generator
) -> PublicMix | None:
    """``[dpsgd] public_batch`` RandAugment-ed copies of the RELEASED, post-processed central images (images
    in [0, 1], labels) per step, drawn with the PUBLIC ``generator`` (None when ``public_batch`` is 0):
    ``train``'s stage and a site's DP-SGD round (which gets them from the coordinator with the round) build it
    here."""
    n, w = cfg.dpsgd.public_batch, cfg.warmup
    if n == 0:
        return None
    if central is None or len(central[1]) == 0:
        raise ConfigError(
            "[dpsgd] public_batch > 0 needs released central images ([central] rounds > 0 and a method "
            "with a central release); set public_batch = 0"
        )
    src = torch.from_numpy(np.asarray(central[0], np.float32))
    lab = torch.from_numpy(np.asarray(central[1], np.int64))

    def draw(m: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(lab), (m,), generator=g)
        aug, _ = rand_augment(src[idx], n_ops=w.augment_ops, magnitude_max=w.augment_magnitude, generator=g)
        return aug * 2 - 1, lab[idx]  # [0, 1] -> the model's [-1, 1]

    return PublicMix(draw, n, generator)


def seed_dropout(model: nn.Module, generator: torch.Generator) -> None:
    """Seed torch's GLOBAL generator (the caller forks it: ``padding.fork_rng``) from the private
    ``generator`` when ``model`` has active dropout. ``nn.Dropout`` draws its masks there, which is
    public-seeded in the local pipeline, fixed in a fresh per-message process and carried across requests in
    the warm worker; masks from it were predictable and assigned by position in the batch, so one image more
    shifted every later image's mask. Now they are a fresh secret draw per step (DP-SGD) or round (FedSGD),
    independent of the data: coupled on the shared examples, each one still moves the sum by <= C. A model
    without dropout draws nothing (its noise stream is unchanged)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))


class DPSGDTrainer:
    """DP-SGD on one site's data. Reused unchanged by the federation for local rounds.

    ``model``: the module to train (e.g. an ``EDMDenoiser``); ``loss``: a ``PerExampleLoss`` (default:
    ``EDMLoss`` built from ``image_shape``/``n_classes`` and the config). ``noise_multiplier`` and
    ``sample_rate`` come from the plan (whole-history calibration), never from here. ``generator`` drives
    sampling and all noise.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: JobConfig,
        noise_multiplier: float,
        sample_rate: float,
        generator: torch.Generator,
        *,
        loss: PerExampleLoss | None = None,
        image_shape: tuple[int, int, int] | None = None,
        n_classes: int | None = None,
        n_public: int | None = None,
        patient_rows: Sequence[Tensor] | None = None,
        images_per_patient: int | None = None,
        public: PublicMix | None = None,
        pad_to: int | None = None,
        draw_rows: int | None = None,
    ) -> None:
        """``patient_rows``: each patient's image indices, grouped ONCE when the site's data was opened
        (``privacy_unit.PatientIndex.rows`` / ``group_patient_rows``; never regrouped per trainer, i.e. per
        request) for patient-level DP-SGD; then ``n_public`` is the PUBLIC number of patients (required) and
        ``images_per_patient`` the public cap on a sampled patient's images per step (default: the physical
        batch). ``pad_to``: a PUBLIC row (image) count each step processes whatever its sample
        (``training.padding``: the step's time does not count it). ``draw_rows``: a PUBLIC count of rows
        (images, or patients) the Poisson draw is made over (``poisson_sample``)."""
        if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
            raise ConfigError(f"DP-SGD noise multiplier must be a finite number > 0, got {noise_multiplier}")
        if not 0 < sample_rate <= 1:
            raise DataError(
                f"DP-SGD sampling rate q = batch / N = {sample_rate:.4g} is outside (0, 1]: the dataset has "
                f"fewer examples than [dpsgd] batch; lower [dpsgd] batch or use more data"
            )
        d = cfg.dpsgd
        self.model = model
        self.cfg = cfg
        self.sigma = float(noise_multiplier)
        self.q = float(sample_rate)
        self.clip = float(d.clip)
        self.chunk = int(d.physical_batch)
        self.generator = generator
        # The divisor q * n_public must be PUBLIC: dividing by q * (exact count) would scale the released
        # noise by the private N. None keeps the old behaviour (q times the rows given) for callers that own
        # the data.
        if n_public is not None and (isinstance(n_public, bool) or int(n_public) < 1):
            raise ConfigError(f"DP-SGD public dataset size must be an integer >= 1, got {n_public!r}")
        self.n_public = None if n_public is None else int(n_public)
        self.rows_of: Sequence[Tensor] | None = None
        if patient_rows is not None:
            self.patient_cap = _patient_cap(n_public, images_per_patient, int(d.physical_batch))
            self.rows_of = patient_rows
            self.patient_images = sum(int(r.numel()) for r in patient_rows)  # once, not per step
        if loss is None:
            # an EDMDenoiser knows its own image shape and class count
            image_shape = image_shape if image_shape is not None else getattr(model, "image_shape", None)
            n_classes = n_classes if n_classes is not None else getattr(model, "n_classes", None)
            if image_shape is None or n_classes is None:
                raise ConfigError(
                    "DPSGDTrainer needs image_shape and n_classes (or a model that has them) to "
                    "build the default EDM loss"
                )
            loss = EDMLoss(
                image_shape,
                n_classes,
                d.noise_multiplicity,
                cfg.model.label_dropout,
                sigma_data=getattr(model, "sigma_data", None),
            )
        self.loss = loss
        # which per-example-gradient engine (hooks or torch.func) every call of this trainer uses, the
        # padding's included (a padding row must cost what a real one does); resolved once, the hooks
        # cross-checked against torch.func on a public dummy batch (select_engine), refused here if impossible
        self.public = public if public is not None and public.batch > 0 else None
        self.pad_to = None if pad_to is None else int(pad_to)
        self.draw_rows = None if draw_rows is None else int(draw_rows)
        # [dpsgd] trainable: frozen parameters get no per-example gradient, no clip share and no noise (their
        # values are public: models.trainable); the noise dimension is the trainable count
        self.noise_dimension = set_trainable(model, d.trainable, d.lora_rank)
        self.engine = select_engine(model, loss, d.per_example, check=True)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=d.lr)
        # A fresh EMA: the caller copies the warm-up EMA weights into ``model`` before DP-SGD starts (method
        # §2), and the EMA's own warm-up keeps a short CPU-scale run from being dominated by the starting
        # weights.
        self.ema = EMA(model, d.ema)
        self.steps_done = 0

    # -- one logical step ---------------------------------------------------------------------
    def noisy_gradient(self, images: Tensor, labels: Tensor) -> tuple[dict[str, Tensor], StepStats]:
        """Poisson-sample from (images, labels) and return the privatised mean gradient (no optimizer
        step)."""
        if self.rows_of is not None:
            return self._noisy_patient_gradient(images, labels)
        t0 = time.perf_counter()
        n = images.shape[0]
        dev = self.params[0].device
        expected = self.q * (n if self.n_public is None else self.n_public)
        idx = poisson_sample(n, self.q, self.generator, self.draw_rows)
        names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        total, losses, n_clipped = clipped_gradient_sum(
            self.model, self.loss, images, labels, idx, self.clip, self.chunk, self.generator, self.engine
        )
        if self.pad_to is not None:  # dummy rows up to the public count, dropped: the update is unchanged
            pad_step(
                self.model,
                self.loss,
                images,
                labels,
                padding_chunks(int(idx.numel()), self.pad_to, self.chunk),
                self.clip,
                self.chunk,
                partial(batch_gradients, engine=self.engine),
                clip_and_sum,
            )
        return self._noised(total, names, dev, expected), self._stats(
            int(idx.numel()), expected, losses, n_clipped, t0
        )

    def _noisy_patient_gradient(self, images: Tensor, labels: Tensor) -> tuple[dict[str, Tensor], StepStats]:
        """Patient-level step (see the module docstring): sampled patients' clipped per-patient sums,
        noised."""
        t0 = time.perf_counter()
        assert self.rows_of is not None and self.n_public is not None
        if self.patient_images != images.shape[0]:
            raise DataError(
                f"patient-level DP-SGD: the patient index covers {self.patient_images} "
                f"images but {images.shape[0]} were given"
            )
        dev = self.params[0].device
        expected = self.q * self.n_public  # public patients: the exact count never scales the released noise
        rows, owner = patient_batch(self.rows_of, self.q, self.patient_cap, self.generator, self.draw_rows)
        names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        total = {name: torch.zeros_like(p) for name, p in zip(names, self.params)}
        losses: list[Tensor] = []
        n_clipped = 0
        was_training = self.model.training
        self.model.train()
        carry: dict[str, Tensor] | None = None  # the partial sum of a patient that straddles two chunks
        grads_of = _Chooser(self.model, self.loss, self.engine)
        for part, own, k, continues in _patient_chunks(rows, owner, self.chunk):
            rand = {key: v.to(dev) for key, v in self.loss.draw(part.numel(), self.generator).items()}
            xs, ys = images[part.to(images.device)].to(dev), labels[part.to(labels.device)].to(dev)
            grads, loss = grads_of(xs, ys, rand, self.chunk)
            # one group row per image of the call (the unused ones zero): the clip's rows, like the
            # image-level step's, total the public bound whatever the number of sampled patients
            sums, carry = _carry_patients(group_sum(grads, own, int(part.numel())), carry, k - 1, continues)
            # clip each COMPLETE patient's sum to C; in place, as the padding calls do (the carry is a
            # separate tensor)
            summed, norms = clip_and_sum(sums, self.clip, in_place=True)
            for name in total:
                total[name] += summed[name]
            losses.append(loss.detach().cpu())
            n_clipped += int((norms > self.clip).sum())
        if self.pad_to is not None:  # dummy images up to the public count, dropped: the update is unchanged
            # in calls of the same ``chunk`` as the real ones: calls = ceil(bound / chunk) + 1, rows = bound
            # (public)
            pad_step(
                self.model,
                self.loss,
                images,
                labels,
                padding_chunks(int(rows.numel()), self.pad_to, self.chunk),
                self.clip,
                self.chunk,
                partial(batch_gradients, engine=self.engine),
                clip_and_sum,
            )
        self.model.train(was_training)
        b = int(owner.max()) + 1 if owner.numel() else 0
        return self._noised(total, names, dev, expected), self._stats(b, expected, losses, n_clipped, t0)

    def _noised(
        self, total: dict[str, Tensor], names: list[str], dev: torch.device, expected: float
    ) -> dict[str, Tensor]:
        """Add N(0, (sigma C)^2) to the clipped sum, then the public mix, and divide by the public divisor
        (one tail for the image- and patient-level steps: the same noise draws in the same order)."""
        std = self.sigma * self.clip
        for name, p in zip(names, self.params):
            noise = (torch.randn(p.shape, generator=self.generator, dtype=p.dtype) * std).to(dev)
            total[name] = total[name] + noise
        was_training = self.model.training
        self.model.train()
        divisor = expected + self._add_public(total, dev)  # after the noise: post-processing (PublicMix)
        self.model.train(was_training)
        return {name: g / divisor for name, g in total.items()}

    def _stats(self, b: int, expected: float, losses: list[Tensor], n_clipped: int, t0: float) -> StepStats:
        return StepStats(
            step=self.steps_done + 1,
            batch_size=b,
            expected_batch=expected,
            # an empty batch's stand-in keeps the same ops: a zero-row step is not cheaper (L3)
            loss=float(torch.cat(losses or [torch.full((1,), math.nan)]).mean()),
            clipped_fraction=n_clipped / b if b else float("nan"),
            seconds=time.perf_counter() - t0,
        )

    def _add_public(self, total: dict[str, Tensor], dev: torch.device) -> int:
        """Add the clipped gradients of ``public.batch`` released examples to ``total``; returns how many
        (public). All randomness comes from the public generator: the private stream is the same with or
        without it."""
        if self.public is None:
            return 0
        pub = self.public
        grads_of = _Chooser(self.model, self.loss, self.engine)
        for start in range(0, pub.batch, self.chunk):
            m = min(self.chunk, pub.batch - start)
            xs, ys = pub.draw(m, pub.generator)
            rand = {k: v.to(dev) for k, v in self.loss.draw(m, pub.generator).items()}
            grads, _ = grads_of(xs.to(dev), ys.to(dev), rand, self.chunk)
            summed, _ = clip_and_sum(grads, self.clip, in_place=True)
            for name in total:
                total[name] += summed[name]
        return pub.batch

    def step(self, images: Tensor, labels: Tensor) -> StepStats:
        """One DP-SGD step on the site's whole training set (``images`` in [-1, 1], ``labels`` int64).

        The caller must have charged one ``(sigma, q, 1)`` event before calling this (``run`` does it via
        ``before_step``).
        """
        with fork_rng(self.model):  # CPU and, on a GPU, its generator: both restored after the private seed
            seed_dropout(self.model, self.generator)  # masks from the private stream
            noisy, stats = self.noisy_gradient(images, labels)
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                p.grad = noisy[name]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.update(self.model)
        self.steps_done += 1
        return stats

    def run(
        self,
        images: Tensor,
        labels: Tensor,
        n_steps: int,
        before_step: Callable[[int], None] | None = None,
        after_step: Callable[[StepStats], None] | None = None,
    ) -> list[StepStats]:
        """``n_steps`` steps. ``before_step(i)`` (i = lifetime step index, 1-based) runs BEFORE step i and is
        where the caller charges (and persists) its privacy ledger; if it raises (e.g. budget exhausted), step
        i is not taken. ``after_step(stats)`` is for progress bars and checkpoints."""
        out = []
        for _ in range(n_steps):
            if before_step is not None:
                before_step(self.steps_done + 1)
            stats = self.step(images, labels)
            out.append(stats)
            if after_step is not None:
                after_step(stats)
        return out

    def ema_model(self) -> nn.Module:
        """A copy of the model holding the EMA weights (what is sampled from and released)."""
        m = copy.deepcopy(self.model)
        self.ema.copy_to(m)
        return m.eval()

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "steps_done": self.steps_done,
            "sigma": self.sigma,
            "q": self.q,
            **({"public_generator": self.public.generator.get_state()} if self.public is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if abs(state["sigma"] - self.sigma) > 1e-12 or abs(state["q"] - self.q) > 1e-12:
            raise ConfigError(
                f"checkpoint was written with sigma={state['sigma']}, q={state['q']} but this trainer has "
                f"sigma={self.sigma}, q={self.q}: it belongs to a different plan"
            )
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.steps_done = int(state["steps_done"])
        if self.public is not None and "public_generator" in state:
            self.public.generator.set_state(state["public_generator"])
