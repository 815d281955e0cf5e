"""``feta-release privacy``: plan a job's privacy budget before touching data; account a saved event
history."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError, PrivacyError


@click.group()
def privacy() -> None:
    """Plan and account privacy budgets."""


@privacy.command("plan")
@click.argument("job_file", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--dataset-size",
    "--size",
    "-n",
    type=click.IntRange(min=1),
    default=None,
    help="Public number of training images. Default: 4000 (the embedded data's training split).",
)
@click.option(
    "--patient-cap",
    type=click.IntRange(min=1),
    default=None,
    metavar="K",
    help="The site caps each patient at K images (--patient-cap of node/site/data): state ε per PATIENT, "
    "DP-SGD sampling whole patients as `train` does. Give -n as the number of images left after the cap, "
    "and --patients P at K >= 2 (at K = 1 the patients are the -n images).",
)
@click.option(
    "--patients",
    "public_patients",
    type=click.IntRange(min=1),
    default=None,
    metavar="P",
    help="With --patient-cap: the PUBLIC number of patients; plans patient-level DP-SGD (whole patients "
    "sampled at rate q, each patient's summed gradient clipped), so DP-SGD's ε holds per patient directly "
    "(default at --patient-cap 1: -n, one image a patient).",
)
@click.option(
    "--max-images-per-person",
    type=click.IntRange(min=1),
    default=None,
    metavar="M",
    help="Without patient ids: the most images one person may have; states the group-privacy ε for them.",
)
@click.option(
    "--policy",
    "policy_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Plan JOB_FILE as a federated job at the site of this policy (signed JSON, or a TOML/JSON draft), "
    "exactly as its node will: its public size, per-job budget and unit of privacy (a patient-level policy: "
    "DP-SGD samples its public patients at q = batch / patients). Replaces -n and the patient options.",
)
@click.option(
    "--sites",
    "n_sites",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="With --policy: the number of sites the coordinator signs the job for. Default: this site and the "
    "peers its policy pins. A job of 2 or more sites sums its releases by secure aggregation unless it sets "
    "[federation] secure_aggregation = false: the plan is then the SkellamEvents the node charges.",
)
@click.option(
    "--declared-size",
    is_flag=True,
    help="-n is a DECLARED public size (`train --public-size N`): no noisy count is planned. Default: as "
    "`train` without --public-size, which draws its public size from a noisy count of the images (the "
    "event 'size', charged first) and -n is then about the count.",
)
@click.option(
    "--shape",
    default=None,
    metavar="HxWxC",
    help="Without JOB_FILE: the images' shape (e.g. 28x28x1, 64x64x3) of the job to derive.",
)
@click.option(
    "--classes",
    type=click.IntRange(min=1),
    default=None,
    help="Without JOB_FILE: the number of classes of the job to derive.",
)
@click.option(
    "--epsilon",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Without JOB_FILE: the budget of the job to derive (`train --epsilon` derives the same job).",
)
@click.option(
    "--delta",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=None,
    help="Without JOB_FILE: delta of the derived job (default: the rule of `train --delta`).",
)
@click.option(
    "--time-budget", default=None, metavar="DURATION", help="Without JOB_FILE: as `train --time-budget`."
)
@click.option(
    "--for-device",
    "for_device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Without JOB_FILE: the device the derived job is sized for.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Without JOB_FILE: the torch CPU threads the derived job is timed at, as `train --threads` "
    "(default: torch's default here, what `train` without --threads uses).",
)
@click.option(
    "--preset",
    default=None,
    metavar="NAME",
    help="Plan a shipped job as `train --preset NAME` runs it (instead of JOB_FILE): at --patients P its "
    "DP-SGD rate samples the patients (batch = rate x P), where a JOB_FILE's rate is a fraction of the "
    "images.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def plan(
    job_file: Path | None,
    dataset_size: int | None,
    patient_cap: int | None,
    public_patients: int | None,
    max_images_per_person: int | None,
    policy_path: Path | None,
    n_sites: int | None,
    declared_size: bool,
    shape: str | None,
    classes: int | None,
    epsilon: float | None,
    delta: float | None,
    time_budget: str | None,
    for_device: str,
    threads: int | None,
    preset: str | None,
    as_json: bool,
) -> None:
    """Per-stage sigma, q, steps and epsilon of JOB_FILE, the calibrated DP-SGD sigma and the total epsilon,
    and what that ε means for the unit of privacy (an image, or a patient). Without JOB_FILE: the job `train`
    derives from these public facts (--size, --shape, --classes, --epsilon), printed as TOML, and its plan.

    \b
    Example:
      feta-release privacy plan job.toml -n 9500 --patient-cap 5 --patients 2000
      feta-release privacy plan job.toml --policy site-kit/policy.signed.json
      feta-release privacy plan --size 300 --shape 64x64x3 --classes 10 --epsilon 10
    """
    from ..privacy_unit import PrivacyUnit

    derived = (shape, classes, epsilon, delta, time_budget, threads)
    if preset is not None and (job_file is not None or policy_path is not None):
        raise click.UsageError(
            "--preset plans a shipped job at -n and --patients: drop JOB_FILE and --policy"
        )
    if public_patients is not None and patient_cap is None:
        raise click.UsageError(
            "--patients plans patient-level DP-SGD, which needs patient ids: give --patient-cap K"
        )
    if job_file is None and preset is None:
        if policy_path is not None or n_sites is not None or max_images_per_person is not None:
            raise click.UsageError(
                "--policy, --sites and --max-images-per-person plan JOB_FILE: give it, or drop them"
            )
        public_patients = _planned_patients(patient_cap, public_patients, dataset_size)
        _plan_derived(
            dataset_size,
            shape,
            classes,
            epsilon,
            delta,
            time_budget,
            for_device,
            declared_size,
            as_json,
            patient_cap=patient_cap,
            public_patients=public_patients,
            threads=threads,
        )
        return
    if any(v is not None for v in derived):
        raise click.UsageError(
            "--shape, --classes, --epsilon, --delta, --time-budget and --threads describe a job to derive: "
            "drop them, or drop JOB_FILE"
        )

    if policy_path is not None:
        if (
            dataset_size is not None
            or patient_cap is not None
            or public_patients is not None
            or max_images_per_person
        ):
            raise click.UsageError(
                "--policy fixes the size and the unit of privacy: drop -n, --patient-cap, "
                "--patients and --max-images-per-person"
            )
        # (a policy's size is its administrator's declaration: nothing is drawn, --declared-size changes
        # nothing)
        assert job_file is not None  # --preset beside --policy is refused above
        _plan_for_policy(job_file, policy_path, n_sites, as_json)
        return
    if n_sites is not None:
        raise click.UsageError("--sites plans a federated job at a site: give --policy too")
    if patient_cap is not None and max_images_per_person is not None:
        raise click.UsageError(
            "give --patient-cap (patient ids known) or --max-images-per-person (unknown), not both"
        )
    # DP-SGD sampled as `train` samples it: whole patients of the public count train runs with
    public_patients = _planned_patients(patient_cap, public_patients, dataset_size)
    unit = (
        PrivacyUnit("patient", patient_cap)
        if patient_cap is not None
        else PrivacyUnit("image", max_images_per_person)
    )
    from ..planning import DEFAULT_DATASET_SIZE, patient_dpsgd
    from ..planning import plan as plan_privacy

    cfg = _planned_job(job_file, preset, public_patients, patient_cap)
    job_file = job_file or Path(f"preset:{preset}")
    assumed = dataset_size is None
    n = DEFAULT_DATASET_SIZE if dataset_size is None else dataset_size
    from ..mechanisms.count import size_event

    # --patient-cap makes the PATIENT the unit: the job's [privacy] budget is then a budget per patient
    result = plan_privacy(
        cfg,
        n,
        size=None if declared_size else size_event(),
        # DP-SGD sampled as `train` and a patient-level node sample it: whole patients at q = batch / P
        **patient_dpsgd(public_patients, patient_cap),
    )
    if as_json:
        data = result.to_dict()
        data["job"] = str(job_file)
        data["dataset_size_assumed"] = assumed
        data["privacy_unit"] = unit.statement(result.epsilon, result.delta, result.events, result.accountant)
        if public_patients is not None and (sgd := result.event("dpsgd")) is not None:
            data["privacy_unit"]["expected_patients_per_step"] = sgd.q * public_patients
        click.echo(json.dumps(data, indent=2))
        if assumed:
            click.echo(f"note: no --dataset-size given; assumed N = {n} (embedded training split)", err=True)
        return
    _print_plan(result, job_file, assumed)
    st = unit.statement(result.epsilon, result.delta, result.events, result.accountant)
    if public_patients is not None and (sgd := result.event("dpsgd")) is not None:
        click.echo(
            f"patient-level DP-SGD: each step samples patients at q = {sgd.q:.4g}, expected "
            f"{sgd.q * public_patients:.1f} of the {public_patients} public patients, divided by that"
        )
    click.echo(unit_line(st))


def _planned_job(job_file: Path | None, preset: str | None, patients: int | None, cap: int | None) -> Any:
    """The job a plan plans: JOB_FILE as `train JOB_FILE` runs it, or the preset as `train --preset` runs
    it, whose DP-SGD rate at a patient-level site samples the public patients
    (``job_rules.fit_dpsgd_to_patients``, the one function both apply)."""
    from ..config import load_job, load_preset
    from ..job_rules import PatientFacts, fit_dpsgd_to_patients

    if preset is None:
        assert job_file is not None
        return load_job(job_file)
    cfg = load_preset(preset)
    facts = None if patients is None else PatientFacts(int(patients), int(cap or 1))
    sgd = fit_dpsgd_to_patients(cfg, facts)
    return cfg.replace(dpsgd=sgd) if sgd else cfg


def _planned_patients(patient_cap: int | None, public_patients: int | None, size: int | None) -> int | None:
    """The PUBLIC patient count DP-SGD samples at --patient-cap, as `train` runs it: --patients; at a cap of
    1 the public size (-n), the cap leaving one image a patient (`train` counts them once). At a cap of 2 or
    more without --patients, `train` draws the count (a noisy count, charged first) and samples patients at
    q = batch / that count, which no plan knows: refused, naming the option. (Planned over the images
    instead, DP-SGD would be a job no patient-level site runs, its σ and ε not what the ledger charges.)"""
    from ..planning import DEFAULT_DATASET_SIZE

    if patient_cap is None or public_patients is not None:
        return public_patients
    if patient_cap == 1:
        return size if size is not None else DEFAULT_DATASET_SIZE
    raise click.UsageError(
        f"--patient-cap {patient_cap} without --patients: `train` then draws the patient count (a noisy "
        "count, the event 'patients', charged first) and samples patients at q = batch / that count, which "
        "no plan knows before the draw; give --patients P (the public count: train --public-patients P)"
    )


def parse_shape(text: str) -> tuple[int, int, int]:
    """'28x28x1' / '64x64' (H x W [x C]) -> (C, H, W); anything else refused naming the form."""
    parts = text.lower().replace(",", "x").split("x")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        nums = []
    if len(nums) not in (2, 3) or min(nums) < 1:
        raise ConfigError(f"--shape: {text!r} is not HxWxC (e.g. 28x28x1, 64x64x3)")
    h, w, c = (nums + [1])[:3]
    return c, h, w


def _plan_derived(
    size: int | None,
    shape: str | None,
    classes: int | None,
    eps: float | None,
    delta: float | None,
    time_budget: str | None,
    device: str,
    declared: bool,
    as_json: bool,
    *,
    patient_cap: int | None = None,
    public_patients: int | None = None,
    threads: int | None = None,
) -> None:
    """The job derived from public facts (feta_release.job_rules), as TOML, and its plan, timed at
    ``threads`` CPU threads (default: torch's here, as `train`); per patient with
    ``patient_cap``; with ``public_patients`` too, planned and timed as ``train`` runs it at a patient-level
    site (DP-SGD samples whole patients at q = batch / patients, each step padded to whole patients' images:
    ``job_rules.PatientFacts``)."""
    if shape is None or classes is None or eps is None:
        raise click.UsageError(
            "give JOB_FILE, or --shape, --classes and --epsilon (and --size) to plan the job "
            "`train` derives from them"
        )
    from ..job_rules import DataFacts, PatientFacts, derivation_toml, derive
    from ..mechanisms.count import size_event
    from ..planning import DEFAULT_DATASET_SIZE, patient_dpsgd
    from ..planning import plan as plan_privacy
    from .derive_options import parse_duration, run_threads

    c, h, w = parse_shape(shape)
    n = DEFAULT_DATASET_SIZE if size is None else size
    facts = DataFacts(
        size=n,
        height=h,
        width=w,
        channels=c,
        n_classes=classes,
        epsilon=eps,
        delta=delta,
        device=device,  # type: ignore[arg-type]  # click.Choice: "cpu" or "cuda", typed str
        time_budget=parse_duration(time_budget) if time_budget else None,
        size_drawn=not declared,
        patients=None if public_patients is None else PatientFacts(public_patients, int(patient_cap or 1)),
        threads=run_threads(threads),
    )
    d = derive(facts)
    result = plan_privacy(
        d.cfg,
        n,
        image_shape=(c, h, w),
        n_classes=classes,
        size=None if declared else size_event(),
        **patient_dpsgd(public_patients, patient_cap),
    )
    if as_json:
        click.echo(
            json.dumps(
                {
                    **result.to_dict(),
                    "job": "derived",
                    "derived_job": d.cfg.to_dict(),
                    "notes": list(d.notes),
                    "estimated_seconds": d.estimate.seconds,
                },
                indent=2,
            )
        )
        return
    click.echo(derivation_toml(d))
    _print_plan(result, Path("derived job"), size is None)


def _read_policy(path: Path) -> Any:
    """A site policy for planning: a signed one (its integrity checked, not who signed it: planning trusts
    nothing) or an unsigned draft (validated)."""
    from ..policy.document import SitePolicy, read_policy_document, read_signed_policy_unverified
    from ..policy.envelope import read_json

    if (
        path.suffix.lower() == ".json"
        and isinstance(raw := read_json(path, "policy"), dict)
        and "signature" in raw
    ):
        return read_signed_policy_unverified(path)[0]
    return SitePolicy.from_document(read_policy_document(path), None, str(path))


def _plan_for_policy(job_file: Path, policy_path: Path, n_sites: int | None, as_json: bool) -> None:
    """The federated plan of JOB_FILE at one site, as its node makes it (``edge.admission.request_for``; a
    secure job: ``planning.secure_site_events``, the history the node charges and the coordinator plans)."""
    from ..config import load_job
    from ..planning import plan as plan_privacy
    from ..planning import site_form
    from ..privacy_unit import site_unit_statement

    pol = _read_policy(policy_path)
    n_sites = n_sites if n_sites is not None else 1 + len(pol.peers)
    # the secure default the coordinator's signed job resolves (>= 2 sites: secure unless the job says not)
    cfg = load_job(job_file).with_secure_default(n_sites)
    # a job written with sampling rates: the coordinator sizes each site's batches (central over the public
    # images, DP-SGD over the public population DP-SGD samples: the patients of a patient-level site)
    if cfg.central.rate is not None:
        cfg = cfg.replace(central={"batch": max(1, round(cfg.central.rate * pol.dataset_size))})
    if cfg.dpsgd.rate is not None:
        cfg = cfg.replace(dpsgd={"batch": max(1, round(cfg.dpsgd.rate * pol.dpsgd_population))})
    form = site_form(cfg, pol, n_sites)
    if cfg.federation.secure_aggregation:
        shape, classes = _declared_shape(pol, policy_path)
        result = plan_privacy(
            cfg, int(pol.dataset_size), federated=True, image_shape=shape, n_classes=classes, **form
        )
    else:
        result = plan_privacy(cfg, int(pol.dataset_size), federated=True, **form)
    st = site_unit_statement(pol, result.epsilon, result.delta, result.events, result.accountant)
    if as_json:
        data = {
            **result.to_dict(),
            "job": str(job_file),
            "policy": str(policy_path),
            "site_id": pol.site_id,
            "federated": True,
            "sites": n_sites,
            "secure_aggregation": bool(cfg.federation.secure_aggregation),
            "privacy_unit": st,
        }
        click.echo(json.dumps(data, indent=2))
        return
    _print_plan(result, job_file, False)
    _print_site_lines(cfg, pol, policy_path, n_sites, result)
    click.echo(unit_line(st))


def _declared_shape(pol: Any, policy_path: Path) -> tuple[tuple[int, int, int], int]:
    """(image shape, classes) of a policy's declared data: a secure sum's sensitivities depend on them."""
    d = pol.declared
    if d is None:
        raise ConfigError(
            f"{policy_path}: the policy declares no dataset.classes / dataset.image_shape; a secure-"
            "aggregation job's events depend on them: add them (`site init` drafts them from the data)"
        )
    c, h, w = (int(v) for v in d.image_shape)
    return (c, h, w), len(d.class_names)


def _print_site_lines(cfg: Any, pol: Any, policy_path: Path, n_sites: int, result: Any) -> None:
    fed = cfg.federation
    mode = (
        f"secure aggregation over {n_sites} sites (Skellam noise shares; "
        f"{pol.counted_colluders(n_sites)} colluder(s) assumed)"
        if fed.secure_aggregation
        else f"per-site noise, {n_sites} site(s)"
    )
    rounds = (
        f"{fed.rounds} FedSGD round(s)"
        if fed.secure_aggregation and fed.fedsgd
        else (f"{fed.rounds} round(s) x {fed.local_steps} local step(s)")
    )
    click.echo(f"site {pol.site_id} (policy {policy_path}): federated plan, {mode}, {rounds}")
    if result.worst_case_epsilon is not None:
        click.echo(
            f"worst case (every other site colluding: own noise share only): epsilon "
            f"{result.worst_case_epsilon:.3f} (cap {pol.worst_case_cap:g})"
        )
    sgd = result.event("dpsgd")
    if pol.privacy_unit == "patient" and sgd is not None:
        click.echo(
            f"patient-level DP-SGD: q = batch / public patients = {cfg.dpsgd.batch} / {pol.patients} = "
            f"{sgd.q:.4g}; each step's noisy sum is divided by q x {pol.patients}"
        )


def unit_line(st: dict[str, Any]) -> str:
    """The one form of the privacy-unit line of both plans (local and ``--policy``), from a unit statement
    (``PrivacyUnit.statement`` / ``site_unit_statement``): what is protected, at which (ε, δ), how, and the
    optional facts the statement carries (public patients, sensitivity, a person's group figure)."""
    if st["unit"] == "patient":
        who = f"at most {st['images_per_patient_cap']} image(s) each" + (
            f", {st['public_patients']} public patients" if "public_patients" in st else ""
        )
        line = (
            f"unit of privacy: the PATIENT ({who}): ε per patient {st['epsilon_per_patient']:.3f} at δ "
            f"{st['delta_per_patient']:.3g} ({st['how']})"
        )
        return line + (f"; sensitivity: {st['sensitivity']}" if "sensitivity" in st else "")
    line = (
        f"unit of privacy: one IMAGE: ε {st['epsilon_per_image']:.3f} at δ {st['delta_per_image']:.3g} "
        f"({st['how']})"
    )
    if "largest_group" in st:
        line += (
            f"; a person with {st['largest_group']} images: ε {st['epsilon_for_largest_group']:.3f} at δ "
            f"{st['delta_for_largest_group']:.3g}"
        )
    return line


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print_plan(result: Any, job_file: Path, assumed: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    title = f"privacy plan for {job_file} (N = {result.dataset_size}{', assumed' if assumed else ''})"
    table = Table(title=title)
    for col, just in [
        ("stage", "left"),
        ("sigma", "right"),
        ("q", "right"),
        ("steps", "right"),
        ("epsilon alone", "right"),
        ("share", "right"),
        ("noise/ signal", "right"),
        ("note", "left"),
    ]:
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for s in result.stages:
        table.add_row(
            s.stage,
            _fmt(s.sigma, ".3f"),
            _fmt(s.q, ".4g"),
            str(s.steps) if s.enabled else "-",
            f"{s.epsilon:.3f}",
            f"{100 * s.share:.0f}%",
            _fmt(s.noise_to_signal, ".3f"),
            s.note,
        )
    console.print(table)
    for s in result.stages:
        if s.noise_note:
            console.print(escape(f"noise/signal [{s.stage}]: {s.noise_note}"))
    if result.noise_multiplier is not None:
        how = "calibrated" if result.calibrated else "configured"
        console.print(f"DP-SGD noise multiplier ({how}): [bold]{result.noise_multiplier:.3f}[/bold]")
    console.print(
        f"total epsilon over the whole history: [bold]{result.epsilon:.3f}[/bold] at delta = "
        f"{result.delta:g} (budget {result.target_epsilon:g}, {result.accountant} accountant)"
    )
    console.print("shares are of the sum of per-stage epsilons; composed, the total is smaller than that sum")
    for w in result.warnings:
        console.print(f"[yellow]warning[/yellow]: {escape(w)}")
    if assumed:
        console.print(
            f"note: no --dataset-size given; assumed N = {result.dataset_size} (embedded training split)"
        )


def _statement_inputs(
    path: Path, raw: dict, delta: float | None, accountant: str | None, patient_cap: int | None
) -> tuple[Any, float | None, str | None, int | None]:
    """(events, delta, accountant, patient cap) of a JSON object: a history ``{"history": [...]}`` or a site's
    statement (bare, or signed as ``{"statement": ..., "signature": ...}``), whose ``history`` is a WORD
    (where its events come from, e.g. "site-ledger") and whose events are ``events``. A statement's
    ``privacy_unit`` carries its SIGNED images-per-patient cap: every per-patient figure holds over that cap
    only, so a different --patient-cap is refused rather than silently stating another site's figure."""
    from ..privacy_unit import statement_patient_cap

    if isinstance(raw.get("statement"), dict):
        raw = raw["statement"]
    history = raw.get("history")
    items = history if isinstance(history, list) else raw.get("events")
    if items is None:
        raise PrivacyError(f'{path}: object has no "history" or "events" list')
    signed = statement_patient_cap(raw)
    if signed is not None and patient_cap is not None and patient_cap != signed:
        raise PrivacyError(
            f"{path}: --patient-cap {patient_cap} differs from the statement's signed cap of {signed} images "
            "per patient, over which its per-patient figure holds; drop --patient-cap"
        )
    delta = raw.get("delta") if delta is None else delta
    return items, delta, accountant or raw.get("accountant"), patient_cap or signed


@privacy.command("account")
@click.argument("history_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--delta", type=float, default=None, help='Target delta (default: the file\'s "delta").')
@click.option(
    "--accountant",
    type=click.Choice(["rdp", "prv"]),
    default=None,
    help='Accountant (default: the file\'s "accountant", else rdp).',
)
@click.option(
    "--patient-cap",
    type=click.IntRange(min=1),
    default=None,
    metavar="K",
    help="The history is a patient-level site's (at most K images a patient): state ε PER PATIENT, the "
    "figure its caps bound (default: a site statement's own cap, its privacy_unit; a K other than that "
    "signed cap is refused).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def account(
    history_file: Path, delta: float | None, accountant: str | None, patient_cap: int | None, as_json: bool
) -> None:
    """Total epsilon of a saved event history (a list of events, or an object with "history" or "events",
    such as a site's signed statement); per patient at a patient-level site (--patient-cap, or the
    statement's).

    \b
    Example:
      feta-release privacy account history.json --delta 1e-5 --accountant prv
    """
    from ..accounting import epsilon_breakdown, events_from_list, unit_epsilon, unit_name

    try:
        raw = json.loads(history_file.read_text("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{history_file}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{history_file}: not a readable JSON file: {exc}") from None
    if isinstance(raw, dict):
        items, delta, accountant, patient_cap = _statement_inputs(
            history_file, raw, delta, accountant, patient_cap
        )
    else:
        items = raw
    if not isinstance(items, list):
        raise PrivacyError(
            f"{history_file}: the event history must be a list of {{stage, sigma, q, steps}} objects"
        )
    if delta is None:
        raise PrivacyError(f"{history_file}: no delta in the file; pass --delta")
    accountant = accountant or "rdp"
    try:
        events = events_from_list(items)
    except PrivacyError as exc:
        raise PrivacyError(f"{history_file}: {exc}") from None
    total = unit_epsilon(events, delta, accountant, patient_cap=patient_cap)  # type: ignore[arg-type]
    breakdown = epsilon_breakdown(events, delta, accountant, patient_cap=patient_cap)  # type: ignore[arg-type]
    per_stage = {k: v for k, v in breakdown.items() if k != "total"}
    unit = unit_name(patient_cap)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "epsilon": total,
                    "delta": delta,
                    "accountant": accountant,
                    "unit": unit,
                    "images_per_patient_cap": patient_cap,
                    "stages": per_stage,
                    "events": len(events),
                },
                indent=2,
            )
        )
        return
    what = "epsilon" if patient_cap is None else "epsilon per PATIENT"
    for stage, eps in per_stage.items():
        click.echo(f"{stage:<10} {what} alone {eps:.3f}")
    click.echo(f"total {what} {total:.3f} at delta {delta:g} ({accountant}, {len(events)} events)")
    if patient_cap is None and any(getattr(e, "unit", "image") == "patient" for e in events):
        click.echo(
            "note: the history holds patient-level DP-SGD, but no patient cap is known: these figures "
            "compose the events as if each protected one image, less than one patient can lose; give "
            "--patient-cap K (the site's dataset.patient_cap) for epsilon per patient"
        )
