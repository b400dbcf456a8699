"""Validation errors as one line per problem, and what to say about a key a run model does not have: the models are
walked from the one validated (the error's title) along the error's location, so ``train.eval_evry`` suggests
``eval_every`` and ``mad`` on a SAC-LN agent says that it is a MAD-SAC setting."""

from __future__ import annotations

import functools
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from qed_ray.spec.config import AGENT_SPECS, K_PAPER, K_USUAL, AgentBase, Frozen
from qed_ray.spec.hints import close_match, did_you_mean, short_repr, short_text

_AGENT = "agent"  # a field holding any of the agents (RunSpec.agent): the next location part is the agent's name


@functools.cache
def model_named(title: str) -> type[BaseModel] | None:
    """The run or spec model class called ``title`` (a ValidationError's title), if exactly one is."""
    found, stack = [], [Frozen]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__name__ == title:
            found.append(cls)
    return found[0] if len(found) == 1 else None


def _model_of(annotation: Any) -> Any:
    """The model class a field holds (through ``X | None``, ``list[X]``), :data:`_AGENT` for the agent union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [m for m in (_model_of(a) for a in typing.get_args(annotation)) if m is not None]
    if len(models) > 1 and all(isinstance(m, type) and issubclass(m, AgentBase) for m in models):
        return _AGENT
    return models[0] if len(models) == 1 else None


def _walk(model: type[BaseModel], loc: tuple) -> tuple[type[BaseModel] | None, str | None, tuple]:
    """The model at ``loc`` (list indices stepped over), the agent whose settings hold it (or None) and the path
    inside that agent's settings."""
    cls: Any = model
    agent = model.model_fields["name"].default if issubclass(model, AgentBase) else None
    inner: tuple = ()
    for part in loc:
        if cls is _AGENT:
            cls, agent, inner = AGENT_SPECS.get(part), part, ()
        elif isinstance(part, int):
            continue
        else:
            info = cls.model_fields.get(part) if cls is not None else None
            if info is None:
                return None, None, ()
            cls, inner = _model_of(info.annotation), (*inner, part)
        if cls is None:
            return None, None, ()
    return (cls if cls is not _AGENT else None), agent, inner


