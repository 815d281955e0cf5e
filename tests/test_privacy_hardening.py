"""Issue 12 §1: nothing un-noised leaves a site. Each test is an attack that worked on the code before the fix."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.setup import sign_job_file
from feta_release.federation import messages as fm

from .federation_fixtures import full_job, harness, make_federation, tiny_job

# What a site may put beside its released arrays: public values fixed by the signed job and policy, ids, and the
# privacy events (σ, q, steps: public too). Anything else is a new channel that must be reviewed first.
PUBLIC_REPLY_FIELDS = {
    fm.TRAIN: {"round", "num_examples", "sigma", "q", "site_id", "request_id", "events"},
    fm.CENTRAL: {"site_id", "request_id", "events"},
    fm.FREQUENCY: {"site_id", "request_id", "events"},
}


@pytest.fixture()
def fed(tmp_path):
    return make_federation(tmp_path / "fed")


def _weights(cfg):
    from feta_release.models import build_denoiser

    return {k: v.numpy() for k, v in build_denoiser(cfg.model, (1, 28, 28), 10).state_dict().items()}


def _ask(grid, signed, mtype, doc=None, arrays=None, node=100):
    msg = grid.create_message(fm.make_payload({"job": signed, **(doc or {})}, arrays), mtype, node, "t")
    (rep,) = grid.send_and_receive([msg])
    assert not rep.has_error(), rep.error.reason if rep.has_error() else ""
    return fm.read_payload(rep.content)


def test_train_reply_carries_no_loss_no_seconds_only_public_fields(fed):
    """Attack: a coordinator that picks the weights reads the un-noised mean loss of the private Poisson batch
    (a counting query) and the on-site seconds (the realised batch size) from every DP-SGD reply."""
    cfg = tiny_job()
    signed, _ = sign_job_file(fed, cfg, "job-reply")
    doc, arrays = _ask(harness(fed), signed, fm.TRAIN, {"round": 0}, _weights(cfg))
    assert "loss" not in doc and "seconds" not in doc
    assert set(doc) <= PUBLIC_REPLY_FIELDS[fm.TRAIN], set(doc) - PUBLIC_REPLY_FIELDS[fm.TRAIN]
    assert set(arrays) == set(_weights(cfg))  # the weights, and no extra array


def test_central_and_frequency_replies_carry_no_timing(fed):
    cfg = full_job()
    signed, _ = sign_job_file(fed, cfg, "job-stats")
    grid = harness(fed)
    for mtype in (fm.CENTRAL, fm.FREQUENCY):
        doc, _ = _ask(grid, signed, mtype)
        assert "seconds" not in doc
        assert set(doc) <= PUBLIC_REPLY_FIELDS[mtype], (mtype, set(doc) - PUBLIC_REPLY_FIELDS[mtype])


# -- the NaN/Inf channel ----------------------------------------------------------------------------------


def _rare_class_sites(label: int = 9):
    """A site without any image of class ``label`` and the same site plus one such image (the target)."""
    from .federation_fixtures import tiny_sites

    ds = tiny_sites()["site-a"]
    keep = np.flatnonzero(ds.labels != label)
    target = np.flatnonzero(ds.labels == label)[:1]
    return ds.subset(keep), ds.subset(np.sort(np.concatenate([keep, target])))


def _overflow_weights(cfg, label: int = 9):
    """Finite weights crafted so that the forward pass overflows for images of class ``label`` only."""
    w = _weights(cfg)
    w["net.class_embed.weight"][label] = 3e38
    return w


def test_crafted_weights_overflowing_one_image_do_not_reveal_its_membership():
    """Attack (NaN/Inf channel): the coordinator sends FINITE weights crafted so that the loss of one image
    (the only image of a rare class) overflows. On the old code the clipped sum became NaN exactly when that
    image was sampled, so NaN in the returned weights answered "is the image in the data?" with certainty."""
    import torch

    from edge.releases import dpsgd_round
    from feta_release.accounting import PrivacyEvent

    cfg = tiny_job(model={"label_dropout": 0.0})
    without, with_target = _rare_class_sites()
    weights = _overflow_weights(cfg)
    event = PrivacyEvent("dpsgd", 1.0, 1.0, 1)  # q = 1: the target is in every batch it belongs to
    for ds in (without, with_target):
        out = dpsgd_round(ds, cfg, weights, event, torch.Generator().manual_seed(0))
        assert all(np.isfinite(v).all() for v in out.values())


class _ExpOfDot:
    """loss = exp(<w, x>): crafted w makes it overflow for one chosen x only (a stand-in for crafted weights)."""

    def draw(self, n, generator):
        import torch

        return {"z": torch.zeros(n, 1)}

    def __call__(self, model, x, y, rand):
        return model(x.unsqueeze(0)).exp().sum() + rand["z"].sum()


@pytest.mark.parametrize("seed", range(6))
def test_overflowing_example_acts_exactly_like_a_zero_gradient_example(seed):
    """Attack (NaN/Inf channel), statistical form: with Poisson rate 1/2, the old engine returned NaN in about half
    of the steps (exactly those that sampled the target). Now the target's contribution is replaced by zero, so the
    released noisy gradient is bit-identical to the one for a dataset holding a zero-gradient image in its place:
    its distribution is that of the neighbouring dataset plus a harmless example, whatever the weights."""
    import torch
    from torch import nn

    from feta_release.config import JobConfig
    from feta_release.training.dpsgd import DPSGDTrainer

    cfg = JobConfig().replace(dpsgd={"batch": 4, "steps": 1, "physical_batch": 3, "noise_multiplicity": 1, "clip": 1.0})
    g = torch.Generator().manual_seed(100 + seed)
    others = torch.cat([torch.zeros(9, 1), torch.rand(9, 2, generator=g)], 1)  # <w, x> = 0 for these
    target = torch.tensor([[1.0, 0.0, 0.0]])  # <w, x> = 1000: exp overflows to inf, its gradient is inf/NaN
    zero = torch.zeros(1, 3)  # gradient of exp(<w, x>) w.r.t. w is exp(.) x = 0
    outs = []
    for extra in (target, zero):
        model = nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[1000.0, 0.0, 0.0]]))
        tr = DPSGDTrainer(model, cfg, 1.0, 0.5, torch.Generator().manual_seed(seed), loss=_ExpOfDot())
        x = torch.cat([others, extra])
        noisy, stats = tr.noisy_gradient(x, torch.zeros(10, dtype=torch.long))
        outs.append(noisy["weight"])
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


@st.composite
def _grads_with_poison(draw):
    b = draw(st.integers(1, 6))
    shapes = [(b, draw(st.integers(1, 4)), draw(st.integers(1, 3))), (b, draw(st.integers(1, 5)))]
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3, 1e19]))
    poisoned = draw(st.lists(st.booleans(), min_size=b, max_size=b))
    bad = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return shapes, seed, scale, poisoned, bad


@given(_grads_with_poison(), st.floats(0.01, 10.0))
@settings(max_examples=60, deadline=None)
def test_clip_and_sum_drops_non_finite_examples_and_keeps_the_bound(case, clip):
    """Property: whatever NaN/inf some examples' gradients hold, the clipped sum is finite, equals the clipped sum of
    the finite examples alone, and each example contributes at most C (the sensitivity under add/remove)."""
    import torch

    from feta_release.training.dpsgd import clip_and_sum

    shapes, seed, scale, poisoned, bad = case
    g = torch.Generator().manual_seed(seed)
    grads = {f"p{i}": torch.randn(s, generator=g) * scale for i, s in enumerate(shapes)}
    for i, p in enumerate(poisoned):
        if p:
            grads["p0"][i].view(-1)[0] = bad
    summed, norms = clip_and_sum(grads, clip)
    assert all(torch.isfinite(v).all() for v in summed.values())
    clean = [i for i, p in enumerate(poisoned) if not p]
    if clean:
        ref, _ = clip_and_sum({k: v[clean] for k, v in grads.items()}, clip)
        for k in grads:
            torch.testing.assert_close(summed[k], ref[k], rtol=1e-5, atol=1e-6 * clip)
    else:
        assert all(float(v.abs().max()) == 0.0 for v in summed.values())
    for i in range(len(poisoned)):
        one, _ = clip_and_sum({k: v[i:i + 1] for k, v in grads.items()}, clip)
        assert math.sqrt(sum(float(v.double().pow(2).sum()) for v in one.values())) <= clip * (1 + 1e-5)
    assert all(math.isinf(float(norms[i])) for i, p in enumerate(poisoned) if p)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_incoming_weights_are_refused(bad):
    """Attack (NaN/Inf channel): the old node checked only names and shapes, and trained on NaN/inf weights."""
    import torch

    from edge.releases import dpsgd_round
    from feta_release.accounting import PrivacyEvent
    from feta_release.errors import PrivacyError

    cfg = tiny_job()
    ds, _ = _rare_class_sites()
    w = _weights(cfg)
    w["net.conv_out.bias"][0] = bad
    with pytest.raises(PrivacyError, match=r"NaN/infinite value\(s\).*net\.conv_out\.bias"):
        dpsgd_round(ds, cfg, w, PrivacyEvent("dpsgd", 1.0, 0.5, 1), torch.Generator().manual_seed(0))


def test_node_refuses_non_finite_weights_before_charging(fed):
    """The same attack through the node: an error reply naming the problem, and nothing charged to the ledger."""
    cfg = tiny_job()
    signed, _ = sign_job_file(fed, cfg, "job-nan")
    w = _weights(cfg)
    w["net.conv_out.weight"][0, 0, 0, 0] = float("nan")
    grid = harness(fed)
    msg = grid.create_message(fm.make_payload({"job": signed, "round": 0}, w), fm.TRAIN, 100, "t")
    (rep,) = grid.send_and_receive([msg])
    assert rep.has_error() and "NaN/infinite" in rep.error.reason
    from edge.ledger import Ledger

    assert Ledger(fed.sites[0].ledger).job_events("job-nan") == []


# -- keyed commitment instead of a plain data hash ----------------------------------------------------------


def test_hello_and_policy_carry_no_plain_data_hash(fed):
    """Attack (membership by hashing): the policy in every `hello` reply and release held sha256 of all pixels
    and labels; anyone who knows all images but one hashes each candidate for the last one and compares. The
    site's data fingerprint must appear nowhere in what the site sends."""
    import json

    from feta_release.data.loading import load_dataset

    cfg = tiny_job()
    signed, _ = sign_job_file(fed, cfg, "job-hello")
    doc, _ = _ask(harness(fed), signed, fm.HELLO)
    site = fed.site(doc["site_id"])
    ds, _ = load_dataset(site.data)
    sent = json.dumps(doc)
    assert ds.fingerprint() not in sent
    assert doc["policy"]["policy"]["dataset"]["commitment"] == site.commitment != ds.fingerprint()
    assert "fingerprint" not in doc["policy"]["policy"]["dataset"]


