"""Clean stops and restarts, fast: Ctrl-C in a single run (one line, exit 130, no traceback), the start line and
progress of a restarted sweep, and a short `--env-steps` that evaluates at its end."""

import json
import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from kit import TRAIN, sweep_spec

from qed_ray.spec.config import TrainSpec
from qed_ray.records.layout import PackId, SweepDir, seed_dir
from qed_ray.rl.run import RunStopped, parse_args, spec_from_args
from qed_ray.service.announce import resumed_env_steps, start_line
from qed_ray.service.packing import TuneTrial, form_packs
from qed_ray.spec.sweep import SpecError
from sweep_helpers import ROOT

TINY = ["--task", "cartpole-balance", "--env-steps", "40000", "--eval-every", "1000", "--eval-episodes", "1",
        "--warmup-decisions", "50", "--frame-skip", "10", "--hidden", "8", "--batch-size", "8"]


def test_ctrl_c_in_a_run_prints_one_line_and_exits_130(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "MUJOCO_GL": "disable", "PYTHONPATH": str(ROOT)}
    # Its own session, so that the signal reaches the whole process group (env worker too), as Ctrl-C in a terminal.
    proc = subprocess.Popen([sys.executable, "-m", "qed_ray", "run", *TINY, "--env-workers", "1", "--out", str(out)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:  # the first evaluation: its checkpoint is being written
        seen.append(line)
        if "eval return" in line:
            os.killpg(proc.pid, signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=120)
    output = "".join(seen) + rest + err
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    (line,) = err.strip().splitlines()
    stop = re.fullmatch(r"stopped \(Ctrl-C\) at env step ([\d,]+) of 40,000; run the same command to resume from "
                        r"its checkpoint at env step ([\d,]+)", line)
    assert stop, line
    reached, checkpoint = (int(g.replace(",", "")) for g in stop.groups())
    pack = PackId.of(["cartpole-balance/sac_ln/te/0"])
    assert checkpoint == max(SweepDir(out).pack_checkpoint_steps(pack)) and 1000 <= checkpoint <= reached < 40000


def test_the_stop_line_before_the_first_checkpoint():
    train = TrainSpec(env_steps=40000, eval_every=2000)
    assert RunStopped(1234, train, 0).line() == ("stopped (Ctrl-C) at env step 1,234 of 40,000, before its first "
                                                 "checkpoint (at env step 2,000); run the same command to start it "
                                                 "again")


def _checkpoint(layout: SweepDir, pack: PackId, step: int) -> None:
    folder = layout.pack_checkpoint(pack, step)
    for seed in pack.seeds:
        (folder / seed_dir(seed)).mkdir(parents=True)
    (folder / "pack.json").write_text("{}")


def test_a_restart_says_what_resumed_from_where_and_counts_progress_from_there(tmp_path):
    from qed_ray.service.sweep import Progress

    spec = sweep_spec(name="restart", seeds=4, train={**TRAIN, "env_steps": 8000, "eval_every": 2000},
                      storage_path=str(tmp_path))
    layout, packs = SweepDir(tmp_path / "restart"), form_packs(spec)
    done, resumed, resumed_later, fresh = packs  # one seed per pack
    layout.done_marker(done.names[0]).parent.mkdir(parents=True)
    layout.done_marker(done.names[0]).write_text(json.dumps({"env_steps": 8000}))
    _checkpoint(layout, done.id, 8000)
    _checkpoint(layout, resumed.id, 2000)
    _checkpoint(layout, resumed.id, 4000)
    _checkpoint(layout, resumed_later.id, 6000)
    assert start_line(spec, layout, packs, new=[fresh.names[0]]) == (
        "sweep restart: 4 trials (1 done, 2 resumed from env steps 4,000 to 6,000, 1 new) in 4 packs of up to 1 "
        "seed")
    assert "(1 done, 2 resumed from env steps 4,000 to 6,000, 0 new, 1 starting from scratch)" in \
        start_line(spec, layout, packs, new=[])
    pending = [resumed, resumed_later, fresh]
    offsets = resumed_env_steps(layout, pending)
    assert offsets == {resumed.name: 4000, resumed_later.name: 6000}

    def trial(pack, reported=None):
        return SimpleNamespace(status="RUNNING" if reported else "PENDING",
                               config={"pack": TuneTrial.from_pack(pack).param()},
                               last_result={"seed_env_steps": reported} if reported else {})

    progress = Progress(3 * 8000, resumed=offsets)
    line = progress.line([trial(resumed), trial(resumed_later), trial(fresh)])
    assert "env steps 10,000/24,000 (42%) | ETA -" in line, "the checkpoints count before the trials report"
    line = progress.line([trial(resumed, 6000), trial(resumed_later), trial(fresh, 2000)])
    assert "env steps 14,000/24,000 (58%)" in line and "ETA -" not in line


def _train_spec(*flags: str):
    args, run_flags = parse_args(["--task", "cartpole-balance", "--out", "unused", *flags])
    return spec_from_args(args, run_flags)


def test_env_steps_below_the_default_eval_every_evaluates_at_the_end(capsys):
    spec = _train_spec("--env-steps", "4000", "--warmup-decisions", "100")
    assert (spec.train.env_steps, spec.train.eval_every) == (4000, 4000)
    assert capsys.readouterr().out == ("note: --env-steps 4,000 is below the default eval_every (20,000): evaluating "
                                       "once, at the end (--eval-every N evaluates every N env steps)\n")
    spec = _train_spec("--env-steps", "4000", "--eval-every", "2000", "--warmup-decisions", "100")
    assert spec.train.eval_every == 2000 and capsys.readouterr().out == "", "a given --eval-every is kept"
    with pytest.raises(SpecError) as refused:
        _train_spec("--env-steps", "30000")
    assert str(refused.value) == ("train.env_steps: 30000 must be a multiple of eval_every (20000); give "
                                  "--eval-every, a multiple of 1000 env steps that divides --env-steps")
    with pytest.raises(SpecError) as refused:
        _train_spec("--env-steps", "4000")
    assert str(refused.value).startswith("train.warmup_decisions: 5000 uniform-random decisions use up the whole ")
    assert str(refused.value).endswith("; lower it or raise env_steps (--warmup-decisions, --env-steps)")


def test_tunes_warning_about_trials_a_stop_kept_from_reporting_is_dropped_and_others_kept(caplog):
    import logging

    from qed_ray.service.sweep import quiet_never_started

    quiet_never_started()
    quiet_never_started()  # once is enough
    logger = logging.getLogger("ray.tune.analysis.experiment_analysis")
    assert sum(type(f).__name__ == "NeverStarted" for f in logger.filters) == 1
    missing = ("- {t}: FileNotFoundError('Could not fetch metrics for {t}: both result.json and progress.csv were "
               "not found at /x/{t}')")
    with caplog.at_level(logging.WARNING, logger=logger.name):  # as Tune words it (experiment_analysis.py)
        logger.warning("Failed to fetch metrics for 2 trial(s):\n" + "\n".join(missing.format(t=t) for t in "ab"))
        logger.warning("Failed to fetch metrics for 2 trial(s):\n" + missing.format(t="a") + "\n- b: ValueError('x')")
    assert [r.getMessage().splitlines()[-1] for r in caplog.records] == ["- b: ValueError('x')"]
