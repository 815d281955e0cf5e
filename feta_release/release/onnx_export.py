"""Export a trained EDM denoiser and its sampler as ONE self-contained ONNX generator.

Shape of the generator graph (assembled with the onnx helper API, not traced):

    noise (B,C,H,W) float32 ~ N(0, I),  labels (B,) int64
      x = noise * t_0
      Loop i = 0 .. M-1:             # the Karras schedule t_0 > ... > t_{N-1} > t_N = 0 is a constant initializer
          Euler or Heun step from t_i to t_{i+1} around the denoiser body
      [Heun] final Euler step t_{N-1} -> 0   # EDM's Heun takes no 2nd-order correction into t = 0
      images = clip((x + 1) / 2, 0, 1)

SDEdit (``SamplerSettings.start_sigma``, format ``feta-release-generator/2``): two more inputs, ``start``
(B,C,H,W) float32 in [0, 1] and ``from_release`` (bool scalar). With ``from_release`` the schedule is the
Karras schedule from ``start_sigma`` (same steps, sigma_min and rho) and ``x = 2 start - 1 + noise *
start_sigma``, exactly ``models.sampler.sample(init=start)`` with ``sigma_max = start_sigma``; without it the
graph is the noise sampler above (``start`` ignored). Both schedules are constants of the graph, so the signed
file fixes both samplers. A generator without ``start_sigma`` is the format-1 graph, byte for byte as before.

Why a Loop around the exported denoiser rather than tracing the whole sampler: tracing unrolls every step
(16,605 nodes, 71 s to open a session at 50 steps), the Loop graph is the denoiser's size (weights are
initializers of the outer graph, referenced from the loop body), builds in well under a second and opens
as fast as the bare denoiser, with the same numbers (shared/reference/onnx-and-eval-notes.md).

The denoiser body is exported with the TorchScript exporter (dynamo=False, opset 17), which torch deprecates,
on purpose: the torch.export-based exporter (dynamo=True, torch 2.13 + onnxscript 0.7.2) was measured on the
UNet at channels 8 and 32, each export in a fresh process as a release runs it: 7.0-8.5 s of CPU against
0.33-0.37 s with one torch thread (20x; 22-26 s against 1.0-1.1 s wall) and 1.8-2.1 s with torch's default
threads (4x), for a graph that gives the same images (max |diff| to the torch sampler 2.4e-7 with either, Heun
18 and Euler 12) at the same onnxruntime speed. It would also add onnxscript and onnx-ir to the hash-pinned
node install. Moving over when the TorchScript exporter goes: ``dynamo=True, opset_version=18`` with one
``torch.export.Dim`` for axis 0 of the three inputs in ``dynamic_shapes``; its optimizer leaves no local
functions and no nested subgraphs, so :class:`_Inliner` takes its graph as it is; the generator's opset
becomes 18, where the guidance ``Split`` needs ``num_outputs=2``. Only the notices the TorchScript exporter
itself prints are silenced (``_hide_exporter_notices``); any other warning raised while exporting still shows.

Metadata and the manifest (no circularity): the manifest records the generator file's sha256, so the
generator cannot hold the manifest's hash. The generator instead holds ``feta.statement_sha256``, the
hash of the *release statement* (job id + config + every site's privacy event history and (eps, delta)),
which is fixed before the generator is written. The manifest then hashes the finished generator file.
``verify`` recomputes the statement hash from the manifest and compares it with the generator's metadata,
so a generator cannot be moved under another job's privacy statement.
"""  # noqa: E501

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import ReleaseError
from .manifest import sampler_record

GENERATOR_FORMAT = "feta-release-generator/1"
GENERATOR_FORMAT_SDEDIT = "feta-release-generator/2"  # + inputs start, from_release
OPSET = 17
META_PREFIX = "feta."


START_SOURCES = ("central", "aux", "mix")


