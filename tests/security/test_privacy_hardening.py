"""Nothing un-noised leaves a site. Each test is an attack that worked on the code before the fix."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.setup import sign_job_file
from feta_release.federation import messages as fm
from tests.support.federation import full_job, harness, make_federation, tiny_job

# What a site may put beside its released arrays: public values fixed by the signed job and policy, ids, and
# the privacy events (σ, q, steps: public too). Anything else is a new channel that must be reviewed first.
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
    assert set(arrays) == set(fm.with_ema(_weights(cfg), _weights(cfg)))  # the weights and their EMA only


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
    from tests.support.federation import tiny_sites

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
        out = dpsgd_round(ds, cfg, weights, event, torch.Generator().manual_seed(0), 40)
        assert all(np.isfinite(v).all() for v in out.values())


class _ExpOfDot:
    """loss = exp(<w, x>): crafted w makes it overflow for one chosen x only (a stand-in for crafted
    weights)."""

    def draw(self, n, generator):
        import torch

        return {"z": torch.zeros(n, 1)}

    def __call__(self, model, x, y, rand):
        return model(x.unsqueeze(0)).exp().sum() + rand["z"].sum()


@pytest.mark.parametrize("seed", range(6))
def test_overflowing_example_acts_exactly_like_a_zero_gradient_example(seed):
    """Attack (NaN/Inf channel), statistical form: with Poisson rate 1/2, the old engine returned NaN in about
    half of the steps (exactly those that sampled the target). Now the target's contribution is replaced by
    zero, so the released noisy gradient is bit-identical to the one for a dataset holding a zero-gradient
    image in its place: its distribution is that of the neighbouring dataset plus a harmless example, whatever
    the weights."""
    import torch
    from torch import nn

    from feta_release.config import JobConfig
    from feta_release.training.dpsgd import DPSGDTrainer

    cfg = JobConfig().replace(
        dpsgd={"batch": 4, "steps": 1, "physical_batch": 3, "noise_multiplicity": 1, "clip": 1.0}
    )
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


def _poisoned_grads(case):  # noqa: ANN001, ANN202 - a _grads_with_poison draw
    """The drawn gradients (name -> (B, ...)), the poisoned examples' first entry set to the drawn NaN/inf."""
    import torch

    shapes, seed, scale, poisoned, bad = case
    g = torch.Generator().manual_seed(seed)
    grads = {f"p{i}": torch.randn(s, generator=g) * scale for i, s in enumerate(shapes)}
    for i, p in enumerate(poisoned):
        if p:
            grads["p0"][i].view(-1)[0] = bad
    return grads, poisoned


@given(_grads_with_poison(), st.floats(0.01, 10.0))
@settings(max_examples=60, deadline=None)
def test_clip_and_sum_drops_non_finite_examples_and_keeps_the_bound(case, clip):
    """Property: whatever NaN/inf some examples' gradients hold, the clipped sum is finite, equals the clipped
    sum of the finite examples alone, and each example contributes at most C (the sensitivity under
    add/remove)."""
    import torch

    from feta_release.training.dpsgd import clip_and_sum

    grads, poisoned = _poisoned_grads(case)
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
        one, _ = clip_and_sum({k: v[i : i + 1] for k, v in grads.items()}, clip)
        assert math.sqrt(sum(float(v.double().pow(2).sum()) for v in one.values())) <= clip * (1 + 1e-5)
    assert all(math.isinf(float(norms[i])) for i, p in enumerate(poisoned) if p)


