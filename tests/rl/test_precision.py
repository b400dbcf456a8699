"""train.precision and QED's critic products (qed_ray.rl.precision) and their numerics gate (benchmarks/precision_gate.py).

The torch_only tests run on the GPU machine too (``QED_TEST_DEVICE=cuda``): there the gate runs on the tensor cores
inside a CUDA graph, against FP64 on the same inputs, with the same expectations as the CPU emulation.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qed_ray.rl.agents import make_agent
from qed_ray.rl.agents.base import params_of
from kit import TEMPERATURES

from qed_ray.spec.config import RunSpec, TrainSpec, agent_spec
from qed_ray.spec.field_hints import format_validation_error
from qed_ray.spec.naming import identity, parse_variant
from qed_ray.rl.precision import (CUDA_DEFAULT, apply_matmul_precision, resolve_precision, round_tf32, split_linear,
                               split_tf32, tf32_linear)
from benchmarks.precision_gate import GateSettings, run_gate

ROOT = Path(__file__).parents[2]
QED = TEMPERATURES["qed"]


def bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float32).view(torch.int32)[0]) & 0xFFFFFFFF


def rounded_bits(pattern: int, rounding: str) -> int:
    x = torch.tensor([pattern], dtype=torch.int64).to(torch.int32).view(torch.float32)
    return int(round_tf32(x, rounding).view(torch.int32)[0]) & 0xFFFFFFFF


# input bits -> (rna, rne, rz): ties are low 13 bits == 0x1000
CASES = {
    0x3F800000: (0x3F800000, 0x3F800000, 0x3F800000),  # 1.0: TF32 already
    0x3F801000: (0x3F802000, 0x3F800000, 0x3F800000),  # 1 + 2^-11, a tie, even below: away / even / down
    0x3F803000: (0x3F804000, 0x3F804000, 0x3F802000),  # 1 + 3 * 2^-11, a tie, odd below: both nearest go up
    0x3F801001: (0x3F802000, 0x3F802000, 0x3F800000),  # just above the tie: nearest goes up
    0x3F800FFF: (0x3F800000, 0x3F800000, 0x3F800000),  # just below the tie: nearest goes down
    0xBF801000: (0xBF802000, 0xBF800000, 0xBF800000),  # -(1 + 2^-11): away from zero is down
    0x3FFFFFFF: (0x40000000, 0x40000000, 0x3FFFE000),  # 2 - 2^-23: the carry moves to the next binade
    0x7F7FFFFF: (0x7F800000, 0x7F800000, 0x7F7FE000),  # the largest float rounds to inf
    0x00000001: (0x00000000, 0x00000000, 0x00000000),  # the smallest subnormal rounds to +0
    0x7F800000: (0x7F800000, 0x7F800000, 0x7F800000),  # inf
    0x7F800001: (0x7F800001, 0x7F800001, 0x7F800001),  # a NaN whose payload sits in the low bits stays NaN
}


@pytest.mark.torch_only
@pytest.mark.parametrize("pattern", CASES)
def test_tf32_rounding_of_known_bit_patterns(pattern):
    assert tuple(rounded_bits(pattern, r) for r in ("rna", "rne", "rz")) == CASES[pattern]


@pytest.mark.torch_only
def test_the_split_is_exact_to_2_to_the_minus_22_and_both_parts_are_tf32(device):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(device) * 100
    hi, lo = split_tf32(x)
    assert all(int((t.view(torch.int32) & 0x1FFF).abs().max()) == 0 for t in (hi, lo))
    assert float(((hi.double() + lo.double() - x.double()) / x.double()).abs().max()) <= 2.0 ** -22
    with pytest.raises(TypeError, match="float32"):
        round_tf32(x.double())


@pytest.mark.torch_only
def test_3xtf32_products_are_fp32_accurate_and_tf32_products_are_not(device):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(64, 256, generator=g), torch.randn(128, 256, generator=g), torch.randn(128, generator=g)
    x, w, b = x.to(device), w.to(device), b.to(device)
    exact = F.linear(x.double(), w.double(), b.double())

    def err(y):
        return float((y.double() - exact).abs().mean())

    with torch.no_grad():
        fp32, three, one = err(F.linear(x, w, b)), err(split_linear(x, w, b)), err(tf32_linear(x, w, b))
        emulated = tf32_linear(x, w, b, emulate=True)
        tf32_operands = split_linear(round_tf32(x), round_tf32(w), b, emulate=True)
    assert three <= 2 * fp32 and one >= 100 * fp32
    assert torch.equal(emulated, F.linear(round_tf32(x), round_tf32(w), b))
    assert torch.equal(tf32_operands, F.linear(round_tf32(x), round_tf32(w), b))  # lo = 0: one product remains
    with pytest.raises(RuntimeError, match="forward-only"):
        split_linear(x, w.requires_grad_(True), b)


@pytest.mark.torch_only
def test_the_gate_passes_3xtf32_and_fails_tf32_on_every_case(device):
    settings = GateSettings(hidden=32, states=128, q_levels=(10.0, 120.0, 400.0))
    result = run_gate(settings, device, graph=device.type == "cuda")
    assert [(c.q_level, c.regime) for c in result.cases] == [(q, r) for q in (10.0, 120.0, 400.0)
                                                             for r in ("floor", "mid", "cap")]
    assert result.passed("3xtf32") and all(c.passes("3xtf32") for c in result.cases)
    assert not any(c.passes("tf32") for c in result.cases)
    for c in result.cases:
        assert c.errors["fp32"].mean > 0 and c.errors["tf32"].mean > 100 * c.errors["fp32"].mean
        assert c.q_abs_min < c.q_level < c.q_abs_max
        share = {"floor": (c.frac_floor, 0.2, 0.6), "mid": (c.frac_floor + c.frac_cap, 0.0, 0.1),
                 "cap": (c.frac_cap, 0.2, 0.6)}[c.regime]
        assert share[1] <= share[0] <= share[2]
    floor = [c for c in result.cases if c.regime == "floor" and c.q_level == 120.0][0]
    assert floor.errors["tf32"].mean > 1.0  # near the floor at |Q| ~ 120, TF32 doubles alpha on average
    assert result.to_json()["passed"] == {"3xtf32": True, "tf32": False}
    assert len(result.table().splitlines()) == 2 + len(result.cases)


@pytest.mark.torch_only
def test_only_qeds_critic_passes_change_precision(device):
    agent = make_agent(agent_spec(name="sac_ln", hidden=16, batch_size=8), QED, 5, 2, device, 0)
    fn, g = agent.fn, torch.Generator().manual_seed(2)
    batch = {k: torch.randn(8, d, generator=g).to(device) for k, d in (("obs", 5), ("action", 2), ("next_obs", 5))}
    batch.update(reward=torch.rand(8, generator=g).to(device), terminated=torch.zeros(8, device=device))
    noise = [torch.randn(n, 2, generator=g).to(device) for n in (8, 32, 8, 32)]
    p = agent.params()
    out = {}
    for precision in ("fp32", "tf32"):
        fn.qed_precision = precision
        _, metrics = fn.critic_loss(p, params_of(agent.critic_target), batch, noise[0], noise[1])
        actor, logp, alpha = fn.actor_loss(p["actor"], p["critic"], p["temperature"], batch["obs"], noise[2],
                                           noise[3])
        out[precision] = (metrics, actor.detach(), logp.detach(), alpha)
    names = agent.metric_layout.names
    (m32, a32, logp32, alpha32), (m_tf, a_tf, logp_tf, alpha_tf) = out["fp32"], out["tf32"]
    for name in ("q/mean", "q/abs_diff_mean", "q/abs_diff_max"):  # the TD loss's online pass: untouched
        assert m32[names.index(name)] == m_tf[names.index(name)]
    assert m32[names.index("alpha/target_mean")] != m_tf[names.index("alpha/target_mean")]
    assert torch.equal(logp32, logp_tf) and not torch.equal(alpha32, alpha_tf)
    # the actor's own critic pass is FP32 both times: the losses differ by exactly the alpha term
    assert float(a_tf - a32) == pytest.approx(float(((alpha_tf - alpha32) * logp32).mean()), rel=1e-4, abs=1e-6)


@pytest.mark.torch_only
def test_a_packs_vmapped_qed_pass_is_each_seeds_pass(device):
    agents = [make_agent(agent_spec(name="sac_ln", hidden=16, batch_size=8), QED, 5, 2, device, s) for s in (0, 1)]
    fn = agents[0].fn
    fn.qed_precision = "3xtf32"
    g = torch.Generator().manual_seed(3)
    states, actions = torch.randn(6, 5, generator=g).to(device), torch.rand(24, 2, generator=g).to(device) * 2 - 1
    stacked = {k: torch.stack([params_of(a.critic)[k].detach() for a in agents]) for k in params_of(agents[0].critic)}
    with torch.no_grad():
        packed = torch.func.vmap(lambda p: fn.qed_q_pair(p, states, actions, 4))(stacked)
        single = [fn.qed_q_pair({k: v.detach() for k, v in params_of(a.critic).items()}, states, actions, 4)
                  for a in agents]
        fn.qed_precision = "fp32"
        plain = fn.qed_q_pair({k: v.detach() for k, v in params_of(agents[0].critic).items()}, states, actions, 4)
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(packed[j][i], single[i][j], rtol=1e-6, atol=1e-6)
    assert not torch.equal(plain[0], single[0][0])  # the split products are not the plain ones, bit for bit


@pytest.mark.torch_only
def test_resolving_the_precision_of_a_run():
    assert resolve_precision("auto", "cpu") == ("fp32", "auto on cpu")
    assert resolve_precision("fp32", "cpu") == ("fp32", "fp32 on cpu")
    for asked in ("3xtf32", "tf32"):
        assert resolve_precision(asked, "cpu") == ("fp32", f"train.precision {asked!r} is ignored on cpu: it has no "
                                                           f"TF32 tensor cores, every product is IEEE FP32")
    assert resolve_precision("auto", "cuda", "graph")[0] == CUDA_DEFAULT == "fp32"
    assert [resolve_precision(p, "cuda:0", "graph")[0] for p in ("fp32", "3xtf32", "tf32")] == ["fp32", "3xtf32",
                                                                                              "tf32"]
    assert resolve_precision("tf32", "cuda", "compile")[0] == "tf32"
    with pytest.raises(ValueError, match=r"train.precision: '3xtf32' switches TF32 on .* use train.compile auto"):
        resolve_precision("3xtf32", "cuda", "compile")
    with pytest.raises(ValueError, match="train.precision: 'bf16' is not one of auto, fp32, 3xtf32, tf32"):
        resolve_precision("bf16", "cpu")


@pytest.mark.torch_only
def test_tf32_sets_the_process_wide_matmul_precision_and_the_others_restore_fp32():
    try:
        apply_matmul_precision("tf32")
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
        apply_matmul_precision("3xtf32")
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    finally:
        apply_matmul_precision("fp32")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


@pytest.mark.torch_only
def test_train_precision_is_validated_and_is_part_of_a_runs_identity():
    with pytest.raises(ValueError) as e:
        TrainSpec(precision="bf16")
    assert format_validation_error(e.value, "train.") == ("train.precision: Input should be 'auto', 'fp32', '3xtf32' "
                                                         "or 'tf32' (got 'bf16')")
    plain = RunSpec(task="cartpole-balance")
    assert plain.train.precision == "auto" and "train.precision" not in identity(plain)
    tf32 = RunSpec(task="cartpole-balance", train=TrainSpec(precision="tf32"))
    assert identity(tf32)["train.precision"] == "tf32"


def test_ablations_cross_fp32_and_tf32_and_each_precision_is_its_own_group():
    from qed_ray.spec.sweep import load_spec  # PyYAML: not on the GPU machine that runs the torch_only tests

    trials = load_spec(ROOT / "sweeps" / "ablations.yaml").trials()  # its cells: test_options.py
    groups = {t.name.rsplit("/", 1)[0] for t in trials}
    assert len(groups) == 72 and all("+precision=" in g for g in groups)
    te = [t for t in trials if t.run.temperature.kind == "te" and t.run.train.precision == "tf32"][0]
    assert parse_variant(te.variant)["train"] == {"precision": "tf32"}


def test_a_cpu_run_ignores_the_precision_and_says_so(tiny_run):
    from qed_ray.rl.trainer import build_trainer

    specs = [tiny_run(seed=s, temperature={"kind": "qed", "k": 0.2}, train={"precision": "3xtf32"}) for s in (0, 1)]
    lines = []
    pack = build_trainer(specs, lambda *a, **k: None, None, log=lines.append)
    try:
        reason = "train.precision '3xtf32' is ignored on cpu: it has no TF32 tensor cores, every product is IEEE FP32"
        updates = specs[0].train.decisions - specs[0].train.warmup_decisions  # a tiny run: too short to compile
        assert f"update mode off (auto: {updates} updates < the ~" in lines[-1]
        assert f"s compile on a CPU); precision fp32 ({reason})" in lines[-1]
        assert pack.precision == "fp32" and pack.agent.template.fn.qed_precision == "fp32"
        assert [(s.precision, s.update_mode) for s in pack.summaries()] == [("fp32", "off")] * 2
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        pack.close()
