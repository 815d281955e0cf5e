"""``feta-release demo --public``: the public set the demo's coordinator pretrains on before its model learns
from the sites' releases (docs/explanation/public-pretraining.md).

``strokes[:N]`` generates N pen-stroke images offline with the generator of ``data generate strokes``
(``data.procedural``: no digit set is their source, so the pretraining is unconditional) into OUT/public/;
``PATH`` is an existing set in any layout the loaders read. Either is read back through the private data's
loader at the job's ``[job]`` load options (as ``coordinator run --public`` reads it) and must come out at the
digits' image shape. Only the coordinator reads it: the signed job names it by sha256, count, shape and
description, it costs no epsilon and no site receives an image of it.

Off by default: pretraining on 10,000 strokes did not raise the digits' accuracy at epsilon 1 (0.714 with,
0.773 without, one seed; the measurement in the document above).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feta_release.config import JobConfig
from feta_release.data.dataset import ImageDataset
from feta_release.data.loading import LoadOptions
from feta_release.data.procedural import checked_size, generate_dataset, write_dataset
from feta_release.data.public import public_record, read_public
from feta_release.errors import ConfigError, DataError
from feta_release.job_rules import DataFacts, PublicFacts, public_facts, public_section
from feta_release.ledger_chain import make_private_dirs

STROKES = "strokes"
STROKES_N = 10_000  # the size the digits' measurement pretrained on
STROKES_N_QUICK = 200
STROKES_SEED = 7  # the measurement's seed: the same images
QUICK_PRETRAINING = {"pretrain_iterations": 5, "pretrain_batch": 16}  # a smoke run: minutes, not quality


@dataclass(frozen=True)
class DemoPublic:
    """The demo's public set: where the coordinator reads it, what the job calls it, and the images."""

    path: Path
    description: str
    data: ImageDataset

    @property
    def facts(self) -> PublicFacts:
        return public_facts(self.data)

    def record(self) -> dict[str, Any]:
        """How the signed job names it (``[public]``: sha256, count, shape, classes, description)."""
        return public_record(self.data, self.description)

    def words(self) -> str:
        """The demo's closing line on it: what it is (description, count, sha256 prefix) and what it cost."""
        c, h, w = self.data.image_shape
        return (
            f"public pretraining on {self.data.n} images {c}x{h}x{w} ({self.description}), sha256 "
            f"{self.data.fingerprint()[:16]}…: read by the coordinator only, it cost no epsilon (in no "
            "site's ledger) and no site received an image of it"
        )


def strokes_count(spec: str, quick: bool) -> int | None:
    """N of ``strokes[:N]`` (the default: the measured 10,000, or a few hundred with --quick); None: a
    path."""
    name, colon, n = spec.partition(":")
    if name != STROKES:
        return None
    if not colon:
        return STROKES_N_QUICK if quick else STROKES_N
    if not n.isdigit() or int(n) < 1:
        raise ConfigError(
            f"--public {spec}: N in strokes:N must be a whole number of images >= 1, e.g. strokes:10000"
        )
    return int(n)


def demo_public(
    spec: str | None,
    description: str,
    out_dir: Path,
    cfg: JobConfig,
    shape: tuple[int, int, int],
    quick: bool,
) -> DemoPublic | None:
    """The public set ``--public spec`` names, read as the coordinator will read it and refused in one line
    (naming the file, what is wrong and the fix) when it cannot be read or is not of the private ``shape``.
    A PATH is checked before anything is written; generated strokes go to OUT/public/."""
    if spec is None:
        if description:
            raise ConfigError("--public-description describes a --public set: give --public too")
        return None
    n = strokes_count(spec, quick)
    if n is not None:
        checked_size(STROKES, n, shape[-1], "A")
        ds = generate_dataset(STROKES, n, size=shape[-1], seed=STROKES_SEED)
        make_private_dirs(out_dir)  # the run's folder, for this account only (coordinator.demo)
        path = write_dataset(ds, out_dir / "public" / f"strokes-{n}.npz")
        description = description or (
            f"{n} generated pen strokes, `feta-release data generate strokes --n {n} --size {shape[-1]} "
            f"--seed {STROKES_SEED}`; no digit set is their source"
        )
    else:
        path = Path(spec)
        if not path.exists():
            raise DataError(
                f"{path}: no such file or folder; give --public an image set (folder, labels .csv or "
                ".npz) or strokes[:N] to generate pen strokes"
            )
        description = description or f"public image set {path.name}"
    opts = LoadOptions(resize=cfg.job.resize, image_size=cfg.job.image_size, window=cfg.job.window)
    try:
        data = read_public(path, opts, opts.image_size)
    except DataError as exc:  # the loader names the file and what is wrong; the fix for this option:
        raise DataError(
            f"{exc}; give --public a readable image set (folder, labels .csv or .npz) or strokes[:N]"
        ) from None
    if tuple(data.image_shape) != tuple(shape):
        raise DataError(
            f"{path}: public images are {list(data.image_shape)} (C, H, W), the demo's digits "
            f"{list(shape)}; give a set of {shape[0]}x{shape[1]}x{shape[2]} images (or --public strokes:N)"
        )
    public = DemoPublic(path, description, data)
    public.record()  # a description over the limit: refused here, before any process starts
    return public


def pretraining(public: PublicFacts, size: int, epsilon: float, quick: bool) -> dict[str, Any]:
    """The job's ``[public]`` pretraining settings, as the derived job of ``train --public`` sets them, for
    the federation's summed public ``size`` (``job_rules.public_section``: about 20 passes over the set,
    200..4,000 steps of 64); --quick: a few steps."""
    if quick:
        return dict(QUICK_PRETRAINING)
    c, h, w = public.shape
    facts = DataFacts(
        size=size,
        height=h,
        width=w,
        channels=c,
        n_classes=max(1, len(public.class_names)),  # not read by the pretraining rule
        epsilon=epsilon,
        federated=True,
        public=public,
    )
    return public_section(facts)
