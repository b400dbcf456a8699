"""One vocabulary: variant labels and their parse, run identity, grid axes on any field, CLI flags from the models."""

import re
from pathlib import Path

import pytest

from qed_ray.spec.config import AGENT_SPECS, RunSpec, TemperatureSpec
from qed_ray.spec.flags import run_flags
from qed_ray.spec.naming import format_value, identity, parse_value, parse_variant, temperature_label, variant_label
from qed_ray.spec.sweep import load_spec
from qed_ray.rl.run import main as train_main
from kit import TINY_MAD, TRAIN, sweep_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("settings,label", [
    ({"kind": "te"}, "te"),
    ({"kind": "fixed", "alpha": 0.05}, "fixed0.05"),
    ({"kind": "qed", "k": 0.2}, "qed0.2"),
    ({"kind": "qed", "k": 0.2, "n_actions": 8, "tau": 0.9, "alpha_max": 0.2}, "qed0.2"),  # defaults are not named
    ({"kind": "qed", "k": 0.2, "alpha_max": 0.3}, "qed0.2+alpha_max=0.3"),
    ({"kind": "qed", "k": 0.4, "tau": 0.75, "n_actions": 16}, "qed0.4+n_actions=16+tau=0.75"),
    ({"kind": "te", "init_alpha": 1.0, "lr": 1e-05}, "te+init_alpha=1+lr=1e-05"),
    ({"kind": "qed", "k": 0.2, "alpha_max": 1e6}, "qed0.2+alpha_max=1e6"),  # no "+" inside a value
])
def test_temperature_labels_name_every_non_default_setting_and_parse_back(settings, label):
    spec = TemperatureSpec.model_validate(settings)
    assert temperature_label(spec) == spec.label == label
    parsed = parse_variant(label)
    assert parsed["agent"] == {} and parsed["train"] == {}
    assert TemperatureSpec.model_validate(parsed["temperature"]) == spec


def test_variant_labels_with_axes_round_trip():
    run = RunSpec.model_validate({"task": "cheetah-run", "agent": {"name": "mad_sac", "hidden": 256,
                                                                    "mad": {"proportion_real": 0.95}},
                                  "temperature": {"kind": "qed", "k": 0.3, "alpha_max": 0.25},
                                  "train": {"env_steps": 40000, "eval_every": 20000}})
    axes = {"agent.hidden", "agent.mad.proportion_real", "train.env_steps", "agent.depth"}  # depth: at default
    label = variant_label(run, axes)
    assert label == "qed0.3+alpha_max=0.25+hidden=256+mad.proportion_real=0.95+env_steps=40000"
    assert variant_label(run) == "qed0.3+alpha_max=0.25", "without axes only the temperature is named"
    assert parse_variant(label) == {"temperature": {"kind": "qed", "k": 0.3, "alpha_max": 0.25},
                                    "agent": {"hidden": 256, "mad": {"proportion_real": 0.95}},
                                    "train": {"env_steps": 40000}}


@pytest.mark.parametrize("value", [0.1, 0.2, 1e-05, 3e-4, 0.30000000000000004, 123456789.0, -5.0, 512, 0, True, False,
                                   "relu", "cuda:1", 1e6, 1e22, -2.5e17, 1234567.5])
def test_values_format_and_parse_back_exactly(value):
    text = format_value(value)
    back = parse_value(text)
    assert back == value and isinstance(back, bool) == isinstance(value, bool)  # a float field takes -5 as -5.0
    assert not any(c in text for c in "/+=")


@pytest.mark.parametrize("label", ["ppo", "qed", "fixed", "te0.2", "qed0.2+widht=3", "te+hidden"])
def test_bad_variant_labels_are_refused(label):
    with pytest.raises(ValueError, match=re.escape(repr(label))):
        parse_variant(label)


