"""``feta-release train``: one site's job run as a federation of ONE, in one process.

The site is a node's (``edge.site.Site.in_memory``: its policy's signature, validity and version, its site
key and its keyed commitment to the images loaded here, which are never copied onto disk); it answers through
the node's handlers (``edge.clientapp``: verify, replay, policy, charge, compute, record). The coordinator is
``federation.job.run_job``'s ``JobDriver``, over the in-process Grid (``federation.harness``). So ``train``
has no stage loop, ledger account, report, chart or release builder of its own: a fix to either side lands
here too (docs/architecture.md, "A federation of one").

Run directory (``RUN_DIR``): the coordinator's job directory (``signed_job.json``, ``plan.json``,
``progress.jsonl``, ``state/``, ``released/``, ``model.pt``, ``job_summary.json``, ``attestations.json``,
``policies/``, ``privacy_report.*``, ``budget.svg``, ``samples.png``, ``release/``), beside it
``grids/NN-<stage>.png`` (drawn at the driver's stage boundaries), ``synthetic.npz``, the run's own policy
(``policy.signed.json``, keys under ``keys/``) and ``COMPLETE`` (written last); the site's private side under
``site/`` (ledger, site key, work directory with the round checkpoints; never exported).

Resume: the same command continues. The driver's ``state/`` holds what it collected; a request sent again
carries its deterministic id, which the site's ledger answers from its record without charging twice; a
DP-SGD round killed after its charge is finished from the site's checkpoint (``--checkpoint-every``).

Public size: declared (``--public-size``, or the signed policy's), else drawn before the site is opened: a
noisy count (``mechanisms.count``), charged first in the site's ledger under the job's id, so the site and the
coordinator both count it first in the job's history (``mechanisms.count.counted_events``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.markup import escape

from edge.clientapp import app
from edge.site import (
    CFG_DEVICE,
    CFG_HELD,
    CFG_LEDGER,
    CFG_POLICY,
    CFG_ROUND_CHECKPOINT,
    CFG_SECRET,
    CFG_SITE_KEY,
    CFG_TRUSTED,
    CFG_WORK,
    Site,
    declared_schema,
    hold_site,
    release_site,
    verify_policy_file,
)
from feta_release.accounting import PrivacyEvent, events_from_list, per_unit, unit_name
from feta_release.config import JobConfig
from feta_release.data import ImageDataset
from feta_release.data.commitment import dataset_commitment, ensure_secret
from feta_release.data.declared import DataDeclaration
from feta_release.errors import ConfigError
from feta_release.federation.harness import HarnessNode, InProcessGrid
from feta_release.federation.job import run_job
from feta_release.files import atomic_write_bytes, private_dir
from feta_release.ledger import Budget, Ledger, as_budget
from feta_release.ledger_chain import make_private_dirs
from feta_release.mechanisms.count import (
    PATIENTS_STAGE,
    SIZE_SIGMA,
    SIZE_STAGE,
    draw_public_size,
    patients_event,
    size_event,
)
from feta_release.models import generate
from feta_release.planning import PrivacyPlan, merged, patient_dpsgd
from feta_release.planning import plan as privacy_plan
from feta_release.policy import make_policy, sign_policy, write_signed_policy
from feta_release.policy.envelope import read_json
from feta_release.policy.jobs import sign_job
from feta_release.privacy_unit import PatientIndex, figure_unit_words, job_in_unit, statement_patient_cap
from feta_release.progress_events import job_log
from feta_release.randomness import os_numpy_generator
from feta_release.release.jobdir import RELEASE, build_release, privacy_report, sample_grid, synthetic_set
from feta_release.release.jobfiles import SIGNED_JOB
from feta_release.signing import generate_keypair, load_private_key
from feta_release.stages.context import seed_from
from feta_release.stages.pretrain import PublicInputs, with_public
from feta_release.training.data_checks import check_data, check_data_content
from feta_release.training.device import resolve_device
from feta_release.training.progress import Reporter
from feta_release.viz import epsilon_title, save_grid

SITE_DIR = "site"  # the site's private side: ledger, site key, work directory (never exported)
RUN_POLICY = "policy.signed.json"  # the run's own one-site policy (no --policy)
RUN_ADMIN_KEY = "keys/policy-admin.key"
RUN_DATA_SECRET = "keys/data.secret"
RUN_COORDINATOR_KEY = "keys/coordinator.key"
COMPLETE = "COMPLETE"
SIZE_RECORD = "size.json"  # site/: the job id the drawn public size was charged under
_HOLD = "train"  # the held site's name in this process (edge.site.hold_site)


@dataclass
class TrainOptions:
    """How ``train`` runs its job (the CLI's options). Paths are the user's files; None: the run's own."""

    n_synthetic: int | None = None  # images in synthetic.npz (default: the public size)
    checkpoint_every: int = 10  # DP-SGD steps between the site's round checkpoints
    grid_per_class: int = 8
    reporter: Reporter | None = None
    public_size: int | None = None
    device: str = "cpu"
    ledger: Path | None = None  # a site's own, shared ledger (needs policy)
    site_key: Path | None = None
    policy: Path | None = None  # the site's signed policy, with trusted and data_secret
    trusted: Path | None = None
    data_secret: Path | None = None
    coordinator_key: Path | None = None
    site_id: str | None = None
    patients: PatientIndex | None = None
    # the patient count is not declared: drawn first (a noisy count), or at a cap of 1 the public size
    draw_patients: bool = False
    job_for_size: Callable[[int], JobConfig] | None = None
    public: PublicInputs | None = None
    release: bool = True


@dataclass
class TrainResult:
    run_dir: Path
    epsilon: float
    delta: float
    events: list[Any]
    dpsgd_sigma: float | None
    dpsgd_steps_trained: int
    seconds: float
    release: Path | None = None
    resumed: bool = False
    already_complete: bool = False
    # a patient-level site's signed figure, the one its caps bound (``epsilon`` composes the events as if
    # each protected one image); None at an image-level site
    epsilon_per_patient: float | None = None


@dataclass
class _SiteFiles:
    """Where the run's site keeps its private side, and the policy it is opened under."""

    root: Path
    key: Path
    ledger: Path
    work: Path
    policy: Path
    trusted: Path
    secret: Path
    # ``--policy``: the site's SitePolicy, verified once (:func:`_site_files`); the job's public size and site
    # id and the site itself are taken from it, never from the file read again (it may have been replaced)
    verified: Any = None

    def node_config(self, opts: TrainOptions) -> dict[str, Any]:
        return {
            CFG_HELD: _HOLD,
            CFG_POLICY: str(self.policy),
            CFG_TRUSTED: str(self.trusted),
            CFG_LEDGER: str(self.ledger),
            CFG_SITE_KEY: str(self.key),
            CFG_SECRET: str(self.secret),
            CFG_WORK: str(self.work),
            CFG_DEVICE: opts.device,
            CFG_ROUND_CHECKPOINT: int(opts.checkpoint_every),
        }


def run_train(cfg: JobConfig, data: ImageDataset, out_dir: str | Path, opts: TrainOptions) -> TrainResult:
    """Run (or resume) ``cfg`` on ``data`` as a federation of one into ``out_dir``; see the module doc."""
    t0 = time.perf_counter()
    resolve_device(opts.device)  # refuse an absent GPU before anything is written
    rep = opts.reporter or Reporter(enabled=False)
    root = _run_dir(Path(out_dir))  # checked; made once the job is known to run (or to draw its size)
    resumed = (root / SIGNED_JOB).is_file()
    if (root / COMPLETE).is_file():
        rep.log(f"[green]{escape(str(root))} is already complete[/]; nothing to do")
        return _result(root, None, time.perf_counter() - t0, resumed=True, already_complete=True)
    cfg = with_public(cfg, opts.public, data.image_shape)  # named in the job: its hash covers the inputs
    files = _site_files(root, opts)
    job_id, n_pub, patients, counted = _public_counts(cfg, data, files, opts, rep)
    if opts.job_for_size is not None:  # a job derived from the public facts
        cfg = with_public(opts.job_for_size(n_pub), opts.public, data.image_shape)
    cfg = cfg.for_size(n_pub)  # sampling rates -> batches for the PUBLIC size
    plan = _plan(cfg, data, n_pub, patients, counted, declared=opts.policy is not None)
    for w in plan.warnings:
        rep.warn(w)
    _make_site(files)  # (a drawn size made it already)
    ckey = _coordinator_key(root, opts)
    verified = files.verified
    if opts.policy is None:  # made BEFORE the first release of the job, committing to these images
        _run_policy(root, files, data, cfg, plan, ckey, opts.site_id, patients)
        verified = verify_policy_file(files.policy, files.trusted)
    # the job is signed to, and the site runs under, the one policy object verified here (a site's --policy:
    # the one its public size came from)
    signed = _signed_job(root, cfg, n_pub, ckey, job_id, str(verified.site_id))
    _log_start(rep, cfg, data, plan, files, resumed)
    site = Site.in_memory(files.node_config(opts), data, patients, verified=verified)
    hold_site(_HOLD, site)
    try:
        grid = InProcessGrid({1: HarnessNode(app, files.node_config(opts))})
        run_job(
            grid,
            signed,
            root,
            coordinator_key=ckey,
            progress=lambda ev: _progress(rep, ev),
            wait_timeout=5.0,
            poll_interval=0.05,
            device=opts.device,
            public=opts.public,
            observe=_grids(root, cfg, data, site, str(signed["job"]["job_id"]), opts.grid_per_class),
        )
    finally:
        release_site(_HOLD)
    release = _finish(root, cfg, ckey, n_pub, opts, require_policy=True)
    return _result(root, plan, time.perf_counter() - t0, release=release, resumed=resumed)


# -- the run directory -----------------------------------------------------------------------------


def _run_dir(root: Path) -> Path:
    """``root``, new or a run to resume; a file, or a non-empty folder that holds no run, is refused."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{root}: exists and is not a directory")
    if root.exists() and any(root.iterdir()) and not (root / SITE_DIR).is_dir():
        raise ConfigError(
            f"{root}: directory is not empty and holds no run (no {SITE_DIR}/): not a feta-release run; "
            "choose an empty or new --out directory"
        )
    return root


def _site_files(root: Path, opts: TrainOptions) -> _SiteFiles:
    """Where the site's private side lies (``RUN_DIR/site/``), its key (given, or the run's own), its ledger
    (``--ledger`` a site's own, shared one: only under the site's signed policy) and the policy's files.
    Nothing is written here (:func:`_make_site`)."""
    site = root / SITE_DIR
    if opts.ledger is not None and opts.policy is None and not _inside(opts.ledger, root):
        raise ConfigError(
            f"{opts.ledger}: a site ledger outside the run directory is charged under the site's signed "
            "policy; give --policy SITE.signed.json --trusted ADMIN.pub --data-secret SECRET (or omit "
            "--ledger)"
        )
    key = opts.site_key if opts.site_key is not None else site / "keys" / "site.key"
    if opts.policy is not None:
        if opts.trusted is None or opts.data_secret is None:
            raise ConfigError(
                f"{opts.policy}: a site's policy needs --trusted ADMIN.pub (the key that signed it) and "
                "--data-secret SECRET (the key of its data commitment), as `node start` does"
            )
        # read and verified ONCE: the public size, the site id and the site's policy all come from this object
        # (a file replaced after a read would have the job signed for one policy and run under another).
        # Refused as `node start` refuses it (its public classes and shape are what every release states),
        # before the run directory is written or anything charged
        verified = verify_policy_file(opts.policy, opts.trusted)
        declared_schema(verified, str(opts.policy))
        policy, trusted, secret = opts.policy, opts.trusted, opts.data_secret
    else:
        verified = None
        policy, trusted, secret = (
            root / RUN_POLICY,
            root / "keys" / "policy-admin.pub",
            root / RUN_DATA_SECRET,
        )
    ledger = opts.ledger if opts.ledger is not None else site / "ledger.sqlite"
    return _SiteFiles(
        site, Path(key), Path(ledger), site / "work", Path(policy), Path(trusted), Path(secret), verified
    )


def _make_site(files: _SiteFiles) -> None:
    """The site's private side (0700, for the run's account only: its ledger, key and round checkpoints)
    and the run's own site key (made once, when none is given)."""
    # the run's folders still to be made too, not to the umask: its site's ledger lies below them, and a
    # ledger below a folder others can write is refused (edge.ledger_anchor.refuse_open_folders)
    make_private_dirs(files.root)
    private_dir(files.root)
    if files.key == files.root / "keys" / "site.key" and not files.key.exists():
        generate_keypair(private_dir(files.key.parent), "site")


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _coordinator_key(root: Path, opts: TrainOptions) -> Any:
    """The key that signs the job and the release (``--coordinator-key``, else the run's own, made once)."""
    if opts.coordinator_key is not None:
        return load_private_key(opts.coordinator_key)
    path = root / RUN_COORDINATOR_KEY
    if not path.exists():
        generate_keypair(private_dir(path.parent), "coordinator")
    return load_private_key(path)


