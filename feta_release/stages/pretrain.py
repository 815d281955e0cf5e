"""Public pretraining. The denoiser learns from a PUBLIC image set (``[public]``) before any private
image, or starts from a reused pretrained model file (``[public] pretrained_sha256``); the warm-ups and DP-SGD
then fine-tune it.

Privacy: nothing here reads a site's data. The public set and the public seed (``[job] seed``) determine the
pretrained weights, so they are public: a function of public inputs only, charged nothing, and every later
stage starts from them as it would start from the seeded initialisation. The job names the set (its sha256,
count, shape, classes, description) and the release carries the job, so the release says what the model saw
first.

Labels: a public class maps onto a private class of the same name or through ``[public] label_map``
("public=private"); the images of a class that maps onto none are learnt with the NULL label (the class-free
embedding that classifier-free guidance already trains), so an unlabelled or unrelated public set pretrains
the denoiser unconditionally and the private classes' embeddings are learnt later, from the releases and
DP-SGD.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import JobConfig
from ..data import ImageDataset
from ..data.public import public_problem, public_record
from ..errors import ConfigError, DataError
from ..mechanisms.selection import public_groups, select_groups
from ..models.edm import EDMDenoiser, denoiser_spec
from ..models.model_file import read_model_file
from ..signing import sha256_file
from ..training.warmup_loop import Progress, WarmupResult, train_denoiser
from .context import public_generator

PRETRAINED_FILE = "pretrained.pt"  # RUN_DIR/pretrained.pt: the public model, reusable by `train --pretrained`


@dataclass(frozen=True)
class PublicInputs:
    """What only the coordinator holds (a ``train`` run's too): the public set and/or a pretrained model."""

    data: ImageDataset | None = None
    description: str = ""
    pretrained: Path | None = None

    def section(self) -> dict[str, Any]:
        """The ``[public]`` values that name these inputs (sha256, count, shape, classes, description)."""
        out: dict[str, Any] = public_record(self.data, self.description) if self.data is not None else {}
        if self.pretrained is not None:
            out["pretrained_sha256"] = sha256_file(self.pretrained)
        return out


def with_public(cfg: JobConfig, public: PublicInputs | None, image_shape: tuple[int, int, int]) -> JobConfig:
    """``cfg`` with its ``[public]`` section naming ``public``; refused when the job already names another set
    or model, names one that was not given, or the public images are not the private data's shape."""
    pb = cfg.public
    if pb.selection and (public is None or public.data is None):
        raise ConfigError(
            "[public] selection chooses among public images: give the public set (--public "
            "PATH), or set [public] selection = false"
        )
    if (
        public is not None
        and public.data is not None
        and tuple(public.data.image_shape) != tuple(image_shape)
    ):
        raise DataError(
            f"{public.data.source}: public images are {list(public.data.image_shape)} (C, H, W), the "
            f"private data's {list(image_shape)}; load both at one shape (--resize, --image-size)"
        )
    if public is None:
        if pb.enabled:
            raise ConfigError(
                "the job names public data ([public] sha256 / pretrained_sha256): give the same "
                "--public PATH (and --pretrained FILE) it was made with"
            )
        return cfg
    named = public.section()
    if public.data is not None and pb.sha256 is not None:
        problem = public_problem(
            {"sha256": pb.sha256, "count": pb.count, "shape": list(pb.shape)}, public.data
        )
        if problem:
            raise DataError(f"{public.data.source}: {problem}")
    if (
        pb.pretrained_sha256 is not None
        and named.get("pretrained_sha256", pb.pretrained_sha256) != pb.pretrained_sha256
    ):
        raise DataError(
            f"{public.pretrained}: sha256 {named['pretrained_sha256']}, the job names "
            f"{pb.pretrained_sha256}: not the pretrained model of this job"
        )
    if pb.sha256 is not None and public.data is None:
        raise ConfigError("the job names a public set ([public] sha256): give --public PATH")
    if not public.description:
        named.pop("description", None)  # keep the job's own
    return cfg.replace(public=named)


def selection_groups(public: PublicInputs, cfg: JobConfig) -> tuple[np.ndarray, np.ndarray]:
    """(centroids, each public image's group) of the job's semantic selection: k-means of the public set
    from the job's PUBLIC seed (``mechanisms.selection.public_groups``), the same in every job. Public:
    costs nothing."""
    if public.data is None:
        raise ConfigError("[public] selection needs the public set: give --public PATH")
    return public_groups(public.data.images, cfg.public.selection_groups, cfg.job.seed)


def selected(public: PublicInputs, cfg: JobConfig, histogram: np.ndarray, groups: np.ndarray) -> PublicInputs:
    """``public`` cut to the groups the released (noisy, summed over the sites) ``histogram`` ranks highest,
    at least ``[public] selection_keep`` of it (``select_groups``). Post-processing: it reads the released
    histogram and public values only, never a private image: pretraining on the result costs nothing more."""
    assert public.data is not None
    keep = select_groups(histogram, groups, cfg.public.selection_keep)
    return PublicInputs(public.data.subset(keep), public.description, public.pretrained)


def mapped_labels(
    public: ImageDataset, private_names: tuple[str, ...], label_map: tuple[str, ...]
) -> np.ndarray:
    """Each public image's private class index, or ``len(private_names)`` (the null label) when its class maps
    onto none: by ``label_map`` ("public=private") first, then by equal name."""
    index = {name: i for i, name in enumerate(private_names)}
    pairs = dict(p.split("=", 1) for p in label_map)
    unknown = sorted(v for v in pairs.values() if v not in index)
    if unknown:
        raise ConfigError(
            f"[public] label_map names private class(es) {unknown}, not among {list(private_names)}"
        )
    null = len(private_names)
    table = np.array([index.get(pairs.get(c, c), null) for c in public.class_names], dtype=np.int64)
    return table[public.labels]


def _batches(
    x: torch.Tensor, y: torch.Tensor, batch: int, gen: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:  # endless shuffled epochs of the public set
        for part in torch.randperm(len(y), generator=gen).split(batch):
            yield x[part], y[part]


def pretrain(
    model: EDMDenoiser,
    public: ImageDataset,
    class_names: tuple[str, ...],
    cfg: JobConfig,
    progress: Progress | None = None,
) -> WarmupResult:
    """Train ``model`` in place on the public set (ordinary Adam on the EDM loss, EMA weights copied in at the
    end), its labels mapped onto the private classes (:func:`mapped_labels`). Both drivers' one
    pretraining."""
    pb = cfg.public
    x = torch.from_numpy(np.ascontiguousarray(public.images, np.float32)) * 2 - 1
    y = torch.from_numpy(mapped_labels(public, class_names, pb.label_map))
    batches = _batches(x, y, min(pb.pretrain_batch, len(y)), public_generator(cfg, "pretrain-batches"))
    return train_denoiser(
        model,
        batches,
        pb.pretrain_iterations,
        stage="pretrain",
        lr=pb.pretrain_lr,
        ema_decay=cfg.warmup.ema,
        label_dropout=cfg.model.label_dropout,
        generator=public_generator(cfg, "pretrain"),
        progress=progress,
    )


def load_pretrained(
    model: EDMDenoiser, path: Path, cfg: JobConfig, image_shape: tuple[int, int, int], n_classes: int
) -> None:
    """Load a pretrained model file into ``model`` after checking its hash is the job's and its architecture
    this job's (weights only: ``read_model_file``)."""
    if sha256_file(path) != cfg.public.pretrained_sha256:
        raise DataError(
            f"{path}: its sha256 is not the job's [public] pretrained_sha256; give the file the job names"
        )
    doc = read_model_file(path)
    if doc["spec"] != denoiser_spec(cfg.model, image_shape, n_classes):
        raise ConfigError(
            f"{path}: a model of another architecture or class count than this job's [model]; "
            "pretrain with this job's [model] section"
        )
    model.load_state_dict(doc["state_dict"])


def public_start(
    model: EDMDenoiser,
    public: PublicInputs,
    cfg: JobConfig,
    image_shape: tuple[int, int, int],
    class_names: tuple[str, ...],
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The denoiser's PUBLIC start: the pretrained file's weights (when the job names one),
    then ``[public] pretrain_iterations`` steps on the public set (when it names one). Returns what was
    done."""
    info: dict[str, Any] = {"pretrained_sha256": cfg.public.pretrained_sha256}
    if public.pretrained is not None:
        load_pretrained(model, public.pretrained, cfg, image_shape, len(class_names))
    if public.data is not None and cfg.public.pretrain_iterations > 0:
        res = pretrain(model, public.data, class_names, cfg, progress=progress)
        info.update(final_loss=res.final_loss, steps=res.steps)
    return info
