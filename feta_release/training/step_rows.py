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


def _whole_chunks(rows: int, chunk: int) -> int:
    """``rows`` rounded UP to whole ``chunk``s (the trainer runs a step in calls of ``chunk`` rows)."""
    return -(-int(rows) // int(chunk)) * int(chunk)


def public_batch_bound(n_public: int, q: float, chunk: int) -> int:
    """Rows a step processes whatever its sample: whole ``chunk``s covering q·n + 5 sd of Binomial(n, q), n
    PUBLIC: the rows the sample is drawn from (a site's ``public_rows``, never below its real rows).

    At most whole chunks covering n itself: a Poisson sample of n rows never holds more than n, so rows
    beyond would be padding no sample needs, time the step spends and the job rules charge for nothing (q
    near 1: 308 rows for a site of 300 at q = 0.97 in chunks of 4). The cap is whole chunks covering n + 1,
    not n: a sample that fills the bound leaves no padding call, so its step would run one call fewer
    (``padding_chunks``) and time a site holding exactly n rows that drew them all (every step at q = 1).
    Above n no sample fills the bound, so every step runs the same public number of calls. The same holds
    wherever the tail itself reaches n (q = 1: sd 0, the tail is n, whole chunks of it n when the chunk
    divides n): the bound is then whole chunks covering n + 1 too."""
    mean, sd = q * n_public, math.sqrt(max(n_public * q * (1.0 - q), 0.0))
    return max(chunk, _whole_chunks(_above_all_at_n(math.ceil(mean + PAD_SIGMAS * sd), n_public), chunk))


def _above_all_at_n(tail: int, n: int) -> int:
    """``tail`` rows, or n + 1 where the tail reaches the n rows a sample is drawn from: a bound no sample
    of at most n rows can fill."""
    return n + 1 if tail >= n else tail


def patient_rows_bound(n_images_public: int, q: float, cap: int, chunk: int) -> int:
    """Images a PATIENT-level step processes whatever its sample, in whole ``chunk``s: q·n + 5·sqrt(q·cap·n).

    Each patient joins with probability q and brings m_p <= ``cap`` images, so the sampled images have mean
    q·Σm_p and variance q(1-q)·Σm_p² <= q·cap·Σm_p; n (for Σm_p) is the PUBLIC nominal image count."""
    mean = q * n_images_public
    sd = math.sqrt(max(q * (1.0 - q) * cap * n_images_public, 0.0))
    tail = _above_all_at_n(math.ceil(mean + PAD_SIGMAS * sd), n_images_public)
    return max(chunk, _whole_chunks(tail, chunk))


def step_bound(n_public: int, q: float, chunk: int, patients: object = None) -> int:
    """The public row count of one step of a site's DP-SGD round: images (``public_batch_bound``) or, for a
    patient-level site (``patients``: its ``PatientIndex``), images of sampled patients
    (``patient_rows_bound`` over the nominal image count ``n_public``, rounded to whole ``_patient_unit``s;
    the trainer runs it in calls of ``chunk`` rows, a patient's partial sum carried across a call
    boundary)."""
    if patients is None:
        return public_batch_bound(n_public, q, chunk)
    return patient_rows_bound(n_public, q, _patient_cap(chunk, patients), _patient_unit(chunk, patients))


def _patient_cap(chunk: int, patients: object) -> int:
    return int(getattr(patients, "cap", None) or chunk)


def _patient_unit(chunk: int, patients: object) -> int:
    """The rounding unit of a patient-level step: whole chunks covering ``max(chunk, cap)`` images. Whole
    chunks, because padding runs in calls of ``chunk`` rows: a bound that is not a whole number of them lets
    a sample one row short of it leave a call out (one call fewer: a timing channel)."""
    return _whole_chunks(max(chunk, _patient_cap(chunk, patients)), chunk)


def site_step_rows(n_rows: int, n_public: int, q: float, chunk: int, patients: object = None) -> int:
    """Rows every DP-SGD step of a site holding ``n_rows`` images of PUBLIC size ``n_public`` processes:
    ``step_bound`` over ``public_rows(n_rows, n_public)`` (a site above its public size pads to its bucket,
    which its padded whole-dataset passes already reveal; at or below it, to ``n_public`` itself). The node's
    trainer pads to it, and the job rules charge its time.

    A patient-level step is also capped at whole ``_patient_unit``s covering that bucket + 1: its
    images are the sampled patients' (at most ``cap`` each), a subset of the site's ``n_rows`` images, and
    the bucket is never below ``n_rows``, so no step can hold more, and none fills the bound (every step runs
    the same number of calls, as in ``public_batch_bound``). ``patient_rows_bound`` itself takes the nominal
    image count, which a site may exceed: capped there, a larger site's steps would overrun it and their
    time would count the sample. The cap is a function of the public bucket only."""
    rows = public_rows(n_rows, n_public)
    bound = step_bound(rows, q, chunk, patients)
    if patients is None:
        return bound  # public_batch_bound caps at whole chunks of ``rows`` + 1 already
    return min(bound, _whole_chunks(rows + 1, _patient_unit(chunk, patients)))