def _new_job_id(cfg: JobConfig) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", cfg.job.name)[:64] or "job"
    return f"local-{name}-{secrets.token_hex(6)}"


# -- the public size (the site's administration, before the site is opened) --------------------------


def _public_counts(
    cfg: JobConfig, data: ImageDataset, files: _SiteFiles, opts: TrainOptions, rep: Reporter
) -> tuple[str | None, int, PatientIndex | None, list[PrivacyEvent]]:
    """(job id when the size was drawn, public size, patient index, the noisy counts charged for it).

    A patient count that is not declared (``opts.draw_patients``) is drawn, unless the patient cap is 1:
    the cap then leaves one image per patient, so the patients ARE the images and the public size (declared,
    or drawn from the count of the same images) is the public patient count too, post-processing of that one
    count. Drawn a second time, the same number cost a second charge, and DP-SGD sampled patients at q =
    batch / that second draw while the job was derived, planned and stated at batch / the size (refused after
    both charges where the draw fell under the batch)."""
    patients = opts.patients
    if opts.policy is not None:  # the size the policy verified once declares (_site_files)
        return None, int(files.verified.dataset_size), patients, []
    one_each = patients is not None and opts.draw_patients and patients.cap == 1
    exact = {SIZE_STAGE: data.n} if opts.public_size is None else {}
    if patients is not None and opts.draw_patients and not one_each:
        exact[PATIENTS_STAGE] = patients.n_patients
    if not exact:
        assert opts.public_size is not None
        return None, int(opts.public_size), _images_as_patients(patients, opts.public_size, one_each), []
    # only what does not read the exact count is checked before the draw (a refusal at the exact count would
    # be an un-noised function of it)
    check_data_content(cfg, data)
    _make_site(files)
    job_id, drawn = _drawn(cfg, files, exact, rep)
    if patients is not None and PATIENTS_STAGE in drawn:
        patients = dataclasses.replace(patients, n_public=drawn[PATIENTS_STAGE])
    n_pub = drawn.get(SIZE_STAGE, opts.public_size)
    assert n_pub is not None
    patients = _images_as_patients(patients, n_pub, one_each)
    return job_id, int(n_pub), patients, [_COUNT_EVENTS[stage]() for stage in exact]


