"""``feta-release demo``: the whole federated release on the embedded digits, on this machine.

Splits the embedded data into 3 sites, gives each its keys and a signed policy, starts a coordinator
(SuperLink) and 3 site nodes (SuperNodes) on loopback as real processes, runs FETA-Pro at ε = 1 and
writes everything into one folder: samples.png, privacy_report.{txt,json}, release/ (ONNX generator +
signed manifest with each site's signed spend statement), and the federation's files.

Import boundary (fast CLI start, enforced by tests/house/test_import_boundaries.py): the modules that pull in
Flower or torch (``.setup``, ``.runner``, ``.finalize``, ``edge.launch``) are imported inside the functions
that start the federation, so ``feta-release demo --help`` loads neither.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.markup import escape

from feta_release.cli.device_option import device_option
from feta_release.cli.progress_option import progress_option
from feta_release.config import load_preset
from feta_release.data import load_embedded
from feta_release.data.dataset import ImageDataset, save_npz
from feta_release.data.public import refuse_private_copies
from feta_release.data.splits import split_sites, train_heldout_split
from feta_release.federation.procs import free_port
from feta_release.job_rules import PublicFacts, job_toml
from feta_release.ledger_chain import make_private_dirs
from feta_release.release.report import write_report
from feta_release.release.verify import TrustRoots
from feta_release.signing import load_public_key

from .demo_public import DemoPublic, demo_public, pretraining
from .superlink import SuperLinkSettings, start_superlink

N_SITES = 3
DIGITS_SHAPE = (1, 28, 28)  # the embedded digits' (C, H, W)


def demo_config(
    preset: str,
    epsilon: float,
    site_size: int,
    rounds: int,
    local_steps: int,
    quick: bool,
    secure: bool = True,
    public: PublicFacts | None = None,
) -> Any:
    """The preset's job, adapted to a federation of sites of ``site_size`` images each.

    The single-site preset's sampling RATES are kept (q = batch / N), so each site's batch is the preset's
    rate times the site's size; its DP-SGD steps (if any) become rounds x local_steps at every site.
    ``secure``: the central images and frequency statistics are summed by secure aggregation (each site adds
    its share of the noise; the sum carries the pooled mechanism's noise, not sqrt(3) times it); DP-SGD rounds
    keep per-site noise (FedSGD loses at this epsilon: docs/secure-aggregation.md).
    ``public``: the facts of a public pretraining set (``--public``): the job pretrains on it as the derived
    job of ``train --public`` does (``[public]`` steps from the set's size; DP-SGD, if any, of the norms,
    attention and conditioning only); the set itself is named when the job is signed.
    """
    cfg = load_preset(preset)
    sized = cfg.for_size(site_size)  # presets with [central]/[dpsgd] rate: batch = rate x public size
    n_ref = 4000  # presets without a rate are written for the embedded 4,000-image training split
    central_b = (
        sized.central.batch if cfg.central.rate is not None else int(cfg.central.batch / n_ref * site_size)
    )
    dpsgd_b = sized.dpsgd.batch if cfg.dpsgd.rate is not None else round(cfg.dpsgd.batch / n_ref * site_size)
    # a preset without DP-SGD (steps = 0) keeps none; one given in epochs (steps None) has DP-SGD too
    steps = 0 if cfg.dpsgd.steps == 0 else rounds * local_steps
    over: dict[str, Any] = {
        "privacy": {"epsilon": epsilon},
        "central": {"batch": max(1, min(site_size, central_b))},
        "dpsgd": {"batch": max(1, min(site_size, dpsgd_b)), "steps": steps},
        "federation": {
            "sites": [f"site-{chr(ord('a') + i)}" for i in range(N_SITES)],
            "min_sites": 2,
            "rounds": rounds,
            "local_steps": local_steps,
            "round_timeout": 900.0,
            "secure_aggregation": secure,
        },
        "job": {"name": "demo"},
    }
    if quick:  # a smoke run of the real processes: minutes, not quality
        over.update(
            {
                "model": {"channels": 8, "channel_mult": [1], "num_res_blocks": 1, "attn_resolutions": []},
                "warmup": {
                    "spatial_iterations": 5,
                    "spatial_batch": 16,
                    "frequency_images": 40,
                    "frequency_epochs": 1,
                    "frequency_batch": 20,
                    "polish_iterations": min(5, cfg.warmup.polish_iterations),
                },
                "auxgen": {"epochs": 1, "iterations_per_epoch": 2, "width": 8, "batch": 20},
                "frequency": {"features": 100},
                "dpsgd": {"batch": 16, "steps": steps, "noise_multiplicity": 1, "physical_batch": 16},
                "sampler": {"steps": 4},
            }
        )
    if public is not None:
        over["public"] = pretraining(public, site_size * N_SITES, epsilon, quick)
        over["dpsgd"]["trainable"] = "norm_attention"
    return cfg.replace(**over)


@click.command()
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("feta-demo"),
    show_default=True,
    help="One folder for everything the demo writes (must be new or empty).",
)
@click.option("--epsilon", type=float, default=1.0, show_default=True, help="Per-site ε of the release.")
@click.option(
    "--preset",
    default="cpu-eps1-nodpsgd",
    show_default=True,
    help="Job preset adapted to 3 sites (the default spends ε on the central images and frequency statistics "
    "and runs no DP-SGD: at this ε·N it scores higher, docs/evaluation.md; cpu-eps1 adds DP-SGD rounds).",
)
@click.option(
    "--rounds", type=int, default=4, show_default=True, help="Federated DP-SGD rounds (presets with DP-SGD)."
)
@click.option(
    "--local-steps",
    type=int,
    default=10,
    show_default=True,
    help="DP-SGD steps per site per round (presets with DP-SGD).",
)
@click.option(
    "--per-site", type=int, default=None, help="Use only this many images per site (faster, worse)."
)
@click.option("--quick", is_flag=True, help="Tiny model and stages: checks the machinery in a few minutes.")
@click.option("--no-release", is_flag=True, help="Skip the ONNX release (samples + privacy report only).")
@click.option(
    "--secure-aggregation/--per-site-noise",
    "secure",
    default=True,
    show_default=True,
    help="Sum the central images and frequency statistics by secure aggregation (each site adds a share of "
    "the noise), or let each site add the full noise to its own release.",
)
@click.option(
    "--public",
    "public_spec",
    default=None,
    metavar="strokes[:N]|PATH",
    help="Pretrain the coordinator's model on a PUBLIC image set before it learns from the sites: "
    "strokes[:N] generates N pen strokes offline (default 10,000, 200 with --quick; no digit set is "
    "their source), PATH reads an existing set of 1x28x28 images (folder, labels .csv or .npz). The "
    "signed job names it by sha256, count and shape; it costs no epsilon and no site receives it. "
    "Off by default: 10,000 strokes did not raise the digits' accuracy at ε = 1 (0.714 with, 0.773 "
    "without, one seed; docs/explanation/public-pretraining.md).",
)
@click.option(
    "--public-description",
    default="",
    help="What the --public set is (up to 500 characters; in the signed job). Default: how the strokes "
    "were generated, or the set's file name.",
)
@device_option("the coordinator's training and sampling and the sites' DP-SGD rounds")
@progress_option("a status spinner naming the current step")
def demo(
    out_dir: Path,
    epsilon: float,
    preset: str,
    rounds: int,
    local_steps: int,
    per_site: int | None,
    quick: bool,
    no_release: bool,
    secure: bool,
    public_spec: str | None,
    public_description: str,
    device: str,
    progress: bool,
) -> None:
    """Run the whole federated release on the embedded data: 3 sites + a coordinator on loopback, ε = 1.

    \b
    Example:
      feta-release demo --out demo-out --quick
      feta-release demo --out demo-public --public strokes:10000
    """
    console = demo_console()
    if out_dir.exists() and any(out_dir.iterdir()):
        raise click.UsageError(f"{out_dir} is not empty; give a new --out folder")
    from .runner import coordinator_device

    device = coordinator_device(device)  # an absent GPU: refused before anything is written or started
    t_start = time.monotonic()
    timings: dict[str, float] = {}
    procs: list[Any] = []

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        with _status(console, progress, "[bold]preparing 3 sites: data, keys, signed policies") as status:
            t0 = time.monotonic()
            public = demo_public(
                public_spec, public_description, out_dir, load_preset(preset), DIGITS_SHAPE, quick
            )  # read (a PATH: checked) before the federation is written
            split = site_datasets(per_site)  # the sites' digits: checked against --public, then written
            if public is not None:
                refuse_site_images(public, split[0])
            # for this account only, not to the umask: the sites' ledgers lie below it, and a node refuses a
            # ledger below a folder others can write (edge.ledger_anchor.refuse_open_folders); made once the
            # public set is checked, so a refused one leaves nothing behind
            make_private_dirs(out_dir)
            fed, cfg = _prepare(out_dir, epsilon, preset, rounds, local_steps, split, quick, secure, public)
            timings["prepare"] = time.monotonic() - t0
            _log_ready(console, fed, cfg, public)
            status.update(
                "[bold]starting the coordinator (SuperLink) and 3 site nodes (SuperNodes) on loopback"
            )
            t0 = time.monotonic()
            address = _start_processes(out_dir, fed, procs, console, device)
            timings["start_processes"] = time.monotonic() - t0
            status.update("[bold]running the federated job")
            t0 = time.monotonic()
            summary = _run_job(out_dir, fed, cfg, address, console, status, device, public=public)
            timings["job"] = time.monotonic() - t0
        _stop_all(procs)
        with _status(console, progress, "[bold]writing samples, privacy report and release"):
            t0 = time.monotonic()
            from .finalize import build_release, job_log, privacy_report, sample_grid

            job_out = out_dir / "job"
            sink = job_log(job_out, "release")  # the release's stages in the job's progress.jsonl
            report = privacy_report(job_out, sink)
            grid = sample_grid(job_out, device=device, sink=sink)
            _copy(job_out / "privacy_report.txt", out_dir / "privacy_report.txt")
            _copy(job_out / "privacy_report.json", out_dir / "privacy_report.json")
            _copy(grid, out_dir / "samples.png")
            _copy(job_out / "budget.svg", out_dir / "budget.svg")
            release = None
            if not no_release:
                release = build_release(job_out, fed.coordinator_key, sink=sink)
                link_release(out_dir, release)
                _dpo_report(release, out_dir, fed)
            timings["finalize"] = time.monotonic() - t0
        timings["total"] = time.monotonic() - t_start
        _finish(out_dir, console, timings, summary, release, public)
        del report
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the coordinator and site nodes[/]")
        raise SystemExit(130) from None
    finally:
        _stop_all(procs)
        signal.signal(signal.SIGTERM, old)


def _finish(
    out_dir: Path,
    console: Any,
    timings: dict[str, float],
    summary: dict[str, Any],
    release: Path | None,
    public: DemoPublic | None,
) -> None:
    """``demo_summary.json`` and the closing lines: the privacy report, the public set (if any), the files."""
    doc = {
        "timings_s": timings,
        "job_phase_timings_s": summary["timings"],
        "site_epsilon": summary["site_epsilon"],
        "site_unit": summary.get("site_unit"),
        "rounds": summary["rounds"],
        "skipped": summary["skipped"],
        "release": "release" if release else None,
        "cores": _cores(),
    }
    if public is not None:
        doc["public"] = {k: v for k, v in public.record().items() if k != "class_names"}
    (out_dir / "demo_summary.json").write_text(json.dumps(doc, indent=2), "utf-8")
    console.print(escape((out_dir / "privacy_report.txt").read_text("utf-8")))
    if public is not None:
        console.print(escape(public.words()))
    console.print(
        f"[bold green]done in {timings['total']:.0f} s[/]: {out_dir / 'samples.png'}, "
        f"{out_dir / 'privacy_report.txt'}" + (f", {release}" if release else "")
    )


def _log_ready(console: Any, fed: Any, cfg: Any, public: DemoPublic | None) -> None:
    console.log(
        f"3 sites ready ({', '.join(f'{s.site_id}: public size {s.size}' for s in fed.sites)}); "
        f"coordinator key {fed.coordinator_pub}"
    )
    if public is not None:
        console.log(
            escape(
                f"public set {public.path} ({public.data.n} images): the coordinator pretrains "
                f"{cfg.public.pretrain_iterations} steps of {cfg.public.pretrain_batch} on it before it "
                "trains on the sites' releases; no site receives it"
            )
        )


def link_release(out_dir: Path, release: Path) -> Path:
    """``OUT/release``: a RELATIVE link to the release inside OUT, so the folder can be moved, archived or
    sent and every copy verifies its own files (an absolute link made a copy verify the original's files
    instead)."""
    link = out_dir / "release"
    link.symlink_to(os.path.relpath(release.resolve(), out_dir.resolve()), target_is_directory=True)
    return link


def _dpo_report(release: Path, out_dir: Path, fed: Any) -> Path:
    """``report.html``: the release report a data-protection officer reads. Trust is role-bound as for
    ``verify``: each demo site's administrator (policy) key for its site id, and the demo's coordinator key
    pinned."""
    roots = TrustRoots(
        {s.site_id: (load_public_key(s.policy_pub),) for s in fed.sites},
        (load_public_key(fed.coordinator_pub),),
    )
    return write_report(release, out_dir / "report.html", roots)[0]


def demo_console(file: Any = None) -> Console:
    """The demo's console: timestamped lines without the source location (a user reads the step, not the line
    of demo.py that logged it)."""
    return Console(stderr=file is None, file=file, log_path=False)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _copy(src: Path, dst: Path) -> None:
    dst.write_bytes(src.read_bytes())


def site_datasets(per_site: int | None) -> tuple[dict[str, ImageDataset], ImageDataset]:
    """({site id: its private digits}, the held-out digits): the embedded data split as the demo splits it."""
    train, heldout = train_heldout_split(load_embedded(), 0.2, seed=0)
    parts = split_sites(train, N_SITES, seed=0)
    if per_site is not None:
        parts = [
            p.subset(np.sort(np.random.default_rng(i).permutation(p.n)[:per_site]))
            for i, p in enumerate(parts)
        ]
    return {f"site-{chr(ord('a') + i)}": p for i, p in enumerate(parts)}, heldout


def refuse_site_images(public: DemoPublic, sites: dict[str, ImageDataset]) -> None:
    """Refuse a --public set holding any of the demo's sites' digits (``data.public.refuse_private_copies``),
    before the federation is written. The demo may: it split those digits itself, so it learns nothing a
    site would not want told. A real coordinator or site node must not (the argument beside that function):
    there the signed job's public hash is the coordinator operator's declaration. ``sites``: the digits
    :func:`site_datasets` gives each site."""
    private = np.concatenate([d.images for d in sites.values()])
    merged = ImageDataset(private, np.zeros(len(private), np.int64), ("digit",), "the demo's sites' digits")
    refuse_private_copies(public.data, merged, public.path, f"the {len(private)} digits of the demo's sites")


def _prepare(
    out_dir: Path,
    epsilon: float,
    preset: str,
    rounds: int,
    local_steps: int,
    split: tuple[dict[str, ImageDataset], ImageDataset],
    quick: bool,
    secure: bool = True,
    public: DemoPublic | None = None,
) -> tuple[Any, Any]:
    """The federation written under OUT from ``split`` (:func:`site_datasets`: the sites' digits and the
    held-out ones) and the job planned from the sites' public sizes."""
    from .setup import prepare_federation

    datasets, heldout = split
    fed = prepare_federation(out_dir / "federation", datasets)
    save_npz(heldout, out_dir / "federation" / "heldout.npz")
    # the job is planned from the sites' PUBLIC sizes (their policies), as a real coordinator must
    site_size = min(s.size for s in fed.sites)
    facts = public.facts if public is not None else None
    cfg = demo_config(preset, epsilon, site_size, rounds, local_steps, quick, secure, facts)
    return fed, cfg


