"""A real ``mlflow server --app-name basic-auth`` (slow): what the cluster configs run, set up as they are.

The server gets everything secret from its environment, as on the clusters (its admin login from a Secret or an
owner-only env file, the store URI from ``MLFLOW_BACKEND_STORE_URI``), never from argv. ``cluster/mlflow_users.py``
then creates the clients' user (the nodes' login) with EDIT on a sweep experiment, from owner-only files. Anonymous
or wrong-password writes are refused with 401, reads too; the project's Tracker logs a sweep as the clients' user,
which gets 403 for everything administrative: creating users, changing permissions, deleting the experiment,
writing elsewhere. One server serves the whole module.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from kit import cmdline, descendants, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cluster"))
import mlflow_users  # noqa: E402

pytestmark = pytest.mark.slow
MLFLOW = str(Path(sys.executable).with_name("mlflow"))
ADMIN, CLIENT, EXPERIMENT = "qed-admin", "qed-client", "sweep-exp"


def _request(url: str, method: str = "GET", body: bytes | None = None, auth: tuple[str, str] | None = None) -> int:
    """HTTP status of one request (with basic auth when given)."""
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers, method=method),
                                    timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except urllib.error.URLError:
        return -1


def _owner_only(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One basic-auth server on a free localhost port, its stores in a temp dir, its admin login in its environment
    only; then the clients' user and its EDIT on EXPERIMENT, set up by cluster/mlflow_users.py as the admin."""
    tmp = tmp_path_factory.mktemp("mlflow_auth")
    password, client_password = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    ini = tmp / "basic_auth.ini"
    ini.write_text("[mlflow]\ndefault_permission = READ\n"
                   f"database_uri = sqlite:///{tmp / 'auth.db'}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_AUTH_ADMIN_USERNAME=ADMIN, MLFLOW_AUTH_ADMIN_PASSWORD=password,
               MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16),
               MLFLOW_BACKEND_STORE_URI=f"sqlite:///{tmp / 'mlflow.db'}")
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([MLFLOW, "server", "--app-name", "basic-auth", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--artifacts-destination", str(tmp / "artifacts")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while _request(f"{url}/health") != 200:
            assert proc.poll() is None and time.time() < deadline, (tmp / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        files = SimpleNamespace(
            admin=_owner_only(tmp / "admin.env", f"MLFLOW_AUTH_ADMIN_USERNAME={ADMIN}\n"
                                                 f"MLFLOW_AUTH_ADMIN_PASSWORD={password}\n"),
            client=_owner_only(tmp / "client.env", f"MLFLOW_TRACKING_USERNAME={CLIENT}\n"
                                                   f"MLFLOW_TRACKING_PASSWORD={client_password}\n"))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = mlflow_users.main(["--tracking-uri", url, "--admin-env", str(files.admin), "--client-env",
                                    str(files.client), EXPERIMENT])
        yield SimpleNamespace(url=url, password=password, client_password=client_password, tmp=tmp, pid=proc.pid,
                              files=files, setup=(rc, out.getvalue().splitlines()))
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)  # the server and its uvicorn workers (own session)
                proc.wait(timeout=3)  # its stores are thrown away: no need to wait out a slow shutdown
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


CREATE = "/api/2.0/mlflow/experiments/create"
SEARCH = "/api/2.0/mlflow/experiments/search"
PLANT = "/api/2.0/mlflow-artifacts/artifacts/planted/evil.txt"


def test_the_clients_user_is_set_up_by_the_admin_tool(server):
    assert server.setup == (0, [f"clients' user '{CLIENT}': created",
                                f"experiment '{EXPERIMENT}' (id 1): '{CLIENT}' may EDIT"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # again, as every `ray up` does: nothing to change
        assert mlflow_users.main(["--tracking-uri", server.url, "--admin-env", str(server.files.admin),
                                  "--client-env", str(server.files.client)]) == 0
    assert out.getvalue() == f"clients' user '{CLIENT}': unchanged\n"


def test_writes_and_reads_without_valid_credentials_are_refused(server):
    body = json.dumps({"name": "intruder"}).encode()
    assert _request(server.url + CREATE, "POST", body) == 401
    assert _request(server.url + CREATE, "POST", body, auth=(CLIENT, "wrong-" + server.client_password)) == 401
    assert _request(server.url + CREATE, "POST", body, auth=("admin", "password1234")) == 401  # old MLflow default
    assert _request(server.url + PLANT, "PUT", b"planted") == 401
    assert _request(server.url + SEARCH + "?max_results=10") == 401
    assert not (server.tmp / "artifacts" / "planted").exists()
    # ...while the right credentials pass (and the health probe needs none).
    assert _request(server.url + SEARCH + "?max_results=10", auth=(CLIENT, server.client_password)) == 200


def test_tracker_logs_through_the_server_with_env_credentials(server, monkeypatch, tmp_path):
    from mlflow.exceptions import MlflowException

    from qed_ray.service.mlflow.tracking import Tracker

    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(MlflowException, match="401|Unauthorized|credentials"):
        Tracker(server.url, "authz", "sweep-1")

    # The nodes' login: the clients' user, on the experiment the admin tool gave it.
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", CLIENT)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.client_password)
    tracker = Tracker(server.url, EXPERIMENT, "sweep-1")
    tracker.mark_training_experiment()
    parent = tracker.parent_run("authz", {"a": {"b": 1}}, {"qed.git_sha": "abc"})
    trial = tracker.trial_run(parent, "cartpole-balance/sac_ln/te/0", {"seed": 0})
    tracker.log_metrics(trial, {"eval/return_mean": 12.5, "flag": True}, step=1000)
    tracker.log_metrics(trial, {"eval/return_mean": 20.0}, step=2000)
    (tmp_path / "spec.yaml").write_text("name: authz\n")
    tracker.log_artifact(parent, tmp_path / "spec.yaml", "spec")
    tracker.end_run(trial)
    assert tracker.parent_run("authz", {}, {}) == parent  # a resumed sweep reopens its run

    assert tracker.client.get_experiment(tracker.experiment_id).tags["mlflow.experimentKind"] == \
        "custom_model_development"
    assert tracker.last_step(trial, "eval/return_mean") == 2000
    history = tracker.client.get_metric_history(trial, "eval/return_mean")
    assert sorted((m.step, m.value) for m in history) == [(1000, 12.5), (2000, 20.0)]
    assert tracker.client.get_run(trial).info.status == "FINISHED"
    assert tracker.tags(trial)["qed.trial"] == "cartpole-balance/sac_ln/te/0"
    # The artifact went through the server (proxied store), not to a client-side path.
    assert [f.path for f in tracker.client.list_artifacts(parent, "spec")] == ["spec/spec.yaml"]
    assert [p.read_text() for p in (server.tmp / "artifacts").rglob("spec.yaml")] == ["name: authz\n"]


@pytest.fixture()
def as_client(server, monkeypatch):
    """This process logged in as the clients' user (the nodes' login)."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", CLIENT)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.client_password)


def _refused(call) -> tuple[str, int]:
    """(MLflow error code, HTTP status) of a call the server refuses."""
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException) as err:
        call()
    return err.value.error_code, err.value.get_http_status_code()


@pytest.mark.filterwarnings("ignore:starlette.middleware.wsgi is deprecated")  # mlflow.server's own import
def test_the_clients_user_cannot_administer_mlflow(server, as_client):
    """What a trial could do with the nodes' login beyond its sweep: nothing. Each is refused with 403."""
    from mlflow.server import get_app_client
    from mlflow.tracking import MlflowClient

    auth, client = get_app_client("basic-auth", tracking_uri=server.url), MlflowClient(server.url)
    sweep = client.get_experiment_by_name(EXPERIMENT).experiment_id
    denied = ("PERMISSION_DENIED", 403)
    assert _refused(lambda: auth.create_user("intruder", secrets.token_urlsafe(18))) == denied
    assert _refused(lambda: auth.update_user_admin(CLIENT, True)) == denied
    assert _refused(lambda: auth.grant_user_permission(CLIENT, "experiment", sweep, "MANAGE")) == denied
    assert _refused(lambda: auth.grant_user_permission(CLIENT, "experiment", "0", "EDIT")) == denied
    assert _refused(lambda: auth.update_user_password(ADMIN, secrets.token_urlsafe(18))) == denied
    assert _refused(lambda: client.delete_experiment(sweep)) == denied
    assert _refused(lambda: client.create_run("0")) == denied  # the Default experiment: READ only
    assert auth.get_user_permission(CLIENT, "experiment", sweep).permission == "EDIT"
    assert not auth.get_user(CLIENT).is_admin
    assert client.get_experiment(sweep).lifecycle_stage == "active"


@pytest.mark.filterwarnings("ignore:starlette.middleware.wsgi is deprecated")
def test_an_experiment_the_clients_created_is_brought_down_to_edit(server, as_client):
    """A sweep whose experiment nobody named first creates it itself and manages it; naming it to the admin tool
    afterwards leaves the clients' user EDIT there, and the sweep goes on logging."""
    from mlflow.server import get_app_client
    from mlflow.tracking import MlflowClient

    auth, client = get_app_client("basic-auth", tracking_uri=server.url), MlflowClient(server.url)
    own = client.create_experiment("unnamed-sweep")
    assert auth.get_user_permission(CLIENT, "experiment", own).permission == "MANAGE"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mlflow_users.main(["--tracking-uri", server.url, "--admin-env", str(server.files.admin),
                                  "--client-env", str(server.files.client), "unnamed-sweep"]) == 0
    assert out.getvalue().splitlines()[-1] == f"experiment 'unnamed-sweep' (id {own}): '{CLIENT}' may EDIT"
    assert auth.get_user_permission(CLIENT, "experiment", own).permission == "EDIT"
    assert _refused(lambda: client.delete_experiment(own)) == ("PERMISSION_DENIED", 403)
    client.set_terminated(client.create_run(own).info.run_id)


def test_the_clients_password_is_rotated_from_its_file(server):
    """cluster/README.md, "Rotating credentials": a new password in the clients' file, the tool run again."""
    new = secrets.token_urlsafe(18)
    server.files.client.write_text(f"MLFLOW_TRACKING_USERNAME={CLIENT}\nMLFLOW_TRACKING_PASSWORD={new}\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert mlflow_users.main(["--tracking-uri", server.url, "--admin-env", str(server.files.admin),
                                  "--client-env", str(server.files.client)]) == 0
    assert out.getvalue() == f"clients' user '{CLIENT}': password updated\n"
    assert _request(server.url + SEARCH + "?max_results=1", auth=(CLIENT, server.client_password)) == 401
    assert _request(server.url + SEARCH + "?max_results=1", auth=(CLIENT, new)) == 200
    server.client_password = new


def test_no_secret_reaches_a_command_line(server):
    """What `ps` shows of the server and its workers: no password, no store URI (read from the environment)."""
    lines = [cmdline(pid) for pid in sorted({server.pid} | descendants(server.pid))]
    assert any("basic-auth" in line for line in lines), lines
    assert not any(server.password in line for line in lines)
    assert not any("mlflow.db" in line or "auth.db" in line for line in lines), lines


@pytest.mark.filterwarnings("ignore:starlette.middleware.wsgi is deprecated")  # mlflow.server's own import
def test_password_rotation_as_documented(server, monkeypatch):
    """cluster/README.md, "Rotating credentials": the admin changes its own password through the auth API; the old
    one is refused from then on. (Last in this module: it changes the server's password.)"""
    from mlflow.server import get_app_client

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", server.password)
    new = secrets.token_urlsafe(18)
    get_app_client("basic-auth", tracking_uri=server.url).update_user_password(
        ADMIN, new, current_password=os.environ["MLFLOW_TRACKING_PASSWORD"])
    assert _request(server.url + SEARCH + "?max_results=1", auth=(ADMIN, server.password)) == 401
    assert _request(server.url + SEARCH + "?max_results=1", auth=(ADMIN, new)) == 200


def test_a_sweep_start_finds_the_server_and_refuses_its_password_in_a_uri(server):
    """The start's probe: the health endpoint needs no login, so a basic-auth server counts as there; a URI that
    carries the clients' password is refused with it masked (the login belongs in the environment)."""
    from qed_ray.service.mlflow.tracking_uri import check_uri, unreachable
    from qed_ray.spec.sweep import SpecError

    assert unreachable(server.url) is None
    host = server.url.split("://", 1)[1]
    with pytest.raises(SpecError) as e:
        check_uri(f"http://{CLIENT}:{server.client_password}@{host}", "MLFLOW_TRACKING_URI")
    assert str(e.value).startswith(f"MLFLOW_TRACKING_URI: 'http://***@{host}' carries credentials")
    assert server.client_password not in str(e.value) and "MLFLOW_TRACKING_PASSWORD" in str(e.value)
