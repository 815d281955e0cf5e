"""One name for the trusted-key option across the CLI: ``--trusted`` is always a key the user chooses to trust
for the SITE ADMINISTRATOR role (the key that signs a site's policy; bound to a site id where a release names
several sites).  Coordinator keys are ``--coordinator``, a certificate's signer ``--certificate-key``.

Spellings used before the CLI was made consistent stay accepted as hidden, deprecated aliases, so that scripts
keep working; each use prints one warning naming the new spelling.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from ..release.verify import TrustRoots


def deprecated_alias(old: str, new: str, **kw: Any) -> Callable[[Any], Any]:
    """Hidden option ``old`` whose value arrives as ``<dest>_deprecated``; merge it with :func:`merged`."""
    dest = new.lstrip("-").replace("-", "_") + "_deprecated"

    def warn(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value not in (None, (), False):
            click.echo(f"warning: {old} is deprecated; use {new} (same meaning)", err=True)
        return value

    return click.option(old, dest, hidden=True, callback=warn, **kw)


def merged_option(new: Any, old: Any) -> Any:
    """The new option's value, else the deprecated alias's (tuples of a repeatable option are joined)."""
    if isinstance(new, tuple) or isinstance(old, tuple):
        return tuple(new or ()) + tuple(old or ())
    return new if new is not None else old


# A key bound to a site reads SITE_ID=FILE everywhere (`verify` and `report` need the binding; the one-site
# commands accept it too, so one spelling works in every command); a bare FILE is accepted where only one site
# is meant.
TRUSTED_METAVAR = "[SITE_ID=]ADMIN.pub"


def site_file(value: str, option: str) -> tuple[str, Path]:
    """``SITE_ID=FILE`` as (site id, existing file); refused with one line naming the option and the fix."""
    from ..errors import ConfigError

    sid, sep, path = value.partition("=")
    if not sep or not sid or not path:
        raise ConfigError(
            f"{option} {value!r}: give SITE_ID=FILE (e.g. st-luke=st-luke/keys/site-signing.pub)"
        )
    if not Path(path).is_file():
        raise ConfigError(f"{option} {value!r}: {path} is not a file")
    return sid, Path(path)


def trusted_key(value: str) -> tuple[str | None, Path]:
    """``--trusted`` as (bound site id or None, file): a bare FILE, or SITE_ID=FILE. An existing file whose
    name holds '=' stays a bare FILE."""
    if "=" in value and not Path(value).is_file():
        return site_file(value, "--trusted")
    if not Path(value).is_file():
        from ..errors import ConfigError

        raise ConfigError(f"--trusted {value!r}: no such file; give ADMIN.pub or SITE_ID=ADMIN.pub")
    return None, Path(value)


def trusted_for_site(values: Any, site_id: str) -> list[Path]:
    """The files of ``--trusted`` values meant for ``site_id`` (bare, or bound to it); a key bound to another
    site is refused: trusting it for this one would let that site's administrator sign this site's policy."""
    from ..errors import ConfigError

    out = []
    for v in [values] if isinstance(values, (str, Path)) else list(values or ()):
        sid, path = trusted_key(str(v))
        if sid is not None and sid != site_id:
            raise ConfigError(
                f"--trusted {v}: bound to site {sid!r}, but the policy is site {site_id!r}'s; give "
                f"{site_id}=ADMIN.pub (or the bare file)"
            )
        out.append(path)
    return out


def policy_site_id(signed_policy: Path) -> str:
    """The site id a signed policy names, read BEFORE it is verified, only to pick the ``--trusted`` keys
    bound to that site; the policy is then verified against them."""
    from ..policy.envelope import read_json

    doc = read_json(signed_policy, "signed policy")
    pol = doc.get("policy") if isinstance(doc, dict) else None
    return str(pol.get("site_id", "")) if isinstance(pol, dict) else ""


def trusted_for_policy(values: Any, signed_policy: Path) -> list[Path]:
    """``trusted_for_site`` for the site that ``signed_policy`` names."""
    return trusted_for_site(values, policy_site_id(signed_policy))


# A release's trust roots, on every command that verifies one (verify, synthesize, verify-synthetic,
# report): a key given here is trusted for one role only, bound to the site it names (``TrustRoots``).
RELEASE_TRUSTED_HELP = "A site's administrator public key (signs its policy); repeat for each site."
RELEASE_COORDINATOR_HELP = (
    "Optional: pin the coordinator key (it must also be allowed by every site's policy)."
)


def release_trust_options(
    trusted_help: str = RELEASE_TRUSTED_HELP, coordinator_help: str = RELEASE_COORDINATOR_HELP
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the repeatable ``--trusted SITE_ID=KEY.pub`` and ``--coordinator KEY.pub`` (the function gets
    ``trusted`` and ``coordinators``, tuples that :func:`release_trust_roots` reads)."""

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option(
            "--coordinator",
            "coordinators",
            multiple=True,
            type=click.Path(dir_okay=False),
            help=coordinator_help,
        )(f)
        return click.option(
            "--trusted", "trusted", multiple=True, metavar="SITE_ID=KEY.pub", help=trusted_help
        )(f)

    return deco


def release_trust_roots(entries: tuple[str, ...], coordinators: tuple[str, ...] = ()) -> TrustRoots:
    """``--trusted SITE_ID=ADMIN_KEY.pub`` (repeatable) and optional ``--coordinator KEY.pub`` pins as the
    release's ``TrustRoots``."""
    from ..errors import ConfigError
    from ..release.verify import SITE_ID_RE, TrustRoots
    from ..signing import load_public_key

    if not entries:
        raise ConfigError(
            "give --trusted SITE_ID=ADMIN_KEY.pub for each site (the key that signs its policy)"
        )
    admins: dict[str, list[Any]] = {}
    for e in entries:
        sid, sep, path = e.partition("=")
        if not sep or not SITE_ID_RE.fullmatch(sid) or not path:
            raise ConfigError(
                f"--trusted {e!r}: say whose key it is, as SITE_ID=ADMIN_KEY.pub (a key trusted for "
                "every role would let a coordinator or another site sign for a site); the coordinator "
                "key comes from the sites' signed policies, or pin it with --coordinator KEY.pub"
            )
        admins.setdefault(sid, []).append(load_public_key(path))
    return TrustRoots(
        {k: tuple(v) for k, v in admins.items()}, tuple(load_public_key(p) for p in coordinators)
    )
