"""Inputs that must be bounded before anything starts: tracking URIs (scheme, credentials, a server that answers),
replay memory per trial and per pack, storage paths that are URIs or files, and a CUDA device this torch lacks.
Each refusal is one ``error:`` line naming its field, exit 2, with nothing created; a password never appears in
any output."""

import json
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from qed_ray.spec.replay_memory import MAX_PACK_REPLAY_BYTES, MAX_TRIAL_REPLAY_BYTES, replay_needs
from qed_ray.rl.replay import Replay
from qed_ray.service.mlflow.tracking_uri import check_uri, masked, unreachable
from qed_ray.spec.sweep import SpecError, SweepSpec
from qed_ray.spec.tasks import TASK_DIMS, TASKS
from kit import flat, free_port

ROOT = Path(__file__).parents[2]
BASE = {"name": "s", "tasks": ["cartpole-balance"], "seeds": 2,
        "agents": [{"name": "sac_ln", "overrides": {"hidden": 16}, "temperatures": [{"kind": "te"}]}],
        "train": {"env_steps": 2000, "eval_every": 1000, "warmup_decisions": 100}}
SECRET = "s3cr3t-Pa55"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a CUDA device")


@pytest.fixture
def cli(monkeypatch, tmp_path, capsys):
    """Runs ``python -m qed_ray.sweep`` in-process with its storage in ``tmp_path/results``; returns
    ``(exit code, stderr, stdout)``."""
    for key in ("QED_STORAGE_PATH", "QED_STORAGE_ROOT", "RAY_JOB_CONFIG_JSON_ENV_VAR", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TUNE_DISABLE_SIGINT_HANDLER", "0")  # restored after the test (main() sets it)
    monkeypatch.setenv("RAY_AIR_NEW_OUTPUT", "0")
    from qed_ray.service.sweep_cli import main

    def run(spec: dict, *flags: str):
        path = tmp_path / f"spec-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump({"storage_path": str(tmp_path / "results"), **spec}))
        capsys.readouterr()
        code = main([str(path), *flags])
        out = capsys.readouterr()
        return code, out.err, out.out

    return run


# ---- tracking URIs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("uri, says", [
    ("htp://head:5000", "'htp://head:5000' has unknown scheme 'htp' (did you mean 'http'?); use http(s)://host:port"),
    ("mlruns", "'mlruns' has no scheme; use http(s)://host:port"),
    ("sqlite:///mlflow.db", "'sqlite:///mlflow.db' is not an absolute SQLite path (sqlite:/// and then a relative "
                            "path; a Ray trial runs in another folder); use sqlite:////abs/path/mlflow.db"),
    ("file:mlruns", "'file:mlruns' is not an absolute local path; use file:///abs/path"),
    ("http://:5000", "'http://:5000' names no host"),
    ("http://head:50x0", "'http://head:50x0' is not a valid URI (Port could not be cast to integer value as '50x0')"),
    (f"http://qed:{SECRET}@head:5000", "'http://***@head:5000' carries credentials, which would be printed and stored "
                                      "with the sweep; give the URI without them and set MLFLOW_TRACKING_USERNAME "
                                      "and MLFLOW_TRACKING_PASSWORD instead"),
    (f"https://qed:{SECRET}/x@y@head", "'https://***@head' carries credentials"),
    (f"postgresql://qed:{SECRET}@db/mlflow", "'postgresql://***@db/mlflow' carries credentials, which would be "
                                             "printed and stored with the sweep; give the URI without them and give "
                                             "the password in the driver's password file (PostgreSQL: ~/.pgpass)"),
    (f"postgresql://db/mlflow?sslmode=require&password={SECRET}",  # as a query parameter
     "'postgresql://db/mlflow?***' carries a credential in its query string (password=...), which would be printed "
     "and stored with the sweep; give the URI without it and the password in the driver's password file"),
    (f"http://head:5000/?Access_Token={SECRET}", "'http://head:5000/?***' carries a credential in its query string "
                                                 "(Access_Token=...)"),
])
def test_bad_tracking_uris_are_refused_naming_the_field_and_masking_the_password(uri, says):
    with pytest.raises(SpecError) as e:
        check_uri(uri, "tracking.uri")
    assert str(e.value).startswith(f"tracking.uri: {says}") and SECRET not in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("uri", ["http://head:5000", "https://mlflow.example.org/", "sqlite:////abs/mlflow.db",
                                 "file:///abs/mlruns", "postgresql+psycopg2://qed@db:5432/mlflow",
                                 "mysql://db/mlflow"])
