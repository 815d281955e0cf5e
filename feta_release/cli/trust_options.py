"""One name for the trusted-key option across the CLI: ``--trusted`` is always a key the user chooses to trust
for the SITE ADMINISTRATOR role (the key that signs a site's policy; bound to a site id where a release names
several sites).  Coordinator keys are ``--coordinator``, a certificate's signer ``--certificate-key``.

Spellings used before the CLI was made consistent stay accepted as hidden, deprecated aliases, so that scripts
keep working; each use prints one warning naming the new spelling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def deprecated_alias(old: str, new: str, **kw: Any) -> Callable[[Any], Any]:
    """Hidden option ``old`` whose value arrives as ``<dest>_deprecated``; merge it with :func:`merged`."""
    dest = new.lstrip("-").replace("-", "_") + "_deprecated"

    def warn(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value not in (None, (), False):
            click.echo(f"warning: {old} is deprecated; use {new} (same meaning)", err=True)
        return value

    return click.option(old, dest, hidden=True, callback=warn, **kw)


def merged(new: Any, old: Any) -> Any:
    """The new option's value, else the deprecated alias's (tuples of a repeatable option are joined)."""
    if isinstance(new, tuple) or isinstance(old, tuple):
        return tuple(new or ()) + tuple(old or ())
    return new if new is not None else old
