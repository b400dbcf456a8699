"""The tracking URI before MLflow sees it: a scheme this service works with, no credentials in it, a server that
answers (docs/spec.md, ``tracking``)."""

from __future__ import annotations

import os
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import SplitResult, parse_qsl, urlsplit

from qed_ray.spec.hints import near, short_text
from qed_ray.records.layout import SweepDir
from qed_ray.spec.sweep import SpecError

URI_ENV = "MLFLOW_TRACKING_URI"
SERVERS = ("http", "https")
LOCAL = ("sqlite", "file")
DATABASES = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}  # default ports
PROBE_TIMEOUT_S = 5.0
_DEFAULT_PORTS = {"http": 80, "https": 443, **DATABASES}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|credential|auth|signature|access.?key", re.I)
ALLOWED = ("http(s)://host:port (a tracking server), sqlite:////abs/path/mlflow.db, file:///abs/path or "
           "postgresql/mysql/mssql://host/db")


def masked(uri: str) -> str:
    """``uri`` with everything before its last ``@`` after the scheme (so a password with an unescaped ``/`` or ``@``
    too) and its query string replaced by ``***``, cut to a line."""
    if "@" in uri:
        head = uri[:uri.index("://") + 3] if "://" in uri else ""
        uri = f"{head}***@{uri.rsplit('@', 1)[1]}"
    if "?" in uri:  # a query string may carry a password or a token under any name
        uri = uri.split("?", 1)[0] + "?***"
    return short_text(uri, 120)


def _user_part(uri: str) -> str | None:
    rest = uri.split("://", 1)[1] if "://" in uri else uri
    return rest.rsplit("@", 1)[0] if "@" in rest else None


def uri_field() -> str:
    return URI_ENV if os.environ.get(URI_ENV) else "tracking.uri"


def base_scheme(uri: str) -> str:
    """``postgresql`` for ``postgresql+psycopg2://...``; "" without a scheme."""
    found = _SCHEME.match(uri)
    return found.group(1).lower().split("+", 1)[0] if found else ""


def check_uri(uri: str, field: str) -> None:
    """Raises SpecError (one line naming ``field``, the password masked) for a URI this service cannot use."""
    problem = _problem(uri)
    if problem:
        raise SpecError(f"{field}: {problem}")


def given_uri(flag: str | None) -> str | None:
    """A CLI's MLflow URI: its ``--tracking-uri``, else ``MLFLOW_TRACKING_URI``, else None (the sweep folder's own
    store); checked like a spec's."""
    uri = flag or os.environ.get(URI_ENV) or None
    if uri is not None:
        check_uri(uri, "--tracking-uri" if flag else URI_ENV)
    return uri


def _problem(uri: str) -> str | None:
    shown, scheme = repr(masked(uri)), base_scheme(uri)
    if scheme not in (*SERVERS, *LOCAL, *DATABASES):
        what = f"unknown scheme {scheme!r}{near(scheme, (*SERVERS, *LOCAL, *DATABASES))}" if scheme else "no scheme"
        return f"{shown} has {what}; use {ALLOWED}"
    user = _user_part(uri)
    if user is not None and (scheme in SERVERS or ":" in user):
        where = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD instead" if scheme in SERVERS else
                 "give the password in the driver's password file (PostgreSQL: ~/.pgpass) instead")
        return (f"{shown} carries credentials, which would be printed and stored with the sweep; give the URI "
                f"without them and {where}")
    try:  # only now: a parser's message may quote any part of the URI, and it holds no password any more
        parts = urlsplit(uri)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        return f"{masked(uri)!r} is not a valid URI ({short_text(str(e), 100)})"
    secret = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True) if _SECRET_PARAM.search(k)]
    if secret:
        return (f"{shown} carries a credential in its query string ({secret[0]}=...), which would be printed and "
                f"stored with the sweep; give the URI without it and the password in the driver's password file "
                f"(PostgreSQL: ~/.pgpass) or MLFLOW_TRACKING_PASSWORD instead")
    if scheme == "sqlite" and not re.match(r"sqlite(\+\w+)?:////", uri, re.I):
        return (f"{shown} is not an absolute SQLite path (sqlite:/// and then a relative path; a Ray trial runs in "
                f"another folder); use sqlite:////abs/path/mlflow.db (four slashes)")
    if scheme == "file" and (parts.netloc or not parts.path.startswith("/")):
        return f"{shown} is not an absolute local path; use file:///abs/path"
    if scheme not in LOCAL and not parts.hostname:
        return f"{shown} names no host; use {ALLOWED}"
    return None


def unreachable(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why nothing answers at a server (``/health``: any HTTP answer will do) or database (TCP) URI within
    ``timeout_s``; None: it answered, or the store is local. Sends no credentials."""
    scheme, parts = base_scheme(uri), urlsplit(uri)
    if scheme in LOCAL:
        return None
    try:
        if scheme in SERVERS:
            _ask_http(parts, timeout_s)
        else:
            socket.create_connection((parts.hostname, parts.port or _DEFAULT_PORTS[scheme]), timeout_s).close()
    except (OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        return (f"nothing answers at {masked(uri)} within {timeout_s:g} s ({type(why).__name__}: "
                f"{short_text(str(why), 100)})")
    return None


def _ask_http(parts: SplitResult, timeout_s: float) -> None:
    url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}/health"
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        pass  # an HTTP answer of any status: a server is there (a login it refuses shows in the first MLflow call)


def default_tracking_uri(sweep_dir: Path) -> str:
    """``sqlite:////abs/<sweep_dir>/mlflow.db`` (4 slashes: absolute; relative URIs break inside Ray trials)."""
    return f"sqlite:///{SweepDir(Path(sweep_dir).resolve()).mlflow_db}"
