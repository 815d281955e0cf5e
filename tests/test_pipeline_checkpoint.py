"""Run-directory files: atomic writes, torch checkpoints, job hash."""

from __future__ import annotations

import os

import pytest
import torch

from feta_release.config import load_preset
from feta_release.errors import FetaError
from feta_release.training.checkpoint import (
    atomic_write_bytes,
    atomic_write_json,
    config_hash,
    load_torch,
    read_json,
    save_torch,
)


def test_atomic_write_replaces_and_leaves_no_temporaries(tmp_path):
    p = tmp_path / "sub" / "privacy.json"
    atomic_write_json(p, {"a": 1})
    atomic_write_json(p, {"a": 2})
    assert read_json(p) == {"a": 2}
    assert sorted(os.listdir(p.parent)) == ["privacy.json"]


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
    p = tmp_path / "run.json"
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