@given(_grads_with_poison(), st.floats(0.01, 10.0))
@settings(max_examples=60, deadline=None)
def test_clip_and_sum_in_place_equals_the_copying_form(case, clip):
    """Property: ``in_place=True`` (the DP-SGD step's hot path: non-finite entries zeroed in the handed-over
    gradients, no copy) returns the same sum and norms as the copying form, poisoned rows and all, and leaves
    every finite row as it was."""
    import torch

    from feta_release.training.dpsgd import clip_and_sum

    grads, poisoned = _poisoned_grads(case)
    keep = {k: v.clone() for k, v in grads.items()}
    ref, ref_norms = clip_and_sum(grads, clip)
    for k in grads:  # the copying form leaves its input as it was
        torch.testing.assert_close(grads[k], keep[k], rtol=0, atol=0, equal_nan=True)
    got, norms = clip_and_sum(grads, clip, in_place=True)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0)
    torch.testing.assert_close(norms, ref_norms, rtol=0, atol=0)
    clean = [i for i, p in enumerate(poisoned) if not p]
    for k in grads:
        assert torch.equal(grads[k][clean], keep[k][clean]) and torch.isfinite(grads[k]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_incoming_weights_are_refused(bad):
    """Attack (NaN/Inf channel): the old node checked only names and shapes, and trained on NaN/inf
    weights."""
    import torch

    from edge.releases import dpsgd_round
    from feta_release.accounting import PrivacyEvent
    from feta_release.errors import PrivacyError

    cfg = tiny_job()
    ds, _ = _rare_class_sites()
    w = _weights(cfg)
    w["net.conv_out.bias"][0] = bad
    with pytest.raises(PrivacyError, match=r"NaN/infinite value\(s\).*net\.conv_out\.bias"):
        dpsgd_round(ds, cfg, w, PrivacyEvent("dpsgd", 1.0, 0.5, 1), torch.Generator().manual_seed(0), 40)


def test_node_refuses_non_finite_weights_before_charging(fed):
    """The same attack through the node: an error reply naming the problem, and nothing charged to the
    ledger."""
    cfg = tiny_job()
    signed, _ = sign_job_file(fed, cfg, "job-nan")
    w = _weights(cfg)
    w["net.conv_out.weight"][0, 0, 0, 0] = float("nan")
    grid = harness(fed)
    msg = grid.create_message(fm.make_payload({"job": signed, "round": 0}, w), fm.TRAIN, 100, "t")
    (rep,) = grid.send_and_receive([msg])
    assert rep.has_error() and "NaN/infinite" in rep.error.reason
    from feta_release.ledger import Ledger

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
    """Without the secret the commitment cannot be recomputed for a candidate dataset (it differs under any
    other key), with it any change of one pixel or label is detected."""
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
    np.savez(
        tmp_path / "d.npz", images=rng.random((1234, 1, 4, 4)).astype(np.float32), labels=np.arange(1234) % 3
    )
    res = CliRunner().invoke(
        cli, ["policy", "data-commitment", str(tmp_path / "d.npz"), "--secret", str(tmp_path / "data.secret")]
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "data.secret").stat().st_mode & 0o077 == 0
    assert "size = 1200" in res.output and 'commitment = "' in res.output


# -- the exact count N never leaves the site ---------------------------------------------------------------
# Neighbouring relation: add/remove ONE image of one site. Every rate and denominator that leaves a site comes
# from the PUBLIC nominal size of its signed policy, so a release is a function of (public values, noisy
# sums).


@pytest.fixture()
def fed_nominal(tmp_path):
    """Sites of 40 images whose signed policies declare the public nominal sizes 50, 60, 70."""
    from tests.support.federation import tiny_sites

    return make_federation_sizes(tmp_path / "fedn", tiny_sites(), {"site-a": 50, "site-b": 60, "site-c": 70})


def make_federation_sizes(root, datasets, sizes):
    from coordinator.setup import prepare_federation

    return prepare_federation(root, datasets, public_sizes=sizes)


def test_no_reply_reveals_the_exact_count(fed_nominal):
    """Attack (exact N published): `hello` said `dataset_size` = N, every event carried q = batch / N, the
    frequency release carried `n_public` = N and DP-SGD replies `num_examples` = N. Now each is the policy's
    nominal size."""
    cfg = full_job()
    signed, _ = sign_job_file(fed_nominal, cfg, "job-n")
    grid = harness(fed_nominal)
    n_true, n_pub = 40, 50  # site-a (node 100)
    hello, _ = _ask(grid, signed, fm.HELLO)
    assert hello["site_id"] == "site-a" and hello["dataset_size"] == n_pub
    assert hello["policy"]["policy"]["dataset"]["size"] == n_pub
    central, _ = _ask(grid, signed, fm.CENTRAL)
    assert central["events"][0]["q"] == pytest.approx(cfg.central.batch / n_pub)
    _freq, arrays = _ask(grid, signed, fm.FREQUENCY)
    assert int(arrays["n_public"]) == n_pub
    train, _ = _ask(grid, signed, fm.TRAIN, {"round": 0}, _weights(cfg))
    assert train["num_examples"] == n_pub and train["q"] == pytest.approx(cfg.dpsgd.batch / n_pub)
    assert (
        train["events"][0]["q"] * n_true != cfg.dpsgd.batch
        and central["events"][0]["q"] * n_true != cfg.central.batch
    )


@given(
    n=st.integers(5, 60), n_public=st.integers(5, 200), sigma=st.floats(0.5, 4.0), clip=st.floats(0.1, 2.0)
)
@settings(max_examples=25, deadline=None)
def test_dpsgd_divisor_and_noise_depend_on_the_public_size_only(n, n_public, sigma, clip):
    """The old trainer divided the noisy sum by q * (exact N): with zero gradients the released update is pure
    noise of std sigma C / (q N), which reveals N. Now the std is sigma C / (q n_public) for every true N."""
    import torch
    from torch import nn

    from feta_release.config import JobConfig
    from feta_release.training.dpsgd import DPSGDTrainer

    q = min(1.0, 4 / n_public)
    cfg = JobConfig().replace(
        dpsgd={"batch": 4, "steps": 1, "physical_batch": 8, "noise_multiplicity": 1, "clip": clip}
    )
    model = nn.Linear(60, 100)  # 6,100 parameters, zero gradient
    tr = DPSGDTrainer(
        model, cfg, sigma, q, torch.Generator().manual_seed(n), loss=_ZeroGrad(), n_public=n_public
    )
    noisy, stats = tr.noisy_gradient(torch.randn(n, 60), torch.zeros(n, dtype=torch.long))
    values = torch.cat([v.flatten() for v in noisy.values()])
    assert stats.expected_batch == pytest.approx(q * n_public)
    # 6,100 draws: relative s.e. of the sample std ~ 0.9 %; 6 % is > 6 s.e.
    assert float(values.std()) == pytest.approx(sigma * clip / (q * n_public), rel=0.06)


class _ZeroGrad:
    def draw(self, n, generator):
        import torch

        return {"z": torch.zeros(n, 1)}

    def __call__(self, model, x, y, rand):
        return (model(x.unsqueeze(0)) * 0.0).sum() + rand["z"].sum()


def _digits(n, seed):
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, n)