def _images_as_patients(patients: PatientIndex | None, n_pub: int, one_each: bool) -> PatientIndex | None:
    """``patients`` with the public size as its public patient count where the cap leaves one image each."""
    if patients is None or not one_each:
        return patients
    return dataclasses.replace(patients, n_public=int(n_pub))


_COUNT_EVENTS = {SIZE_STAGE: size_event, PATIENTS_STAGE: patients_event}
_COUNT_WORDS = {SIZE_STAGE: "size N =", PATIENTS_STAGE: "number of patients ="}


def _drawn(
    cfg: JobConfig, files: _SiteFiles, exact: dict[str, int], rep: Reporter
) -> tuple[str, dict[str, int]]:
    """(job id, stage -> public count): each count of ``exact`` with Gaussian noise, charged in the site's
    ledger under the job's id BEFORE it is drawn (one request per count), its value recorded as the
    request's answer. A resume reads the recorded answers back; a count charged and never recorded (a kill in
    between) is refused, as a node refuses such a release."""
    record = files.root / SIZE_RECORD
    job_id = json.loads(record.read_text("utf-8"))["job_id"] if record.is_file() else _new_job_id(cfg)
    atomic_write_bytes(record, json.dumps({"job_id": job_id}).encode())  # before the first charge
    p = cfg.privacy
    budget = Budget(
        job_epsilon=float(p.epsilon), lifetime_epsilon=math.inf, delta=float(p.delta), accountant=p.accountant
    )
    drawn, said = {}, []
    with Ledger(files.ledger, key=load_private_key(files.key)) as led:
        for stage, n in exact.items():
            rid, ev = f"{job_id}:{stage}:0", [_COUNT_EVENTS[stage]()]
            prior = led.check(job_id, rid, stage, ev, budget)  # refuses a charged, never-recorded count
            if prior is None:
                led.charge(job_id, rid, stage, ev, budget)
                value = draw_public_size(n, os_numpy_generator())
                led.record_response(rid, json.dumps({"count": value, "sigma": SIZE_SIGMA}).encode())
                said.append(f"{_COUNT_WORDS[stage]} {value:,}")
            else:
                value = int(json.loads(bytes(prior.response or b"{}"))["count"])
            drawn[stage] = int(value)
    if said:
        rep.log(
            escape(
                f"public {', '.join(said)}: drawn from a noisy count (Gaussian, noise std {SIZE_SIGMA:g}, "
                "charged first); rates, denominators and the default number of synthetic images use it "
                "(declare a figure you would publish anyway with --public-size / --public-patients)"
            )
        )
    return job_id, drawn


