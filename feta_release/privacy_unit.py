"""The unit of privacy: one image, or one PATIENT when patient ids are known.

Every mechanism here is differentially private with respect to adding or removing one RECORD (one
image): DP-SGD clips each image's gradient to C, the central images clip each image to an L2 bound,
the frequency statistic bounds each image's feature vector. A patient with m images is m records.

When patient ids are known (a CSV ``patient_id`` column or DICOM PatientID) a site bounds each
patient's contribution with a per-patient cap k (``--patient-cap K``): at most k images of each patient
are used, the FIRST k in file order. That choice depends only on the patient's own records, so adding
or removing one patient adds or removes at most k records and changes nothing else (stability; a
shared random draw would not have this property). Sensitivities under add/remove of a whole patient:
  central sum of clipped images     k · clip            (image level: clip)
  frequency mean of feature vectors k / N               (image level: 1 / N, features of norm 1)
  DP-SGD summed clipped gradients   k · C per step      (image level: C)
With k = 1 the patient-level guarantee IS the image-level (ε, δ): the accountant's numbers hold for a
patient unchanged. With k > 1 the image-level releases hold per patient by group privacy over k records:
(ε_r, δ_r) per record gives (k·ε_r, k·e^{(k-1)ε_r}·δ_r) per patient (Dwork & Roth, Thm 2.2 generalised to (ε,
δ); Vadhan 2017, Lemma 2.2), with δ_r chosen so that the patient's δ is the budget's
(``accounting.group_epsilon``).

Patient-level DP-SGD (``training.dpsgd``, events with ``unit = "patient"``) needs no such conversion: it
Poisson-samples PATIENTS and clips each sampled patient's summed gradient to C, so add/remove of one patient
changes the noised sum by at most C, and the accountant's (ε, δ) for those steps holds per patient as it is.
When the warm-up stages are image-level with k > 1, δ is split in half: the image-level releases' group figure
at δ/2 and DP-SGD's ε at δ/2 compose by basic composition to (ε per patient, δ)
(``accounting.patient_epsilon``). At a patient-level site THAT figure is what every cap bounds
(``ledger.check_spend``: per job, lifetime, worst case), what DP-SGD's σ is calibrated to meet
(``planning.stage_events`` with ``patient_cap``), what the statement says and what ``verify`` checks against
the signed caps: a job whose per-patient figure cannot meet the budget is refused before anything is charged,
naming that figure. Without patient ids the unit stays the image, and a person with m images in the data is
protected only by that same group bound with k = m.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import DataError, PrivacyError

if TYPE_CHECKING:
    from torch import Tensor


def cap_per_patient(patients: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the first ``k`` images of every patient, in the given (file) order."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PrivacyError(f"patient cap must be an integer >= 1, got {k!r}")
    patients = np.asarray(patients)
    seen: dict[int, int] = {}
    keep = []
    for i, p in enumerate(patients.tolist()):
        c = seen.get(p, 0)
        if c < k:
            keep.append(i)
        seen[p] = c + 1
    return np.asarray(keep, dtype=np.int64)


def group_patient_rows(ids: Any) -> tuple[Tensor, ...]:
    """Image indices of each patient (int64 tensors, patients by ascending id, each patient's images in file
    order; ids with no image are skipped): the grouping patient-level DP-SGD samples from.

    Its work (a stable sort, a count and a split of the private ids) depends on the exact number and layout of
    a site's patients, so ``PatientIndex`` runs it ONCE, when the site's data is opened, and every DP-SGD
    request reuses the result."""
    import torch  # lazy: the light install (verify, report) imports this module without torch

    a = np.asarray(ids).astype(np.int64, copy=False).reshape(-1)
    if a.size and int(a.min()) < 0:
        raise DataError(
            "patient-level DP-SGD: patient indices must be >= 0 (the loader numbers patients 0..P-1); "
            "load the data with feta_release.data.loading, which assigns them"
        )
    order = np.argsort(a, kind="stable").astype(np.int64, copy=False)
    counts = np.bincount(a) if a.size else np.zeros(0, dtype=np.int64)
    parts = np.split(order, np.cumsum(counts)[:-1]) if counts.size else []
    return tuple(torch.from_numpy(np.ascontiguousarray(p)) for p in parts if p.size)


@dataclass(frozen=True)
class PatientIndex:
    """What patient-level DP-SGD needs: ``ids`` (per image, 0..P-1; private, stays in the site's process),
    ``n_public`` (the PUBLIC number of patients, the divisor's N: never the exact count) and ``cap`` (the
    public number of a sampled patient's images used per step, the loader's patient cap). ``rows``: the ids
    grouped by patient (``group_patient_rows``), computed once here, when the site's data is opened, never per
    request."""

    ids: np.ndarray
    n_public: int
    cap: int
    rows: tuple[Tensor, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("n_public", "cap"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PrivacyError(f"patient-level DP-SGD: {name} must be an integer >= 1, got {v!r}")
        object.__setattr__(self, "rows", group_patient_rows(self.ids))  # frozen: set once, here

    @property
    def n_patients(self) -> int:
        """The EXACT number of patients (private: for the site's own sizing only, never a divisor or a
        message)."""
        return len(self.rows)

    def trainer_kwargs(self) -> dict[str, Any]:
        """``DPSGDTrainer`` keywords of patient-level DP-SGD: sample patients, clip per patient, divide by q x
        the PUBLIC patient count (the one place a site turns its index into a trainer's arguments). The rows
        are the ones grouped at open: a request's trainer never regroups the private ids."""
        return {"n_public": self.n_public, "patient_rows": self.rows, "images_per_patient": self.cap}


def unit_phrase(events: Sequence[Any]) -> str:
    """The unit of privacy of a site's event history (dicts or PrivacyEvents), in words: patient-level DP-SGD
    events say "patient"; every other event protects one image of the site."""
    units = {(e.get("unit", "image") if isinstance(e, dict) else getattr(e, "unit", "image")) for e in events}
    if "patient" in units:
        return (
            "one patient of that site for DP-SGD (patients sampled, each patient's summed gradient clipped), "
            "one image for the other stages"
        )
    return "one image of that site"


def group_privacy(epsilon: float, delta: float, k: int) -> tuple[float, float]:
    """(ε, δ)-DP for one record implies (k·ε, k·e^{(k-1)ε}·δ)-DP for a group of k records."""
    if k < 1:
        raise PrivacyError(f"group size must be >= 1, got {k}")
    if k == 1:
        return float(epsilon), float(delta)
    with np.errstate(over="ignore"):
        d = k * math.exp(min((k - 1) * epsilon, 700.0)) * delta
    return float(k * epsilon), float(min(d, 1.0))


@dataclass(frozen=True)
class PrivacyUnit:
    """What one (ε, δ) protects. ``k``: records per unit (the patient cap), or the largest number of
    images one person has when the unit is the image (None: unknown)."""

    kind: str  # "image" | "patient"
    k: int | None = 1

    def statement(
        self, epsilon: float, delta: float, events: Sequence[Any] = (), accountant: str = "rdp"
    ) -> dict:
        """What (ε, δ) (the accountant's figure over ``events``) means for one patient or one image.

        A patient: with ``events``, ε PER PATIENT at δ itself (``accounting.patient_epsilon``, the figure the
        site's ledger caps and its DP-SGD is calibrated to meet): patient-level events as they are, the
        image-level ones by group privacy over the cap. Without events (a bare figure), only group privacy of
        (ε, δ) can be stated."""
        if self.kind == "patient" and events:
            return self._patient_statement(float(delta), list(events), accountant)
        if self.kind == "patient":
            k = int(self.k or 1)
            pe, pd = group_privacy(epsilon, delta, k)
            how = (
                "exact: each patient contributes one image, so the image-level accounting covers the patient"
                if k == 1
                else f"group privacy over the cap of {k} images per patient"
            )
            return {
                "unit": "patient",
                "images_per_patient_cap": k,
                "epsilon_per_patient": pe,
                "delta_per_patient": pd,
                "how": how,
                "sensitivity": self._sensitivity(False),
            }
        out = {
            "unit": "image",
            "epsilon_per_image": float(epsilon),
            "delta_per_image": float(delta),
            "how": "no patient ids: one image is the unit; a person with k images is protected only by group "
            "privacy, (k·ε, k·e^((k-1)ε)·δ)",
        }
        if self.k and self.k > 1:
            pe, pd = group_privacy(epsilon, delta, int(self.k))
            out.update(largest_group=int(self.k), epsilon_for_largest_group=pe, delta_for_largest_group=pd)
        return out

    def _sensitivity(self, patient_sgd: bool) -> str:
        k = int(self.k or 1)
        sgd = (
            "DP-SGD: one patient adds one clipped summed gradient, C per step (patients sampled)"
            if patient_sgd
            else f"DP-SGD {k}·C per step"
        )
        return (
            f"add/remove one patient changes at most {k} record(s) of the image-level releases: central "
            f"{k}·clip (mode: {k}·sqrt(P)), frequency {k}/N; {sgd}"
        )

    def _patient_statement(self, delta: float, events: list[Any], accountant: str) -> dict:
        from .accounting import epsilon as compose
        from .accounting import patient_epsilon

        k = int(self.k or 1)
        image_level = [e for e in events if e.steps > 0 and getattr(e, "unit", "image") != "patient"]
        patient_level = [e for e in events if e.steps > 0 and getattr(e, "unit", "image") == "patient"]
        total = patient_epsilon(events, delta, k, accountant)  # type: ignore[arg-type]
        out = {
            "unit": "patient",
            "images_per_patient_cap": k,
            "sensitivity": self._sensitivity(bool(patient_level)),
            "epsilon_per_patient": total,
            "delta_per_patient": delta,
        }
        if k == 1 or not image_level:
            return {
                **out,
                "how": "exact: "
                + (
                    "DP-SGD samples and clips whole patients"
                    if patient_level
                    else "each patient contributes one image"
                )
                + (", and each patient has one image in the other releases" if image_level else ""),
            }
        if not patient_level:
            return {
                **out,
                "how": f"group privacy over the cap of {k} images per patient (per-image δ chosen so the "
                "patient's δ is the budget's)",
            }
        eps_s = compose(patient_level, delta / 2, accountant)  # type: ignore[arg-type]
        return {
            **out,
            "epsilon_dpsgd_per_patient": eps_s,
            "epsilon_warmup_per_patient": total - eps_s,
            "how": f"DP-SGD per patient directly (no group conversion) at δ/2; the image-level releases by "
            f"group privacy over the cap of {k} images per patient at δ/2; the two by basic composition",
        }


def site_unit_statement(
    policy: Any, epsilon: float, delta: float, events: Sequence[Any], accountant: str
) -> dict:
    """What one site's (ε, δ) protects, from its SIGNED policy (a federation may mix units: each site states
    its own). A patient-level policy: ε per patient (DP-SGD directly, the capped warm-up by group privacy)
    with the public patient count; an image-level one: per image, and a person with k images only by group
    privacy."""
    if getattr(policy, "privacy_unit", "image") == "patient":
        st = PrivacyUnit("patient", int(policy.patient_cap)).statement(epsilon, delta, events, accountant)
        return {**st, "public_patients": int(policy.patients)}
    return PrivacyUnit("image", None).statement(epsilon, delta)


def statement_patient_cap(statement: dict) -> int | None:
    """The images-per-patient cap a site's signed statement declares (None: an image-level site)."""
    u = statement.get("privacy_unit")
    if isinstance(u, dict) and u.get("unit") == "patient" and "epsilon_per_patient" in u:
        return int(u["images_per_patient_cap"])
    return None


def lifetime_in_unit(statement: dict) -> dict | None:
    """A site's signed lifetime spend (all its jobs on the same data) in the SITE'S unit, as its ledger caps
    it (None: a statement without one): per patient at a patient-level site (``accounting.patient_epsilon``
    over its cap), whereas the statement's ``lifetime.epsilon`` composes the events as if each protected one
    image, a smaller number than one patient can lose (kept as ``epsilon_per_image``, beside ``unit``).
    Image-level sites: the signed figure as it is. The one derivation the privacy report and the certificate
    state."""
    from .accounting import events_from_list, patient_epsilon

    life = statement.get("lifetime")
    if not isinstance(life, dict):
        return None
    cap, delta = statement_patient_cap(statement), float(life["delta"])
    if cap is None:
        return {"epsilon": float(life["epsilon"]), "delta": delta}
    acc = statement.get("accountant", "rdp")
    per = patient_epsilon(events_from_list(life["events"]), delta, cap, acc)
    return {"epsilon": per, "delta": delta, "unit": "patient", "epsilon_per_image": float(life["epsilon"])}


def job_in_unit(statement: dict) -> dict:
    """A site's signed spend on THIS job in the SITE'S unit, as its ledger caps it: per patient at a
    patient-level site (the statement's ``privacy_unit``, which verify recomputes from the signed policy and
    the events), the statement's ``epsilon`` (the events composed as if each protected one image) kept as
    ``epsilon_per_image``; an image-level site's signed figure as it is. The job's counterpart of
    :func:`lifetime_in_unit`."""
    cap = statement_patient_cap(statement)
    if cap is None:
        return {"epsilon": float(statement["epsilon"]), "delta": float(statement["delta"])}
    u = statement["privacy_unit"]
    return {
        "epsilon": float(u["epsilon_per_patient"]),
        "delta": float(u["delta_per_patient"]),
        "unit": "patient",
        "images_per_patient_cap": cap,
        "epsilon_per_image": float(statement["epsilon"]),
    }


def figure_unit_words(cap: int | None, whose: str = "that site") -> str:
    """What a site's figure in its unit (:func:`job_in_unit`, :func:`lifetime_in_unit`) protects, in ASCII
    words (they go into PNG text chunks): one patient with all of their images at a patient-level site (every
    stage, the image-level ones by group privacy over the cap), else one image."""
    if cap is None:
        return f"one image of {whose}"
    return f"one patient of {whose} with all of their images (at most {cap} used), every stage"


def figures_in_unit(statements: dict[str, dict]) -> tuple[dict[str, float] | None, float | None, str]:
    """(ε per site in its unit, the largest δ, the unit in words) of the sites' signed statements (site id
    -> statement): what a title over a job's samples states. A federation that mixes units names the
    patient-level sites."""
    figures = {sid: job_in_unit(st) for sid, st in statements.items()}
    if not figures:
        return None, None, figure_unit_words(None, "one site")
    patient = sorted(sid for sid, f in figures.items() if f.get("unit") == "patient")
    if not patient:
        unit = figure_unit_words(None, "one site")
    elif len(patient) == len(figures):
        unit = "per patient: one patient of one site with all of their images, every stage"
    else:
        unit = f"per patient at {', '.join(patient)} (all of a patient's images), per image elsewhere"
    eps = {sid: f["epsilon"] for sid, f in figures.items()}
    return eps, max(f["delta"] for f in figures.values()), unit
