"""Policy documents: schema errors name the field, examples validate, the shipped schema is the one in
policies/."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from feta_release.errors import PolicyError
from feta_release.policy import PolicySchemaError, SitePolicy, read_policy_document, validate_policy
from feta_release.policy.schema import load_schema
from tests.support.policy import keys, policy_doc

ROOT = Path(__file__).resolve().parents[2]
K = keys()
DOC = policy_doc(K)


@pytest.mark.parametrize("name", ["policy.schema.json", "job.schema.json"])
def test_schema_copy_in_policies_is_identical(name: str) -> None:
    shipped = (ROOT / "feta_release" / "policy" / name).read_bytes()
    assert (ROOT / "policies" / name).read_bytes() == shipped, (
        f"policies/{name} differs from the packaged schema"
    )
    assert load_schema(name.split(".")[0]) == json.loads(shipped)


@pytest.mark.parametrize("example", ["strict-hospital.toml", "research.toml"])
def test_examples_validate(example: str) -> None:
    doc = read_policy_document(ROOT / "policies" / example)
    pol = SitePolicy.from_document(doc, signer=None)
    assert pol.job_epsilon <= pol.lifetime_epsilon
    assert all(m in pol.mechanisms for m in ("central", "frequency", "dpsgd"))
    text = (ROOT / "policies" / example).read_text()
    assert text.count("#") >= 10  # the examples explain their fields


def _set(doc, path, value):
    d = copy.deepcopy(doc)
    parent = d
    for p in path[:-1]:
        parent = parent[p]
    if value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return d


_DELETE = object()

MALFORMED = [
    (("version",), "1", "version"),
    (("version",), 0, "version"),
    (("version",), 1.5, "version"),
    (("version",), _DELETE, "version"),
    (("site_id",), "has space", "site_id"),
    (("dataset", "commitment"), "xyz", "dataset.commitment"),
    (("dataset", "size"), 0, "dataset.size"),
    (("dataset", "size"), _DELETE, "dataset.size"),
    (("budget", "per_job", "epsilon"), -1.0, "budget.per_job.epsilon"),
    (("budget", "lifetime", "delta"), 1.0, "budget.lifetime.delta"),
    (("budget", "per_job", "epsilon"), 100.0, "budget.per_job.epsilon"),  # above lifetime
    (("accountant",), "gdp", "accountant"),
    (("mechanisms", "dpsgd", "min_sigma"), -1, "mechanisms.dpsgd.min_sigma"),
    (("mechanisms", "dpsgd", "min_sigma"), _DELETE, "mechanisms.dpsgd.min_sigma"),
    (("mechanisms", "dpsgd", "max_stepz"), 3, "mechanisms.dpsgd.max_stepz"),
    (("mechanisms", "central", "max_rounds"), "5", "mechanisms.central.max_rounds"),
    (("mechanisms", "frequency", "allowed"), "yes", "mechanisms.frequency.allowed"),
    (("mechanisms", "frequency"), _DELETE, "mechanisms.frequency"),
    (("coordinators", 0), "not a key", "coordinators[0]"),
    (("app_bundles",), ["abc"], "app_bundles[0]"),
    (("not_before",), "2026-01-01", "not_before"),
    (("expires",), "2026-01-01T00:00:00", "expires"),
    (("expires",), "2020-01-01T00:00:00Z", "expires"),  # before not_before
    (("extra_field",), 1, "extra_field"),
]


@pytest.mark.parametrize(
    "path,value,field",
    MALFORMED,
    ids=[
        f"{'.'.join(map(str, p))}={v!r}" if v is not _DELETE else f"del {'.'.join(map(str, p))}"
        for p, v, _ in MALFORMED
    ],
)
def test_schema_errors_name_the_field(path, value, field: str) -> None:
    bad = _set(DOC, path, value)
    with pytest.raises(PolicySchemaError) as exc:
        validate_policy(bad, "p.json")
    assert field in exc.value.fields, exc.value.fields
    assert field in str(exc.value) and "p.json" in str(exc.value)


def test_disabled_mechanism_needs_no_limits() -> None:
    doc = _set(DOC, ("mechanisms", "frequency"), {"allowed": False})
    validate_policy(doc)
    assert SitePolicy.from_document(doc, None).mechanisms["frequency"].allowed is False


def test_toml_and_json_read_the_same(tmp_path) -> None:
    j = tmp_path / "p.json"
    j.write_text(json.dumps(DOC))
    assert read_policy_document(j) == DOC
    toml = tmp_path / "p.toml"
    toml.write_text((Path(__file__).resolve().parents[2] / "policies" / "research.toml").read_text())
    doc = read_policy_document(toml)
    assert doc["not_before"] == "2026-01-01T00:00:00Z"  # TOML dates become canonical ISO text


def test_toml_local_datetime_refused(tmp_path) -> None:
    src = (
        (ROOT / "policies" / "research.toml")
        .read_text()
        .replace("expires = 2028-01-01T00:00:00Z", "expires = 2028-01-01T00:00:00")
    )
    p = tmp_path / "p.toml"
    p.write_text(src)
    with pytest.raises(PolicyError, match="UTC offset"):
        read_policy_document(p)


def test_bad_toml_names_file(tmp_path) -> None:
    p = tmp_path / "p.toml"
    p.write_text("version = = 1")
    with pytest.raises(PolicyError, match="p.toml: not valid TOML"):
        read_policy_document(p)
