"""Public pretraining ([public], train --public / --pretrained): named in the job, free in the ledger,
first."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from rich.console import Console

from feta_release.config import JobConfig, load_preset
from feta_release.data import ImageDataset, load_embedded
from feta_release.data.procedural import generate_dataset
from feta_release.errors import ConfigError, DataError
from feta_release.models.model_file import read_model_file
from feta_release.planning import plan, stage_events
from feta_release.stages import PublicInputs
from feta_release.stages.pretrain import PRETRAINED_FILE, mapped_labels, with_public
from feta_release.training.progress import Reporter
from tests.support.training import site_requests, train_run

pytestmark = pytest.mark.slow  # two tiny runs


def _data(n: int = 240) -> ImageDataset:
    full = load_embedded()
    rng = np.random.default_rng(0)
    idx = np.concatenate(
        [rng.choice(np.flatnonzero(full.labels == c), n // 10, replace=False) for c in range(10)]
    )
    return full.subset(np.sort(idx))


def _cfg(**over) -> JobConfig:
    base = load_preset("tiny").replace(public={"pretrain_iterations": 6, "pretrain_batch": 16})
    return base.replace(**over) if over else base


@pytest.fixture(scope="module")
def strokes() -> ImageDataset:
    return generate_dataset("strokes", 64, size=28, seed=4)


@pytest.fixture(scope="module")
def shown() -> io.StringIO:
    """What ``train``'s progress lines (``--progress``, the default) showed of the public run."""
    return io.StringIO()


@pytest.fixture(scope="module")
def public_run(tmp_path_factory, strokes, shown):
    out = tmp_path_factory.mktemp("pub") / "r"
    res = train_run(
        _cfg(),
        _data(),
        out,
        n_synthetic=10,
        public_size=240,
        public=PublicInputs(strokes, "procedural pen strokes, seed 4"),
        reporter=Reporter(enabled=True, console=Console(file=shown, width=200)),
    )
    return out, res


def test_the_job_names_the_public_set_by_hash_count_shape_and_description(public_run, strokes):
    out, _ = public_run
    job = json.loads((out / "signed_job.json").read_text())["job"]["config"]
    assert job["public"]["sha256"] == strokes.fingerprint()
    assert job["public"]["count"] == 64 and job["public"]["shape"] == [1, 28, 28]
    assert job["public"]["description"] == "procedural pen strokes, seed 4"
    assert job["public"]["class_names"] == list(strokes.class_names)
    said = [json.loads(line)["message"] for line in (out / "progress.jsonl").read_text().splitlines()]
    assert "public pretraining: 6 steps" in said
    assert list((out / "grids").glob("*-after-pretrain.png"))


def test_pretraining_reports_its_progress_as_the_warm_ups_do(public_run, shown):
    out, _ = public_run
    events = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    said = [e["message"] for e in events if e["phase"] == "pretrain"]
    assert said[0] == "public pretraining on 64 public images, 6 steps of 16"
    assert [m.split(" loss ")[0] for m in said[1:-1]] == [f"pretrain {i}/6" for i in range(1, 7)]
    assert said[-1] == "public pretraining: 6 steps"
    phases = [e["phase"] for e in events]
    first_warmup = phases.index("warmup")
    assert max(i for i, p in enumerate(phases) if p == "pretrain") < first_warmup  # before the warm-ups
    assert "pretrain: pretrain 6/6 loss" in shown.getvalue()  # train's progress lines show it


def test_pretraining_costs_nothing_in_the_ledger(public_run):
    out, res = public_run
    plain = stage_events(load_preset("tiny"), 240)
    assert (
        stage_events(_cfg().replace(public={"sha256": "0" * 64, "count": 64, "shape": [1, 28, 28]}), 240)
        == plain
    )
    rows = site_requests(out)
    assert [r["mechanism"] for r in rows] == ["central", "frequency", "dpsgd"]  # nothing for the public set
    assert res.epsilon == pytest.approx(plan(load_preset("tiny"), 240).epsilon, rel=1e-9)


def test_a_pretrained_file_is_reused_by_hash_and_gives_the_same_start(public_run, tmp_path, strokes):
    out, _ = public_run
    f = out / PRETRAINED_FILE
    doc = read_model_file(f)
    assert doc["public"]["sha256"] == strokes.fingerprint()
    cfg = _cfg(public={"pretrain_iterations": 0})
    res = train_run(
        cfg, _data(), tmp_path / "again", public_size=240, public=PublicInputs(pretrained=f), release=False
    )
    job = json.loads((tmp_path / "again" / "signed_job.json").read_text())["job"]["config"]
    assert job["public"]["pretrained_sha256"] and job["public"].get("sha256") is None
    again = read_model_file(tmp_path / "again" / PRETRAINED_FILE)["state_dict"]
    for k, v in doc["state_dict"].items():
        assert torch.equal(v, again[k]), k
    assert res.epsilon > 0


def test_the_job_refuses_another_public_set_than_the_one_it_names(strokes):
    cfg = with_public(_cfg(), PublicInputs(strokes), (1, 28, 28))
    other = generate_dataset("strokes", 64, size=28, seed=5)
    with pytest.raises(DataError, match="not the public set"):
        with_public(cfg, PublicInputs(other), (1, 28, 28))
    with pytest.raises(ConfigError, match="--public PATH"):
        with_public(cfg, None, (1, 28, 28))
    with pytest.raises(DataError, match="private data's"):
        with_public(_cfg(), PublicInputs(generate_dataset("strokes", 8, size=32)), (1, 28, 28))


