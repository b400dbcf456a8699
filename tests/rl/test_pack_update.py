"""The pack's update runner (qed_ray.rl.update): eager, compiled and CUDA-graphed updates are the same update.

torch + numpy + pydantic only: these tests run on the GPU machine too (``QED_TEST_DEVICE=cuda``, marker
``torch_only``), where the graph tests run instead of being skipped.
"""

import os

import numpy as np
import pytest
import torch

from kit import ACT, B, OBS, TEMPERATURES, spec_of

from qed_ray.rl.agents import make_packed_agent
from qed_ray.spec.config import TrainSpec
from qed_ray.rl.update import (PackUpdater, compile_pays, inductor_cache_dir, make_capturable, resolve_mode,
                              use_inductor_cache)
from qed_ray.rl.replay import Replay
from qed_ray.rl.update_metrics import MetricAccumulator

pytestmark = pytest.mark.torch_only

ROWS = 64
SEEDS = (3, 7)
TEMPS = TEMPERATURES
ON = np.ones(2, bool)


def setup(name: str, kind: str, device: torch.device, mode: str = "off", model_every: int = 1,
          seeds: tuple[int, ...] = SEEDS):
    """A pack with a filled replay (same rows and sampling streams every call) and its updater."""
    agent = make_packed_agent(spec_of(name, {"model_every": model_every}), TEMPS[kind], OBS, ACT, device, seeds)
    rngs = [np.random.default_rng(s) for s in seeds]
    replay = Replay(ROWS, OBS, ACT, rngs, device)
    data = np.random.default_rng(0)
    n = len(seeds)
    for _ in range(ROWS):
        replay.add(data.normal(size=(n, OBS)), data.uniform(-1, 1, (n, ACT)), data.normal(size=n),
                   data.normal(size=(n, OBS)), np.zeros(n, bool), np.ones(n, bool))
    acc = MetricAccumulator(agent.metric_layout, agent.device, seeds=n)
    return agent, replay, acc, PackUpdater(agent, replay, acc, mode, B)


@pytest.mark.parametrize("name,model_every", [("sac_ln", 1), ("mad_sac", 2)])
def test_the_eager_runner_is_exactly_the_packs_update_on_the_gathered_batch(name, model_every, device):
    agent, replay, acc, run = setup(name, "qed", device, "off", model_every)
    ref, ref_replay, ref_acc, _ = setup(name, "qed", device, "off", model_every)
    for _ in range(3):
        run(replay.indices(B, ON), agent.noise(B, ON))
        ref_acc.add(ref.update(ref_replay.sample(B, ON), ref.noise(B, ON)))
    a, r = agent.tensors(), ref.tensors()
    assert a.keys() == r.keys()
    for k in a:
        assert torch.equal(a[k], r[k]), k
    assert torch.equal(acc.total, ref_acc.total) and acc.count == ref_acc.count == 3
    assert agent.updates == ref.updates == (3 if name == "mad_sac" else 0)


def test_an_eager_update_on_a_given_batch_keeps_the_memo_tensor_a_graph_writes(device):
    agent, replay, acc, run = setup("mad_sac", "te", device)
    memo = agent.memo["model_metrics"]
    batch = replay.gather(replay.indices(B, ON))
    batch["reward"][1, 0] = float("nan")
    metrics = run.eager(batch, agent.noise(B, ON))
    assert agent.memo["model_metrics"] is memo
    k = len(memo[0])
    torch.testing.assert_close(memo, metrics[:, -k:], rtol=0, atol=0, equal_nan=True)
    assert acc.count == 1
    assert torch.isfinite(metrics[0]).all() and not torch.isfinite(metrics[1]).all()  # the NaN stays in seed 1


def test_a_frozen_seed_is_held_by_the_runner(device):
    agent, replay, _, run = setup("sac_ln", "te", device)
    agent.freeze(0)
    before = {k: v.clone() for k, v in agent.tensors().items() if not k.startswith(("actor_opt", "critic_opt",
                                                                                     "alpha_opt"))}
    run(replay.indices(B, ON), agent.noise(B, ON))
    after = agent.tensors()
    assert all(torch.equal(after[k][0], v[0]) for k, v in before.items())
    moved = [k for k, v in before.items() if not torch.equal(after[k][1], v[1])]
    assert "actor.net.0.weight" in moved and "critic.q1.0.weight" in moved


def test_modes_resolve_from_the_switch_and_the_device():
    agent, *_ = setup("mad_sac", "te", torch.device("cpu"), model_every=2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mode("auto", cpu, agent)[0] == "off"
    assert resolve_mode("compile", cpu, agent)[0] == "compile"
    mode, why = resolve_mode("auto", cuda, agent)  # model_every=2: two branches, no single graph
    assert mode == "off" and "model_every=2" in why
    sac, *_ = setup("sac_ln", "te", cpu)
    assert resolve_mode("auto", cuda, sac) == ("graph", "one CUDA graph per update")
    with pytest.raises(ValueError, match="train.compile: 'graph' needs a CUDA device .*auto, off, compile"):
        resolve_mode("graph", cpu, sac)
    with pytest.raises(ValueError, match="train.compile: 'fast' is not one of auto, off, compile, graph"):
        resolve_mode("fast", cpu, sac)
    with pytest.raises(ValueError, match="PackUpdater mode 'graph' needs a CUDA agent"):
        setup("sac_ln", "te", cpu, "graph")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="model_every=2 needs the eager update"):
            setup("mad_sac", "te", torch.device("cuda"), "graph", model_every=2)