@dataclass(frozen=True)
class SamplerSettings:
    """What the generator graph computes; stored verbatim in metadata and the manifest."""

    solver: str = "heun"  # "euler" | "heun" (EDM's deterministic 2nd-order solver, no churn)
    steps: int = 18
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    rho: float = 7.0
    guidance: float = 0.0  # classifier-free guidance weight w: (1+w) D(x,y) - w D(x,null)
    # SDEdit from released central images (``[sampler] start_sigma``): None = the noise sampler only.
    start_sigma: float | None = None
    # Where ``synthesize`` takes the SDEdit starts from (``[sampler] start_source``): "central" the released
    # central images, "aux" the shipped aux-generator pool, "mix" every other image from each. The graph is
    # the same (the start is an input); only the metadata and manifest record it.
    start_source: str = "central"

    def __post_init__(self) -> None:
        if self.solver not in ("euler", "heun"):
            raise ReleaseError(f"sampler solver must be 'euler' or 'heun', got {self.solver!r}")
        if self.steps < 1:
            raise ReleaseError(f"sampler steps must be >= 1, got {self.steps}")
        if not 0 < self.sigma_min < self.sigma_max:
            raise ReleaseError(
                f"sampler needs 0 < sigma_min < sigma_max, got {self.sigma_min}, {self.sigma_max}"
            )
        if self.guidance < 0:
            raise ReleaseError(f"guidance weight must be >= 0, got {self.guidance}")
        if self.start_sigma is not None and not self.sigma_min < self.start_sigma <= self.sigma_max:
            raise ReleaseError(
                f"sampler start_sigma must be in (sigma_min, sigma_max], got {self.start_sigma}"
            )
        if self.start_source not in START_SOURCES:
            raise ReleaseError(
                f"sampler start_source must be one of {', '.join(START_SOURCES)}, got {self.start_source!r}"
            )
        if self.start_source != "central" and self.start_sigma is None:
            raise ReleaseError(f"sampler start_source {self.start_source!r} needs start_sigma (SDEdit)")

    def to_dict(self) -> dict[str, Any]:
        """As the metadata and manifest record it (``manifest.sampler_record``: a noise-only or central-start
        release's sampler reads as before start_sigma / start_source existed)."""
        return sampler_record(asdict(self))

    @property
    def sdedit(self) -> bool:
        return self.start_sigma is not None

    @classmethod
    def from_config(cls, sampler_section: Any) -> SamplerSettings:
        return cls(
            solver=sampler_section.solver,
            steps=int(sampler_section.steps),
            sigma_min=float(sampler_section.sigma_min),
            sigma_max=float(sampler_section.sigma_max),
            rho=float(sampler_section.rho),
            guidance=float(sampler_section.guidance),
            start_sigma=None
            if getattr(sampler_section, "start_sigma", None) is None
            else float(sampler_section.start_sigma),
            start_source=str(getattr(sampler_section, "start_source", "central")),
        )


def karras_schedule(s: SamplerSettings, sigma_max: float | None = None) -> np.ndarray:
    """t_0 .. t_{N-1} (Karras et al. 2022, eq. 5) with t_N = 0 appended; float64. ``sigma_max``: start there
    instead (SDEdit's schedule from ``start_sigma``)."""
    n = s.steps
    top = s.sigma_max if sigma_max is None else float(sigma_max)
    i = np.arange(n, dtype=np.float64)
    if n == 1:
        t = np.array([top], dtype=np.float64)
    else:
        a, b = top ** (1 / s.rho), s.sigma_min ** (1 / s.rho)
        t = (a + i / (n - 1) * (b - a)) ** s.rho
    return np.concatenate([t, [0.0]])


# -- denoiser export --------------------------------------------------------------------------------


def _hide_exporter_notices(tracer_warning: type[Warning]) -> None:
    """Inside ``warnings.catch_warnings()``: ignore what the TorchScript exporter prints on every export, each
    by its exact message (and the module raising it where the message is generic), so that any other warning,
    ours or torch's, still shows."""
    # The exporter's deprecation: the choice is deliberate and measured (module docstring).
    warnings.filterwarnings(
        "ignore", r"You are using the legacy TorchScript-based ONNX export\.", DeprecationWarning
    )
    # The same deprecation from inside the legacy exporter (its logging setup, deprecated with it).
    warnings.filterwarnings(
        "ignore",
        r"The feature will be removed\. Please remove usage of this function",
        DeprecationWarning,
        r"torch\.onnx\._internal\.torchscript_exporter\.",
    )
    # GroupNorm's eager input check (F._verify_batch_size: more than one value per group) reads a traced size
    # as a bool. It only guards training on a single value and has no data flow into the graph, so the trace
    # loses nothing; a tensor-to-bool conversion in our own model code is raised from our module and still
    # shows.
    warnings.filterwarnings(
        "ignore",
        r"Converting a tensor to a Python boolean might cause the trace to be incorrect",
        tracer_warning,
        r"torch\.nn\.functional",
    )