def test_public_labels_map_onto_private_classes_by_name_or_label_map_else_null(strokes):
    private = ("arc", "x", "y")
    lab = mapped_labels(strokes, private, ())
    names = np.array(strokes.class_names)[strokes.labels]
    assert np.array_equal(lab == 0, names == "arc") and set(lab[names != "arc"]) == {3}  # 3: the null label
    lab = mapped_labels(strokes, private, ("loop=y",))
    assert np.array_equal(lab == 2, names == "loop")
    with pytest.raises(ConfigError, match="label_map"):
        mapped_labels(strokes, private, ("loop=z",))


def test_public_section_is_strict_and_absent_jobs_hash_as_before():
    base = load_preset("tiny")
    assert "public" not in base.to_dict()
    with pytest.raises(ConfigError, match="sha256"):
        base.replace(public={"sha256": "xyz"})
    with pytest.raises(ConfigError, match="unknown key"):
        JobConfig.from_dict({"public": {"path": "/data"}})
    with pytest.raises(ConfigError, match="count >= 1"):
        base.replace(public={"sha256": "a" * 64})


def test_a_federated_job_sends_the_sites_the_public_hash_never_the_public_images(tmp_path, monkeypatch):
    """The coordinator pretrains; every message to a site (encoded as on the wire) holds the job's [public]
    hash and none of the public images' bytes, and each site's ledger charges the plan of the same job without
    [public]."""
    from flwr.common.serde import message_to_proto

    from coordinator.setup import sign_job_file
    from feta_release.federation import harness as h
    from tests.support.federation import harness, ledger_requests, make_federation, run_harness_job, tiny_job

    fed = make_federation(tmp_path / "fed")
    public = generate_dataset("strokes", 48, size=28, seed=9)
    pub = PublicInputs(public, "pen strokes")
    base = tiny_job(public={"pretrain_iterations": 3, "pretrain_batch": 8})
    cfg = with_public(base, pub, (1, 28, 28))
    signed, _ = sign_job_file(fed, cfg, "job-pub")
    sent: list[bytes] = []
    wire = h._wire

    def record(msg):
        sent.append(message_to_proto(msg).SerializeToString())
        return wire(msg)

    monkeypatch.setattr(h, "_wire", record)
    res = run_harness_job(fed, harness(fed), signed, tmp_path / "out", public=pub)
    assert res.rounds_done == 2
    assert any(public.fingerprint().encode() in m for m in sent)  # the job, naming the set by hash
    images = [np.ascontiguousarray(public.images[i], "<f4").tobytes() for i in range(public.n)]
    pixels = [np.rint(public.images[i] * 255).astype(np.uint8).tobytes() for i in range(public.n)]
    assert not any(img in m for m in sent for img in images + pixels)
    plain, _ = sign_job_file(fed, base, "job-plain")
    run_harness_job(fed, harness(fed), plain, tmp_path / "plain")
    for s in fed.sites:
        got = [r["events"] for r in ledger_requests(fed, s.site_id, "job-pub")]
        assert got == [r["events"] for r in ledger_requests(fed, s.site_id, "job-plain")]
    again, _ = sign_job_file(fed, cfg, "job-pub-again")
    with pytest.raises(ConfigError, match="--public PATH"):  # the coordinator never skips it silently
        run_harness_job(fed, harness(fed), again, tmp_path / "nopub")
    assert ledger_requests(fed, "site-a", "job-pub-again") == []  # refused before any release


def test_verify_shows_the_public_set_and_checks_its_hash_when_given(public_run, strokes, tmp_path):
    from feta_release.data import save_npz
    from feta_release.release.verify import verify_release
    from feta_release.signing import load_public_key

    out, _ = public_run
    rel = out / "release"
    trust = {"site": [load_public_key(out / "keys" / "policy-admin.pub")]}

    def public_check(path=None):
        res = verify_release(rel, trust, public=path)
        return next(c for c in res.checks if c.name == "public data")

    shown = public_check()
    assert (
        shown.status == "pass" and strokes.fingerprint()[:16] in shown.detail and "64 images" in shown.detail
    )
    save_npz(strokes, tmp_path / "same.npz")
    assert public_check(tmp_path / "same.npz").status == "pass"
    save_npz(generate_dataset("strokes", 64, size=28, seed=5), tmp_path / "other.npz")
    bad = public_check(tmp_path / "other.npz")
    assert bad.status == "fail" and "sha256" in bad.detail


def test_train_reads_public_through_the_private_loader_and_refuses_a_stray_description(tmp_path, strokes):
    from feta_release.cli.train_cmd import _public_inputs
    from feta_release.data import save_npz

    save_npz(strokes, tmp_path / "public.npz", dtype="uint8")
    private = _data(20)
    got = _public_inputs(_cfg(), str(tmp_path / "public.npz"), "strokes", None, None, private)
    assert got.data.n == 64 and got.description == "strokes" and got.data.image_shape == (1, 28, 28)
    private32 = generate_dataset("strokes", 4, size=32, seed=0)
    with pytest.raises(DataError, match="private data's"):
        _public_inputs(_cfg(), str(tmp_path / "public.npz"), "", None, None, private32)
    with pytest.raises(ConfigError, match="--public PATH"):
        _public_inputs(_cfg(), None, "a description without a set", None, None, private)
    assert _public_inputs(_cfg(), None, "", None, None, private) is None