def _start_processes(out_dir: Path, fed: Any, procs: list[Any], console: Any, device: str = "cpu") -> str:
    from edge.launch import NodeSettings, start_node

    port = free_port()
    coord = out_dir / "coordinator"
    procs.append(start_superlink(SuperLinkSettings(port=port, database=None, insecure=True, home=coord)))
    console.log(
        f"coordinator SuperLink on 127.0.0.1:{port} (pid {procs[-1].pid}; --insecure: loopback demo only)"
    )
    for s in fed.sites:
        ns = NodeSettings(
            data=s.data,
            policy=s.policy,
            trusted_policy_key=s.policy_pub,
            ledger=s.ledger,
            site_key=s.site_key,
            data_secret=s.data_secret,
            superlink=f"127.0.0.1:{port}",
            port=free_port(),
            insecure=True,
            device=device,
        )
        procs.append(start_node(ns))
        console.log(
            f"site node {s.site_id} started (pid {procs[-1].pid}); policy verified, "
            "keyed data commitment checked"
        )
    return f"127.0.0.1:{port}"


class _NoStatus:
    """``console.status``'s interface without the spinner (``--no-progress``): the log lines stay."""

    def __enter__(self) -> _NoStatus:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *args: Any, **kw: Any) -> None:
        return None


def _status(console: Any, progress: bool, text: str) -> Any:
    return console.status(text) if progress else _NoStatus()


