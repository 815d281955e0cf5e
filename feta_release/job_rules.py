"""A job derived from the PUBLIC facts of a dataset: the rules that turn (size, image shape, classes, epsilon,
delta, device, time budget) into a ``JobConfig``, so a site need not pick a preset tuned for someone else's
data.

The facts are public: ``size`` is the declared size (``--public-size``, a signed policy's ``dataset.size``,
the sum of a federation's declarations) or the one drawn from a noisy count, never an exact private count.
Every rule below is a function of these facts alone, so the derived job is public too (it is signed, shipped
and hashed).

Where the rules come from. The presets that reach the best measured figures on 4,000 28x28 digits
(``cpu-eps1-nodpsgd``, ``cpu-eps10-nodpsgd``; docs/evaluation.md) spend the whole budget on the two warm-up
releases: one central pass over all images (q = 1, ~80 % of epsilon alone), the frequency statistic filling
the rest, no DP-SGD, the small 16-channel UNet, the polish and SDEdit sampling. The rules generalise that
recipe by the public facts, and drop what was digit knowledge:

- central: ``rate = 1`` (one pass, the least noise per epsilon); query side near 15 px by a power-of-two
  downsample (14 at 28 px, 16 at 64 and 128 px, as ``xray64-eps10``), doubled while the noise stays far below
  the signal; ``clip = sqrt(values) / 7`` (2 at 14x14 grey, tuned on digits: a brighter or larger image is
  scaled down, which the per-image contrast stretch undoes); cells by the GENERIC public rule ``aux`` (each
  class split by its nearest public prototype, k-means centres of aux-generator images: post-processing of the
  frequency release) as many (1, 2 or 4) as keep each cell's noise under :data:`CELL_NOISE`; federated jobs
  one cell (``aux`` is single-site only, ``slant`` is a prior on handwriting).
- frequency: sigma fills the budget the central release leaves; as many random features (32 .. 2,048) as keep
  the planner's frequency figure under :data:`FEATURE_NOISE`; at the cap the patch map of the eps = 10 preset
  (7x7 patches at stride 3 on 28 px, scaled with the image); switched off when even 32 features would be
  mostly noise (its budget then goes to the central release).
- model: 16 channels on every device, one UNet level more per doubling of the side above 28 px.
- DP-SGD: on only where its noise-to-signal over the job (:func:`dpsgd_noise`: sigma sqrt(P) / (B
  sqrt(T)), the noise of T averaged clipped-gradient steps against the clip, P the parameters DP-SGD trains:
  :func:`job_dpsgd_dimension`) is at most
  :data:`DPSGD_MAX_NOISE`, a fifth of the figure at the one point where a DP-SGD stage was measured to tie
  (4,000 digits, eps = 10); its steps from the time budget by the cost model below. Its physical batch
  (rows per per-example-gradient call): on the CPU ``_physical`` (memory: rows x values); on a GPU the fewest
  calls that cover a step's padded rows, split evenly, within the site policies' ``resources`` caps and a GPU
  memory bound (``_physical_batch``).
- public pretraining (``train --public``; docs/explanation/public-pretraining.md), from the public set's facts
  (:class:`PublicFacts`: size, shape, class names): about :data:`PRETRAIN_EPOCHS` passes over it, within
  [:data:`PRETRAIN_MIN`, :data:`PRETRAIN_MAX`] steps and at most :data:`PRETRAIN_SHARE` of the time budget;
  class-conditional when its classes name private classes (equal names, ``stages.pretrain.mapped_labels``),
  else unconditional (the null label); DP-SGD, where it runs, then trains only the normalisation, attention
  and conditioning parameters (``trainable = "norm_attention"``): the convolutions keep what the public set
  taught. Where the public classes name EVERY private class (:func:`every_class_public`) the pretrained
  denoiser is kept away from the released central images (:func:`keep_pretrained`: no spatial warm-up, no
  polish, no central images in the frequency warm-up, their time given to pretraining); the central release
  is unchanged and still seeds the sampler's starts and the cells.

FLOOR (:func:`derive` refuses below it, naming the figure): a job is refused only when even the strongest
release any job can make here (the central images, whole budget, one pass, one image per class) would be
mostly noise by the planner's own figure (``planning.stage_noise`` above ``planning.MOSTLY_NOISE``, the line
of its warning). Above the floor every derived job plans with no "mostly noise" warning.

COST MODEL (:func:`estimate`): one term for every stage the command runs, named as its progress events name it
(``progress_events``). Seconds = ``SECONDS_PER_PIXEL_PASS`` x image values x width factor x (warm-up image
passes + ``DPSGD_OVERHEAD`` x DP-SGD image passes) + the aux-generator fit (:func:`aux_step_seconds` a step:
batch x image PIXELS x its width's cost) + the releases + the aux-generator draws
(``AUX_DRAW_SECONDS_PER_PIXEL``) and k-means of the cell prototypes + the sampler
(``SAMPLING_SECONDS_PER_PIXEL`` per denoiser call, image pixel and width factor: the stage grids, the sample
grid samples.png and the synthetic set) + the ONNX export, the signing and the privacy report. The privacy
report, the sample grid, the synthetic set and the release (``progress_events.FINISHING``) are left out of
the time budget, which bounds the training. A DP-SGD step passes its PADDED rows (:func:`dpsgd_step_rows`:
the public bound every step is padded to, from the node's own ``training.step_rows.site_step_rows``), not
q·N; a federated step the slowest site's (each pads over its own declared size, in parallel), in whole rounds
of :data:`LOCAL_STEPS` steps.
``SECONDS_PER_PIXEL_PASS`` = 1.7e-6 was measured on this project's 2-core CPU, 2 threads, idle machine
(``bench/bench_dpsgd.py --batch 64 --k 1 --physical 32 --rounds 3 --steps 1 --threads 2 --methods
nonprivate,hooks``: non-private 0.085 s per 64-image step at 28 px = 1.69e-6 s per image
value; at 64 px, B = 32, 0.214 s = 1.63e-6; the hooks step 1.35x / 1.15x of it). It predicts 8.0 min for
``cpu-eps10-nodpsgd`` (measured: 8 min 8 s alone on 2 threads). The CPU rates are 2-thread rates: a job run
on fewer threads (``DataFacts.threads``: ``train --threads``, else torch's default) is timed at
:func:`thread_factor` times them (1.80 on 1 thread), so its budget buys fewer steps; more than 2 are not
credited. On a GPU it is divided by ``CUDA_SPEEDUP``
(20: the whole eps = 10 job took 47 s on one H100 against ~15 min on the 2-core CPU; not measured for other
jobs), except a DP-SGD step: on a GPU it is :data:`CUDA_CALL_SECONDS` per call of ``physical_batch`` rows plus
:data:`CUDA_DPSGD_SECONDS_PER_VALUE` per padded row, image value and width (one H100, 64 px, 16 channels: 0.26
s a step of ~800 rows at physical batch 256).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .accounting import MAX_NOISE_MULTIPLIER, PrivacyEvent, epsilon, smallest_fitting_sigma, unit_epsilon
from .config import JobConfig
from .data.dataset import check_site_memory
from .errors import ConfigError, DataError, FetaError, PrivacyError
from .mechanisms.count import size_event
from .planning import MOSTLY_NOISE, stage_sampling_rate
from .progress_events import (
    AUX_FIT,
    AUX_IMAGES,
    CENTRAL,
    DPSGD,
    EXPORT,
    FINISHING,
    FREQUENCY,
    FREQUENCY_WARMUP,
    GRIDS,
    POLISH,
    PRETRAINING,
    PROTOTYPES,
    REPORT,
    SAMPLE_GRID,
    SAMPLING,
    SIGNING,
    SPATIAL,
)
from .training.step_rows import site_step_rows

__all__ = [
    "DataFacts",
    "Derivation",
    "REFERENCE_THREADS",
    "PatientFacts",
    "policy_patient_facts",
    "with_physical_caps",
    "Estimate",
    "check_facts",
    "default_delta",
    "derivation_toml",
    "derive",
    "derive_job",
    "estimate",
    "job_toml",
]

# -- the rules' constants (each one's origin beside it)
# ------------------------------------------------------------
CENTRAL_SHARE = 0.8  # central alone: 0.795 of eps = 1 and 0.782 of eps = 10 in the tuned presets
# when DP-SGD runs: the eps = 10 trial with DP-SGD gave the central release about half
CENTRAL_SHARE_DPSGD = 0.5
FILL = 0.995  # the releases' target when DP-SGD is off (the eps = 1 preset reached 0.994)
FILL_DPSGD = 0.75  # the releases' target when DP-SGD runs; DP-SGD is calibrated for the rest
# a cell's central noise figure at most this: 4 cells at eps 1 and at eps 10 on 4,000 digits. At eps 1
# (validation, 3 seeds, fresh noise draws, docs/derived-job.md) 1 cell scored 0.582 +- 0.063, 2 cells
# (figure 0.065) 0.715 +- 0.101 and 4 cells (0.129) 0.750 +- 0.026: more distinct starts per class
# outweigh the noisier cells, even where some cells carry mostly noise
CELL_NOISE = 0.14
RES_NOISE = 0.02  # the query side doubles while the central figure stays under this (no preset needed it)
MAX_CELLS = 4  # 4 tuned at eps = 10 (6 gave +0.007, inside the noise); 8 at eps = 1 lost 0.03
FEATURE_NOISE = 0.25  # the frequency figure at most this: 200 features at eps 1, the 2,048 cap at eps 10
FEATURE_LADDER = (2048, 1024, 512, 200, 100, 64, 32)
CLIP_PER_ROOT_VALUE = 1 / 7  # clip 2 at 14x14 grey (tuned on digits: 2 beat 3)
PIXEL_BANDWIDTH2 = 105.0 / 784  # [frequency] bandwidth2 per image value of the pixel map (105 at 28x28 grey)
STRONG_EPSILON = 5.0  # from here the eps = 10 preset's aux fit and sampler, below it the eps = 1 preset's
# DP-SGD's noise-to-signal over the job (dpsgd_noise) where a DP-SGD stage was measured to tie the releases
# alone: the rules' DP-SGD on 4,000 digits at eps = 10 (eps x N = 40,000; docs/evaluation.md, "a DP-SGD stage
# at eps = 10": +-0.01): sigma 2.09, 160k parameters, B = 1,000, T = 80 steps. At eps = 1 (figure 0.64) DP-SGD
# lowered accuracy. tests/accounting/test_dpsgd_rule.py recomputes it from the rules.
DPSGD_TIE_NOISE = 0.0936
DPSGD_MARGIN = 5.0  # the former rule's margin over the tie (eps x N >= 200,000 = 5 x 40,000): NOT measured
DPSGD_MAX_NOISE = DPSGD_TIE_NOISE / DPSGD_MARGIN
DPSGD_MIN_STEPS = 20  # fewer steps than this are not worth the budget they take from the releases
LOCAL_STEPS = 5  # a derived federated job's DP-SGD steps per site per round (its steps: whole rounds)
DELTA_PRESETS = 1e-5  # every preset's delta (N ~ 4,000)
# cost model (see the module docstring)
SECONDS_PER_PIXEL_PASS = 1.7e-6
# the CPU rates below were measured on 2 threads of this project's 2-core CPU; a run on ``threads`` torch
# threads (``train --threads``, else torch's default) takes (REFERENCE_THREADS / min(threads,
# REFERENCE_THREADS)) ** THREAD_EXPONENT times as long (thread_factor). Measured on the derived 28 px job's
# step (bench/bench_dpsgd.py's steps, --derived 4000 --size 28 --classes 10 --epsilon 1 --physical 64): on 1
# thread 5.28 s of CPU a non-private step and 6.47 s a private one (median of 4 rounds, nice 5; CPU seconds
# because the shared cores' load made wall times 1.3-2x longer), against 2.914 / 3.486 s of wall on 2 threads
# on the quiet machine: 1.81x / 1.86x, exponent 0.86 / 0.89; 0.85 taken (1.80x). Not measured for the aux
# fit (its 1-thread step, 0.265 s, is 1.33x the 2-thread epoch's 0.2 s a step; those two were not measured
# together) nor the sampler. More threads than 2 are not credited: never measured here, so a machine with
# more cores gets the 2-thread job (its estimate an upper bound).
REFERENCE_THREADS = 2
THREAD_EXPONENT = 0.85
DPSGD_OVERHEAD = 1.35  # per-example-gradient step / non-private step (bench/bench_dpsgd.py, 28 px)
# the torch sampler (the synthetic set, the grids): seconds per denoiser call, image PIXEL (height x width:
# the UNet's cost does not follow the input channels) and width factor, on 2 threads at its batch of 256. From
# the whole 64x64x1 derived job on 2 idle cores: 4,100 images (Heun 8: 15 calls each) in ~525 s = 1.67e-6; at
# 28 px it is ~1.1e-6 (1-thread CPU seconds, bench/release_cost.py and docs/derived-job.md: a 64 px batch
# spends ~60 % of its CPU time in minor page faults, a 28 px batch ~35 %), so 28 px is overestimated ~1.5x
SAMPLING_SECONDS_PER_PIXEL = 1.67e-6
# the release: the ONNX export of the generator (0.2 CPU-s at 28 and 64 px, 1 or 3 channels: the trace and the
# sampler graph, about 1 s wall with the tracer's start), the signing (hashing ~6 MB of files: 0.01 s), the
# privacy report and chart (0.002 s); bench/release_cost.py and a `train` run's progress events
EXPORT_SECONDS = 1.0
SIGNING_SECONDS = 0.1
REPORT_SECONDS = 0.1
# the aux generator's images (the frequency warm-up set, the cell prototypes' draw), per image pixel: 60 s for
# the 64x64x1 derived job's 4,000 (+ 4,000 RandAugment-ed central copies, ~3 % of it) on 2 cores
AUX_DRAW_SECONDS_PER_PIXEL = 3.7e-6
# the cell prototypes: PROTOTYPE_IMAGES aux images per class (stages.prototypes.PER_CLASS), then k-means per
# class (Python-bound at these sizes: 0.3-0.6 s a class on 1 thread, 28 or 64 px)
PROTOTYPE_IMAGES = 256
KMEANS_SECONDS_PER_CLASS = 0.5
GRID_PER_CLASS = 8  # a stage grid's images per class (`train`'s grid_per_class)
SAMPLE_GRID_PER_CLASS = 10  # samples.png's (release.jobdir.sample_grid)
# the aux generator's fit: seconds per step, image of its batch and image PIXEL (height x width) at width 32,
# CPU. From the eps = 10 preset's header at 28 px: 8 s an epoch of 40 steps of 100 images (2 threads). One
# step's CPU seconds follow the pixels, not the values (its convolutions run at its width; the output channels
# and the feature map it is fitted through add ~1 %: 1 thread, 28 px 0.265 s at 1 channel, 0.263 at 3; 64 px
# 1.43 s, the same per pixel within 10 %), and the batch linearly (bench/release_cost.py, "aux_fit_*")
AUX_STEP_SECONDS_PER_PIXEL = 8.0 / 40 / (100 * 784)
# its width w costs w + AUX_WIDTH_SQUARE x w^2 (the layers that scale with it, and the convolutions from w to
# w channels): 1 thread at 28 px, 0.097 / 0.257 / 0.787 s a step at width 16 / 32 / 64 (this: 0.098 / - /
# 0.766)
AUX_WIDTH_SQUARE = 0.03
RELEASE_FLOPS = 2e10  # assumed CPU rate of the feature map (a matrix product), not measured
CUDA_SPEEDUP = 20.0
# DP-SGD on a GPU, measured on one NVIDIA H100: a derived job on 3,200 64x64x1 images (16 channels, 3 levels,
# width factor 1.25, trainable norm_attention), q = 0.25 (~800 expected rows, padded to 1,024: 4 calls of
# physical batch 256), one other process on the GPU: 0.26 s a step, peak 3.5 GB of GPU memory. A call's
# fixed cost is taken as a whole small training step's there (kernel launches, not rows): 27 ms, a
# public-pretraining step of 64 images at 64 px on that GPU; the rest of the 0.26 s is per row. At physical
# batch 8 that predicts 3.3 s a step alone (116 calls), consistent with the same job there not getting
# through 20 steps in 5 min with 10 jobs sharing the GPU (the CPU rate / CUDA_SPEEDUP had said 0.55 s).
CUDA_CALL_SECONDS = 0.027
# per padded row, image value and width factor: the rest of the 0.26 s over 1,024 rows of 64x64 at 1.25
CUDA_DPSGD_SECONDS_PER_VALUE = (0.26 - 4 * CUDA_CALL_SECONDS) / (1024 * 64 * 64 * 1.25)
# the GPU memory one call may take: a few GB, so that several jobs share a GPU (10 ran on one 80 GB H100)
GPU_CALL_BYTES = 6 * 2**30
# a row's activations per image value per model channel: 209 measured (3.5 GB / (256 rows x 4,096 values x 16
# channels) on that H100), rounded up; per parameter a float32 per-example gradient, doubled for the clip's
# working copies (assumed, not measured: norm_attention, the measured job, trains few parameters)
GPU_ACTIVATION_BYTES = 256
GPU_GRADIENT_BYTES = 8
GPU_ROW_MULTIPLE = 8  # a GPU call takes a multiple of 8 rows where it can (the matrix units' tile)
BASE_BUDGET = 900.0  # seconds: 4,000 images at 28 px within 15 minutes on 2 CPU cores
# public pretraining: bench/pretraining.py's full size is 4,000 steps of 64 on 10,000 images (~25 passes); the
# [public] default 2,000 steps; fewer than a few hundred steps leave the fresh model's loss far from converged
PRETRAIN_EPOCHS = 20
PRETRAIN_MIN = 200
PRETRAIN_MAX = 4000
PRETRAIN_BATCH = 64
PRETRAIN_SHARE = 1 / 3  # of the time budget: the rest is for the stages that read the private data


@dataclass(frozen=True)
class PublicFacts:
    """The facts of a PUBLIC pretraining set (``train --public``): size, image shape (C, H, W), classes."""

    size: int
    shape: tuple[int, int, int]
    class_names: tuple[str, ...] = ()


def public_facts(ds: Any) -> PublicFacts:
    """The facts of a loaded public set (an ``ImageDataset``): its size, shape and class names."""
    c, h, w = (int(v) for v in ds.image_shape)
    return PublicFacts(int(ds.n), (c, h, w), tuple(str(n) for n in ds.class_names))


@dataclass(frozen=True)
class PatientFacts:
    """A PATIENT-level site's public patient facts (its signed policy's ``dataset.patients`` and
    ``dataset.patient_cap``): its DP-SGD samples whole patients at q = batch / ``patients`` and pads each step
    in whole chunks covering ``max(chunk, cap)`` images (``training.step_rows.site_step_rows``, which reads
    ``cap`` as it reads a node's ``PatientIndex``)."""

    patients: int
    cap: int


def policy_patient_facts(policy: Any) -> PatientFacts | None:
    """A site policy's public patient facts (``dataset.patients``, ``dataset.patient_cap``) where its unit of
    privacy is the patient, as its node reads them into its ``PatientIndex`` (``edge.site``); None where the
    unit is the image."""
    cap = policy.unit_cap
    if cap is None or not policy.patients:
        return None
    return PatientFacts(int(policy.patients), int(cap))


@dataclass(frozen=True)
class DataFacts:
    """The public facts a job is derived from. ``size``: declared or noisy-drawn, never an exact private
    count; ``size_drawn``: it comes from the run's noisy count (its event is charged first, so the rules leave
    room)."""

    size: int
    height: int
    width: int
    channels: int
    n_classes: int
    epsilon: float
    delta: float | None = None  # None: default_delta(size)
    device: Literal["cpu", "cuda"] = "cpu"
    time_budget: float | None = None  # seconds; None: default_time_budget
    federated: bool = False
    size_drawn: bool = False
    memory_mb: float | None = None  # the site's resources.max_worker_memory_mb; None: not checked
    public: PublicFacts | None = None  # a public pretraining set (its facts only; no private value)
    # "auto": DP-SGD by the eps x N rule; "on" / "off": asked for (a benchmark's route, a site's choice)
    dpsgd: Literal["auto", "on", "off"] = "auto"
    class_names: tuple[str, ...] = ()  # the private classes' names (public: declared or read off the data)
    # a federation's sites' declared (PUBLIC) sizes: each samples the one signed DP-SGD batch (sized at the
    # smallest) at q = batch / its own size, all in parallel; () where unknown: costed as one site of ``size``
    site_sizes: tuple[int, ...] = ()
    # each site's patient facts, aligned with ``site_sizes`` (None: an image-level site; (): every site is)
    site_patients: tuple[PatientFacts | None, ...] = ()
    # the one site's patient facts (a local run or ``privacy plan`` of a patient-level site); None: images
    patients: PatientFacts | None = None
    # the site policies' resources.max_physical_batch and max_pass_rows (the smallest of a federation's
    # sites': one signed job runs at every site); None: the policy's default (``DEFAULT_RESOURCES``)
    max_physical_batch: int | None = None
    max_pass_rows: int | None = None
    # the torch CPU threads the job runs with (``train --threads``, else torch's default; a federation's: the
    # coordinator's, ``coordinator.derive``): the CPU time estimates scale with them (:func:`thread_factor`)
    threads: int = REFERENCE_THREADS

    @property
    def shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of an image."""
        return (self.channels, self.height, self.width)

    @property
    def values(self) -> int:
        """Values in one image (channels x height x width)."""
        return self.channels * self.height * self.width

    @property
    def job_delta(self) -> float:
        """The job's delta: the given one, else :func:`default_delta` of the size."""
        return default_delta(self.size) if self.delta is None else float(self.delta)

    @property
    def budget(self) -> float:
        """Seconds the derived job may take: the given budget, else the default for the data."""
        return default_time_budget(self) if self.time_budget is None else float(self.time_budget)


@dataclass(frozen=True)
class Estimate:
    """Estimated seconds of a derived job by stage (the cost model of the module docstring)."""

    seconds: dict[str, float]

    @property
    def total(self) -> float:
        """Estimated seconds of the whole job, drawing the synthetic set included."""
        return sum(self.seconds.values())

    @property
    def finishing(self) -> float:
        """The stages after the training: the privacy report, the sample grid, the synthetic set (whose size
        is the user's choice: ``train --synthetic``) and the release."""
        return sum(self.seconds.get(k, 0.0) for k in FINISHING)

    @property
    def training(self) -> float:
        """Everything but the finishing stages: what the time budget bounds."""
        return self.total - self.finishing


@dataclass(frozen=True)
class Derivation:
    """A derived job, the estimate it was sized with and one line per rule (the TOML header)."""

    cfg: JobConfig
    facts: DataFacts
    estimate: Estimate
    notes: tuple[str, ...] = field(default=())


def default_delta(n: int) -> float:
    """The presets' delta 1e-5 up to 10,000 images; beyond, the power of ten at or below 1 / (10 N).

    >>> default_delta(4000), default_delta(10_000), default_delta(60_000)
    (1e-05, 1e-05, 1e-06)
    """
    return min(DELTA_PRESETS, 10.0 ** -(math.ceil(math.log10(max(int(n), 1))) + 1))


def default_time_budget(facts: DataFacts) -> float:
    """15 min for 4,000 28x28 images on the CPU; x sqrt of the pixels (34 min at 64 px) and of N / 4,000."""
    pixels = facts.height * facts.width
    return BASE_BUDGET * math.sqrt(max(1.0, pixels / 784)) * math.sqrt(max(1.0, facts.size / 4000))


def check_facts(f: DataFacts) -> None:
    """Refuse facts no job can be derived from, naming the fact and the fix."""

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"derived job: {msg}")

    need(isinstance(f.size, int) and f.size >= 1, f"public size must be a positive integer, got {f.size!r}")
    need(min(f.height, f.width) >= 8, f"images must be at least 8x8 pixels, got {f.height}x{f.width}")
    need(f.channels >= 1, f"channels must be >= 1, got {f.channels}")
    need(f.n_classes >= 1, f"the number of classes must be >= 1, got {f.n_classes}")
    need(math.isfinite(f.epsilon) and f.epsilon > 0, f"epsilon must be > 0, got {f.epsilon}")
    need(f.delta is None or 0 < f.delta < 1, f"delta must be in (0, 1), got {f.delta}")
    need(f.device in ("cpu", "cuda"), f"device must be cpu or cuda, got {f.device!r}")
    need(
        f.time_budget is None or f.time_budget > 0,
        f"the time budget must be > 0 seconds, got {f.time_budget}",
    )
    need(f.dpsgd in ("auto", "on", "off"), f"dpsgd must be auto, on or off, got {f.dpsgd!r}")
    need(
        isinstance(f.threads, int) and not isinstance(f.threads, bool) and f.threads >= 1,
        f"threads must be an integer >= 1, got {f.threads!r}",
    )
    for name in ("max_physical_batch", "max_pass_rows"):
        cap = getattr(f, name)
        need(cap is None or (isinstance(cap, int) and cap >= 1), f"{name} must be >= 1, got {cap!r}")
    need(
        all(isinstance(n, int) and n >= 1 for n in f.site_sizes) and (f.federated or not f.site_sizes),
        f"site sizes are a federation's positive declared sizes, got {list(f.site_sizes)}",
    )
    need(
        not f.site_patients or len(f.site_patients) == len(f.site_sizes),
        f"site patients are one entry per site size, got {len(f.site_patients)} for {len(f.site_sizes)}",
    )
    for p in (f.patients, *f.site_patients):
        need(
            p is None
            or (isinstance(p.patients, int) and isinstance(p.cap, int) and min(p.patients, p.cap) >= 1),
            f"a patient-level site's public patients and patient cap must be positive integers, got {p}",
        )
    if f.public is not None:
        need(
            isinstance(f.public.size, int) and f.public.size >= 1,
            f"the public set must hold at least one image, got {f.public.size!r}",
        )
        need(
            tuple(f.public.shape) == f.shape,
            f"the public images are {list(f.public.shape)} (C, H, W), the "
            f"private data's {list(f.shape)}; load both at one shape (--resize, --image-size)",
        )
    if f.memory_mb is not None:  # the images' memory is a ceiling no job changes: refused with the figure
        try:
            check_site_memory(f.size, f.shape, f.memory_mb, "derived job", "resources.max_worker_memory_mb")
        except DataError as exc:
            raise ConfigError(str(exc)) from None


