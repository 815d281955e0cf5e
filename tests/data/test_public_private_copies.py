"""Counting the private images a public set copies (``data.public.private_copies``): exactly the copies, in
any order, whether either set holds uint8 pixels or their float form (k / 255, as the loaders return them)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.data.dataset import _to_uint8
from feta_release.data.public import image_digests, private_copies

SHAPE = (1, 3, 3)  # small images: collisions between random ones are likely, so "exactly" is tested
RGB = (3, 3, 3)


@st.composite
def _sets(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(private uint8 images, public uint8 images, a permutation of the public set, the true copy count by
    pixel-by-pixel comparison)."""
    shape = draw(st.sampled_from([SHAPE, RGB]))
    # channels drawn whole from few levels: solid colours (each channel constant, channels differing) occur
    channel = st.one_of(
        st.sampled_from([0, 1, 128, 254, 255]).map(lambda v: [v] * 9),
        st.lists(st.sampled_from([0, 1, 128, 254, 255]), min_size=9, max_size=9),
    )
    pixels = st.lists(channel, min_size=shape[0], max_size=shape[0]).map(lambda cs: sum(cs, []))
    private = np.array(draw(st.lists(pixels, min_size=1, max_size=12)), np.uint8).reshape(-1, *shape)
    fresh = np.array(draw(st.lists(pixels, max_size=12)), np.uint8).reshape(-1, *shape)
    picks = draw(st.lists(st.integers(0, len(private) - 1), max_size=8))  # copies, repeats allowed
    public = np.concatenate([fresh, private[picks]])
    # the O(N*M) definition: a public image with spatial information (some channel not one value) equal to
    # some private one
    truth = sum(
        any(len(np.unique(c)) > 1 for c in p) and any(np.array_equal(p, q) for q in private) for p in public
    )
    order = np.array(draw(st.permutations(range(len(public)))), np.int64)
    return private, public, order, truth


@settings(max_examples=150, deadline=None)
@given(_sets())
def test_the_counter_counts_exactly_the_copies_in_any_order_and_form(sets):
    private, public, order, truth = sets
    assert private_copies(public, private) == truth
    assert private_copies(public[order], private[::-1]) == truth  # order of neither set matters
    as_float = (public.astype(np.float32) / 255).astype(np.float32)  # a uint8 image round-tripped to float
    assert private_copies(as_float, private) == truth
    assert private_copies(public, private.astype(np.float32) / 255) == truth


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1, width=32), min_size=9, max_size=9))
def test_a_float_image_and_its_uint8_storage_have_one_digest(values):
    img = np.array(values, np.float32).reshape(1, *SHAPE)
    stored = _to_uint8(img)  # what save_npz(dtype="uint8") stores of it
    reloaded = stored.astype(np.float32) / 255  # and what the loader returns from it
    assert image_digests(img) == image_digests(stored) == image_digests(reloaded)


def test_a_pixel_off_by_one_level_is_no_copy():
    private = np.arange(9, dtype=np.uint8).reshape(1, *SHAPE) + 100
    moved = private.copy()
    moved[0, 0, 1, 1] = 101
    assert private_copies(moved, private) == 0 and private_copies(private, private) == 1
    assert private_copies(np.zeros((0, *SHAPE), np.uint8), private) == 0


def test_blank_frames_in_both_sets_are_no_copies_but_a_real_image_beside_them_is():
    """A constant image (a blank or saturated slice) in both sets carries nothing about anyone: it is not
    counted, whatever its level or form; a non-constant private image beside it still is."""
    scan = np.arange(9, dtype=np.uint8).reshape(1, *SHAPE) * 20
    for level in (0, 37, 255):
        blank = np.full((1, *SHAPE), level, np.uint8)
        private = np.concatenate([blank, scan])
        assert private_copies(blank, private) == 0
        assert private_copies(blank.astype(np.float32) / 255, private) == 0
        assert private_copies(np.concatenate([blank, blank, scan]), private) == 1


def test_a_solid_colour_frame_in_both_sets_is_no_copy():
    """A solid red frame (each channel one value, the channels different) holds no spatial information, as a
    blank slice does: in both sets it is not counted; an RGB image with spatial detail beside it still is."""
    red = np.zeros((1, *RGB), np.uint8)
    red[0, 0] = 255
    scan = np.arange(27, dtype=np.uint8).reshape(1, *RGB)
    private = np.concatenate([red, scan])
    assert private_copies(red, private) == 0
    assert private_copies(red.astype(np.float32) / 255, private) == 0
    assert private_copies(np.concatenate([red, red, scan]), private) == 1
    one_spot = red.copy()
    one_spot[0, 2, 1, 1] = 9  # one pixel differs in one channel: spatial information, counted
    assert private_copies(one_spot, np.concatenate([one_spot, scan])) == 1
