"""The Ray auth token file of this machine, kept private to its owner: Ray 2.60 writes the token a ``ray.init()``
generates with the process umask (0644), so any local user could read it and run code on every Ray port. This
module imports nothing from Ray and never invents, reads or moves a token."""

from __future__ import annotations

import logging
import os
import stat
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


def token_path(env: Mapping[str, str] | None = None, home: Path | None = None) -> Path | None:
    """The token file Ray would use or create, or None when no file is involved (auth disabled, or the token in
    ``RAY_AUTH_TOKEN``)."""
    env = os.environ if env is None else env
    if env.get("RAY_AUTH_MODE", "").lower() == "disabled" or env.get("RAY_AUTH_TOKEN"):
        return None
    if env.get("RAY_AUTH_TOKEN_PATH"):
        return Path(env["RAY_AUTH_TOKEN_PATH"]).expanduser()
    return (Path.home() if home is None else home) / ".ray" / "auth_token"


def restrict(path: Path) -> bool:
    """Drops the group and other permission bits of an existing file; True if it changed anything (someone else's
    file is left as it is, with a warning)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if not mode & 0o077:
        return False
    try:
        path.chmod(mode & 0o700)
    except PermissionError:
        warnings.warn(f"{path} is readable by other users and cannot be changed by this user: chmod 600 {path}",
                      stacklevel=2)
        return False
    return True


@contextmanager
def private_ray_token(env: Mapping[str, str] | None = None, home: Path | None = None) -> Iterator[Path | None]:
    """Wrap ``ray.init`` in this: the token file it may create or use ends up mode 0600, and Ray's default folder
    ``~/.ray`` is created mode 0700 if missing (so a token Ray writes there is private from the start)."""
    env = os.environ if env is None else env
    path = token_path(env, home)
    if path is not None and not env.get("RAY_AUTH_TOKEN_PATH"):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path is not None and path.exists():
        restrict(path)
    try:
        yield path
    finally:
        if path is not None and path.exists():
            restrict(path)


class _OptOutNotice(logging.Filter):
    """Drops Ray's notice that token auth is on "by default" (its only advice: how to switch it off)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(OPT_OUT_NOTICE)


OPT_OUT_NOTICE = "Token authentication is enabled for this Ray cluster"
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def quiet_opt_out_notice() -> None:
    """Silences Ray 2.60's start-up warning "Token authentication is enabled ... Set RAY_AUTH_MODE=disabled to opt
    out"; auth stays as Ray chose it, and every other message of that logger still shows."""
    logger = logging.getLogger(RAY_AUTH_LOGGER)
    if not any(isinstance(f, _OptOutNotice) for f in logger.filters):
        logger.addFilter(_OptOutNotice())