def _plan(
    cfg: JobConfig,
    data: ImageDataset,
    n_pub: int,
    patients: PatientIndex | None,
    counted: list[PrivacyEvent],
    declared: bool,
) -> PrivacyPlan:
    """The run's plan at public size ``n_pub`` (its data checked first), the drawn counts first: what the
    site's ledger will hold for the job, DP-SGD as one round of all its steps."""
    check_data(cfg, data, n_pub, declared=declared)
    return privacy_plan(
        cfg,
        n_pub,
        image_shape=data.image_shape,
        n_classes=data.n_classes,
        size=counted or None,
        **(patient_dpsgd(None, None) if patients is None else patient_dpsgd(patients.n_public, patients.cap)),
    )


# -- the run's own policy and its signed job -------------------------------------------------------


def _run_policy(
    root: Path,
    files: _SiteFiles,
    data: ImageDataset,
    cfg: JobConfig,
    plan: PrivacyPlan,
    ckey: Any,
    site_id: str | None,
    patients: PatientIndex | None,
) -> None:
    """The run's own signed one-site policy (``RUN_DIR/policy.signed.json``, made once, before the job's
    first release): its budget the job's ``[privacy]`` target, its caps admitting the planned releases, its
    dataset the public size with a keyed commitment to ``data`` (``keys/data.secret``), its declared schema
    the data's classes and shape, signed with ``keys/policy-admin.key``. It binds what the run uses and is
    only as trustworthy as the run folder's owner."""
    if files.policy.is_file():
        return
    keys = private_dir(root / "keys")
    if not (root / RUN_ADMIN_KEY).exists():
        generate_keypair(keys, "policy-admin")
    secret, _ = ensure_secret(files.secret)
    ids = None if patients is None else patients.ids
    eps = (float(cfg.privacy.epsilon), float(cfg.privacy.delta))
    doc = make_policy(
        site_id or "site",
        dataset_commitment(data, secret, patients=ids),
        plan.dataset_size,
        [ckey.public_key()],
        per_job=eps,
        lifetime=eps,
        accountant=cfg.privacy.accountant,
        mechanisms=_admitting(plan.events, plan.dataset_size),
        site_key=load_private_key(files.key).public_key(),
        declared=DataDeclaration.draft_from(data),
        patient_level=None if patients is None else (int(patients.n_public), int(patients.cap)),
    )
    doc["description"] = "one-site policy of a `feta-release train` run, signed with the run's own key"
    write_signed_policy(files.policy, sign_policy(doc, load_private_key(root / RUN_ADMIN_KEY)))


