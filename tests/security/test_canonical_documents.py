"""Canonical documents: duplicate JSON keys and non-plain site ids, as properties.

Attack: ``{"epsilon": 9, "epsilon": 0.5}`` is one document to Python (last key wins) and another to a reader
that keeps the first; a signature over it then vouches for two different statements. On 473f707 every
signed document (manifest, signed policy, job and attestation messages) was parsed with plain json.loads and
such a document was accepted; the release-level cases are in test_release_roles.py.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feta_release.errors import PolicyError
from feta_release.release.verify import SITE_ID_RE, VerificationResult, _sites_against_job
from feta_release.signing import DuplicateKeyError, loads_strict

KEYS = st.text(alphabet='abcdeε_"\\', min_size=0, max_size=4)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
)


def _obj(pairs: list[tuple[str, object]]) -> str:
    """A JSON object written pair by pair (so a key may appear twice, as an attacker writes it)."""
    return "{" + ",".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs) + "}"


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(KEYS, SCALARS), max_size=6), outer=KEYS, depth=st.integers(0, 3))
def test_duplicate_keys_refused_at_any_depth(pairs, outer, depth):
    text = _obj(pairs)
    for _ in range(depth):
        text = "{" + json.dumps(outer) + ": [" + text + "]}"
    keys = [k for k, _ in pairs]
    if len(set(keys)) == len(keys):
        assert loads_strict(text) == json.loads(text)
    else:
        with pytest.raises(DuplicateKeyError, match="duplicate key"):
            loads_strict(text)


@given(name=st.sampled_from(["NaN", "Infinity", "-Infinity"]))
def test_non_finite_numbers_refused(name):
    with pytest.raises(ValueError):
        loads_strict('{"epsilon": ' + name + "}")


def test_message_with_duplicate_keys_is_refused():
    """A job or attestation message to or from a site with a key twice is refused (fails on 473f707)."""
    from flwr.app import ConfigRecord, RecordDict

    from feta_release.federation import messages as fm

    rd = RecordDict({"cfg": ConfigRecord({"json": '{"round": 0, "round": 5}'})})
    with pytest.raises(PolicyError, match="duplicate key 'round'"):
        fm.read_payload(rd)


def test_unsigned_policy_with_duplicate_keys_is_refused_before_signing(tmp_path):
    from feta_release.policy.document import read_policy_document

    p = tmp_path / "p.json"
    p.write_text('{"version": 1, "version": 2}')
    with pytest.raises(PolicyError, match="duplicate key 'version'"):
        read_policy_document(p)


PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _site_ids_accepted(ids: list[object]) -> list[str]:
    res = VerificationResult(release_dir="r")
    return [sid for sid, _ in _sites_against_job(res, [{"site_id": s} for s in ids], None)]


@settings(max_examples=300, deadline=None)
@given(sid=st.one_of(st.text(max_size=70), st.from_regex(PLAIN, fullmatch=True), st.integers(), st.none()))
def test_site_id_accepted_iff_plain_name(sid):
    """A site id names a file and a trust root: '', '.', '..', 'a/b', control characters, non-ASCII digits,
    over-long names and non-strings are refused; the policy schema's plain names are accepted."""
    ok = isinstance(sid, str) and bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", sid, flags=re.ASCII))
    assert (_site_ids_accepted([sid]) == [sid]) is ok
    assert bool(isinstance(sid, str) and SITE_ID_RE.fullmatch(sid)) is ok


@pytest.mark.parametrize("bad", ["", ".", "..", "../a", "a/b", "a\\b", "a\n", "٣", "-a", "a" * 65])
def test_site_id_examples_refused(bad):
    assert _site_ids_accepted([bad]) == []


def test_duplicate_site_refused():
    res = VerificationResult(release_dir="r")
    assert [s for s, _ in _sites_against_job(res, [{"site_id": "a"}, {"site_id": "a"}], None)] == ["a"]
    assert "listed twice" in res.reason()
