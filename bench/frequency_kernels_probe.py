"""Which frequency statistic carries the most signal at the same epsilon? Aux-only accuracy per feature map (validation).

    python bench/frequency_kernels_probe.py --sigma 1.1 --seeds 0,1 \
        --maps "rff:500;patch7s7:64;patch7s3:32" --out bench/results/e10-kernels.json

A probe for issue 15 at epsilon = 10 (docs/evaluation.md): four sessions of levers on the pixel-RFF statistic
(features, bandwidth, aux fit, budget) sit within +-0.01. Here the statistic itself changes. Every map gives each
image a feature vector of norm EXACTLY 1 (so the release E + N(0, (sigma/N)^2) keeps L2 sensitivity 1/N and the same
epsilon as the shipped release at the same sigma):

- ``rff:F``: the shipped map, [cos, sin](x W) / sqrt(F/2) on all pixels (Gaussian kernel, bandwidth2 105).
- ``patchKsS:F``: the image cut into KxK patches at stride S (P positions); each patch gets its own F random
  Fourier features (one public W shared by all positions, bandwidth2 scaled to the patch: 105 K^2 / 784); the P
  blocks are concatenated and scaled by 1/sqrt(P). Its kernel is the MEAN over positions of a Gaussian kernel on
  each patch: two images are close when they are close locally, everywhere, which a single Gaussian on 784 pixels
  (where most digits are about equally far apart) does not say.
- ``mixKsS:F``: half the weight on the pixel map (500 features), half on the patch map.

For each map and seed: release on the validation fit part (3,200 images) at ``--sigma``, fit the aux generator
exactly as the preset does (``fit_aux_generator``, [auxgen] of cpu-eps10-nodpsgd) to it, train the protocol
classifier on ``--n`` of its images alone and score it on the validation part. The held-out part is never loaded.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time

import numpy as np
import torch

PIXEL_BW2 = 105.0


def _omega(dim: int, half: int, bw2: float, seed: int) -> torch.Tensor:
    gen = np.random.Generator(np.random.PCG64(seed))
    return torch.from_numpy((gen.standard_normal((dim, half)) / math.sqrt(bw2)).astype(np.float32))


def _omega_orthogonal(dim: int, half: int, bw2: float, seed: int) -> torch.Tensor:
    """Orthogonal random features (Yu et al. 2016): columns orthonormal within each block of ``dim``, each scaled by
    a chi(dim) norm, so every column is marginally N(0, I / bw2) as in ``_omega``, with a lower-variance kernel."""
    gen = np.random.Generator(np.random.PCG64(seed))
    blocks = []
    for _ in range(-(-half // dim)):
        q, r = np.linalg.qr(gen.standard_normal((dim, dim)))
        q = q * np.sign(np.diag(r))  # Haar-distributed
        blocks.append(q * np.sqrt(gen.chisquare(dim, size=dim)))
    return torch.from_numpy((np.concatenate(blocks, axis=1)[:, :half] / math.sqrt(bw2)).astype(np.float32))


def _rff(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    p = x @ w
    return torch.cat([torch.cos(p), torch.sin(p)], dim=-1) / math.sqrt(w.shape[1])


class FeatureMap:
    """``spec`` -> x (B, C, H, W) in [0, 1] -> (B, features), every row of norm 1."""

    def __init__(self, spec: str, shape: tuple[int, int, int], seed: int = 1234, bw_scale: float = 1.0) -> None:
        kind, _, f = spec.partition(":")
        draw = _omega
        if kind.startswith("o"):  # orthogonal frequencies for the same kernel
            kind, draw = kind[1:], _omega_orthogonal
        self.spec, self.features_per_block = spec, int(f)
        c, h, w = shape
        self.shape = shape
        m = re.fullmatch(r"(rff|patch|mix)(?:(\d+)s(\d+))?", kind)
        if m is None:
            raise SystemExit(f"unknown map {spec!r}")
        self.kind = m.group(1)
        self.w_pix = _omega(c * h * w, 250 if self.kind == "mix" else int(f) // 2, PIXEL_BW2, seed)
        if self.kind in ("patch", "mix"):
            self.k, self.s = int(m.group(2)), int(m.group(3))
            self.w_patch = draw(c * self.k * self.k, int(f) // 2, bw_scale * PIXEL_BW2 * self.k * self.k / (h * w),
                                  seed + 1)

    def _patches(self, x: torch.Tensor) -> torch.Tensor:
        cols = torch.nn.functional.unfold(x, self.k, stride=self.s)  # (B, C k k, P)
        phi = _rff(cols.transpose(1, 2), self.w_patch)  # (B, P, F): each block norm 1
        return phi.reshape(len(x), -1) / math.sqrt(cols.shape[2])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, *self.shape)
        if self.w_pix.device != x.device:  # the aux fit may run on a GPU (--device cuda)
            self.w_pix = self.w_pix.to(x.device)
            if self.kind != "rff":
                self.w_patch = self.w_patch.to(x.device)
        if self.kind == "rff":
            return _rff(x.reshape(len(x), -1), self.w_pix)
        if self.kind == "patch":
            return self._patches(x)
        return torch.cat([_rff(x.reshape(len(x), -1), self.w_pix), self._patches(x)], dim=1) / math.sqrt(2.0)


def release(fmap: FeatureMap, images: np.ndarray, labels: np.ndarray, k: int, sigma: float, seed: int) -> np.ndarray:
    """E + N(0, (sigma/N)^2): (features, k), N = the fit part's size (public in the real job)."""
    total = None
    with torch.no_grad():
        for i in range(0, len(images), 256):
            phi = fmap(torch.from_numpy(np.ascontiguousarray(images[i:i + 256], dtype=np.float32))).double()
            norms = phi.norm(dim=1)
            assert torch.allclose(norms, torch.ones_like(norms), atol=1e-4), "feature map must have unit norm"
            oh = torch.nn.functional.one_hot(torch.from_numpy(labels[i:i + 256]), k).double()
            part = phi.T @ oh
            total = part if total is None else total + part
    n = len(images)
    e = total.numpy() / n
    return (e + np.random.default_rng(5_000 + seed).normal(0.0, sigma / n, size=e.shape)).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--maps", required=True, help="spec;spec;...  (rff:F, patchKsS:F, mixKsS:F; prefix o: orthogonal)")
    ap.add_argument("--sigma", type=float, default=1.1)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--bw-scale", type=float, default=1.0, help="multiplies the patch bandwidth2")
    ap.add_argument("--preset", default="cpu-eps10-nodpsgd")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--grid", default="", help="save a grid of the first seed's aux images per map: PREFIX")
    ap.add_argument("--vary-omega", action="store_true", help="omega seed 1234 + 1000 * seed (public draw per seed)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from feta_release.config import load_preset
    from feta_release.data import ImageDataset, load_embedded
    from feta_release.eval_protocol import balanced_labels, mean_std, protocol_splits
    from feta_release.evaluation import accuracy, train_classifier
    from feta_release.training import frequency as trainfreq
    from feta_release.training.frequency import aux_draw, fit_aux_generator

    torch.set_num_threads(args.threads)
    job = load_preset(args.preset)
    fit, val = protocol_splits(load_embedded(), "validation")
    labels = np.asarray(balanced_labels(args.n, fit.n_classes))
    rows = []
    for spec in args.maps.split(";"):
        accs, t0 = [], time.perf_counter()
        for seed in (int(s) for s in args.seeds.split(",")):
            fmap = FeatureMap(spec, fit.image_shape, seed=1234 + 1000 * seed if args.vary_omega else 1234,
                              bw_scale=args.bw_scale)
            emb = release(fmap, fit.images, fit.labels, fit.n_classes, args.sigma, seed)
            dummy = torch.zeros((int(np.prod(fit.image_shape)), emb.shape[0] // 2))
            orig = trainfreq.rff_features
            trainfreq.rff_features = lambda x, _w, fmap=fmap: fmap(x)  # the fit loop matches the probe's own map
            try:
                gen = fit_aux_generator(emb, dummy, fit.image_shape, fit.n_classes, job, fit.n,
                                        generator=torch.Generator().manual_seed(300 + seed))
            finally:
                trainfreq.rff_features = orig
            x = aux_draw(gen, labels, torch.Generator().manual_seed(88 + seed))
            if args.grid and not accs:
                from feta_release.viz import save_grid
                save_grid(x.numpy(), labels, f"{args.grid}-{spec.replace(':', '-')}.png", title=spec)
            syn = ImageDataset(x.numpy(), labels, fit.class_names, source=spec)
            accs.append(accuracy(train_classifier(syn, 5, seed), val))
            print(json.dumps({"map": spec, "seed": seed, "aux_acc": round(accs[-1], 4)}), flush=True)
        m, s = mean_std(accs)
        rows.append({"map": spec, "features": int(emb.shape[0]), "sigma": args.sigma, "bw_scale": args.bw_scale,
                     "acc": [round(a, 4) for a in accs], "mean": round(m, 4), "std": round(s, 4),
                     "s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