def test_two_widths_and_two_alpha_max_expand_to_distinct_trials_with_distinct_labels():
    spec = sweep_spec(seeds=1, agents=[{"name": "sac_ln", "overrides": {"hidden": [256, 512], "batch_size": 64},
                                        "temperatures": [{"kind": "qed", "k": 0.2, "alpha_max": [0.2, 0.3]}]}])
    assert [t.name for t in spec.trials()] == [
        "cartpole-balance/sac_ln/qed0.2/0", "cartpole-balance/sac_ln/qed0.2+alpha_max=0.3/0",
        "cartpole-balance/sac_ln/qed0.2+hidden=512/0", "cartpole-balance/sac_ln/qed0.2+alpha_max=0.3+hidden=512/0"]
    assert [(t.run.agent.hidden, t.run.temperature.alpha_max) for t in spec.trials()] == [
        (256, 0.2), (256, 0.3), (512, 0.2), (512, 0.3)]
    assert all(t.run.agent.batch_size == 64 for t in spec.trials()), "a shared setting is not an axis"
    for t in spec.trials():  # every name parses back to the settings that make its trial differ
        parsed = parse_variant(t.variant)
        assert TemperatureSpec.model_validate(parsed["temperature"]) == t.run.temperature
        assert parsed["agent"].get("hidden", 256) == t.run.agent.hidden


def test_any_agent_or_train_field_is_an_axis_and_entries_of_one_agent_are_compared():
    spec = sweep_spec(seeds=1, agents=[
        {"name": "mad_sac", "overrides": {"hidden": 32, "mad": {**TINY_MAD, "proportion_real": [0.5, 0.95]}},
         "temperatures": [{"kind": "te"}]},
        {"name": "sac_ln", "overrides": {"hidden": 16}, "temperatures": [{"kind": "te"}]},
        {"name": "sac_ln", "overrides": {"hidden": 32, "activation": "relu"}, "temperatures": [{"kind": "te"}]}],
        train={**TRAIN, "eval_every": [1000, 2000]})
    # mad_sac's hidden=32 is shared by all its trials (not an axis); eval_every's default is 20000, so both named.
    assert [t.name for t in spec.trials()] == [
        "cartpole-balance/mad_sac/te+eval_every=1000/0", "cartpole-balance/mad_sac/te+eval_every=2000/0",
        "cartpole-balance/mad_sac/te+mad.proportion_real=0.95+eval_every=1000/0",
        "cartpole-balance/mad_sac/te+mad.proportion_real=0.95+eval_every=2000/0",
        "cartpole-balance/sac_ln/te+hidden=16+eval_every=1000/0", "cartpole-balance/sac_ln/te+hidden=16+eval_every=2000/0",
        "cartpole-balance/sac_ln/te+activation=relu+hidden=32+eval_every=1000/0",
        "cartpole-balance/sac_ln/te+activation=relu+hidden=32+eval_every=2000/0"]
    assert {t.run.train.eval_every for t in spec.trials()} == {1000, 2000}


def test_identical_entries_are_refused():
    with pytest.raises(Exception, match="two entries expand to the same trial cartpole-balance/sac_ln/te/0"):
        sweep_spec(seeds=1, agents=[{"name": "sac_ln", "temperatures": [{"kind": "te"}]},
                                    {"name": "sac_ln", "temperatures": [{"kind": "te"}]}])


def test_adding_a_defaulted_field_leaves_identity_unchanged():
    class NewTemperature(TemperatureSpec):
        new_option: int = 7

    class NewRun(RunSpec):
        temperature: NewTemperature = NewTemperature()

    raw = {"task": "hopper-hop", "seed": 3, "agent": {"name": "mad_sac", "hidden": 256},
           "temperature": {"kind": "qed", "k": 0.3}, "train": {"env_steps": 40000, "eval_every": 20000}}
    old, new = RunSpec.model_validate(raw), NewRun.model_validate(raw)
    assert identity(old) == identity(new) == {
        "agent": "mad_sac", "agent.hidden": 256, "seed": 3, "task": "hopper-hop", "temperature.k": 0.3,
        "temperature.kind": "qed", "temperature.target_alpha": "floor", "train.env_steps": 40000}
    # eval_every 20000 is the default: not identity; target_alpha is, because its default changed (naming.EXPLICIT)
    assert new.variant == old.variant == "qed0.3"
    changed = NewRun.model_validate({**raw, "temperature": {"kind": "qed", "k": 0.3, "new_option": 8}})
    assert identity(changed)["temperature.new_option"] == 8 and changed.variant == "qed0.3+new_option=8"


