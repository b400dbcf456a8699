"""Shared test settings: headless MuJoCo, one torch thread, Ray token auth with a throwaway token, and a throwaway
results key.

Every Ray cluster the tests start (embedded ``ray.init``, ``ray start``, ``ray.cluster_utils.Cluster``) listens on
all interfaces: Ray 2.60 binds its GCS, raylet and worker gRPC servers to 0.0.0.0 whatever ``--node-ip-address``
says. So the tests never disable auth: this session gets a fresh random token, in the environment only (never
written to ``~/.ray/auth_token``), which every Ray process and client started by the tests inherits. A neighbour
on the network who can reach those ports cannot run code on them without it.
"""

import atexit
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "disable")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Forced, not defaulted: an exported RAY_AUTH_MODE=disabled or a real cluster's token must not leak into the tests.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
# The results key (qed_ray.service.results_key) of this session: never the user's own ~/.config/qed_ray/results.key.
# Created by the first driver or helper that needs it; every subprocess inherits the variable.
_KEY_DIR = tempfile.mkdtemp(prefix="qed-test-key-")
atexit.register(shutil.rmtree, _KEY_DIR, True)
os.environ["QED_RESULTS_KEY_FILE"] = str(Path(_KEY_DIR) / "results.key")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# Each slow file's seconds in a recorded run (scripts/slow_order.py writes it from that run's --durations).
DURATIONS = Path(__file__).parent / "data" / "slow_durations.json"


def file_seconds(path: Path = DURATIONS) -> dict[str, float]:
    """``{test file relative to the repository: seconds}`` of :data:`DURATIONS`, checked where it is read."""
    seconds = json.loads(path.read_text()).get("seconds")
    if not isinstance(seconds, dict) or not all(isinstance(s, (int, float)) and s >= 0 for s in seconds.values()):
        raise pytest.UsageError(f"{path}: 'seconds' must map test files to seconds >= 0; regenerate it with "
                                f"scripts/slow_order.py (docs/ci.md)")
    return seconds


def pytest_collection_modifyitems(items):
    """Orders the collected tests by their file's recorded seconds, longest first, so that the pytest-xdist workers
    (scripts/test.sh) end together; files the run did not record keep their order after them (the sort is stable:
    a file's own order stays)."""
    seconds = file_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


@pytest.fixture
def tiny_run():
    """A RunSpec factory with tiny networks and a short budget (fast on CPU)."""
    from qed_ray.spec.config import RunSpec

    def make(**overrides):
        raw = {
            "task": "cartpole-balance", "seed": 0,
            "agent": {"hidden": 32, "batch_size": 32},
            "temperature": {"kind": "te"},
            "train": {"env_steps": 4000, "eval_every": 2000, "eval_episodes": 1, "warmup_decisions": 200},
        }
        for key, value in overrides.items():
            if isinstance(value, dict):
                raw[key] = {**raw.get(key, {}), **value}
            else:
                raw[key] = value
        return RunSpec.model_validate(raw)

    return make


TEMPLATE_FINISHED = ["cartpole-balance/sac_ln/te/0", "cartpole-balance/sac_ln/te/1", "cartpole-balance/sac_ln/qed0.2/0"]
TEMPLATE_RUNNING = {"cartpole-balance/sac_ln/qed0.2/1": 1000}


@pytest.fixture(scope="session")
def sweep_template(tmp_path_factory):
    """A hand-built sweep folder (tests/folder_helpers.py): cartpole-balance sac_ln te seeds 0, 1 and qed0.2 seed 0
    finished, qed0.2 seed 1 at 1000 of 2000 env steps; copy it before changing it."""
    from folder_helpers import new_sweep

    from qed_ray.records.layout import SweepDir

    layout = SweepDir(tmp_path_factory.mktemp("template") / "sweep")
    new_sweep(layout, TEMPLATE_FINISHED, TEMPLATE_RUNNING)
    return layout.root


@pytest.fixture
def sweep_copy(sweep_template, tmp_path):
    """A private copy of the hand-built sweep folder."""
    import shutil

    from qed_ray.records.layout import SweepDir

    return SweepDir(shutil.copytree(sweep_template, tmp_path / "sweep"))


@pytest.fixture(scope="session")
def ray_head():
    """One Ray head from ``ray start`` (this machine's CPUs, no dashboard), shared by the slow tests whose sweep
    drivers need no cluster of their own: a driver run with ``ray_head.env(...)`` joins it instead of starting an
    embedded Ray, as a driver on a real cluster does (tests/ray_cluster.py: isolated folder, token auth)."""
    from types import SimpleNamespace

    from ray_cluster import ray_env, short_tmp, start_head

    with short_tmp() as tmp:
        address = start_head(tmp)
        yield SimpleNamespace(address=address, tmp=tmp, env=lambda **extra: ray_env(tmp, address, **extra))


@pytest.fixture
def device():
    """The torch device of the ``torch_only`` tests: ``QED_TEST_DEVICE`` (default cpu; the GPU check sets cuda)."""
    return torch.device(os.environ.get("QED_TEST_DEVICE", "cpu"))
