"""Training loop behaviour: divergence guard, fault injection, summary, CLI errors."""

import json

import numpy as np
import pytest

from qed_ray.train import main, run
from qed_ray.trainer import InjectedCrash


def test_nan_in_loss_stops_run_with_reason(tiny_run, tmp_path):
    spec = tiny_run(train={"env_steps": 2000, "debug": {"nan": {"env_step": 600}}, "nan_check_every": 10})
    summary = run(spec, tmp_path)
    assert summary["status"] == "diverged"
    assert "non-finite loss/critic" in summary["reason"] and "env step" in summary["reason"]
    assert summary["decisions"] < 1000, "stopped soon after the injection, not at the end"
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["reason"] == summary["reason"]


def test_injected_crash_only_on_fresh_start(tiny_run, tmp_path):
    spec = tiny_run(train={"env_steps": 4000, "debug": {"crash_at_env_step": 3000}})
    with pytest.raises(InjectedCrash):
        run(spec, tmp_path)
    summary = run(spec, tmp_path)  # resumes from the 2000-step checkpoint, so no crash
    assert summary["status"] == "finished" and summary["env_steps"] == 4000
    assert [e["env_steps"] for e in summary["evals"]] == [2000, 4000]


def test_summary_and_cli_outputs(tmp_path, capsys):
    import time

    t0 = time.perf_counter()
    rc = main(["--task", "cartpole-balance", "--temperature", "qed", "--k", "0.2", "--seed", "0",
               "--env-steps", "2000", "--eval-every", "1000", "--eval-episodes", "1", "--warmup-decisions", "100",
               "--hidden", "16", "--batch-size", "16", "--out", str(tmp_path)])
    wall = time.perf_counter() - t0
    assert rc == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    # wall_s is the real time of the run, evaluations and checkpoints included; only building it is outside
    assert s["warmup_s"] + s["train_s"] + s["eval_s"] <= s["wall_s"] + 1e-6 and s["wall_s"] <= wall
    assert s["wall_s"] - (s["warmup_s"] + s["train_s"] + s["eval_s"]) < 0.05 * s["wall_s"] + 0.05
    assert s["eval_s"] > 0 and s["warmup_s"] > 0 and s["updates_per_s"] == pytest.approx(900 / s["train_s"])
    assert s["env_steps"] == 2000 and s["decisions"] == 1000 and s["updates"] == 900
    assert 0 <= s["final_eval_return_mean"] <= 1000
    assert s["final_alpha"]["actor_min"] <= s["final_alpha"]["actor_mean"] <= 0.2 + 1e-6
    assert s["updates_per_s"] > 0 and s["variant"] == "qed0.2"
    assert (tmp_path / "checkpoint" / "manifest.json").exists()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[        0/2,000 env steps] warm-up (uniform random actions), 0.0 min so far, ETA")
    evals = [line for line in out if "env steps] eval return" in line]
    assert len(evals) == 2 and evals[0].startswith("[    1,000/2,000") and evals[-1].endswith("ETA 0.0 min")


def test_remaining_time_counts_warmup_training_and_evaluation():
    from qed_ray.config import TrainSpec
    from qed_ray.trainer import remaining_s

    t = TrainSpec(env_steps=20_000, eval_every=4000, eval_episodes=2, warmup_decisions=1000)  # 10,000 decisions
    # at decision 400: 600 warm-up at 0.001 s, 9,000 training at 0.01 s, 5 evaluations at 3 s
    assert remaining_s(t, 400, 0, 0.001, 0.01, 3.0) == pytest.approx(0.6 + 90 + 15)
    # before any evaluation: one costs 2 episodes x 500 decisions at the warm-up cost
    assert remaining_s(t, 400, 0, 0.001, 0.01, None) == pytest.approx(0.6 + 90 + 5 * 1.0)
    assert remaining_s(t, 400, 0, 0.001, None, 3.0) is None, "training cost not measured yet"
    assert remaining_s(t, 6000, 3, None, 0.01, 3.0) == pytest.approx(40 + 6), "resumed past warm-up"
    assert remaining_s(t, 10_000, 5, None, None, None) == 0.0


