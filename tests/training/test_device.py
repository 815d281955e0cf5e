"""``--device auto|cpu|cuda`` resolution (CI is CPU-only: the CUDA path itself is exercised on a GPU
machine)."""

from __future__ import annotations

import pytest
import torch

from feta_release.cli import main
from feta_release.errors import ConfigError
from feta_release.training.device import resolve_device


def test_auto_follows_cuda_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda")


def test_cuda_without_a_gpu_and_unknown_names_are_one_line_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="auto, cpu, cuda"):
        resolve_device("tpu")


def test_train_cli_refuses_cuda_without_a_gpu_before_writing(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["train", "--preset", "tiny", "--device", "cuda", "--out", str(out), "--no-progress"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
