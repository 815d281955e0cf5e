"""The derived job's header states DP-SGD's sampling rate as the planner charges it. A federated job signs one
BATCH (``coordinator.derive.federated_job``: sized at the smallest declared site, cut to the sites' caps),
not a rate, and each site samples it over its own population (its public images, or its public patients at a
patient-level site): the header states the largest of those q, read off the facts. It printed "q = None"
there, and a text replacement patched one caller."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.config import JobConfig
from feta_release.job_rules import DataFacts, PatientFacts, notes_of
from feta_release.planning import patient_dpsgd, stage_events

_SITE = st.tuples(
    st.integers(1_000, 60_000),  # public size
    st.one_of(st.none(), st.tuples(st.floats(0.2, 1.0), st.integers(1, 4))),  # patients: share, cap
)


def _stated_q(notes: tuple[str, ...]) -> float:
    line = next(n for n in notes if n.startswith("dpsgd:"))
    got = re.search(r" at q = ([0-9.e-]+) ", line)
    assert got is not None, line
    return float(got.group(1))


@settings(max_examples=40, deadline=None)
@given(sites=st.lists(_SITE, min_size=2, max_size=4), share=st.floats(0.01, 1.0), rounds=st.integers(1, 6))
def test_a_federated_header_states_the_q_the_most_sampled_site_is_charged(
    sites: list[tuple[int, tuple[float, int] | None]], share: float, rounds: int
) -> None:
    sizes = tuple(n for n, _ in sites)
    patients = tuple(None if p is None else PatientFacts(max(1, round(n * p[0])), p[1]) for n, p in sites)
    smallest = min(n if p is None else p.patients for n, p in zip(sizes, patients))
    batch = max(1, round(share * smallest))  # the one signed batch, at most every site's population
    cfg = JobConfig.from_dict(
        {
            "central": {"sigma": 5.0, "clip": 2.0, "rounds": 1, "rate": 1.0},
            "dpsgd": {"batch": batch, "steps": 5 * rounds, "noise_multiplier": 1.0},
            "federation": {"rounds": rounds, "local_steps": 5},
        },
        "signed job",
    )
    facts = DataFacts(
        sum(sizes), 28, 28, 1, 10, 10.0, federated=True, site_sizes=sizes, site_patients=patients
    )
    notes = notes_of(facts, cfg, 5 * rounds)
    charged = max(
        next(
            e.q
            for e in stage_events(
                cfg.for_size(n),  # the central release's rate as a batch of this site
                n,
                federated=True,
                **patient_dpsgd(None if p is None else p.patients, None if p is None else p.cap),
            )
            if e.stage == "dpsgd"
        )
        for n, p in zip(sizes, patients)
    )
    assert "q = None" not in " ".join(notes)
    assert _stated_q(notes) == pytest.approx(charged, rel=1e-3)