def test_commitment_is_keyed_binding_and_needs_the_secret(tmp_path):
    """Without the secret the commitment cannot be recomputed for a candidate dataset (it differs under any other
    key), with it any change of one pixel or label is detected."""
    from feta_release.data.commitment import create_secret, dataset_commitment, load_secret
    from feta_release.data.dataset import ImageDataset

    rng = np.random.default_rng(0)
    ds = ImageDataset(rng.random((6, 1, 4, 4)).astype(np.float32), np.arange(6) % 2, ("a", "b"))
    k1, k2 = load_secret(create_secret(tmp_path / "a")), load_secret(create_secret(tmp_path / "b"))
    c = dataset_commitment(ds, k1)
    assert len(c) == 64 and c == dataset_commitment(ds, k1)
    assert c != dataset_commitment(ds, k2) and c != ds.fingerprint()
    img = ds.images.copy()
    img[3, 0, 1, 2] = np.nextafter(img[3, 0, 1, 2], np.float32(2))
    assert dataset_commitment(ImageDataset(img, ds.labels, ds.class_names), k1) != c
    lab = ds.labels.copy()
    lab[5] = 1 - lab[5]
    assert dataset_commitment(ImageDataset(ds.images, lab, ds.class_names), k1) != c


def test_data_secret_file_is_256_bits_owner_only_and_never_overwritten(tmp_path):
    import os
    import stat

    from feta_release.data.commitment import SECRET_BYTES, create_secret, load_secret
    from feta_release.errors import ConfigError

    p = create_secret(tmp_path / "s" / "data.secret")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    key = load_secret(p)
    assert len(key) >= SECRET_BYTES == 32
    assert load_secret(create_secret(tmp_path / "other")) != key  # drawn from the OS, not derived
    with pytest.raises(ConfigError, match="already exists"):
        create_secret(p)
    assert load_secret(p) == key
    os.chmod(p, 0o644)
    with pytest.raises(ConfigError, match=r"readable by other users.*chmod 600"):
        load_secret(p)
    with pytest.raises(ConfigError, match="not found.*data-commitment"):
        load_secret(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("ab" * 16)
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="128 bits"):
        load_secret(short)


def test_policy_data_commitment_cli_creates_secret_and_suggests_a_round_public_size(tmp_path):
    from click.testing import CliRunner

    from feta_release.cli import cli

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", images=rng.random((1234, 1, 4, 4)).astype(np.float32), labels=np.arange(1234) % 3)
    res = CliRunner().invoke(cli, ["policy", "data-commitment", str(tmp_path / "d.npz"), "--secret",
                                   str(tmp_path / "data.secret")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "data.secret").stat().st_mode & 0o077 == 0
    assert "size = 1200" in res.output and 'commitment = "' in res.output
