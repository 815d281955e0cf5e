"""Signing a job (or reusing the one an interrupted run left) and submitting it with ``flwr run``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feta_release.config import JobConfig, load_job
from feta_release.data.loading import LoadOptions
from feta_release.errors import ConfigError, FetaError
from feta_release.federation.job import public_inputs, save_device, save_public
from feta_release.files import atomic_write_bytes
from feta_release.policy.jobs import sign_job
from feta_release.signing import load_private_key
from feta_release.stages.pretrain import PublicInputs, with_public
from feta_release.training.device import resolve_device

from .setup import APP_DIR
from .superlink import submit, write_flwr_config

SIGNED_JOB = "signed_job.json"


@dataclass(frozen=True)
class PublicOption:
    """``coordinator run --public PATH --public-description TEXT --pretrained FILE``: the coordinator's public
    inputs (only it reads them; the signed job's [public] names them by hash; the sites never need them)."""

    path: str | None = None
    description: str = ""
    pretrained: Path | None = None

    @staticmethod
    def options(cfg: Any) -> LoadOptions:
        """How the set is read: the job's [job] resize/image_size/window (as ``train`` without flags)."""
        return LoadOptions(resize=cfg.job.resize, image_size=cfg.job.image_size, window=cfg.job.window)

    def load(self, cfg: Any) -> PublicInputs | None:
        """The inputs read as ``train --public`` reads them (``data.public.read_public``)."""
        return public_inputs(self.path, self.description, self.pretrained, self.options(cfg))


def coordinator_device(name: str) -> str:
    """``--device`` resolved here, before anything is signed or written (``cuda`` without a GPU: one
    ConfigError line); ``auto`` becomes what it found, so the ServerApp computes where this check looked."""
    return resolve_device(name).type


def sign_or_resume(
    job_file: Path,
    sites: list[str],
    key_path: Path,
    out_dir: Path,
    job_id: str | None,
    public: PublicOption = PublicOption(),
) -> Path:
    """The signed job for ``out_dir``: the existing one when resuming (same job id: the sites' ledgers then
    answer already-paid requests from their records), a new one otherwise. ``public``: hashed into the job's
    ``[public]`` section (``stages.pretrain.with_public``: a job file naming another set is refused)."""
    cfg = load_job(job_file)
    inputs = public.load(cfg)
    shape = tuple(inputs.data.image_shape) if inputs is not None and inputs.data is not None else (1, 1, 1)
    cfg = with_public(cfg, inputs, shape)  # type: ignore[arg-type]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SIGNED_JOB
    if path.exists():
        prev = json.loads(path.read_text("utf-8"))
        body = prev.get("job", {})
        # compared as signed: signing states the secure-aggregation default, which a job file may leave out
        named = body.get("config", {}).get("public", {})
        if (named.get("sha256") or named.get("pretrained_sha256")) and not cfg.public.enabled:
            raise ConfigError(
                f"{out_dir} holds job {body.get('job_id')!r}, signed with public inputs "
                "([public]): give the same --public PATH / --pretrained FILE to resume it"
            )
        if body.get("config") != cfg.with_secure_default(len(sites)).to_dict() or body.get("sites") != sites:
            raise ConfigError(
                f"{out_dir} holds job {body.get('job_id')!r} with another config or site list; "
                "use a new --out for a new job"
            )
        if job_id and job_id != body.get("job_id"):
            raise ConfigError(f"{out_dir} holds job {body.get('job_id')!r}, not {job_id!r}")
        return path
    if not sites:
        raise ConfigError("--sites: name at least one site")
    jid = job_id or f"{cfg.job.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    signed = sign_job(cfg, load_private_key(key_path), jid, sites)
    # a kill mid-write: no torn job to resume
    atomic_write_bytes(path, json.dumps(signed, indent=2).encode("utf-8"))
    return path


def run_signed_job(
    signed_path: Path,
    key_path: Path,
    out_dir: Path,
    superlink: str,
    *,
    insecure: bool,
    root_certificates: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    app_dir: Path = APP_DIR,
    retry_hint: str = "run the same command again to resume",
    device: str = "cpu",
    public: PublicOption = PublicOption(),
) -> dict[str, Any]:
    """Submit the signed job and return its summary; ``retry_hint`` ends the error of a run that did not
    finish (the demo cannot resume into its non-empty folder, so it says what to do instead). ``device``:
    where the ServerApp computes (:func:`coordinator_device`), handed to it in ``out_dir``
    (``federation.job.save_device``)."""
    home = out_dir / "flwr_cli_home"
    write_flwr_config(home, superlink, insecure=insecure, root_certificates=root_certificates)
    save_device(out_dir, device)  # every submit: a resume with another --device must not find the last one's
    given = public.path is not None or public.pretrained is not None  # else the job is not read for options
    opts = public.options(load_job_of(signed_path)) if given else LoadOptions()
    save_public(out_dir, public.path, public.description, public.pretrained, opts)  # likewise
    summary_path = out_dir / "job_summary.json"
    if summary_path.exists():
        summary_path.unlink()  # a stale summary must not pass for this run's
    code = submit(
        app_dir,
        home,
        {
            "job-file": str(signed_path.resolve()),
            "out-dir": str(out_dir.resolve()),
            "coordinator-key": str(key_path.resolve()),
        },
        on_line=on_line,
    )
    # `flwr run` exits 0 even when the ServerApp raised: the job's own summary is the proof it finished.
    if code != 0 or not summary_path.exists():
        last = _last_error(out_dir)
        raise FetaError(
            f"the job did not finish (flwr run exit code {code}){': ' + last if last else ''}; "
            f"progress log: {out_dir / 'progress.jsonl'}; {retry_hint}"
        )
    return json.loads(summary_path.read_text("utf-8"))


def load_job_of(signed_path: Path) -> Any:
    """The config of the signed job at ``signed_path`` (its body as signed)."""
    return JobConfig.from_dict(json.loads(signed_path.read_text("utf-8"))["job"]["config"])


def _last_error(out_dir: Path) -> str:
    p = out_dir / "progress.jsonl"
    if not p.exists():
        return ""
    for line in reversed(p.read_text("utf-8", errors="replace").splitlines()):
        try:
            ev = json.loads(line)
        except ValueError:  # the line a killed coordinator was writing
            continue
        if ev.get("phase") == "error" or ev.get("error"):
            return str(ev.get("message"))
    return ""
