"""Digests of tiny default runs, to pin that new options leave the defaults' results unchanged bit for bit.

``python tests/default_digests.py`` prints ``{case: sha256}`` as JSON; ``tests/data/default_digests.json`` holds
what it printed at commit 20a91d0 (before issue 18's options), run with
``PYTHONPATH=<git archive of 20a91d0> python tests/default_digests.py``. A case's digest covers every parameter
and optimiser-free state of the agent after the run, the update metrics and (trainer cases) the evaluation
returns, all as exact bytes: the same digest means the same floating-point results.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

OBS, ACT, B = 5, 2, 16
TINY_MAD = {"latent_dim": 16, "encoder_hidden": 16, "model_hidden": 16, "num_bins": 21, "vmin": -10.0,
            "vmax": 10.0}
QED = {"kind": "qed", "k": 0.2, "n_actions": 4, "alpha_max": 0.5, "init_alpha": 0.02}
UPDATE_CASES = {"sac_ln_te": ("sac_ln", {"kind": "te"}), "sac_ln_qed": ("sac_ln", QED),
                "mad_sac_qed": ("mad_sac", QED)}


def _digest(parts) -> str:
    h = hashlib.sha256()
    for t in parts:
        h.update(np.ascontiguousarray(t.detach().cpu().numpy() if torch.is_tensor(t) else np.asarray(t)).tobytes())
    return h.hexdigest()


def _agent_state(agent) -> list[torch.Tensor]:
    return [v for _, m in sorted(agent.modules().items()) for _, v in sorted(m.state_dict().items())]


def update_digest(name: str, temperature: dict, steps: int = 6) -> str:
    """``steps`` float32 updates of a tiny agent on seeded batches, noise from the agent's own generator."""
    from qed_ray.agents import make_agent
    from qed_ray.config import MadSpec, TemperatureSpec
    from qed_ray.config import agent_spec as make_agent_spec

    extra = {"mad": MadSpec(**TINY_MAD)} if name == "mad_sac" else {}
    spec = make_agent_spec(name=name, hidden=16, batch_size=B, **extra)
    agent = make_agent(spec, TemperatureSpec(**temperature), OBS, ACT, torch.device("cpu"), 0)
    metrics = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        batch = {"obs": torch.randn(B, OBS, generator=g), "action": torch.rand(B, ACT, generator=g) * 2 - 1,
                 "reward": torch.rand(B, generator=g) * 2, "next_obs": torch.randn(B, OBS, generator=g),
                 "terminated": (torch.rand(B, generator=g) < 0.1).float()}
        metrics.append(agent.update(batch))
    return _digest(metrics + _agent_state(agent))


def trainer_digest(temperature: dict) -> str:
    """A tiny SAC-LN run on cartpole-balance through the trainer (env, replay, evaluation)."""
    from qed_ray.config import RunSpec
    from qed_ray.trainer import build_trainer

    spec = RunSpec.model_validate({
        "task": "cartpole-balance", "seed": 3, "agent": {"hidden": 16, "batch_size": 16},
        "temperature": temperature,
        "train": {"env_steps": 1000, "eval_every": 1000, "eval_episodes": 1, "warmup_decisions": 200}})
    reports = []
    trainer = build_trainer(spec, lambda m, save: reports.append(m), replay_dir=None, log=lambda s: None)
    trainer.run()
    returns = [r["eval/return_mean"] for r in reports if "eval/return_mean" in r]
    return _digest([np.array(returns, dtype=np.float64), *_agent_state(trainer.agent)])


def all_digests() -> dict[str, str]:
    """Every case's digest."""
    torch.set_num_threads(1)
    out = {case: update_digest(*args) for case, args in UPDATE_CASES.items()}
    out["trainer_sac_ln_qed"] = trainer_digest(QED)
    return out


if __name__ == "__main__":
    print(json.dumps(all_digests(), indent=1))
