"""The site's Flower ClientApp: the only code that touches the site's images.

Each releasing handler is a compute function ``(site, job, request, rng) -> (arrays, events)`` wrapped by
``edge.protocol.release``, which owns the order every release follows (verify the job, answer a replay from
the ledger, check the policy, charge, compute with fresh OS noise, record, reply). ``hello`` and ``attest``
release nothing about the images and are plain handlers.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from feta_release.accounting import Event, PrivacyEvent
from feta_release.errors import ConfigError, PolicyError, PrivacyError
from feta_release.federation import messages as fm
from feta_release.mechanisms.central import check_prototypes
from feta_release.mechanisms.selection import check_centroids
from feta_release.policy.jobs import Job
from feta_release.signing import public_key_pem
from feta_release.training.device import resolve_device

from .attest import site_attestation
from .fedsgd import check_round_weights, gradient_contribution
from .padded_releases import pad_secure, padded
from .protocol import Arrays, ReleaseRng, Request, release, verified_job
from .public_errors import public_errors_mod
from .releases import (
    check_round,
    dpsgd_round,
    release_central,
    release_frequency,
    release_selection,
    round_checkpoint,
    selection_share,
)
from .resources import resources_mod
from .secure import admit_masked, handle, masked_contribution
from .site import Site, site_for

# error replies: no local path or internal text leaves (public_errors); the policy's memory and message caps
# (resources) hold before any handler reads the message
app = ClientApp(mods=[public_errors_mod, resources_mod])


def site_device(site: Site) -> torch.device:
    """Where this node's DP-SGD / FedSGD rounds compute (``node start --device``). Also resolved by each
    round's admission, before its charge: a GPU gone since the node started refuses the round instead of
    charging for a computation that cannot run. ``is_available`` only reads a cached device count, so a GPU is
    also made to run one small operation: one left broken by an earlier CUDA error (or out of memory) is
    refused here too, in a fixed line (a CUDA error's own text is not sent to the coordinator)."""
    dev = resolve_device(site.device)
    if dev.type == "cuda":
        try:
            torch.zeros(1, device=dev).add_(1)
            torch.cuda.synchronize(dev)
        except Exception:  # any failure of the device itself: what it says stays in this process
            raise ConfigError(
                "--device cuda: the node's GPU failed a test operation (broken CUDA state or out of "
                "memory); nothing charged for this round; restart the node or use --device cpu"
            ) from None
    return dev


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """Identify the site for a job: site id, public size, its signed policy, what it has spent (no
    release)."""
    site = site_for(context.node_config)
    doc, _ = fm.read_payload(msg.content)
    # a hello releases nothing: it is answered for a closed job too, so that a re-run of a finished job can
    # collect the attestation of a site that was down when the others attested (every release of it stays
    # refused)
    job = verified_job(site, doc, attesting=True)
    reply = {
        "site_id": site.site_id,
        "dataset_size": site.n_public,  # the policy's public nominal size, never the exact count
        # the policy's DECLARED schema (the data were mapped onto it at open), never values read off the
        # images
        "image_shape": list(site.policy.declared.image_shape),
        "n_classes": int(site.policy.declared.n_classes),
        "class_names": list(site.policy.declared.class_names),
        # the signed policy the site verified and runs under, never the file read again (replaced since?)
        "policy": site.policy.signed,
        "site_public_key": public_key_pem(site.key),
        "lifetime_events": [e for r in site.ledger.requests() for e in r["events"]],
        "job_events": site.ledger.job_events(job.job_id),
        # which ledger, how far: the coordinator refuses one that does not extend the last it saw attested
        "ledger": site.ledger.anchor(),
    }
    return Message(fm.make_payload(reply), reply_to=msg)


def _selection_fits(site: Site, job: Job, req: Request) -> None:
    """Public input only, before the charge: exactly one array, the job's number of centroids of this site's
    declared image shape, finite (a public image or anything else in the request is refused)."""
    if set(req.arrays) != {"centroids"}:
        raise PolicyError(
            f"selection request carries arrays {sorted(req.arrays)}; only 'centroids' is accepted"
        )
    check_centroids(
        req.arrays["centroids"], job.config.public.selection_groups, tuple(site.policy.declared.image_shape)
    )


@app.query("selection")
@release("selection", admit=_selection_fits)
def selection(site: Site, job: Job, req: Request, rng: ReleaseRng) -> tuple[Arrays, list[Event]]:
    """The semantic selection query: a noisy histogram of the public groups nearest to this site's images."""
    centroids = req.arrays["centroids"]

    def release(ds: Any, cfg: Any, n_public: int, r: Any) -> tuple[Arrays, list[PrivacyEvent]]:
        return release_selection(ds, cfg, centroids, r)

    arrays, events = padded(release, site.data, job.config, site.n_public, rng.numpy())  # + public work
    return arrays, [*events]


def _central_fits(site: Site, job: Job, req: Request) -> None:
    """Public input only, before the charge: with ``[central] cell_rule = "aux"`` exactly the array
    ``prototypes`` (classes x cells x pixels of the declared schema, finite, in [0, 1]); otherwise none."""
    c, declared = job.config.central, site.policy.declared
    if c.cell_rule != "aux":
        if req.arrays:
            raise PolicyError(f"central request carries arrays {sorted(req.arrays)}; it takes none")
        return
    if set(req.arrays) != {"prototypes"}:
        raise PolicyError(
            f'central request carries arrays {sorted(req.arrays)}; [central] cell_rule = "aux" takes only '
            "'prototypes'"
        )
    p = check_prototypes(
        req.arrays["prototypes"], declared.n_classes, c.cells, tuple(declared.image_shape), "central request"
    )
    if p.min() < 0 or p.max() > 1:
        raise PolicyError("central request: cell prototypes outside [0, 1] are not images; refused")


@app.query("central")
@release("central", admit=_central_fits)
def central(site: Site, job: Job, req: Request, rng: ReleaseRng) -> tuple[Arrays, list[Event]]:
    prototypes = req.arrays.get("prototypes")

    def release(ds: Any, cfg: Any, n_public: int, r: Any) -> tuple[Arrays, list[PrivacyEvent]]:
        return release_central(ds, cfg, n_public, r, prototypes)

    arrays, events = padded(release, site.data, job.config, site.n_public, rng.numpy())  # public work
    return arrays, [*events]


@app.query("frequency")
@release("frequency")
def frequency(site: Site, job: Job, req: Request, rng: ReleaseRng) -> tuple[Arrays, list[Event]]:
    # public work
    arrays, events = padded(release_frequency, site.data, job.config, site.n_public, rng.numpy())
    return arrays, [*events]


def _secure_info(site: Site, req: Request) -> dict[str, Any]:
    # public values only: which sum this vector belongs to (the coordinator's own round id echoed)
    return {
        "phase": req.doc.get("phase"),
        "round_id": req.doc.get("round_id"),
        "stage": "collect_masked_vectors",
    }


def _secure_fits(site: Site, job: Job, req: Request) -> None:
    admit_masked(site, job, req.doc)


@release("central", admit=_secure_fits, public=_secure_info, secure=True)
def central_masked(site: Site, job: Job, req: Request, rng: ReleaseRng) -> tuple[Arrays, list[Event]]:
    """Mean central images as this site's masked Skellam contribution to the secure sum (edge/secure.py)."""
    out = {"masked": masked_contribution(site, job, req.doc, rng.numpy())}
    # public work (padded_releases)
    pad_secure(site.data, job.config, site.n_public, "central", len(job.sites))
    return out, [req.event]


@release("frequency", admit=_secure_fits, public=_secure_info, secure=True)
def frequency_masked(site: Site, job: Job, req: Request, rng: ReleaseRng) -> tuple[Arrays, list[Event]]:
    """The frequency embedding sum as this site's masked Skellam contribution to the secure sum."""
    out = {"masked": masked_contribution(site, job, req.doc, rng.numpy())}
    # public work (padded_releases)
    pad_secure(site.data, job.config, site.n_public, "frequency", len(job.sites))
    return out, [req.event]


def _secure_selection_fits(site: Site, job: Job, req: Request) -> None:
    admit_masked(site, job, req.doc)
    _selection_fits(site, job, req)


@release("selection", admit=_secure_selection_fits, public=_secure_info, secure=True)
def selection_masked(site: Site, job: Job, req: Request, rng: ReleaseRng) -> tuple[Arrays, list[Event]]:
    """The semantic selection histogram as this site's masked Skellam contribution to the secure sum (a
    secure-aggregation job): the coordinator decodes the noisy sum of the sites' histograms, never one."""
    centroids, n_sites = req.arrays["centroids"], len(job.sites)

    def share(ds: Any, cfg: Any, n_public: int, r: Any) -> Any:
        return selection_share(ds, cfg, centroids, n_sites, r)

    noisy = padded(share, site.data, job.config, site.n_public, rng.numpy())  # + public work
    return {"masked": masked_contribution(site, job, req.doc, rng.numpy(), noisy)}, [req.event]


def _fedsgd_fits(site: Site, job: Job, req: Request) -> None:
    admit_masked(site, job, req.doc)
    check_round_weights(site, job, req)
    site_device(site)


@release("dpsgd", admit=_fedsgd_fits, public=_secure_info, secure=True)
def dpsgd_masked(site: Site, job: Job, req: Request, rng: ReleaseRng) -> tuple[Arrays, list[Event]]:
    """One FedSGD round: this site's clipped-gradient sum plus its noise share, masked (edge/fedsgd.py)."""
    noisy = gradient_contribution(site, job, req, rng.numpy(), rng.torch(), site_device(site))
    return {"masked": masked_contribution(site, job, req.doc, rng.numpy(), noisy)}, [req.event]


@app.query("secagg")
def secagg(msg: Message, context: Context) -> Message:
    """One stage of a secure sum (setup, share_keys, collect_masked_vectors, unmask): see edge/secure.py."""
    return handle(
        msg,
        context,
        {
            "selection": selection_masked,
            "central": central_masked,
            "frequency": frequency_masked,
            "dpsgd": dpsgd_masked,
        },
    )


def _fitting_weights(site: Site, job: Job, req: Request) -> None:
    check_round(job.config, site.data.image_shape, site.data.n_classes, req.arrays)
    site_device(site)


def _round_info(site: Site, req: Request) -> dict[str, Any]:
    # Only public values go with the weights: the per-example loss of the private batch and the on-site
    # seconds (which track the realised Poisson batch size) are un-noised functions of the data.
    assert isinstance(req.event, PrivacyEvent)  # DP-SGD rounds are per-site Gaussian releases
    return {"round": req.round, "num_examples": site.n_public, "sigma": req.event.sigma, "q": req.event.q}


@app.train()
@release("dpsgd", admit=_fitting_weights, public=_round_info, resume=True)
def train(site: Site, job: Job, req: Request, rng: ReleaseRng) -> tuple[Arrays, list[Event]]:
    """One federated DP-SGD round: global weights and their EMA in, ``local_steps`` DP-SGD steps on site,
    weights and the EMA continued over those steps out (``edge.releases.dpsgd_round``). A round whose process
    was killed is finished when it is asked again, from its checkpoint (``node config
    round-checkpoint-every``)."""
    if not isinstance(req.event, PrivacyEvent):
        raise PrivacyError(
            f"DP-SGD round {req.round}: planned a {type(req.event).__name__}, not a Gaussian step"
        )
    first_step = req.round * job.config.federation.local_steps  # public: the job's steps before this round
    ckpt = round_checkpoint(site.ledger, site.work_dir, job.job_id, req.rid, site.round_checkpoint_every)
    return dpsgd_round(
        site.data,
        job.config,
        req.arrays,
        req.event,
        rng.torch(),
        site.n_public,
        site.patients,
        site_device(site),
        first_step,
        ckpt,
    ), [req.event]


@app.query("attest")
def attest(msg: Message, context: Context) -> Message:
    """The site's signed, FINAL statement of what this job spent here, from its own ledger (no release).

    Attesting closes the job at this site first: no charge for it can commit afterwards, so the figures
    signed are the job's last. A repeated attest (a retry) signs the same, closed history again."""
    site = site_for(context.node_config)
    doc, _ = fm.read_payload(msg.content)
    job = verified_job(site, doc, attesting=True)
    return Message(fm.make_payload({"attestation": site_attestation(site, job)}), reply_to=msg)
