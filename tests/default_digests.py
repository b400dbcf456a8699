"""Pinned results of tiny default runs: new options and refactors must leave the defaults' numbers unchanged.

``python tests/default_digests.py`` prints ``{case: fingerprint}`` as JSON; ``tests/data/default_digests.json`` holds
what it printed at the commit that pinned them. A case's values are every parameter and optimiser-free state of the
agent after the run, the update metrics and (trainer case) the evaluation returns, flattened to one float64 vector;
its fingerprint is the vector's L2 norm and :data:`PROJECTIONS` fixed random projections of it (scaled by
1/sqrt(n)). Two runs with the same random streams and maths give fingerprints equal to within :data:`RTOL` of the
norm: the last bits of float32 results depend on the CPU's instruction set (AVX2 or AVX-512 kernels) and, in a pack,
on how vmap orders a reduction, and 800 updates compound them to about 1e-5 (a pack of one against the single-seed
trainer of qed_ray 0.1: 1.2e-5), while any change of a random stream or of the maths moves them by orders of
magnitude more.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from kit import ACT, B, OBS, QED, spec_of
from oracles.single_seed import single_update

UPDATE_CASES = {"sac_ln_te": ("sac_ln", {"kind": "te"}), "sac_ln_qed": ("sac_ln", QED),
                "mad_sac_qed": ("mad_sac", QED)}
PROJECTIONS = 16
RTOL = 1e-4  # of the vector's norm: float32 rounding and the CPU's instruction set, not a change of the numbers


def fingerprint(parts) -> dict:
    """``{"n", "norm", "projections"}`` of the values in ``parts`` (tensors or arrays)."""
    v = np.concatenate([np.asarray(t.detach().cpu().numpy() if torch.is_tensor(t) else t, np.float64).ravel()
                        for t in parts])
    w = np.random.default_rng(0).standard_normal((PROJECTIONS, v.size)) / np.sqrt(v.size)
    return {"n": int(v.size), "norm": float(np.linalg.norm(v)), "projections": (w @ v).tolist()}


def same(a: dict, b: dict, rtol: float = RTOL) -> bool:
    """Whether two fingerprints are of the same numbers (up to ``rtol`` of the norm)."""
    scale = rtol * max(a["norm"], 1e-12)
    return a["n"] == b["n"] and abs(a["norm"] - b["norm"]) <= scale and \
        all(abs(x - y) <= scale for x, y in zip(a["projections"], b["projections"]))


def _agent_state(modules) -> list[torch.Tensor]:
    return [v for _, m in sorted(modules.items()) for _, v in sorted(m.state_dict().items())]


def update_values(name: str, temperature: dict, steps: int = 6) -> list:
    """``steps`` float32 updates of one seed's tiny agent on seeded batches, noise from its own generator."""
    from qed_ray.spec.config import TemperatureSpec
    from qed_ray.rl.agents import make_agent

    agent = make_agent(spec_of(name), TemperatureSpec(**temperature), OBS, ACT, torch.device("cpu"), 0)
    metrics = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        batch = {"obs": torch.randn(B, OBS, generator=g), "action": torch.rand(B, ACT, generator=g) * 2 - 1,
                 "reward": torch.rand(B, generator=g) * 2, "next_obs": torch.randn(B, OBS, generator=g),
                 "terminated": (torch.rand(B, generator=g) < 0.1).float()}
        metrics.append(single_update(agent, batch))
    return metrics + _agent_state(agent.modules())


def trainer_values(temperature: dict) -> list:
    """A tiny SAC-LN run on cartpole-balance through the trainer (env, replay, evaluation): a pack of one seed."""
    from qed_ray.spec.config import RunSpec
    from qed_ray.rl.trainer import build_trainer

    spec = RunSpec.model_validate({
        "task": "cartpole-balance", "seed": 3, "agent": {"hidden": 16, "batch_size": 16},
        "temperature": temperature,
        "train": {"env_steps": 1000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 200}})
    reports = []
    trainer = build_trainer([spec], lambda m, save: reports.append(m[0]), None, log=lambda s: None)
    trainer.run()
    trainer.close()
    returns = [r["eval/return_mean"] for r in reports]
    state = [v[0] for _, sd in sorted(trainer.agent.state.items()) for _, v in sorted(sd.items())]
    return [np.array(returns, dtype=np.float64), *state]


def all_fingerprints() -> dict[str, dict]:
    """Every case's fingerprint."""
    torch.set_num_threads(1)
    out = {case: fingerprint(update_values(*args)) for case, args in UPDATE_CASES.items()}
    out["trainer_sac_ln_qed"] = fingerprint(trainer_values(QED))
    return out


if __name__ == "__main__":
    print(json.dumps(all_fingerprints(), indent=1))
