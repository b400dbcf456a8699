"""The single-run CLI refuses bad or silently-wrong settings before anything is built or written."""

import json

import pytest

from qed_ray.train import main


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
    from qed_ray.train import parse_args, spec_from_args

    args, flags = parse_args(["--config", str(cfg), "--out", str(tmp_path / "run"), "--k", "0.3", "--seed", "4"])
    spec = spec_from_args(args, flags)
    assert (spec.temperature.kind, spec.temperature.k, spec.seed) == ("qed", 0.3, 4), "flags override the config"
    assert "note: --env-steps not given: training for the default 2,000,000 env steps" in capsys.readouterr().out


TINY = ["--task", "cartpole-balance", "--env-steps", "2000", "--eval-every", "1000", "--eval-episodes", "1",
        "--warmup-decisions", "100", "--hidden", "16", "--batch-size", "16"]


def test_folders_the_cli_did_not_make_are_refused_and_left_alone(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.csv").write_text("1,2")
    mine = tmp_path / "mine"  # a run folder whose checkpoint/ is not ours (no manifest)
    (mine / "checkpoint").mkdir(parents=True)
    (mine / "run.json").write_text("{}")
    (mine / "checkpoint" / "notes.txt").write_text("keep me")
    expected = {a_file: f"error: --out: {a_file} is a file, not a folder",
                foreign: f"error: --out: {foreign} is not empty and holds no run.json, so it is not a run folder of "
                         f"this CLI; refusing to write into it (give a new or empty folder)",
                mine: f"error: --out: {mine / 'checkpoint'} exists but holds no manifest.json, so it is not a "
                      f"checkpoint of this CLI; refusing to replace it (move it away, or give another --out)"}
    for out, line in expected.items():
        assert main([*TINY, "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == line
    assert a_file.read_text() == "x" and [p.name for p in foreign.iterdir()] == ["data.csv"]
    assert sorted(p.name for p in mine.rglob("*")) == ["checkpoint", "notes.txt", "run.json"]


def test_resume_checks_the_settings_and_a_finished_run_keeps_its_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out)]) == 0
    summary = (out / "summary.json").read_bytes()
    capsys.readouterr()
    # Same command again: reported, not retrained, summary.json untouched (no NaN figures from an empty interval).
    assert main([*TINY, "--out", str(out)]) == 0
    assert "already finished" in capsys.readouterr().out and (out / "summary.json").read_bytes() == summary
    assert [json.loads(x)["env_steps"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1000, 2000]
    # Other settings would continue a different run: refused, naming each changed setting once.
    assert main([*TINY, "--gamma", "0.98", "--hidden", "32", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": ")[1] for line in err] == ["agent.gamma", "agent.hidden"], err
    assert err[0].startswith(f"error: agent.gamma: the checkpoint in {out / 'checkpoint'} was trained with "
                             f"<default>, this run gives 0.98")
    assert main([*TINY[:2], "--env-steps", "1000", *TINY[4:], "--out", str(out)]) == 2
    assert "train.env_steps: 1,000 is below the 2,000 env steps" in capsys.readouterr().err
    # How the run executes is not what it is: another thread count passes the check (and finds the run finished;
    # a larger --env-steps continuing it is test_checkpoint.py's exact-resume case).
    assert main([*TINY, "--threads", "2", "--out", str(out)]) == 0
    assert "already finished" in capsys.readouterr().out and (out / "summary.json").read_bytes() == summary
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "metrics.jsonl", "replay", "run.json",
                                                     "summary.json"], "no staging or old checkpoint folder is left"
