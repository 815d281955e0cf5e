"""The node's side of a FedSGD round over secure aggregation (``[federation] fedsgd``;
docs/secure-aggregation.md).

One round is ONE pooled DP-SGD step: the coordinator sends the global weights with the masking stage of the
round's secure sum (``query.secagg``, phase ``dpsgd``, the round named in the request); the site
Poisson-samples its images at the planned rate q = batch / n_public, takes each sampled image's gradient (the
same per-example loss and clipping as ``DPSGDTrainer``: ``training.dpsgd.batch_gradients`` /
``clipped_rows``), turns each clipped gradient into integers ONE RECORD AT A TIME (scale, conditional
randomized rounding: ``mechanisms.skellam.quantize_records``), sums them, adds its noise share Sk(mu / n) and
hands the vector to the mask (``edge.secure.masked_contribution``).

Sensitivity (add/remove one image of this site): one rounded record, L2 <= Delta2 = the event's ``l2`` and
L1 <= Delta1 = its ``l1`` (integer units): the round is the Poisson-subsampled Skellam event the protocol
charged before this code ran. Nothing else leaves: no realised batch size, no loss, no clipped count (the
reply carries the masked vector and the public round id only), and the work is padded to a public batch size
so that the reply's latency does not count the sample either (``padded_sample``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from feta_release.accounting import SkellamEvent
from feta_release.errors import PrivacyError
from feta_release.mechanisms import secure_sums as ss
from feta_release.mechanisms import skellam as sk
from feta_release.models import build_denoiser
from feta_release.models.edm import EDMLoss
from feta_release.policy.jobs import Job
from feta_release.training.dpsgd import (
    batch_gradients,
    clipped_rows,
    poisson_sample,
    seed_dropout,
    select_engine,
)
from feta_release.training.padding import fork_rng, model_range_rows, public_rows
from feta_release.training.step_rows import public_batch_bound

from .protocol import Request
from .releases import check_weights
from .site import Site


def round_params(site: Site, job: Job, event: SkellamEvent, dim: int) -> sk.SkellamParams:
    """The Skellam parameters of the charged event: its noise share Sk(mu_worst) (sigma derived from it), and
    the quantization (dim, clip, scale) whose sensitivities must be the event's l2 / l1, else refused (the
    released records must be the ones the charge's sensitivity covers)."""
    n_sites, clip = len(job.sites), float(job.config.dpsgd.clip)
    scale = 2.0 ** ss.fedsgd_scale_bits(dim) / clip
    sigma = math.sqrt(event.worst_mu * n_sites) / (clip * scale)
    params = ss.fedsgd_params(dim, clip, sigma, n_sites)
    if not (
        math.isclose(params.site_mu, event.worst_mu, rel_tol=1e-9)
        and math.isclose(params.l2_sensitivity, event.l2, rel_tol=1e-12)
        and math.isclose(params.l1_sensitivity, event.l1, rel_tol=1e-12)
    ):
        raise PrivacyError(
            f"FedSGD round: the mechanism's parameters {params} do not give the charged event {event}; "
            "nothing released"
        )
    return params


def gradient_contribution(
    site: Site,
    job: Job,
    req: Request,
    np_rng: np.random.Generator,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> np.ndarray:
    """This site's FedSGD round input: the sum of its sampled images' clipped, scaled, conditionally rounded
    gradients plus its Skellam noise share (int64, not yet reduced mod m). ``np_rng`` / ``generator``: fresh
    OS randomness (rounding and noise / Poisson sampling and the loss's noise draws). ``device`` (``node start
    --device``): where the gradients are computed; every draw stays on those CPU generators, and the clipped
    rows come back to the CPU before they are rounded."""
    event = req.event
    if not isinstance(event, SkellamEvent):
        raise PrivacyError(f"FedSGD round {req.round}: planned a {type(event).__name__}, not a Skellam share")
    cfg, ds = job.config, site.data
    model = build_denoiser(cfg.model, ds.image_shape, ds.n_classes)
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in req.arrays.items()})
    model.to(device)  # only the arithmetic moves: batch_gradients moves each chunk to the model's device
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    dim = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = round_params(site, job, event, dim)
    loss = EDMLoss(
        ds.image_shape,
        ds.n_classes,
        cfg.dpsgd.noise_multiplicity,
        cfg.model.label_dropout,
        sigma_data=getattr(model, "sigma_data", None),
    )
    # converted per indexed chunk (padded rows included): no copy of the site
    images = model_range_rows(ds.images)
    labels = torch.from_numpy(np.asarray(ds.labels, dtype=np.int64))
    # q over the site's rows: each image joins with probability q = batch / n_public (the planned, charged
    # rate)
    chunk = int(cfg.dpsgd.physical_batch)
    # the public size, or the bucket the padded passes reveal
    bound_n = public_rows(images.shape[0], site.n_public)
    idx, real = padded_sample(
        poisson_sample(images.shape[0], event.q, generator, bound_n), bound_n, event.q, chunk
    )
    total, at = np.zeros(dim, dtype=np.int64), 0
    # the per-example engine once a round, as DPSGDTrainer does: [dpsgd] per_example, the hooks cross-checked
    # on a public dummy batch (their own fixed generator: this round's draws are untouched)
    engine = select_engine(model, loss, cfg.dpsgd.per_example, check=True)
    with fork_rng(model):  # the CPU's and (on a GPU) the device's global RNG restored after the private seed
        seed_dropout(model, generator)  # dropout masks from the round's private generator
        for grads, _ in batch_gradients(model, loss, images, labels, idx, chunk, generator, engine):
            rows = clipped_rows(grads, names, float(cfg.dpsgd.clip)).detach().cpu().double().numpy()
            # padding rows: computed like the others, then zeroed (they round to 0)
            rows[max(0, real - at) :] = 0.0
            at += rows.shape[0]
            # per record: the sensitivity is one rounded record
            total += sk.quantize_records(rows, params, np_rng)
    return total + sk.skellam_noise(dim, params.site_mu, np_rng)


def padded_sample(idx: torch.Tensor, n_public: int, q: float, chunk: int) -> tuple[torch.Tensor, int]:
    """The sampled indices padded to a PUBLIC size, and how many are real.

    The work of a round (and so the reply's latency, which the coordinator sees per site per round) would
    otherwise track the realised Poisson batch |B|, an un-noised count. It is padded to whole chunks
    covering q·n_public + 5 sd of Binomial(n_public, q) (``training.step_rows.public_batch_bound``, the bound
    a site's per-site rounds pad to); only a batch above that takes longer. Padding rows repeat image 0 and
    are zeroed after clipping: the released sum is unchanged."""
    bound = public_batch_bound(n_public, q, chunk)
    real = int(idx.numel())
    if real >= bound:
        return idx, real
    return torch.cat([idx, torch.zeros(bound - real, dtype=idx.dtype)]), real


def check_round_weights(site: Site, job: Job, req: Request) -> None:
    """Before the charge (public input only): the global weights fit the job's model and are finite."""
    check_weights(job.config, site.data.image_shape, site.data.n_classes, req.arrays)
