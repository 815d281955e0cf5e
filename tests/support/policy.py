"""Shared helpers for the policy/keys/jobs tests: keys, a signed policy, a signed job, tampering."""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Iterator
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from feta_release.config import JobConfig
from feta_release.policy import make_policy, sign_job, sign_policy

NOW = dt.datetime(2026, 6, 1, tzinfo=dt.UTC)
FP = "ab" * 32


def keys() -> dict[str, Ed25519PrivateKey]:
    return {name: Ed25519PrivateKey.generate() for name in ("site", "coord", "other")}


def policy_doc(k: dict[str, Ed25519PrivateKey], **over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        not_before="2026-01-01T00:00:00Z",
        valid_days=36500,  # far future: tests must not start failing when the clock passes a date
        app_bundles=["cd" * 32],
        lifetime=(3.0, 1e-5),
        per_job=(1.5, 1e-5),
        mechanisms={
            "central": {"min_sigma": 4.0, "max_rounds": 5, "max_batch": 600},
            "frequency": {"min_sigma": 10.0, "max_features": 1000},
            "dpsgd": {"min_sigma": 1.0, "max_steps": 200, "max_batch": 256, "max_clip": 1.0},
        },
    )
    kw.update(over)
    return make_policy("site-a", FP, 1000, [k["coord"].public_key()], **kw)


def signed_policy(k: dict[str, Ed25519PrivateKey], **over: Any) -> dict[str, Any]:
    return sign_policy(policy_doc(k, **over), k["site"])


def job_config() -> JobConfig:
    return JobConfig.from_dict(
        {"dpsgd": {"steps": 50, "batch": 128}, "federation": {"sites": ["site-a", "site-b"]}}
    )


def signed_job(
    k: dict[str, Ed25519PrivateKey],
    key: str = "coord",
    sites: tuple[str, ...] = ("site-a", "site-b"),
    job_id: str = "job-1",
) -> dict[str, Any]:
    return sign_job(job_config(), k[key], job_id, sites, created="2026-05-01T12:00:00Z")


# -- tampering -------------------------------------------------------------------------------------


def leaf_paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every leaf (scalar or empty container) of a JSON document, as a path of keys / indexes."""
    if isinstance(doc, dict) and doc:
        for key in doc:
            yield from leaf_paths(doc[key], prefix + (key,))
    elif isinstance(doc, list) and doc:
        for i, v in enumerate(doc):
            yield from leaf_paths(v, prefix + (i,))
    else:
        yield prefix


def dict_paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    if isinstance(doc, dict):
        yield prefix
        for key, v in doc.items():
            yield from dict_paths(v, prefix + (key,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from dict_paths(v, prefix + (i,))


def get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def alterations(value: Any) -> list[Any]:
    """Different values for a leaf: a changed character (start, middle, end), a changed number or type."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, float(value), str(value)]
    if isinstance(value, float):
        return [value * 1.5 + 0.1, value + 1e-12 * max(1.0, abs(value)), str(value)]
    if isinstance(value, str):
        if not value:
            return ["x"]
        out = []
        for i in sorted({0, len(value) // 2, len(value) - 1}):
            c = value[i]
            out.append(value[:i] + ("B" if c != "B" else "C") + value[i + 1 :])
        return out
    if value is None:
        return [0]
    if isinstance(value, list):
        return [["x"]]
    if isinstance(value, dict):
        return [{"x": 1}]
    raise AssertionError(value)


def tampered(doc: dict[str, Any], path: tuple, new: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    parent = get(out, path[:-1])
    parent[path[-1]] = new
    return out


def tamper_cases(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(description, tampered copy) for every leaf alteration, every key deletion and an added key per
    object."""
    cases = []
    for path in leaf_paths(doc):
        if not path:
            continue
        for i, new in enumerate(alterations(get(doc, path))):
            cases.append((f"alter {'.'.join(map(str, path))} #{i}", tampered(doc, path, new)))
        out = copy.deepcopy(doc)
        parent = get(out, path[:-1])
        del parent[path[-1]]
        cases.append((f"delete {'.'.join(map(str, path))}", out))
    for path in dict_paths(doc):
        out = copy.deepcopy(doc)
        get(out, path)["zz_extra"] = 1
        cases.append((f"add key under {'.'.join(map(str, path)) or 'top'}", out))
    return cases