def with_physical_caps(facts: DataFacts, policies: Any) -> DataFacts:
    """``facts`` with the smallest ``resources.max_physical_batch`` and ``resources.max_pass_rows`` (each
    its default where unset) of the site ``policies``, so that every site admits the derived job's physical
    batch (``policy.enforce.check_resources``)."""
    from .policy.enforce import resource_cap

    return replace(
        facts,
        max_physical_batch=int(min(resource_cap(p, "max_physical_batch") for p in policies)),
        max_pass_rows=int(min(resource_cap(p, "max_pass_rows") for p in policies)),
    )


# -- privacy: the budget split
# ---------------------------------------------------------------------------------


def _first(f: DataFacts) -> list[PrivacyEvent]:
    return [size_event()] if f.size_drawn else []


def job_patient_cap(f: DataFacts) -> int | None:
    """The patient cap the job's budget is counted over: a patient-level site's, or in a federation the
    largest of its patient-level sites' (the warm-up releases are one signed job, so the most constrained
    site decides their noise); None where every site's unit is the image."""
    caps = [p.cap for p in (f.patients, *f.site_patients) if p is not None]
    return max(caps) if caps else None


def _spent(f: DataFacts, events: list[PrivacyEvent]) -> float:
    """The job's epsilon of ``events`` as the planner and the ledger count it: per patient at a patient-level
    site (``accounting.patient_epsilon``: image-level releases by group privacy over the cap), else per
    image."""
    return unit_epsilon(events, f.job_delta, patient_cap=job_patient_cap(f))


