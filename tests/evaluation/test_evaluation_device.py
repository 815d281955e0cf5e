"""The evaluation classifiers train where they are told (a GPU for a benchmark's many rows) and always come
back on the CPU, so scoring, features and the report do not depend on where they trained."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from feta_release import evaluation
from feta_release.eval_classifier import train_classifier
from tests.support.finding_images import finding_images

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_classifier_trained_on_a_device_is_returned_on_the_cpu(device: str) -> None:
    ds = finding_images(12, size=16, seed=3)
    state = torch.random.get_rng_state()
    net = train_classifier(ds, 2, seed=0, device=device)
    assert all(p.device.type == "cpu" for p in net.parameters())
    assert torch.equal(torch.random.get_rng_state(), state)  # the global CPU RNG is left as it was
    assert net.fit_log is not None and net.fit_log.epochs >= 1
    with torch.no_grad():
        assert net(torch.from_numpy(ds.images[:4])).shape == (4, ds.n_classes)


def test_evaluate_trains_every_classifier_on_the_device_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = evaluation.train_classifier

    def spy(*a: Any, **kw: Any) -> Any:
        seen.append(kw.get("device", "default"))
        return real(*a, **{**kw, "device": "cpu"})

    monkeypatch.setattr(evaluation, "train_classifier", spy)
    ds = finding_images(10, size=16, seed=4)
    half = np.arange(ds.n) % 2 == 0
    evaluation.evaluate(
        ds.subset(np.flatnonzero(half)),
        ds.subset(np.flatnonzero(~half)),
        0,
        classifier_epochs=1,
        feature_epochs=1,
        device="cuda",
    )
    assert seen == ["cuda"] * 4  # the synthetic classifier, two cross-fitted ceilings, the feature network
