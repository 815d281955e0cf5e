"""The coordinator's warm-up on released statistics only (post-processing: no privacy cost): the SAME stage
computations (``feta_release.stages.spatial`` / ``freq_warmup``), on the sites' releases combined with
public-size weights.

Central images: the sites' released images are averaged (``combine_central``), post-processed as a single
site's are, and the spatial stage trains on them. Frequency statistics: the sites' noisy embeddings are
combined into one (``combine_frequency``); the frequency stage fits the auxiliary generator to it and warms
the denoiser on its images (+ the combined central images when ``[warmup] frequency_mix_central``). A
federation of one site therefore warms up exactly as ``train`` does on the same releases
(``tests/training/test_warmup_shared.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import JobConfig
from ..errors import DataError
from ..mechanisms.central import CentralRelease, combine_central, postprocess_central
from ..mechanisms.frequency import FrequencyRelease, combine_frequency
from ..models.auxgen import AuxModel
from ..models.edm import EDMDenoiser
from ..progress_events import Sink
from ..stages.freq_warmup import fit_aux, frequency_enabled, frequency_set, frequency_train
from ..stages.spatial import central_polish, spatial_enabled, spatial_stage

# a stage boundary: (stage name, the model after it, or the released central images (images, labels))
Observer = Callable[[str, Any], None]


def warm_up(
    model: EDMDenoiser,
    central: dict[str, dict[str, np.ndarray]],
    freq: dict[str, dict[str, np.ndarray]],
    cfg: JobConfig,
    sizes: dict[str, int],
    sink: Sink | None,
    observe: Observer | None = None,
    aux: AuxModel | None = None,
) -> AuxModel | None:
    """Run the enabled warm-up stages in place on ``model`` from the sites' releases (``{site: arrays}``);
    returns the aux generator the frequency stage fitted (None without it), for ``[sampler] start_source``
    aux/mix. ``sink``: each stage's progress (``progress_events``). ``observe``: called with
    ``("after-spatial" | "after-frequency", model)`` at each stage's end (a ``train`` run draws its sample
    grids there; post-processing). ``aux``: the generator already fitted to these frequency releases
    (:func:`fitted_aux`; ``[central] cell_rule = "aux"`` needed it first)."""
    observe = observe or (lambda stage, what: None)
    pooled = pooled_central(central, sizes, cfg) if central else None
    if pooled is not None and spatial_enabled(cfg):
        spatial_stage(model, pooled, cfg, sink)
        if not (freq and frequency_enabled(cfg)):
            central_polish(model, pooled, cfg, sink)
        observe("after-spatial", model)
    if freq and frequency_enabled(cfg):
        aux = _frequency(model, pooled_frequency(freq, sizes, cfg), pooled, cfg, sink, aux)
        if pooled is not None:
            central_polish(model, pooled, cfg, sink)  # the last warm-up stage ends with the polish (if on)
        observe("after-frequency", model)
    elif pooled is not None and not spatial_enabled(cfg):
        central_polish(model, pooled, cfg, sink)
    return aux


def _frequency(
    model: EDMDenoiser,
    release: FrequencyRelease,
    central: tuple[np.ndarray, np.ndarray] | None,
    cfg: JobConfig,
    sink: Sink | None,
    aux: AuxModel | None = None,
) -> AuxModel:
    device = next(model.parameters()).device
    if aux is None:
        aux = fit_aux(
            release.embedding, cfg, model.image_shape, model.n_classes, release.n_public, device, sink
        )
    frequency_train(model, *frequency_set(aux, central, cfg, sink), cfg, sink)
    return aux


def pooled_central(
    central: dict[str, dict[str, np.ndarray]], sizes: dict[str, int], cfg: JobConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The sites' central images averaged with public-size weights, then post-processed as a single site's
    release is (``[central] stretch``): float32 images in [0, 1] and int64 labels."""
    sites = sorted(central)
    combined = combine_central(
        [CentralRelease.from_arrays(central[s]) for s in sites], [sizes[s] for s in sites]
    )
    images, labels = postprocess_central(combined, stretch=cfg.central.stretch)
    return images.astype(np.float32), labels.astype(np.int64)


def pooled_frequency(
    freq: dict[str, dict[str, np.ndarray]], sizes: dict[str, int], cfg: JobConfig
) -> FrequencyRelease:
    """The sites' embeddings combined with public-size weights; refused unless they used the job's public
    random features (the aux generator is fitted with those)."""
    sites = sorted(freq)
    release = combine_frequency([freq[s] for s in sites], [sizes[s] for s in sites])
    f = cfg.frequency
    got = (release.features, float(release.bandwidth2), release.seed, release.patch, release.stride)
    want = (f.features, float(f.bandwidth2), f.seed, f.patch, f.stride)
    if got != want:
        raise DataError(
            f"the sites' frequency releases use features/bandwidth2/seed/patch/stride "
            f"{'/'.join(map(str, got))}, the job {'/'.join(map(str, want))}: they were not made for this job"
        )
    return release


def fitted_aux(
    freq: dict[str, dict[str, np.ndarray]],
    sizes: dict[str, int],
    cfg: JobConfig,
    image_shape: tuple[int, int, int],
    n_classes: int,
    device: Any,
    sink: Sink | None = None,
) -> AuxModel:
    """The aux generator fitted to the sites' combined frequency releases (post-processing), as the frequency
    warm-up fits it: ``[central] cell_rule = "aux"`` draws its public cell prototypes from it before the
    central release."""
    release = pooled_frequency(freq, sizes, cfg)
    return fit_aux(release.embedding, cfg, image_shape, n_classes, release.n_public, device, sink)