def export_denoiser(denoiser: Any, image_shape: Sequence[int], *, opset: int = OPSET) -> onnx.ModelProto:
    """Trace ``denoiser(x, sigma, labels)`` to ONNX with a dynamic batch dimension.

    ``denoiser`` is an ``EDMDenoiser`` (or any module with that call signature); it is traced in eval mode.
    """
    import torch  # only the export path needs torch; synthesis never imports this module

    c, h, w = (int(v) for v in image_shape)
    was_training = denoiser.training
    denoiser.eval()
    try:
        x = torch.zeros(2, c, h, w)
        sigma = torch.tensor([1.0, 2.0])
        labels = torch.zeros(2, dtype=torch.int64)
        buf = io.BytesIO()
        batch = {0: "batch"}
        with warnings.catch_warnings():
            _hide_exporter_notices(torch.jit.TracerWarning)
            torch.onnx.export(
                denoiser,
                (x, sigma, labels),
                buf,
                dynamo=False,
                opset_version=opset,
                input_names=["x", "sigma", "labels"],
                output_names=["denoised"],
                dynamic_axes={"x": batch, "sigma": batch, "labels": batch, "denoised": batch},
                do_constant_folding=True,
            )
    finally:
        denoiser.train(was_training)
    return onnx.load_from_string(buf.getvalue())


# -- generator assembly -----------------------------------------------------------------------------


class _Inliner:
    """Copies the denoiser graph's nodes under a fresh prefix each time the sampler calls it.

    Weights are shared: every copy reads the same outer-graph initializers (renamed ``w/...``), so a
    Heun loop body with two denoiser calls costs nodes, not bytes.
    """

    def __init__(self, den: onnx.ModelProto):
        g = den.graph
        self.graph = g
        for node in g.node:
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
                raise ReleaseError(
                    f"denoiser graph has a nested subgraph in node {node.name!r}; cannot inline it"
                )
        self.inputs = [i.name for i in g.input if i.name not in {t.name for t in g.initializer}]
        if len(self.inputs) != 3 or len(g.output) != 1:
            raise ReleaseError(
                f"denoiser graph must have inputs (x, sigma, labels) and one output; got {self.inputs} -> "
                f"{[o.name for o in g.output]}"
            )
        self.output = g.output[0].name
        self.weights: dict[str, str] = {t.name: f"w/{t.name}" for t in g.initializer}
        self.calls = 0

    def initializers(self) -> list[TensorProto]:
        out = []
        for t in self.graph.initializer:
            t2 = TensorProto()
            t2.CopyFrom(t)
            t2.name = self.weights[t.name]
            out.append(t2)
        return out

    def call(self, x: str, sigma: str, labels: str, out: str) -> list[onnx.NodeProto]:
        prefix = f"d{self.calls}/"
        self.calls += 1
        mapping = dict(zip(self.inputs, (x, sigma, labels)))
        mapping[self.output] = out
        mapping.update(self.weights)

        def rn(name: str) -> str:
            if not name:
                return name  # an omitted optional input stays omitted
            return mapping.get(name, prefix + name)

        nodes = []
        for k, node in enumerate(self.graph.node):
            n = onnx.NodeProto()
            n.CopyFrom(node)
            # Index keeps names unique even where the source graph repeats or omits them (quantized graphs
            # do).
            n.name = f"{prefix}{k}/{node.name or node.op_type}"
            del n.input[:]
            n.input.extend(rn(v) for v in node.input)
            del n.output[:]
            n.output.extend(rn(v) for v in node.output)
            nodes.append(n)
        return nodes


def _const(name: str, value: Any, dtype: Any = np.float32) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype=dtype), name)
    )


