"""The MLflow server's users, set up by whoever administers it: python cluster/mlflow_users.py [EXPERIMENT ...]

MLflow's basic-auth app knows two kinds of login here (cluster/README.md, "MLflow users"):
- the admin, created by the server at its first start from MLFLOW_AUTH_ADMIN_USERNAME/PASSWORD, which live only where
  the server starts (VMs: ~/mlflow/admin.env, generated on the head; KubeRay: the Secret qed-mlflow-admin) and with
  its administrator; it may create users and change permissions;
- the clients' user (MLFLOW_TRACKING_USERNAME/PASSWORD of ~/.qed/mlflow.env, the Secret qed-mlflow-client), the login
  of every Ray node, so of every trial and every job driver: no admin, READ on what it was not given (the server's
  default_permission), EDIT on each sweep experiment named here.

With the admin's credentials this tool creates the clients' user (or gives it the password of its file again, after
a rotation), refuses one that is an admin or the admin itself, and for each EXPERIMENT creates it if it does not exist
and gives the clients' user EDIT on it. EDIT is what a sweep needs (runs, metrics, tags, artifacts); it cannot delete
the experiment, nor create users or change permissions. A sweep whose experiment does not exist yet creates it
itself: MLflow lets any user create experiments and makes the creator their manager (MANAGE, on that experiment
only); naming the experiment here, before or after, gives the clients' user EDIT on it instead.

Credentials come from owner-only files of KEY=VALUE lines, never from the command line.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import time
import urllib.error
import urllib.request
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple

ADMIN_KEYS = ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD")  # what the server reads
CLIENT_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")  # what MLflow's client reads
CLIENT_PERMISSION = "EDIT"


class UsersError(Exception):
    """A problem the administrator must fix (named file, user or experiment); printed as one ``error:`` line."""


class Login(NamedTuple):
    """A username and its password (never printed)."""

    username: str
    password: str


def read_login(path: Path, keys: tuple[str, str]) -> Login:
    """The login that an owner-only env file (``KEY=VALUE`` lines) holds under ``keys`` (username, password)."""
    try:
        mode, text = path.stat().st_mode, path.read_text()
    except OSError as err:
        raise UsersError(f"{path}: cannot read it ({err.strerror})") from None
    if stat.S_IMODE(mode) & 0o077:
        raise UsersError(f"{path}: readable by other users (mode {stat.S_IMODE(mode):o}); chmod 600 {path}")
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    missing = [k for k in keys if not values.get(k, "").strip()]
    if missing:
        raise UsersError(f"{path}: no {' / '.join(missing)} (expected {keys[0]}=... and {keys[1]}=... lines)")
    return Login(values[keys[0]].strip(), values[keys[1]].strip())


@contextmanager
def logged_in(login: Login) -> Iterator[None]:
    """MLflow's clients read their login from the environment: this process's, for the duration only."""
    saved = {k: os.environ.get(k) for k in CLIENT_KEYS}
    os.environ.update(zip(CLIENT_KEYS, login))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wait_until_up(uri: str, seconds: float) -> None:
    """Polls the server's /health (which needs no login) until it answers 200 or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() >= deadline:
            raise UsersError(f"the MLflow server at {uri} did not answer /health within {seconds:g} s")
        time.sleep(1)


def _auth(uri: str):
    with warnings.catch_warnings():  # mlflow.server's own import of a deprecated starlette module
        warnings.filterwarnings("ignore", message="starlette.middleware.wsgi is deprecated")
        from mlflow.server import get_app_client

        return get_app_client("basic-auth", tracking_uri=uri)


def _accepted(uri: str, login: Login) -> bool:
    """Whether the server accepts this login (a user may read its own record)."""
    from mlflow.exceptions import MlflowException

    with logged_in(login):
        try:
            _auth(uri).get_user(login.username)
        except MlflowException as err:
            if err.error_code == "UNAUTHENTICATED":
                return False
            raise
    return True


