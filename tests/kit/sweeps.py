"""The one sweep-spec builder: a small valid sweep (one task, two seeds, SAC-LN with 16 hidden units, te, 2,000 env
steps) with whole top-level fields replaced (a test module's own base mapping first, then single fields), as a model
or as the YAML file a CLI reads."""

from __future__ import annotations

from pathlib import Path

import yaml

from qed_ray.spec.sweep import SweepSpec

TRAIN = {"env_steps": 2000, "eval_every": 1000, "warmup_decisions": 100}
SWEEP = {"name": "s", "tasks": ["cartpole-balance"], "seeds": 2,
         "agents": [{"name": "sac_ln", "overrides": {"hidden": 16}, "temperatures": [{"kind": "te"}]}],
         "train": TRAIN}


def sweep_raw(*bases: dict, **changes) -> dict:
    """:data:`SWEEP` with the top-level fields of each of ``bases``, then of ``changes``, replaced whole (a ``train``
    given is the whole block: start from :data:`TRAIN` to change one setting)."""
    raw = dict(SWEEP)
    for base in bases:
        raw.update(base)
    return {**raw, **changes}


def sweep_spec(*bases: dict, **changes) -> SweepSpec:
    """The validated :class:`SweepSpec` of :func:`sweep_raw`."""
    return SweepSpec.model_validate(sweep_raw(*bases, **changes))


def sweep_file(path: Path, *bases: dict, **changes) -> Path:
    """Writes :func:`sweep_raw` to the YAML file ``path`` (a CLI's input) and returns it."""
    path.write_text(yaml.safe_dump(sweep_raw(*bases, **changes)))
    return path
