"""The class list and the image shape are PUBLIC declarations of the signed site policy
(``dataset.classes``, ``dataset.image_shape``; feta_release/data/declared.py). The node maps its data onto
them: each image is conformed on its own (no vote over the images), labels are looked up by name (outside:
refused, a local error naming the file and the fix; a declared class without images is fine), and a policy
without them is refused with a line saying how to re-sign."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from feta_release.data import load_dataset, parse_arrays
from feta_release.data.declared import DataDeclaration, conform_image, convert_channels
from feta_release.errors import DataError, PolicyError

DECL = DataDeclaration(("benign", "malignant", "sarcoma"), (1, 8, 8))


def _csv(root: Path, rows: list[tuple[str, np.ndarray]]) -> Path:
    """A CSV site: one PNG per (label, uint8 pixels (H, W) grey or (H, W, 3) RGB)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = ["path,label"]
    for i, (lab, px) in enumerate(rows):
        Image.fromarray(px, mode="L" if px.ndim == 2 else "RGB").save(root / f"{i:03d}.png")
        lines.append(f"{i:03d}.png,{lab}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n", "utf-8")
    return root / "labels.csv"


# -- the per-image conversion depends on the image alone (hypothesis)
# ------------------------------------------

_image = st.tuples(st.sampled_from([1, 3]), st.integers(3, 12), st.integers(3, 12), st.integers(0, 2**32 - 1))


def _pixels(c: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w) if c == 1 else (h, w, 3), dtype=np.uint8)


@settings(max_examples=30, deadline=None)
@given(
    img=_image,
    shape=st.tuples(st.sampled_from([1, 3]), st.integers(2, 10), st.integers(2, 10)),
    resize=st.sampled_from(["resize", "crop"]),
)
def test_conform_image_gives_the_declared_shape_in_unit_range(img, shape, resize) -> None:
    c, h, w, seed = img
    px = _pixels(c, h, w, seed).astype(np.float32) / 255
    arr = px[:, :, None] if px.ndim == 2 else px
    out = conform_image(arr, shape, resize)
    assert out.shape == shape and out.dtype == np.float32
    assert np.isfinite(out).all() and out.min() >= 0.0 and out.max() <= 1.0
    assert np.array_equal(out, conform_image(arr.copy(), shape, resize))  # deterministic


@settings(max_examples=30, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_grey_copied_to_rgb_comes_back_as_the_same_grey(h, w, seed) -> None:
    grey = np.random.default_rng(seed).random((h, w, 1), dtype=np.float32)
    back = convert_channels(convert_channels(grey, 3), 1)
    assert np.allclose(back, grey, atol=1e-6)  # the luma weights sum to 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    images=st.lists(_image, min_size=2, max_size=7), drop=st.integers(0, 6), channels=st.sampled_from([1, 3])
)
def test_each_loaded_image_is_its_own_conversion_and_neighbours_load_alike(images, drop, channels) -> None:
    """Loaded under a declaration, image i is ``conform_image(image i)`` whatever the other images are, and
    the neighbouring dataset without one image has the same shape, classes and (other) pixels: nothing is
    voted on."""
    decl = DataDeclaration(("a", "b"), (channels, 6, 6))
    rows = [("ab"[i % 2], _pixels(*im)) for i, im in enumerate(images)]
    drop %= len(rows)
    with tempfile.TemporaryDirectory() as tmp:
        full, _ = load_dataset(_csv(Path(tmp) / "full", rows), resize="resize", declared=decl)
        less, _ = load_dataset(
            _csv(Path(tmp) / "less", rows[:drop] + rows[drop + 1 :]), resize="resize", declared=decl
        )
    assert full.image_shape == less.image_shape == decl.image_shape
    assert full.class_names == less.class_names == decl.class_names
    for i, (_, px) in enumerate(rows):
        alone = px.astype(np.float32) / 255
        expect = conform_image(alone[:, :, None] if alone.ndim == 2 else alone, decl.image_shape, "resize")
        assert np.array_equal(full.images[i], expect)
    assert np.array_equal(np.delete(full.images, drop, axis=0), less.images)


# -- labels: by name, outside refused, empty declared classes fine
# ------------------------------------------------


def test_a_label_outside_the_declared_classes_is_refused_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    grey = np.full((8, 8), 9, np.uint8)
    path = _csv(tmp_path, [("benign", grey), ("malignant", grey), ("lymphoma", grey)])
    with pytest.raises(DataError) as err:
        load_dataset(path, declared=DECL)
    msg = str(err.value)
    assert "'lymphoma'" in msg and "002.png" in msg and "dataset.classes" in msg and "re-sign" in msg


def test_declared_classes_without_images_and_label_order_follow_the_declaration(tmp_path: Path) -> None:
    grey = np.full((8, 8), 9, np.uint8)
    ds, _ = load_dataset(_csv(tmp_path, [("malignant", grey), ("malignant", grey)]), declared=DECL)
    assert ds.class_names == DECL.class_names and list(ds.labels) == [1, 1]  # one class only present: fine
    assert list(ds.class_counts()) == [0, 2, 0]


