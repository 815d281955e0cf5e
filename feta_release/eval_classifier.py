"""The evaluation classifier: a small ResNet that keeps local evidence, trained to convergence with early
stopping.

Why this network: a finding in a medical image can be a few pixels at any place. A classifier that averages
its last feature map (globally or to a coarse grid) dilutes such a finding among the background. On the test
set of ``tests/support/finding_images.py`` (48x48 noisy textures, 600 training images, one class differing
from "normal" only by a 2x2 bright spot at a random place) the former evaluation CNN (3x3 average pooling of
its last map) scored 67 % on the finding class and 33 % on normal; this network 100 % and 92 %. So the head
sees the global MAX (is the evidence anywhere?) concatenated with the global MEAN (overall texture, intensity)
of the last stage.

Architecture (adapts to the image): a 3x3 conv-BN-ReLU stem at full resolution (cheap: 1 or 3 input channels),
then 2x2 max-pools (each but the last followed by a conv-BN-ReLU) until the side is below 24 px (28 -> 14,
64 -> 16, 128 -> 16): max pooling keeps a bright pixel's evidence and makes the network cheap enough for the
CPU. Then three BasicBlock stages (conv-BN-ReLU-conv-BN plus a shortcut) of width w, 2w, 4w at strides 1, 2, 2
(last map 3..6 px a side). w = 16 up to 10 classes, 24 up to 30, 32 beyond, so 100 classes get a 256-d pooled
feature.

Training (DPImageBench's rule: nothing is chosen on the test set): a stratified 10 % validation part of the
TRAINING images, checked every ~``CHECK_STEPS`` optimizer steps (whole epochs); AdamW; after a warm-up of
``WARMUP_STEPS`` steps, the learning rate is cut 5x whenever the validation loss has not improved for
``PATIENCE`` checks; after ``LR_CUTS`` cuts one more plateau means converged and training stops; the weights
with the lowest validation loss are returned. Augmentation: random translations of up to ~1/14 of the side
(reflection padding, so no artificial black border); no flips, since laterality matters in medical images.
``max_epochs`` caps the epochs (default: enough for ~2,500 optimizer steps, between 20 and 150 epochs); a run
that hits the cap while still improving is reported as not converged.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from .data import ImageDataset
from .errors import DataError
from .training.progress import Reporter

DEFAULT_LR = 2e-3
DEFAULT_BATCH = 64
WEIGHT_DECAY = 0.05  # AdamW (decoupled); 5e-4 let 540 images be memorised (normal vs finding 48 %)
VALIDATION_FRACTION = 0.1
MIN_VALIDATION = 20  # fewer validation images than this: no early stopping (train the cap), said in the log
# the validation loss is checked every ~this many optimizer steps (whole epochs, at least one)
CHECK_STEPS = 60
PATIENCE = 3  # checks without a better validation loss before the learning rate is cut
LR_CUTS = 2  # cuts (x 0.2 each) before a further plateau counts as converged
MIN_IMPROVEMENT = 1e-3  # relative decrease of the validation loss that counts as an improvement
# No plateau counts before this many steps: a class told apart by a small finding can sit at chance for a few
# hundred steps before its loss starts to fall (measured on 48x48 images, 540 training images).
WARMUP_STEPS = 300
TARGET_STEPS = 2500  # the automatic epoch cap gives roughly this many optimizer steps


class _Block(nn.Module):
    """BasicBlock: 3x3 conv-BN-ReLU-3x3 conv-BN, plus an identity (or 1x1 conv-BN) shortcut, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def classifier_plan(image_shape: tuple[int, int, int], n_classes: int) -> tuple[int, int]:
    """(base width w, number of 2x2 max-pools before the stages) for images (C, H, W) and ``n_classes``: halve
    until the side is below 24 px (28 -> 14, 64 -> 16, 128 -> 16)."""
    _, h, w = image_shape
    pools, side = 0, min(h, w)
    while side >= 24:
        pools, side = pools + 1, side // 2
    width = 16 if n_classes <= 10 else 24 if n_classes <= 30 else 32
    return width, pools


