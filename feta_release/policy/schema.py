"""JSON Schemas of policy and job documents, shipped inside the package (``policy.schema.json``,
``job.schema.json`` next to this file are the one source of truth; ``policies/`` holds identical
copies for people, checked by a test). Errors name the field path, e.g. ``mechanisms.dpsgd.min_sigma``.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator

from .errors import PolicySchemaError

SCHEMAS = {"policy": "policy.schema.json", "job": "job.schema.json"}


@cache
def load_schema(name: str) -> dict[str, Any]:
    return json.loads(resources.files("feta_release.policy").joinpath(SCHEMAS[name]).read_text("utf-8"))


@cache
def _validator(name: str) -> Draft202012Validator:
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def field_path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _describe(err: Any) -> list[tuple[str, str]]:
    base = list(err.absolute_path)
    if err.validator == "required" and isinstance(err.instance, dict):
        missing = [r for r in err.validator_value if r not in err.instance]
        return [(field_path(base + [m]), "required field missing") for m in missing]
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = set(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - known)
        return [(field_path(base + [e]), f"unknown field (known: {', '.join(sorted(known))})") for e in extra]
    if err.validator == "anyOf" and base and base[0] == "coordinators":
        return [(field_path(base), "not a PEM public key nor a 16-hex key fingerprint")]
    return [(field_path(base), err.message)]


def schema_problems(doc: Any, name: str) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for err in sorted(_validator(name).iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path]):
        problems.extend(p for p in _describe(err) if p not in problems)
    return problems


def validate(doc: Any, name: str, source: str) -> None:
    """Raise :class:`PolicySchemaError` listing every offending field of ``doc``."""
    problems = schema_problems(doc, name)
    if problems:
        raise PolicySchemaError(source, problems)
