"""Timing: every DP-SGD step of a site runs the same public number of calls, whatever its Poisson sample.

A step runs its sampled rows in calls of ``chunk`` rows, then padding calls up to the public bound
(``training.padding.padding_chunks``). A sample that filled the bound would leave no padding call (one call
fewer), and a bound that is not a whole number of chunks lets a sample one row short of it leave one out:
either way the step's timing would tell two neighbouring datasets apart (a site holding exactly its public
size that drew every row at q = 1, against one row fewer)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from feta_release.data.commitment import public_rows
from feta_release.training.padding import padding_chunks
from feta_release.training.step_rows import site_step_rows


def _calls(real: int, bound: int, chunk: int) -> int:
    return -(-real // chunk) + len(padding_chunks(real, bound, chunk))


@settings(max_examples=300, deadline=None)
@given(
    n_public=st.integers(1, 400),
    held=st.integers(-3, 3),
    q=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    chunk=st.integers(1, 40),
    cap=st.one_of(st.none(), st.integers(1, 50)),
)
@example(n_public=64, held=0, q=1.0, chunk=8, cap=None)  # tail n = 64 rows: 8 calls at 64, 9 at 63
@example(n_public=64, held=0, q=1.0, chunk=32, cap=None)
@example(n_public=24, held=0, q=0.9, chunk=4, cap=5)  # a bound of 25: 7 calls at 24 rows, 8 at 23
@example(n_public=8, held=0, q=0.8, chunk=2, cap=3)
def test_every_sample_a_site_can_draw_runs_the_same_number_of_calls(
    n_public: int, held: int, q: float, chunk: int, cap: int | None
) -> None:
    """Whatever the site holds around its public size and whatever it samples below the bound, a step runs
    the same number of calls; at q = 1 (every row drawn, no tail to speak of) the bound is above every
    sample. (A sample past a 5 sd tail below the site's rows, probability about 3e-7 a step, runs longer:
    the documented residual of ``public_batch_bound``.)"""
    n_rows = max(1, n_public + held)
    patients = None if cap is None else SimpleNamespace(cap=cap)
    bound = site_step_rows(n_rows, n_public, q, chunk, patients)
    most = min(n_rows, public_rows(n_rows, n_public))
    if q == 1.0:
        assert bound > most
    counts = {_calls(r, bound, chunk) for r in range(0, min(most, bound - 1) + 1)}
    assert len(counts) == 1, (bound, sorted(counts))
