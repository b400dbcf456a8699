"""What the commands print, read as values: wrapped output flattened, line widths, the counts of a ``label: N word,
N word`` line, each group's outcome in a gather's log, the columns of groups.csv. A test asserts these values, and
pins wording only where the words are the feature (an error message, the headline caption)."""

import re


def flat(text: str) -> str:
    """``text`` with its line breaks and runs of spaces as single spaces (what the commands print is wrapped to 100
    columns when stdout is not a terminal)."""
    return " ".join(text.split())


def widest(text: str) -> int:
    """The widest line of ``text`` that could have been wrapped: a line that is one word (a path longer than the
    width, kept whole so that it can be copied) does not count."""
    return max((len(line) for line in text.splitlines() if len(line.split()) > 1), default=0)


def counts(text: str, label: str) -> dict[str, int]:
    """``{word: N}`` of the first line of ``text`` holding ``label: N word, N word, ...`` (up to a `` (``, ``;`` or
    the line's end; thousands commas allowed), e.g. ``counts(out, "trials") == {"done": 3, "running": 0, ...}``; {}
    when no line has the label."""
    for line in text.splitlines():
        head, found, rest = line.partition(f"{label}: ")
        if found and (not head or head.endswith(" ")):
            rest = re.split(r" \(|;", rest)[0]
            pairs = [re.fullmatch(r"([\d,]+) (.+)", part.strip()) for part in rest.split(", ")]
            return {m.group(2): int(m.group(1).replace(",", "")) for m in pairs if m}
    return {}


def outcomes(log: str) -> dict[str, str]:
    """``{group: evaluated | cached | REFUSED}`` of a gather's log (``  <task/agent/variant>: <outcome>`` lines)."""
    return dict(re.findall(r"^\s+(\S+/\S+/\S+): (evaluated|cached|REFUSED)\b", log, flags=re.M))


# groups.csv's columns in order: the original ten, then the added ones (tables.group_rows).
GROUP_COLUMNS = ["task", "agent", "variant", "n_seeds", "mean_return", "std_return_across_seeds", "V",
                 "action_distance", "q1_dispersion", "early_q_gap", "n_failed", "V_ci_lower", "V_ci_upper",
                 "action_distance_ci_lower", "action_distance_ci_upper", "score_var", "alpha_frac_floor",
                 "alpha_frac_cap", "alpha_frac_floor_late", "alpha_frac_cap_late", "log_std_at_min", "qed_at_cap",
                 "n_unverified", "alpha_frac_hot_late", "alpha_ratio_late", "entropy_late", "entropy_gap_late",
                 "alpha_regime"]