def _leaf_paths(cls: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in cls.model_fields.items():
        sub = _model_of(info.annotation)
        out.extend(_leaf_paths(sub, f"{prefix}{name}.") if isinstance(sub, type) else [f"{prefix}{name}"])
    return out


def _has_path(cls: type[BaseModel], path: tuple) -> bool:
    for i, part in enumerate(path):
        info = cls.model_fields.get(part)
        if info is None:
            return False
        if i < len(path) - 1:
            cls = _model_of(info.annotation)
            if not isinstance(cls, type):
                return False
    return True


@functools.lru_cache(maxsize=1024)
def unknown_field(title: str, loc: tuple) -> str:
    """The message for the key ``loc[-1]``, which the model at ``loc[:-1]`` (inside the model ``title``) lacks."""
    key, model = loc[-1], model_named(title)
    cls, agent, inner = _walk(model, loc[:-1]) if model is not None else (None, None, ())
    if cls is None:
        return "unknown field"
    if agent is not None and isinstance(key, str):
        owners = [name for name, other in AGENT_SPECS.items() if name != agent and _has_path(other, (*inner, key))]
        if owners:
            return f"applies only to {' and '.join(owners)}, not to {agent}"
    hint = did_you_mean(key, cls.model_fields)
    if hint:
        return f"unknown field{hint}"
    nested = [p for p in _leaf_paths(cls) if p.rsplit(".", 1)[-1] == key]
    if nested:
        return f"unknown field here; did you mean {nested[0]!r}?"
    if agent is not None and not inner:
        for name, other in AGENT_SPECS.items():
            paths = [p for p in _leaf_paths(other) if p.rsplit(".", 1)[-1] == key]
            if name != agent and paths:
                return f"applies only to {name} (as {paths[0]}), not to {agent}"
    return f"unknown field; the fields here are {', '.join(cls.model_fields)}"


def choice_hint(got: Any, expected: str) -> str:
    """``"; did you mean 'relu'?"`` for a value outside a list of choices given as pydantic quotes them."""
    return did_you_mean(got, re.findall(r"'([^']*)'", expected)) if isinstance(got, str) else ""


def tag_message(ctx: dict) -> str:
    """The message for an agent name (a discriminated union's tag) that names no agent."""
    tag, expected = ctx.get("tag", ""), ctx.get("expected_tags", "")
    choices = re.findall(r"'([^']*)'", expected)
    match = close_match(tag, choices)
    hint = f"; did you mean {match!r}?" if match is not None else ""
    return f"unknown {short_repr(tag)}; one of {', '.join(choices)}{hint}"


def format_validation_error(err: Exception, prefix: str = "") -> str:
    """One ``field.path: message (got value)`` line per problem from a pydantic ValidationError. A message that
    starts with a field name (our validators' convention) is relative to the error's location; agent names
    (discriminator tags) are dropped from locations."""
    if not isinstance(err, ValidationError):
        return f"{prefix.rstrip('.')}: {err}" if prefix else str(err)
    lines = []
    for e in err.errors():
        raw_loc = tuple(e.get("loc", ()))
        loc = [short_text(str(p)) for p in raw_loc if p not in AGENT_SPECS]
        msg, hint = _message(err.title, raw_loc, e)
        for line in msg.splitlines():
            lines.append(_locate(prefix, loc, line, e.get("input"), e.get("type", "")) + hint)
    return "\n".join(dict.fromkeys(lines))


def _message(title: str, loc: tuple, e: dict) -> tuple[str, str]:
    kind, msg = e.get("type", ""), e.get("msg", "").removeprefix("Value error, ")
    if kind not in ("extra_forbidden", "literal_error", "union_tag_invalid"):
        return msg, ""
    if kind == "extra_forbidden":
        return unknown_field(title, loc), ""
    if kind == "literal_error":
        return msg, choice_hint(e.get("input"), e.get("ctx", {}).get("expected", ""))
    return tag_message(e.get("ctx", {})), ""


_FIELD_PATH = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def _locate(prefix: str, loc: list[str], msg: str, got: Any, kind: str) -> str:
    head, sep, rest = msg.partition(": ")
    if sep and _FIELD_PATH.fullmatch(head):
        loc, msg = [*loc, head], rest  # our validator named the field, relative to the model it checks
    path = prefix + ".".join(loc)
    show = kind not in ("value_error", "assertion_error", "extra_forbidden", "union_tag_invalid") and \
        not isinstance(got, (dict, list)) and got is not None
    suffix = f" (got {short_repr(got)})" if show else ""
    if kind == "missing":
        msg, suffix = "required field missing", ""
    return f"{path}: {msg}{suffix}" if path else f"{msg}{suffix}"


_K_PATH = re.compile(r"agents\.(\d+)\.temperatures\.(\d+)\.k: ")


def k_in_words(line: str, raw: Any) -> str:
    """A sweep spec's problem with QED's k named by its agent and temperature entry (``k (agent sac_ln, temperature
    entry 2): ...``) rather than by its index path (``agents.0.temperatures.1.k: ...``); ``raw``: the spec as read."""
    m = _K_PATH.match(line)
    agents = raw.get("agents") if isinstance(raw, dict) else None
    if m is None or not isinstance(agents, list) or int(m.group(1)) >= len(agents):
        return line
    entry = agents[int(m.group(1))]
    name = short_text(str(entry.get("name"))) if isinstance(entry, dict) else "?"
    return f"k (agent {name}, temperature entry {int(m.group(2)) + 1}): {line[m.end():]}"


def k_warning(agent: str, k: float) -> str | None:
    """The warning for a valid QED k outside :data:`~qed_ray.spec.config.K_USUAL` (None inside), where alpha(s) sits
    at its floor or its cap (paper Sec. 5.1)."""
    if k > K_USUAL[1]:
        effect = (f"{k / K_PAPER[1]:g} times smaller than at k = {K_PAPER[1]:g}, so QED would sit at its floor "
                  f"alpha_TE (training like te)")
    elif k < K_USUAL[0]:
        effect = (f"{K_PAPER[0] / k:g} times larger than at k = {K_PAPER[0]:g}, so QED would sit at its cap "
                  f"alpha_max (a fixed temperature)")
    else:
        return None
    return (f"k: {k:g} (agent {agent}) is outside {K_USUAL[0]:g} to {K_USUAL[1]:g} (the paper uses {K_PAPER[0]:g} to "
            f"{K_PAPER[1]:g}): alpha(s) = Delta / (k x action_dim) is {effect}")
