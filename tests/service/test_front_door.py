"""The front door, fast: every command's --help (plain text, two examples, no test-only flags), the README's local `ray
job submit` recipe being the one --help prints (tests/service/test_job_submit.py runs it), the refusal of a relative
storage path in a Ray job, the driver's first lines, and `--status --dir` from any shell."""

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from folder_helpers import TEMPLATE_SWEEP
from kit import counts, flat, sweep_file, sweep_spec, widest
from qed_ray.records.layout import SweepDir
from qed_ray.service.announce import LOCAL_HEAD, LOCAL_STATUS, first_lines, status_command
from qed_ray.service.sweep_state import RUNTIME_ENV_JSON, storage_root
from qed_ray.spec.sweep import SpecError

ROOT = Path(__file__).resolve().parents[2]
MARKUP = re.compile(r"``|:(func|mod|class|meth|attr|data|exc|obj|ref):`")


def _mains():
    from qed_ray.analysis.group_eval import main as analysis
    from qed_ray.paper.theory import main as theory
    from qed_ray.paper.toy import main as toy
    from qed_ray.rl.envs import main as envs
    from qed_ray.rl.run import main as train
    from qed_ray.service.behaviour_cli import main as visualize
    from qed_ray.service.reanalysis import main as gather
    from qed_ray.service.mlflow.relink import main as relink
    from qed_ray.service.sweep_cli import main as sweep
    return {"sweep": sweep, "run": train, "gather": gather, "visualize": visualize, "relink": relink,
            "theory": theory, "toy": toy, "envs": envs, "analysis": analysis}