@given(
    n=st.integers(2, 30),
    n_public=st.integers(1, 500),
    seed=st.integers(0, 10_000),
    kind=st.sampled_from(["mean", "mode"]),
    clip=st.floats(0.05, 3.0),
)
@settings(max_examples=40, deadline=None)
def test_central_images_sensitivity_under_add_remove_with_public_denominator(n, n_public, seed, kind, clip):
    """Central images: adding one image changes the pre-noise query by at most C (mean) or sqrt(#pixels)
    (mode), whatever the true count; the released rate and denominator are functions of public values only."""
    from feta_release.mechanisms.central import central_images, central_query

    images, labels = _digits(n + 1, seed)
    batch = max(1, min(n_public, 3))
    s_small, sens = central_query(images[:n], labels[:n], 3, kind=kind, clip=clip)
    s_big, sens2 = central_query(images, labels, 3, kind=kind, clip=clip)
    assert sens == sens2
    assert float(np.linalg.norm((s_big - s_small).ravel())) <= sens * (1 + 1e-6)
    rel, ev = central_images(
        images[:n],
        labels[:n],
        3,
        kind=kind,
        rounds=1,
        batch=batch,
        sigma=1.0,
        clip=clip,
        n_public=n_public,
        rng=np.random.default_rng(seed),
    )
    assert ev.q == batch / n_public
    assert rel.denominator == (batch / 3 if kind == "mean" else 1.0)


def test_central_mean_noise_is_sigma_c_over_the_public_denominator():
    """Released mean image = (S + N(0, (σC)²)) / B_c with B_c = batch / classes public; for an empty class the
    value is pure noise of std σC / B_c for any true count."""
    from feta_release.mechanisms.central import central_images

    for n in (20, 200):
        images, labels = _digits(n, 1)
        labels[:] = 0  # classes 1 and 2 are empty: their rows are pure noise
        rel, _ = central_images(
            images,
            labels,
            3,
            kind="mean",
            rounds=40,
            batch=30,
            sigma=2.0,
            clip=0.5,
            n_public=300,
            rng=np.random.default_rng(7),
        )
        noise = rel.values[rel.labels != 0].ravel()  # 2 classes x 40 rounds x 9 pixels = 720 draws
        assert float(noise.std()) == pytest.approx(2.0 * 0.5 / 10.0, rel=0.12)