def _admitting(events: Sequence[Any], size: int) -> dict[str, dict[str, Any]]:
    """Mechanism caps that admit the run's own releases (the research defaults, widened where the run goes
    past them): the run is gated by its [privacy] budget, which the policy states."""
    out: dict[str, dict[str, Any]] = {}
    for stage, cap in (("central", "max_rounds"), ("frequency", None), ("dpsgd", "max_steps")):
        evs = [e for e in events if e.stage == stage]
        if not evs:
            continue
        rule: dict[str, Any] = {
            "min_sigma": min(1.0 if stage != "dpsgd" else 0.5, *(float(e.sigma) for e in evs))
        }
        if cap is not None:
            rule[cap] = max(50 if stage == "central" else 100000, sum(int(e.steps) for e in evs))
        if stage != "frequency":
            rule["max_batch"] = max(60000, math.ceil(max(float(e.q) for e in evs) * size))
        out[stage] = rule
    return out


def one_site_job(cfg: JobConfig, n_public: int) -> JobConfig:
    """``cfg`` as the job of a federation of one: DP-SGD one round of all its steps (the node checkpoints
    inside it), per-site noise (one site: nothing to sum)."""
    steps = cfg.dpsgd_steps(n_public)
    return cfg.replace(
        federation={
            "min_sites": 1,
            "rounds": 1,
            "local_steps": max(1, steps),
            "secure_aggregation": False,
            "fedsgd": False,
        }
    )


