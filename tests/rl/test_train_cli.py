"""The run CLI (one seed or a pack of seeds) refuses bad or silently-wrong settings and folders that are not its own
before anything is built or written, resumes only the same run, and reports a finished one."""

import json
import shutil

import pytest

from qed_ray.records.layout import trial_dirname
from qed_ray.rl.run import main


@pytest.mark.parametrize("flags,needle", [
    (["--k", "0.2"], "temperature.k: applies only to kind 'qed', but kind is 'te'"),
    (["--alpha", "0.1"], "temperature.alpha: applies only to kind 'fixed', but kind is 'te'"),
    (["--temperature", "fixed", "--alpha", "inf"], "temperature.alpha: Input should be a finite number"),
    (["--actor-lr", "nan"], "agent.actor_lr: Input should be a finite number"),
    (["--seed", "4294967296"], "seed: Input should be less than or equal to 4294967295"),
    (["--device", "cuda:abc"], "train.device: 'cuda:abc' is not one of"),
    (["--env-steps", "2000", "--eval-every", "1000"], "train.warmup_decisions: 5000 uniform-random decisions"),
    (["--proportion-real", "0.5"], "error: --proportion-real applies to mad_sac, but the agent is sac_ln (give --agent "
                                   "mad_sac, or drop --proportion-real)\n"),
    (["--agent", "mad_sac", "--hl-vmin", "-5"], "error: --hl-vmin applies to sac_ln, but the agent is mad_sac"),
    (["--eval-every", "1500"], "train.eval_every: 1500 must be a multiple of 1000"),
    (["--seeds", "0", "1", "--env-workers", "3"],  # as pack.env_workers is bounded in a sweep
     "error: --env-workers: 3 workers for the 2 training envs; allowed 0 to 2 (one per --seeds)\n"),
    (["--env-workers", "2"], "error: --env-workers: 2 workers for the 1 training env; allowed 0 to 1"),
])
def test_bad_settings_are_refused_naming_the_field_once(tmp_path, capsys, flags, needle):
    out = tmp_path / "run"
    assert main(["--task", "cartpole-balance", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert not out.exists(), "nothing is created for a refused run"


@pytest.mark.parametrize("content,needle", [
    (b"- a\n- b\n", "does not hold a mapping"),
    (b"", "does not hold a mapping"),
    (b"task: caf\xe9\n", "is not UTF-8 text (byte 0xe9 at offset 9)"),
    (b"task: cartpole-balance\ntask: cheetah-run\n", "duplicate key 'task'"),
    (b"task: [unclosed\n", "invalid YAML"),
    (b"task: cartpole-balance\nagent: {name: sac_ln, mad: {proportion_real: 0.3}}\n",
     "error: agent.mad: applies only to mad_sac, not to sac_ln\n"),
    (b"task: cartpole-balance\ntrain: {eval_evry: 2000}\n", "error: train.eval_evry: unknown field; did you mean "
                                                            "'eval_every'?\n"),
    (b"task: cartpole-balance\nagent: {name: sac-ln}\n",
     "error: agent: unknown 'sac-ln'; one of sac_ln, mad_sac; did you mean 'sac_ln'?\n"),
    (b"task: cheetah_run\n", "error: task: unknown task 'cheetah_run' (did you mean 'cheetah-run'?); valid tasks: "),
    (b"task: cartpole-balance\nseed: 1\x00\n",  # a NUL byte
     "run.yaml: line 2, column 8: the character U+0000 is not allowed in YAML (a NUL or control character: is it the "
     "right file?)\n"),
    (b"task: cartpole\x1b[0m-balance\n", "run.yaml: line 1, column 15: the character U+001B is not allowed"),
])
def test_bad_config_files_give_one_line(tmp_path, capsys, content, needle):
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(content)
    assert main(["--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


def test_missing_task_and_missing_budget(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == "error: task: required (--task, or 'task' in --config)\n"
    cfg = tmp_path / "run.yaml"
    cfg.write_text("task: cartpole-balance\ntemperature: {kind: qed, k: 0.2}\n")
    from qed_ray.rl.run import parse_args, spec_from_args

    args, flags = parse_args(["--config", str(cfg), "--out", str(tmp_path / "run"), "--k", "0.3", "--seed", "4"])
    spec = spec_from_args(args, flags)
    assert (spec.temperature.kind, spec.temperature.k, spec.seed) == ("qed", 0.3, 4), "flags override the config"
    assert "note: --env-steps not given: training for the default 2,000,000 env steps" in capsys.readouterr().out


TINY = ["--task", "cartpole-balance", "--env-steps", "2000", "--eval-every", "1000", "--eval-episodes", "1",
        "--warmup-decisions", "50", "--frame-skip", "10", "--hidden", "8", "--batch-size", "8"]
SEED0 = trial_dirname("cartpole-balance/sac_ln/te/0")


def _tree(root) -> dict:
    """Every file under ``root`` with its bytes (what "nothing changed on disk" compares)."""
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-seed run folder, written once by the CLI."""
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main([*TINY, "--seeds", "0", "1", "--out", str(out)]) == 0
    return out


def test_folders_the_cli_did_not_make_are_refused_and_left_alone(tmp_path, capsys, finished):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    foreign = tmp_path / "foreign"  # e.g. a foreign checkpoint/ folder and nothing of ours
    (foreign / "checkpoint").mkdir(parents=True)
    (foreign / "checkpoint" / "notes.txt").write_text("keep me")
    sweep = tmp_path / "sweep"  # a finished sweep's folder: the run must not overwrite its snapshots or DONE.json
    shutil.copytree(finished, sweep)
    (sweep / "sweep.json").write_text('{"sweep_id": "abc", "name": "s"}')
    old = tmp_path / "old"  # a single-seed run folder of qed_ray 0.1
    (old / "checkpoint").mkdir(parents=True)
    (old / "run.json").write_text(json.dumps({"task": "cartpole-balance", "seed": 0}))
    expected = {
        a_file: f"error: --out: {a_file} is a file, not a folder",
        foreign: f"error: --out: {foreign} is not empty and holds no run.json, so it is not a run folder of this CLI; "
                 f"refusing to write into it (give a new or empty folder)",
        sweep: f"error: --out: {sweep} is a sweep folder (it holds sweep.json); refusing to write into it (give a new "
               f"or empty folder; a sweep is resumed with python -m qed_ray.sweep)",
        old: f"error: --out: {old} is a run folder of run format 1 (format 1: a single-seed run of qed_ray 0.1, with "
             f"checkpoint/ and metrics.jsonl) that this release cannot resume; finish it with the release that wrote "
             f"it, or give a new --out"}
    before = {out: _tree(out) for out in (foreign, sweep, old)}
    for out, line in expected.items():
        assert main([*TINY, "--seeds", "0", "1", "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [line]
    assert a_file.read_text() == "x" and {out: _tree(out) for out in before} == before, "nothing changed on disk"


def test_resume_checks_the_settings_and_a_finished_run_keeps_its_summary(tmp_path, capsys, finished):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = _tree(out)
    assert main([*TINY, "--seeds", "0", "1", "--out", str(out)]) == 0  # reported, not retrained
    assert "already finished" in capsys.readouterr().out and _tree(out) == before
    lines = (out / SEED0 / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["env_steps"] for x in lines] == [1000, 2000]
    # Other settings would continue a different run: refused, naming each changed setting once, nothing changed.
    assert main([*TINY, "--seeds", "0", "1", "--gamma", "0.98", "--actor-lr", "0.001", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": ")[1] for line in err] == ["agent.actor_lr", "agent.gamma"], err
    assert err[1] == (f"error: agent.gamma: the run in {out} was trained with <default>, this run gives 0.98; "
                      f"resuming would continue a different run (use the same settings, or another --out)")
    assert main([*TINY, "--seeds", "0", "2", "--out", str(out)]) == 2
    assert f"--seeds: {out} holds the pack of seeds [0, 1], this run gives [0, 2]" in capsys.readouterr().err
    assert main([*TINY[:2], "--env-steps", "1000", *TINY[4:], "--seeds", "0", "1", "--out", str(out)]) == 2
    assert "train.env_steps: 1,000 is below the 2,000 env steps" in capsys.readouterr().err
    assert _tree(out) == before, "nothing changed on disk by a refused resume"
    # How the run executes is not what it is: another thread count passes the check and finds the run finished
    assert main([*TINY, "--seeds", "0", "1", "--threads", "2", "--out", str(out)]) == 0
    assert "already finished" in capsys.readouterr().out and _tree(out) == before


def test_a_resumed_run_trims_metrics_written_after_its_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY[:2], "--env-steps", "1000", *TINY[4:], "--seed", "0", "--out", str(out)]) == 0
    s = json.loads((out / SEED0 / "summary.json").read_text())
    # wall_s is the real time of the run, evaluations and checkpoints included
    assert s["warmup_s"] + s["train_s"] + s["eval_s"] <= s["wall_s"] + 1e-6
    assert s["wall_s"] - (s["warmup_s"] + s["train_s"] + s["eval_s"]) < 0.05 * s["wall_s"] + 0.05
    assert s["env_steps"] == 1000 and s["decisions"] == 100 and s["updates"] == 50 and s["pack_size"] == 1
    assert s["updates_per_s"] == pytest.approx(50 / s["train_s"]) and s["variant"] == "te"
    out_lines = capsys.readouterr().out.splitlines()
    assert out_lines[0].startswith("[        0/1,000 env steps] warm-up (uniform random actions), 0.0 min so far")
    evals = [line for line in out_lines if "env steps] eval return" in line]
    assert len(evals) == 1 and evals[0].startswith("[    1,000/1,000") and evals[0].endswith("ETA 0.0 min")
    metrics = out / SEED0 / "metrics.jsonl"
    ghost = json.loads(metrics.read_text())
    metrics.write_text(metrics.read_text() + json.dumps({**ghost, "env_steps": 2000}) + "\n")  # past the checkpoint
    assert main([*TINY, "--seed", "0", "--out", str(out)]) == 0  # a larger budget continues the run
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [m["env_steps"] for m in lines] == [1000, 2000] and lines[0] == ghost and lines[1] != {**ghost,
                                                                                                "env_steps": 2000}
    assert "resumed cartpole-balance/sac_ln/te/pack0 from its checkpoint at env step 1,000" in capsys.readouterr().out


@pytest.mark.parametrize("flags, needle", [
    (["--seeds", "0", "0"], "--seeds: pack.seeds: [0, 0] repeats a seed"),
    (["--seeds", "0", "1", "--env-workers", "-1"], "--env-workers: -1 must be >= 0"),
    (["--seeds", "0", "1", "--seed", "3"], "--seeds: give either --seed or --seeds, not both"),
])
def test_pack_flags_are_refused_before_building_anything(tmp_path, capsys, flags, needle):
    assert main([*TINY, "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_unknown_task_and_choice_flags(tmp_path, capsys):
    assert main(["--task", "cheetah-fly", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cheetah-fly" in err and "walker-walk" in err
    with pytest.raises(SystemExit) as e:
        main(["--task", "cartpole-balance", "--agent", "ppo", "--out", str(tmp_path)])
    assert e.value.code == 2


def test_a_pack_of_one_that_diverges_exits_1_with_its_reason(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main([*TINY, "--seed", "0", "--debug-nan-at-env-step", "600", "--nan-check-every", "10", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 1
    s = json.loads((out / SEED0 / "summary.json").read_text())
    assert s["status"] == "diverged" and "non-finite loss/critic" in s["reason"] and "by env step 600" in s["reason"]
    assert s["decisions"] == 60 and f"cartpole-balance/sac_ln/te/0 stopped: {s['reason']}" in captured.err
    assert json.loads((out / "policies" / SEED0 / "DIVERGED.json").read_text())["env_steps"] == 600


def test_the_last_seed_stopped_at_an_evaluation_exits_1_diverged(tmp_path, capsys):
    # The NaN injected at env step 1000 is caught by the check at that evaluation (nan_check_every 1000): that
    # stops the pack's last active seed, and the evaluation's report is skipped (it raised StopIteration).
    out = tmp_path / "run"
    rc = main([*TINY, "--seed", "0", "--debug-nan-at-env-step", "1000", "--nan-check-every", "1000", "--out",
               str(out)])
    captured = capsys.readouterr()
    assert rc == 1 and "Traceback" not in captured.err
    s = json.loads((out / SEED0 / "summary.json").read_text())
    assert s["status"] == "diverged" and "by env step 1000" in s["reason"] and s["decisions"] == 100
    assert json.loads((out / "policies" / SEED0 / "DIVERGED.json").read_text())["env_steps"] == 1000
    assert not (out / SEED0 / "metrics.jsonl").exists()  # no evaluation was reported


def test_checkpoints_of_an_older_format_are_refused_never_replaced(tmp_path, capsys, finished):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    manifests = sorted(out.glob("checkpoints/*/*/seed_*/manifest.json"))
    assert len(manifests) == 4  # the newest two checkpoints of the pack of two seeds
    for manifest in manifests:  # as qed_ray 0.1 (checkpoint format 1) wrote them
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 1}))
    before = _tree(out)
    assert main([*TINY[:2], "--env-steps", "3000", *TINY[4:], "--seeds", "0", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out}/checkpoints/") and \
        "written by an older version of qed_ray (checkpoint format 1" in err[0] and "or use a new --out" in err[0], err
    assert _tree(out) == before, "the older checkpoints and everything else are kept"
