"""Run configuration: frozen pydantic models validated once at load time.

Derived values (observation/action dims, episode length in decisions) are never stored here; they are
computed from the environment and passed to constructors. Defaults follow the paper (App. B) and the MAD-TD
code defaults (``shared/research/mad_td.md`` §1.2), except where the paper overrides them: gradient clip 20,
``proportion_real`` 0.5, no actor LayerNorm.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CONTROL_STEPS_PER_EPISODE = 1000  # dm_control's default time limit (DESIGN.md §3)


class Frozen(BaseModel):
    """Base: immutable, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class TemperatureSpec(Frozen):
    """Temperature rule (DESIGN.md §3): target entropy (``te``), ``fixed``, or ``qed`` (paper Sec. 5.1)."""

    kind: Literal["te", "fixed", "qed"] = "te"
    alpha: float | None = Field(None, gt=0, description="constant temperature; required for kind=fixed")
    init_alpha: float = Field(0.1, gt=0, description="initial alpha_TE (pytorch_sac's DMC default)")
    lr: float = Field(3e-4, gt=0, description="Adam learning rate of log alpha_TE")
    k: float | None = Field(None, gt=0, description="QED scale: alpha = Delta / (k * action_dim); required for qed")
    n_actions: int = Field(8, ge=2, description="QED: policy actions per state for the disagreement expectile")
    tau: float = Field(0.9, gt=0, lt=1, description="QED: expectile level of |Q1 - Q2|")
    alpha_max: float = Field(0.2, gt=0, description="QED: upper clip of alpha(s)")

    @model_validator(mode="after")
    def _check_kind_fields(self) -> "TemperatureSpec":
        if self.kind == "fixed" and self.alpha is None:
            raise ValueError("temperature.alpha: required when temperature.kind is 'fixed' (a value > 0)")
        if self.kind == "qed" and self.k is None:
            raise ValueError("temperature.k: required when temperature.kind is 'qed' (a value > 0, paper: 0.1-0.4)")
        return self

    @property
    def label(self) -> str:
        """Short variant name used in trial names and tables, e.g. ``te``, ``fixed0.1``, ``qed0.2``."""
        if self.kind == "fixed":
            return f"fixed{self.alpha:g}"
        if self.kind == "qed":
            return f"qed{self.k:g}"
        return "te"


class MadSpec(Frozen):
    """MAD-SAC specifics (``shared/research/mad_td.md`` §1, §2); ignored by SAC-LN."""

    latent_dim: int = Field(512, ge=8, description="encoder output size; a multiple of simnorm_group")
    simnorm_group: int = Field(8, ge=2)
    encoder_hidden: int = Field(512, ge=1)
    model_hidden: int = Field(512, ge=1)
    encoder_lr: float = Field(1e-4, gt=0)
    model_lr: float = Field(3e-4, gt=0)
    proportion_real: float = Field(0.5, gt=0, le=1, description="share of real rows in a critic batch (paper: 0.5)")
    model_every: int = Field(1, ge=1, description="model/encoder step every n-th update (reference: once per env step)")
    vmin: float = -300.0
    vmax: float = 300.0
    num_bins: int = Field(151, ge=3)
    sigma_ratio: float = Field(0.75, gt=0, description="HL-Gauss sigma as a multiple of the bin width")
    clip_warn_fraction: float = Field(0.01, ge=0, le=1, description="warn when this share of TD targets is clipped")
    actor_critic: Literal["online", "target"] = Field(
        "online", description="critic the actor maximises: 'online' (SAC) or 'target' (MAD-TD; mad_td.md §2.5)")

    @model_validator(mode="after")
    def _check(self) -> "MadSpec":
        if self.vmin >= self.vmax:
            raise ValueError(f"agent.mad.vmin/vmax: need vmin < vmax, got {self.vmin} >= {self.vmax}")
        if self.latent_dim % self.simnorm_group:
            raise ValueError(f"agent.mad.latent_dim: {self.latent_dim} is not a multiple of simnorm_group "
                             f"{self.simnorm_group}")
        return self


