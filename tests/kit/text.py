"""What the commands print, read as values: wrapped output flattened, line widths, the columns of groups.csv."""


def flat(text: str) -> str:
    """``text`` with its line breaks and runs of spaces as single spaces (what the commands print is wrapped to 100
    columns when stdout is not a terminal)."""
    return " ".join(text.split())


def widest(text: str) -> int:
    """The widest line of ``text`` that could have been wrapped: a line that is one word (a path longer than the
    width, kept whole so that it can be copied) does not count."""
    return max((len(line) for line in text.splitlines() if len(line.split()) > 1), default=0)


# groups.csv's columns in order: the original ten, then the added ones (tables.group_rows).
GROUP_COLUMNS = ["task", "agent", "variant", "n_seeds", "mean_return", "std_return_across_seeds", "V",
                 "action_distance", "q1_dispersion", "early_q_gap", "n_failed", "V_ci_lower", "V_ci_upper",
                 "action_distance_ci_lower", "action_distance_ci_upper", "score_var", "alpha_frac_floor",
                 "alpha_frac_cap", "alpha_frac_floor_late", "alpha_frac_cap_late", "log_std_at_min", "qed_at_cap",
                 "n_unverified", "alpha_frac_hot_late", "alpha_ratio_late", "entropy_late", "entropy_gap_late",
                 "alpha_regime"]