def _help(main, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_every_help_is_plain_text_with_two_examples(capsys):
    for name, main in _mains().items():
        text = _help(main, capsys)
        assert not MARKUP.search(text), f"{name}: markup in --help: {MARKUP.search(text).group(0)}"
        examples = text.split("examples (from the repository root, after: source .venv/bin/activate):\n", 1)[1]
        lines = [ln for ln in examples.splitlines() if f"qed-ray {name}" in ln]
        assert len(lines) >= 2 and all(ln.startswith("  ") for ln in lines), (name, examples)
    train = _help(_mains()["run"], capsys)
    assert "--debug" not in train and "--env-steps" in train, "the test-only flags stay out of --help"
    sweep = _help(_mains()["sweep"], capsys)
    assert LOCAL_HEAD.replace("\n", "\n  ") in sweep and LOCAL_STATUS in sweep and "--dir DIR" in sweep


def _readme_section(title: str) -> str:
    return (ROOT / "README.md").read_text().split(f"\n### {title}\n", 1)[1].split("\n### ", 1)[0]


def test_the_readme_gives_the_recipe_help_prints():
    blocks = re.findall(r"```bash\n(.*?)\n```", _readme_section("On a local Ray head (`ray job submit`)"), re.S)
    assert blocks[0] == LOCAL_HEAD, "README's local recipe differs from --help's (qed_ray/service/announce.py)"
    assert blocks[1] == f".venv/bin/{LOCAL_STATUS}"
    assert RUNTIME_ENV_JSON in LOCAL_HEAD and "RAY_AUTH_MODE=token" in LOCAL_HEAD
    assert "ray start --head" in LOCAL_HEAD and LOCAL_HEAD.startswith("source .venv/bin/activate")


def test_the_readme_gives_demo_and_test_times_as_ranges():
    intro = (ROOT / "README.md").read_text().split("\n---\n", 1)[0]
    assert not re.search(r"about \d+(\.\d+)? minutes", intro), "single figures break on a busy machine"
    for what in ("the install takes 1-3 minutes", "the demo sweep 3.5-8 minutes", "`make test` 15-20 minutes"):
        assert what in " ".join(intro.split()), what


@pytest.fixture
def in_ray_job(monkeypatch, tmp_path):
    """This process as a `ray job submit` driver (the variable Ray sets for one), in a folder of ``tmp_path``."""
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    for var in ("QED_STORAGE_ROOT", "QED_STORAGE_PATH"):
        monkeypatch.delenv(var, raising=False)

    def at(folder: Path) -> Path:
        folder.mkdir(parents=True)
        monkeypatch.chdir(folder)
        return folder
    return at


def test_a_relative_storage_path_in_a_ray_job_names_the_job_folder_and_the_line_to_add(in_ray_job, tmp_path,
                                                                                       monkeypatch):
    package = in_ray_job(tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_ab12")
    with pytest.raises(SpecError) as refused:
        storage_root(sweep_spec(storage_path="results"))
    lines = str(refused.value).splitlines()
    assert lines[0] == (f"storage_path: 'results' is relative, and this Ray job's working folder is Ray's per-job "
                        f"copy of --working-dir ({package}): Ray deletes it, and the next submission gets a new one "
                        f"and would start over.")
    assert lines[2] == """  --runtime-env-json '{"env_vars": {"QED_STORAGE_ROOT": "'"$PWD"'"}}'"""
    assert "QED_STORAGE_ROOT exported in the submitting shell does not reach the job" in lines[3]
    # Without --working-dir the job runs where the head was started: named as that, not as a package cache.
    head = in_ray_job(tmp_path / "where_the_head_started")
    with pytest.raises(SpecError) as refused:
        storage_root(sweep_spec(storage_path="results"))
    assert f"is the folder the Ray head was started in ({head}), not the folder the job was submitted from" in \
        str(refused.value)
    # The line, as a shell expands it, is what makes the same spec land in the submitter's folder.
    env_json = json.loads(shlex.split(lines[2])[1].replace("$PWD", str(tmp_path)))
    monkeypatch.setenv("QED_STORAGE_ROOT", env_json["env_vars"]["QED_STORAGE_ROOT"])
    assert storage_root(sweep_spec(storage_path="results")) == tmp_path / "results"


def test_the_first_lines_print_the_folder_and_the_status_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sweeps").mkdir()
    layout = SweepDir(tmp_path / "store" / "my results" / "smoke")
    lines = first_lines("smoke", tmp_path / "sweeps" / "smoke.yaml", layout, "sqlite:///x/mlflow.db")
    assert lines == [f"sweep smoke: results in {layout.root} (MLflow: sqlite:///x/mlflow.db)",
                     f"  progress from any shell: {sys.executable} -m qed_ray.sweep sweeps/smoke.yaml --status "
                     f"--dir '{layout.root}'"]  # this interpreter by its path: runs in a shell without the venv
    assert status_command(Path("/elsewhere/s.yaml"), layout).split()[3] == "/elsewhere/s.yaml"


@pytest.fixture
def sweep_cli(monkeypatch, capsys):
    """``python -m qed_ray.sweep ARGS`` in this process: ``(exit code, stdout, stderr)`` (the variables the CLI sets
    are restored after the test)."""
    from qed_ray.service.sweep_cli import main

    for var in ("MUJOCO_GL", "RAY_AIR_NEW_OUTPUT", "TUNE_DISABLE_SIGINT_HANDLER"):
        monkeypatch.setenv(var, os.environ.get(var, ""))

    def call(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err
    return call


def test_status_dir_reads_the_given_folder_whatever_the_shell_says(sweep_copy, tmp_path, monkeypatch, sweep_cli):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QED_STORAGE_ROOT", str(tmp_path / "unrelated"))
    monkeypatch.delenv("QED_STORAGE_PATH", raising=False)
    spec = sweep_file(tmp_path / "sweep.yaml", TEMPLATE_SWEEP, storage_path="results")
    code, out, _ = sweep_cli(str(spec), "--status")
    looked = tmp_path / "unrelated" / "results" / "sweep"
    assert code == 0 and widest(out) <= 100 and flat(out) == flat(
        f"sweep sweep: not started ({looked} has no sweep.json; the folder is storage_path 'results' of the spec "
        f"(QED_STORAGE_PATH not set) against QED_STORAGE_ROOT={tmp_path / 'unrelated'}). A sweep submitted with "
        f"`ray job submit` stores where its job's variables say: its driver's first lines print the --status --dir "
        f"command that finds it.\n")
    monkeypatch.delenv("QED_STORAGE_ROOT")
    assert f"against the current folder {tmp_path} (QED_STORAGE_ROOT not set))" in flat(sweep_cli(str(spec),
                                                                                                  "--status")[1])
    code, out, _ = sweep_cli(str(spec), "--status", "--dir", str(sweep_copy.root))
    assert code == 0 and flat(out).startswith(f"sweep sweep: 4 trials in {sweep_copy.root} ")
    assert counts(out, "trials") == {"done": 3, "running": 0, "stopped": 1, "failed": 0, "not started": 0}
    code, _, err = sweep_cli(str(spec), "--dir", str(sweep_copy.root))
    assert code == 2 and err.startswith("error: --dir: only with --status")


def test_status_dir_on_a_folder_of_another_sweep_or_of_no_sweep_says_so(sweep_copy, tmp_path, sweep_cli, capsys):
    state = json.loads(sweep_copy.state_file.read_text())
    sweep_copy.state_file.write_text(json.dumps({**state, "name": "other"}))
    spec = sweep_file(tmp_path / "sweep.yaml", TEMPLATE_SWEEP, storage_path="results")
    code, out, err = sweep_cli(str(spec), "--status", "--dir", str(sweep_copy.root))
    assert (code, out) == (2, "")
    assert err == (f"error: {sweep_copy.root} holds the sweep 'other', not 'sweep'; the folder is given by --dir; "
                   f"give the folder of 'sweep' with --dir, or the spec of 'other'\n")
    storage = sweep_copy.root.parent  # the storage root, not the sweep folder
    code, _, err = sweep_cli(str(spec), "--status", "--dir", str(storage))
    assert code == 2 and err == (f"error: {storage} is not a sweep folder (files but no sweep.json; the folder is "
                                 f"given by --dir); it holds the sweep folder(s) sweep: give --dir {sweep_copy.root}\n")
    from qed_ray.service.reanalysis import main as gather
    assert gather([str(storage)]) == 2
    assert capsys.readouterr().err == (f"error: sweep_dir: {storage} is not a sweep folder (no sweep.json); it holds "
                                       f"the sweep folder(s) sweep: give {sweep_copy.root}\n")



def _write_spec(folder: Path, **changes) -> Path:
    return sweep_file(folder / "fd.yaml", {"name": "fd", "seeds": 1, "storage_path": str(folder / "results")},
                      **changes)


def test_help_and_refusals_answer_without_torch_ray_or_mlflow(tmp_path):
    from kit import cli_run

    proc, loaded = cli_run(tmp_path, "qed_ray.sweep", "--help", cwd=ROOT)
    assert proc.returncode == 0 and LOCAL_STATUS in proc.stdout and loaded == [], loaded
    for command in ("run", "gather", "visualize"):
        proc, loaded = cli_run(tmp_path, "qed_ray", command, "--help", cwd=ROOT)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: qed-ray {command} ") and loaded == [], (
            command, loaded)
    proc, loaded = cli_run(tmp_path, "qed_ray", "--help", cwd=ROOT)
    assert proc.returncode == 0 and loaded == [] and proc.stdout.startswith("usage: qed-ray COMMAND [ARGS ...]\n")
    assert [ln.split()[0] for ln in proc.stdout.split("commands:\n")[1].split("\n\n")[0].splitlines()] == [
        "sweep", "run", "gather", "visualize", "analysis", "relink", "envs", "toy", "theory"]
    proc, loaded = cli_run(tmp_path, "qed_ray", "train", cwd=ROOT)
    assert (proc.returncode, proc.stderr, loaded) == (2, "error: 'train' is not a qed-ray command; the commands: sweep, "
                                                         "run, gather, visualize, analysis, relink, envs, toy, theory\n",
                                                      [])
    proc, loaded = cli_run(tmp_path, "qed_ray.gather", str(tmp_path))
    assert (proc.returncode, proc.stderr, loaded) == (
        2, f"error: sweep_dir: {tmp_path} is not a sweep folder (no sweep.json)\n", [])
    specs = ", ".join(sorted(p.name for p in (ROOT / "sweeps").glob("*.yaml")))
    proc, loaded = cli_run(tmp_path, "qed_ray.sweep", "sweeps/smoek.yaml", cwd=ROOT)
    assert (proc.returncode, proc.stderr, loaded) == (2, f"error: sweeps/smoek.yaml: no such file (did you mean "
                                                         f"'sweeps/smoke.yaml'?); the specs in sweeps/: {specs}\n", [])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc, _ = cli_run(tmp_path, "qed_ray.sweep", "sweeps/smoke.yaml", "--dry-run", cwd=elsewhere)
    assert (proc.returncode, proc.stderr) == (2, f"error: sweeps/smoke.yaml: no such file in the current folder "
                                                 f"{elsewhere.resolve()}; run from the repository root ({ROOT}) or "
                                                 f"give an absolute path ({ROOT / 'sweeps' / 'smoke.yaml'})\n")
    bad_k = [{"kind": "te"}, {"kind": "qed", "k": -0.2}]
    proc, loaded = cli_run(tmp_path, "qed_ray.sweep", str(_write_spec(
        tmp_path, agents=[{"name": "sac_ln", "temperatures": bad_k}])))
    assert (proc.returncode, proc.stderr, loaded) == (2, (
        "error: k (agent sac_ln, temperature entry 2): -0.2 is not above 0; QED's alpha(s) = Delta / (k x action_dim) "
        "needs 0 < k <= 1000 (paper Sec. 5.1), and the paper uses 0.1 to 0.4\n"), [])
    # A k the paper's range is far from is accepted, with a warning saying what QED would do with it.
    huge_k = [{"kind": "te"}, {"kind": "qed", "k": 1000}]
    proc, loaded = cli_run(tmp_path, "qed_ray.sweep", str(_write_spec(
        tmp_path, agents=[{"name": "sac_ln", "temperatures": huge_k}])), "--dry-run", "--workers", "0")
    assert (proc.returncode, loaded) == (2, []) and proc.stderr.splitlines() == [
        "warning: k: 1000 (agent sac_ln) is outside 0.05 to 1 (the paper uses 0.1 to 0.4): alpha(s) = Delta / "
        "(k x action_dim) is 2500 times smaller than at k = 0.4, so QED would sit at its floor alpha_TE (training "
        "like te)", "error: --workers: 0 worker nodes; allowed 1 or more"]
    assert not (tmp_path / "results").exists()


def test_a_stale_ray_address_is_named_and_given_up_on_before_anything_is_written(tmp_path):
    """A head that died without `ray stop` left its address in a (private) Ray temp folder: the sweep says where it
    joins, stops after QED_RAY_CONNECT_TIMEOUT_S naming the address and the ways out, and writes no sweep folder."""
    from kit import cli_run, free_port

    ray_tmp = tmp_path / "raytmp"
    (ray_tmp / "ray").mkdir(parents=True)
    stale, address = ray_tmp / "ray" / "ray_current_cluster", f"127.0.0.1:{free_port()}"
    stale.write_text(address)
    spec = _write_spec(tmp_path)
    proc, loaded = cli_run(tmp_path, "qed_ray.sweep", str(spec), timeout=300, env={
        "RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": "", "QED_RAY_CONNECT_TIMEOUT_S": "3"})
    source = f"the address a `ray start` on this machine left in {stale}"
    assert proc.returncode == 1 and loaded == ["ray"], (proc.stdout + proc.stderr, loaded)  # the driver: not yet
    assert f"Ray: joining the cluster at {address} ({source})" in proc.stdout.splitlines()
    assert proc.stderr.splitlines()[-1] == (
        f"error: Ray: joining the cluster at {address} ({source}) failed (nothing listens there: "
        f"ConnectionRefusedError); if no head runs there any more, `ray stop` clears the stale address (it also stops "
        f"every Ray process of yours on this machine; or remove {stale}), or run with RAY_ADDRESS=local for an "
        f"embedded cluster (QED_RAY_CONNECT_TIMEOUT_S to wait longer)")
    assert not (tmp_path / "results").exists(), "nothing is written before the join succeeds"
    import socket

    with socket.socket() as mute:  # something listens there but never answers as Ray's GCS would
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        address = f"127.0.0.1:{mute.getsockname()[1]}"
        stale.write_text(address)
        proc, _ = cli_run(tmp_path, "qed_ray.sweep", str(spec), timeout=300, env={
            "RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": "", "QED_RAY_CONNECT_TIMEOUT_S": "3"})
    assert proc.returncode == 1 and f"Ray: joining the cluster at {address} ({source})" in proc.stdout.splitlines()
    assert proc.stderr.splitlines()[-1] == (
        f"error: Ray: joining the cluster at {address} ({source}) got no answer within 3 s; if no head runs there any "
        f"more, `ray stop` clears the stale address (it also stops every Ray process of yours on this machine; or "
        f"remove {stale}), or run with RAY_ADDRESS=local for an embedded cluster (QED_RAY_CONNECT_TIMEOUT_S to wait "
        f"longer)")
    assert not (tmp_path / "results").exists()


def test_where_ray_is_joined_comes_from_ray_address_or_ray_start_or_nowhere(tmp_path):
    from qed_ray.service.ray_join import target, timeout_s

    file = tmp_path / "ray_current_cluster"
    assert target(str(tmp_path), {"RAY_ADDRESS": "10.0.0.5:6379"}).line() == \
        "Ray: joining the cluster at 10.0.0.5:6379 (RAY_ADDRESS)"
    assert target(str(tmp_path), {"RAY_ADDRESS": "local"}).line() == \
        "Ray: starting an embedded cluster on this machine (RAY_ADDRESS=local)"
    assert target(str(tmp_path), {}).line() == \
        f"Ray: starting an embedded cluster on this machine (no RAY_ADDRESS, and no `ray start` address in {file})"
    assert target(str(tmp_path), {"RAY_ADDRESS": "auto"}).line() == \
        f"Ray: joining the cluster at auto (RAY_ADDRESS=auto, no `ray start` address in {file})"
    file.write_text("10.0.0.6:6380\n")
    assert target(str(tmp_path), {"RAY_ADDRESS": "auto"}).address == "10.0.0.6:6380"
    assert (timeout_s({}), timeout_s({"QED_RAY_CONNECT_TIMEOUT_S": "2.5"})) == (30.0, 2.5)
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(SpecError) as refused:
            timeout_s({"QED_RAY_CONNECT_TIMEOUT_S": bad})
        assert str(refused.value) == f"QED_RAY_CONNECT_TIMEOUT_S: {bad!r} is not a number of seconds above 0 (default 30)"
