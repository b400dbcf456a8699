"""`ray job submit --working-dir . -- python -m qed_ray.sweep SPEC` against a real `ray start --head` (slow)."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from qed_ray.layout import SweepDir
from sweep_helpers import ROOT, cli_env, sweep_runs, tiny_spec

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_job_submit_runs_the_sweep_where_the_spec_says(tmp_path):
    spec = tiny_spec(tmp_path, "job", seeds=1)
    temp_dir = tempfile.mkdtemp(prefix="qj", dir="/tmp")  # short: unix socket paths are length-limited
    dash = _free_port()
    # The same auth mode on the head and on the job client (Ray 2.60 enables token auth by default).
    env = cli_env(PATH=f"{BIN}:{os.environ['PATH']}")
    try:
        subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={_free_port()}", "--num-cpus=2",
                        f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                        f"--dashboard-port={dash}", "--disable-usage-stats",
                        # explicit free ports: another cluster's agent may hold the defaults (52365, ...)
                        f"--dashboard-agent-listen-port={_free_port()}",
                        f"--dashboard-agent-grpc-port={_free_port()}",
                        f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}"],
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
    finally:
        _kill_cluster(temp_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout and "IQM" in proc.stdout
    sweep_dir = tmp_path / "results" / "job"  # where the spec's absolute storage_path says
    results = json.loads(SweepDir(sweep_dir).results_json.read_text())
    assert [(g["task"], g["variant"], g["seeds"]) for g in results["groups"]] == [("cartpole-balance", "te", [0])]
    _, runs = sweep_runs(sweep_dir, "job")
    assert sorted(r.data.tags["qed.role"] for r in runs) == ["sweep", "trial"]
    assert all(r.info.status == "FINISHED" for r in runs)