def test_shipped_sweeps_keep_their_identity():
    # The identity hashes only non-default settings: these values may change only when a shipped spec does.
    got = {p.stem: load_spec(p).fingerprint() for p in sorted((ROOT / "sweeps").glob("*.yaml"))}
    names = [t.name for t in load_spec(ROOT / "sweeps" / "dmc18.yaml").trials()]
    assert names[:2] == ["acrobot-swingup/sac_ln/te/0", "acrobot-swingup/sac_ln/te/1"]
    assert len(set(names)) == 1440 and "walker-walk/mad_sac/qed0.4/9" in names
    assert got["smoke"] == load_spec(ROOT / "sweeps" / "smoke.yaml").fingerprint()
    assert len(set(got.values())) == len(got)


def test_one_registry_of_agent_names():
    assert set(AGENT_SPECS) == {"sac_ln", "mad_sac"}
    assert {f.path: f.choices for f in run_flags()}[("agent", "name")] == tuple(AGENT_SPECS)


def test_train_help_shows_the_true_default_of_every_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag
    with pytest.raises(SystemExit) as e:
        train_main(["--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    helps, current = {}, None
    for line in lines:  # "  --flag METAVAR  help", the help possibly on the following, more indented line(s)
        m = re.match(r"  (--[a-z-]+)(?: \S+)?(?:\s{2,}(.*))?$", line)
        if m:
            current = m.group(1)
            helps[current] = m.group(2) or ""
        elif current and line.startswith("    ") and line.strip():
            helps[current] = f"{helps[current]} {line.strip()}".strip()
        else:
            current = None
    assert "(default: None)" not in "\n".join(lines)
    flags = run_flags()
    hidden = {f.option for f in flags if "debug" in f.path}  # test-only settings: they work, --help leaves them out
    assert hidden and not hidden & set(helps) and {f.option for f in flags} - hidden <= set(helps)
    for f in flags:
        if f.option in hidden:
            continue
        if f.path == ("task",):
            assert "(required)" in helps[f.option]
            continue
        if f.path[0] == "agent" and f.path[-1] != "name":
            owners = {n: c for n, c in AGENT_SPECS.items() if _has(c, f.path[1:])}
            for name, cls in owners.items():
                default = _default(cls, f.path[1:])
                shown = "none" if default is None else format_value(default)
                assert shown in helps[f.option], (f.option, name)
            if len(owners) < len(AGENT_SPECS):
                assert f"{', '.join(owners)} only" in helps[f.option]
            continue
        model = {"temperature": TemperatureSpec, "train": RunSpec.model_fields["train"].default}.get(f.path[0])
        default = (RunSpec.model_fields[f.path[0]].default if model is None else _default(model, f.path[1:]))
        if f.path == ("agent", "name"):
            default = "sac_ln"
        shown = "none" if default is None else format_value(default)
        assert helps[f.option].endswith(f"(default: {shown})"), (f.option, helps[f.option])
    assert "default: 256 for sac_ln, 512 for mad_sac" in helps["--hidden"]


def _has(cls, path):
    fields = cls.model_fields
    return path[0] in fields and (len(path) == 1 or _has(fields[path[0]].annotation, path[1:]))


def _default(cls, path):
    info = (cls if isinstance(cls, type) else type(cls)).model_fields[path[0]]
    return info.default if len(path) == 1 else _default(info.annotation, path[1:])