def _run_job(
    out_dir: Path,
    fed: Any,
    cfg: Any,
    address: str,
    console: Any,
    status: Any,
    device: str = "cpu",
    public: DemoPublic | None = None,
) -> dict[str, Any]:
    from .runner import PublicOption, run_signed_job, sign_or_resume

    job_file = out_dir / "federation" / "job.toml"
    job_file.write_text(job_toml(cfg), "utf-8")
    job_out = out_dir / "job"
    # as `coordinator run --public PATH --public-description TEXT`: hashed into the signed job's [public],
    # handed to the ServerApp in job_out; the sites receive the job, never the path or the images
    option = PublicOption(str(public.path), public.description) if public is not None else PublicOption()
    sites = [s.site_id for s in fed.sites]
    signed = sign_or_resume(job_file, sites, fed.coordinator_key, job_out, None, option)

    def on_line(line: str) -> None:
        if line.startswith("[feta] "):
            text = line.removeprefix("[feta] ")
            console.log(escape(text))  # "[central]", "[sampler]": stage names, not rich markup
            status.update(f"[bold]{escape(text)}")
        elif "ERROR" in line or "Traceback" in line or line.startswith("feta_release"):
            console.log(f"[red]{escape(line)}")

    return run_signed_job(
        signed,
        fed.coordinator_key,
        job_out,
        address,
        insecure=True,
        on_line=on_line,
        retry_hint=f"run the demo again with a new --out (logs of this run stay in {out_dir})",
        device=device,
        public=option,
    )


def _stop_all(procs: list[Any]) -> None:
    """Stop every process group at once: one by one, a loaded machine can take ~15 s per process (SIGTERM
    wait, then SIGKILL), so a Ctrl-C took over a minute to return."""
    taken, procs[:] = list(procs), []
    if taken:
        with ThreadPoolExecutor(len(taken)) as pool:
            list(pool.map(lambda p: p.stop(), taken))
