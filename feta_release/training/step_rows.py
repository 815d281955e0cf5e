"""The PUBLIC row count of one DP-SGD step: the bound its work is padded to (``training.padding``).

Torch-free (arithmetic on public facts only), so the job rules' cost model (``job_rules``: the time of a
DP-SGD step, the steps a time budget buys) reads the very count a site's node pads each step to
(``edge.releases``), and the two cannot drift apart. Why the work is padded, and why to this bound:
``training.padding``."""

from __future__ import annotations

import math

from ..data.commitment import public_rows

# q·n + 5 sd: about 3e-7 of the steps exceed it where the normal approximation holds (large q·n); at small
# means the binomial tail is heavier (about 5e-6 at q·n = 16 before the rounding to whole chunks, which
# adds slack). A step above the bound only takes longer: the bound is about time, never about the noise.
PAD_SIGMAS = 5.0


def public_batch_bound(n_public: int, q: float, chunk: int) -> int:
    """Rows a step processes whatever its sample: whole ``chunk``s covering q·n + 5 sd of Binomial(n, q), n
    PUBLIC."""
    mean, sd = q * n_public, math.sqrt(max(n_public * q * (1.0 - q), 0.0))
    return max(chunk, -(-math.ceil(mean + PAD_SIGMAS * sd) // chunk) * chunk)


def patient_rows_bound(n_images_public: int, q: float, cap: int, chunk: int) -> int:
    """Images a PATIENT-level step processes whatever its sample, in whole ``chunk``s: q·n + 5·sqrt(q·cap·n).

    Each patient joins with probability q and brings m_p <= ``cap`` images, so the sampled images have mean
    q·Σm_p and variance q(1-q)·Σm_p² <= q·cap·Σm_p; n (for Σm_p) is the PUBLIC nominal image count."""
    mean = q * n_images_public
    sd = math.sqrt(max(q * (1.0 - q) * cap * n_images_public, 0.0))
    return max(chunk, -(-math.ceil(mean + PAD_SIGMAS * sd) // chunk) * chunk)


def step_bound(n_public: int, q: float, chunk: int, patients: object = None) -> int:
    """The public row count of one step of a site's DP-SGD round: images (``public_batch_bound``) or, for a
    patient-level site (``patients``: its ``PatientIndex``), images of sampled patients
    (``patient_rows_bound`` over the nominal image count ``n_public``, rounded to whole ``max(chunk, cap)``;
    the trainer runs it in calls of ``chunk`` rows, a patient's partial sum carried across a call
    boundary)."""
    if patients is None:
        return public_batch_bound(n_public, q, chunk)
    cap = int(getattr(patients, "cap", None) or chunk)
    return patient_rows_bound(n_public, q, cap, max(chunk, cap))


def site_step_rows(n_rows: int, n_public: int, q: float, chunk: int, patients: object = None) -> int:
    """Rows every DP-SGD step of a site holding ``n_rows`` images of PUBLIC size ``n_public`` processes:
    ``step_bound`` over ``public_rows(n_rows, n_public)`` (a site above its public size pads to its bucket,
    which its padded whole-dataset passes already reveal; at or below it, to ``n_public`` itself). The node's
    trainer pads to it, and the job rules charge its time."""
    return step_bound(public_rows(n_rows, n_public), q, chunk, patients)
