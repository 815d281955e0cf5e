"""The one typed configuration object of a job (``JobConfig``), loaded from TOML.

Every section is a frozen dataclass; unknown keys and impossible values are refused with the
section, the key and what is wrong, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .bounds import MIN_CLIP
from .errors import ConfigError


@dataclass(frozen=True)
class JobSection:
    name: str = "feta-job"
    seed: int = 0
    # "refuse" lists images whose size differs; "resize" resizes them to ``image_size`` (bilinear);
    # "crop" centre-crops to square first. Same meaning as --resize (feta_release.data.LoadOptions).
    resize: Literal["refuse", "resize", "crop"] = "refuse"
    image_size: int | None = None  # None: the data's own size
    window: str = "auto"  # 16-bit/DICOM windowing: auto | bits:N | CENTER,WIDTH (feta_release.data.dicom)
    # Coarse method switch, used by presets and the benchmark; stages can also be disabled one by one. Applied
    # when the config is built (``METHOD_OFF``), so the planner, ``train``, the coordinator and every node see
    # one job.
    method: Literal["feta-pro", "dp-feta", "dpdm", "feta-pro-freq"] = "feta-pro"


@dataclass(frozen=True)
class PrivacySection:
    epsilon: float = 1.0
    delta: float = 1e-5
    accountant: Literal["rdp", "prv"] = "rdp"


@dataclass(frozen=True)
class CentralSection:
    kind: Literal["mean", "mode"] = "mean"
    rounds: int = 5  # one central image per class per round; 0 disables the stage
    batch: int = 6000  # expected Poisson batch over the whole dataset: q = batch / N
    # When set, the batch is derived from the PUBLIC dataset size: batch = round(rate * N) (see for_size)
    rate: float | None = None
    sigma: float = 5.0  # noise multiplier (std / sensitivity)
    clip: float | None = None  # L2 bound on the downsampled image; None: sqrt(c*h*w) (pixels are bounded)
    downsample: float = 0.5  # factor applied before the query (nearest)
    bins: int | None = None  # mode histogram bins; None: 2 for grey, 16 for colour
    # Per-image contrast stretch of the released images (post-processing,
    # mechanisms.central.stretch_contrast): a mean of clipped images is dim with a noisy background
    # (docs/evaluation.md).
    stretch: bool = False
    # Slant cells per class (mean only): each class's sum is split by a public function of each image
    # (mechanisms.central.slant_cells), releasing cells x rounds images per class for the same event and
    # epsilon. Federated jobs too: each site splits its sums the same way (per-site releases and secure sums
    # alike).
    cells: int = 1
    # How an image's cell is chosen: "slant" (the fixed prior above) or "aux": its nearest of `cells` public
    # prototypes of its class, k-means centres of aux-generator images (feta_release/stages/prototypes.py).
    # "aux" moves the frequency release and the aux fit BEFORE the central release (same events, same
    # epsilon); single-site only for now (a federation's sites would need the coordinator's prototypes).
    cell_rule: Literal["slant", "aux"] = "slant"


@dataclass(frozen=True)
class FrequencySection:
    features: int = 10000  # d_rff = 2 * number of frequencies
    sigma: float | None = None  # None disables the stage
    bandwidth2: float = 105.0  # Gaussian kernel bandwidth^2: omega ~ N(0, 1/bandwidth2)
    seed: int = 1234  # public seed: every site and the coordinator draw the same omega
    chunk: int = 512  # images per streamed chunk (memory is chunk x features, never N x features)
    # The feature map (mechanisms/feature_map.py): 0 = random Fourier features of all pixels (the papers'); k
    # > 0 = of every k x k patch at this stride, ``features`` shared out over the patch positions. Rows have
    # norm 1 either way: the same sensitivity and epsilon.
    patch: int = 0
    stride: int = 1


@dataclass(frozen=True)
class ModelSection:
    channels: int = 32  # base width (nf)
    channel_mult: tuple[int, ...] = (2, 2)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = (14,)
    dropout: float = 0.0
    label_dropout: float = 0.1  # classifier-free guidance null-label rate


@dataclass(frozen=True)
class WarmupSection:
    # Spatial warm-up on central images (ordinary training: they are already private).
    spatial_iterations: int = 2000
    spatial_batch: int = 64
    augment_ops: int = 2
    augment_magnitude: int = 3
    # Frequency warm-up: denoiser trained on auxiliary-generator images.
    frequency_images: int = 60000
    frequency_epochs: int = 10
    frequency_batch: int = 256
    # Also train the frequency warm-up on as many augmented copies of the released central images as there are
    # aux images (post-processing): keeps what the spatial stage learnt (docs/evaluation.md).
    frequency_mix_central: bool = False
    lr: float = 3e-4
    ema: float = 0.999
    # Central polish: after the last warm-up stage, this many more steps on augmented released central images
    # only, at ``polish_lr`` (post-processing). At lr 2e-3 the EMA model is under-fitted and draws speckled
    # strokes; a low-lr pass on the release lifted the model above its release (docs/evaluation.md).
    polish_iterations: int = 0
    polish_lr: float = 5e-4


@dataclass(frozen=True)
class AuxGenSection:
    z_dim: int = 60
    width: int = 64
    lr: float = 0.01
    batch: int = 100
    epochs: int = 5
    iterations_per_epoch: int | None = None  # None: N // batch with N the public dataset size
    gamma: float = 0.9
    # Fits of the same release from successive public starts, and how many of them (lowest final loss first)
    # the aux images are drawn from, evenly: post-processing, chosen by a function of the release alone.
    restarts: int = 1
    keep: int = 1


@dataclass(frozen=True)
class DPSGDSection:
    batch: int = 4096  # expected (logical) Poisson batch: q = batch / N
    rate: float | None = None  # when set: batch = round(rate * N) for the public size N (see for_size)
    steps: int | None = None
    epochs: float | None = None  # steps = ceil(epochs * N / batch); give steps OR epochs
    clip: float = 1.0
    noise_multiplicity: int = 32
    lr: float = 3e-4
    ema: float = 0.999
    physical_batch: int = 32  # rows per vectorised per-example-gradient chunk (memory bound)
    # per-example gradients: "hooks" (training.ghost_clip: one batched backward, 1.1-1.3x non-private),
    # "vmap" (torch.func, any module), "auto" = hooks when the model's layers allow it and the hooks pass
    # their cross-check on a public dummy batch (training.dpsgd.select_engine), else vmap. Same vectors either
    # way.
    per_example: Literal["auto", "hooks", "vmap"] = "auto"
    # None: calibrated over the whole history for the target (eps, delta)
    noise_multiplier: float | None = None
    # Already-RELEASED examples (RandAugment-ed copies of the released central images) added to every DP-SGD
    # step as non-private examples: free in epsilon (post-processing of the central release;
    # training.dpsgd.PublicMix).
    public_batch: int = 0
    # Which parameters DP-SGD trains (models.trainable): "all", or "norm_attention" (normalisation, attention
    # and conditioning: noise-level map, class embedding, per-block affine), the rest frozen at their PUBLIC
    # values (after public pretraining). The clip bounds the trainable gradient vector only and the noise has
    # one draw per trainable coordinate, so fewer dimensions carry the same sigma * C.
    # "lora": low-rank adapters on every conv/linear layer (models.lora), rank `lora_rank`, merged into the
    # weights when DP-SGD ends (a federated site: at the end of each round)
    trainable: Literal["all", "norm_attention", "lora"] = "all"
    lora_rank: int = 4


@dataclass(frozen=True)
class PublicSection:
    """A PUBLIC image set the denoiser is pretrained on before it sees any private image (stages.pretrain): it
    costs no epsilon, and the job names it (the sha256 of its canonical form, ``ImageDataset.fingerprint``,
    its count, shape and description), so a verifier can tell what the model knew before the private data.
    Only the coordinator (or the local run) reads it; sites receive this section of the signed job, never
    images.
    """

    sha256: str | None = None  # fingerprint of the public set; None: no public set
    count: int = 0
    shape: tuple[int, ...] = ()  # (C, H, W)
    description: str = ""
    class_names: tuple[str, ...] = ()  # the public set's classes; () when it is used without labels
    # "public=private" pairs naming which public class stands for which private class; a private class that no
    # pair (or equal name) reaches is learnt later (the pretraining draws it as the null label)
    label_map: tuple[str, ...] = ()
    pretrain_iterations: int = 2000  # steps on the public set (when one is named)
    pretrain_batch: int = 64
    pretrain_lr: float = 2e-3
    # sha256 of a reused pretrained model file (``train --pretrained``); it is loaded instead of pretraining
    pretrained_sha256: str | None = None
    # Semantic selection (PrivImage; mechanisms/selection.py): each site releases a noisy histogram of which
    # of `selection_groups` k-means groups of the public set its images are nearest to (sensitivity 1 image,
    # noise multiplier `selection_sigma`, charged as the event "selection"; a secure-aggregation job sums the
    # sites' histograms securely, each site adding its share of the noise); pretraining then uses the groups
    # with the highest noisy counts, at least `selection_keep` of the public set. Off by default (costs ε).
    selection: bool = False
    selection_groups: int = 16
    selection_sigma: float = 20.0
    selection_keep: float = 0.5

    @property
    def enabled(self) -> bool:
        return self.sha256 is not None or self.pretrained_sha256 is not None


@dataclass(frozen=True)
class SamplerSection:
    solver: Literal["euler", "heun"] = "heun"
    steps: int = 18
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0
    guidance: float = 0.0
    # SDEdit start for the run's synthetic set (post-processing of the release): None draws from pure noise at
    # sigma_max; a value starts from RandAugment-ed released central images plus N(0, start_sigma^2) noise and
    # denoises from start_sigma. The signed release then ships the central images and its ONNX generator takes
    # a start image too (format 2; `synthesize --from release`, the default for such a release:
    # docs/release.md).
    start_sigma: float | None = None
    # Where the SDEdit starts come from (with start_sigma): "central" the released central images (as before);
    # "aux" the auxiliary generator's images; "mix" every other start from each. The aux generator is fitted
    # to the noised frequency release only, so its images are post-processing of a release: no privacy cost.
    # The signed release then ships a fixed pool of its images (aux_images.npz) for `synthesize`
    # (docs/release.md).
    start_source: Literal["central", "aux", "mix"] = "central"

    @property
    def uses_aux(self) -> bool:
        """SDEdit starts (partly) from the aux generator: start_source aux or mix, with start_sigma."""
        return self.start_sigma is not None and self.start_source != "central"


@dataclass(frozen=True)
class FederationSection:
    sites: tuple[str, ...] = ()
    min_sites: int = 1  # a round goes on if at least this many sites answered
    rounds: int = 10  # federated DP-SGD rounds
    local_steps: int = 5  # DP-SGD steps per site per round
    round_timeout: float = 600.0
    # Central images and the frequency embedding summed by secure aggregation (docs/secure-aggregation.md):
    # each site adds a 1/n share of the noise (Skellam), the coordinator learns only the sum. False: per-site
    # noise (the explicit opt-out). Unset (None): ON for a job with >= 2 sites, off for one site; a signed job
    # always states the resolved value (``JobConfig.with_secure_default``, applied by ``policy.jobs`` when it
    # signs or reads one).
    secure_aggregation: bool | None = None
    # Sites a secure sum needs (a strict majority of the job's sites); None: all of them. Lower it to survive
    # dropouts; a site's epsilon counts threshold - max_colluders honest noise shares (its own only when
    # 2 (threshold - max_colluders) <= sites - max_colluders: see accountants.skellam.site_epsilons).
    secagg_threshold: int | None = None
    # DP-SGD as FedSGD (docs/secure-aggregation.md, "FedSGD"): each round is ONE pooled DP-SGD step; each site
    # sends its clipped-gradient sum plus its Skellam noise share through the secure sum, the coordinator
    # steps. Needs secure_aggregation; ``local_steps`` is then unused. False: ``local_steps`` per-site-noise
    # steps, FedAvg.
    fedsgd: bool = False


@dataclass(frozen=True)
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    central: CentralSection = field(default_factory=CentralSection)
    frequency: FrequencySection = field(default_factory=FrequencySection)
    model: ModelSection = field(default_factory=ModelSection)
    warmup: WarmupSection = field(default_factory=WarmupSection)
    auxgen: AuxGenSection = field(default_factory=AuxGenSection)
    dpsgd: DPSGDSection = field(default_factory=DPSGDSection)
    sampler: SamplerSection = field(default_factory=SamplerSection)
    federation: FederationSection = field(default_factory=FederationSection)
    public: PublicSection = field(default_factory=PublicSection)

    # -- derived quantities -------------------------------------------------------------------
    def dpsgd_steps(self, n: int) -> int:
        """DP-SGD steps for a dataset of public size ``n``."""
        if self.dpsgd.steps is not None:
            return self.dpsgd.steps
        assert self.dpsgd.epochs is not None
        return max(1, math.ceil(self.dpsgd.epochs * n / self.dpsgd.batch))

    @property
    def federated_rounds(self) -> int:
        """The federated DP-SGD rounds the job runs: ``[federation] rounds``, or 0 when ``[dpsgd] steps = 0``
        (no DP-SGD: a single-site preset that spends its whole budget on the warm-up releases means the same
        federated)."""
        return 0 if self.dpsgd.steps == 0 else int(self.federation.rounds)

    def with_secure_default(self, n_sites: int) -> JobConfig:
        """This job for ``n_sites`` sites with ``[federation] secure_aggregation`` resolved: an unset value
        becomes True for >= 2 sites (the default), False for one; an explicit value is kept. Re-validated, so
        a job that cannot be summed securely (mode central images, FedSGD on one site) is refused naming the
        fix."""
        if self.federation.secure_aggregation is not None:
            return self
        return self.replace(federation={"secure_aggregation": int(n_sites) >= 2})

    def for_size(self, n: int) -> JobConfig:
        """This job on a dataset of PUBLIC size ``n``: ``[central]``/``[dpsgd]`` ``rate`` turned into a batch
        (round(rate * n), at least 1), so q = batch / n is exactly what the accountant charges. A job without
        rates is returned unchanged."""
        out = self
        if self.central.rate is not None:
            out = out.replace(central={"batch": max(1, round(self.central.rate * n))})
        if self.dpsgd.rate is not None:
            out = out.replace(dpsgd={"batch": max(1, round(self.dpsgd.rate * n))})
        return out

    def to_dict(self) -> dict[str, Any]:
        d = _to_plain(dataclasses.asdict(self))
        # The default start source is left out, so a job that does not use the option hashes as before it
        # existed (run directories resume, signed jobs, ledgers and model.pt stay byte for byte the same).
        if d["sampler"].get("start_source") == "central":
            del d["sampler"]["start_source"]
        if d["frequency"].get("patch") == 0 and d["frequency"].get("stride") == 1:  # likewise the pixel map
            del d["frequency"]["patch"], d["frequency"]["stride"]
        if d["auxgen"].get("restarts") == 1 and d["auxgen"].get("keep") == 1:  # likewise a single aux fit
            del d["auxgen"]["restarts"], d["auxgen"]["keep"]
        if d["dpsgd"].get("trainable") == "all":  # likewise DP-SGD of every parameter
            del d["dpsgd"]["trainable"]
        if d["dpsgd"].get("trainable") != "lora":  # likewise the adapters' rank of a job without them
            del d["dpsgd"]["lora_rank"]
        if self.public == PublicSection():  # likewise a job without public data
            del d["public"]
        elif not self.public.selection:  # likewise a public job without semantic selection
            for key in ("selection", "selection_groups", "selection_sigma", "selection_keep"):
                del d["public"][key]
        return d

    def replace(self, **sections: Any) -> JobConfig:
        """Copy with whole sections or ``section={"key": value}`` overrides, re-validated."""
        data = self.to_dict()
        for name, value in sections.items():
            if dataclasses.is_dataclass(value) and not isinstance(value, type):  # an instance, not the class
                value = dataclasses.asdict(value)
            if name not in data and name != "public":  # [public] is left out of to_dict while unset
                raise ConfigError(f"unknown section [{name}]")
            merged = {**data.get(name, {}), **value}
            if name == "dpsgd" and "steps" in value and "epochs" not in value:
                merged["epochs"] = None  # steps and epochs are alternatives: the override wins
            if name == "dpsgd" and "epochs" in value and "steps" not in value:
                merged["steps"] = None
            data[name] = merged
        return JobConfig.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<job>") -> JobConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: top level must be a table")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(
                f"{source}: unknown section(s) {', '.join('[' + u + ']' for u in unknown)}; "
                f"known sections: {', '.join(known)}"
            )
        sections = {}
        hints = typing.get_type_hints(cls)
        for name in known:
            sections[name] = _build_section(hints[name], data.get(name, {}), f"{source} [{name}]")
        cfg = cls(**sections)
        off = METHOD_OFF.get(cfg.job.method, {})
        cfg = dataclasses.replace(
            cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in off.items()}
        )
        _validate(cfg, source)
        return cfg


# What ``[job] method`` switches off (dpdm: no warm-up; dp-feta: central images only; feta-pro-freq: frequency
# only).
METHOD_OFF: dict[str, dict[str, dict[str, Any]]] = {
    "dpdm": {"central": {"rounds": 0}, "frequency": {"sigma": None}},
    "dp-feta": {"frequency": {"sigma": None}},
    "feta-pro-freq": {"central": {"rounds": 0}},
}


def load_job(path: str | Path) -> JobConfig:
    """Read and validate a job TOML file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{p}: job file not found") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read job file: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: job file is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    return JobConfig.from_dict(data, source=str(p))


