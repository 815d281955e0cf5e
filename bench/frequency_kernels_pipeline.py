"""Probe: the whole pipeline (bench/eval_protocol.py) with the frequency statistic swapped for a probe feature map.

    python bench/frequency_kernels_pipeline.py --map patch7s3:32 -- --mode validation --preset cpu-eps10-nodpsgd \
        --seeds 0 --threads 1 --lean --tag p7s3 --set frequency.features=2048 --out runs/fkp

Exploration only (validation mode): the release's and the aux fit's feature map are both replaced by
``frequency_kernels_probe.FeatureMap`` (unit-norm rows, so the release's sensitivity and epsilon are those of the
shipped map at the same sigma); ``frequency.features`` must be set to the map's total dimension.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--map", required=True)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    import eval_protocol
    from frequency_kernels_probe import FeatureMap

    from feta_release.data import load_embedded
    from feta_release.mechanisms import frequency as mechfreq
    from feta_release.training import frequency as trainfreq

    fmap = FeatureMap(args.map, load_embedded().image_shape)

    def embedding_sum(images, labels, n_classes, omega, chunk=512):
        total = torch.zeros((fmap(torch.zeros(1, *images.shape[1:])).shape[1], n_classes), dtype=torch.float64)
        with torch.no_grad():
            for i in range(0, len(images), chunk):
                phi = fmap(torch.from_numpy(np.ascontiguousarray(images[i:i + chunk], dtype=np.float32))).double()
                oh = torch.nn.functional.one_hot(torch.from_numpy(labels[i:i + chunk]), n_classes).double()
                total += phi.T @ oh
        return total.numpy()

    mechfreq.embedding_sum = embedding_sum
    trainfreq.rff_features = lambda x, _w: fmap(x)
    sys.argv = ["eval_protocol.py"] + [a for a in args.rest if a != "--"]
    eval_protocol.main()


if __name__ == "__main__":
    main()
