"""The README's local recipe (`ray start --head`, `ray job submit --working-dir . --runtime-env-json ...`) run as
written, against a real head (slow).

The recipe's lines run in one bash, in order, from a copy of the repository whose `sweeps/smoke.yaml` is a tiny spec
(the shipped name, so that the lines need no change) and whose `.venv` is this venv. The test changes only what would
collide with other Ray instances on the machine: `ray start --head` gets free ports, the recipe's private temp folder
(`mktemp -d`, mode 0700) is made inside the test's own, and the job API's address follows the dashboard's port; the
head's session and the job packages it unpacks are found inside that 0700 folder. While the job runs, the `--status
--dir` command its driver prints first runs in another process (none of the job's variables set) and reports the
running sweep; afterwards the results folder and the MLflow runs are where the README says. The same head then
refuses, naming the job's folder and the `--runtime-env-json` line, the submission that leaves the storage root out
(`QED_STORAGE_ROOT` exported in the submitting shell does not reach the job).

The head runs with token auth (the session's throwaway token from conftest.py), as the clusters in cluster/ do; the
same cluster also shows that the job API and the GCS refuse a client without the right token.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from qed_ray.records.layout import SweepDir
from kit import flat, free_port
from ray_cluster import kill_processes_naming
from qed_ray.service.sweep_state import RUNTIME_ENV_JSON
from sweep_helpers import ROOT, cli_env, sweep_runs, tiny_spec

pytestmark = pytest.mark.slow


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


def _readme_recipe() -> tuple[str, str]:
    """The README's local recipe and its `--status` line for another shell (section "On a local Ray head")."""
    section = (ROOT / "README.md").read_text().split("\n### On a local Ray head (`ray job submit`)\n", 1)[1]
    recipe, status = re.findall(r"```bash\n(.*?)\n```", section.split("\n### ", 1)[0], re.S)[:2]
    return recipe, status


def _clone(tmp_path: Path) -> Path:
    """The repository as a user has it, for the recipe: the code, `.rayignore`, a tiny `sweeps/smoke.yaml` (relative
    storage_path, as the shipped one), and `.venv` (this venv)."""
    clone = tmp_path / "repo"
    shutil.copytree(ROOT / "qed_ray", clone / "qed_ray", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".rayignore", clone / ".rayignore")
    (clone / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    (clone / "sweeps").mkdir()
    tiny_spec(clone / "sweeps", "smoke", seeds=1, storage_path="results")
    return clone


def _fresh_shell() -> dict:
    """A shell's environment before the recipe: nothing of this venv on PATH, no Ray auth mode, and the session's
    throwaway token (standing in for ~/.ray/auth_token, which the test never writes)."""
    env = cli_env()
    env.pop("RAY_AUTH_MODE")
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) != Path(sys.prefix, "bin"))
    env.pop("VIRTUAL_ENV", None)
    return env