def _signed_job(
    root: Path, cfg: JobConfig, n_pub: int, ckey: Any, job_id: str | None, site_id: str
) -> dict[str, Any]:
    """The run's signed one-site job (``RUN_DIR/signed_job.json``, signed once; a resume checks it is this
    job) for ``site_id`` (the verified policy's)."""
    job = one_site_job(cfg, n_pub)
    path = root / SIGNED_JOB
    if path.is_file():
        signed = dict(read_json(path, "signed job"))
        if JobConfig.from_dict(signed["job"]["config"]) != job.with_secure_default(1):
            raise ConfigError(
                f"{root}: belongs to a different job config; use a new --out directory or the same job and "
                "options to resume"
            )
        return signed
    signed = sign_job(job, ckey, job_id or _new_job_id(cfg), [site_id])
    atomic_write_bytes(path, json.dumps(signed, indent=2).encode("utf-8"))
    return signed


# -- progress and grids ----------------------------------------------------------------------------


def _log_start(
    rep: Reporter, cfg: JobConfig, data: ImageDataset, plan: PrivacyPlan, files: _SiteFiles, resumed: bool
) -> None:
    sgd = plan.event("dpsgd")
    rep.log(
        f"[bold]{escape(cfg.job.name)}[/] ({cfg.job.method}) on {data.n} images, {data.n_classes} classes: "
        f"planned epsilon {plan.epsilon:.3f} {per_unit(unit_name(plan.patient_cap))} at delta "
        f"{cfg.privacy.delta:g}"
        + (f"; DP-SGD sigma {plan.noise_multiplier:.3f}, q {sgd.q:.4f}, {sgd.steps} steps" if sgd else "")
        + escape(f"; ledger {files.ledger}" + (" [resuming]" if resumed else ""))
    )


def _progress(rep: Reporter, ev: dict[str, Any]) -> None:
    rep.log(escape(f"{ev.get('phase', '')}: {ev.get('message', '')}"))


