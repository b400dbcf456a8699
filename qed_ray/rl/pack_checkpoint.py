"""A pack's checkpoints and policy snapshots: what :class:`~qed_ray.rl.trainer.Trainer` writes and restores (the
layout: docs/design.md, "Packs" and "Resume"). Everything is copied on the training thread and written by the
background writer; a policy snapshot is one seed's acting modules (or all) with the evaluation history."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from qed_ray.records.checkpoint import MANIFEST_FILE, load_checkpoint, new_manifest, save_checkpoint
from qed_ray.records.codec import write_record
from qed_ray.records.layout import PACK_FILE, PACK_FORMAT, member_dirs
from qed_ray.records.manifests import CheckpointError, Manifest, PackRecord
from qed_ray.rl.pack import PackState, Progress, SeedRun, read_pack

if TYPE_CHECKING:
    from qed_ray.records.writer import BackgroundWriter
    from qed_ray.rl.agents.packed import PackedAgent
    from qed_ray.rl.env_pool import EnvPool
    from qed_ray.rl.replay import Replay


class PackCheckpoints:
    """Saves and restores one pack: its :class:`~qed_ray.rl.pack.PackState` with the agent's tensors, the replay
    (``replay_dirs``: per seed, where its chunks persist; None: inside each checkpoint) and the envs' streams."""

    def __init__(self, state: PackState, agent: PackedAgent, replay: Replay, pool: EnvPool, writer: BackgroundWriter,
                 replay_dirs: Sequence[Path] | None, times: Callable[[], dict]):
        self.state, self.agent, self.replay, self.pool, self.writer = state, agent, replay, pool, writer
        self.replay_dirs, self.times = replay_dirs, times

    def member_dir(self, i: int) -> str:
        return member_dirs([r.name for r in self.state.runs], [r.spec.seed for r in self.state.runs])[i]

    def identity(self, i: int) -> dict:
        """Fields seed ``i``'s checkpoint must match."""
        s = self.state.runs[i].spec
        return {"task": s.task, "agent": s.agent.name, "variant": s.variant, "seed": s.seed,
                "obs_dim": self.pool.obs_dim, "action_dim": self.pool.action_dim}

    def save(self, directory: Path, modules: Sequence[str] | None = None, index: int | None = None) -> Future:
        """Queues the pack checkpoint (or, with ``modules`` and ``index``, a policy snapshot of seed ``index``) for
        the writer thread; the state is copied before this returns."""
        st, directory, times = self.state, Path(directory), self.times()
        if modules is not None:
            state = self.agent.module_state_dicts(index, modules)
            run = st.runs[index]
            # The evaluation history and wall and CPU time ride along, so the gather step and --status read a finished
            # or running trial from its snapshots alone (learning curves, critic-proxy x of App. D, cost so far).
            manifest = new_manifest(**self.identity(index), env_steps=st.env_steps, run=run.spec, policy_only=True,
                                    modules=sorted(state), evals=list(run.evals), **times)
            return self.writer.submit(directory, lambda: save_checkpoint(directory, state, manifest))
        seeds, chunks = [], []
        for i, run in enumerate(st.runs):
            if run.status != "diverged":
                run.saved = (self.agent.seed_state_dict(i), self._manifest(i, times))
            if run.saved is not None:
                sub = directory / self.member_dir(i)
                loc = self.replay_dirs[i] if self.replay_dirs is not None else sub / "replay"
                if run.status != "diverged":
                    chunks.append(self.replay.plan_save(i, loc))
                elif self.replay_dirs is None:  # a new checkpoint folder needs the rows its manifest counts
                    chunks.append(self.replay.plan_save(i, loc, run.saved[1].replay.added))
                seeds.append((sub, *run.saved))
        pack = PackRecord(format=PACK_FORMAT, pack=st.name, names=[r.name for r in st.runs],
                          seeds=[r.spec.seed for r in st.runs], pack_size=st.n, env_steps=st.env_steps,
                          **{**st.progress.model_dump(), **times},
                          status=[st.status(r) for r in st.runs],
                          reasons=[r.reason for r in st.runs],
                          stopped_at=[list(r.stopped_at) if r.stopped_at else None for r in st.runs])

        def write() -> None:
            for chunk in chunks:
                chunk.write()
            for sub, state, manifest in seeds:
                save_checkpoint(sub, state, manifest)
            write_record(directory / PACK_FILE, pack)  # last: it marks a complete pack checkpoint

        return self.writer.submit(directory, write)

    def _manifest(self, i: int, times: dict) -> Manifest:
        """Seed ``i``'s manifest: identity, settings, progress, random streams, replay size, place in the pack."""
        st, run = self.state, self.state.runs[i]
        return new_manifest(
            **self.identity(i), env_steps=st.env_steps, run=run.spec,
            progress={"decisions": st.progress.decisions, "updates": st.progress.updates, "episodes": run.episodes,
                      **times, "evals": list(run.evals)},
            rng={"warmup": run.warmup_rng.bit_generator.state, "replay": self.replay.rng_state(i),
                 "env": self.pool.random_state(i)},
            replay={"added": int(self.replay.added[i]), "external": self.replay_dirs is not None},
            pack=st.name, pack_size=st.n, pack_index=i)

    def restore(self, directory: Path) -> PackRecord:
        """Loads a pack checkpoint of the same seeds and pack size into the state (a seed it records as finished
        without its replay: docs/design.md, "Packs"); returns its pack.json, or raises CheckpointError naming the
        file and field."""
        st, directory = self.state, Path(directory)
        pack = read_pack(directory, [r.spec.seed for r in st.runs])
        states, manifests = [], []
        for i, run in enumerate(st.runs):
            sub = directory / self.member_dir(i)
            if pack.status[i] == "diverged" and not os.path.lexists(sub / MANIFEST_FILE):
                states.append(None), manifests.append(None)  # diverged before its first checkpoint
                continue
            state, m = load_checkpoint(sub, expect={**self.identity(i), "pack_size": st.n, "pack_index": i},
                                       map_location="cpu", run=run.spec)
            states.append(state), manifests.append(m)
        self.agent.load_seed_state_dicts(states)
        for i, (run, m) in enumerate(zip(st.runs, manifests)):
            done = pack.status[i] == "finished" and pack.env_steps >= st.train.env_steps  # not a larger budget
            self._restore_seed(i, run, m, states[i], directory, done)
            if pack.status[i] == "diverged":
                if pack.stopped_at[i] is None:
                    raise CheckpointError(f"{directory / PACK_FILE}: stopped_at.{i}: missing for a diverged seed")
                st.stop(i, pack.reasons[i], pack.stopped_at[i])
                self.agent.freeze(i)
        st.progress, st.resumed_from = Progress.of(pack), pack.env_steps
        return pack

    def _restore_seed(self, i: int, run: SeedRun, m: Manifest | None, state: dict | None, directory: Path,
                      finished: bool) -> None:
        """Seed ``i``'s counters, history, random streams and replay from its manifest (None: it has none). A
        seed ``finished`` in this checkpoint trains no more, so its replay (perhaps pruned since) is not read."""
        if m is None:
            return
        sub = directory / self.member_dir(i)
        progress, rng, replay = m.require(sub / MANIFEST_FILE, "progress", "rng", "replay")
        run.episodes, run.evals = progress.episodes, list(progress.evals)
        try:  # the model checked each state's shape; the generators check the rest of what they are given
            run.warmup_rng.bit_generator.state = rng.warmup.model_dump()
            self.replay.set_rng_state(i, rng.replay.model_dump())
            self.pool.set_random_state(i, rng.env.model_dump())
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(f"{sub / MANIFEST_FILE}: rng: not a state this generator can take "
                                  f"({type(e).__name__}: {e})") from None
        src = self.replay_dirs[i] if replay.external else sub / "replay"
        if not finished:
            self.replay.load(i, src, replay.added)
        run.saved = (state, m)