def test_folder_layout_with_an_empty_or_missing_declared_class(tmp_path: Path) -> None:
    for name, n in (("benign", 2), ("malignant", 0)):
        (tmp_path / name).mkdir()
        for i in range(n):
            Image.new("L", (8, 8), 30).save(tmp_path / name / f"{i}.png")
    ds, _ = load_dataset(tmp_path, declared=DECL)
    assert ds.class_names == DECL.class_names and ds.n == 2
    (tmp_path / "other").mkdir()
    Image.new("L", (8, 8), 30).save(tmp_path / "other" / "0.png")
    with pytest.raises(DataError, match="'other'"):
        load_dataset(tmp_path, declared=DECL)


def test_npz_labels_map_by_name_or_as_indices_into_the_declaration() -> None:
    imgs = np.zeros((3, 8, 8), np.uint8)
    ds = parse_arrays(imgs, np.array(["sarcoma", "benign", "sarcoma"]), declared=DECL)
    assert list(ds.labels) == [2, 0, 2] and ds.class_names == DECL.class_names
    ds = parse_arrays(imgs, np.array([0, 0, 1]), declared=DECL)
    assert list(ds.labels) == [0, 0, 1] and ds.n_classes == 3
    with pytest.raises(DataError, match="declares 3 classes"):
        parse_arrays(imgs, np.array([0, 3, 1]), declared=DECL)
    with pytest.raises(DataError, match="'x'"):
        parse_arrays(imgs, np.array(["x", "benign", "benign"]), declared=DECL)


def test_a_size_other_than_the_declared_one_is_refused_unless_resizing_is_asked(tmp_path: Path) -> None:
    path = _csv(
        tmp_path, [("benign", np.zeros((10, 10), np.uint8)), ("malignant", np.zeros((8, 8), np.uint8))]
    )
    with pytest.raises(DataError, match=r"(?s)declared image_shape size 8x8.*000.png \(10x10\)"):
        load_dataset(path, declared=DECL)
    ds, report = load_dataset(path, declared=DECL, resize="crop")
    assert ds.image_shape == (1, 8, 8) and report.n_resized == 1


def test_the_draft_declaration_loads_exactly_as_the_undeclared_data(tmp_path: Path) -> None:
    """What site init commits to (the undeclared load) is what the node recomputes under the drafted
    declaration."""
    rng = np.random.default_rng(1)
    rows = [
        ("b", rng.integers(0, 256, (8, 8), dtype=np.uint8)),
        ("a", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)),
        ("a", rng.integers(0, 256, (8, 8), dtype=np.uint8)),
    ]
    path = _csv(tmp_path, rows)
    plain, _ = load_dataset(path)
    again, _ = load_dataset(path, declared=DataDeclaration.draft_from(plain))
    assert again.fingerprint() == plain.fingerprint()


# -- the policy: schema, and the node's refusal of a policy without a declaration
# ---------------------------------


def test_policy_schema_needs_both_fields_and_a_valid_shape() -> None:
    from feta_release.policy import make_policy
    from feta_release.policy.document import SitePolicy, validate_policy

    doc = make_policy("s", "ab" * 32, 100, ["a" * 64], declared=DECL)
    assert SitePolicy.from_document(doc, None).declared == DECL
    assert doc["dataset"]["classes"] == ["benign", "malignant", "sarcoma"] and doc["dataset"][
        "image_shape"
    ] == [1, 8, 8]
    for bad in (
        {"image_shape": None},
        {"image_shape": [2, 8, 8]},
        {"classes": ["only"]},
        {"classes": ["a", "a"]},
    ):
        d = json.loads(json.dumps(doc))
        for k, v in bad.items():
            if v is None:
                del d["dataset"][k]
            else:
                d["dataset"][k] = v
        with pytest.raises(PolicyError):
            validate_policy(d)


def test_node_refuses_a_policy_without_a_declared_schema_saying_how_to_re_sign(tmp_path: Path) -> None:
    from edge.site import Site
    from feta_release.policy.document import sign_policy, write_signed_policy
    from feta_release.signing import load_private_key
    from tests.support.federation import make_federation

    fed = make_federation(tmp_path / "fed")
    site = fed.sites[0]
    doc = json.loads(site.policy.read_text("utf-8"))["policy"]
    assert "classes" in doc["dataset"] and "image_shape" in doc["dataset"]  # prepare_federation drafts them
    for k in ("classes", "image_shape"):
        del doc["dataset"][k]
    key = load_private_key(site.policy_pub.with_suffix(".key"))
    write_signed_policy(site.policy, sign_policy(doc, key))
    with pytest.raises(PolicyError, match=r"declares no public data schema.*re-sign"):
        Site.open(site.node_config())


