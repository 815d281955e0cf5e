"""A labels CSV lists images INSIDE its own folder: an absolute path, a '..' part or a symbolic link out of
the folder is refused (each row named, with the fix), so a file supplier cannot make the node train on images
from elsewhere (another study's, another department's) as this site's data."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from feta_release.data import load_dataset
from feta_release.errors import DataError


def _png(path: Path, value: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8), value).save(path)
    return path


def _csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("path,label\n" + "".join(f"{p},{lab}\n" for p, lab in rows))
    return path


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """``data/`` with two images inside, and ``outside/other.png`` beside it (another study's image)."""
    data = tmp_path / "data"
    _png(data / "img" / "a.png", 10)
    _png(data / "img" / "b.png", 200)
    _png(tmp_path / "outside" / "other.png", 120)
    return data, tmp_path / "outside" / "other.png"


def test_labels_csv_refuses_a_path_that_goes_up_out_of_its_folder(layout) -> None:
    data, _ = layout
    csv = _csv(data / "labels.csv", [("img/a.png", "x"), ("img/b.png", "y"), ("../outside/other.png", "y")])
    with pytest.raises(DataError) as err:
        load_dataset(csv)
    msg = str(err.value)
    assert str(csv) in msg and "line 4" in msg and "outside the data folder" in msg and "'..'" in msg
    assert "move or copy them in" in msg


def test_labels_csv_refuses_an_absolute_path(layout) -> None:
    data, other = layout
    csv = _csv(data / "labels.csv", [("img/a.png", "x"), ("img/b.png", "y"), (str(other), "y")])
    with pytest.raises(DataError, match=r"line 4: .* is an absolute path"):
        load_dataset(csv)


def test_labels_csv_refuses_a_symbolic_link_out_of_its_folder(layout) -> None:
    data, other = layout
    (data / "img" / "c.png").symlink_to(other)
    (data / "elsewhere").symlink_to(other.parent, target_is_directory=True)
    csv = _csv(
        data / "labels.csv",
        [("img/a.png", "x"), ("img/b.png", "y"), ("img/c.png", "y"), ("elsewhere/other.png", "x")],
    )
    with pytest.raises(DataError) as err:
        load_dataset(csv)
    msg = str(err.value)
    assert "2 row(s) name a file outside the data folder" in msg and "line 4" in msg and "line 5" in msg
    assert "symbolic link that leads out of the data folder" in msg


def test_labels_csv_inside_its_folder_still_loads_links_included(layout) -> None:
    data, _ = layout
    (data / "img" / "link.png").symlink_to(data / "img" / "b.png")
    csv = _csv(data / "labels.csv", [("img/a.png", "x"), ("./img/link.png", "y")])
    ds, _ = load_dataset(csv)
    assert ds.n == 2 and ds.class_names == ("x", "y")


segments = st.lists(
    st.sampled_from(["..", ".", "img", "a.png", "b.png", "out", "sub"]), min_size=1, max_size=6
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=segments, absolute=st.booleans())
def test_a_row_loads_iff_it_names_an_image_inside_the_folder_without_going_up(
    tmp_path: Path, parts, absolute
) -> None:
    """Any path built of names, '.' and '..' (relative or absolute): loaded exactly when it is relative, has
    no '..' part and names an image inside the folder; otherwise refused naming its line, never read from
    outside."""
    root = tmp_path / "case"
    data = root / "data"
    if not data.exists():
        _png(data / "img" / "a.png", 10)
        _png(data / "base.png", 200)  # a name no generated path reaches: the other class's one image
        _png(data / "b.png", 150)
        _png(root / "img" / "a.png", 90)  # what '../img/a.png' would reach
        _png(root / "out" / "a.png", 90)
    listed = posixpath.join(str(data) if absolute else "", *parts)
    csv = _csv(data / "labels.csv", [("base.png", "y"), (listed, "x")])
    inside = not absolute and ".." not in parts
    target = data.joinpath(*parts)
    if inside and target.is_file():
        ds, _ = load_dataset(csv)
        assert ds.n == 2
        return
    with pytest.raises(DataError) as err:
        load_dataset(csv)
    if not inside:
        assert "line 3" in str(err.value) and "outside the data folder" in str(err.value)
    assert os.path.realpath(root / "img" / "a.png") not in str(err.value)
