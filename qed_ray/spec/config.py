"""Run configuration: frozen pydantic models validated once at load time (docs/spec.md; defaults: paper App. B and
the MAD-TD code it ran). Every message starts with the field it is about, relative to the model that raises it, so
that the caller's prefix (``train.``, ``agents.0.overrides.``) makes the full path."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator, \
    model_validator

from qed_ray.spec.hints import short_repr
from qed_ray.spec.labels import temperature_label
from qed_ray.spec.tasks import check_task

CONTROL_STEPS_PER_EPISODE = 1000  # dm_control's default time limit
MAX_SEED = 2**32 - 1  # numpy's and dm_control's seed range


class Frozen(BaseModel):
    """Base: immutable; unknown keys, NaN/inf and lax coercions (``true`` or ``"3"`` for an int) are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=True)


HOT_RATIO = 5.0  # QED runs "hot" at a state where its alpha is at least this many times alpha_TE (its floor)
K_MAX = 1000.0  # the largest k accepted: far past where QED does anything (a larger value is a typo)
K_PAPER = (0.1, 0.4)  # the k the paper found stable (Sec. 6, "Ablating k")
K_USUAL = (0.05, 1.0)  # outside this a spec is warned about (qed_ray.spec.sweep.SweepSpec.warnings)


class TemperatureSpec(Frozen):
    """Temperature rule: target entropy (``te``, paper Eq. 1), ``fixed``, or ``qed`` (paper Sec. 5.1)."""

    kind: Literal["te", "fixed", "qed"] = Field("te", description="temperature rule")
    alpha: float | None = Field(None, gt=0, le=100, description="the constant temperature (kind fixed; required)")
    init_alpha: float = Field(0.1, gt=0, le=100, description="initial alpha_TE (pytorch_sac's DMC default)")
    lr: float = Field(3e-4, gt=0, le=1, description="Adam learning rate of log alpha_TE")
    k: float | None = Field(None, description="QED scale: alpha = Delta / (k * action_dim) (kind qed; required; "
                                              f"above 0, at most {K_MAX:g}; paper: 0.1-0.4)")
    n_actions: int = Field(8, ge=2, le=1024, description="QED: policy actions per state for the expectile")
    tau: float = Field(0.9, gt=0, lt=1, description="QED: expectile level of |Q1 - Q2|")
    alpha_max: float = Field(0.2, gt=0, le=1e6, description="QED: upper clip of alpha(s)")
    target_alpha: Literal["qed", "floor"] = Field(
        "floor", description="QED: alpha in the TD target: 'floor' = alpha_TE (QED only at the actor update, paper "
                             "App. C), 'qed' = alpha(s') from the target critics (an ablation: a second QED pass)")

    # Which fields each kind reads: a value set on a field the kind ignores would train something else than
    # the user asked for (e.g. ``{kind: te, k: 0.2}`` silently trains the baseline).
    FIELDS_OF_KIND: ClassVar[dict[str, tuple[str, ...]]] = {"te": ("init_alpha", "lr"), "fixed": ("alpha",),
                      "qed": ("k", "n_actions", "tau", "alpha_max", "target_alpha", "init_alpha", "lr")}

    # The scalars a pack's members may differ in (pack.by: shape): each member's value is its own [S] slice of the
    # rule's state (QED's 1 / (k d) and alpha_max, the fixed alpha, the initial log alpha_TE); none changes a
    # tensor's shape or the update's code path. Every other temperature setting is shared by a pack.
    MEMBER_FIELDS: ClassVar[tuple[str, ...]] = ("k", "alpha", "alpha_max", "init_alpha")

    @field_validator("k")
    @classmethod
    def _k_in_range(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= K_MAX:
            raise ValueError(f"{v:g} is {'not above 0' if v <= 0 else f'above {K_MAX:g}'}; QED's alpha(s) = Delta / "
                             f"(k x action_dim) needs 0 < k <= {K_MAX:g} (paper Sec. 5.1), and the paper uses "
                             f"{K_PAPER[0]:g} to {K_PAPER[1]:g}")
        return v

    @model_validator(mode="after")
    def _check_kind_fields(self) -> "TemperatureSpec":
        used = self.FIELDS_OF_KIND[self.kind]
        restricted = {f for fields in self.FIELDS_OF_KIND.values() for f in fields}  # others apply to every kind
        for name, info in type(self).model_fields.items():
            if name in restricted and name not in used and getattr(self, name) != info.default:
                kinds = [k for k, fields in self.FIELDS_OF_KIND.items() if name in fields]
                raise ValueError(f"{name}: applies only to kind {' or '.join(map(repr, kinds))}, but kind is "
                                 f"{self.kind!r} (set kind: {kinds[0]}, or drop {name})")
        if self.kind == "fixed" and self.alpha is None:
            raise ValueError("alpha: required when kind is 'fixed' (a value > 0)")
        if self.kind == "qed" and self.k is None:
            raise ValueError("k: required when kind is 'qed' (a value > 0, paper: 0.1-0.4)")
        return self

    @property
    def label(self) -> str:
        """E.g. ``te``, ``fixed0.1``, ``qed0.2+alpha_max=0.3``."""
        return temperature_label(self)

    def shared(self) -> dict[str, Any]:
        """The settings the members of one pack share: all but :data:`MEMBER_FIELDS`."""
        return self.model_dump(exclude=set(self.MEMBER_FIELDS))


class HLGaussSpec(Frozen):
    """The support of HL-Gauss critic heads (MAD-TD's binned critic): SAC-LN's ``agent.hl``, extended by MAD-SAC's
    :class:`MadSpec` (``agent.mad.vmin`` and so on)."""

    vmin: float = Field(-300.0, ge=-1e6, le=1e6, description="lowest HL-Gauss bin centre")
    vmax: float = Field(300.0, ge=-1e6, le=1e6, description="highest HL-Gauss bin centre")
    num_bins: int = Field(151, ge=3, le=10_000, description="HL-Gauss bins")
    sigma_ratio: float = Field(0.75, gt=0, le=100, description="HL-Gauss sigma as a multiple of the bin width")

    @model_validator(mode="after")
    def _check_support(self) -> "HLGaussSpec":
        if self.vmin >= self.vmax:
            raise ValueError(f"vmin: need vmin < vmax, got {self.vmin} >= {self.vmax}")
        return self


class MadSpec(HLGaussSpec):
    """MAD-SAC specifics (paper Sec. 5.2, App. B; docs/mad_sac.md); the critic support is :class:`HLGaussSpec`'s."""

    latent_dim: int = Field(512, ge=8, le=65536, description="encoder output size; a multiple of simnorm_group")
    simnorm_group: int = Field(8, ge=2, le=1024, description="features per SimNorm simplex")
    encoder_hidden: int = Field(512, ge=1, le=65536, description="encoder hidden width")
    model_hidden: int = Field(512, ge=1, le=65536, description="latent dynamics and reward-head hidden width")
    encoder_lr: float = Field(1e-4, gt=0, le=1, description="Adam learning rate of the encoder")
    model_lr: float = Field(3e-4, gt=0, le=1, description="Adam learning rate of dynamics and reward head")
    proportion_real: float = Field(0.5, gt=0, le=1, description="share of real rows in a critic batch (paper: 0.5)")
    model_every: int = Field(1, ge=1, le=1_000_000, description="model/encoder step every n-th update "
                                                                "(MAD-TD: once per env step)")
    clip_warn_fraction: float = Field(0.01, ge=0, le=1, description="warn when this share of TD targets is clipped")
    actor_critic: Literal["online", "target"] = Field(
        "online", description="critic the actor maximises: 'online' (SAC) or 'target' (MAD-TD)")
    actor_rows: Literal["real", "all"] = Field(
        "real", description="critic-batch rows the actor and alpha_TE steps use: 'real' (the proportion_real "
                            "share) or 'all' (MAD-TD: every row's real start state)")

    @model_validator(mode="after")
    def _check(self) -> "MadSpec":
        if self.latent_dim % self.simnorm_group:
            raise ValueError(f"latent_dim: {self.latent_dim} is not a multiple of simnorm_group {self.simnorm_group}")
        return self


class AgentBase(Frozen):
    """Hyper-parameters shared by every agent (MAD-TD code defaults, paper App. B)."""

    depth: int = Field(2, ge=1, le=64, description="hidden layers per MLP")
    critic_depth: int | None = Field(None, ge=1, le=64, description="hidden layers per critic head (none: depth)")
    activation: Literal["mish", "relu"] = Field("mish", description="hidden activation")
    actor_lr: float = Field(3e-4, gt=0, le=1, description="Adam learning rate of the actor")
    critic_lr: float = Field(3e-4, gt=0, le=1, description="Adam learning rate of the critics")
    polyak: float = Field(0.01, gt=0, le=1, description="target <- (1 - polyak) target + polyak online")
    gamma: float = Field(0.99, gt=0, lt=1, description="discount")
    grad_clip: float = Field(20.0, gt=0, le=1e6, description="global-norm gradient clip (paper App. B: 20)")
    utd: int = Field(1, ge=1, le=1024, description="updates per decision")
    log_std_min: float = Field(-5.0, ge=-100, le=100, description="lower bound of the actor's log-std")
    log_std_max: float = Field(2.0, ge=-100, le=100, description="upper bound of the actor's log-std")

    @model_validator(mode="after")
    def _check(self) -> "AgentBase":
        if self.log_std_min >= self.log_std_max:
            raise ValueError(f"log_std_min: need log_std_min < log_std_max, got {self.log_std_min} >= "
                             f"{self.log_std_max}")
        return self

    @property
    def critic_layers(self) -> int:
        return self.critic_depth or self.depth


class SacLnSpec(AgentBase):
    """SAC-LN (paper Sec. 5.2): twin LayerNorm critics, tanh-Gaussian actor; the standard DMC SAC size."""

    name: Literal["sac_ln"] = Field("sac_ln", description="base agent")
    hidden: int = Field(256, ge=1, le=65536, description="width of every hidden layer")
    batch_size: int = Field(256, ge=2, le=1_000_000, description="replay rows per update")
    critic: Literal["mse", "hlgauss"] = Field(
        "mse", description="critic heads: 'mse' (scalar, squared TD error) or 'hlgauss' (binned, cross-entropy; "
                           "MAD-TD's model-free configuration)")
    hl: HLGaussSpec = Field(HLGaussSpec(), description="the HL-Gauss support (critic hlgauss only)")

    @model_validator(mode="after")
    def _check_critic(self) -> "SacLnSpec":
        if self.critic == "mse" and self.hl != HLGaussSpec():
            raise ValueError("hl: applies only to critic 'hlgauss', but critic is 'mse' (set critic: hlgauss, or "
                             "drop hl)")
        return self


class MadSacSpec(AgentBase):
    """MAD-SAC (paper Sec. 5.2): MaxEnt MAD-TD without MPC; MAD-TD's sizes."""

    name: Literal["mad_sac"] = Field("mad_sac", description="base agent")
    hidden: int = Field(512, ge=1, le=65536, description="width of every hidden layer")
    batch_size: int = Field(512, ge=2, le=1_000_000, description="replay rows per update")
    mad: MadSpec = MadSpec()


# The one registry of agent names: spec class per name (agents.AGENTS maps the same names to code).
AGENT_SPECS: dict[str, type[AgentBase]] = {"sac_ln": SacLnSpec, "mad_sac": MadSacSpec}


def _agent_tag(value: Any) -> str | None:
    # A missing name means the default agent, as for every other defaulted field.
    return value.get("name", "sac_ln") if isinstance(value, dict) else getattr(value, "name", None)


AgentSpec = Annotated[Union[tuple(Annotated[cls, Tag(name)] for name, cls in AGENT_SPECS.items())],
                      Discriminator(_agent_tag)]
_AGENT_ADAPTER: TypeAdapter = TypeAdapter(AgentSpec)


def agent_spec(data: dict | None = None, **fields) -> AgentBase:
    """The validated spec of the agent named by ``name`` (default ``sac_ln``) from a mapping and/or keywords."""
    return _AGENT_ADAPTER.validate_python({**(data or {}), **fields})


class NanInjection(Frozen):
    """A NaN written into the first replay reward of an update, so that it flows into the critic loss."""

    env_step: int | None = Field(None, ge=1, description="testing: inject NaN into the critic loss at this env step")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="testing: only the run of this seed (none: every "
                                                                  "run; in a pack, the other seeds go on)")

    @model_validator(mode="after")
    def _check(self) -> "NanInjection":
        if self.seed is not None and self.env_step is None:
            raise ValueError(f"seed: {self.seed} names the run to poison, but env_step is not set (set "
                             f"env_step, or drop seed)")
        return self

    def hits(self, seed: int, env_step: int) -> bool:
        return self.env_step == env_step and self.seed in (None, seed)


