"""The tiny settings every agent-level test builds from: sizes, temperatures, MAD-SAC's world model, agent specs
and seeded synthetic batches."""

from __future__ import annotations

import torch

from qed_ray.spec.config import MadSpec, TemperatureSpec, agent_spec

OBS, ACT, B = 5, 2, 16  # observation and action sizes of the synthetic batches, and their batch size
QED = {"kind": "qed", "k": 0.2, "n_actions": 4, "alpha_max": 0.5, "init_alpha": 0.02}  # QED with N = 4 samples
# "qed" measures QED at s' for the TD target too (target_alpha: qed, the default before App. C's floor became it),
# so the maths tests cover every QED pass and match the format-1 oracle (tests/oracles/reference_update.py)
TEMPERATURES = {"te": TemperatureSpec(kind="te"), "fixed": TemperatureSpec(kind="fixed", alpha=0.05),
                "qed": TemperatureSpec(**QED, target_alpha="qed")}
TINY_MAD = {"latent_dim": 16, "encoder_hidden": 16, "model_hidden": 16, "num_bins": 21, "vmin": -10.0,
            "vmax": 10.0}


def tiny_mad(**overrides) -> MadSpec:
    """MAD-SAC's world-model settings at test size (``overrides`` replace single fields)."""
    return MadSpec(**{**TINY_MAD, **overrides})


def spec_of(name: str, mad: dict | None = None, **overrides):
    """A tiny agent spec (16 hidden units, batch :data:`B`); MAD-SAC gets :func:`tiny_mad` with ``mad``'s fields."""
    extra = {"mad": tiny_mad(**(mad or {}))} if name == "mad_sac" else {}
    return agent_spec(name=name, **{"hidden": 16, "batch_size": B, **extra, **overrides})


def batch_of(seed: int, b: int = B, lead: tuple[int, ...] = (), dtype=torch.float32) -> dict[str, torch.Tensor]:
    """A seeded synthetic batch: observations N(0, 1) [*lead, b, OBS], actions U(-1, 1), rewards U(0, 2), no
    terminal transitions."""
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(*lead, b, OBS, generator=g, dtype=dtype),
            "action": torch.rand(*lead, b, ACT, generator=g, dtype=dtype) * 2 - 1,
            "reward": torch.rand(*lead, b, generator=g, dtype=dtype) * 2,
            "next_obs": torch.randn(*lead, b, OBS, generator=g, dtype=dtype),
            "terminated": torch.zeros(*lead, b, dtype=dtype)}
