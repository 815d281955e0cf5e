"""What a site's error reply may say, written once for every path an error can leave by.

Flower turns an exception raised while a node handles a message into an error reply whose reason is the
exception's type and text, and sends it to the coordinator. Those texts were written for the site's
administrator: they may name local files (the policy, the ledger, the worker's socket and key), the node's
directories, or carry an internal exception's text (which can depend on the images). A reply is a release,
so before anything leaves:

  * a ``FetaError`` (the protocol's deliberate refusals: policy rule, budget, closed job, wrong request) keeps
    its type and its one line, with every local path replaced by ``<site path>``; except a ``DataError`` (a
    check of the site's own images, whose text may state their exact count or shape): its type and a generic
    line;
  * any other exception (a bug, an ``OSError``, torch) becomes one generic ``SiteFailure`` line;
  * both carry a random reference id, and the full detail (text and traceback) goes to the node's LOCAL log
    under that id, so the site's administrator can find what the coordinator's operator reports.

Used by the ClientApp (``edge.clientapp``: a Flower mod around every handler), the warm worker's channel
replies (``edge.worker``) and the per-message forwarder (``edge.forward``: channel failures).
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from flwr.app import Context, Message

from feta_release.errors import DataError, FetaError

log = logging.getLogger("feta.node")

PLACEHOLDER = "<site path>"
# node-config keys whose values are local files or directories (edge.site's CFG_*; spelled out so that this
# module imports nothing of the site: the per-message forwarder uses it without torch)
PATH_KEYS = (
    "data-path",
    "policy-file",
    "trusted-policy-key",
    "ledger-path",
    "site-key",
    "work-dir",
    "data-secret",
)
# An absolute path or a home-relative one: a '/' or '~/' that does not follow a word character (so "q/n",
# "sigma/sqrt(n)" and "and/or" stay), then anything up to white space, a quote or a bracket.
_PATH = re.compile(r"(?<![\w.\-])(?:~/|/)[^\s'\"<>()\[\]{},;]+")
_PUBLIC = "_feta_public_reply"


class SiteFailure(FetaError):
    """A request failed at the site for a reason that is not one of the protocol's refusals (details
    local)."""


def new_reference() -> str:
    return secrets.token_hex(6)


def redact(text: str, node_config: Mapping[str, Any] | None = None) -> str:
    """``text`` with the node's configured paths (as given and resolved) and any absolute path replaced."""
    named: set[str] = set()
    for key in PATH_KEYS:
        value = (node_config or {}).get(key)
        if isinstance(value, str) and len(value) > 1:
            named.add(value)
            try:
                named.add(str(Path(value).resolve()))
            except (OSError, RuntimeError):
                pass
    for value in sorted(named, key=len, reverse=True):  # longest first: a file inside a named dir goes whole
        text = text.replace(value, PLACEHOLDER)
    return _PATH.sub(PLACEHOLDER, text)


def is_public(exc: BaseException) -> bool:
    """True for an exception already made public here (or re-raised from a worker that did)."""
    return bool(getattr(exc, _PUBLIC, False))


_Exc = TypeVar("_Exc", bound=BaseException)


def mark_public(exc: _Exc) -> _Exc:
    """``exc`` itself (same type, so a caller's return type holds), flagged as safe to leave the site."""
    setattr(exc, _PUBLIC, True)
    return exc


def _same_type(exc: FetaError, text: str) -> BaseException:
    """An exception of ``exc``'s own type (callers in this process still catch it by type) with ``text``."""
    cls = type(exc)
    try:
        out = cls.__new__(cls)
        Exception.__init__(out, text)
        out.__dict__.update({k: v for k, v in vars(exc).items() if not k.startswith("__")})
        if str(out) == text:
            return out
    except Exception:  # noqa: BLE001 - a subclass that cannot be rebuilt: the base type carries the line
        pass
    return FetaError(text)


def public_error(
    exc: BaseException, node_config: Mapping[str, Any] | None = None, *, where: str = "request"
) -> BaseException:
    """The exception that may leave the site in place of ``exc``; ``exc`` itself is logged locally in full."""
    if is_public(exc):
        return exc
    ref = new_reference()
    log.error(
        "%s failed (error reference %s): %s: %s",
        where,
        ref,
        type(exc).__name__,
        exc,
        exc_info=(type(exc), exc, exc.__traceback__),
    )
    if isinstance(exc, DataError):  # about the site's own images: may state exact counts or shapes
        out = _same_type(
            exc,
            f"the site's data failed a check before this {where} (site error reference {ref}: "
            "its administrator finds which in the node's local log)",
        )
    elif isinstance(exc, FetaError):
        line = " ".join(redact(str(exc), node_config).split())  # one line, whatever the original had
        out = _same_type(exc, f"{line} [site error reference {ref}]")
    else:
        out = SiteFailure(
            f"the site could not answer this {where} (an internal error; site error reference {ref}: "
            "its administrator finds the cause in the node's local log)"
        )
    return mark_public(out)


def public_errors_mod(message: Message, context: Context, call_next: Any) -> Message:
    """Flower mod around every handler of the site's ClientApp: whatever a handler raises leaves as
    :func:`public_error` says (the full detail stays in this process's log)."""
    try:
        return call_next(message, context)  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - every failure is answered, none with its raw text
        raise public_error(
            exc, context.node_config, where=f"{message.metadata.message_type} request"
        ) from None
