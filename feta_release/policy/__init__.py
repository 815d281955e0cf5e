"""Site privacy policies, signed jobs, and the rules a node and a coordinator enforce.

Public API (see policies/README.md for the document format):

- keys: :mod:`feta_release.signing` (``generate_keypair``, ``load_private_key``, ``fingerprint``)
- policies: :func:`read_policy_document`, :func:`make_policy`, :func:`sign_policy`,
  :func:`load_site_policy` (node start), :func:`open_signed_policy`, :class:`SitePolicy`
- jobs: :func:`sign_job`, :func:`verify_job` (node), :func:`verify_job_with_keys`, :class:`Job`
- enforcement: :func:`check_request`, :func:`check_budget`, :func:`check_job_fits`,
  :func:`check_app_bundle`, :class:`MechanismRequest`
- errors: :class:`PolicyViolation` (``.rule``), :class:`PolicySchemaError` (``.fields``),
  :class:`PolicyBudgetExceeded` (a ``BudgetExceededError`` with ``.rule``), :class:`JobDoesNotFit`
"""

from .document import (
    MECHANISMS,
    MechanismRule,
    SitePolicy,
    check_validity,
    load_site_policy,
    make_policy,
    open_signed_policy,
    read_policy_document,
    sign_policy,
    validate_policy,
    write_signed_policy,
)
from .enforce import (
    MechanismRequest,
    check_app_bundle,
    check_budget,
    check_job,
    check_job_fits,
    check_request,
)
from .errors import JobDoesNotFit, PolicyBudgetExceeded, PolicySchemaError, PolicyViolation
from .jobs import Job, sign_job, verify_job, verify_job_with_keys

__all__ = [
    "MECHANISMS",
    "Job",
    "JobDoesNotFit",
    "MechanismRequest",
    "MechanismRule",
    "PolicyBudgetExceeded",
    "PolicySchemaError",
    "PolicyViolation",
    "SitePolicy",
    "check_app_bundle",
    "check_budget",
    "check_job",
    "check_job_fits",
    "check_request",
    "check_validity",
    "load_site_policy",
    "make_policy",
    "open_signed_policy",
    "read_policy_document",
    "sign_job",
    "sign_policy",
    "validate_policy",
    "verify_job",
    "verify_job_with_keys",
    "write_signed_policy",
]