def ensure_client(uri: str, admin: Login, client: Login) -> str:
    """Creates the clients' user, or sets its password to the file's when the server refuses it; returns what was
    done ("created", "password updated", "unchanged"). Refuses the admin's name and any admin user."""
    if client.username == admin.username:
        raise UsersError(f"the clients' user {client.username!r} is the MLflow admin: every trial would be an "
                         f"admin; give the clients their own username")
    from mlflow.exceptions import MlflowException

    with logged_in(admin):
        auth = _auth(uri)
        try:
            user = auth.get_user(client.username)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            auth.create_user(client.username, client.password)
            return "created"
    if user.is_admin:
        raise UsersError(f"the clients' user {client.username!r} is an admin of {uri}; demote it "
                         f"(update_user_admin) or give the clients another username")
    if _accepted(uri, client):
        return "unchanged"
    with logged_in(admin):
        _auth(uri).update_user_password(client.username, client.password)
    return "password updated"


def grant_edit(uri: str, admin: Login, client_user: str, experiment: str) -> str:
    """Creates ``experiment`` (as the admin) if it does not exist and gives ``client_user`` EDIT on it, replacing
    whatever permission the user had there (MANAGE, if a sweep created it); returns the experiment id."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    with logged_in(admin):
        found = MlflowClient(uri).get_experiment_by_name(experiment)
        if found is not None and found.lifecycle_stage != "active":
            raise UsersError(f"experiment {experiment!r} (id {found.experiment_id}) is deleted: restore it "
                             f"(MlflowClient.restore_experiment) or name the sweep's experiment differently")
        experiment_id = found.experiment_id if found else MlflowClient(uri).create_experiment(experiment)
        auth = _auth(uri)
        try:
            auth.grant_user_permission(client_user, "experiment", experiment_id, CLIENT_PERMISSION)
        except MlflowException as err:  # a grant exists (EDIT from an earlier run, MANAGE from creating it)
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            if auth.get_user_permission(client_user, "experiment", experiment_id).permission != CLIENT_PERMISSION:
                auth.revoke_user_permission(client_user, "experiment", experiment_id)
                auth.grant_user_permission(client_user, "experiment", experiment_id, CLIENT_PERMISSION)
    return experiment_id


def main(argv: list[str] | None = None) -> int:
    """Sets up the clients' user and its EDIT permissions; prints one line per step, ``error: ...`` on a problem."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiments", nargs="*", metavar="EXPERIMENT",
                        help="sweep experiments (a sweep's tracking.experiment, default its name) to give the "
                             "clients' user EDIT on")
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="the MLflow server (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--admin-env", type=Path, default=Path("~/.qed/mlflow-admin.env").expanduser(),
                        help=f"owner-only file with {' and '.join(ADMIN_KEYS)} (default: %(default)s)")
    parser.add_argument("--client-env", type=Path, default=Path("~/.qed/mlflow.env").expanduser(),
                        help=f"owner-only file with {' and '.join(CLIENT_KEYS)} (default: %(default)s)")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait this long for a server that is still starting")
    args = parser.parse_args(argv)
    try:
        if not (args.tracking_uri or "").startswith(("http://", "https://")):
            raise UsersError(f"--tracking-uri must be the MLflow server's http(s) URL, got {args.tracking_uri!r}")
        admin, client = read_login(args.admin_env, ADMIN_KEYS), read_login(args.client_env, CLIENT_KEYS)
        wait_until_up(args.tracking_uri, args.wait)
        print(f"clients' user {client.username!r}: {ensure_client(args.tracking_uri, admin, client)}")
        for name in args.experiments:
            experiment_id = grant_edit(args.tracking_uri, admin, client.username, name)
            print(f"experiment {name!r} (id {experiment_id}): {client.username!r} may {CLIENT_PERMISSION}")
    except UsersError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - MLflow's errors, imported only when one occurs
        from mlflow.exceptions import MlflowException

        if not isinstance(err, MlflowException):
            raise
        hint = ""
        if err.error_code == "UNAUTHENTICATED":  # the clients' login is checked without raising: the admin's
            hint = (f" (the login of {args.admin_env} was refused; a server keeps the admin its auth database "
                    f"was first created with)")
        print(f"error: {args.tracking_uri}: {err.error_code}{hint}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