def _conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class ResNetClassifier(nn.Module):
    """Stem, three BasicBlock stages, global max + mean pooling (concatenated), linear head; images in [0,
    1]."""

    def __init__(self, in_channels: int, n_classes: int, image_hw: tuple[int, int] = (28, 28)) -> None:
        super().__init__()
        width, pools = classifier_plan((in_channels, *image_hw), n_classes)
        stem = _conv_bn_relu(in_channels, width)
        for i in range(pools):  # max-pool (keeps a bright pixel's evidence), then a conv at the new scale
            stem.append(nn.MaxPool2d(2))
            if i < pools - 1:
                stem += _conv_bn_relu(width, width)
        self.stem = nn.Sequential(*stem)
        self.stages = nn.Sequential(
            _Block(width, width, 1), _Block(width, 2 * width, 2), _Block(2 * width, 4 * width, 2)
        )
        self.feature_dim = 8 * width  # max and mean of 4w channels
        self.head = nn.Linear(self.feature_dim, n_classes)
        self.fit_log: FitLog | None = None  # set by train_classifier

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled features (B, 8w): global max then global mean of the last stage's channels."""
        z = self.stages(self.stem(x * 2.0 - 1.0))
        return torch.cat([z.amax(dim=(2, 3)), z.mean(dim=(2, 3))], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@dataclass
class FitLog:
    """How one classifier was trained: what stopped it and the validation curve it was stopped on."""

    epochs: int  # epochs run
    max_epochs: int
    best_epoch: int  # epoch whose weights were kept (1-based; = epochs when there is no validation part)
    stopped: str  # "converged" | "max_epochs" (cap hit while still improving) | "no_validation"
    n_train: int
    n_validation: int
    validation_loss: list[float] = field(default_factory=list)
    validation_accuracy: list[float] = field(default_factory=list)

    @property
    def converged(self) -> bool:
        return self.stopped == "converged"

    def to_dict(self) -> dict:
        return asdict(self)


def validation_split(labels: np.ndarray, n_classes: int, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of a stratified validation part: per class round(fraction * n_c) images, at least 1 for a
    class with >= 2 images (a class with 0 or 1 image keeps all of it for training)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(labels), dtype=bool)
    for c in range(n_classes):
        idx = np.flatnonzero(labels == c)
        if len(idx) >= 2:
            k = min(max(int(round(fraction * len(idx))), 1), len(idx) - 1)
            mask[rng.permutation(idx)[:k]] = True
    return mask


def auto_max_epochs(n_train: int, batch_size: int) -> int:
    """Epoch cap giving about ``TARGET_STEPS`` optimizer steps, within [20, 150]."""
    steps = max(1, math.ceil(n_train / batch_size))
    return int(min(150, max(20, math.ceil(TARGET_STEPS / steps))))


def random_shift(x: torch.Tensor, max_shift: int, rng: np.random.Generator) -> torch.Tensor:
    """Each image translated by an independent integer offset in [-max_shift, max_shift]^2 (reflection
    fill)."""
    if max_shift < 1:
        return x
    n, _, h, w = x.shape
    pad = nn.functional.pad(x, (max_shift,) * 4, mode="reflect")
    off = rng.integers(0, 2 * max_shift + 1, size=(n, 2))
    return torch.stack([pad[i, :, a : a + h, b : b + w] for i, (a, b) in enumerate(off)])


def max_shift_for(h: int, w: int) -> int:
    """Translation range of the augmentation: ~1/14 of the side (2 px at 28, 4 px at 64), at least 1."""
    return max(1, round(min(h, w) / 14))


def _check_trainable(ds: ImageDataset, epochs: int | None) -> None:
    if ds.n == 0:
        raise DataError(f"{ds.source}: cannot train a classifier on 0 images")
    if epochs is not None and epochs < 1:
        raise DataError(f"classifier epochs must be >= 1, not {epochs}")
    _, h, w = ds.image_shape
    if min(h, w) < 8:
        raise DataError(
            f"{ds.source}: images of {h}x{w} are too small for the evaluation classifier (min 8x8)"
        )


def _validation_scores(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``net`` in eval mode on (x, y)."""
    net.eval()
    # a block, not torch's decorator (mypy saw the decorated function as Any); no_grad, not inference mode:
    # the net trains on after each epoch's scores
    with torch.no_grad():
        logits = torch.cat([net(x[i : i + 500]) for i in range(0, len(x), 500)])
        return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


def _train_epoch(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    shift: int,
    rng: np.random.Generator,
) -> None:
    net.train()
    order = torch.from_numpy(rng.permutation(len(x))).to(x.device)
    for start in range(0, len(x), batch_size):
        idx = order[start : start + batch_size]
        loss = nn.functional.cross_entropy(net(random_shift(x[idx], shift, rng)), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


class _Plateau:
    """Early stopping with learning-rate cuts on the validation loss; remembers the best weights."""

    def __init__(self, net: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.net, self.opt = net, opt
        self.best = math.inf
        self.best_epoch = 0
        self.best_state = copy.deepcopy(net.state_dict())
        self.bad = 0
        self.cuts = 0

    def step(self, epoch: int, loss: float, counting: bool) -> bool:
        """Record one check's validation loss; True when training has converged. ``counting``: False during
        the warm-up (the best weights are still kept, plateaus are not counted)."""
        if loss < self.best * (1.0 - MIN_IMPROVEMENT):
            self.best, self.best_epoch, self.bad = loss, epoch, 0
            self.best_state = copy.deepcopy(self.net.state_dict())
            return False
        self.bad += counting
        if self.bad < PATIENCE:
            return False
        if self.cuts >= LR_CUTS:
            return True
        self.cuts, self.bad = self.cuts + 1, 0
        for g in self.opt.param_groups:
            g["lr"] *= 0.2
        return False


def train_classifier(
    ds: ImageDataset,
    epochs: int | None = None,
    seed: int = 0,
    *,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    augment: bool = True,
    reporter: Reporter | None = None,
    what: str = "classifier",
    device: str = "cpu",
) -> ResNetClassifier:
    """Train a :class:`ResNetClassifier` on ``ds`` with early stopping on a stratified 10 % validation part of
    ``ds`` itself; deterministic given ``seed`` (on one device). ``epochs``: the epoch cap (None:
    :func:`auto_max_epochs`).

    ``augment``: random translations (:func:`random_shift`, :func:`max_shift_for`). ``device``: where it
    trains ("cpu", "cuda"); the network is returned on the CPU either way. The returned network (eval mode)
    carries ``fit_log`` (:class:`FitLog`). Leaves the global torch RNG (of the CPU and of ``device``) as it
    found it.
    """
    _check_trainable(ds, epochs)
    c, h, w = ds.image_shape
    val = validation_split(ds.labels, ds.n_classes, VALIDATION_FRACTION, seed)
    if val.sum() < MIN_VALIDATION:
        val[:] = False
    dev = torch.device(device)
    data = tuple(
        torch.from_numpy(a).to(dev)
        for a in (ds.images[~val], ds.labels[~val], ds.images[val], ds.labels[val])
    )
    cap = epochs if epochs is not None else auto_max_epochs(len(data[0]), batch_size)
    log = FitLog(
        epochs=0,
        max_epochs=cap,
        best_epoch=0,
        stopped="max_epochs",
        n_train=len(data[0]),
        n_validation=len(data[2]),
    )
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        net = ResNetClassifier(c, ds.n_classes, (h, w)).to(dev)
        best_state = _fit(
            net,
            data,
            log,
            batch_size=batch_size,
            lr=lr,
            shift=max_shift_for(h, w) if augment else 0,
            rng=np.random.default_rng(seed),
            reporter=reporter or Reporter(enabled=False),
            what=f"{what} ({ds.n:,} images)",
        )
    if best_state is not None:
        net.load_state_dict(best_state)
    net = net.cpu()
    net.fit_log = log
    return net.eval()


def _fit(
    net: ResNetClassifier,
    data: tuple[torch.Tensor, ...],
    log: FitLog,
    *,
    batch_size: int,
    lr: float,
    shift: int,
    rng: np.random.Generator,
    reporter: Reporter,
    what: str,
) -> dict | None:
    """The training loop; fills ``log``; returns the best weights (None without a validation part)."""
    x_tr, y_tr, x_va, y_va = data
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    plateau = _Plateau(net, opt)
    steps_per_epoch = math.ceil(len(x_tr) / batch_size)
    every = max(1, round(CHECK_STEPS / steps_per_epoch))  # epochs between validation checks
    with reporter.task(what, log.max_epochs) as advance:
        for epoch in range(1, log.max_epochs + 1):
            _train_epoch(net, opt, x_tr, y_tr, batch_size, shift, rng)
            log.epochs = epoch
            if not len(x_va) or (epoch % every and epoch < log.max_epochs):
                advance(1)
                continue
            loss, acc = _validation_scores(net, x_va, y_va)
            log.validation_loss.append(loss)
            log.validation_accuracy.append(acc)
            advance(1, info=f"validation accuracy {acc:.1%}, loss {loss:.3f}")
            if plateau.step(epoch, loss, counting=epoch * steps_per_epoch >= WARMUP_STEPS):
                log.stopped = "converged"
                break
    if not len(x_va):
        log.stopped, log.best_epoch = "no_validation", log.epochs
        return None
    log.best_epoch = plateau.best_epoch
    return plateau.best_state