@given(n=st.integers(1, 20), n_public=st.integers(1, 1000), seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_frequency_sensitivity_is_one_over_the_public_size(n, n_public, seed):
    """RFF frequency release: adding one image changes E = sum phi(x) e_y^T / n_public by exactly 1 / n_public
    in Frobenius norm (||phi|| = 1), whatever the true count; the noise is N(0, (σ / n_public)²) and the
    release carries n_public, never n."""
    import torch

    from feta_release.mechanisms.frequency import embedding_sum, frequency_statistics, rff_frequencies

    images, labels = _digits(n + 1, seed)
    omega = rff_frequencies(36, 64, 10.0, 3)
    diff = (
        embedding_sum(images, labels, 3, omega) - embedding_sum(images[:n], labels[:n], 3, omega)
    ) / n_public
    assert float(np.linalg.norm(diff)) == pytest.approx(1.0 / n_public, rel=1e-4)
    rel, ev = frequency_statistics(
        images[:n],
        labels[:n],
        3,
        features=64,
        sigma=1.0,
        bandwidth2=10.0,
        seed=3,
        n_public=n_public,
        rng=np.random.default_rng(seed),
    )
    assert rel.n_public == n_public and ev.q == 1.0
    del torch


def test_frequency_noise_std_is_sigma_over_the_public_size():
    from feta_release.mechanisms.frequency import embedding_sum, frequency_statistics, rff_frequencies

    images, labels = _digits(30, 2)
    omega = rff_frequencies(36, 2000, 10.0, 3)
    clean = embedding_sum(images, labels, 3, omega) / 500
    rel, _ = frequency_statistics(
        images,
        labels,
        3,
        features=2000,
        sigma=3.0,
        bandwidth2=10.0,
        seed=3,
        n_public=500,
        rng=np.random.default_rng(0),
    )
    noise = rel.embedding.astype(np.float64) - clean  # 6,000 draws
    assert float(noise.std()) == pytest.approx(3.0 / 500, rel=0.05)


def test_local_train_writes_only_the_public_size(tmp_path, monkeypatch):
    """Attack (exact N published), single site: `feta-release train` wrote N into run.json and q = batch / N
    into privacy.json (which `export` turned into the release's statement), and made N synthetic images by
    default. Its site's noise is the node's: fresh OS keys of >= 128 bits per release, never stored."""
    import json

    import feta_release.randomness as rnd
    from feta_release.config import load_preset
    from feta_release.data import load_embedded
    from tests.support.training import train_run

    full = load_embedded()
    rng = np.random.default_rng(3)
    idx = np.concatenate([rng.choice(np.flatnonzero(full.labels == c), 13, replace=False) for c in range(10)])
    # 123 images: the public size is a noisy count's rounding, never 123
    data = full.subset(np.sort(idx[:-7]))
    # batches of 8 < the smallest size a draw gives (10): the run never depends on where the draw falls
    cfg = load_preset("tiny").replace(
        warmup={"spatial_iterations": 1, "frequency_epochs": 0},
        central={"batch": 8},
        dpsgd={"steps": 1, "batch": 8, "physical_batch": 8},
    )
    out = tmp_path / "run"
    keys: list[bytes] = []
    real = rnd.os_key
    monkeypatch.setattr(rnd, "os_key", lambda: keys.append(real()) or keys[-1])
    train_run(cfg, data, out, n_synthetic=None)
    # the noise of the size, central, frequency and DP-SGD releases: a fresh >= 128-bit OS key each, kept in
    # no file of the run
    assert len(keys) >= 4 and min(len(k) for k in keys) * 8 >= 128 and len(set(keys)) == len(keys)
    stored = [p.read_bytes() for p in out.rglob("*") if p.is_file()]
    assert not any(k.hex().encode() in b or k in b for k in keys for b in stored)
    plan = json.loads((out / "plan.json").read_text())["site"]
    report = json.loads((out / "privacy_report.json").read_text())["sites"]["site"]
    # drawn from a noisy count charged first (review: the exact count's rounding was not DP)
    n = plan["size"]
    assert n == json.loads((out / "policy.signed.json").read_text())["policy"]["dataset"]["size"]
    assert n != data.n and n % 10 == 0
    assert report["events"][0]["stage"] == "size"
    qs = {e["stage"]: e["q"] for e in report["events"]}
    assert qs["central"] == pytest.approx(8 / n) and qs["dpsgd"] == pytest.approx(8 / n)
    assert len(np.load(out / "synthetic.npz")["labels"]) == n
    assert int(np.load(out / "state" / "frequency_site.npz")["n_public"]) == n


def test_node_noise_generators_draw_at_least_128_bits_from_the_os(monkeypatch):
    """Attack (seed search): the node seeded its DP-SGD noise with `manual_seed(secrets.randbits(63))`; 2^63
    seeds can be searched (with the public weights in hand, a seed that reproduces the noise removes it)."""
    import random

    from edge.protocol import ReleaseRng

    asked = []
    real = random._urandom
    monkeypatch.setattr(random, "_urandom", lambda n: asked.append(n) or real(n))
    ReleaseRng().torch()
    assert sum(asked) >= 16, asked
    asked.clear()
    ReleaseRng().numpy()
    assert sum(asked) >= 16, asked


def test_torch_generator_uses_the_whole_key():
    """Keys that agree on their first 64 bits still give different streams (no truncation to manual_seed's 64
    bits), equal keys give equal streams (a run can resume), and two OS generators differ."""
    import torch

    from feta_release.randomness import os_torch_generator, torch_generator_from

    a, b = bytes(32), bytes(31) + b"\x01"
    draw = lambda g: torch.rand(8, generator=g)  # noqa: E731
    assert not torch.equal(draw(torch_generator_from(a)), draw(torch_generator_from(b)))
    assert torch.equal(draw(torch_generator_from(b)), draw(torch_generator_from(b)))
    assert not torch.equal(draw(os_torch_generator()), draw(os_torch_generator()))
    with pytest.raises(ValueError, match="128 bits"):
        torch_generator_from(bytes(8))