class _Builder:
    def __init__(self, inliner: _Inliner, settings: SamplerSettings, null_label: int):
        self.inl = inliner
        self.s = settings
        self.null_label = null_label
        self.uid = 0

    def fresh(self, stem: str) -> str:
        self.uid += 1
        return f"{stem}_{self.uid}"

    def denoise(self, x: str, t_scalar: str, nodes: list[onnx.NodeProto]) -> str:
        """D(x; t, y) with optional classifier-free guidance; ``t_scalar`` is a 0-d float tensor."""
        s = self.fresh
        batch = s("batch")
        nodes.append(helper.make_node("Shape", [x], [batch], start=0, end=1))
        if self.s.guidance == 0.0:
            sig = s("sigma_b")
            nodes.append(helper.make_node("Expand", [t_scalar, batch], [sig]))
            out = s("D")
            nodes.extend(self.inl.call(x, sig, "labels", out))
            return out
        # Guidance: one denoiser call on the doubled batch [conditional; null label].
        xx, sig, b2, both = s("xx"), s("sigma_2b"), s("batch2"), s("D2")
        nodes.append(helper.make_node("Concat", [x, x], [xx], axis=0))
        nodes.append(helper.make_node("Mul", [batch, "two_i64"], [b2]))
        nodes.append(helper.make_node("Expand", [t_scalar, b2], [sig]))
        nodes.extend(self.inl.call(xx, sig, "labels_cfg", both))
        dc, du = s("Dc"), s("Du")
        nodes.append(helper.make_node("Split", [both], [dc, du], axis=0))  # opset 17: equal halves
        a, b, out = s("Dc_w"), s("Du_w"), s("D")
        nodes.append(helper.make_node("Mul", [dc, "one_plus_w"], [a]))
        nodes.append(helper.make_node("Mul", [du, "w"], [b]))
        nodes.append(helper.make_node("Sub", [a, b], [out]))
        return out

    def slope(self, x: str, den: str, t_scalar: str, nodes: list[onnx.NodeProto]) -> str:
        """d = (x - D) / t: the probability-flow ODE's derivative dx/dt."""
        diff, d = self.fresh("x_minus_D"), self.fresh("slope")
        nodes.append(helper.make_node("Sub", [x, den], [diff]))
        nodes.append(helper.make_node("Div", [diff, t_scalar], [d]))
        return d

    def euler(self, x: str, t_cur: str, t_next: str, nodes: list[onnx.NodeProto]) -> tuple[str, str, str]:
        """x + (t_next - t_cur) d; returns (x_next, d, h)."""
        den = self.denoise(x, t_cur, nodes)
        d = self.slope(x, den, t_cur, nodes)
        h, hd, x_next = self.fresh("h"), self.fresh("h_d"), self.fresh("x_euler")
        nodes.append(helper.make_node("Sub", [t_next, t_cur], [h]))
        nodes.append(helper.make_node("Mul", [d, h], [hd]))
        nodes.append(helper.make_node("Add", [x, hd], [x_next]))
        return x_next, d, h

    def heun(self, x: str, t_cur: str, t_next: str, nodes: list[onnx.NodeProto]) -> str:
        x_e, d, h = self.euler(x, t_cur, t_next, nodes)
        den2 = self.denoise(x_e, t_next, nodes)
        d2 = self.slope(x_e, den2, t_next, nodes)
        s = self.fresh
        avg, half, step, x_next = s("d_sum"), s("d_avg"), s("h_davg"), s("x_heun")
        nodes.append(helper.make_node("Add", [d, d2], [avg]))
        nodes.append(helper.make_node("Mul", [avg, "half"], [half]))
        nodes.append(helper.make_node("Mul", [half, h], [step]))
        nodes.append(helper.make_node("Add", [x, step], [x_next]))
        return x_next