class DebugSpec(Frozen):
    """Fault injection for end-to-end tests. Config is the only channel into a Ray worker, so the hooks live in
    the run spec, grouped here so that nothing else reads like a production setting."""

    crash_at_env_step: int | None = Field(None, ge=1, description="testing: raise once at this env step unless "
                                                                  "resumed from a checkpoint")
    nan: NanInjection = Field(NanInjection(), description="testing: NaN injected into one seed's critic loss")


# ``train.precision`` (qed_ray.rl.precision): the matrix products of a run on CUDA.
Precision = Literal["auto", "fp32", "3xtf32", "tf32"]

# TrainSpec fields before ``debug`` grouped them; a before-validator moves them into ``debug``.
LEGACY_DEBUG_FIELDS = ("debug_crash_at_env_step", "debug_nan_at_env_step")


class TrainSpec(Frozen):
    """Training budget and loop settings. Budgets count env (control) steps; decisions = env steps / frame_skip."""

    env_steps: int = Field(2_000_000, gt=0, le=10**10, description="training budget in control steps (paper: 2M)")
    eval_every: int = Field(20_000, gt=0, le=10**10, description="env steps between evaluations and checkpoints "
                                                                 "(a multiple of 1000)")
    eval_episodes: int = Field(10, ge=1, le=10_000, description="evaluation episodes per evaluation")
    warmup_decisions: int = Field(5000, ge=0, le=10**10, description="uniform-random decisions before updates")
    frame_skip: int = Field(2, ge=1, le=1000, description="control steps per decision")
    replay_capacity: int | None = Field(None, ge=1, le=10**9,
                                        description="replay size in transitions; none: the whole run (never evicts)")
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'")
    threads: int = Field(1, ge=1, le=1024, description="torch CPU threads")
    compile: Literal["auto", "off", "compile", "graph"] = Field(
        "auto", description="a pack's update: 'auto' (graph on CUDA; elsewhere compile when the run's updates "
                            "repay the compile, else off), 'off' (eager), 'compile' "
                            "(torch.compile), 'graph' (one CUDA graph replayed per update; CUDA only)")
    precision: Precision = Field(
        "auto", description="CUDA matrix products: 'auto' (the fastest that passed the numerics gate on a GPU: "
                            "precision.CUDA_DEFAULT), 'fp32', '3xtf32' (QED's critic passes on TF32 tensor cores at "
                            "FP32 accuracy), 'tf32' (every product in TF32, JAX's default: for ablations); CPU runs "
                            "are FP32 whatever is set")
    nan_check_every: int = Field(50, ge=1, le=10**9, description="decisions between non-finite loss checks")
    holdout_fraction: float = Field(0.0, ge=0, lt=1, description="share of transitions held out of the replay, "
                                                                "never trained on (MAD-TD: 0.05)")
    mask_time_limits: bool = Field(False, description="keep each episode's time-limit transition out of the replay "
                                                      "and so out of every loss (MAD-TD masks it)")
    shared_indices: bool = Field(False, description="the seeds of one variant in a pack draw the same replay "
                                                    "positions at every update, as MAD-TD's multi-seed trainer does "
                                                    "(a control; false: each seed its own, independent runs)")
    debug: DebugSpec = Field(DebugSpec(), description="fault injection for end-to-end tests")

    @model_validator(mode="before")
    @classmethod
    def _upgrade_debug_fields(cls, data: Any) -> Any:
        # Runs written before the debug fields were grouped (manifests, policy snapshots, old YAML) still load.
        if not isinstance(data, dict) or not any(k in data for k in LEGACY_DEBUG_FIELDS):
            return data
        data, debug = dict(data), dict(data.get("debug") or {})
        crash, nan = data.pop("debug_crash_at_env_step", None), data.pop("debug_nan_at_env_step", None)
        if crash is not None:
            debug["crash_at_env_step"] = crash
        if nan is not None:
            debug["nan"] = {**dict(debug.get("nan") or {}), "env_step": nan}
        return {**data, "debug": debug} if debug else data

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        head, _, index = v.partition(":")
        if v in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit() and len(index) < 4):
            return v
        raise ValueError(f"{short_repr(v)} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'")

    @model_validator(mode="after")
    def _check(self) -> "TrainSpec":
        if CONTROL_STEPS_PER_EPISODE % self.frame_skip:
            raise ValueError(f"frame_skip: {self.frame_skip} must divide {CONTROL_STEPS_PER_EPISODE}")
        # Checkpoints are written at evaluations; keeping them on episode boundaries makes resume exact
        # without serialising mid-episode physics state.
        if self.eval_every % CONTROL_STEPS_PER_EPISODE:
            raise ValueError(f"eval_every: {self.eval_every} must be a multiple of {CONTROL_STEPS_PER_EPISODE} env "
                             f"steps (one episode)")
        if self.env_steps % self.eval_every:
            raise ValueError(f"env_steps: {self.env_steps} must be a multiple of eval_every ({self.eval_every})")
        if self.shared_indices and self.holdout_fraction:
            # Each seed holds out other decisions (a hash of its own seed), so one ring position would hold a
            # different transition in each seed: the seeds could not draw the same replay rows.
            raise ValueError(f"shared_indices: true needs holdout_fraction 0 (it is {self.holdout_fraction:g}: each "
                             f"seed holds out other transitions, so the same replay positions would hold different "
                             f"decisions); set holdout_fraction: 0 or shared_indices: false")
        return self

    def budget_problem(self) -> str | None:
        """Why this budget would train nothing (warm-up covers every decision), or None; the sweep and the CLI refuse
        such a run, programmatic specs (tests, tools) may still build one."""
        if self.warmup_decisions < self.decisions:
            return None
        return (f"warmup_decisions: {self.warmup_decisions} uniform-random decisions use up the whole budget of "
                f"{self.decisions} decisions (env_steps {self.env_steps} / frame_skip {self.frame_skip}): no "
                f"gradient update would happen; lower it or raise env_steps")

    @property
    def decisions(self) -> int:
        return self.env_steps // self.frame_skip

    @property
    def eval_every_decisions(self) -> int:
        return self.eval_every // self.frame_skip

    @property
    def episode_decisions(self) -> int:
        """Decisions per episode (500 at frame skip 2)."""
        return CONTROL_STEPS_PER_EPISODE // self.frame_skip


class RunSpec(Frozen):
    """One training run (= one sweep trial): task x agent x temperature x seed."""

    task: str = Field(description="dm_control task (domain-task)")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="run seed (env, initialisation, sampling)")
    agent: AgentSpec = Field(SacLnSpec(), description="agent and its hyper-parameters")
    temperature: TemperatureSpec = TemperatureSpec()
    train: TrainSpec = TrainSpec()

    @field_validator("task")
    @classmethod
    def _check_task(cls, v: str) -> str:
        return check_task(v)

    @property
    def variant(self) -> str:
        """Variant label of this run on its own: its temperature (a sweep also names its grid axes)."""
        return self.temperature.label

    @property
    def name(self) -> str:
        return f"{self.task}/{self.agent.name}/{self.variant}/{self.seed}"