def test_heartbeat_reports_before_the_first_evaluation(tiny_run, tmp_path):
    from qed_ray.trainer import build_trainer

    beats, reports = [], []
    spec = tiny_run(train={"env_steps": 2000, "eval_every": 2000, "warmup_decisions": 300})
    trainer = build_trainer(spec, lambda m, save: reports.append(m), None, heartbeat=beats.append, heartbeat_s=0.0)
    summary = trainer.run()
    assert beats[0] == {"env_steps": 0, "total_env_steps": 2000, "warmup": True, "eta_s": None,
                        "wall_s": beats[0]["wall_s"]}
    assert [b["env_steps"] for b in beats] == list(range(0, 2000, 200)), "every 100 decisions at heartbeat_s 0"
    assert [b["warmup"] for b in beats[1:]] == [True, True, False, False, False, False, False, False, False]
    assert beats[3]["eta_s"] is None and beats[4]["eta_s"] > 0, "known once training decisions were timed"
    assert reports[0]["perf/eta_s"] == 0.0 and len(reports) == 1
    assert summary["wall_s"] >= beats[-1]["wall_s"] > 0


@pytest.mark.parametrize("flags,needle", [
    (["--k", "-1", "--temperature", "qed"], "temperature.k"),
    (["--temperature", "qed"], "temperature.k: required"),
    (["--temperature", "fixed"], "temperature.alpha: required"),
    (["--eval-every", "1500"], "train.eval_every"),
    (["--env-steps", "-5"], "train.env_steps"),
    (["--device", "tpu"], "train.device"),
])
def test_bad_flag_values_get_clear_errors(tmp_path, capsys, flags, needle):
    rc = main(["--task", "cartpole-balance", "--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.startswith("error: ")
    assert not (tmp_path / "checkpoint").exists()


def test_unknown_task_flag(tmp_path, capsys):
    assert main(["--task", "cheetah-fly", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cheetah-fly" in err and "walker-walk" in err


def test_bad_choice_flag_exits_with_usage(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--task", "cartpole-balance", "--agent", "ppo", "--out", str(tmp_path)])
    assert e.value.code == 2


def test_policy_snapshots_keep_exactly_the_named_modules(tiny_run, tmp_path):
    import json as _json

    from qed_ray.agents import load_policy
    from qed_ray.trainer import build_trainer

    spec = tiny_run(train={"env_steps": 2000})
    trainer = build_trainer(spec, lambda m, save: None, replay_dir=None, log=lambda s: None)
    trainer.save(tmp_path / "mid", modules=trainer.agent.acting_modules)
    mid = _json.loads((tmp_path / "mid" / "manifest.json").read_text())
    assert mid["modules"] == ["actor"] and mid["policy_only"] and mid["env_steps"] == 0
    trainer.p.decisions = spec.train.decisions
    trainer.save(tmp_path / "final", modules=tuple(trainer.agent.modules()))
    final = _json.loads((tmp_path / "final" / "manifest.json").read_text())
    assert final["modules"] == ["actor", "critic", "critic_target", "temperature"] and final["env_steps"] == 2000
    assert mid["evals"] == [] and mid["wall_s"] == 0.0, "the history and wall time ride along (none yet)"
    agent, _ = load_policy(tmp_path / "mid")
    obs = trainer.env.reset()[None]
    assert (agent.act_batch(obs) == trainer.agent.act_batch(obs)).all()
    with pytest.raises(ValueError, match=r"modules: \['critic_2'\] are not modules of sac_ln"):
        trainer.save(tmp_path / "bad", modules=("actor", "critic_2"))
    assert not (tmp_path / "bad").exists(), "nothing is written for a bad module name"


def test_eval_records_round_trip_through_checkpoint_and_summary(tiny_run, tmp_path):
    import math

    from qed_ray.trainer import EvalRecord

    rec = EvalRecord(2000, 12.5, 0.0625, 0.5)
    assert rec.to_json() == {"env_steps": 2000, "return_mean": 12.5, "alpha_mean": 0.0625, "q_gap_mean": 0.5}
    assert EvalRecord.from_json(rec.to_json()) == rec
    warmup_only = EvalRecord.from_json(json.loads(json.dumps(EvalRecord(1000, 3.0, math.nan, math.nan).to_json())))
    assert warmup_only.env_steps == 1000 and math.isnan(warmup_only.alpha_mean) and math.isnan(warmup_only.q_gap_mean)
    older = EvalRecord.from_json({"env_steps": 1000, "return_mean": 3.0, "alpha_mean": 0.1})
    assert math.isnan(older.q_gap_mean), "a record written before the critic gap was kept reads it as unknown"

    spec = tiny_run(train={"env_steps": 4000, "eval_every": 2000})
    summary = run(spec, tmp_path)
    manifest = json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())
    assert manifest["progress"]["evals"] == summary["evals"]  # the checkpoint holds the same records
    assert 0 < manifest["progress"]["wall_s"] <= summary["wall_s"]
    assert [sorted(e) for e in summary["evals"]] == [["alpha_mean", "env_steps", "q_gap_mean", "return_mean"]] * 2
    assert summary["evals"][1]["q_gap_mean"] == pytest.approx(
        json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])["q/abs_diff_mean"])
    assert summary["final_eval_return_mean"] == summary["evals"][-1]["return_mean"]
    assert summary["alpha_mean_over_training"] == pytest.approx(np.mean([e["alpha_mean"] for e in summary["evals"]]))


def test_tf32_is_off_for_critic_passes_once_the_trainer_runs(tiny_run, tmp_path):
    import torch

    from qed_ray.trainer import build_trainer

    def allow_tf32():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")

    seen = []

    def reporter(metrics, save):
        seen.append((torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
                     torch.backends.cudnn.allow_tf32))

    spec = tiny_run(agent={"hidden": 8, "batch_size": 8}, temperature={"kind": "qed", "k": 0.2},
                    train={"env_steps": 1000, "eval_every": 1000, "warmup_decisions": 100})
    try:
        allow_tf32()
        trainer = build_trainer(spec, reporter, replay_dir=None, log=lambda s: None)
        assert torch.get_float32_matmul_precision() == "highest"  # set where the agent is built
        allow_tf32()  # something between construction and the run switches it on again
        trainer.run()
        assert seen == [("highest", False, False)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("highest")


def test_debug_settings_are_grouped_and_the_old_names_still_load():
    from pydantic import ValidationError

    from qed_ray.config import TrainSpec, format_validation_error

    legacy = TrainSpec.model_validate({"debug_crash_at_env_step": 3000, "debug_nan_at_env_step": 600})
    assert legacy == TrainSpec.model_validate({"debug": {"crash_at_env_step": 3000, "nan": {"env_step": 600}}})
    assert "debug_nan_at_env_step" not in legacy.model_dump() and TrainSpec().debug.nan.env_step is None
    nan = TrainSpec.model_validate({"debug": {"nan": {"seed": 1, "env_step": 600}}}).debug.nan
    assert nan.hits(1, 600) and not nan.hits(0, 600) and not nan.hits(1, 602)
    assert TrainSpec.model_validate({"debug": {"nan": {"env_step": 600}}}).debug.nan.hits(5, 600)  # every seed
    with pytest.raises(ValidationError) as e:
        TrainSpec.model_validate({"debug": {"nan": {"seed": 1}}})
    assert format_validation_error(e.value, "train.").startswith("train.debug.nan.seed: 1 names the run to poison")