def _prologue(settings: SamplerSettings, n_classes: int) -> list[onnx.NodeProto]:
    """Constants, the classifier-free-guidance labels (when guided) and x_init = noise * sigma_0."""
    nodes: list[onnx.NodeProto] = [
        _const("half", 0.5),
        _const("one", 1.0),
        _const("zero", 0.0),
        _const("one_i64", 1, np.int64),
        _const("cond_true", True, np.bool_),
        _const("idx0", 0, np.int64),
    ]
    if settings.guidance != 0.0:
        nodes += [
            _const("two_i64", [2], np.int64),
            _const("w", settings.guidance),
            _const("one_plus_w", 1.0 + settings.guidance),
        ]
        # labels_cfg = [labels; null label repeated]: built once, read by every loop iteration.
        nodes += [
            helper.make_node("Shape", ["labels"], ["label_batch"]),
            helper.make_node(
                "ConstantOfShape",
                ["label_batch"],
                ["null_labels"],
                value=numpy_helper.from_array(np.array([n_classes], dtype=np.int64)),
            ),
            helper.make_node("Concat", ["labels", "null_labels"], ["labels_cfg"], axis=0),
        ]
    if settings.start_sigma is not None:
        return nodes + _sdedit_prologue()
    return nodes + [
        helper.make_node("Gather", ["sigmas", "idx0"], ["t0"], axis=0),
        helper.make_node("Mul", ["noise", "t0"], ["x_init"]),
    ]


def _sdedit_prologue() -> list[onnx.NodeProto]:
    """``sigmas`` = the start schedule or the noise schedule; ``x_init = noise t_0 (+ 2 start - 1)``."""
    return [
        _const("two", 2.0),
        helper.make_node("Where", ["from_release", "sigmas_start", "sigmas_noise"], ["sigmas"]),
        helper.make_node("Gather", ["sigmas", "idx0"], ["t0"], axis=0),
        helper.make_node("Mul", ["noise", "t0"], ["noise_t0"]),
        helper.make_node("Mul", ["start", "two"], ["start_2"]),
        helper.make_node("Sub", ["start_2", "one"], ["start_model"]),  # [0, 1] -> the model's [-1, 1]
        helper.make_node("Where", ["from_release", "start_model", "zero"], ["offset"]),
        helper.make_node("Add", ["noise_t0", "offset"], ["x_init"]),
    ]


def _sampler_loop(b: _Builder, settings: SamplerSettings, img_type: onnx.TypeProto) -> onnx.NodeProto:
    """The ONNX Loop over sampler steps: body (i, cond, x) -> (cond, x_next); schedule, weights and labels
    come from the outer scope."""
    body_nodes: list[onnx.NodeProto] = [
        helper.make_node("Add", ["i", "one_i64"], ["i_next"]),
        helper.make_node("Gather", ["sigmas", "i"], ["t_cur"], axis=0),
        helper.make_node("Gather", ["sigmas", "i_next"], ["t_next"], axis=0),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
    ]
    if settings.solver == "euler":
        x_next, _, _ = b.euler("x_in", "t_cur", "t_next", body_nodes)
    else:
        x_next = b.heun("x_in", "t_cur", "t_next", body_nodes)
    body_nodes.append(helper.make_node("Identity", [x_next], ["x_out"]))
    body = helper.make_graph(
        body_nodes,
        "sampler_step",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_value_info("x_in", img_type),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_value_info("x_out", img_type),
        ],
    )
    return helper.make_node("Loop", ["trip_count", "cond_true", "x_init"], ["x_loop"], body=body)


def _last_euler_step(b: _Builder, n: int, nodes: list[onnx.NodeProto], init: list[onnx.TensorProto]) -> str:
    """Heun's final step to sigma = 0 is a plain Euler step (EDM): appended after the loop."""
    nodes += [
        helper.make_node("Gather", ["sigmas", "last_i"], ["t_last"], axis=0),
        helper.make_node("Gather", ["sigmas", "end_i"], ["t_end"], axis=0),
    ]
    init.append(numpy_helper.from_array(np.array(n - 1, dtype=np.int64), "last_i"))
    init.append(numpy_helper.from_array(np.array(n, dtype=np.int64), "end_i"))
    x_final, _, _ = b.euler("x_loop", "t_last", "t_end", nodes)
    return x_final


