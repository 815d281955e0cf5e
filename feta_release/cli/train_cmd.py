"""``feta-release train``: one site's whole job as a federation of one (``coordinator.local_run``): the node's
handlers answer the coordinator's ``JobDriver`` in one process (plan, releases, warm-ups, DP-SGD, samples,
release)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..data.loading import LoadOptions
from ..errors import ConfigError
from .data_options import data_load_options
from .derive_options import DeriveRequest, base_job, derive_options, derived_jobs
from .device_option import device_option
from .progress_option import progress_option
from .trust_options import TRUSTED_METAVAR, trusted_for_policy


@click.command()
@click.argument("job", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--preset",
    default=None,
    help="Use a shipped job instead of JOB or a derived one (`feta-release preset "
    "list`); on the embedded digits the best measured are cpu-eps1-nodpsgd (eps 1) and cpu-eps10-nodpsgd "
    "(eps 10).",
)
@click.option(
    "--data",
    "data_path",
    default=None,
    help="Image folder (one sub-folder per class), labels .csv or .npz; default: the training split (80%, "
    "seed 0) of the embedded MNIST subset, whose held-out 20% is left for `feta-release evaluate`.",
)
@data_load_options
@derive_options
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Run directory: created, or resumed when it holds an unfinished run of the same job and data.",
)
@click.option(
    "--synthetic",
    "n_synthetic",
    type=click.IntRange(min=0),
    default=None,
    help="Images in RUN_DIR/synthetic.npz (balanced labels); default: the public size.",
)
@click.option(
    "--public-size",
    type=click.IntRange(min=1),
    default=None,
    help="PUBLIC nominal dataset size N for rates q = batch / N and all denominators (default: a --policy's "
    "dataset.size, else drawn from a noisy count of the images: the Gaussian mechanism, noise std 50, "
    "charged first as the event 'size' and rounded to 2 significant digits; the exact count is never "
    "written into the run).",
)
@click.option(
    "--public-patients",
    type=click.IntRange(min=1),
    default=None,
    help="With --patient-cap: the PUBLIC number of patients; DP-SGD then samples whole patients (rate q) and "
    "divides by q x this number (default: a --policy's dataset.patients; at --patient-cap 1 the public size, "
    "the cap leaving one image a patient; else drawn from a noisy patient count, noise std 50, charged first "
    "as the event 'patients').",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="DP-SGD steps between checkpoints (a killed run resumes its charged DP-SGD round from the last one; "
    "nothing is charged twice).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="torch CPU threads (default: torch's); a derived job is timed at them.",
)
@device_option("training, DP-SGD and sampling")
@click.option(
    "--ledger",
    "ledger",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Site ledger (SQLite) charged before every release; default RUN_DIR/site/ledger.sqlite. Give the "
    "site's "
    "own to compose this run with its earlier ones.",
)
@click.option(
    "--site-key",
    "site_key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The site's private key: signs the ledger (default: RUN_DIR/site/keys/site.key, created once); "
    "`export --site-key` must be the same key.",
)
@click.option(
    "--policy",
    "policy_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The site's signed policy (required with a --ledger outside RUN_DIR): every charge is checked "
    "against its caps, as a node checks them.",
)
@click.option(
    "--trusted",
    "trusted",
    default=None,
    metavar=TRUSTED_METAVAR,
    help="The site administrator's public key that signed --policy (ADMIN.pub or SITE_ID=ADMIN.pub).",
)
@click.option(
    "--coordinator-key",
    "coordinator_key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The key that signs the one-site job and RUN_DIR/release's manifest, as a "
    "federation's coordinator (default: RUN_DIR/keys/coordinator.key, created once).",
)
@click.option(
    "--site-id", default=None, help="The site's id in the release (default: the policy's, else 'site')."
)
@click.option(
    "--public",
    "public_path",
    default=None,
    help="A PUBLIC image set (same layouts and checks as --data; labels optional) the model is pretrained on "
    "before any private image: free in epsilon, named in the job and the release by its sha256, count "
    "and shape ([public]; docs/explanation/public-pretraining.md).",
)
@click.option(
    "--public-description", default="", help="What the --public set is (up to 500 characters; in the job)."
)
@click.option(
    "--pretrained",
    "pretrained",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Start from a pretrained model file (an earlier run's RUN_DIR/pretrained.pt), named in the job by "
    "its sha256.",
)
@click.option(
    "--no-release", is_flag=True, help="Stop after training: no RUN_DIR/release (`export` can make one)."
)
@click.option(
    "--data-secret",
    "data_secret",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="With --policy: the site's data secret, the key of the policy's data commitment (as `node start` "
    "takes it); the images loaded are checked against the commitment before anything is released.",
)
@progress_option("progress bars per stage", old_quiet=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary at the end.")
def train(
    job: Path | None,
    preset: str | None,
    data_path: str | None,
    load: LoadOptions | None,
    epsilon: float | None,
    delta: float | None,
    time_budget: str | None,
    save_job: Path | None,
    dpsgd: str | None,
    out_dir: Path,
    n_synthetic: int | None,
    public_size: int | None,
    public_patients: int | None,
    checkpoint_every: int,
    threads: int | None,
    device: str,
    ledger: Path | None,
    site_key: Path | None,
    policy_path: Path | None,
    trusted: str | None,
    coordinator_key: Path | None,
    site_id: str | None,
    public_path: str | None,
    public_description: str,
    pretrained: Path | None,
    no_release: bool,
    data_secret: Path | None,
    progress: bool,
    as_json: bool,
) -> None:
    """Train a synthesizer on one site's data and write RUN_DIR, the job directory (coordinator.local_run).

    Recommended: give no JOB and no --preset, only --epsilon: the job is DERIVED from the data's public facts
    (size, image shape, classes, epsilon, device, --time-budget; feta_release.job_rules, docs/derived-job.md),
    printed as TOML (--save-job keeps it); on the embedded digits at eps 1 it scores 0.78 +- 0.02 held-out
    (3 fresh noise draws, docs/derived-job.md). Shipped presets are tuned to 28x28 digits:
    cpu-eps1-nodpsgd (0.80 held-out at eps 1) and cpu-eps10-nodpsgd (0.90 at eps 10) score so on the fixed
    noise draws their settings were chosen on (eps 1, one fresh draw: 0.68 on validation);
    `feta-release preset list` shows them all with their figures.

    The run is a federation of one: the site is opened as a node opens one (its signed policy: --policy
    --trusted --data-secret, or the run's own, made before the first release and committed to the data), and
    answers the coordinator's requests with the node's handlers; every release is charged in the site ledger
    (RUN_DIR/site/, or --ledger) before it runs, and a charge over the budget is refused naming the rule.
    Re-running the same command after an interruption resumes without spending privacy again for what was
    already charged (a DP-SGD round killed inside continues from the site's last checkpoint).
    RUN_DIR is the coordinator's job directory (signed_job.json, the site's attestation, privacy_report.*,
    budget.svg, samples.png, grids/, synthetic.npz and the signed RUN_DIR/release for `verify`, `synthesize`
    and `report`); RUN_DIR/COMPLETE marks a finished run.
    --resize/--image-size/--window override the job's [job] resize/image_size/window.

    \b
    Example:
      feta-release train --data /data/images --epsilon 1 --out runs/derived --save-job job.toml
      feta-release train --preset cpu-eps1-nodpsgd --out runs/eps1
      feta-release train --preset xray64-eps10 --data /data/chest --resize crop --image-size 64 --out runs/x
    """
    import torch

    from coordinator.local_run import TrainOptions, run_train

    from ..training.device import resolve_device
    from ..training.progress import Reporter

    req = DeriveRequest(epsilon, delta, time_budget, save_job, dpsgd)
    cfg = _job_or_preset(job, preset, req)
    site_policy = _site_policy(policy_path, trusted)
    _check_cap_for_policy(site_policy, load, policy_path)  # before any image is read or any ε charged
    public_patients = _policy_patients(site_policy, public_patients, policy_path)
    _refuse_drawn_patients(cfg, preset, load, public_patients)
    if threads:
        torch.set_num_threads(threads)
    declared = site_policy.declared if site_policy is not None else None
    data, patients, as_read = _training_data(
        cfg or base_job(), data_path, load, public_patients, declared, (site_policy, str(policy_path))
    )
    job_for_size = None
    if preset is not None:  # a preset on data of another shape: adapted by the rules, or refused in one line
        cfg = _fit_preset(
            cfg, preset, data, public_size, site_policy, _declared_patients(patients, public_patients)
        )
    public = _public_inputs(cfg or base_job(), public_path, public_description, pretrained, load, as_read)
    del as_read  # every image as read, the capped ones too: needed only to check the public set
    if cfg is None:  # the job derived from the data's public facts (and the --public set's)
        cfg, job_for_size = derived_jobs(
            req,
            data,
            resolve_device(device).type,
            public_size,
            site_policy,
            load,
            lambda text: click.echo(text, err=as_json),
            public=public.data if public is not None else None,
            patients=_declared_patients(patients, public_patients),
            one_each=patients is not None and public_patients is None and int(patients.cap) == 1,
            threads=torch.get_num_threads(),  # --threads set above, else torch's default: the run's own
        )
    rep = Reporter(enabled=progress)
    opts = TrainOptions(
        n_synthetic=n_synthetic,
        checkpoint_every=checkpoint_every,
        reporter=rep,
        public_size=public_size,
        device=device,
        ledger=ledger,
        site_key=site_key,
        policy=policy_path,
        trusted=trusted_for_policy(trusted, policy_path)[0] if policy_path and trusted else None,
        data_secret=data_secret,
        coordinator_key=coordinator_key,
        site_id=site_id,
        patients=patients,
        draw_patients=patients is not None and public_patients is None,
        job_for_size=job_for_size,
        public=public,
        release=not no_release,
    )
    res = run_train(cfg, data, out_dir, opts)
    if data_path is not None and site_policy is None:  # a site's policy declares them (_site_policy)
        click.echo(
            f"note: the classes {list(data.class_names)} and image shape {list(data.image_shape)} were read "
            f"off {data_path} and are released as they are (un-noised); to make them a public declaration, "
            "give --policy with dataset.classes and dataset.image_shape",
            err=True,
        )
    _print_summary(res, cfg.privacy.accountant, res.release, as_json)
    if res.release is not None and not as_json:
        _print_next(res.release, res.run_dir, policy_path, trusted)


def _print_next(release: Path, run_dir: Path, policy_path: Path | None, trusted: str | None) -> None:
    """The exact commands that check and use the release (the trusted key is the run's own without
    --policy)."""
    from ..policy.envelope import read_json

    signed = read_json(policy_path or run_dir / "policy.signed.json", "signed policy")
    sid = signed["policy"]["site_id"]
    key = (
        Path(trusted.partition("=")[2] or trusted)
        if policy_path and trusted
        else run_dir / "keys" / "policy-admin.pub"
    )
    if not policy_path:
        click.echo(
            "the release is signed under the run's own one-site policy "
            f"({run_dir / 'policy.signed.json'}, key {key}: trust it only as far as you trust this "
            "run folder)"
        )
    click.echo(
        f"check and use it:\n  feta-release verify {release} --trusted {sid}={key}\n"
        f"  feta-release synthesize --release {release} --trusted {sid}={key} --num 100 --out synthetic"
    )


def _job_or_preset(job: Path | None, preset: str | None, req: DeriveRequest) -> Any:
    """The job of JOB or --preset, or None for the derived job (--epsilon given, neither JOB nor --preset)."""
    from ..config import load_job, load_preset

    if job is not None and preset is not None:
        raise ConfigError("give exactly one of JOB (a job .toml file) or --preset NAME, not both")
    if job is None and preset is None:
        if req.epsilon is None:
            raise ConfigError(
                "give --epsilon E to derive the job from the data (recommended), or a JOB file, or "
                "--preset NAME (`feta-release preset list`)"
            )
        return None
    if req.given:
        raise ConfigError(
            "--epsilon, --delta, --time-budget, --save-job and --dpsgd are for the derived "
            "job: drop them, or drop JOB / --preset to derive the job from the data"
        )
    return load_job(job) if job is not None else load_preset(preset)  # type: ignore[arg-type]


def _check_cap_for_policy(policy: Any, load: LoadOptions | None, policy_path: Path | None) -> None:
    """A --patient-cap the --policy does not make the unit of privacy (``data.loading.check_cap_for_policy``),
    refused before the data is read."""
    from ..data.loading import check_cap_for_policy

    cap = load.patient_cap if load is not None else None
    if policy is not None:
        check_cap_for_policy(policy, cap, cap_source=f"--patient-cap {cap}", policy_source=str(policy_path))


def _policy_patients(policy: Any, public_patients: int | None, policy_path: Path | None) -> int | None:
    """The public patient count: a patient-level --policy's signed ``dataset.patients`` (its node samples
    DP-SGD over it, q = batch / it), else --public-patients. A --public-patients beside a policy that declares
    another count is refused: the job would be derived, and the trainer divide, over one count while the
    node charges q over the other."""
    declared = int(policy.patients) if policy is not None and policy.patients else None
    if declared is None:
        return public_patients
    if public_patients is not None and public_patients != declared:
        raise ConfigError(
            f"{policy_path}: the policy declares dataset.patients = {declared}, its node samples DP-SGD "
            f"over them, but --public-patients is {public_patients}: drop --public-patients (or re-sign the "
            "policy with the count you mean)"
        )
    return declared


def _refuse_drawn_patients(
    cfg: Any, preset: str | None, load: LoadOptions | None, public: int | None
) -> None:
    """A cap of K >= 2 whose patient count P is not public, refused before anything is drawn or charged where
    the job is sized over P: a derived job (it fits its noise per patient over the cap and samples patients
    at q = batch / P) and a preset sampling DP-SGD at a rate (its batch is rate x P,
    ``job_rules.fit_dpsgd_to_patients``). Drawing P (a noisy count charged in the site ledger) would size
    either over the images, another job than the one asked for (the derived one then refused after the
    charge)."""
    cap = load.patient_cap if load is not None else None
    if cap is None or cap < 2 or public is not None:
        return
    if cfg is None:
        raise ConfigError(
            f"--patient-cap {cap} derives a job that fits its noise per patient over the cap and samples "
            "patients at batch / P, so the number of patients P must be public before the job is derived: "
            "give --public-patients P (the public number of patients), or a --policy that declares it"
        )
    if preset is not None and cfg.dpsgd.rate is not None and cfg.dpsgd.steps != 0:
        raise ConfigError(
            f"--preset {preset} at --patient-cap {cap} samples whole patients at its DP-SGD rate "
            f"q = {cfg.dpsgd.rate:g}, a batch of q x P patients, so the number of patients P must be public "
            "before the run: give --public-patients P (the public number of patients), or a --policy that "
            "declares it"
        )


def _declared_patients(patients: Any, public_patients: int | None) -> Any:
    """The patient facts the derived job's time model reads (``job_rules.PatientFacts``): the DECLARED public
    patients (--public-patients, the policy's) and the cap; None at an image-level run, or where the run draws
    its patient count (the job is then timed as image-level)."""
    from ..job_rules import PatientFacts

    if patients is None or public_patients is None:
        return None
    return PatientFacts(int(public_patients), int(patients.cap))


def _fit_preset(
    cfg: Any, name: str, data: Any, public_size: int | None, policy: Any, patients: Any = None
) -> Any:
    """``job_rules.fit_preset`` on the data's shape and classes, the PUBLIC size (--public-size or the
    policy's; none: the size checks are left to the run's plan) and a patient-level site's declared patients
    (``job_rules.PatientFacts``: DP-SGD's batch over them); a note says what was adapted."""
    from ..job_rules import DataFacts, fit_preset, preset_shape
    from ..policy.enforce import resource_cap

    declared = (
        public_size if public_size is not None else (int(policy.dataset_size) if policy is not None else None)
    )
    c, h, w = (int(v) for v in data.image_shape)
    memory = None
    if policy is not None and declared is not None:
        memory = resource_cap(policy, "max_worker_memory_mb")
    facts = DataFacts(
        size=declared or 1,
        height=h,
        width=w,
        channels=c,
        n_classes=int(data.n_classes),
        epsilon=float(cfg.privacy.epsilon),
        memory_mb=memory,
        patients=patients,
    )
    fitted = fit_preset(cfg, name, facts, size_known=declared is not None)
    if fitted.dpsgd.rate != cfg.dpsgd.rate:
        click.echo(
            f"note: preset {name} samples DP-SGD at q = {cfg.dpsgd.rate:g}; this site samples whole "
            f"patients, so its batch is q x the {patients.patients} public patients = {fitted.dpsgd.batch} "
            "patients, "
            f"{fitted.dpsgd.steps} steps",
            err=True,
        )
    if preset_shape(cfg) != facts.shape:
        m, ce, fr = fitted.model, fitted.central, fitted.frequency
        side = max(1, int(h * ce.downsample))
        tuned = "x".join(map(str, preset_shape(cfg)))
        click.echo(
            f"note: preset {name} was tuned on {tuned} images; adapted to "
            f"{c}x{h}x{w} by the derived job's rules: central query {side}x{side} (clip {ce.clip}), "
            + (f"{fr.patch}x{fr.patch} patches at stride {fr.stride}, " if fr.patch else "")
            + f"{len(m.channel_mult)} UNet levels, physical batch {fitted.dpsgd.physical_batch}",
            err=True,
        )
    return fitted


def _training_data(
    cfg: Any,
    data_path: str | None,
    load: LoadOptions | None,
    public_patients: int | None,
    declared: Any = None,
    policy: tuple[Any, str] = (None, ""),
) -> tuple[Any, Any, Any]:
    """(the site's dataset, its patient index or None, every image as read): --data loaded with the job's (or
    the options') resize, or the embedded MNIST training split (its held-out 20 % is left for `evaluate`).

    The file is read ONCE. A --patient-cap is applied to the images in memory (``data.loading.cap_loaded``,
    the loader's own cap), so the third value holds the images the cap drops too: they are their patients'
    private images all the same, and a --public set made of them would release them with no noise
    (``_public_inputs`` checks against it). A second read for that check would judge bytes the run does not
    train on: a file changed between the reads (swapped, rewritten) would hide copies of the images trained
    on from the check.

    ``policy``: the verified --policy and its path. Its unit of privacy, patient cap and public patients are
    applied as its node applies them (``data.loading.policy_data``): a patient-level policy caps the images at
    its ``dataset.patient_cap`` (a --patient-cap of another value is refused) and its DP-SGD samples its
    ``dataset.patients``, so the job is derived and trained over the counts the node charges.

    ``declared``: the --policy's public class list and image shape, which the data are mapped onto as a node
    maps them. Without one the classes present and the majority shape of --data are used, and the release
    (synthetic labels, model, manifest) shows them as they are: ``train`` notes it after the run."""
    from ..data import load_dataset, load_embedded, train_heldout_split
    from ..data.loading import cap_loaded, policy_data

    patients = None
    if data_path is None:
        data = as_read = train_heldout_split(load_embedded(), 0.2, seed=0)[0]
    else:
        job = LoadOptions(resize=cfg.job.resize, image_size=cfg.job.image_size, window=cfg.job.window)
        kw = (load.over(job) if load is not None else job).kwargs()
        cap = kw.pop("patient_cap")
        as_read, report = load_dataset(data_path, **kw, declared=declared)
        data = as_read if cap is None else cap_loaded(as_read, report, int(cap))
        if report.n_skipped:
            click.echo(f"note: {report.n_skipped} file(s) skipped while loading {data_path}", err=True)
        if policy[0] is not None:
            data, patients = policy_data(
                policy[0], data, report, data_source=data_path, policy_source=policy[1]
            )
        else:
            patients = _patient_index(report, public_patients)
    if public_patients is not None and patients is None:
        raise ConfigError(
            "--public-patients is for patient-level DP-SGD: give --patient-cap K with data that has "
            "patient ids (a CSV patient_id column or DICOM PatientID)"
        )
    return data, patients, as_read


def _public_inputs(
    cfg: Any,
    path: str | None,
    description: str,
    pretrained: Path | None,
    load: LoadOptions | None,
    private: Any,
) -> Any:
    """--public / --pretrained as ``stages.pretrain.PublicInputs`` (None: neither), the set loaded as --data
    is, and refused when it holds copies of the private images (both are read here: before the job is
    derived, anything charged or written).

    ``private``: every private image of the ONE read of --data, those a --patient-cap drops included
    (``_training_data``)."""
    if path is None and pretrained is None:
        if description:
            raise ConfigError("--public-description describes a --public set: give --public PATH too")
        return None
    from ..data.public import load_public, refuse_private_copies
    from ..stages.pretrain import PublicInputs

    job = LoadOptions(resize=cfg.job.resize, image_size=cfg.job.image_size, window=cfg.job.window)
    opts = load.over(job) if load is not None else job
    data = load_public(path, opts, private.image_shape) if path is not None else None
    if data is not None:
        refuse_private_copies(data, private, str(path), f"the private data {private.source}")
    return PublicInputs(data, description, pretrained)


def _print_summary(res: Any, accountant: str, release: Path | None, as_json: bool) -> None:
    """The run's ε, events and where its outputs are: one line, or the JSON summary (--json). ``epsilon`` is
    in the site's unit (``unit``), as ``privacy_report.json``'s ``epsilon_total``: per patient at a
    patient-level site, the figure its caps bound; there the events composed as if each protected one image
    are ``epsilon_per_image``."""
    from ..accounting import per_unit, unit_name

    per = res.epsilon_per_patient  # a patient-level site's guarantee (None: images)
    summary = {
        "run_dir": str(res.run_dir),
        "unit": unit_name(per),
        "epsilon": res.epsilon if per is None else per,
        "epsilon_per_patient": per,
        "delta": res.delta,
        "accountant": accountant,
        "events": [e.to_dict() for e in res.events],
        "dpsgd_noise_multiplier": res.dpsgd_sigma,
        "dpsgd_steps_trained": res.dpsgd_steps_trained,
        "seconds": round(res.seconds, 1),
        "resumed": res.resumed,
        "already_complete": res.already_complete,
        "release": str(release) if release else None,
    }
    if per is not None:
        summary["epsilon_per_image"] = res.epsilon
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        # the figure with its unit after it, in the words of the start line ("planned epsilon 0.998 per
        # image") and of every other line that states a site's ε (accounting.per_unit)
        click.echo(
            f"{res.run_dir}: epsilon {summary['epsilon']:.3f} {per_unit(str(summary['unit']))} "
            f"at delta {res.delta:g} "
            f"({res.dpsgd_steps_trained} DP-SGD steps, {res.seconds:.0f} s); "
            f"synthetic images in {res.run_dir / 'synthetic.npz'}"
            + (f"; release in {release}" if release else "")
        )


def _patient_index(report: Any, public_patients: int | None) -> Any:
    """Patient-level DP-SGD when the data was loaded with a patient cap (patient ids known); else None."""
    if report.patient_cap is None or report.patients is None:
        return None
    from ..privacy_unit import PatientIndex

    # no declared count: 1 is a placeholder, the run (`TrainOptions(draw_patients=True)`) draws the public
    # count from a noisy patient count charged first (the exact count, or a rounding of it, would be an
    # un-noised release)
    n_pub = public_patients if public_patients is not None else 1
    return PatientIndex(report.patients, int(n_pub), int(report.patient_cap))


def _site_policy(policy_path: Path | None, trusted: str | None) -> Any:
    """The verified ``SitePolicy`` (signature by the trusted administrator key, validity window, a declared
    public data schema) or None."""
    if policy_path is None:
        if trusted is not None:
            raise ConfigError("--trusted is the key that signed --policy; give --policy SITE.signed.json too")
        return None
    if trusted is None:
        raise ConfigError(f"{policy_path}: give --trusted ADMIN.pub, the administrator key that signed it")
    from edge.site import declared_schema

    from ..policy import load_site_policy

    policy = load_site_policy(policy_path, trusted_for_policy(trusted, policy_path))
    # refused as `node start` refuses it, before the data are read: the classes and shape every release states
    # are the policy's public declaration, never the data's
    declared_schema(policy, str(policy_path))
    return policy
