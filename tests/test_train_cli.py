"""The single-run CLI refuses bad or silently-wrong settings before anything is built or written."""

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
    (["--proportion-real", "0.5"], "agent.mad: Extra inputs are not permitted"),
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