def test_usable_tracking_uris_pass(uri):
    check_uri(uri, "tracking.uri")
    assert masked(uri) == (uri.replace("qed@", "***@") if "@" in uri else uri)


def test_a_query_string_is_masked_where_a_uri_is_shown():
    check_uri("postgresql://db/mlflow?sslmode=require", "tracking.uri")  # no credential in it: usable
    assert masked("postgresql://db/mlflow?sslmode=require") == "postgresql://db/mlflow?***"


@pytest.mark.parametrize("source", ["spec", "env"])
@pytest.mark.parametrize("flags", [("--dry-run",), ()])
def test_a_uri_with_a_password_is_refused_and_the_password_is_never_shown_or_stored(cli, monkeypatch, tmp_path,
                                                                                     source, flags):
    uri = f"http://qed:{SECRET}@127.0.0.1:{free_port()}"
    if source == "env":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    code, err, out = cli({**BASE, **({"tracking": {"uri": uri}} if source == "spec" else {})}, *flags)
    field = "tracking.uri" if source == "spec" else "MLFLOW_TRACKING_URI"
    assert code == 2 and err.splitlines() == [
        f"error: {field}: 'http://***@127.0.0.1:{uri.rsplit(':', 1)[1]}' carries credentials, which would be printed "
        f"and stored with the sweep; give the URI without them and set MLFLOW_TRACKING_USERNAME and "
        f"MLFLOW_TRACKING_PASSWORD instead"]
    assert SECRET not in err + out
    assert not (tmp_path / "results").exists(), "no folder, so no MLflow store and no parameter holds it"


def test_an_unreachable_server_fails_a_start_in_one_line_and_warns_a_dry_run(cli, tmp_path):
    import ray

    uri = f"http://127.0.0.1:{free_port()}"
    code, err, out = cli({**BASE, "tracking": {"uri": uri}})
    assert code == 2 and err.splitlines() == [
        f"error: tracking.uri: nothing answers at {uri} within 5 s (ConnectionRefusedError: [Errno 111] Connection "
        f"refused); start the tracking server or correct the URI"], err
    assert not (tmp_path / "results").exists() and not ray.is_initialized(), "refused before the folder and Ray"
    code, err, out = cli({**BASE, "tracking": {"uri": uri}}, "--dry-run")
    assert code == 0 and err.splitlines() == [
        f"warning: tracking.uri: nothing answers at {uri} within 5 s (ConnectionRefusedError: [Errno 111] Connection "
        f"refused); a start from here would be refused (fine if the address is reachable only from the cluster's "
        f"head)"], err
    assert f"(MLflow {uri}, experiment s)" in flat(out) and not (tmp_path / "results").exists()


