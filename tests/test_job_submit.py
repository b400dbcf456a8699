"""`ray job submit --working-dir . -- python -m qed_ray.sweep SPEC` against a real `ray start --head` (slow).

A spec with a relative `storage_path` is refused there (its folder would be Ray's per-job package cache).

The head runs with token auth (the session's throwaway token from conftest.py), as the clusters in cluster/ do; the
same cluster also shows that the job API and the GCS refuse a client without the right token.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from qed_ray.layout import SweepDir
from kit import free_port
from sweep_helpers import ROOT, cli_env, sweep_runs, tiny_spec

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _kill_cluster(temp_dir: str) -> None:
    """Stops only the processes of this test's cluster (a bare `ray stop` would hit other clusters too)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    for line in out.splitlines()[1:]:
        pid, _, args = line.strip().partition(" ")
        if temp_dir in args and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _http_status(url: str, token: str | None) -> int:
    """The status of a GET on the job API, with or without the bearer token."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


CONNECT = "import ray; ray.init(address=%r, logging_level='ERROR'); print('connected')"


def _refusals(env: dict, dash: int, gcs: int) -> dict:
    """What the running cluster answers to clients with no token, a wrong token and the right one."""
    jobs = f"http://127.0.0.1:{dash}/api/jobs/"
    wrong = dict(env, RAY_AUTH_TOKEN="0" * 64)
    gcs_wrong = subprocess.run([sys.executable, "-c", CONNECT % f"127.0.0.1:{gcs}"], env=wrong,
                               capture_output=True, text=True, timeout=120)
    return {"http_none": _http_status(jobs, None), "http_wrong": _http_status(jobs, "0" * 64),
            "http_right": _http_status(jobs, env["RAY_AUTH_TOKEN"]), "gcs_wrong": gcs_wrong}


def test_job_submit_runs_the_sweep_where_the_spec_says(tmp_path):
    spec = tiny_spec(tmp_path, "job", seeds=1)
    temp_dir = tempfile.mkdtemp(prefix="qj", dir="/tmp")  # short: unix socket paths are length-limited
    dash, gcs = free_port(), free_port()
    # Token auth on the head and on the job client, with the session's throwaway token (never auth disabled: Ray
    # binds these ports on every interface).
    env = cli_env(PATH=f"{BIN}:{os.environ['PATH']}")
    try:
        subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={gcs}", "--num-cpus=2",
                        f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={dash}", "--disable-usage-stats",
                        # explicit free ports: another cluster's agent may hold the defaults (52365, ...)
                        f"--dashboard-agent-listen-port={free_port()}",
                        f"--dashboard-agent-grpc-port={free_port()}",
                        f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}"],
                       env=env, check=True, capture_output=True, text=True, timeout=120)
        for _ in range(4):
            proc = subprocess.run(
                [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir", ".",
                 "--", "python", "-m", "qed_ray.sweep", str(spec)],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            # On a loaded machine the head's job agent can still be starting; only that is retried.
            if "agent" not in proc.stdout + proc.stderr:
                break
            time.sleep(10)
        refused = _refusals(env, dash, gcs)
        # A relative storage_path would land in Ray's per-job package cache (the job's working folder): refused.
        relative = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--working-dir", ".",
             "--", "python", "-m", "qed_ray.sweep", str(tiny_spec(tmp_path, "jobrel", seeds=1,
                                                                   storage_path="results"))],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        _kill_cluster(temp_dir)
    # Without the cluster's token nobody gets in: not the job API (remote code execution by design), not the GCS.
    assert (refused["http_none"], refused["http_wrong"], refused["http_right"]) == (401, 403, 200), refused
    assert refused["gcs_wrong"].returncode != 0 and "connected" not in refused["gcs_wrong"].stdout
    assert "authentication" in refused["gcs_wrong"].stderr.lower(), refused["gcs_wrong"].stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout and "IQM" in proc.stdout
    assert relative.returncode != 0 and "error: storage_path: 'results' is relative, and this driver runs as a Ray " \
        "job whose working folder is Ray's per-job package cache" in relative.stdout, relative.stdout[-3000:]
    sweep_dir = tmp_path / "results" / "job"  # where the spec's absolute storage_path says
    results = json.loads(SweepDir(sweep_dir).results_json.read_text())
    assert [(g["task"], g["variant"], g["seeds"]) for g in results["groups"]] == [("cartpole-balance", "te", [0])]
    _, runs = sweep_runs(sweep_dir, "job")
    assert sorted(r.data.tags["qed.role"] for r in runs) == ["sweep", "trial"]
    assert all(r.info.status == "FINISHED" for r in runs)
