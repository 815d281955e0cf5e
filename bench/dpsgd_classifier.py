"""The anchor a synthetic release should approach: a CNN trained DIRECTLY on the private data with DP-SGD
(Opacus).

A synthetic release at (ε, δ) is worth its cost when a classifier trained on it gets close to a classifier
trained on the real data at the same (ε, δ) with DP-SGD: this script trains that classifier, with Opacus (an
implementation independent of the project's own DP-SGD engine), and scores it on real held-out images.

- ``PrivacyEngine(accountant="rdp").make_private_with_epsilon``: the noise multiplier is calibrated by
  Opacus's RDP accountant for the target ε at δ over the planned epochs; Poisson sampling (each example joins
  each batch independently with probability q = batch / N), which is the sampling the RDP analysis assumes.
- Per-example gradients clipped to L2 norm ``clip`` (sensitivity of the summed gradient: ``clip``, one example
  added or removed), Gaussian noise of std ``noise_multiplier * clip`` added to the sum.
- The model is a small CNN with GroupNorm, not BatchNorm: BatchNorm normalises each example with statistics of
  the whole batch, so one example's gradient depends on the others (no per-example sensitivity to clip, and
  the running statistics would leak the batch without noise); Opacus refuses it. GroupNorm normalises each
  example over groups of its own channels, so per-example gradients are well defined and clipping bounds each
  example's influence.

Run alone (one figure, JSON on stdout):

    python bench/dpsgd_classifier.py --data embedded --epsilon 1 --seed 0
    python bench/dpsgd_classifier.py --data medical --n 4000 --epsilon 10
    python bench/dpsgd_classifier.py --data medical --n 4000 --epsilon 10 --mode validation   # for tuning

``--n`` is the size of the TRAINING part (the protocol's train split, 80 % of the generated set); the figure
is the accuracy on the protocol's held-out part (``--mode test``) or on the validation part inside train
(``--mode validation``), feta_release/eval_protocol.py.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from feta_release.data import ImageDataset

DEFAULT_EPOCHS = 10
DEFAULT_BATCH = 256
DEFAULT_CLIP = 1.0
DEFAULT_LR = 2e-3


class GroupNormCNN(nn.Module):
    """Conv 16/32/32 (3x3, GroupNorm(4), ReLU, 2x2 max-pool after the first two) -> mean and max pooling ->
    logits.

    Small on purpose: DP-SGD noise grows with the number of parameters it perturbs, and on 2 CPU cores the
    cost of a step is the model's own (Opacus's per-example hooks add ~10 %)."""

    def __init__(self, in_channels: int, n_classes: int, width: int = 16) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.ReLU()]

        self.body = nn.Sequential(
            *block(in_channels, width),
            nn.MaxPool2d(2),
            *block(width, 2 * width),
            nn.MaxPool2d(2),
            *block(2 * width, 2 * width),
        )
        self.head = nn.Linear(4 * width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x * 2.0 - 1.0)
        return self.head(torch.cat([h.mean((2, 3)), h.amax((2, 3))], dim=1))


@dataclass
class DpsgdResult:
    accuracy: float  # on the real evaluation images
    epsilon: float  # Opacus's RDP accountant after the steps actually taken
    target_epsilon: float
    delta: float
    noise_multiplier: float
    sampling_rate: float
    steps: int
    epochs: int
    n_train: int
    seconds: float


def expected_batch(n: int, batch: int = DEFAULT_BATCH) -> int:
    """The expected Poisson batch: ``batch``, but at most a quarter of the data (q <= 0.25 on small sets,
    where a huge q would leave few steps and little privacy amplification)."""
    return max(1, min(batch, n // 4))


def train_dpsgd(
    train: ImageDataset,
    *,
    epsilon: float,
    delta: float,
    epochs: int = DEFAULT_EPOCHS,
    batch: int = DEFAULT_BATCH,
    clip: float = DEFAULT_CLIP,
    lr: float = DEFAULT_LR,
    seed: int = 0,
) -> tuple[nn.Module, dict]:
    """A ``GroupNormCNN`` trained on ``train`` with DP-SGD at (``epsilon``, ``delta``); (model in eval mode,
    accounting: epsilon spent, noise multiplier, sampling rate, steps)."""
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    data = torch.utils.data.TensorDataset(torch.from_numpy(train.images), torch.from_numpy(train.labels))
    loader = torch.utils.data.DataLoader(data, batch_size=expected_batch(train.n, batch), shuffle=True)
    model = GroupNormCNN(train.image_shape[0], train.n_classes)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    engine = PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():  # Opacus warns that secure_mode is off: a benchmark, not a release
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private_with_epsilon(
            module=model,
            optimizer=opt,
            data_loader=loader,
            target_epsilon=epsilon,
            target_delta=delta,
            epochs=epochs,
            max_grad_norm=clip,
            poisson_sampling=True,
        )
    steps = 0
    model.train()
    # torch's note on full backward hooks without input gradients: expected here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(epochs):
            for xb, yb in loader:
                opt.zero_grad(set_to_none=True)
                if len(xb):  # Poisson sampling may draw an empty batch: the step still adds noise (opt.step)
                    nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
                steps += 1
    info = {
        "epsilon": float(engine.get_epsilon(delta)),
        "noise_multiplier": float(opt.noise_multiplier),
        "sampling_rate": float(getattr(loader, "sample_rate", 1.0 / len(loader))),
        "steps": steps,
    }
    return model.eval(), info


@torch.no_grad()
def accuracy(model: nn.Module, test: ImageDataset, batch: int = 500) -> float:
    hits = 0
    for i in range(0, test.n, batch):
        pred = model(torch.from_numpy(test.images[i : i + batch])).argmax(1).numpy()
        hits += int((pred == test.labels[i : i + batch]).sum())
    return hits / test.n


def dpsgd_anchor(
    train: ImageDataset,
    test: ImageDataset,
    *,
    epsilon: float,
    delta: float,
    seed: int = 0,
    epochs: int = DEFAULT_EPOCHS,
    batch: int = DEFAULT_BATCH,
    clip: float = DEFAULT_CLIP,
    lr: float = DEFAULT_LR,
) -> DpsgdResult:
    """Train on ``train`` with DP-SGD at (ε, δ) and score on ``test``."""
    t0 = time.perf_counter()
    model, info = train_dpsgd(
        train, epsilon=epsilon, delta=delta, epochs=epochs, batch=batch, clip=clip, lr=lr, seed=seed
    )
    return DpsgdResult(
        accuracy=accuracy(model, test),
        target_epsilon=epsilon,
        delta=delta,
        epochs=epochs,
        n_train=train.n,
        seconds=round(time.perf_counter() - t0, 1),
        **info,
    )


def load_kind(kind: str, n_train: int, data_seed: int = 0, size: int | None = None) -> ImageDataset:
    """The labelled set whose protocol train split holds ``n_train`` images: ``embedded`` (a stratified subset
    of the 5,000 shipped digits; at most 4,000 for training), ``medical`` or ``rgb`` (generated, seed
    ``data_seed``)."""
    from feta_release.data import load_embedded
    from feta_release.data.procedural import generate_dataset
    from feta_release.errors import ConfigError
    from feta_release.eval_protocol import PROTOCOL

    total = math.ceil(n_train / (1.0 - PROTOCOL.heldout_fraction))
    if kind in ("embedded", "digits"):
        ds = load_embedded()
        if total > ds.n:
            raise ConfigError(
                f"the embedded digits hold {ds.n} images: at most "
                f"{int(ds.n * (1 - PROTOCOL.heldout_fraction))} for training, not {n_train}"
            )
        if total < ds.n:
            keep = np.concatenate(
                [
                    np.random.default_rng(data_seed).permutation(np.flatnonzero(ds.labels == c))[
                        : total // ds.n_classes + (c < total % ds.n_classes)
                    ]
                    for c in range(ds.n_classes)
                ]
            )
            ds = ds.subset(np.sort(keep), source=f"{ds.source} [{total} of {ds.n}, seed {data_seed}]")
        return ds
    return generate_dataset(kind, total, size=size, seed=data_seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="embedded", choices=["embedded", "medical", "rgb"])
    ap.add_argument("--n", type=int, default=4000, help="training images (the protocol's train part)")
    ap.add_argument("--size", type=int, default=None, help="side of generated images (default: the kind's)")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=None, help="default: the project's job default (1e-5)")
    ap.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="expected Poisson batch (at most n / 4)")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--clip", type=float, default=DEFAULT_CLIP)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=["test", "validation"], default="test")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from feta_release.config import PrivacySection
    from feta_release.eval_protocol import protocol_splits

    torch.set_num_threads(args.threads)
    train, test = protocol_splits(load_kind(args.data, args.n, size=args.size), args.mode)
    delta = args.delta if args.delta is not None else PrivacySection().delta
    res = dpsgd_anchor(
        train,
        test,
        epsilon=args.epsilon,
        delta=delta,
        seed=args.seed,
        epochs=args.epochs,
        batch=args.batch,
        clip=args.clip,
        lr=args.lr,
    )
    print(json.dumps({"data": args.data, "mode": args.mode, **asdict(res)}))


if __name__ == "__main__":
    main()