def _fit_sigma(f: DataFacts, prior: list[PrivacyEvent], stage: str, target: float) -> float:
    """Smallest sigma of one q = 1 release of ``stage`` that keeps prior + it within ``target`` (per patient
    at a patient-level site)."""
    return smallest_fitting_sigma(
        lambda s: _spent(f, prior + [PrivacyEvent(stage, s, 1.0, 1)]),
        target,
        tol=0.005,
        max_sigma=MAX_NOISE_MULTIPLIER,
        refusal=f"derived job: no [{stage}] noise fits epsilon {target:.3g}{_per(f)}",
    )


def _up(sigma: float) -> float:
    """A noise multiplier written with 4 decimals, rounded UP: the written job never spends more than
    planned."""
    return math.ceil(sigma * 1e4) / 1e4


def _check_size_event(f: DataFacts) -> None:
    if not f.size_drawn:
        return
    spent = _spent(f, _first(f))
    if spent >= 0.5 * f.epsilon:
        raise ConfigError(
            f"derived job: epsilon {f.epsilon:g} is too small to draw the public size too: the noisy count "
            f"alone costs epsilon {spent:.3f} (more than half the budget); declare the size instead (train "
            "--public-size N, or a signed policy's dataset.size), or raise --epsilon"
        )


# -- central images
# ---------------------------------------------------------------------------------------------


def query_factor(height: int, noise_room: float = 0.0) -> float:
    """The power-of-two downsample whose query side is nearest 15 px (ties up; at most 0.5 unless the image is
    small), doubled once per factor 2 of ``noise_room`` (how far the noise figure is
    below :data:`RES_NOISE`)."""
    best = min((2.0**-k for k in range(0, 5)), key=lambda x: (abs(height * x - 15), -x))
    best = min(best, 0.5) if height >= 24 else best
    while noise_room >= 2 and best < 1 and height * best * 2 <= 32:
        best, noise_room = best * 2, noise_room / 2
    return best


def _query_values(f: DataFacts, factor: float) -> int:
    return f.channels * max(1, int(f.height * factor)) * max(1, int(f.width * factor))


def central_clip(values: int) -> float:
    return round(CLIP_PER_ROOT_VALUE * math.sqrt(values), 3)


def central_noise(sigma: float, clip: float, values: int, size: int, n_classes: int, cells: int) -> float:
    """``planning.stage_noise``'s central (mean) figure: noise std per value of one released (class, cell)
    mean."""
    return sigma * min(clip, math.sqrt(values)) / (size / (n_classes * cells))


def _floor(f: DataFacts, sigma_all: float, clip: float, values: int) -> None:
    r = central_noise(sigma_all, clip, values, f.size, f.n_classes, 1)
    if r <= MOSTLY_NOISE:
        return
    n_min = math.ceil(f.size * r / MOSTLY_NOISE)
    need_sigma = MOSTLY_NOISE * f.size / (f.n_classes * clip)
    eps_min = _spent(f, _first(f) + [PrivacyEvent("central", need_sigma, 1.0, 1)]) / FILL
    raise ConfigError(
        f"derived job: below the floor: {f.size} images in {f.n_classes} classes at epsilon {f.epsilon:g} - "
        f"even the strongest release (central images, the whole budget, one pass, one image per class) would "
        f"have noise std {r:.2f} per value of a class mean (noise sigma {sigma_all:.2f} x clip {clip:g} / "
        f"{f.size / f.n_classes:.1f} images per class), above the planner's mostly-noise line "
        f"{MOSTLY_NOISE}; it needs about {n_min} images at this epsilon, or epsilon >= {eps_min:.2f} at this "
        "size (or fewer classes)"
    )


def _cells(f: DataFacts, sigma: float, clip: float, values: int, frequency_on: bool) -> int:
    if f.federated or not frequency_on:
        return 1  # "aux" prototypes are single-site; "slant" is a prior on handwriting: no generic split
    ok = [
        c
        for c in (MAX_CELLS, 2, 1)
        if central_noise(sigma, clip, values, f.size, f.n_classes, c) <= CELL_NOISE
    ]
    return ok[0] if ok else 1


# -- frequency statistic
# ----------------------------------------------------------------------------------------


def frequency_noise(sigma: float, features: int, size: int, n_classes: int) -> float:
    """``planning.stage_noise``'s frequency figure."""
    return sigma * math.sqrt(features) / size * n_classes


def _features(f: DataFacts, sigma: float) -> int | None:
    for feats in FEATURE_LADDER:
        if frequency_noise(sigma, feats, f.size, f.n_classes) <= FEATURE_NOISE:
            return feats
    low = FEATURE_LADDER[-1]
    return low if frequency_noise(sigma, low, f.size, f.n_classes) <= MOSTLY_NOISE else None


