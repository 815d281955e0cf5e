"""``[dpsgd] public_batch`` in a federated job: the coordinator sends the pooled, post-processed central
images with every per-site DP-SGD round as PUBLIC input, and the site mixes RandAugment-ed copies of them into
every step from the job's public seed, the stream ``train`` draws from (docs/architecture.md). Before, the
config refused the knob for any federated job, so a federation of one could not run a ``train`` job that used
it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from feta_release.accounting import PrivacyEvent
from feta_release.errors import PolicyError, PrivacyError
from feta_release.federation import messages as fm
from feta_release.federation.driver import JobDriver
from feta_release.models import build_denoiser
from feta_release.stages.context import public_generator
from feta_release.training.dpsgd import DPSGDTrainer
from tests.support.federation import tiny_job

SHAPE = (1, 16, 16)


def _central(m: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    return rng.random((m, *SHAPE), dtype=np.float32), np.arange(m, dtype=np.int64) % 10


def _weights(cfg) -> dict[str, np.ndarray]:
    torch.manual_seed(1)
    return {k: v.numpy() for k, v in build_denoiser(cfg.model, SHAPE, 10).state_dict().items()}


def test_a_sites_round_mixes_the_sent_central_images_from_the_jobs_public_stream(monkeypatch):
    from edge.releases import dpsgd_round

    cfg = tiny_job(dpsgd={"batch": 4, "physical_batch": 4, "public_batch": 3})
    central = _central()
    mixes = []
    init = DPSGDTrainer.__init__

    def capture(self, *a, **kw):
        pub = kw.get("public")
        mixes.append((pub, None if pub is None else pub.generator.get_state().clone()))
        init(self, *a, **kw)

    monkeypatch.setattr(DPSGDTrainer, "__init__", capture)
    rng = np.random.default_rng(0)
    ds = SimpleNamespace(
        images=rng.random((12, *SHAPE), dtype=np.float32),
        labels=rng.integers(0, 10, 12),
        image_shape=SHAPE,
        n_classes=10,
    )
    dpsgd_round(
        ds,
        cfg,
        fm.with_round_public(_weights(cfg), central),
        PrivacyEvent("dpsgd", 1.5, 4 / 12, 1),
        torch.Generator().manual_seed(0),
        12,
    )
    ((mix, state),) = mixes
    assert mix is not None and mix.batch == 3
    # drawn from the job's PUBLIC seed: the stream train's stage draws its mix from
    assert torch.equal(state, public_generator(cfg, "dpsgd-public").get_state())
    x, y = mix.draw(50, public_generator(cfg, "any"))
    assert x.shape == (50, *SHAPE) and float(x.min()) >= -1 - 1e-6 and float(x.max()) <= 1 + 1e-6
    assert set(y.tolist()) <= set(central[1].tolist())


BAD_PUBLIC = {
    "NaN images": lambda c: (np.full_like(c[0], np.nan), c[1]),
    "images above 1": lambda c: (c[0] + 2.0, c[1]),
    "another image shape": lambda c: (c[0][:, :, :8], c[1]),
    "a label outside the classes": lambda c: (c[0], c[1] + 10),
    "no images": lambda c: (c[0][:0], c[1][:0]),
}


@pytest.mark.parametrize("what", sorted(BAD_PUBLIC))
def test_a_round_with_bad_public_input_is_refused_before_the_charge(what):
    """Attack: the coordinator's public input is not images the job's step can mix (NaN would make the update
    NaN or not depending on the private batch; out-of-range images or labels are not released central
    images)."""
    from edge.releases import check_round

    cfg = tiny_job(dpsgd={"public_batch": 3})
    w = _weights(cfg)
    check_round(cfg, SHAPE, 10, fm.with_round_public(w, _central()))
    with pytest.raises(PrivacyError, match="round refused"):
        check_round(cfg, SHAPE, 10, fm.with_round_public(w, BAD_PUBLIC[what](_central())))


def test_public_input_is_sent_exactly_when_the_job_mixes_it():
    from edge.releases import check_round

    w = _weights(tiny_job())
    with pytest.raises(PrivacyError, match="carries no central images"):
        check_round(tiny_job(dpsgd={"public_batch": 3}), SHAPE, 10, w)
    with pytest.raises(PrivacyError, match="carries central images"):
        check_round(tiny_job(), SHAPE, 10, fm.with_round_public(w, _central()))
    with pytest.raises(PolicyError, match="public input"):
        check_round(tiny_job(dpsgd={"public_batch": 3}), SHAPE, 10, {**w, fm.PUBLIC_IMAGES: _central()[0]})


def test_the_coordinator_sends_the_pooled_central_images_with_each_round():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    model = torch.nn.Linear(3, 2)
    seen: list[dict[str, np.ndarray]] = []

    class Grid:
        def send_and_receive(self, msgs, timeout):
            out = []
            for m in msgs:
                _, arrays = fm.read_payload(m.content)
                seen.append(arrays)
                reply = {k: v for k, v in arrays.items() if not k.startswith(fm.PUBLIC_PREFIX)}
                out.append(
                    SimpleNamespace(
                        metadata=SimpleNamespace(src_node_id=m.metadata.dst_node_id),
                        has_error=lambda: False,
                        content=fm.make_payload({}, reply),
                    )
                )
            return out

    drv = JobDriver.__new__(JobDriver)
    drv.grid, drv.signed_job, drv.query_timeout = Grid(), {}, 1.0
    drv.cfg = SimpleNamespace(
        federation=SimpleNamespace(min_sites=1, local_steps=1), dpsgd=SimpleNamespace(ema=0.9, public_batch=3)
    )
    drv.sites = {"a": SimpleNamespace(node_id=1, size=100)}
    drv.planned_dpsgd, drv.skipped, drv.emit = {}, {}, lambda *a, **k: None
    drv.public_central = _central()
    assert drv._round(0, model) == ["a"]
    (arrays,) = seen
    assert np.array_equal(arrays[fm.PUBLIC_IMAGES], drv.public_central[0])
    assert np.array_equal(arrays[fm.PUBLIC_LABELS], drv.public_central[1])
