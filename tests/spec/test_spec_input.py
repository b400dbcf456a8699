"""Every spec input is bounded and named: YAML alias bombs, oversized, deep or complex-keyed files are refused before
anything is expanded; merge keys work; the duplicate check is linear; messages stay short and suggest the near name."""

import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qed_ray.spec import hints, sweep as spec_module
from qed_ray.spec.grid import MAX_GRID_VALUES, MAX_PROBLEMS, expand_grid
from qed_ray.spec.sweep import MAX_TRIALS, SpecError, load_spec
from qed_ray.service.sweep_cli import main
from qed_ray.spec.yaml_input import MAX_BYTES, MAX_DEPTH, MAX_NODES, YamlInputError, parse

ROOT = Path(__file__).resolve().parents[2]
SPEC_HEAD = "name: t\ntasks: [cartpole-balance]\nseeds: 2\n"
TRAIN = "train: {env_steps: 2000, eval_every: 1000, warmup_decisions: 100}\n"
BUDGET_LINE = re.compile(r"line (\d+): ([\d,]+) values by this line, counting each alias \(\*name\) as a copy of "
                         r"what it names; at most 100,000")


def _node(kind: str, items: list[str], i: int) -> str:
    if kind == "list":
        return f"[{', '.join(items)}]"
    if kind == "merge" and i:  # merges the level before nine times, and names it once more
        return f"{{<<: [{', '.join(items)}], m{i}: {items[0]}}}"
    return "{" + ", ".join(f"k{j}: {v}" for j, v in enumerate(items)) + "}"


