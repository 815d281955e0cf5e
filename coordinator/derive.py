"""A federated job derived from the sites' PUBLIC declarations (``feta_release.job_rules``): the sum of their
declared sizes, their common declared image shape and classes, the smallest of their per-job budgets.

The declarations are read from the sites' policies (signed, or drafts) as ``privacy plan --policy`` reads
them: planning trusts nothing, every node checks the signed job against its own signed policy when the job
runs. The derived job is judged by each site's whole policy as its node judges it (``edge.admission.admit``)
before it is written, so no site refuses it after others have spent budget on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.admission import admit
from feta_release.errors import ConfigError, PolicyViolation, PrivacyError
from feta_release.job_rules import (
    DPSGD_MAX_NOISE,
    DPSGD_MIN_STEPS,
    LOCAL_STEPS,
    REFERENCE_THREADS,
    DataFacts,
    Derivation,
    default_delta,
    derive,
    estimate,
    job_dpsgd_noise,
    notes_of,
    policy_patient_facts,
    with_physical_caps,
)
from feta_release.planning import plan, site_form
from feta_release.policy.document import SitePolicy, read_policy_document, read_signed_policy_unverified
from feta_release.policy.envelope import read_json
from feta_release.policy.jobs import sign_job
from feta_release.signing import public_key_pem


def read_site_policy(path: Path) -> Any:
    """A site policy for planning: signed (its integrity checked, not who signed it) or an unsigned draft."""
    if (
        path.suffix.lower() == ".json"
        and isinstance(raw := read_json(path, "policy"), dict)
        and "signature" in raw
    ):
        return read_signed_policy_unverified(path)[0]
    return SitePolicy.from_document(read_policy_document(path), None, str(path))


def facts_from_policies(
    policies: Sequence[Any],
    epsilon: float,
    delta: float | None = None,
    time_budget: float | None = None,
    device: str = "cpu",
    threads: int = REFERENCE_THREADS,
) -> DataFacts:
    """The public facts of a federation: summed declared sizes, the one declared shape and class list (refused
    when the sites disagree or one declares none), epsilon and delta capped by every site's per-job budget,
    the physical batch by every site's resource caps.

    ``threads``: the CPU threads the job is timed at, the COORDINATOR's (``coordinator run``: its torch
    threads; ``coordinator derive-job --for-threads``). The coordinator runs the warm-up, the aux fit and the
    sampling, most of a job's time; the sites' DP-SGD rounds are timed at the same count, since a site's
    policy declares no thread count (a site with fewer threads than the coordinator runs its rounds slower
    than estimated)."""
    if not policies:
        raise ConfigError("derived federated job: give each site's policy (--policy FILE, once per site)")
    decls = []
    for p in policies:
        if p.declared is None:
            raise ConfigError(
                f"site {p.site_id}: its policy declares no dataset.classes / dataset.image_shape; a "
                "derived job needs them (`feta-release site init` writes them), or give a JOB file"
            )
        decls.append(p.declared)
    if len({(d.class_names, d.image_shape) for d in decls}) > 1:
        seen = ", ".join(
            f"{p.site_id}: {len(d.class_names)} classes {list(d.image_shape)}"
            for p, d in zip(policies, decls)
        )
        raise ConfigError(
            f"derived federated job: the sites declare different classes or image shapes ({seen}); "
            "they must agree on one schema"
        )
    # one signed batch for every site (q = batch / each site's size): the smallest site's size, so that it
    # samples q = 1 and a larger one q < 1; the combined release then counts n_sites x that many images on
    # average
    size = len(policies) * min(int(p.dataset_size) for p in policies)
    c, h, w = decls[0].image_shape
    eps = min([float(epsilon)] + [float(p.job_epsilon) for p in policies])
    cap = min(float(p.job_delta) for p in policies)
    facts = DataFacts(
        size=size,
        height=int(h),
        width=int(w),
        channels=int(c),
        n_classes=decls[0].n_classes,
        epsilon=eps,
        delta=min(cap, default_delta(size) if delta is None else float(delta)),
        device="cuda" if device == "cuda" else "cpu",
        time_budget=time_budget,
        threads=int(threads),
        federated=True,
        # each site pads its DP-SGD steps over its own size: the time rules charge the slowest site's rows
        site_sizes=tuple(int(p.dataset_size) for p in policies),
        # a patient-level site samples its public patients and pads whole patients' images: charged so
        site_patients=tuple(policy_patient_facts(p) for p in policies),
    )
    # one physical batch for every site: within the smallest resources.max_physical_batch and max_pass_rows
    # of their policies (a larger one, a GPU's, would be refused by that site's node)
    return with_physical_caps(facts, policies)


def derive_federated(
    policy_files: Sequence[Path],
    epsilon: float,
    delta: float | None = None,
    time_budget: float | None = None,
    device: str = "cpu",
    threads: int = REFERENCE_THREADS,
) -> tuple[Derivation, list[str]]:
    """(the job derived from the sites' policies, their site ids in the order given), timed at ``threads``
    CPU threads (:func:`facts_from_policies`)."""
    policies = [read_site_policy(Path(p)) for p in policy_files]
    ids = [p.site_id for p in policies]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"derived federated job: a site's policy was given twice ({', '.join(ids)})")
    facts = facts_from_policies(policies, epsilon, delta, time_budget, device, threads)
    smallest, cap = min(int(p.dataset_size) for p in policies), dpsgd_batch_cap(policies)
    d, refusal = summed_as_every_site_plans(federated_job(facts, smallest, cap), facts, policies)
    if refusal and d.cfg.dpsgd_steps(facts.size) > 0:  # a site's plan refuses DP-SGD: the job without it
        d, refusal = without_dpsgd(facts, policies, smallest, cap, refusal)
    if refusal:
        raise ConfigError(f"derived federated job: {refusal}")
    return admitted_by_every_site(d, facts, policies, smallest, cap), ids


def without_dpsgd(
    facts: DataFacts, policies: Sequence[Any], smallest: int, cap: int, why: str
) -> tuple[Derivation, str]:
    """The job derived again with DP-SGD off (the warm-up releases then take the whole budget), its header
    saying ``why``; with why a site's plan refuses it ("" when every site plans it)."""
    d = federated_job(replace(facts, dpsgd="off"), smallest, cap)
    d = replace(d, notes=tuple(f"dpsgd: off ({why})" if n.startswith("dpsgd:") else n for n in d.notes))
    return summed_as_every_site_plans(d, facts, policies)


# the refusals a derived job has a remedy for: every DP-SGD rule (its steps cut, or DP-SGD off)
DPSGD_RULES = "mechanisms.dpsgd."


def admitted_by_every_site(
    d: Derivation, facts: DataFacts, policies: Sequence[Any], smallest: int, cap: int
) -> Derivation:
    """``d`` in a form every site's node admits (:func:`site_refusals`), by the derived remedies, each tried
    only while a site still refuses, in this order (the least change to what the job trains first):

    1. each site adding the whole noise (:func:`with_per_site_noise`), where the secure form is refused by a
       rule the per-site form passes: the form the rules fitted (each site's spend is the one they fitted;
       only the pooled warm-up release is noisier), and DP-SGD, its steps and its sigma stay as derived;
    2. DP-SGD's steps cut to the sites' smallest ``mechanisms.dpsgd.max_steps`` (DP-SGD kept, fewer steps);
    3. DP-SGD off, its budget split planned again (:func:`dpsgd_within_policies`);
    4. step 1 again for a job step 2 or 3 derived anew (without DP-SGD the warm-up takes the whole budget:
       a smaller sigma, which a site may refuse on its own share).

    Why this order: a site's refusal of the secure form on its own share says nothing about DP-SGD, and
    the per-site form charges each site's DP-SGD over the warm-up as the rules fitted it. Judged the other way
    round, a DP-SGD refusal of the per-site form (its warm-up is cheaper than a site's own-share view of the
    secure one, so its DP-SGD sigma is smaller) came after the DP-SGD remedy had run, and the job was
    refused naming a DP-SGD rule although the job without DP-SGD was admitted; and a DP-SGD refusal of the
    secure form alone would have cost DP-SGD where the per-site form admits it. Any other refusal raises
    :class:`PolicyViolation` naming the site, its rule and the fix."""
    d, failures = with_per_site_noise(d, facts, policies, site_refusals(d.cfg, policies))
    remedy = ""
    if d.cfg.federated_rounds > 0 and any(rule.startswith(DPSGD_RULES) for _, rule, _ in failures):
        d, remedy = dpsgd_within_policies(d, facts, policies, smallest, cap, failures)
        d, failures = with_per_site_noise(d, facts, policies, site_refusals(d.cfg, policies))
    if failures:
        site, rule, message = failures[0]
        if rule in ("job", "plan"):  # the planner's refusal, not a policy rule: as the plan path says it
            said = " ".join(message.removeprefix(f"site {site}: ").split())
            raise ConfigError(f"derived federated job: site {site}'s plan refuses it: {said}")
        raise refused(site, rule, message, remedy)
    return d


def with_per_site_noise(
    d: Derivation, facts: DataFacts, policies: Sequence[Any], failures: list[tuple[str, str, str]]
) -> tuple[Derivation, list[tuple[str, str, str]]]:
    """``d`` with each site adding the whole noise (``secure_aggregation = false``, named in a note) where it
    is signed to sum securely, a site's node refuses that form by a rule (``failures``: :func:`site_refusals`
    of ``d``) that it does not refuse the per-site form by, and every site plans the per-site form; else ``d``
    and its ``failures`` unchanged. The secure form is kept wherever it fares no worse: its pooled noise is
    the smaller."""
    secure = len(policies) >= 2 and d.cfg.federation.secure_aggregation is not False
    if not secure or not failures:
        return d, failures
    per_site = d.cfg.replace(federation={"secure_aggregation": False})
    left = site_refusals(per_site, policies)
    gone = [f for f in failures if (f[0], f[1]) not in {(s, r) for s, r, _ in left}]
    if not gone or site_plan_refusal(per_site, facts, policies):
        return d, failures
    site, rule, _ = gone[0]
    why = f"site {site}'s node refuses it on its own share: {rule}"
    return replace(d, cfg=per_site, notes=(*d.notes, per_site_note(why))), left


def dpsgd_within_policies(
    d: Derivation,
    facts: DataFacts,
    policies: Sequence[Any],
    smallest: int,
    cap: int,
    failures: Sequence[tuple[str, str, str]],
) -> tuple[Derivation, str]:
    """(``d`` within every site's DP-SGD rules, the short remedy the refusal names): its steps cut to the
    smallest ``mechanisms.dpsgd.max_steps`` of the sites (whole rounds) where that cap refuses it, judged
    again; DP-SGD off where a site allows none, the cut leaves under the rules' minimum of steps or a
    DP-SGD rule (its sigma floor: fewer steps, less sigma) still refuses."""
    rules = {rule: site for site, rule, _ in reversed(failures)}  # each rule's first site
    if "mechanisms.dpsgd.max_steps" in rules and "mechanisms.dpsgd.allowed" not in rules:
        site, most = min(
            ((p.site_id, int(p.mechanisms["dpsgd"].caps["max_steps"])) for p in policies if _steps_cap(p)),
            key=lambda s: s[1],
        )
        rounds, why = most // LOCAL_STEPS, f"site {site}'s mechanisms.dpsgd.max_steps = {most}"
        if rounds * LOCAL_STEPS < DPSGD_MIN_STEPS:
            return _dpsgd_off(
                facts, policies, smallest, cap, f"{why}, under the {DPSGD_MIN_STEPS} steps it needs"
            )
        cut = with_rounds(d, facts, policies, rounds, why, (smallest, cap))
        if cut.cfg.federated_rounds == 0:  # too noisy in fewer steps: with_rounds turned it off
            return cut, f"DP-SGD off: {why}"
        left = [f for f in site_refusals(cut.cfg, policies) if f[1].startswith(DPSGD_RULES)]
        if not left:
            return (
                cut,
                f"DP-SGD cut to {rounds * LOCAL_STEPS} steps: site {site}'s mechanisms.dpsgd.max_steps",
            )
        rules = {rule: site for site, rule, _ in reversed(left)}
    if "mechanisms.dpsgd.allowed" in rules:
        why = f"site {rules['mechanisms.dpsgd.allowed']}'s policy allows no DP-SGD: mechanisms.dpsgd.allowed"
    else:
        rule, site = next(iter(rules.items()))
        why = f"site {site}'s policy refuses its DP-SGD: {rule}"
    return _dpsgd_off(facts, policies, smallest, cap, why)


def _dpsgd_off(
    facts: DataFacts, policies: Sequence[Any], smallest: int, cap: int, why: str
) -> tuple[Derivation, str]:
    """(the job with DP-SGD off, its header saying ``why``; the short remedy); a site's plan refusing even it
    raises the plan path's ConfigError."""
    d, refusal = without_dpsgd(facts, policies, smallest, cap, why)
    if refusal:
        raise ConfigError(f"derived federated job: {refusal}")
    return d, f"DP-SGD off: {why.split(': ')[0]}"


def _steps_cap(policy: Any) -> bool:
    rule = policy.mechanisms.get("dpsgd")
    return rule is not None and "max_steps" in rule.caps


def with_rounds(
    d: Derivation,
    facts: DataFacts,
    policies: Sequence[Any],
    rounds: int,
    why: str,
    sizes: tuple[int, int],
) -> Derivation:
    """``d`` with ``rounds`` federated DP-SGD rounds of :data:`LOCAL_STEPS` (fewer steps: the planner
    calibrates DP-SGD's noise to the same remaining budget, so its sigma and noise-to-signal change), costed
    again, its header stating the cut job and planned by every site; DP-SGD off where the rules chose it
    ("auto") and its noise-to-signal over the cut job is above :data:`DPSGD_MAX_NOISE`. ``sizes``: the
    smallest site's size and the DP-SGD batch cap (:func:`without_dpsgd`)."""
    old, steps = d.cfg.dpsgd_steps(facts.size), rounds * LOCAL_STEPS
    cfg = d.cfg.replace(dpsgd={"steps": steps}, federation={"rounds": rounds})
    noise = job_dpsgd_noise(d.facts, cfg.to_dict())
    if d.facts.dpsgd == "auto" and noise > DPSGD_MAX_NOISE:
        off = (
            f"{why}: cut to {steps} steps its noise-to-signal over the job is {noise:.4f}, above "
            f"{DPSGD_MAX_NOISE:.4f}"
        )
        return _dpsgd_off(facts, policies, *sizes, off)[0]
    # the cut job's header, its q read off the facts (the signed batch over the smallest site)
    fresh = notes_of(d.facts, cfg, steps)
    cut = f"; cut from {old} to {steps} steps: {why}"
    stated = {k: next(n for n in fresh if n.startswith(k)) for k in ("dpsgd:", "estimated ")}
    notes = tuple(
        next((v + cut * (k == "dpsgd:") for k, v in stated.items() if n.startswith(k)), n) for n in d.notes
    )
    d, refusal = summed_as_every_site_plans(
        replace(d, cfg=cfg, estimate=estimate(cfg, d.facts), notes=notes), facts, policies
    )
    if refusal:
        raise ConfigError(f"derived federated job: {refusal}")
    return d


def site_refusals(cfg: Any, policies: Sequence[Any]) -> list[tuple[str, str, str]]:
    """Every (site, rule, message) by which a site's node would refuse ``cfg`` signed for all the sites: the
    node's own admission (``edge.admission.admit``: resources, every mechanism's allowed, min_sigma and caps,
    the budget), the job judged in the form the node charges it (its declared image shape and classes). Who
    signs is checked when the job is signed: here it is signed by a throw-away key each site is told to
    allow, so every other rule is judged as the node judges it."""
    key = Ed25519PrivateKey.generate()
    signed = sign_job(cfg, key, "derived", [p.site_id for p in policies])
    trusted = (public_key_pem(key.public_key()),)
    out = []
    for p in policies:
        shape = (tuple(p.declared.image_shape), int(p.declared.n_classes))
        res = admit(replace(p, coordinators=trusted), signed, source="the derived job", data_shape=shape)
        out += [(p.site_id, rule, msg) for rule, msg in res.failures]
    return out


def refused(site: str, rule: str, message: str, remedy: str = "") -> PolicyViolation:
    """A site's refusal of the derived job in one line: its rule, why, and who fixes it; ``remedy``: the
    header's note of what was already changed to fit the sites' DP-SGD rules."""
    for head in (f"site {site}: policy rule {rule}: ", f"site {site}: "):
        message = message.removeprefix(head)
    after = f" ({remedy})" if remedy else ""
    # a budget refusal names its own fix (whose number is the limit: edge.admission explains it)
    fix = (
        ""
        if "fix:" in message
        else f"; fix: the site changes {rule} in its POLICY (raise version, re-sign) if its administrator "
        "accepts such a job, or the coordinator derives with other options (--epsilon, --time-budget, "
        "--for-device)"
    )
    return PolicyViolation(
        rule,
        f"the derived federated job{after} would be refused by this site's node: {' '.join(message.split())}"
        + fix,
        site=site,
    )


def summed_as_every_site_plans(
    d: Derivation, facts: DataFacts, policies: Sequence[Any]
) -> tuple[Derivation, str]:
    """(the job in a form every site's plan admits, "") or (the job, why a site refuses it). Signed for 2+
    sites a job sums by secure aggregation, where a site counts only the noise shares of the peers it pins: a
    site pinning none counts its own share alone and refuses the warm-up the rules fitted to the whole noise.
    Each site then adds the whole noise itself (``[federation] secure_aggregation = false``), the form the
    rules fitted, named in a note; the job is never signed in a form a site's plan refuses."""
    refusal = site_plan_refusal(d.cfg, facts, policies)
    if not refusal or len(policies) < 2 or d.cfg.federation.secure_aggregation is not None:
        return d, refusal
    per_site = d.cfg.replace(federation={"secure_aggregation": False})
    if site_plan_refusal(per_site, facts, policies):
        return d, refusal
    return replace(d, cfg=per_site, notes=(*d.notes, per_site_note(refusal))), ""


def per_site_note(refusal: str) -> str:
    """The header's note of a job whose every site adds the whole noise: why the secure form was refused."""
    return (
        "federation: secure_aggregation = false, each site adds the whole noise: summed securely, "
        f"{refusal} (a site counts only the noise shares of the peers it pins: pin the sites' keys, "
        "[secure_aggregation] peers, to sum securely)"
    )


def dpsgd_batch_cap(policies: Sequence[Any]) -> int:
    """The largest DP-SGD batch every site's signed policy admits (public values only): at most its
    ``dpsgd_population`` (a patient-level site's public patients: patient-level DP-SGD samples patients,
    q = batch / patients) and its ``mechanisms.dpsgd.max_batch``."""
    caps = []
    for p in policies:
        rule = p.mechanisms.get("dpsgd")
        max_batch = rule.caps.get("max_batch") if rule is not None else None
        caps.append(min(int(p.dpsgd_population), int(max_batch) if max_batch else int(p.dpsgd_population)))
    return max(1, min(caps))


def site_plan_refusal(cfg: Any, facts: DataFacts, policies: Sequence[Any]) -> str:
    """Why a site's own plan (``planning.plan`` as its node plans it: its public size, per-job budget, unit of
    privacy and patient cap from its policy) refuses the signed job; "" when every site plans it. The job is
    planned in the form it is signed in (``JobConfig.with_secure_default``: secure aggregation for 2+ sites),
    where a site counts only the noise shares of the peers it pins (``planning.SecureSite``)."""
    cfg = cfg.with_secure_default(len(policies))
    for p in policies:
        try:
            plan(
                cfg,
                int(p.dataset_size),
                federated=True,
                image_shape=facts.shape,
                n_classes=facts.n_classes,
                **site_form(cfg, p, len(policies)),
            )
        except PrivacyError as exc:
            return f"site {p.site_id}'s plan refuses it: {exc}"
    return ""


def federated_job(facts: DataFacts, site_size: int, batch_cap: int | None = None) -> Derivation:
    """The job derived from a federation's ``facts`` with its sampling rates turned into the one batch every
    site is signed for (a signed federated job carries batches, not rates: each site's q = batch / its own
    size); ``batch_cap``: the largest DP-SGD batch every site's policy admits (:func:`dpsgd_batch_cap`)."""
    d = derive(facts)
    c, s = d.cfg.central, d.cfg.dpsgd
    batch = max(1, min(site_size, round((s.rate or 0.0) * site_size)))
    capped = batch_cap is not None and batch > batch_cap
    cfg = d.cfg.replace(
        central={"rate": None, "batch": max(1, round((c.rate or 1.0) * site_size))},
        dpsgd={"rate": None, "batch": min(batch, batch_cap) if batch_cap is not None else batch},
    )
    note = (
        f"federation: {facts.size // site_size} site(s); one signed batch for all of them, sized at the "
        f"smallest declared site ({site_size} images): central {cfg.central.batch}, DP-SGD {cfg.dpsgd.batch}"
        + (
            f" (cut from {batch} to what every site's policy admits: its public patients or images and "
            "its mechanisms.dpsgd.max_batch)"
            if capped
            else ""
        )
    )
    notes = d.notes
    if cfg.federated_rounds > 0:  # the dpsgd line restated for the signed batch (its q, after any cut)
        said = next(n for n in notes_of(facts, cfg, cfg.dpsgd_steps(facts.size)) if n.startswith("dpsgd:"))
        notes = tuple(said if n.startswith("dpsgd:") else n for n in notes)
    return replace(d, cfg=cfg, notes=notes[:-1] + (note,) + notes[-1:])
