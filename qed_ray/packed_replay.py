"""The replay of a pack: each seed's own ring buffer, held together in one tensor [S, capacity, D].

A row is one transition laid out as ``obs | action | reward | next_obs | terminated`` (D = 2 O + A + 2, float32),
so a decision writes the S seeds' rows with one copy and an update gathers [S, B, D] with one kernel (on the GPU
when the storage fits there). Seed s samples with its own generator exactly as its single-seed
:class:`~qed_ray.replay.ReplayBuffer` does (``rng.integers(0, len, B)``), and persists in the single-seed chunk
format (:func:`~qed_ray.replay.plan_chunk`), so a seed's replay folder is the same whether it was trained alone or
in a pack.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from qed_ray.replay import FIELDS, ChunkWrite, plan_chunk, read_chunks

FLOAT_BYTES = 4
# Share of the GPU's free memory the replay of a pack may take; the rest is for the networks, QED's [S, B N, H]
# activations and the allocator's slack.
GPU_REPLAY_SHARE = 0.5


def row_width(obs_dim: int, action_dim: int) -> int:
    """D: floats per stored transition."""
    return 2 * obs_dim + action_dim + 2


def replay_bytes(seeds: int, capacity: int, obs_dim: int, action_dim: int) -> int:
    """Bytes of a pack's replay storage: S x capacity x D float32 (cheetah-run 17/6, 1M: 168 MB per seed)."""
    return seeds * capacity * row_width(obs_dim, action_dim) * FLOAT_BYTES


def replay_device(device: torch.device, nbytes: int) -> torch.device:
    """Where a pack's replay lives: on the agent's GPU when ``nbytes`` fits in :data:`GPU_REPLAY_SHARE` of its free
    memory (sampling is then one gather kernel), else in host memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(device)
    return device if nbytes <= GPU_REPLAY_SHARE * free else torch.device("cpu")


class PackedReplay:
    """S uniform replay rings, one per seed, each with its own sampling generator.

    Args:
        capacity: transitions kept per seed.
        obs_dim, action_dim: sizes.
        rngs: one sampling generator per seed (what ``build_trainer`` derives for that seed).
        device: where batches go (the agent's device).
        storage_device: where the rows live (default: ``device``).
    """

    def __init__(self, capacity: int, obs_dim: int, action_dim: int, rngs: Sequence[np.random.Generator],
                 device: torch.device, storage_device: torch.device | None = None):
        self.capacity, self.rngs, self.device = capacity, list(rngs), torch.device(device)
        self.n = len(self.rngs)
        widths = {"obs": obs_dim, "action": action_dim, "reward": 1, "next_obs": obs_dim, "terminated": 1}
        ends = np.cumsum([widths[k] for k in FIELDS])
        self.columns = {k: slice(int(e - widths[k]), int(e)) for k, e in zip(FIELDS, ends)}
        self.width = int(ends[-1])
        self.storage = torch.zeros((self.n, capacity, self.width), dtype=torch.float32,
                                   device=storage_device or self.device)
        self.added = np.zeros(self.n, dtype=np.int64)  # per seed: transitions ever added

    def sizes(self) -> np.ndarray:
        """[S] transitions held per seed."""
        return np.minimum(self.added, self.capacity)

    def add(self, obs: np.ndarray, action: np.ndarray, reward: np.ndarray, next_obs: np.ndarray,
            terminated: np.ndarray, active: np.ndarray) -> None:
        """Appends one transition per active seed (arrays [S, ...]; rows of stopped seeds are ignored)."""
        rows = np.concatenate([obs, action, np.asarray(reward, np.float64)[:, None], next_obs,
                               np.asarray(terminated, np.float64)[:, None]], axis=1).astype(np.float32)
        seeds = np.flatnonzero(active)
        pos = self.added[seeds] % self.capacity
        dev = self.storage.device
        self.storage[torch.from_numpy(seeds).to(dev), torch.from_numpy(pos).to(dev)] = \
            torch.from_numpy(rows[seeds]).to(dev)
        self.added[seeds] += 1

    def indices(self, batch_size: int, active: np.ndarray) -> np.ndarray:
        """[S, B] ring positions: seed s's ``rng.integers(0, len_s, B)`` (its single-seed draw); zeros, without a
        draw, for a stopped seed."""
        out = np.zeros((self.n, batch_size), dtype=np.int64)
        for s in np.flatnonzero(active):
            size = min(int(self.added[s]), self.capacity)
            if size == 0:
                raise RuntimeError(f"replay: sample() from the empty buffer of pack seed {s}")
            out[s] = self.rngs[s].integers(0, size, size=batch_size)
        return out

    def gather(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch at positions ``idx`` [S, B]: obs [S, B, O], action [S, B, A], reward [S, B], next_obs,
        terminated [S, B] on :attr:`device`."""
        return self.gather_tensor(torch.from_numpy(idx).to(self.storage.device))

    def gather_tensor(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`gather` at positions ``idx`` [S, B] (int64, on the storage's device): device work only, no host
        sync, so a CUDA graph can capture it when the storage lives on the agent's device."""
        rows = torch.gather(self.storage, 1, idx.unsqueeze(-1).expand(-1, -1, self.width)).to(self.device)
        out = {k: rows[..., c].contiguous() for k, c in self.columns.items()}
        out["reward"], out["terminated"] = out["reward"].squeeze(-1), out["terminated"].squeeze(-1)
        return out

    def sample(self, batch_size: int, active: np.ndarray) -> dict[str, torch.Tensor]:
        """:meth:`gather` at :meth:`indices`."""
        return self.gather(self.indices(batch_size, active))

    # ---- per seed: the single-seed persistence and generator state ------------------------------------------
    def rows(self, s: int, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of seed ``s``'s fields at ring positions ``idx``, shaped as :class:`ReplayBuffer` stores them."""
        r = self.storage[s, torch.from_numpy(idx).to(self.storage.device)].cpu().numpy()
        out = {k: np.ascontiguousarray(r[:, c]) for k, c in self.columns.items()}
        out["reward"], out["terminated"] = out["reward"][:, 0], out["terminated"][:, 0]
        return out

    def plan_save(self, s: int, directory: str | os.PathLike, added: int | None = None) -> ChunkWrite:
        """Seed ``s``'s next chunk for ``directory``, up to ``added`` transitions (default: all it has), with its
        rows copied now (write it on any thread)."""
        added = int(self.added[s]) if added is None else added
        return plan_chunk(directory, added, self.capacity, lambda idx: self.rows(s, idx))

    def load(self, s: int, directory: str | os.PathLike, added: int) -> None:
        """Rebuilds seed ``s``'s ring from its chunks covering [0, added)."""
        chunks = read_chunks(directory, added, self.capacity)
        dev = self.storage.device
        for idx, fields in chunks:
            cols = [np.asarray(fields[k], np.float32).reshape(len(idx), -1) for k in FIELDS]
            self.storage[s, torch.from_numpy(idx).to(dev)] = torch.from_numpy(np.concatenate(cols, 1)).to(dev)
        self.added[s] = added

    def rng_state(self, s: int) -> dict:
        """Seed ``s``'s sampler state (JSON-serialisable, as :meth:`ReplayBuffer.rng_state`)."""
        return self.rngs[s].bit_generator.state

    def set_rng_state(self, s: int, state: dict) -> None:
        """Restores :meth:`rng_state`."""
        self.rngs[s].bit_generator.state = state
