"""Replay: one uniform ring per seed of a pack, held together in one tensor [S, capacity, D], and append-only
persistence (docs/design.md, "Replay")."""

from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from qed_ray.records.atomic import TMP_MARK, atomic_file
from qed_ray.records.checkpoint import CheckpointError
from qed_ray.spec.replay_memory import FLOAT_BYTES, replay_bytes, replay_capacity, row_width  # noqa: F401 - the API

FIELDS = ("obs", "action", "reward", "next_obs", "terminated")
CHUNK_RE = re.compile(r"chunk_(\d{10})_(\d{10})\.npz$")
_MASK64 = (1 << 64) - 1
HOLDOUT_KEY = 0x5EED_0D0E_4E1D_0005  # keeps the hold-out draw apart from every other use of the run seed


def holdout_draw(seed: int, decision: int) -> float:
    """A uniform number in [0, 1) fixed by (run seed, decision index): splitmix64 of both. Stateless, so a resumed
    run and every seed of a pack hold out exactly what one uninterrupted run does, with no stream to checkpoint."""
    z = (HOLDOUT_KEY ^ (seed << 32) ^ decision) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = ((z ^ (z >> shift)) * mult) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def keeps_transition(train, seed: int, decision: int, truncated: bool) -> bool:
    """Whether the transition of ``decision`` (0-based) of the run of ``seed`` enters its replay buffer: always,
    unless ``train.holdout_fraction`` holds it out or, with ``train.mask_time_limits``, it ends an episode at its
    time limit (``truncated``), two MAD-TD details (docs/mad_sac.md, "Departures from the MAD-TD code"). MAD-TD
    stores the latter with loss weight 0; dropping it differs only in that its actor step still reads the start
    state, one row in 500."""
    if train.mask_time_limits and truncated:
        return False
    return not (train.holdout_fraction and holdout_draw(seed, decision) < train.holdout_fraction)


# Share of the GPU's free memory the replay of a pack may take; the rest is for the networks, QED's [S, B N, H]
# activations and the allocator's slack.
GPU_REPLAY_SHARE = 0.5


def replay_device(device: torch.device, nbytes: int) -> torch.device:
    """Where a pack's replay lives: on the agent's GPU when ``nbytes`` fits in :data:`GPU_REPLAY_SHARE` of its free
    memory (sampling is then one gather kernel), else in host memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(device)
    return device if nbytes <= GPU_REPLAY_SHARE * free else torch.device("cpu")


class Replay:
    """S uniform replay rings of ``capacity`` transitions, one per seed of a pack, each with its own sampling
    generator; batches go to ``device``, the rows live on ``storage_device`` (default: ``device``)."""

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
        """[S, B] ring positions: seed s's ``rng.integers(0, len_s, B)``; zeros, without a draw, for a stopped seed."""
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
        return self.gather(self.indices(batch_size, active))

    # ---- per seed: persistence and generator state ------------------------------------------------------------
    def rows(self, s: int, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Copies of seed ``s``'s fields at ring positions ``idx``: obs [n, O], action [n, A], reward [n], next_obs,
        terminated [n]."""
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
        """Seed ``s``'s sampler state (JSON)."""
        return self.rngs[s].bit_generator.state

    def set_rng_state(self, s: int, state: dict) -> None:
        self.rngs[s].bit_generator.state = state


def list_chunks(directory: Path) -> list[tuple[int, int, Path]]:
    """``(start, end, path)`` of every chunk file in ``directory``, ordered by start."""
    out = []
    if directory.exists():
        for p in directory.iterdir():
            m = CHUNK_RE.search(p.name)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(out)


@dataclass
class ChunkWrite:
    """One replay chunk ready to be written: the fields already copied, so the writing may happen on another
    thread while training goes on (:func:`plan_chunk`)."""

    directory: Path
    start: int
    end: int
    fields: dict[str, np.ndarray] | None  # None: nothing new since the last chunk
    stale: list[Path]  # chunks past ``end`` left by a run that crashed after its last checkpoint

    def write(self) -> int:
        """Deletes the stale chunks and writes this one (atomically: temp file, fsync, rename); returns bytes."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in self.stale:
            path.unlink(missing_ok=True)
        if self.fields is None:
            return 0
        path = self.directory / f"chunk_{self.start:010d}_{self.end:010d}.npz"
        with atomic_file(path) as tmp:
            np.savez(tmp, **self.fields)
        return path.stat().st_size


def plan_chunk(directory: str | os.PathLike, added: int, capacity: int,
               rows: Callable[[np.ndarray], dict[str, np.ndarray]]) -> ChunkWrite:
    """The chunk that brings ``directory`` up to ``added`` transitions ever added, its rows copied now by
    ``rows(ring idx)`` (those older than ``capacity`` are gone from the ring and are not written)."""
    directory = Path(directory)
    saved, stale = 0, []
    for start, end, path in list_chunks(directory):
        if end > added:
            stale.append(path)
        else:
            saved = max(saved, end)
    if saved == added:
        return ChunkWrite(directory, saved, added, None, stale)
    saved = max(saved, added - capacity)
    return ChunkWrite(directory, saved, added, rows(np.arange(saved, added) % capacity), stale)


def read_chunks(directory: str | os.PathLike, added: int, capacity: int
                ) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """``(ring idx, fields)`` of the chunks covering transitions [0, added), in order, each read when reached.
    CheckpointError: chunks short of ``added`` (before anything is read), or a damaged one (when reached)."""
    chunks = [(s, e, p) for s, e, p in list_chunks(Path(directory)) if e <= added]
    covered = max((e for _, e, _ in chunks), default=0)
    if covered != added:
        raise CheckpointError(f"{directory}: replay chunks cover {covered} transitions, checkpoint needs {added}")
    return ((np.arange(start, end) % capacity, _read_chunk(path, end - start)) for start, end, path in chunks)


def _read_chunk(path: Path, rows: int) -> dict[str, np.ndarray]:
    """A chunk's arrays; a truncated, corrupt (zip CRC) or incomplete chunk raises CheckpointError naming it."""
    try:
        with np.load(path) as z:
            arrays = {k: z[k] for k in FIELDS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: damaged replay chunk ({type(e).__name__}: {e})") from e
    bad = [k for k, v in arrays.items() if len(v) != rows]
    if bad:
        raise CheckpointError(f"{path}: damaged replay chunk ({bad[0]} has {len(arrays[bad[0]])} rows, the name "
                              f"says {rows})")
    return arrays


def prune_chunks(directory: str | os.PathLike) -> int:
    """Deletes a finished run's replay chunks and leftover temporary files (nothing else), then the folder if that
    empties it; returns the bytes freed."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    freed = 0
    for p in directory.iterdir():
        if p.is_file() and (CHUNK_RE.search(p.name) or (p.name.startswith(".chunk_") and TMP_MARK in p.name)):
            freed += p.stat().st_size
            p.unlink()
    if not any(directory.iterdir()):
        directory.rmdir()
    return freed