def _levels(kind: str, depth: int = 9) -> str:
    """A < 1 KB bomb: level 0 holds 9 scalars, each next level 9 aliases of the one before (9^depth values)."""
    lines = [f"l0: &l0 {_node(kind, ['lol'] * 9, 0)}"]
    lines += [f"l{i}: &l{i} {_node(kind, [f'*l{i - 1}'] * 9, i)}" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


# A grid axis whose values are the levels of a bomb, each defined where it is first used.
AXIS_BOMB = "[&x0 [1, 2, 3, 4, 5, 6, 7, 8, 9], " + ", ".join(
    f"&x{i} [{', '.join([f'*x{i - 1}'] * 9)}]" for i in range(1, 8)) + "]"
BOMBS = {
    "aliases_in_lists": _levels("list"),
    "aliases_in_mappings": _levels("map"),
    "merge_keys": _levels("merge"),
    "aliases_in_keys": _levels("list", depth=5) + "keys: {? *l4 : 1}\n",
    "in_a_grid_axis": SPEC_HEAD + TRAIN + f"agents:\n- name: sac_ln\n  temperatures: [{{kind: qed, k: {AXIS_BOMB}}}]\n",
}


def test_alias_bombs_are_refused_by_the_node_budget_under_a_memory_limit(tmp_path, capsys):
    paths = {}
    for name, text in BOMBS.items():
        assert len(text.encode()) < 1024, name
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(text)
    # Each bomb is loaded in a process that cannot take more than 256 MiB of address space: expanding any of them
    # would take gigabytes. The process prints the exit code and the error line the CLI gives for a SpecError.
    probe = ("import sys\nfrom qed_ray.spec.sweep import SpecError, load_spec\n"
             "for path in sys.argv[1:]:\n"
             "    try:\n        load_spec(path)\n        print(0, 'loaded')\n"
             "    except SpecError as e:\n        print(2, 'error: ' + str(e).replace(chr(10), ' // '))\n")
    limit = 256 << 20
    done = subprocess.run([sys.executable, "-c", probe, *map(str, paths.values())], capture_output=True, text=True,
                          timeout=60, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    results = [line.split(" ", 1) for line in done.stdout.splitlines()]
    assert len(results) == len(BOMBS)
    for (name, path), (rc, message) in zip(paths.items(), results):
        assert rc == "2" and message.startswith(f"error: {path}: line ") and " // " not in message, (name, message)
        m = BUDGET_LINE.search(message)
        assert m is not None, (name, message)
        counted = int(m.group(2).replace(",", ""))
        # Refused at the first alias past the budget: every alias counted before named a target within it.
        assert MAX_NODES < counted <= 2 * MAX_NODES, (name, counted)
    # The CLI itself: exit code 2 and the same single line, nothing expanded (the probe above showed it cannot be).
    assert main([str(paths["aliases_in_lists"]), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and BUDGET_LINE.search(err) and err.startswith(f"error: {paths['aliases_in_lists']}: ")


def test_the_budget_counts_an_alias_as_the_size_of_what_it_names():
    text = "a: &a [x, x, x]\nb: [*a, *a, *a, *a]\n"
    # root 1, key a 2, [x, x, x] 3-6, key b 7, its list 8, then 4 per alias: 12, 16, 20, 24.
    assert parse(text, "f.yaml", max_nodes=24) == {"a": ["x"] * 3, "b": [["x"] * 3] * 4}
    with pytest.raises(YamlInputError, match=r"^f.yaml: line 2: 24 values by this line, counting each alias "
                                             r"\(\*name\) as a copy of what it names; at most 23$"):
        parse(text, "f.yaml", max_nodes=23)
    with pytest.raises(YamlInputError, match=r"^f.yaml: line 1: alias \*a names a node that contains it"):
        parse("a: &a [1, *a]\n", "f.yaml")


def test_a_spec_with_merge_keys_loads_and_equals_its_expanded_form(tmp_path):
    merged = SPEC_HEAD + """agents:
- name: sac_ln
  overrides: &small {hidden: 16, batch_size: 16}
  temperatures:
  - &qed {kind: qed, k: 0.2, tau: 0.8}
  - {<<: *qed, k: [0.3, 0.4]}
- name: mad_sac
  overrides:
    <<: *small
    hidden: 32
    mad: &mad {latent_dim: 16, simnorm_group: 8, encoder_hidden: 16, model_hidden: 16}
  temperatures: [{<<: [*qed, {tau: 0.5, n_actions: 4}], alpha_max: 0.3}]
""" + TRAIN
    expanded = SPEC_HEAD + """agents:
- name: sac_ln
  overrides: {hidden: 16, batch_size: 16}
  temperatures:
  - {kind: qed, k: 0.2, tau: 0.8}
  - {kind: qed, k: [0.3, 0.4], tau: 0.8}
- name: mad_sac
  overrides:
    batch_size: 16
    hidden: 32
    mad: {latent_dim: 16, simnorm_group: 8, encoder_hidden: 16, model_hidden: 16}
  temperatures: [{kind: qed, k: 0.2, tau: 0.8, n_actions: 4, alpha_max: 0.3}]
""" + TRAIN
    (tmp_path / "merged.yaml").write_text(merged)
    (tmp_path / "expanded.yaml").write_text(expanded)
    a, b = load_spec(tmp_path / "merged.yaml"), load_spec(tmp_path / "expanded.yaml")
    assert a.trials() == b.trials() and a.fingerprint() == b.fingerprint()
    assert [t.name for t in a.trials()][::2] == [
        "cartpole-balance/sac_ln/qed0.2+tau=0.8/0", "cartpole-balance/sac_ln/qed0.3+tau=0.8/0",
        "cartpole-balance/sac_ln/qed0.4+tau=0.8/0",
        "cartpole-balance/mad_sac/qed0.2+n_actions=4+tau=0.8+alpha_max=0.3/0"]
    # An explicit key wins over a merged one, and an earlier mapping of a merge list over a later one.
    assert parse("b: &b {x: 1, y: 2}\nm: &m {<<: *b, y: 5}\nc: {<<: [*m, *b], z: 3}\nd: {<<: *m}\n", "f") == {
        "b": {"x": 1, "y": 2}, "m": {"x": 1, "y": 5}, "c": {"x": 1, "y": 5, "z": 3}, "d": {"x": 1, "y": 5}}


def test_the_trial_cap_spec_validates_with_a_linear_duplicate_check(tmp_path, monkeypatch):
    seen = []

    def counting(items):
        items = list(items)
        seen.append(len(items))
        return hints.duplicates(items)

    monkeypatch.setattr(spec_module, "duplicates", counting)
    p = tmp_path / "cap.yaml"
    p.write_text(SPEC_HEAD.replace("seeds: 2", "seeds: 10000") + "agents:\n- name: sac_ln\n  temperatures: "
                 "[{kind: qed, k: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]}]\n" + TRAIN)
    trials = load_spec(p).trials()
    assert len(trials) == MAX_TRIALS and len({t.name for t in trials}) == MAX_TRIALS
    assert seen == [1, MAX_TRIALS], "tasks once, then every trial name once"
    assert trials[-1].name == "cartpole-balance/sac_ln/qed1/9999" and trials[-1].run.seed == 9999


class Counted:
    """A hashable item that counts how often it is hashed and compared."""
    calls = {"hash": 0, "eq": 0}

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        Counted.calls["hash"] += 1
        return hash(self.value)

    def __eq__(self, other):
        Counted.calls["eq"] += 1
        return self.value == other.value


def test_the_duplicate_check_hashes_each_item_once_and_compares_only_equal_hashes():
    items = [Counted(i) for i in range(MAX_TRIALS)] + [Counted(7)]
    Counted.calls.update(hash=0, eq=0)
    found = hints.duplicates(items)
    assert [c.value for c in found] == [7]
    # One hash per item; comparisons only where hashes meet: the repeated item's lookup and its store.
    assert Counted.calls == {"hash": MAX_TRIALS + 1, "eq": 2}


def test_an_oversized_file_is_refused_before_the_parser_sees_it(tmp_path, capsys):
    p = tmp_path / "big.yaml"
    p.write_text("[" * (MAX_BYTES + 1))  # parsed, it would be refused for its depth, not its size
    assert main([str(p)]) == 2
    assert capsys.readouterr().err == (f"error: {p}: {MAX_BYTES + 1:,} bytes, more than the {MAX_BYTES:,} a spec "
                                       f"or config file may have (is it the right file?)\n")
    with pytest.raises(SpecError, match=r"^/dev/zero: more than the 1,048,576 bytes a spec or config file may have"):
        load_spec("/dev/zero")  # no size in its metadata: the read stops one byte past the limit


@pytest.mark.parametrize("text,message", [
    ("name: t\n? [a, b]\n: 1\n", "line 2: a mapping key must be a plain value, not a sequence (complex keys are "
                                 "not allowed)"),
    ("name: t\n? {a: 1}\n: 1\n", "line 2: a mapping key must be a plain value, not a mapping"),
    ("l: &l [1]\nname: {*l : 1}\n", "line 2: a mapping key must be a plain value, not a sequence (complex keys are not "
                                    "allowed; *l names one)"),
    ("name: t\nx: " + "[" * 400 + "]" * 400 + "\n", f"line 2: nested {MAX_DEPTH + 1} levels deep (aliases expanded); "
                                                    f"at most {MAX_DEPTH}"),
    ("d: &d " + "[" * 20 + "]" * 20 + "\ne: [[[[[[[[[[[[*d]]]]]]]]]]]]\n",
     f"line 2: nested {MAX_DEPTH + 1} levels deep (aliases expanded); at most {MAX_DEPTH}"),
    ("seeds: 1" + "0" * 5000 + "\n", "invalid YAML value (Exceeds the limit (4300 digits) for integer string"),
    ("name: t\nseeds: \x002\n", "line 2, column 8: the character U+0000 is not allowed in YAML (a NUL or control "
                                 "character: is it the right file?)"),  # PyYAML's reader raised it unparsed
    ("name: t\x07\n", "line 1, column 8: the character U+0007 is not allowed in YAML"),
])
def test_complex_keys_and_deep_nesting_give_one_line(tmp_path, capsys, text, message):
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    assert main([str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {p}: {message}") and err.count("\n") == 1, err


BASE = {"name": "t", "tasks": ["cartpole-balance"], "seeds": 2,
        "agents": [{"name": "sac_ln", "overrides": {"hidden": 16}, "temperatures": [{"kind": "qed", "k": 0.2}]}],
        "train": {"env_steps": 2000, "eval_every": 1000, "warmup_decisions": 100}}


@pytest.mark.parametrize("path,value,line", [
    ("train.eval_evry", 2000, "train.eval_evry: unknown field; did you mean 'eval_every'?"),
    ("agents.0.temperatures.0.kind", "qde",
     "agents.0.temperatures.0.kind: Input should be 'te', 'fixed' or 'qed' (got 'qde'); did you mean 'qed'?"),
    ("agents.0.overrides.activation", "relux",
     "agents.0.overrides.activation: Input should be 'mish' or 'relu' (got 'relux'); did you mean 'relu'?"),
    ("final_eval", {"policies": ["maen"]},
     "final_eval.policies.0: Input should be 'mean' or 'sample' (got 'maen'); did you mean 'mean'?"),
    ("agents.0.name", "sac-ln", "agents.0.name: unknown agent 'sac-ln' (did you mean 'sac_ln'?); implemented agents: "
                                "sac_ln, mad_sac"),
    ("tasks", ["cheetah_run"], "tasks: unknown task(s) ['cheetah_run'] (did you mean 'cheetah-run'?); valid tasks: "),
    ("tasks", "dmc81", "tasks: unknown task set 'dmc81' (did you mean 'dmc18'?); task sets: dmc18"),
    ("tasks", "cheetah-run", "tasks: 'cheetah-run' is a task, not a task set; give a list of tasks: [cheetah-run]"),
    ("agents.0.overrides.mad", {"proportion_real": 0.3}, "agents.0.overrides.mad: applies only to mad_sac, not to "
                                                         "sac_ln"),
    ("agents.0.overrides.proportion_real", 0.3,
     "agents.0.overrides.proportion_real: applies only to mad_sac (as mad.proportion_real), not to sac_ln"),
    ("agents.0.overrides.hl", {"vmni": -5}, "agents.0.overrides.hl.vmni: unknown field; did you mean 'vmin'?"),
])
def test_misspelt_keys_and_values_get_the_near_name(tmp_path, capsys, path, value, line):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    node, keys = raw, path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    node[keys[-1]] = value
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert main([str(p), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {line}") and err.count("\n") == 1, err


def test_messages_stay_short_however_large_the_input(tmp_path, capsys):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    raw["tasks"] = ["x" * 20_000]
    raw["agents"][0]["temperatures"][0]["k"] = [-i for i in range(1, 1000)]
    raw["train"]["device"] = "gpu" * 5_000
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert main([str(p)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert max(len(line) for line in lines) < 500 and len(lines) == MAX_PROBLEMS + 1 + 2, lines
    assert re.match(r"error: tasks: unknown task\(s\) \['x{20,40}\.\.\.x{20,40}'\]; valid tasks: ", lines[0]), lines[0]
    assert lines[1:MAX_PROBLEMS + 1] == [f"error: k (agent sac_ln, temperature entry 1): -{i} is not above 0; QED's "
                                         f"alpha(s) = Delta / (k x action_dim) needs 0 < k <= 1000 (paper Sec. 5.1), "
                                         f"and the paper uses 0.1 to 0.4" for i in range(1, MAX_PROBLEMS + 1)]
    assert lines[MAX_PROBLEMS + 1] == ("error: agents.0.temperatures.0: more problems may follow in other combinations "
                                       "(fix these first)")
    assert re.fullmatch(r"error: train\.device: '[gpu]{20,40}\.\.\.[gpu]{20,40}' is not one of 'auto', 'cpu', 'cuda', "
                        r"'cuda:N'", lines[-1]) and len(lines[-1]) < 200, lines[-1]


def _junk(level: int) -> str:
    """A mapping of 9^level values in a few hundred bytes: each level's first entry defines what the others name."""
    if level == 0:
        return "{" + ", ".join(f"k{n}: 0" for n in range(9)) + "}"
    return (f"{{k0: &j{level} {_junk(level - 1)}, " + ", ".join(f"k{n}: *j{level}" for n in range(1, 9)) + "}")


def test_a_grid_padded_with_junk_is_refused_before_it_is_validated_per_combination(tmp_path, capsys):
    p = tmp_path / "spec.yaml"
    p.write_text(SPEC_HEAD + TRAIN + "agents:\n- name: sac_ln\n  temperatures: [{kind: te}]\n  overrides:\n"
                 f"    hidden: [{', '.join(map(str, range(1, 401)))}]\n    junk: {_junk(3)}\n")
    assert main([str(p)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: agents\.0\.overrides: 400 combinations of ([\d,]+) values each: more than the "
                        rf"{MAX_GRID_VALUES:,} values a grid of agent settings may hold \(is something other than "
                        rf"settings in it\?\)\n", err), err


def test_expansion_copies_only_the_mappings_on_the_axes_paths():
    shared = {"deep": {"x": 1}}
    raw = {"hidden": [1, 2], "mad": {"proportion_real": [0.5, 0.9], "other": shared}, "gamma": 0.9}
    combos = expand_grid(raw)
    assert combos == [{"hidden": h, "mad": {"proportion_real": p, "other": shared}, "gamma": 0.9}
                      for h in (1, 2) for p in (0.5, 0.9)]
    assert all(c["mad"]["other"] is shared for c in combos) and raw["mad"]["proportion_real"] == [0.5, 0.9]
    assert len({id(c["mad"]) for c in combos}) == 4