def test_the_switch_is_a_train_setting_with_named_choices():
    assert TrainSpec().compile == "auto"
    assert TrainSpec(compile="off").compile == "off"
    with pytest.raises(ValueError, match="compile\n.*'auto', 'off', 'compile' or 'graph'"):
        TrainSpec(compile="fast")


def test_make_capturable_sets_the_flag_and_keeps_step_counters_beside_their_parameters():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=0.1, foreach=True)
    p.grad = torch.ones(3)
    opt.step()
    make_capturable(opt)
    assert opt.param_groups[0]["capturable"] is True
    assert opt.state[p]["step"].device == p.device and float(opt.state[p]["step"]) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name,kind,model_every,seeds", [("mad_sac", "qed", 2, SEEDS), ("sac_ln", "te", 1, SEEDS[:1])])
def test_the_compiled_update_equals_the_eager_one(name, kind, model_every, seeds, device):
    """inductor (C++ on the CPU) against eager with the same batches and noise: within 1e-5 + 1e-4 relative after
    one update (1e-5 absolute alone failed on MAD-SAC's critic.q2.0.weight) and 1e-3 of each tensor's norm after 20 (float rounding compounds; a wrong kernel is off by orders more). MAD-SAC
    with QED and a model step every second update (its model, both branches, QED's disagreement) and SAC-LN with
    te in a pack of one (the fast Mish's compiled backward, te's temperature step, the vmap-free compiled form a
    single run trains with). Two compiles only: a cold inductor compile of
    one agent takes 20 to 150 s on this CI's two cores (on a GPU, benchmarks/gpu_check.sh checks both agents'
    graphs against eager; benchmarks/README.md has all four agent x temperature pairs compiled on a CPU)."""
    agent, replay, acc, run = setup(name, kind, device, "compile", model_every, seeds)
    ref, ref_replay, ref_acc, ref_run = setup(name, kind, device, "off", model_every, seeds)
    on = np.ones(len(seeds), bool)
    for step in range(20):
        run(replay.indices(B, on), agent.noise(B, on))
        ref_run(ref_replay.indices(B, on), ref.noise(B, on))
        a, r = agent.tensors(), ref.tensors()
        if step == 0:  # Adam's first step is +-lr wherever |grad| >> eps: rounding moves it little, but not 0
            for k in a:
                torch.testing.assert_close(a[k], r[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    for k in a:
        assert float((a[k] - r[k]).norm()) <= 1e-3 * float(r[k].norm()) + 1e-6, k
    assert float((acc.total - ref_acc.total).norm()) <= 1e-3 * float(ref_acc.total.norm())


def test_auto_compiles_on_a_cpu_only_when_the_run_repays_the_compile():
    """CPU ``auto``: eager for a run too short to repay the measured compile, compiled for a long one, decided from
    the spec alone (the same answer every time, so a resumed run chooses as the first run did)."""
    cpu = torch.device("cpu")
    sac, *_ = setup("sac_ln", "te", cpu)
    qed, *_ = setup("sac_ln", "qed", cpu)
    assert compile_pays(sac, 10**9)[0] and not compile_pays(sac, 100)[0]
    payback = {a: next(n for n in (10 ** e for e in range(12)) if compile_pays(a, n)[0]) for a in (sac, qed)}
    assert payback[qed] <= payback[sac]  # QED's extra passes save more per update
    mode, why = resolve_mode("auto", cpu, sac, 100)
    assert mode == "off" and why.startswith("auto: 100 updates < the ~") and why.endswith("s compile on a CPU")
    assert resolve_mode("auto", cpu, sac, 10**9)[0] == "compile" == resolve_mode("auto", cpu, sac, 10**9)[0]
    assert resolve_mode("auto", cpu, sac) == ("off", "auto: eager, the run's length is not known")
    assert resolve_mode("off", cpu, sac, 10**9)[0] == "off"


def test_the_inductor_cache_is_keyed_by_the_code_and_a_set_folder_wins(monkeypatch, tmp_path):
    key = inductor_cache_dir()
    assert key == inductor_cache_dir() and len(key.name) == 16 and key.parent.name.startswith("qed_ray_inductor_")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    use_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    use_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(key)


@pytest.mark.parametrize("name", ["sac_ln", "mad_sac"])
def test_the_graphed_update_equals_the_eager_one_without_a_host_sync(name, device):
    """CUDA only: 12 updates (3 warm-up, 1 capture, 8 replays) against eager, the replays under sync-debug 'error'."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device (QED_TEST_DEVICE=cuda)")
    agent, replay, acc, run = setup(name, "qed", device, "graph")
    ref, ref_replay, ref_acc, ref_run = setup(name, "qed", device, "off")
    for i in range(12):
        idx, noise = replay.indices(B, ON), agent.noise(B, ON)
        ref_run(ref_replay.indices(B, ON), ref.noise(B, ON))
        if i >= 5:
            torch.cuda.set_sync_debug_mode("error")
        try:
            run(idx, noise)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert run.graph is not None and agent.updates == ref.updates
    a, r = agent.tensors(), ref.tensors()
    for k in a:
        torch.testing.assert_close(a[k], r[k], rtol=1e-4, atol=1e-5, msg=k)
    assert acc.count == 12
    torch.testing.assert_close(acc.total, ref_acc.total, rtol=1e-4, atol=1e-5)


def test_device_names_that_mean_one_device_are_the_same_device():
    from qed_ray.rl.update import same_device

    assert same_device("cpu", torch.device("cpu")) and not same_device("cpu", "meta")
    if torch.cuda.is_available():  # the graph path gathers inside the graph only when replay and agent share one
        assert same_device("cuda", f"cuda:{torch.cuda.current_device()}")