def build_generator(
    denoiser: onnx.ModelProto,
    settings: SamplerSettings,
    classes: Sequence[str],
    image_shape: Sequence[int],
    *,
    statement_sha256: str = "",
    extra_metadata: dict[str, str] | None = None,
) -> onnx.ModelProto:
    """Assemble the one-file generator: ``(noise, labels) -> images`` in [0, 1].

    ``denoiser`` comes from :func:`export_denoiser`; its null (unconditional) label is ``len(classes)``.
    """
    c, h, w = (int(v) for v in image_shape)
    n_classes = len(classes)
    inl = _Inliner(denoiser)
    b = _Builder(inl, settings, null_label=n_classes)
    sched = karras_schedule(settings)  # length N + 1, ends with 0
    n = settings.steps
    loop_trips = n if settings.solver == "euler" else n - 1

    init = inl.initializers()
    sdedit = settings.start_sigma is not None
    init.append(numpy_helper.from_array(sched.astype(np.float32), "sigmas_noise" if sdedit else "sigmas"))
    if sdedit:
        start_sched = karras_schedule(settings, settings.start_sigma)
        init.append(numpy_helper.from_array(start_sched.astype(np.float32), "sigmas_start"))
    init.append(numpy_helper.from_array(np.array(loop_trips, dtype=np.int64), "trip_count"))
    nodes = _prologue(settings, n_classes)
    img_type = helper.make_tensor_type_proto(TensorProto.FLOAT, ["batch", c, h, w])
    nodes.append(_sampler_loop(b, settings, img_type))
    x_final = _last_euler_step(b, n, nodes, init) if settings.solver == "heun" else "x_loop"
    nodes += [
        helper.make_node("Add", [x_final, "one"], ["x_plus_1"]),
        helper.make_node("Mul", ["x_plus_1", "half"], ["x01"]),
        helper.make_node("Clip", ["x01", "zero", "one"], ["images"]),
    ]

    inputs = [
        helper.make_tensor_value_info("noise", TensorProto.FLOAT, ["batch", c, h, w]),
        helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"]),
    ]
    if sdedit:
        inputs += [
            helper.make_tensor_value_info("start", TensorProto.FLOAT, ["batch", c, h, w]),
            helper.make_tensor_value_info("from_release", TensorProto.BOOL, []),
        ]
    graph = helper.make_graph(
        nodes,
        "feta_generator",
        inputs,
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", c, h, w])],
        initializer=init,
    )
    opsets = [o for o in denoiser.opset_import if o.domain not in ("", "ai.onnx")]
    opsets.append(helper.make_opsetid("", max(OPSET, _default_opset(denoiser))))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="feta-release")
    model.ir_version = denoiser.ir_version
    meta = generator_metadata(classes, (c, h, w), settings, statement_sha256)
    meta.update(extra_metadata or {})
    helper.set_model_props(model, meta)
    onnx.checker.check_model(model)
    return model


def _default_opset(m: onnx.ModelProto) -> int:
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return OPSET


def generator_metadata(
    classes: Sequence[str], image_shape: Sequence[int], settings: SamplerSettings, statement_sha256: str
) -> dict[str, str]:
    inputs = "noise: float32 (batch, C, H, W) standard normal; labels: int64 (batch,) class index"
    if settings.start_sigma is not None:
        inputs += (
            "; start: float32 (batch, C, H, W) in [0, 1], an augmented released central image (ignored "
            "unless from_release); from_release: bool scalar, SDEdit from start at sigma start_sigma"
        )
    return {
        f"{META_PREFIX}format": GENERATOR_FORMAT if settings.start_sigma is None else GENERATOR_FORMAT_SDEDIT,
        f"{META_PREFIX}classes": json.dumps(list(classes), ensure_ascii=False),
        f"{META_PREFIX}image_shape": json.dumps([int(v) for v in image_shape]),
        f"{META_PREFIX}sampler": json.dumps(settings.to_dict(), sort_keys=True),
        f"{META_PREFIX}statement_sha256": statement_sha256,
        f"{META_PREFIX}inputs": inputs,
        f"{META_PREFIX}outputs": "images: float32 (batch, C, H, W) in [0, 1]",
    }


def read_metadata(model_path: str) -> dict[str, str]:
    """The ``feta.*`` metadata of a generator file, without loading its weights into a session."""
    m = onnx.load(model_path, load_external_data=False)
    return {p.key: p.value for p in m.metadata_props}


def export_generator(
    denoiser: Any,
    settings: SamplerSettings,
    classes: Sequence[str],
    image_shape: Sequence[int],
    *,
    statement_sha256: str = "",
) -> onnx.ModelProto:
    """Trace the torch denoiser and assemble the generator in one go."""
    den = export_denoiser(denoiser, image_shape)
    return build_generator(den, settings, classes, image_shape, statement_sha256=statement_sha256)