def _frequency_section(f: DataFacts, sigma: float, features: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "features": features,
        "sigma": _up(sigma),
        "bandwidth2": round(PIXEL_BANDWIDTH2 * f.values, 3),
    }
    if features == FEATURE_LADDER[0]:  # the eps = 10 preset's patch map, scaled with the image
        side = min(f.height, f.width)
        patch, stride = max(3, round(7 * side / 28)), max(1, round(3 * side / 28))
        positions = ((f.height - patch) // stride + 1) * ((f.width - patch) // stride + 1)
        if 2 * positions <= features:
            out.update(patch=patch, stride=stride, bandwidth2=105.0)  # (the map scales it to the patch)
    return out


# -- the model, the warm-up, DP-SGD and the sampler
# -----------------------------------------------------------


def model_section(f: DataFacts) -> dict[str, Any]:
    """16 channels on every device (the device buys time, not a wider model: 16 is the width whose quality
    was measured, docs/derived-job.md "Measured quality"); 2 levels at 28 px, one more per doubling of the
    side (at most 4)."""
    levels = max(2, min(4, 2 + round(math.log2(max(f.height, f.width) / 28))))
    return {
        "channels": 16,
        "channel_mult": [1] + [2] * (levels - 1),
        "num_res_blocks": 1,
        "attn_resolutions": [],
    }


def _warmup(scale: float) -> dict[str, Any]:
    return {
        "spatial_iterations": max(50, round(1000 * scale)),
        "spatial_batch": 50,
        "augment_ops": 2,
        "augment_magnitude": 3,
        "frequency_images": max(400, round(4000 * scale)),
        "frequency_epochs": 3,
        "frequency_batch": 100,
        "frequency_mix_central": True,
        "lr": 2e-3,
        "ema": 0.99,
        "polish_iterations": max(25, round(500 * scale)),
        "polish_lr": 5e-4,
    }


def _auxgen(strong: bool, restarts: int) -> dict[str, Any]:
    return {
        "z_dim": 32,
        "width": 32,
        "lr": 0.01,
        "batch": 100,
        "epochs": 10 if strong else 3,
        "iterations_per_epoch": 40,
        "restarts": restarts,
        "keep": restarts,
    }


def _dpsgd_batch(n: int) -> int:
    return max(1, min(n, max(256, min(4096, round(0.25 * n)))))


def _dpsgd_units(f: DataFacts) -> int:
    """What DP-SGD samples from: a patient-level site's public patients (its batch is at most them, as its
    node requires), else the images."""
    return f.size if f.patients is None else min(f.size, f.patients.patients)


def _dpsgd_rate(f: DataFacts) -> float:
    """The ``[dpsgd]`` rate of the rules' batch over the images. Where a site's unit is the patient, the
    signed batch (rate x the images it is signed at: the smallest site's in a federation) is at most the
    rules' batch for its public patients (what its drafted policy's ``max_batch`` admits, and never above
    them), the rate rounded DOWN so that rounding never lifts the batch over it."""
    r = _dpsgd_batch(f.size) / f.size
    bounds = [_dpsgd_batch(p.patients) for p in (f.patients, *f.site_patients) if p is not None]
    if not bounds:
        return round(r, 6)
    at = min(f.site_sizes) if f.federated and f.site_sizes else f.size
    return math.floor(min(r, min(bounds) / at) * 1e6) / 1e6


# the CPU's rows per per-example-gradient call: a call holds about CPU_CALL_ROW_VALUES rows x image values (64
# rows of 28x28 grey), in multiples of 4 rows, at least 4. Why 64 and not the former 32 at 28 px: a call's
# fixed cost (Python, the hooks, ~500 small operations) is spread over twice the rows. Measured on this
# project's 2-core CPU, quiet, 2 threads, the derived job's own step for 4,000 digits at 28 px (`bench/
# bench_dpsgd.py --derived 4000 --size 28 --classes 10 --epsilon 1 --physical P --rounds 6 --threads 2
# --methods nonprivate,hooks --no-memory`): hooks 3.924 / 3.486 / 3.400 s a step at P = 32 / 64 / 128 (non-
# private 3.159 / 2.914 / 2.814: 1.24x / 1.20x / 1.21x), the private step 11 % faster at 64, little more at
# 128; at 64 training only the norms and attention 1.15x, LoRA 1.17x. Its memory (peak RSS of one step alone,
# `... --epsilon 10 --physical P --rounds 1 --steps 1 --threads 1`): private / non-private 595 / 554 MB at 32,
# 769 / 682 at 64, 1,090 / 1,001 at 128 (28 px); at 64x64 grey (`--size 64 --classes 4`, 1,144 rows a step)
# 645 / 604 MB at the former 8 rows, 759 / 685 at this rule's 12 (hooks 1.14x there in that one round, 1.34x
# at 8; the cores shared). Inside the working memory a site's process has beside its images
# (data.dataset.SITE_WORKING_MB, 1 GiB, the Python/torch baseline of ~300 MB included).
# The training math does not depend on it: each row's gradient is its own, clipped alone, and the step sums
# the same clipped gradients and adds the same noise whatever the calls (only the float summation order
# differs: tests/training/test_dpsgd_engine.py). The loss's randomness (EDM noise levels) is drawn call by
# call, so a seeded run draws the same distribution onto other rows, not the same bits; a job file that
# states its physical_batch runs as before. What changes is time: a step's padded rows are whole calls.
CPU_CALL_ROW_VALUES = 64 * 784


def _physical(values: int) -> int:
    """The CPU's rows per per-example-gradient call for images of ``values`` values
    (:data:`CPU_CALL_ROW_VALUES`): 64 at 28x28 grey, 48 at 32 px grey, 20 at 28 px RGB, 16 at 32 px RGB, 12
    at 64 px grey, 4 (the floor) from 64 px RGB and 128 px grey."""
    return max(4, min(64, 4 * round(CPU_CALL_ROW_VALUES / 4 / values)))


def _physical_batch(f: DataFacts, multiplicity: int) -> int:
    """Rows per per-example-gradient call, within the sites' caps (``resources.max_physical_batch`` and
    ``max_pass_rows`` over the ``multiplicity`` noise draws of each row). CPU: :func:`_physical` (its memory
    is rows x values). GPU: at small batches a call's fixed cost (kernel launches) outweighs its rows (the
    split :data:`CUDA_CALL_SECONDS` / per row is assumed from one measured point, 256 rows), so the fewest
    calls that cover a step's padded rows within the caps and
    :func:`_gpu_rows`, split evenly in multiples of :data:`GPU_ROW_MULTIPLE` (so no call is mostly
    padding): never more than a step pads to."""
    from .policy.enforce import DEFAULT_RESOURCES

    cap = min(
        f.max_physical_batch or int(DEFAULT_RESOURCES["max_physical_batch"]),
        (f.max_pass_rows or int(DEFAULT_RESOURCES["max_pass_rows"])) // multiplicity,
    )
    if f.device != "cuda":
        return max(1, min(cap, _physical(f.values)))
    most = max(1, min(cap, _gpu_rows(f, multiplicity)))
    rows = _step_tail(f)
    even = -(-rows // -(-rows // most))  # rows / the fewest calls of at most ``most``, rounded up
    return min(most, -(-even // GPU_ROW_MULTIPLE) * GPU_ROW_MULTIPLE)


def _gpu_rows(f: DataFacts, multiplicity: int) -> int:
    """The most rows one call may take on a GPU: :data:`GPU_CALL_BYTES` over a row's activations
    (:data:`GPU_ACTIVATION_BYTES` per image value per model channel) and its per-example gradient
    (:data:`GPU_GRADIENT_BYTES` per parameter), ``multiplicity`` noise draws a row; whole multiples of
    :data:`GPU_ROW_MULTIPLE` where that leaves any."""
    from .model_size import denoiser_parameters

    model = JobConfig.from_dict({"model": model_section(f), "dpsgd": {"steps": 0}}, "derived job").model
    params = denoiser_parameters(model, f.shape, f.n_classes)
    per_row = GPU_ACTIVATION_BYTES * f.values * model.channels + GPU_GRADIENT_BYTES * params
    rows = GPU_CALL_BYTES // (per_row * multiplicity)
    return rows - rows % GPU_ROW_MULTIPLE if rows >= GPU_ROW_MULTIPLE else max(1, rows)


def _step_tail(f: DataFacts) -> int:
    """The rows a derived DP-SGD step pads to before whole calls round them up (its padded rows in calls of
    one row: ``dpsgd_step_rows``, the slowest site's in a federation)."""
    one = {"rate": _dpsgd_rate(f), "steps": 0, "physical_batch": 1}
    return dpsgd_step_rows(JobConfig.from_dict({"dpsgd": one}, "derived job"), f)


def _dpsgd_section(f: DataFacts) -> dict[str, Any]:
    """The derived job's ``[dpsgd]`` section, steps 0 (set from the time budget by ``_dpsgd_steps``)."""
    multiplicity = 1
    return {
        "rate": _dpsgd_rate(f),
        "steps": 0,
        "clip": 1.0,
        "noise_multiplicity": multiplicity,
        "physical_batch": _physical_batch(f, multiplicity),
        "lr": 1e-3,
        "ema": 0.9,
        "trainable": "norm_attention" if f.public is not None else "all",
    }


def _sampler(strong: bool, frequency_on: bool) -> dict[str, Any]:
    if strong and frequency_on:
        return {"solver": "heun", "steps": 8, "start_sigma": 0.7, "start_source": "mix"}
    return {"solver": "heun", "steps": 8, "start_sigma": 0.5, "start_source": "central"}


# -- public pretraining ---------------------------------------------------------------------------------


def shared_classes(f: DataFacts) -> tuple[str, ...]:
    """The private classes a public class names by equal name: the pretraining is class-conditional for
    them."""
    if f.public is None:
        return ()
    return tuple(c for c in f.class_names if c in set(f.public.class_names))


def every_class_public(f: DataFacts) -> bool:
    """Every private class has a public class of its name: the pretraining is class-conditional for ALL of
    them (:func:`shared_classes`), so the pretrained denoiser already draws each private class and the derived
    job keeps it away from the released central images (:func:`keep_pretrained`). False without a public set,
    without the private classes' names, or where one private class has no public counterpart."""
    names = set(f.class_names)
    return len(names) == f.n_classes and names <= set(shared_classes(f))


def pretrain_iterations(f: DataFacts, freed: float = 0.0) -> int:
    """About :data:`PRETRAIN_EPOCHS` passes over the public set, clamped to [PRETRAIN_MIN, PRETRAIN_MAX]
    steps, and no more than :data:`PRETRAIN_SHARE` of the time budget buys, plus ``freed`` seconds (the
    warm-up :func:`keep_pretrained` dropped); never below PRETRAIN_MIN."""
    assert f.public is not None
    want = min(PRETRAIN_MAX, max(PRETRAIN_MIN, math.ceil(PRETRAIN_EPOCHS * f.public.size / PRETRAIN_BATCH)))
    model = JobConfig.from_dict({"model": model_section(f), "dpsgd": {"steps": 0}}, "derived job")
    per_step = seconds_per_pass(model, f) * PRETRAIN_BATCH
    return max(PRETRAIN_MIN, min(want, int((PRETRAIN_SHARE * f.budget + freed) // per_step)))


def public_section(f: DataFacts, freed: float = 0.0) -> dict[str, Any]:
    """The ``[public]`` pretraining settings for a public set of ``f.public``'s facts (the set itself is named
    by ``stages.pretrain.with_public`` when the job is signed); ``freed``: seconds of dropped warm-up that
    pretraining may take beside its share (:func:`keep_pretrained`)."""
    return {
        "pretrain_iterations": pretrain_iterations(f, freed),
        "pretrain_batch": PRETRAIN_BATCH,
        "pretrain_lr": 2e-3,
    }


def keep_pretrained(f: DataFacts, d: dict[str, Any], est: Estimate) -> dict[str, Any]:
    """The sections ``d`` (estimated ``est``) with the pretrained denoiser kept away from the released central
    images where :func:`every_class_public`: no spatial warm-up, no polish, no central images mixed into the
    frequency warm-up, their estimated seconds given to public pretraining (its pass and step caps kept).
    Why: on the medical-like set the spatial warm-up's steps on the noised, contrast-stretched central images
    turned the pretrained anatomy back into their speckled prototypes (docs/derived-job.md). The releases
    are untouched: the central images still seed the sampler's SDEdit starts and the cells, so the job plans
    the same events and epsilon. Elsewhere ``d`` as it is."""
    if not every_class_public(f):
        return d
    w = d["warmup"]
    freed = est.seconds.get("spatial warm-up", 0.0) + est.seconds.get("polish", 0.0)
    if w["frequency_mix_central"]:  # the estimate's frequency warm-up is half aux, half central images
        freed += est.seconds.get("frequency warm-up", 0.0) / 2
    off = {"spatial_iterations": 0, "polish_iterations": 0, "frequency_mix_central": False}
    return {**d, "warmup": {**w, **off}, "public": public_section(f, freed)}


# -- the cost model
# ---------------------------------------------------------------------------------------------


def width_factor(cfg: JobConfig) -> float:
    """The model's cost per image value against the 16-channel 2-level UNet the constants were measured on."""
    m = cfg.model
    return (m.channels / 16) ** 2 * (1 + 0.25 * (len(m.channel_mult) - 2)) * m.num_res_blocks


def thread_factor(facts: DataFacts) -> float:
    """How many times the 2-thread CPU rates a run on ``facts.threads`` threads takes:
    (:data:`REFERENCE_THREADS` / min(threads, REFERENCE_THREADS)) ** :data:`THREAD_EXPONENT` (1.80 on 1
    thread, 1 on 2 or more)."""
    return (REFERENCE_THREADS / min(int(facts.threads), REFERENCE_THREADS)) ** THREAD_EXPONENT


def _cpu_or_gpu(seconds: float, facts: DataFacts) -> float:
    """``seconds`` at the 2-thread CPU rate as the facts' device runs them: / :data:`CUDA_SPEEDUP` on a GPU
    (whose time does not follow the CPU threads), x :func:`thread_factor` on the CPU."""
    return seconds / CUDA_SPEEDUP if facts.device == "cuda" else seconds * thread_factor(facts)


def seconds_per_pass(cfg: JobConfig, facts: DataFacts) -> float:
    """Estimated seconds of one training pass of one image through the job's model (see the module
    docstring)."""
    return _cpu_or_gpu(SECONDS_PER_PIXEL_PASS * facts.values * width_factor(cfg), facts)


def dpsgd_step_rows(cfg: JobConfig, facts: DataFacts) -> int:
    """Rows one DP-SGD step of ``cfg`` processes on data of these facts: not the expected Poisson batch q·N
    but the PUBLIC bound every step is padded to (``training.step_rows.site_step_rows``, the count the node's
    trainer pads to), at q = batch / N as the planner charges it.

    A federation with known ``site_sizes``: every site is signed for one batch (``cfg``'s rate at the
    smallest site, ``coordinator.derive.federated_job``) and pads each step over its OWN size at q = batch /
    that size; the sites step in parallel, so a step takes the slowest site's time: the most padded rows of
    any site. Unknown sites: one site of the summed size N (an upper bound on any split of N). A
    patient-level site (``site_patients``, ``patients``) samples its public patients and pads as its node does
    (:func:`_site_step_rows`)."""
    if facts.federated and facts.site_sizes:
        signed_at = min(facts.site_sizes)
        units = facts.site_patients or (None,) * len(facts.site_sizes)
        return max(_site_step_rows(cfg, n, signed_at, p) for n, p in set(zip(facts.site_sizes, units)))
    return _site_step_rows(cfg, facts.size, facts.size, facts.patients)


def _site_step_rows(cfg: JobConfig, n: int, signed_at: int, patients: PatientFacts | None = None) -> int:
    """The padded rows of a site of public size ``n`` sampling ``cfg``'s batch, sized at ``signed_at``: over
    its images, or (``patients``) over its public patients at q = batch / patients, as the planner's event
    (``planning.site_dpsgd``) and the node's pad (``edge.releases``: ``site_step_rows`` with its
    ``PatientIndex``, whose public ``cap`` sets the padding unit and the sample's variance bound)."""
    batch = cfg.for_size(signed_at).dpsgd.batch
    q = stage_sampling_rate(batch, n if patients is None else patients.patients, "dpsgd")
    return site_step_rows(n, n, q, cfg.dpsgd.physical_batch, patients)


def dpsgd_step_seconds(cfg: JobConfig, facts: DataFacts) -> float:
    """Estimated seconds of one DP-SGD step: a per-example-gradient pass of each of its padded rows; on a
    GPU, where a call's fixed cost outweighs its rows at a small physical batch, also
    :data:`CUDA_CALL_SECONDS` for each call of ``physical_batch`` rows."""
    rows = dpsgd_step_rows(cfg, facts)
    if facts.device != "cuda":
        return seconds_per_pass(cfg, facts) * DPSGD_OVERHEAD * rows
    calls = -(-rows // cfg.dpsgd.physical_batch)
    return calls * CUDA_CALL_SECONDS + rows * CUDA_DPSGD_SECONDS_PER_VALUE * facts.values * width_factor(cfg)


def sampler_calls(cfg: JobConfig) -> int:
    """Denoiser calls per image of the job's sampler: Heun's N steps make 2N - 1 (its last step is Euler's),
    Euler's N; guidance doubles each call's batch."""
    s = cfg.sampler
    return (2 * s.steps - 1 if s.solver == "heun" else s.steps) * (2 if s.guidance else 1)


def sampling_seconds(cfg: JobConfig, facts: DataFacts, images: int) -> float:
    """Estimated seconds of the torch sampler drawing ``images`` images of the job's model
    (:data:`SAMPLING_SECONDS_PER_PIXEL` per denoiser call, image pixel and width factor)."""
    pixels = facts.height * facts.width
    return _cpu_or_gpu(
        SAMPLING_SECONDS_PER_PIXEL * pixels * width_factor(cfg) * sampler_calls(cfg) * images, facts
    )


def estimate(cfg: JobConfig, facts: DataFacts, n_synthetic: int | None = None) -> Estimate:
    """Estimated seconds of ``cfg`` on data of these facts, by stage: a term for every stage ``train`` runs,
    named as its progress events name it (``progress_events``), the synthetic set (``n_synthetic``: default
    the public size) and the release included."""
    cfg = cfg.for_size(facts.size)
    out = {**_release_terms(cfg, facts), **_warmup_terms(cfg, facts)}
    if facts.public is not None:
        out[PRETRAINING] = (
            seconds_per_pass(cfg, facts) * cfg.public.pretrain_iterations * cfg.public.pretrain_batch
        )
    steps = cfg.dpsgd_steps(facts.size)
    if steps:
        out[DPSGD] = steps * dpsgd_step_seconds(cfg, facts)
    out.update(_finishing_terms(cfg, facts, facts.size if n_synthetic is None else n_synthetic))
    return Estimate({k: round(v, 1) for k, v in out.items()})


def _release_terms(cfg: JobConfig, facts: DataFacts) -> dict[str, float]:
    """The releases (the feature map, the central query) and what the coordinator fits to them before the
    central request: the aux generator and, with ``[central] cell_rule = "aux"``, the cell prototypes."""
    fr, a, out = cfg.frequency, cfg.auxgen, {}
    if cfg.central.rounds > 0:
        out[CENTRAL] = facts.size * facts.values * cfg.central.rounds / RELEASE_FLOPS
    if fr.sigma is not None:
        cost = fr.features * (fr.patch**2 * facts.channels if fr.patch else facts.values)
        out[FREQUENCY] = facts.size * cost * 2 / RELEASE_FLOPS
        iters = a.iterations_per_epoch or max(1, facts.size // a.batch)
        out[AUX_FIT] = _cpu_or_gpu(a.restarts * a.epochs * iters * aux_step_seconds(cfg, facts), facts)
        if cfg.central.cell_rule == "aux" and cfg.central.rounds > 0:
            # the draw measured on 2 cores (x the threads' factor on the CPU), k-means on 1 thread (Python)
            draw = AUX_DRAW_SECONDS_PER_PIXEL * facts.height * facts.width * PROTOTYPE_IMAGES * _cpu(facts)
            out[PROTOTYPES] = (draw + KMEANS_SECONDS_PER_CLASS) * facts.n_classes
    return out


def _cpu(facts: DataFacts) -> float:
    """:func:`thread_factor` where the stage runs at the CPU rate (the CPU; on a GPU those stages keep their
    2-core figure, as before)."""
    return 1.0 if facts.device == "cuda" else thread_factor(facts)


def aux_step_seconds(cfg: JobConfig, facts: DataFacts) -> float:
    """CPU seconds of one aux-generator fit step: its batch x image pixels x its width's cost, relative to
    width 32 (:data:`AUX_STEP_SECONDS_PER_PIXEL`, :data:`AUX_WIDTH_SQUARE`)."""
    a = cfg.auxgen

    def cost(w: int) -> float:
        return w + AUX_WIDTH_SQUARE * w * w

    return AUX_STEP_SECONDS_PER_PIXEL * a.batch * facts.height * facts.width * cost(a.width) / cost(32)


def _warmup_terms(cfg: JobConfig, facts: DataFacts) -> dict[str, float]:
    """The warm-up stages on the releases and the sample grids ``train`` draws after each."""
    per, w, out = seconds_per_pass(cfg, facts), cfg.warmup, {}
    central, grids = cfg.central.rounds > 0, 0
    if central and w.spatial_iterations > 0:
        out[SPATIAL] = per * w.spatial_iterations * w.spatial_batch
        grids += 1
    if cfg.frequency.sigma is not None:
        mixed = 2 if w.frequency_mix_central and central else 1
        out[AUX_IMAGES] = (
            AUX_DRAW_SECONDS_PER_PIXEL * w.frequency_images * facts.height * facts.width * _cpu(facts)
        )
        out[FREQUENCY_WARMUP] = per * w.frequency_images * w.frequency_epochs * mixed
        grids += 1
    if central and w.polish_iterations > 0:
        out[POLISH] = per * w.polish_iterations * w.spatial_batch
    grids += (facts.public is not None) + (cfg.dpsgd_steps(facts.size) > 0)
    out[GRIDS] = sampling_seconds(cfg, facts, grids * GRID_PER_CLASS * facts.n_classes)
    return out


def _finishing_terms(cfg: JobConfig, facts: DataFacts, n_synthetic: int) -> dict[str, float]:
    """The stages after the training: the privacy report, the sample grid, the synthetic set, the release's
    ONNX export and its signing."""
    return {
        REPORT: REPORT_SECONDS,
        SAMPLE_GRID: sampling_seconds(cfg, facts, SAMPLE_GRID_PER_CLASS * facts.n_classes),
        SAMPLING: sampling_seconds(cfg, facts, n_synthetic),
        EXPORT: EXPORT_SECONDS,
        SIGNING: SIGNING_SECONDS,
    }


# -- the derivation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Split:
    """The releases' noise: central sigma, frequency sigma and features (None: the stage is off), cells,
    factor."""

    central: float
    frequency: float | None
    features: int | None
    cells: int
    factor: float


def _split(f: DataFacts, dpsgd: bool) -> _Split:
    prior, eps = _first(f), f.epsilon
    share, fill = (CENTRAL_SHARE_DPSGD, FILL_DPSGD) if dpsgd else (CENTRAL_SHARE, FILL)
    factor = query_factor(f.height)
    values = _query_values(f, factor)
    clip = central_clip(values)
    sigma_f: float | None = None
    try:
        sigma_c = _fit_sigma(f, prior, "central", share * eps)
        sigma_f = _fit_sigma(f, prior + [PrivacyEvent("central", sigma_c, 1.0, 1)], "frequency", fill * eps)
    except PrivacyError:  # per patient, a share below group privacy's floor: all on the central (below)
        sigma_c = 0.0
    feats = _features(f, sigma_f) if sigma_f is not None else None
    if feats is None or central_noise(sigma_c, clip, values, f.size, f.n_classes, 1) > MOSTLY_NOISE:
        # all on the central
        sigma_c, sigma_f, feats = _fit_sigma(f, prior, "central", fill * eps), None, None
    cells = _cells(f, sigma_c, clip, values, feats is not None)
    room = RES_NOISE / central_noise(sigma_c, clip, values, f.size, f.n_classes, cells)
    return _Split(sigma_c, sigma_f, feats, cells, query_factor(f.height, room))


def _sections(f: DataFacts, s: _Split, scale: float, restarts: int) -> dict[str, Any]:
    strong = f.epsilon >= STRONG_EPSILON
    values = _query_values(f, s.factor)
    d: dict[str, Any] = {
        "job": {"name": "derived", "seed": 0, "method": "feta-pro"},
        "privacy": {"epsilon": float(f.epsilon), "delta": f.job_delta, "accountant": "rdp"},
        "central": {
            "kind": "mean",
            "rounds": 1,
            "rate": 1.0,
            "sigma": _up(s.central),
            "clip": central_clip(values),
            "downsample": s.factor,
            "cells": s.cells,
            "cell_rule": "aux" if s.cells > 1 else "slant",
            "stretch": True,
        },
        "model": model_section(f),
        "warmup": _warmup(scale),
        "auxgen": _auxgen(strong, restarts if s.frequency is not None else 1),
        "dpsgd": _dpsgd_section(f),
        "sampler": _sampler(strong, s.frequency is not None),
    }
    if f.public is not None:
        d["public"] = public_section(f)
    if s.frequency is not None and s.features is not None:
        d["frequency"] = _frequency_section(f, s.frequency, s.features)
    return d


def _with_steps(d: dict[str, Any], steps: int, federated: bool) -> dict[str, Any]:
    if federated and steps > 0:  # rounds of LOCAL_STEPS (every site its own q over its declared size)
        rounds = steps // LOCAL_STEPS  # whole rounds, never more steps than the time rule chose
        return {
            **d,
            "dpsgd": {**d["dpsgd"], "steps": rounds * LOCAL_STEPS},
            "federation": {"rounds": rounds, "local_steps": LOCAL_STEPS},
        }
    return {**d, "dpsgd": {**d["dpsgd"], "steps": steps}}


def _fit_budget(f: DataFacts, s: _Split, reserve: float = 0.0) -> tuple[dict[str, Any], Estimate]:
    """The sections of split ``s`` whose training (sampling aside) fits the time budget less ``reserve``
    seconds (kept for DP-SGD): fewer aux fits, then a shorter warm-up (to a quarter at least)."""
    budget = f.budget - reserve
    restarts = 4 if f.epsilon >= STRONG_EPSILON else 1
    d = _sections(f, s, 1.0, restarts)
    est = estimate(JobConfig.from_dict(d, "derived job"), f)
    if est.training > budget and restarts > 1:
        d = _sections(f, s, 1.0, 1)
        est = estimate(JobConfig.from_dict(d, "derived job"), f)
    warm = sum(est.seconds.get(k, 0.0) for k in (SPATIAL, FREQUENCY_WARMUP, POLISH))
    if est.training > budget and warm > 0:
        scale = max(0.25, 1 - (est.training - budget) / warm)
        d = _sections(f, s, scale, 1)
        est = estimate(JobConfig.from_dict(d, "derived job"), f)
    return d, est


def _dpsgd_seconds(f: DataFacts, steps: int) -> float:
    """Estimated seconds of ``steps`` DP-SGD steps of the derived model at the derived batch, padded."""
    cfg = JobConfig.from_dict({"model": model_section(f), "dpsgd": _dpsgd_section(f)}, "derived job")
    return dpsgd_step_seconds(cfg, f) * steps


def _dpsgd_steps(f: DataFacts, d: dict[str, Any], est: Estimate) -> int:
    """The DP-SGD steps whose padded time (``dpsgd_step_seconds``) fits what the time budget leaves after
    ``est`` (the job without DP-SGD) and the sample grid ``train`` draws after the rounds, at most 20 epochs;
    a federated job's in whole rounds of :data:`LOCAL_STEPS`, rounded DOWN (rounded up, its last round ran
    past the budget by up to 4 steps)."""
    cfg = JobConfig.from_dict(d, "derived job")
    left = f.budget - est.training - sampling_seconds(cfg, f, GRID_PER_CLASS * f.n_classes)
    steps = int(max(0.0, left) // dpsgd_step_seconds(cfg, f))
    units = _dpsgd_units(f)
    steps = min(steps, math.ceil(20 * units / _dpsgd_batch(units)))  # at most 20 epochs (of patients)
    return steps - steps % LOCAL_STEPS if f.federated else steps


def derive(facts: DataFacts) -> Derivation:
    """The job derived from ``facts`` (see the module docstring), its estimate and the rules' notes. Raises
    ConfigError below the floor, naming the figure, why, and the fix."""
    check_facts(facts)
    _check_size_event(facts)
    factor = query_factor(facts.height)
    values = _query_values(facts, factor)
    try:
        _floor(
            facts,
            _fit_sigma(facts, _first(facts), "central", FILL * facts.epsilon),
            central_clip(values),
            values,
        )
        d, est, steps, why_off = _try_dpsgd(facts)
        if not steps:
            d, est = _fit_budget(facts, _split(facts, False))
    except PrivacyError as exc:  # per patient, group privacy over the cap has an epsilon no noise goes below
        cap = job_patient_cap(facts)
        raise ConfigError(
            f"{exc}: even noise multiplier {MAX_NOISE_MULTIPLIER:g} spends more; raise --epsilon"
            + (
                ""
                if cap is None
                else f", or lower the patient cap {cap} (group privacy over it sets that floor)"
            )
        ) from None
    # the DP-SGD steps were sized beside the warm-up; the time it frees goes to pretraining, not to DP-SGD
    d = _with_steps(keep_pretrained(facts, d, est), steps, facts.federated)
    cfg = JobConfig.from_dict(d, "derived job")
    try:
        plan_of(facts, cfg)
    except PrivacyError as exc:  # the split above always leaves room: this would be a rule bug, said plainly
        raise ConfigError(f"derived job does not plan: {exc}") from None
    return Derivation(cfg, facts, estimate(cfg, facts), notes_of(facts, cfg, steps, why_off))


def _try_dpsgd(f: DataFacts) -> tuple[dict[str, Any], Estimate, int, str]:
    """(sections, estimate, DP-SGD steps, why DP-SGD is off) of the job with DP-SGD; where it cannot run:
    empty sections, 0 steps and the reason the job's header gives."""
    if f.dpsgd == "off":
        return _off("asked for")
    try:  # the warm-up leaves room for at least DP-SGD's minimum steps (one more for the rounding)
        d, est = _fit_budget(f, _split(f, True), reserve=_dpsgd_seconds(f, DPSGD_MIN_STEPS + 1))
    except PrivacyError:  # the releases' smaller share leaves them no noise within the budget: no DP-SGD
        return _off(f"with DP-SGD's share taken, no release noise fits epsilon {f.epsilon:g}{_per(f)}")
    steps = _dpsgd_steps(f, d, est)
    if steps < DPSGD_MIN_STEPS:
        rounds = f" ({DPSGD_MIN_STEPS / LOCAL_STEPS:g} whole rounds of {LOCAL_STEPS})" if f.federated else ""
        return _off(f"{steps} steps fit the time budget, fewer than {DPSGD_MIN_STEPS}{rounds}")
    try:  # the planner calibrates DP-SGD for what the warm-up leaves (per patient: composed at delta / 2)
        noise = job_dpsgd_noise(f, _with_steps(d, steps, f.federated))
    except PrivacyError:
        return _off(f"no DP-SGD noise fits what the warm-up leaves of epsilon {f.epsilon:g}{_per(f)}")
    if f.dpsgd == "auto" and noise > DPSGD_MAX_NOISE:
        cfg = JobConfig.from_dict(d, "derived job")
        return _off(
            f"its noise-to-signal over the job sigma sqrt(P) / (B sqrt(T)) over the "
            f"{job_dpsgd_dimension(f, cfg):,} parameters it trains ({cfg.dpsgd.trainable}) is {noise:.4f}, "
            f"above {DPSGD_MAX_NOISE:.4f}, a fifth of where it tied"
        )
    return d, est, steps, ""


def _off(why: str) -> tuple[dict[str, Any], Estimate, int, str]:
    """:func:`_try_dpsgd`'s answer where DP-SGD cannot run: no sections, no steps, the header's reason."""
    return {}, Estimate({}), 0, why


def dpsgd_noise(sigma: float, params: int, batch: int, steps: int) -> float:
    """DP-SGD's noise-to-signal over a job: each step adds noise of std sigma x C per coordinate to the sum of
    ``batch`` gradients clipped to norm C, so the averaged step's noise has norm sigma C sqrt(params) / batch
    against a signal of norm at most C (``planning.stage_noise``'s per-step figure); over ``steps`` steps the
    signal adds up and the independent noise by sqrt(steps)."""
    return sigma * math.sqrt(params) / (batch * math.sqrt(max(1, steps)))


def job_dpsgd_noise(f: DataFacts, sections: dict[str, Any]) -> float:
    """:func:`dpsgd_noise` of the job ``sections`` on these facts, its sigma calibrated by the planner, in the
    dimension DP-SGD trains (:func:`job_dpsgd_dimension`)."""
    cfg = JobConfig.from_dict(sections, "derived job")
    p = plan_of(f, cfg)
    if p.noise_multiplier is None:
        return math.inf
    params = job_dpsgd_dimension(f, cfg)
    return dpsgd_noise(p.noise_multiplier, params, cfg.for_size(f.size).dpsgd.batch, cfg.dpsgd_steps(f.size))


def job_dpsgd_dimension(f: DataFacts, cfg: JobConfig) -> int:
    """How many parameters the job's DP-SGD trains on these facts (``[dpsgd] trainable``): its noise has one
    draw per trained coordinate, the frozen ones keep public values and get none."""
    from .model_size import dpsgd_dimension

    return dpsgd_dimension(cfg.model, f.shape, f.n_classes, cfg.dpsgd.trainable, cfg.dpsgd.lora_rank)


def plan_of(f: DataFacts, cfg: JobConfig) -> Any:
    """The planner's plan (``planning.plan``) of ``cfg`` as the facts' site runs it: a patient-level site's
    DP-SGD samples its public patients (unit "patient") and its total is counted PER PATIENT over its cap.
    A federation's job is planned as one site of the summed size (each site's own plan:
    ``coordinator.derive``)."""
    from .planning import patient_dpsgd, plan

    p = f.patients
    return plan(
        cfg,
        f.size,
        size=_first(f) or None,
        image_shape=f.shape,
        n_classes=f.n_classes,
        **(patient_dpsgd(None, None) if p is None else patient_dpsgd(p.patients, p.cap)),
    )


def derive_job(facts: DataFacts) -> JobConfig:
    """The ``JobConfig`` derived from the public ``facts`` (:func:`derive`)."""
    return derive(facts).cfg


def notes_of(f: DataFacts, cfg: JobConfig, steps: int, why_off: str = "") -> tuple[str, ...]:
    """The header lines of ``cfg`` on ``f`` with ``steps`` DP-SGD steps (``why_off``: why DP-SGD is off): one
    per rule and what it chose. A job changed after its derivation (a federation's signed batch, its DP-SGD
    steps cut) states the job it became, not the one derived."""
    c, fr, m = cfg.central, cfg.frequency, cfg.model
    side = max(1, int(f.height * c.downsample))
    delta = (
        "the presets' 1e-5"
        if f.delta is None and f.job_delta == DELTA_PRESETS
        else ("<= 1 / (10 N)" if f.delta is None else "given")
    )
    lines = [
        f"facts: public size {f.size}{' (noisy count)' if f.size_drawn else ''}, "
        f"{f.height}x{f.width}x{f.channels}, {f.n_classes} classes, epsilon {f.epsilon:g}, delta "
        f"{f.job_delta:g} ({delta}), {_device_note(f)}, time budget {f.budget:.0f} "
        f"s{' (default)' if f.time_budget is None else ''}" + (", federated" if f.federated else ""),
        f"central: one pass over all images (rate 1), sigma {c.sigma:g} "
        f"(epsilon {_spent(f, [PrivacyEvent('central', c.sigma, 1.0, 1)]):.3f} alone{_per(f)}), "
        f"{side}x{side} query (downsample {c.downsample:g}), clip {c.clip:g} = sqrt(values) / 7, {c.cells} "
        "cell(s)" + (" by public aux-generator prototypes" if c.cell_rule == "aux" else ""),
        (
            "frequency: off (even 32 features would be mostly noise; its budget went to the central images)"
            if fr.sigma is None
            else f"frequency: sigma {fr.sigma:g}, {fr.features} features"
            + (f" of {fr.patch}x{fr.patch} patches at stride {fr.stride}" if fr.patch else " of all pixels")
        ),
        f"model: {m.channels} channels, {len(m.channel_mult)} levels; warm-up "
        f"{cfg.warmup.spatial_iterations} spatial + {cfg.warmup.polish_iterations} polish steps, "
        f"{cfg.warmup.frequency_images} aux images, {cfg.auxgen.restarts} aux fit(s) of {cfg.auxgen.epochs} "
        "epochs",
        *_public_notes(f, cfg),
        _dpsgd_note(f, cfg, steps, why_off),
    ]
    est = estimate(cfg, f)
    parts = ", ".join(f"{k} {v:.0f}" for k, v in est.seconds.items())
    over = "; OVER it: the warm-up is at its shortest" if est.training > f.budget * 1.01 else ""
    lines.append(
        f"estimated {est.training / 60:.1f} min of training on {f.device} (budget {f.budget / 60:.1f} "
        f"min{over}) + {est.finishing / 60:.1f} min to draw {f.size} synthetic images and build the release "
        f"({parts} s)"
    )
    lines.append("quality: not yet measured for this derivation (docs/derived-job.md)")
    return tuple(lines)


def _device_note(f: DataFacts) -> str:
    """The device and the CPU threads the job was derived for, and what the threads did to its estimate."""
    what = f"{f.device}, {f.threads} thread{'s' if f.threads != 1 else ''}"
    if f.device == "cuda":
        return what
    factor = thread_factor(f)
    if factor == 1:
        return what
    return f"{what} (CPU stages estimated {factor:.2f}x their {REFERENCE_THREADS}-thread time)"


def _per(f: DataFacts) -> str:
    cap = job_patient_cap(f)
    return "" if cap is None else f" per patient of at most {cap} images"


def _dpsgd_note(f: DataFacts, cfg: JobConfig, steps: int, why_off: str = "") -> str:
    if not steps:
        return f"dpsgd: off ({why_off or 'asked for'})"
    why = (
        "asked for"
        if f.dpsgd == "on"
        else f"noise-to-signal over the job <= {DPSGD_MAX_NOISE:.4f}, a fifth of where it tied on digits; "
        "its gain not yet measured"
    )
    if f.federated:  # whole rounds, rounded down: a round more would not fit
        why += f"; {steps // LOCAL_STEPS} rounds of {LOCAL_STEPS}, the whole rounds that fit"
    return f"dpsgd: {steps} steps at {_stated_q(f, cfg)} from the time budget ({why})"


def _stated_q(f: DataFacts, cfg: JobConfig) -> str:
    """The DP-SGD sampling rate the header states, as the planner charges it (``planning.stage_events``: q =
    batch / the population DP-SGD samples, whole patients at a patient-level site).

    A federated job signs one BATCH, not a rate (``coordinator.derive.federated_job``: sized at the smallest
    declared site, cut to the sites' caps), and each site samples it over its own population: the header
    states the largest q, the smallest population's, read off the facts (``site_sizes``,
    ``site_patients``). A local job samples its one site's images at its rate, or its public patients."""
    if f.federated and f.site_sizes:
        batch = cfg.for_size(min(f.site_sizes)).dpsgd.batch
        units = f.site_patients or (None,) * len(f.site_sizes)
        n, what = min(
            ((n, "images") if p is None else (p.patients, "patients") for n, p in zip(f.site_sizes, units)),
            key=lambda u: u[0],
        )
        q = stage_sampling_rate(batch, n, "dpsgd")
        return f"q = {q:.4g} (batch {batch} over the smallest site's {n} {what})"
    if f.patients is not None:  # whole patients sampled: q over the public patients
        return f"q = {stage_sampling_rate(cfg.for_size(f.size).dpsgd.batch, f.patients.patients, 'dpsgd')}"
    return f"q = {cfg.dpsgd.rate if cfg.dpsgd.rate is not None else cfg.dpsgd.batch / f.size}"


def _public_notes(f: DataFacts, cfg: JobConfig) -> list[str]:
    if f.public is None:
        return []
    shared = shared_classes(f)
    how = (
        f"class-conditional for {len(shared)} of {f.n_classes} private classes named alike "
        f"({', '.join(shared)})"
        if shared
        else "unconditional (no public class names a private class)"
    )
    no_central = every_class_public(f)
    freed = " + the warm-up time freed below" if no_central else ""
    return [
        f"public: {cfg.public.pretrain_iterations} pretraining steps of {cfg.public.pretrain_batch} on "
        f"{f.public.size} public images (~{PRETRAIN_EPOCHS} passes, at most {PRETRAIN_SHARE:.0%} of the "
        f"time budget{freed}), {how}; DP-SGD, where it runs, trains the norms, attention and conditioning "
        "only",
        _central_warmup_note(f, cfg, no_central, len(shared)),
    ]


def _central_warmup_note(f: DataFacts, cfg: JobConfig, no_central: bool, shared: int) -> str:
    """The header's line for :func:`keep_pretrained`: what it chose and why."""
    if not no_central:
        why = (
            f"public classes name only {shared} of {f.n_classes} private classes"
            if shared
            else "the pretraining is unconditional"
        )
        return f"warm-up on the central images: kept ({why}: the releases teach the classes it does not draw)"
    return (
        "warm-up on the central images: off (0 spatial + 0 polish steps, no central images in the frequency "
        "warm-up): every private class has a public class of its name, so the pretrained denoiser is kept "
        "(measured on the medical-like set only: training on the noised central images turned its anatomy "
        "back into their speckled prototypes; docs/derived-job.md); their time went to pretraining "
        f"({cfg.public.pretrain_iterations} steps, "
        f"{pretrain_iterations(f)} without it); the central images still seed the sampler's starts"
    )


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def job_toml(cfg: JobConfig, notes: tuple[str, ...] = ()) -> str:
    """``cfg`` as a job TOML file (``load_job`` reads it back to the same job), ``notes`` as its header."""
    out = [f"# {line}" for line in notes]
    for section, values in cfg.to_dict().items():
        kept = {k: v for k, v in values.items() if v is not None}
        if not kept:
            continue
        out += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in kept.items()]
    return "\n".join(out).lstrip("\n") + "\n"


def derivation_toml(d: Derivation) -> str:
    """A derived job as a TOML file whose header says how it was derived."""
    head = (
        "job derived from public facts by feta_release.job_rules (feta-release train without --preset); "
        "each line: a rule and what it chose",
    )
    return job_toml(d.cfg, head + d.notes)


def sizing_size(facts: DataFacts) -> int:
    """A public reference size for a run that draws its size: the job the noisy count is drawn under is the
    one derived at this size, a function of the facts other than the size (never of the private count): 4,000,
    or the first of 16,000, 64,000, ... that derives (the floor falls with N)."""
    n = 4000
    while True:
        try:
            derive(facts_at(facts, n))
            return n
        except ConfigError:
            if n >= 10**8:
                raise
            n *= 4


def facts_at(facts: DataFacts, n: int) -> DataFacts:
    """``facts`` with the public size ``n``."""
    return replace(facts, size=int(n))


# -- a shipped preset on data of another shape -------------------------------------------------------------
# A preset is a saved example of these rules for one data kind: the digit presets for the embedded 28x28 grey
# digits, ``xray64-eps10`` (``[job] image_size = 64``) for 64x64 grey crops. On data of another shape its
# shape-dependent numbers are mapped by the same rules; what cannot be mapped is refused, naming the
# derived job.
PRESET_SIDE = 28  # the side a preset without ``[job] image_size`` was tuned at (the embedded digits)


def preset_shape(cfg: JobConfig) -> tuple[int, int, int]:
    """The (C, H, W) a preset was tuned on: grey, ``[job] image_size`` or the digits' 28 px."""
    side = int(cfg.job.image_size or PRESET_SIDE)
    return (1, side, side)


def _nearest_factor(side: int, query_side: float) -> float:
    """The power-of-two downsample of ``side`` whose query side is nearest ``query_side`` (ties: larger)."""
    return min((2.0**-k for k in range(0, 6)), key=lambda x: (abs(side * x - query_side), -x))


def _fit_central(cfg: JobConfig, ref: tuple[int, int, int], f: DataFacts) -> dict[str, Any]:
    """The preset's query side kept (the nearest power-of-two downsample), its clip per root query value
    kept (the rule ``clip = sqrt(values) / 7`` scales the same way)."""
    c = cfg.central
    factor = _nearest_factor(f.height, ref[1] * c.downsample)
    out: dict[str, Any] = {"downsample": factor}
    if c.clip is not None:  # (None: sqrt(values), the pixels' own bound, at any shape)
        ref_values = ref[0] * max(1, int(ref[1] * c.downsample)) * max(1, int(ref[2] * c.downsample))
        out["clip"] = round(c.clip * math.sqrt(_query_values(f, factor) / ref_values), 3)
    return out


def _fit_frequency(cfg: JobConfig, ref: tuple[int, int, int], f: DataFacts) -> dict[str, Any]:
    """The patch map scaled with the side (as :func:`_frequency_section`), or the pixel map's bandwidth2
    scaled with the image values (``PIXEL_BANDWIDTH2``'s rule)."""
    fr = cfg.frequency
    if fr.sigma is None:
        return {}
    if fr.patch:
        scale = f.height / ref[1]
        return {"patch": max(3, round(fr.patch * scale)), "stride": max(1, round(fr.stride * scale))}
    return {"bandwidth2": round(fr.bandwidth2 * f.values / (ref[0] * ref[1] * ref[2]), 3)}


def _fit_model(cfg: JobConfig, ref: tuple[int, int, int], f: DataFacts) -> dict[str, Any]:
    """One UNet level more per doubling of the side (fewer per halving; :func:`model_section`'s rule), at
    least one and no more than the side allows; attention kept at the level nearest its resolution."""
    m = cfg.model
    mult = list(m.channel_mult)
    levels = len(mult) + round(math.log2(f.height / ref[1]))
    levels = max(1, min(levels, int(math.log2(f.height)) + 1, len(mult) + 2))
    mult = (mult + [mult[-1]] * levels)[:levels]
    sides = [math.ceil(f.height / 2**k) for k in range(levels)]
    ref_levels = [math.ceil(ref[1] / 2**k) for k in range(len(m.channel_mult))]
    attn = []
    for r in m.attn_resolutions:  # the preset's attention level, shifted as the levels were
        nearest = min(range(len(ref_levels)), key=lambda k: abs(ref_levels[k] - r))
        level = nearest + levels - len(m.channel_mult)
        attn.append(sides[max(0, min(level, levels - 1))])
    return {"channel_mult": mult, "attn_resolutions": sorted(set(attn))}


def _fit_physical(cfg: JobConfig, ref: tuple[int, int, int], f: DataFacts) -> int:
    """The physical batch scaled down with the image values (its memory is rows x values), never up."""
    p = int(cfg.dpsgd.physical_batch)
    scaled = p * ref[0] * ref[1] * ref[2] // f.values
    return max(min(p, 4), min(p, scaled))


def fit_dpsgd_to_patients(cfg: JobConfig, patients: PatientFacts | None) -> dict[str, Any]:
    """A preset's ``[dpsgd]`` at a PATIENT-level site (``patients``: its declared public patients; {}: no
    change). The preset's ``rate`` is the sampling rate q it was tuned at, and such a site samples whole
    patients at q = batch / patients. Sized over the images (rate x N), its batch sampled N / P (up to the
    cap) times the preset's q, each step up to the cap times the preset's rows, its noise calibrated for that
    other job, and a rate over 1 / cap was refused. So the batch is rate x the public patients (q = the
    preset's rate) and ``epochs`` count passes over the patients."""
    d = cfg.dpsgd
    if patients is None or d.rate is None or d.steps == 0:
        return {}
    batch = max(1, round(d.rate * patients.patients))
    out: dict[str, Any] = {"rate": None, "batch": batch}
    if d.steps is None:
        assert d.epochs is not None
        out.update(steps=max(1, math.ceil(d.epochs * patients.patients / batch)), epochs=None)
    return out


def fit_preset(cfg: JobConfig, name: str, facts: DataFacts, *, size_known: bool = True) -> JobConfig:
    """The preset ``name`` on data of these public ``facts``: on its own shape as written; on another shape
    its central query, clip, feature map, UNet levels and physical batch mapped by the rules above; at a
    patient-level site (``facts.patients``) DP-SGD sized over its public patients
    (:func:`fit_dpsgd_to_patients`). Refused in one line naming the derived job where it cannot run (a batch
    larger than the public size, a feature map or model the shape cannot hold, the resource caps).
    ``size_known``: the public size is declared (else it is drawn later and the size checks are left to the
    run's plan)."""
    ref = preset_shape(cfg)
    out = cfg
    if ref != facts.shape:
        out = cfg.replace(
            central=_fit_central(cfg, ref, facts),
            frequency=_fit_frequency(cfg, ref, facts),
            model=_fit_model(cfg, ref, facts),
            dpsgd={"physical_batch": _fit_physical(cfg, ref, facts)},
        )
    if sgd := fit_dpsgd_to_patients(out, facts.patients):
        out = out.replace(dpsgd=sgd)
    try:
        _check_runs(out, facts, size_known)
    except FetaError as exc:
        side, tuned = "x".join(str(v) for v in facts.shape), "x".join(str(v) for v in ref)
        first = str(exc).splitlines()[0]
        raise ConfigError(
            f"preset {name} (tuned on {tuned}) cannot run on {facts.size:,} images of {side} "
            f"in {facts.n_classes} classes: {first}; derive the job from the data instead: drop "
            f"--preset and give --epsilon {facts.epsilon:g} (docs/derived-job.md)"
        ) from None
    return out


def _check_runs(cfg: JobConfig, f: DataFacts, size_known: bool) -> None:
    """What any job must pass on these facts before it runs: the feature map and model the shape can hold, the
    policy's default resource caps, the memory limit, and (a public size) a plan within its epsilon."""
    from .mechanisms.feature_map import check_feature_map
    from .model_size import denoiser_parameters
    from .planning import plan
    from .policy.enforce import DEFAULT_RESOURCES

    check_feature_map(cfg.frequency, f.shape)
    params = denoiser_parameters(cfg.model, f.shape, f.n_classes)
    for what, value, cap in (
        ("[model] parameters", params, "max_model_parameters"),
        ("[dpsgd] physical_batch", cfg.dpsgd.physical_batch, "max_physical_batch"),
        (
            "[dpsgd] physical_batch x noise_multiplicity",
            cfg.dpsgd.physical_batch * cfg.dpsgd.noise_multiplicity,
            "max_pass_rows",
        ),
    ):
        if value > DEFAULT_RESOURCES[cap]:
            raise ConfigError(
                f"{what} {value:,} > the policy's default resources.{cap} {DEFAULT_RESOURCES[cap]:,.0f}"
            )
    if f.memory_mb is not None:
        try:
            check_site_memory(f.size, f.shape, f.memory_mb, "the site", "resources.max_worker_memory_mb")
        except DataError as exc:
            raise ConfigError(str(exc)) from None
    if size_known:
        plan(cfg, f.size, image_shape=f.shape, n_classes=f.n_classes)


# -- the site policy `site init` drafts -------------------------------------------------------------------
DRAFT_EPSILON = 1.0  # the draft's per-job budget: strong by common guidance (edge/kit.py EPSILON_CEILING_JOB)
DRAFT_SHARE_SITES = 16  # min_sigma admits this site's share of the noise in a secure sum of up to 16 sites
DRAFT_MIN_STEPS = 100  # the DP-SGD step cap is at least this (the presets run 4 to 60 steps)
DPSGD_MIN_SIGMA = 0.5  # DP-SGD's floor is not one release's: subsampled steps fit a budget at small sigma


@dataclass(frozen=True)
class SiteCaps:
    """What `site init` drafts into a site policy from the site's PUBLIC facts by these rules (each a value
    the derived job at the drafted budget stays within), and that job (None: below the floor, ``floor`` says
    why)."""

    delta: float
    min_sigma: float  # central and frequency
    central_max_batch: int
    max_features: int
    dpsgd_max_batch: int
    dpsgd_max_steps: int
    max_worker_memory_mb: int
    job: Derivation | None
    floor: str = ""


def site_caps(
    size: int,
    shape: tuple[int, int, int],
    n_classes: int,
    patients: int | None = None,
    job_epsilon: float = DRAFT_EPSILON,
) -> SiteCaps:
    """The draft's caps for a site of public ``size`` images of ``shape`` in ``n_classes`` classes.

    ``patients``: the public number of patients of a patient-level site, whose DP-SGD samples patients. The
    caps:

    * delta: :func:`default_delta` of the size (the presets' 1e-5, below 1 / (10 N) past 10,000 images);
    * min_sigma (central, frequency): the noise multiplier one q = 1 release needs to fit ``job_epsilon``
      alone, over sqrt(:data:`DRAFT_SHARE_SITES`): every one-pass release within the budget passes, and so
      does this site's share sigma / sqrt(n) of a secure sum of up to 16 sites;
    * central max_batch: the size (one pass); max_features: the rules' largest feature count;
    * DP-SGD max_batch: the rules' batch for the unit count; max_steps: 20 epochs of it (at least 100);
    * max_worker_memory_mb: the float32 images plus the working memory (:func:`site_memory_bytes`), rounded up
      to a GiB, at least the policy's default."""
    from .data.dataset import site_memory_bytes
    from .policy.enforce import DEFAULT_RESOURCES

    c, h, w = (int(v) for v in shape)
    delta = default_delta(size)
    one = smallest_fitting_sigma(
        lambda s: epsilon([PrivacyEvent("central", s, 1.0, 1)], delta),
        job_epsilon,
        tol=0.005,
        max_sigma=MAX_NOISE_MULTIPLIER,
        refusal="no sigma fits the draft",
    )
    units = int(patients) if patients else int(size)
    batch = _dpsgd_batch(units)
    need_mb = math.ceil(site_memory_bytes(size, c * h * w) / 2**30) * 1024
    job, floor = None, ""
    try:
        job = derive(DataFacts(int(size), h, w, c, int(n_classes), job_epsilon, delta=delta))
    except ConfigError as exc:
        floor = str(exc)
    return SiteCaps(
        delta=delta,
        min_sigma=math.floor(one / math.sqrt(DRAFT_SHARE_SITES) * 100) / 100,
        central_max_batch=int(size),
        max_features=FEATURE_LADDER[0],
        dpsgd_max_batch=batch,
        dpsgd_max_steps=max(DRAFT_MIN_STEPS, math.ceil(20 * units / batch)),
        max_worker_memory_mb=max(int(DEFAULT_RESOURCES["max_worker_memory_mb"]), need_mb),
        job=job,
        floor=floor,
    )