def _submit(script: str, clone: Path, env: dict, on_status) -> tuple[int, str]:
    """Runs ``script`` in bash from the clone, following its output; calls ``on_status(command)`` once with the
    `--status` command the driver prints first. Returns the exit code and the output."""
    proc = subprocess.Popen(["bash", "-ec", script], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "progress from any shell: " in line:
            on_status(line.split("progress from any shell: ", 1)[1].strip())
    return proc.wait(timeout=900), "".join(lines)


def test_the_readme_local_recipe_runs_the_sweep_and_status_follows_it(tmp_path):
    recipe, readme_status = _readme_recipe()
    clone, env = _clone(tmp_path), _fresh_shell()
    temp_dir = tempfile.mkdtemp(prefix="qj", dir="/tmp")  # short: unix socket paths are length-limited
    dash, gcs = free_port(), free_port()
    # Only what collides with other Ray instances changes: explicit free ports (another cluster's agent may hold the
    # defaults: 8265, 52365, ...), and the recipe's private temp folder is made inside this test's (to be found and
    # cleaned up).
    isolated = (f"ray start --head --num-cpus=2 --include-dashboard=true "
                f"--dashboard-host=127.0.0.1 --disable-usage-stats --dashboard-agent-grpc-port={free_port()} "
                f"--runtime-env-agent-port={free_port()} --metrics-export-port={free_port()}")
    ports = "RAY_PORT=6379 DASHBOARD_PORT=8265 AGENT_PORT=52365"  # the recipe's own line: free ones here
    private = 'export RAY_TMPDIR="$(mktemp -d /tmp/ray-XXXXXXXX)/ray"'
    assert recipe.count("ray start --head --temp-dir=\"$RAY_TMPDIR\"") == 1 and recipe.count(ports) == 1
    assert "127.0.0.1:$DASHBOARD_PORT " in recipe
    assert recipe.count(private) == 1 and recipe.index(private) < recipe.index("ray start")
    script = (recipe.replace(ports, f"RAY_PORT={gcs} DASHBOARD_PORT={dash} AGENT_PORT={free_port()}")
              .replace("ray start --head", isolated).replace("/tmp/ray-XXXXXXXX", f"{temp_dir}/ray-XXXXXXXX"))
    # The recipe's shell settings (the lines before `ray start`) and its submission (the lines from `ray job submit`).
    settings = script.split("\nray start --head", 1)[0]
    submission = "ray job submit" + script.split("\nray job submit", 1)[1]
    probes = []

    def status(command: str) -> None:  # another shell in the repository root: none of the job's variables
        probes.append((command, subprocess.Popen([sys.executable, *shlex.split(command)[1:]], cwd=clone,
                                                 env=_fresh_shell(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 text=True)))
    try:
        code, out = _submit(script, clone, env, status)
        for _ in range(3):  # on a loaded machine the head's job agent can still be starting: only that is retried
            if code == 0 or "results in" in out or "agent" not in out:
                break
            time.sleep(10)
            code, out = _submit(f"{settings}\n{submission}", clone, env, status)
        refused = _refusals(env, dash, gcs)
        # The storage root exported in the submitting shell, no --runtime-env-json.
        left_out = subprocess.run(
            ["bash", "-ec", f"{settings}\nexport QED_STORAGE_ROOT=$PWD\n"
                            f"ray job submit --address http://127.0.0.1:{dash} --working-dir . -- python -m "
                            f"qed_ray.sweep sweeps/smoke.yaml"],
            cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        # Ray's folder lies in the recipe's private one (mode 0700: only this account may enter it; Ray makes its own
        # folder 777), and the head keeps its session, and the job packages it unpacks, in there. Each replay of the
        # settings makes one more private folder.
        private_dirs = sorted(Path(temp_dir).glob("ray-*"))
        modes = {d.name: oct(d.stat().st_mode & 0o7777) for d in private_dirs}
        sessions = [d / "ray" / "session_latest" for d in private_dirs if (d / "ray" / "session_latest").exists()]
        packages = [p for d in sessions for p in (d / "runtime_resources").glob("working_dir_files/*")]
    finally:
        kill_processes_naming(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        for _, probe in probes:
            if probe.poll() is None:
                probe.kill()
    assert private_dirs and set(modes.values()) == {"0o700"}, modes
    assert len(sessions) == 1 and packages, (modes, sessions)
    # Without the cluster's token nobody gets in: not the job API (remote code execution by design), not the GCS.
    assert (refused["http_none"], refused["http_wrong"], refused["http_right"]) == (401, 403, 200), refused
    assert refused["gcs_wrong"].returncode != 0 and "connected" not in refused["gcs_wrong"].stdout
    assert "authentication" in refused["gcs_wrong"].stderr.lower(), refused["gcs_wrong"].stderr[-2000:]
    assert code == 0, out[-6000:]
    assert "succeeded" in out and "IQM" in out
    sweep_dir = clone / "results" / "smoke"  # $PWD/results/smoke, as the README says
    assert f"sweep smoke: results in {sweep_dir} (MLflow: sqlite:///{sweep_dir / 'mlflow.db'})" in out
    results = json.loads(SweepDir(sweep_dir).results_json.read_text())
    assert [(g["task"], g["variant"], g["seeds"]) for g in results["groups"]] == [("cartpole-balance", "te", [0])]
    _, runs = sweep_runs(sweep_dir, "smoke")
    assert sorted(r.data.tags["qed.role"] for r in runs) == ["group", "sweep", "trial"]
    assert all(r.info.status == "FINISHED" for r in runs)
    # The --status command the driver printed is the README's, and from another process it saw the running sweep.
    (command, probe), = probes
    assert shlex.split(command)[1:] == shlex.split(readme_status.replace("$PWD", str(clone)))[1:]
    stdout, stderr = probe.communicate(timeout=120)
    assert probe.returncode == 0 and stderr == "", stderr
    text = flat(stdout)  # wrapped to 100 columns (a long path stands alone on its line)
    assert text.startswith(f"sweep smoke: 1 trials in {sweep_dir} driver: pid "), stdout
    assert re.match(r"driver: pid \d+ on host \S+ \(started [^)]*\) trials: [01] done, [01] running, 0 stopped, "
                    r"0 failed, [01] not started ", text[text.index("driver: "):]), stdout
    # Left out, the storage root is refused in the job, naming its real folder and the line that brings it in.
    assert left_out.returncode != 0
    assert re.search(r"error: storage_path: 'results' is relative, and this Ray job's working folder is Ray's "
                     r"per-job copy of --working-dir \(/\S+/runtime_resources/working_dir_files/\S+\): Ray deletes "
                     r"it", left_out.stdout), left_out.stdout[-3000:]
    assert f"error:   {RUNTIME_ENV_JSON}" in left_out.stdout
