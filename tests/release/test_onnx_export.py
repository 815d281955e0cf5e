"""The one-file ONNX generator reproduces the PyTorch sampler (feta_release.models.sampler.sample).

Bound: max |diff| < 1e-4 on [0,1] images. Why that is the right size: both sides compute the same float32
operations in the same order (schedule cast from float64, same Euler/Heun formulas); the only difference is
the kernels (onnxruntime's vs PyTorch's convolution / GroupNorm reductions), ~1e-7 relative per call. The
deterministic ODE solve is contractive towards the data near sigma -> 0, so those do not blow up over 18 Heun
steps (measured: ~3e-7 without guidance, ~6e-6 with w = 1.5 which scales the difference by 1 + 2w).
A wrong schedule, a missing Heun correction or an off-by-one step gives differences of order 1e-2..1e-1.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from feta_release.models.sampler import karras_sigmas, sample  # noqa: E402
from feta_release.release.onnx_export import (  # noqa: E402
    SamplerSettings,
    build_generator,
    export_denoiser,
    karras_schedule,
)
from tests.support.release import CLASSES, IMAGE_SHAPE  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # fixtures: tests/conftest.py

BOUND = 1e-4


def _session(model: onnx.ModelProto):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1  # tiny model: threads only add contention on the shared CI cores
    return ort.InferenceSession(
        model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"]
    )


def test_schedule_matches_torch_sampler():
    for steps in (1, 2, 18, 50):
        s = SamplerSettings(steps=steps)
        ours = karras_schedule(s).astype(np.float32)
        assert np.array_equal(ours, karras_sigmas(steps).numpy())


def test_denoiser_export_matches_torch(den, den_onnx):
    sess = _session(den_onnx)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, *IMAGE_SHAPE)).astype(np.float32)
    sigma = np.array([0.002, 0.1, 1.0, 10.0, 80.0], dtype=np.float32)
    labels = np.array([0, 1, 2, 3, 1], dtype=np.int64)  # 3 = the null label
    got = sess.run(None, {"x": x, "sigma": sigma, "labels": labels})[0]
    with torch.no_grad():
        ref = den(torch.from_numpy(x), torch.from_numpy(sigma), torch.from_numpy(labels)).numpy()
    assert np.abs(got - ref).max() < 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize(
    "solver,steps,guidance",
    [("heun", 18, 0.0), ("euler", 12, 0.0), ("heun", 5, 1.5), ("heun", 1, 0.0)],
)
def test_generator_matches_torch_sampler(den, den_onnx, solver, steps, guidance):
    settings = SamplerSettings(solver=solver, steps=steps, guidance=guidance)
    sess = _session(build_generator(den_onnx, settings, CLASSES, IMAGE_SHAPE))
    for batch in (1, 7):  # dynamic batch dimension
        rng = np.random.default_rng(batch)
        noise = rng.standard_normal((batch, *IMAGE_SHAPE)).astype(np.float32)
        labels = (np.arange(batch) % len(CLASSES)).astype(np.int64)
        got = sess.run(["images"], {"noise": noise, "labels": labels})[0]
        ref = sample(
            den,
            torch.from_numpy(labels),
            torch.from_numpy(noise),
            solver=solver,
            steps=steps,
            guidance=guidance,
        ).numpy()
        assert got.shape == (batch, *IMAGE_SHAPE)
        assert got.min() >= 0.0 and got.max() <= 1.0
        assert np.abs(got - ref).max() < BOUND
        # The comparison has power: the images are not constant and depend on the labels.
        assert ref.std() > 0.05


def test_wrong_step_count_is_detected(den, den_onnx):
    """The numerical check would catch an off-by-one schedule (guards the bound above against vacuity)."""
    sess = _session(build_generator(den_onnx, SamplerSettings(steps=17), CLASSES, IMAGE_SHAPE))
    noise = np.random.default_rng(0).standard_normal((4, *IMAGE_SHAPE)).astype(np.float32)
    labels = np.array([0, 1, 2, 0], dtype=np.int64)
    got = sess.run(["images"], {"noise": noise, "labels": labels})[0]
    ref = sample(den, torch.from_numpy(labels), torch.from_numpy(noise), steps=18).numpy()
    assert np.abs(got - ref).max() > 10 * BOUND


def test_generator_is_one_loop_and_denoiser_sized(den_onnx):
    gen = build_generator(
        den_onnx, SamplerSettings(steps=18), CLASSES, IMAGE_SHAPE, statement_sha256="ab" * 32
    )
    ops = [n.op_type for n in gen.graph.node]
    assert ops.count("Loop") == 1
    loop = next(n for n in gen.graph.node if n.op_type == "Loop")
    trips = next(t for t in gen.graph.initializer if t.name == "trip_count")
    assert int(onnx.numpy_helper.to_array(trips)) == 17  # N-1 Heun steps, then the final Euler step
    body = loop.attribute[0].g
    assert sum(1 for n in body.node if n.op_type == "Conv") == 2 * sum(
        1 for n in den_onnx.graph.node if n.op_type == "Conv"
    )
    # Weights are stored once (shared by every call of the denoiser), so the file is about the denoiser's
    # size.
    w_den = sum(t.ByteSize() for t in den_onnx.graph.initializer)
    w_gen = sum(t.ByteSize() for t in gen.graph.initializer)
    assert w_gen < w_den + 1024
    assert [i.name for i in gen.graph.input] == ["noise", "labels"]
    assert [o.name for o in gen.graph.output] == ["images"]


def test_metadata_present(den_onnx, tmp_path):
    settings = SamplerSettings(solver="euler", steps=9, guidance=0.5)
    gen = build_generator(den_onnx, settings, CLASSES, IMAGE_SHAPE, statement_sha256="cd" * 32)
    path = tmp_path / "g.onnx"
    path.write_bytes(gen.SerializeToString())
    meta = _session(onnx.load(str(path))).get_modelmeta().custom_metadata_map
    assert json.loads(meta["feta.classes"]) == CLASSES
    assert json.loads(meta["feta.image_shape"]) == list(IMAGE_SHAPE)
    assert json.loads(meta["feta.sampler"]) == settings.to_dict()
    assert meta["feta.statement_sha256"] == "cd" * 32
    assert meta["feta.format"].startswith("feta-release-generator/")


def test_invalid_sampler_settings_refused():
    from feta_release.errors import ReleaseError

    with pytest.raises(ReleaseError, match="solver"):
        SamplerSettings(solver="dpm")
    with pytest.raises(ReleaseError, match="steps"):
        SamplerSettings(steps=0)


# -- SDEdit from released central images (format 2: inputs start, from_release)
# ----------------------------------


def _sdedit_feed(batch: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "noise": rng.standard_normal((batch, *IMAGE_SHAPE)).astype(np.float32),
        "labels": (np.arange(batch) % len(CLASSES)).astype(np.int64),
        "start": rng.random((batch, *IMAGE_SHAPE)).astype(np.float32),
    }


@pytest.mark.parametrize(
    "solver,steps,guidance,start_sigma",
    [("heun", 8, 0.0, 0.5), ("euler", 6, 0.0, 1.0), ("heun", 4, 1.0, 2.0)],
)
def test_sdedit_generator_matches_torch_sdedit_on_the_same_starts_and_noise(
    den, den_onnx, solver, steps, guidance, start_sigma
):
    settings = SamplerSettings(solver=solver, steps=steps, guidance=guidance, start_sigma=start_sigma)
    sess = _session(build_generator(den_onnx, settings, CLASSES, IMAGE_SHAPE))
    for batch in (1, 6):
        feed = _sdedit_feed(batch, batch)
        got = sess.run(["images"], {**feed, "from_release": np.array(True)})[0]
        lab, noise = torch.from_numpy(feed["labels"]), torch.from_numpy(feed["noise"])
        ref = sample(
            den,
            lab,
            noise,
            solver=solver,
            steps=steps,
            guidance=guidance,
            sigma_max=start_sigma,
            init=torch.from_numpy(feed["start"]),
        ).numpy()
        assert np.abs(got - ref).max() < BOUND
        # ... and with from_release off, the same graph is the noise sampler (start ignored)
        off = sess.run(["images"], {**feed, "from_release": np.array(False)})[0]
        ref_noise = sample(den, lab, noise, solver=solver, steps=steps, guidance=guidance).numpy()
        assert np.abs(off - ref_noise).max() < BOUND
        assert np.abs(got - off).max() > 100 * BOUND  # the two paths differ: the comparison has power


def test_sdedit_start_is_not_ignored_and_a_wrong_start_level_is_detected(den, den_onnx):
    settings = SamplerSettings(steps=6, start_sigma=0.5)
    sess = _session(build_generator(den_onnx, settings, CLASSES, IMAGE_SHAPE))
    feed = _sdedit_feed(4, 0)
    got = sess.run(["images"], {**feed, "from_release": np.array(True)})[0]
    other = sess.run(
        ["images"], {**feed, "start": feed["start"][::-1].copy(), "from_release": np.array(True)}
    )[0]
    assert np.abs(got - other).max() > 100 * BOUND
    wrong = sample(
        den,
        torch.from_numpy(feed["labels"]),
        torch.from_numpy(feed["noise"]),
        steps=6,
        sigma_max=1.0,
        init=torch.from_numpy(feed["start"]),
    ).numpy()
    assert np.abs(got - wrong).max() > 10 * BOUND


def test_noise_only_generator_keeps_format_1_and_two_inputs(den_onnx):
    plain = build_generator(den_onnx, SamplerSettings(steps=8), CLASSES, IMAGE_SHAPE)
    meta = {p.key: p.value for p in plain.metadata_props}
    assert meta["feta.format"] == "feta-release-generator/1" and "start_sigma" not in meta["feta.sampler"]
    sd = build_generator(den_onnx, SamplerSettings(steps=8, start_sigma=0.5), CLASSES, IMAGE_SHAPE)
    meta = {p.key: p.value for p in sd.metadata_props}
    assert (
        meta["feta.format"] == "feta-release-generator/2"
        and json.loads(meta["feta.sampler"])["start_sigma"] == 0.5
    )
    assert [i.name for i in sd.graph.input] == ["noise", "labels", "start", "from_release"]
    with pytest.raises(Exception, match="start_sigma"):
        SamplerSettings(steps=8, start_sigma=100.0)


class _WarnsWhileTraced(torch.nn.Module):
    """The denoiser, plus a deprecation and a user warning of its own each time it is traced."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, sigma, labels):
        warnings.warn("model code calls a deprecated API", DeprecationWarning, stacklevel=1)
        warnings.warn("model code has something to say", UserWarning, stacklevel=1)
        return self.inner(x, sigma, labels)


def test_export_hides_only_the_exporters_own_notices(den):
    """The TorchScript exporter's per-export notices are expected (module docstring); every other warning
    raised while exporting - a deprecated API our model calls, anything torch has to say about it - must still
    reach the user and the test log."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        export_denoiser(_WarnsWhileTraced(den), IMAGE_SHAPE)
    assert {(w.category, str(w.message)) for w in seen} == {
        (DeprecationWarning, "model code calls a deprecated API"),
        (UserWarning, "model code has something to say"),
    }