class _Refuses(BaseHTTPRequestHandler):
    """A server that answers every request with 401 (a login it wants): it is there all the same."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(401)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_any_http_answer_or_a_database_port_counts_as_reachable():
    server = HTTPServer(("127.0.0.1", 0), _Refuses)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        assert unreachable(f"http://127.0.0.1:{server.server_port}") is None
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as db:
        db.bind(("127.0.0.1", 0))
        db.listen(1)
        assert unreachable(f"postgresql://qed@127.0.0.1:{db.getsockname()[1]}/mlflow") is None
    port = free_port()
    assert unreachable(f"mysql://127.0.0.1:{port}/mlflow", timeout_s=1) == (
        f"nothing answers at mysql://127.0.0.1:{port}/mlflow within 1 s (ConnectionRefusedError: [Errno 111] "
        f"Connection refused)")
    assert unreachable("sqlite:////nowhere/mlflow.db") is None, "a local store is not probed"


# ---- replay memory ---------------------------------------------------------------------------------------------
def test_task_dims_are_the_envs_sizes():
    measured = json.loads((ROOT / "benchmarks" / "env_costs.json").read_text())["tasks"]
    assert set(TASK_DIMS) == set(TASKS) == set(measured)
    assert TASK_DIMS == {t: (m["obs_dim"], m["action_dim"]) for t, m in measured.items()}
    from qed_ray.rl.envs import make_env

    env = make_env("quadruped-run", seed=0)  # the largest (and a measured file could be stale)
    assert (env.obs_dim, env.action_dim) == TASK_DIMS["quadruped-run"] == (78, 12)
    env.close()


def test_the_estimate_is_the_bytes_the_replay_allocates():
    spec = SweepSpec.model_validate({**BASE, "tasks": ["cheetah-run"], "seeds": 3, "pack": {"seeds": 3}})
    (need,) = spec.replay_needs()
    assert (need.task, need.capacity, need.width, need.seeds) == ("cheetah-run", 1000, 42, 3)
    replay = Replay(need.capacity, *TASK_DIMS["cheetah-run"], [np.random.default_rng(s) for s in range(3)], "cpu")
    assert replay.storage.nbytes == need.per_pack == 3 * need.per_trial == 3 * 1000 * 42 * 4


def test_1e10_env_steps_are_refused_with_the_estimate(cli, tmp_path):
    spec = {**BASE, "tasks": ["cartpole-balance", "quadruped-run"], "train": {"env_steps": 10**10}}
    for flags in (("--dry-run",), ()):
        code, err, _ = cli(spec, *flags)
        assert code == 2 and err.splitlines() == [
            "error: train.env_steps: a trial's replay would hold 3.1 TiB (quadruped-run: 5,000,000,000 transitions x "
            "170 floats), over the 16.0 GiB a trial may hold; lower train.env_steps, or set train.replay_capacity to "
            "at most 25,264,513 transitions per seed"], err
    assert 25_264_513 * 170 * 4 <= MAX_TRIAL_REPLAY_BYTES < 25_264_514 * 170 * 4
    assert not (tmp_path / "results").exists()
    # the same run with the paper's FIFO bound fits
    code, err, out = cli({**spec, "train": {"env_steps": 10**10, "replay_capacity": 10**6}}, "--dry-run")
    assert code == 0, err
    assert ("replay: up to 648.5 MiB per trial (quadruped-run: 1,000,000 transitions x 170 floats), 648.5 MiB per "
            "pack of 1; caps 16.0 GiB per trial, 64.0 GiB per pack") in flat(out)


def test_a_pack_past_its_cap_is_refused_naming_pack_seeds(cli):
    spec = {**BASE, "tasks": ["quadruped-run"], "seeds": 10, "pack": {"seeds": 10},
            "train": {"env_steps": 30_000_000, "eval_every": 20_000}}
    code, err, _ = cli(spec, "--dry-run")
    assert code == 2 and err.splitlines() == [
        "error: pack.seeds: a pack's replay would hold 95.0 GiB (10 seeds x quadruped-run: 15,000,000 transitions x "
        "170 floats), over the 64.0 GiB a pack may hold; pack fewer seeds, or lower train.env_steps, or set "
        "train.replay_capacity to at most 10,105,805 transitions per seed"], err
    assert 10 * 10_105_805 * 170 * 4 <= MAX_PACK_REPLAY_BYTES < 10 * 10_105_806 * 170 * 4
    code, err, out = cli({**spec, "pack": {"seeds": 5}}, "--dry-run")
    assert code == 0 and "replay: up to 9.5 GiB per trial (quadruped-run: 15,000,000 transitions x 170 floats), " \
                          "47.5 GiB per pack of 5;" in flat(out), err


def test_the_largest_need_comes_first_over_tasks_and_train_axes():
    needs = replay_needs([("cartpole-balance", SweepSpec.model_validate(BASE).train_specs()[0]),
                          *[(t, tr) for t in ("walker-walk", "cheetah-run")
                            for tr in SweepSpec.model_validate({**BASE, "train": {**BASE["train"], "env_steps": [
                                2000, 4000]}}).train_specs()]], pack_seeds=2)
    assert [(n.task, n.capacity, n.per_pack) for n in needs] == [
        ("walker-walk", 2000, 2 * 2000 * 56 * 4), ("cheetah-run", 2000, 2 * 2000 * 42 * 4),
        ("walker-walk", 1000, 2 * 1000 * 56 * 4), ("cheetah-run", 1000, 2 * 1000 * 42 * 4),
        ("cartpole-balance", 1000, 2 * 1000 * 13 * 4)]


def test_the_run_cli_refuses_a_replay_past_its_cap_before_writing(tmp_path, capsys):
    from qed_ray.rl.run import main

    out = tmp_path / "run"
    assert main(["--task", "quadruped-run", "--seeds", "0", "1", "2", "3", "4", "5", "--env-steps", "40000000",
                 "--eval-every", "20000", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --seeds: a pack's replay would hold 76.0 GiB (6 seeds x quadruped-run: 20,000,000 transitions x 170 "
        "floats), over the 64.0 GiB a pack may hold; pack fewer seeds, or lower train.env_steps, or set "
        "train.replay_capacity to at most 16,843,009 transitions per seed"]
    assert not out.exists()


# ---- storage paths -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["file:/tmp/qed", "s3:bucket/qed", "gs://bucket/qed"])
def test_a_storage_path_with_a_scheme_is_refused_by_the_dry_run_and_the_start(cli, tmp_path, monkeypatch, storage):
    monkeypatch.chdir(tmp_path)
    for flags in (("--dry-run",), ()):
        code, err, _ = cli({**BASE, "storage_path": storage}, *flags)
        assert code == 2 and err.splitlines() == [
            f"error: storage_path: {storage!r} is a URI; give a filesystem path (on a cluster: a shared mount such as "
            f"EFS/NFS, Filestore or a ReadWriteMany volume, mounted at the same path on every node)"], err
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == [], "no folder named 'file:' or 's3:'"


@pytest.mark.parametrize("under", ["", "deeper/still"])
def test_a_storage_path_that_is_a_file_is_refused_by_the_dry_run(cli, tmp_path, under):
    blocker = tmp_path / "results.txt"
    blocker.write_text("notes")
    storage = blocker / under if under else blocker
    for flags in (("--dry-run",), ()):
        code, err, _ = cli({**BASE, "storage_path": str(storage)}, *flags)
        assert code == 2 and err.splitlines() == [
            f"error: storage_path: {str(storage)!r} resolves to {storage}, but {blocker} is a file, not a folder; "
            f"give a folder (or a path that does not exist yet)"], err
    assert blocker.read_text() == "notes"


# ---- devices ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, says", [
    ({"train": {**BASE["train"], "device": "cuda"}},
     "error: train.device: 'cuda' needs a GPU, but resources.gpu is 0 (the trials run on CPUs); set resources.gpu "
     "(1, or 0.5 to share a GPU), or train.device: auto"),
    ({"train": {**BASE["train"], "device": ["cpu", "cuda:1"]}, "resources": {"gpu": 0.5}},
     "error: train.device: 'cuda:1': a trial sees only the GPU Ray assigns it, as cuda:0; use 'cuda' or 'auto'"),
])
def test_a_sweep_refuses_a_cuda_device_its_trials_cannot_have(cli, changes, says):
    code, err, _ = cli({**BASE, **changes}, "--dry-run")
    assert code == 2 and err.splitlines() == [says], err


@NO_CUDA
def test_device_cuda_on_a_torch_without_cuda_is_one_line(tmp_path, capsys):
    from qed_ray.rl.run import main
    from qed_ray.rl.trainer import DeviceError, build_trainer
    from qed_ray.spec.config import RunSpec

    out = tmp_path / "run"
    assert main(["--task", "cartpole-balance", "--env-steps", "2000", "--eval-every", "1000", "--warmup-decisions",
                 "100", "--device", "cuda", "--out", str(out)]) == 2
    why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None else
           "no CUDA device is visible to this process")
    line = (f"train.device: 'cuda' asks for CUDA, but {why}; use 'auto' (CUDA when available, else CPU) or 'cpu' "
            f"(--device on the command line)")
    assert capsys.readouterr().err.splitlines() == [f"error: {line}"]
    assert not out.exists()
    # a sweep trial builds its run through the same call: its failure is that line
    spec = RunSpec.model_validate({"task": "cartpole-balance", "train": {"device": "cuda"}})
    with pytest.raises(DeviceError) as e:
        build_trainer([spec], lambda m, s: None, None, log=lambda s: None)
    assert str(e.value) == line