class AgentSpec(Frozen):
    """Agent hyper-parameters shared by SAC-LN and MAD-SAC (MAD-TD code defaults, paper App. B)."""

    name: Literal["sac_ln", "mad_sac"] = "sac_ln"
    hidden: int = Field(512, ge=1, description="width of every hidden layer (sac_ln default 256)")
    depth: int = Field(2, ge=1, description="hidden layers per MLP")
    activation: Literal["mish", "relu"] = "mish"
    actor_lr: float = Field(3e-4, gt=0)
    critic_lr: float = Field(3e-4, gt=0)
    batch_size: int = Field(512, ge=2, description="batch size (sac_ln default 256)")
    polyak: float = Field(0.01, gt=0, le=1, description="target <- (1 - polyak) target + polyak online")
    gamma: float = Field(0.99, gt=0, lt=1)
    grad_clip: float = Field(20.0, gt=0, description="global-norm gradient clip (paper App. B: 20)")
    utd: int = Field(1, ge=1, description="updates per decision")
    log_std_min: float = -5.0
    log_std_max: float = 2.0
    mad: MadSpec = MadSpec()

    @model_validator(mode="before")
    @classmethod
    def _agent_defaults(cls, data):
        # SAC-LN defaults to the standard DMC SAC size (256x256, batch 256; pytorch_sac/SB3 scale), MAD-SAC to
        # the MAD-TD reference (512, batch 512). Sweeps that reproduce the paper set both explicitly.
        if isinstance(data, dict) and data.get("name", "sac_ln") == "sac_ln":
            data = {"hidden": 256, "batch_size": 256, **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> "AgentSpec":
        if self.log_std_min >= self.log_std_max:
            raise ValueError(f"agent.log_std_min/log_std_max: need min < max, got {self.log_std_min} >= "
                             f"{self.log_std_max}")
        return self


class TrainSpec(Frozen):
    """Training budget and loop settings. Budgets count env (control) steps; decisions = env steps / frame_skip."""

    env_steps: int = Field(2_000_000, gt=0, description="training budget in control steps (paper: 2M)")
    eval_every: int = Field(20_000, gt=0, description="evaluation + checkpoint interval in env steps")
    eval_episodes: int = Field(10, ge=1)
    warmup_decisions: int = Field(5000, ge=0, description="uniform-random decisions before updates start")
    frame_skip: int = Field(2, ge=1)
    replay_capacity: int | None = Field(None, ge=1, description="default: the whole run (never evicts)")
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', 'cuda', 'cuda:1', ...")
    threads: int = Field(1, ge=1, description="torch CPU threads")
    nan_check_every: int = Field(50, ge=1, description="decisions between non-finite loss checks")
    debug_crash_at_env_step: int | None = Field(None, ge=1, description="testing: raise once at this env step "
                                                "unless resumed from a checkpoint")
    debug_nan_at_env_step: int | None = Field(None, ge=1, description="testing: inject NaN into the critic loss")

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v != "auto" and v != "cpu" and not v.startswith("cuda"):
            raise ValueError(f"train.device: {v!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'")
        return v

    @model_validator(mode="after")
    def _check(self) -> "TrainSpec":
        if CONTROL_STEPS_PER_EPISODE % self.frame_skip:
            raise ValueError(f"train.frame_skip: {self.frame_skip} must divide {CONTROL_STEPS_PER_EPISODE}")
        # Checkpoints are written at evaluations; keeping them on episode boundaries makes resume exact
        # without serialising mid-episode physics state.
        if self.eval_every % CONTROL_STEPS_PER_EPISODE:
            raise ValueError(f"train.eval_every: {self.eval_every} must be a multiple of "
                             f"{CONTROL_STEPS_PER_EPISODE} env steps (one episode)")
        if self.env_steps % self.eval_every:
            raise ValueError(f"train.env_steps: {self.env_steps} must be a multiple of train.eval_every "
                             f"({self.eval_every})")
        return self

    @property
    def decisions(self) -> int:
        """Total agent decisions of the run."""
        return self.env_steps // self.frame_skip

    @property
    def eval_every_decisions(self) -> int:
        """Decisions between evaluations."""
        return self.eval_every // self.frame_skip

    @property
    def episode_decisions(self) -> int:
        """Decisions per episode (500 at frame skip 2)."""
        return CONTROL_STEPS_PER_EPISODE // self.frame_skip


class RunSpec(Frozen):
    """One training run (= one sweep trial): task x agent x temperature x seed."""

    task: str
    seed: int = Field(0, ge=0)
    agent: AgentSpec = AgentSpec()
    temperature: TemperatureSpec = TemperatureSpec()
    train: TrainSpec = TrainSpec()

    @field_validator("task")
    @classmethod
    def _check_task(cls, v: str) -> str:
        from qed_ray.envs import check_task

        return check_task(v)

    @property
    def variant(self) -> str:
        """Temperature variant label (``te``, ``qed0.2``, ``fixed0.1``)."""
        return self.temperature.label

    @property
    def name(self) -> str:
        """Deterministic trial name ``task/agent/variant/seed``."""
        return f"{self.task}/{self.agent.name}/{self.variant}/{self.seed}"


def format_validation_error(err: Exception, prefix: str = "") -> str:
    """``field.path: message (got value)`` per problem, ``; ``-joined, from a pydantic ValidationError.

    Messages raised by our own validators already start with their field path and are kept as they are.
    """
    errors = getattr(err, "errors", None)
    if errors is None:
        return str(err)
    lines = []
    for e in errors():
        loc = prefix + ".".join(str(p) for p in e.get("loc", ()))
        msg = e.get("msg", "").removeprefix("Value error, ")
        got = e.get("input")
        suffix = "" if isinstance(got, (dict, list)) or got is None or msg.count(":") else f" (got {got!r})"
        if ":" in msg.split(" ")[0]:  # "temperature.k: required ..." from a model validator
            lines.append(f"{prefix}{msg}")
        else:
            lines.append(f"{loc.rstrip('.')}: {msg}{suffix}" if loc else f"{msg}{suffix}")
    return "; ".join(lines)
