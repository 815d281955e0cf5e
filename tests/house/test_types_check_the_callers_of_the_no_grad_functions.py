"""The sampler's ``sample`` and the evaluation's ``predict`` and ``extract_features`` ran under torch's
``@torch.no_grad()`` decorator. mypy skips torch, so each decorated function was ``Any`` to its callers and
no argument passed to it was checked: a step count given as text, a dataset where an array belongs, a
fractional batch all passed mypy and showed only when the call ran. They run their no-grad (or inference)
blocks inside now, and mypy checks every caller. (The EMA's methods, undecorated too, take a torch module,
which mypy sees as ``Any``: no wrong call of theirs can be caught this way.)"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.mypy_run import ROOT, mypy_report

# torch's grad-mode context managers used as decorators: the function they wrap is Any to mypy
GRAD_MODE_DECORATOR = re.compile(r"^\s*@torch\.(no_grad|inference_mode|enable_grad|set_grad_enabled)\b", re.M)

WRONG = """
from feta_release.data import ImageDataset
from feta_release.evaluation import extract_features, predict
from feta_release.models.sampler import sample


def calls(denoiser, labels, noise, net, ds: ImageDataset) -> None:  # type: ignore[no-untyped-def]
    sample(denoiser, labels, noise, steps="18")
    predict(net, ds)
    extract_features(net, ds.images, batch_size=0.5)
"""

RIGHT = """
from feta_release.data import ImageDataset
from feta_release.evaluation import extract_features, predict
from feta_release.models.sampler import sample


def calls(denoiser, labels, noise, net, ds: ImageDataset) -> None:  # type: ignore[no-untyped-def]
    sample(denoiser, labels, noise, steps=18)
    predict(net, ds.images)
    extract_features(net, ds.images, batch_size=500)
"""


def test_mypy_checks_the_arguments_given_to_the_formerly_decorated_functions(tmp_path: Path) -> None:
    out = mypy_report(tmp_path, "wrong", WRONG)
    for wrong in (
        'Argument "steps" to "sample" has incompatible type "str"',
        'Argument 2 to "predict" has incompatible type "ImageDataset"',
        'Argument "batch_size" to "extract_features" has incompatible type "float"',
    ):
        assert wrong in out, out
    right = mypy_report(tmp_path, "right", RIGHT)
    assert right.strip().startswith("Success"), right


def test_no_function_of_the_tree_takes_a_grad_mode_decorator() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        for package in ("feta_release", "edge", "coordinator")
        for path in sorted((ROOT / package).rglob("*.py"))
        for text in [path.read_text("utf-8")]
        for m in GRAD_MODE_DECORATOR.finditer(text)
    ]
    assert not found, f"use a `with torch.no_grad():` block inside instead (CONTRIBUTING.md): {found}"