def test_a_label_outside_the_declaration_stays_a_local_error_at_the_node(tmp_path: Path) -> None:
    """The node refuses to open (the admin's log names the file and the fix); the coordinator's error reply
    says neither the label nor the file (a DataError leaves as a generic line: edge/public_errors.py)."""
    from coordinator.setup import prepare_federation, sign_job_file
    from edge.site import Site
    from feta_release.federation import messages as fm
    from tests.support.federation import full_job, harness, tiny_sites

    grey = np.full((8, 8), 9, np.uint8)
    csv = _csv(tmp_path / "data", [("benign", grey)] * 10 + [("malignant", grey)] * 10)
    fed = prepare_federation(
        tmp_path / "fed",
        {"site-a": csv, "site-b": tiny_sites()["site-b"]},
        policy_overrides={"site-a": {"declared": DECL}},
    )
    Image.fromarray(grey, mode="L").save(csv.parent / "new.png")
    with open(csv, "a", encoding="utf-8") as fh:
        fh.write("new.png,lymphoma\n")
    signed, _ = sign_job_file(fed, full_job(), "job-decl")
    grid = harness(fed)
    (rep,) = grid.send_and_receive(
        [grid.create_message(fm.make_payload({"job": signed}), fm.HELLO, 100, "t")]
    )
    assert rep.has_error()
    assert (
        "lymphoma" not in rep.error.reason
        and "new.png" not in rep.error.reason
        and "DataError" in rep.error.reason
    )
    with pytest.raises(DataError, match=r"'lymphoma' \(.*new.png\).*dataset.classes"):
        Site.open(fed.sites[0].node_config())


def test_site_init_drafts_the_declaration_and_the_signed_draft_opens_a_node(tmp_path: Path) -> None:
    """The kit drafts classes and image_shape from the data (the admin's proposal); an admin who adds a rare
    class re-runs data-commitment with it, signs, and the node opens on that declaration."""
    import tomllib

    from click.testing import CliRunner

    from edge.kit import init_site, read_node_toml
    from edge.launch import NodeSettings
    from edge.site import Site
    from feta_release.cli import cli
    from feta_release.signing import generate_keypair, load_public_key, public_key_pem

    rng = np.random.default_rng(0)
    csv = _csv(
        tmp_path / "data",
        [(lab, rng.integers(0, 256, (8, 8), dtype=np.uint8)) for lab in ["benign"] * 6 + ["malignant"] * 6],
    )
    kit = init_site(tmp_path / "kit", csv, "st-mary")
    text = kit.policy_draft.read_text("utf-8")
    ds = tomllib.loads(text)["dataset"]
    assert (
        ds["classes"] == ["benign", "malignant"]
        and ds["image_shape"] == [1, 8, 8]
        and "YOUR declaration" in text
    )
    _, coord_pub = generate_keypair(tmp_path / "coord", "coordinator")
    out = CliRunner().invoke(
        cli,
        [
            "policy",
            "data-commitment",
            str(csv),
            "--secret",
            str(tmp_path / "kit" / "keys" / "data.secret"),
            "--class",
            "benign",
            "--class",
            "malignant",
            "--class",
            "sarcoma",
            "--image-shape",
            "1,8,8",
        ],
    )
    assert out.exit_code == 0, out.output
    fields = tomllib.loads("\n".join(ln for ln in out.output.splitlines() if not ln.startswith("#")))
    assert (
        fields["classes"] == ["benign", "malignant", "sarcoma"] and fields["commitment"] != ds["commitment"]
    )
    text = (
        text.replace(ds["commitment"], fields["commitment"])
        .replace('"benign", "malignant"]', '"benign", "malignant", "sarcoma"]')
        .replace("coordinators = []", f'coordinators = ["""{public_key_pem(load_public_key(coord_pub))}"""]')
    )
    kit.policy_draft.write_text(text, "utf-8")
    out = CliRunner().invoke(
        cli,
        [
            "policy",
            "sign",
            str(kit.policy_draft),
            "--key",
            str(tmp_path / "kit" / "keys" / "policy-admin.key"),
            "--out",
            str(tmp_path / "kit" / "policy.signed.json"),
        ],
    )
    assert out.exit_code == 0, out.output
    site = Site.open(NodeSettings(**read_node_toml(kit.node_toml)).node_config())
    assert site.data.class_names == ("benign", "malignant", "sarcoma") and site.policy.declared.n_classes == 3


def test_train_maps_its_data_onto_the_policy_declaration(tmp_path: Path) -> None:
    """Single-site ``train --policy``: the data are mapped onto the policy's declaration as the node maps
    them, and a declared class without images is not refused there either."""
    from feta_release.cli.train_cmd import _training_data
    from feta_release.config import load_preset
    from feta_release.training.data_checks import check_data

    cfg = load_preset("tiny")
    grey = np.full((8, 8), 9, np.uint8)
    data, _, _ = _training_data(
        cfg, str(_csv(tmp_path, [("benign", grey)] * 3 + [("malignant", grey)] * 3)), None, None, DECL
    )
    assert data.class_names == DECL.class_names and data.image_shape == (1, 8, 8)
    check_data(cfg, data, 100, declared=True)
    with pytest.raises(DataError, match="'sarcoma' have no images"):
        check_data(cfg, data, 100)