def _grids(
    root: Path, cfg: JobConfig, data: ImageDataset, site: Site, job_id: str, per_class: int
) -> Callable[[str, Any], None]:
    """The driver's observer: ``grids/NN-<stage>.png`` at each stage boundary (the released central images
    themselves, then samples of the model after each stage), titled with the ε the site charged so far in
    its unit, as its ledger caps it (per patient at a patient-level site)."""
    count = [0]
    delta = float(cfg.privacy.delta)
    budget = as_budget(site.policy)
    unit = figure_unit_words(budget.patient_cap, "one site")
    unit = unit if budget.patient_cap is None else f"per patient, {unit}"

    def observe(stage: str, what: Any) -> None:
        count[0] += 1
        events = events_from_list(site.ledger.job_events(job_id))
        spent = budget.spent(events, delta) if events else None
        if isinstance(what, tuple):
            images, labels = what
            label, n = "released central images", min(per_class, cfg.central.rounds * cfg.central.cells)
        else:
            gen_images, gen_labels = generate(what, per_class, seed_from(cfg.job.seed, "grid"), cfg.sampler)
            images, labels, n = gen_images.numpy(), gen_labels.numpy(), per_class
            label = f"samples {stage.replace('-', ' ')}"
        save_grid(
            np.asarray(images),
            np.asarray(labels),
            root / "grids" / f"{count[0]:02d}-{stage}.png",
            per_class=n,
            n_classes=data.n_classes,
            class_names=data.class_names,
            title=epsilon_title(label, spent, delta, unit),
        )

    return observe


# -- the end of a run ------------------------------------------------------------------------------


def _finish(
    root: Path, cfg: JobConfig, ckey: Any, n_pub: int, opts: TrainOptions, require_policy: bool
) -> Path | None:
    """The report, chart, sample grid, ``synthetic.npz`` and (unless ``--no-release``) ``RUN_DIR/release``
    from the job directory, by the one code of every job directory, each stage's progress in
    ``progress.jsonl`` and on the console as the job's; ``COMPLETE`` last."""
    rep = opts.reporter or Reporter(enabled=False)
    sink = job_log(root, "release", lambda ev: _progress(rep, ev))
    privacy_report(root, sink)
    dev = resolve_device(opts.device)
    sample_grid(root, device=dev, sink=sink)
    n = n_pub if opts.n_synthetic is None else int(opts.n_synthetic)
    synthetic_set(root, n, cfg.job.seed, dev, sink=sink)
    release = None
    if opts.release:
        release = root / RELEASE
        if not (release / "manifest.json").is_file():
            release = build_release(root, ckey, require_policies=require_policy, sink=sink)
    atomic_write_bytes(root / COMPLETE, b"complete\n")
    return release


def _result(
    root: Path,
    plan: PrivacyPlan | None,
    seconds: float,
    *,
    release: Path | None = None,
    resumed: bool = False,
    already_complete: bool = False,
) -> TrainResult:
    """The run's figures from its job directory: the site's signed statement (events, ε, δ)."""
    atts = json.loads((root / "attestations.json").read_text("utf-8"))
    st = next(iter(atts.values()))["statement"]
    summary = json.loads((root / "job_summary.json").read_text("utf-8"))
    cfg = JobConfig.from_dict(json.loads((root / SIGNED_JOB).read_text("utf-8"))["job"]["config"])
    sgd = next((e for e in events_from_list(st["events"]) if e.stage == "dpsgd"), None)
    rel = root / RELEASE
    return TrainResult(
        root,
        float(st["epsilon"]),
        float(st["delta"]),
        merged(events_from_list(st["events"])),
        getattr(sgd, "sigma", None) if plan is None else plan.noise_multiplier,
        int(summary.get("rounds", 0)) * int(cfg.federation.local_steps),
        seconds,
        release if release is not None else (rel if (rel / "manifest.json").is_file() else None),
        resumed,
        already_complete,
        _per_patient(st),
    )


def _per_patient(statement: dict[str, Any]) -> float | None:
    """The statement's ε per patient where the site's unit of privacy is the patient, else None."""
    return job_in_unit(statement)["epsilon"] if statement_patient_cap(statement) is not None else None
