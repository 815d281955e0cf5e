"""Run-directory files: atomic writes, torch checkpoints, job hash."""

from __future__ import annotations

import os

import pytest
import torch

from feta_release.config import config_hash, load_preset
from feta_release.errors import FetaError
from feta_release.files import atomic_write_bytes, atomic_write_json
from feta_release.files import read_run_json as read_json
from feta_release.training.checkpoint import load_torch, save_torch


def test_atomic_write_replaces_and_leaves_no_temporaries(tmp_path):
    p = tmp_path / "sub" / "plan.json"
    atomic_write_json(p, {"a": 1})
    atomic_write_json(p, {"a": 2})
    assert read_json(p) == {"a": 2}
    assert sorted(os.listdir(p.parent)) == ["plan.json"]


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "x.json"
    atomic_write_json(p, {"v": "old"})

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_bytes(p, b'{"v": "new"}')
    monkeypatch.undo()
    assert read_json(p) == {"v": "old"}


def test_corrupt_json_is_a_clear_error(tmp_path):
    p = tmp_path / "job_summary.json"
    p.write_text("{not json")
    with pytest.raises(FetaError, match="corrupt"):
        read_json(p)


def test_torch_checkpoint_round_trip_with_generator_state(tmp_path):
    state = {"w": torch.arange(4.0), "gen": torch.Generator().manual_seed(9).get_state(), "steps": 7}
    save_torch(tmp_path / "c.pt", state)
    back = load_torch(tmp_path / "c.pt")
    assert torch.equal(back["w"], state["w"]) and back["steps"] == 7
    g2 = torch.Generator()
    g2.set_state(back["gen"])
    assert torch.equal(torch.rand(3, generator=g2), torch.rand(3, generator=torch.Generator().manual_seed(9)))


def test_config_hash_depends_on_values_not_key_order():
    cfg = load_preset("tiny")
    d = cfg.to_dict()
    reordered = {k: d[k] for k in reversed(list(d))}
    assert config_hash(d) == config_hash(reordered)
    assert config_hash(d) != config_hash(cfg.replace(dpsgd={"steps": 5}).to_dict())


def test_one_model_file_format_written_atomically_and_read_weights_only(tmp_path):
    """`train` and the coordinator write model.pt with one writer (atomic), every reader uses one reader."""
    from feta_release.errors import ReleaseError
    from feta_release.models.model_file import read_model_file, write_model_file

    state = {"w": torch.arange(4.0), "n": torch.tensor(3)}
    p = write_model_file(
        tmp_path / "model.pt", spec={"kind": "x"}, state_dict=state, class_names=["a", 1], job_hash="ab"
    )
    doc = read_model_file(p)
    assert doc["class_names"] == ["a", "1"] and doc["job_hash"] == "ab" and doc["spec"] == {"kind": "x"}
    assert torch.equal(doc["state_dict"]["w"], state["w"])
    assert [q.name for q in tmp_path.iterdir()] == ["model.pt"]  # no temporary left behind
    # the coordinator's former format
    save_torch(tmp_path / "old.pt", {"model": state, "spec": {"kind": "x"}})
    with pytest.raises(
        ReleaseError, match=r"old\.pt: not a feta-release model file \(no state_dict, class_names\)"
    ):
        read_model_file(tmp_path / "old.pt")


def test_no_model_or_checkpoint_is_read_or_written_beside_the_one_writer_and_reader():
    """Grep guard: torch.save / torch.load appear only in training/checkpoint.py and models/model_file.py."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    hits = [
        f"{p.relative_to(root)}"
        for d in ("feta_release", "edge", "coordinator", "bench")
        for p in (root / d).rglob("*.py")
        if p.name not in ("checkpoint.py", "model_file.py")
        and ("torch.save(" in p.read_text("utf-8") or "torch.load(" in p.read_text("utf-8"))
    ]
    assert hits == []