def preset_names() -> list[str]:
    """The job files shipped in ``feta_release/presets``, by name."""
    from importlib import resources

    return sorted(
        p.name.removesuffix(".toml")
        for p in resources.files("feta_release.presets").iterdir()
        if p.name.endswith(".toml")
    )


def preset_text(name: str) -> str:
    """The TOML text (header comments included) of a shipped preset; unknown names are refused listing
    them."""
    from importlib import resources

    ref = resources.files("feta_release.presets").joinpath(f"{name}.toml")
    if "/" in name or not ref.is_file():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    return ref.read_text("utf-8")


def load_preset(name: str) -> JobConfig:
    """A job file shipped in ``feta_release/presets`` (e.g. ``cpu-eps1``)."""
    return JobConfig.from_dict(tomllib.loads(preset_text(name)), source=f"preset {name}")


# -- helpers ---------------------------------------------------------------------------------------


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj


def _build_section(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: must be a table of key = value")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(hints[k], v, f"{where} {k}") for k, v in values.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        non_none = [a for a in args if a is not type(None)]
        if value is None:
            return None
        return _coerce(non_none[0], value, where)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_coerce(args[0], v, where) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: must be finite, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _validate_dpsgd(cfg: JobConfig, need: Callable[[bool, str], None]) -> None:
    d = cfg.dpsgd
    need((d.steps is None) != (d.epochs is None), "[dpsgd] give exactly one of steps or epochs")
    need(d.steps is None or d.steps >= 0, f"[dpsgd] steps must be >= 0, got {d.steps}")
    need(d.epochs is None or d.epochs > 0, f"[dpsgd] epochs must be > 0, got {d.epochs}")
    need(d.batch >= 1, f"[dpsgd] batch must be >= 1, got {d.batch}")
    need(d.clip >= MIN_CLIP, f"[dpsgd] clip must be >= {MIN_CLIP:g} (float32 rounding), got {d.clip}")
    need(d.noise_multiplicity >= 1, f"[dpsgd] noise_multiplicity must be >= 1, got {d.noise_multiplicity}")
    need(d.lr > 0, f"[dpsgd] lr must be > 0, got {d.lr}")
    need(0 <= d.ema < 1, f"[dpsgd] ema must be in [0, 1), got {d.ema}")
    need(d.physical_batch >= 1, f"[dpsgd] physical_batch must be >= 1, got {d.physical_batch}")
    need(d.noise_multiplier is None or d.noise_multiplier > 0, "[dpsgd] noise_multiplier must be > 0")
    need(d.public_batch >= 0, f"[dpsgd] public_batch must be >= 0, got {d.public_batch}")
    need(
        d.trainable in ("all", "norm_attention", "lora"),
        f'[dpsgd] trainable must be "all", "norm_attention" or "lora", got {d.trainable!r}',
    )
    need(d.lora_rank >= 1, f"[dpsgd] lora_rank must be >= 1, got {d.lora_rank}")
    need(
        d.trainable == "all" or not cfg.federation.fedsgd,
        f'[dpsgd] trainable = "{d.trainable}" is not wired into FedSGD rounds (the sites\' and the '
        "coordinator's "
        'parameter lists would have to agree on it); set trainable = "all" or fedsgd = false',
    )
    need(
        d.public_batch == 0 or not cfg.federation.fedsgd,
        "[dpsgd] public_batch is not mixed into FedSGD rounds (their update is a secure sum of the sites' "
        "gradient shares; per-site rounds get the central images from the coordinator); set it to 0 or "
        "fedsgd = false",
    )


def _validate_frequency(f: FrequencySection, need: Callable[[bool, str], None]) -> None:
    need(f.sigma is None or f.sigma > 0, f"[frequency] sigma must be > 0, got {f.sigma}")
    need(
        f.features >= 2 and f.features % 2 == 0,
        f"[frequency] features must be an even number >= 2, got {f.features}",
    )
    need(
        0 <= f.patch <= 65_536 and 1 <= f.stride <= 65_536,
        f"[frequency] patch must be in [0, 65536] (0: all "
        f"pixels) and stride in [1, 65536], got patch {f.patch}, stride {f.stride}",
    )
    need(
        f.patch > 0 or f.stride == 1,
        f"[frequency] stride {f.stride} applies to the patch map only: set patch > 0 or leave stride at 1",
    )
    need(0 <= f.seed < 2**63, f"[frequency] seed must be in [0, 2^63), got {f.seed}")
    need(f.bandwidth2 > 0, f"[frequency] bandwidth2 must be > 0, got {f.bandwidth2}")
    need(f.chunk >= 1, f"[frequency] chunk must be >= 1, got {f.chunk}")


def _validate_start_source(cfg: JobConfig, need: Callable[[bool, str], None]) -> None:
    """``[sampler] start_source``: aux/mix starts need an SDEdit level and the stage that fits the aux
    generator."""
    src = cfg.sampler.start_source
    need(
        src in ("central", "aux", "mix"),
        f'[sampler] start_source must be "central", "aux" or "mix", got {src!r}',
    )
    if src == "central":
        return
    need(
        cfg.sampler.start_sigma is not None,
        f'[sampler] start_source = "{src}" needs start_sigma (the SDEdit start level, e.g. 1.0): set it or '
        'use start_source = "central"',
    )
    need(
        cfg.frequency.sigma is not None,
        f'[sampler] start_source = "{src}" starts from the aux generator, which only the frequency stage '
        'fits: set [frequency] sigma (and a method that keeps it) or use start_source = "central"',
    )
    need(
        src != "mix" or cfg.central.rounds > 0,
        '[sampler] start_source = "mix" takes half its starts from the released central images: set '
        '[central] rounds > 0 or use start_source = "aux"',
    )


_HEX = frozenset("0123456789abcdef")


def _is_sha256(v: str | None) -> bool:
    return v is None or (len(v) == 64 and set(v) <= _HEX)


def _validate_public(cfg: JobConfig, need: Callable[[bool, str], None]) -> None:
    """``[public]``: a named public set (its hash, count and shape) or a hashed pretrained model, never
    neither with pretraining asked for; label_map pairs name the public set's classes."""
    pb = cfg.public
    need(
        _is_sha256(pb.sha256) and _is_sha256(pb.pretrained_sha256),
        "[public] sha256 and pretrained_sha256 must be 64 lower-case hex digits (feta-release data "
        "fingerprint)",
    )
    need(
        pb.pretrain_iterations >= 0 and pb.pretrain_batch >= 1 and pb.pretrain_lr > 0,
        "[public] pretrain_iterations must be >= 0, pretrain_batch >= 1 and pretrain_lr > 0",
    )
    if pb.sha256 is not None:
        need(
            pb.count >= 1 and len(pb.shape) == 3 and all(v >= 1 for v in pb.shape),
            f"[public] a public set needs count >= 1 and shape = [C, H, W], got count {pb.count}, shape "
            f"{list(pb.shape)}",
        )
    need(len(pb.description) <= 500, "[public] description must be at most 500 characters")
    if pb.selection:
        _validate_selection(pb, need)
    for pair in pb.label_map:
        pub, sep, priv = pair.partition("=")
        need(
            bool(sep and pub and priv),
            f'[public] label_map entry {pair!r} must read "public_class=private_class"',
        )
        need(
            not pb.class_names or pub in pb.class_names,
            f"[public] label_map names public class {pub!r}, not one of {', '.join(pb.class_names)}",
        )


def _validate_selection(pb: PublicSection, need: Callable[[bool, str], None]) -> None:
    """``[public] selection``: pretraining to use it and a well-formed query (the public set itself is named
    when the run is given it: ``stages.pretrain.with_public`` refuses a selection without one)."""
    need(
        pb.pretrain_iterations > 0,
        "[public] selection spends epsilon on a selection that no pretraining "
        "uses (pretrain_iterations = 0): set pretrain_iterations > 0 or selection = false",
    )
    need(
        pb.selection_groups >= 2 and (pb.sha256 is None or pb.selection_groups <= pb.count),
        f"[public] selection_groups must be >= 2 and at most the public set's count ({pb.count}), "
        f"got {pb.selection_groups}",
    )
    need(
        math.isfinite(pb.selection_sigma) and pb.selection_sigma > 0,
        f"[public] selection_sigma (the histogram's noise multiplier) must be > 0, got {pb.selection_sigma}",
    )
    need(
        0 < pb.selection_keep <= 1,
        f"[public] selection_keep (the fraction of the public set kept) must be in (0, 1], got "
        f"{pb.selection_keep}",
    )


def _validate(cfg: JobConfig, source: str) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"{source}: {msg}")

    p, c, f, d = cfg.privacy, cfg.central, cfg.frequency, cfg.dpsgd
    need(p.epsilon > 0, f"[privacy] epsilon must be > 0, got {p.epsilon}")
    need(0 < p.delta < 1, f"[privacy] delta must be in (0, 1), got {p.delta}")
    need(c.rounds >= 0, f"[central] rounds must be >= 0, got {c.rounds}")
    need(c.rate is None or 0 < c.rate <= 1, f"[central] rate must be in (0, 1], got {c.rate}")
    need(d.rate is None or 0 < d.rate <= 1, f"[dpsgd] rate must be in (0, 1], got {d.rate}")
    if c.rounds > 0:
        need(c.batch >= 1, f"[central] batch must be >= 1, got {c.batch}")
        need(c.sigma > 0, f"[central] sigma must be > 0, got {c.sigma}")
        need(0 < c.downsample <= 1, f"[central] downsample must be in (0, 1], got {c.downsample}")
        need(
            c.clip is None or c.clip >= MIN_CLIP,
            f"[central] clip must be >= {MIN_CLIP:g} (float32 rounding), got {c.clip}",
        )
        need(c.bins is None or c.bins >= 2, f"[central] bins must be >= 2, got {c.bins}")
        need(c.cells >= 1, f"[central] cells must be >= 1, got {c.cells}")
        need(
            c.cells == 1 or c.kind == "mean",
            f'[central] cells = {c.cells} needs kind = "mean" (or set cells = 1)',
        )
        need(
            c.cell_rule in ("slant", "aux"),
            f'[central] cell_rule must be "slant" or "aux", got {c.cell_rule!r}',
        )
        need(
            c.cell_rule != "aux" or (c.kind == "mean" and f.sigma is not None),
            '[central] cell_rule = "aux" takes its prototypes from the aux generator: it needs kind = "mean" '
            'and [frequency] sigma (or set cell_rule = "slant")',
        )
        need(
            c.cell_rule != "aux" or not cfg.federation.sites,
            '[central] cell_rule = "aux" is single-site only (a federation\'s sites split by slant): set '
            'cell_rule = "slant" in a federated job',
        )
    if f.sigma is not None:
        _validate_frequency(f, need)
    a = cfg.auxgen
    need(
        a.restarts >= 1 and 1 <= a.keep <= a.restarts,
        f"[auxgen] need restarts >= 1 and 1 <= keep <= restarts, got restarts {a.restarts}, keep {a.keep}",
    )
    _validate_dpsgd(cfg, need)
    need(cfg.model.channels >= 4, f"[model] channels must be >= 4, got {cfg.model.channels}")
    need(len(cfg.model.channel_mult) >= 1, "[model] channel_mult needs at least one level")
    need(0 <= cfg.model.label_dropout < 1, "[model] label_dropout must be in [0, 1)")
    need(cfg.sampler.steps >= 1, f"[sampler] steps must be >= 1, got {cfg.sampler.steps}")
    need(0 < cfg.sampler.sigma_min < cfg.sampler.sigma_max, "[sampler] need 0 < sigma_min < sigma_max")
    need(
        cfg.sampler.start_sigma is None
        or cfg.sampler.sigma_min < cfg.sampler.start_sigma <= cfg.sampler.sigma_max,
        "[sampler] start_sigma must be in (sigma_min, sigma_max] (or left out: sample from noise)",
    )
    _validate_start_source(cfg, need)
    _validate_public(cfg, need)
    need(
        cfg.warmup.spatial_iterations >= 0 and cfg.warmup.frequency_epochs >= 0,
        "[warmup] counts must be >= 0",
    )
    need(
        cfg.warmup.polish_iterations >= 0 and cfg.warmup.polish_lr > 0,
        "[warmup] polish_iterations must be >= 0 and polish_lr > 0",
    )
    need(cfg.federation.min_sites >= 1, "[federation] min_sites must be >= 1")
    need(
        cfg.federation.rounds >= 0 and cfg.federation.local_steps >= 1,
        "[federation] rounds >= 0, local_steps >= 1",
    )
    need(cfg.job.image_size is None or cfg.job.image_size >= 8, "[job] image_size must be >= 8")
    need(
        cfg.federation.secagg_threshold is None or cfg.federation.secagg_threshold >= 2,
        "[federation] secagg_threshold must be >= 2 (a strict majority of the job's sites)",
    )
    need(
        not (cfg.federation.secure_aggregation and c.rounds > 0 and c.kind == "mode"),
        "[federation] secure_aggregation (the default for a job with >= 2 sites) sums mean central images "
        "only: set "
        '[central] kind = "mean" or [federation] secure_aggregation = false',
    )
    need(
        not cfg.federation.fedsgd or cfg.federation.secure_aggregation is not False,
        "[federation] fedsgd sends noise SHARES, which only secure aggregation sums: set secure_aggregation "
        "= true or fedsgd = false",
    )
    from .data.dicom import parse_window

    try:
        parse_window(cfg.job.window)
    except ConfigError as exc:
        raise ConfigError(f"{source}: [job] {exc}") from None


def config_hash(cfg_dict: dict[str, Any]) -> str:
    """sha256 of the job configuration in canonical JSON (key order and whitespace do not matter)."""
    blob = json.dumps(cfg_dict, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()
