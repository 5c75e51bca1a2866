"""Per-group hyperparameter selection: a fair comparison runs each method at its own best rate.

A *group* (a method, a method x optimizer family, a trainer x modality, ...) runs a grid of
*settings* (``{"lr": 1e-3}``, ``{"lr": 1e-3, "server_lr": 3e-3}``) on one seed; once every grid run
is finished, the setting with the highest score (for example the mean of the run's last three
evaluations) is the group's :class:`Choice`, and the reported runs then use it on other seeds, so
the reported figure is not the maximum the selection picked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedtune.harness.plan import RunSpec
from fedtune.harness.runs import load_summary, run_state
from fedtune.report import figure, table_lines

Setting = dict[str, float]


@dataclass(frozen=True)
class Sweep:
    """A suite's learning-rate sweep (``--lr-grid``, ``--sweep-seed``): the rates, ascending, that
    every swept group runs on the sweep seed."""

    grid: tuple[float, ...]
    seed: int = 0

    def __str__(self) -> str:
        return f"rates {', '.join(f'{lr:g}' for lr in self.grid)} swept on seed {self.seed}"


@dataclass(frozen=True)
class Choice:
    """A group's chosen setting, its score, and every grid point's score in grid order (scores are
    fractions; None: the run has no evaluation)."""

    setting: Setting
    score: float
    scores: list[tuple[Setting, float | None]]

    @property
    def runner_up(self) -> tuple[Setting, float] | None:
        others = [(s, v) for s, v in self.scores if s != self.setting and v is not None and not math.isnan(v)]
        return max(others, key=lambda sv: sv[1]) if others else None

    @property
    def margin(self) -> float | None:
        """Points (percent) by which the chosen setting beat the best other grid point."""
        other = self.runner_up
        return None if other is None else 100 * (self.score - other[1])

    def at_edge(self, key: str = "lr") -> str | None:
        """``"smallest"`` / ``"largest"`` when the chosen ``key`` is an end of the grid's values (a value
        beyond it might do better), else None (also for a grid of one value)."""
        values = sorted({s[key] for s, _ in self.scores})
        if len(values) < 2:
            return None
        return "smallest" if self.setting[key] == values[0] else "largest" if self.setting[key] == values[-1] else None


def choose_from(scores: list[tuple[Setting, float | None]]) -> Choice | None:
    """The argmax of the scores (ties: the first in grid order, i.e. the smaller rate); None when no
    grid point has a score."""
    scored = [(s, v) for s, v in scores if v is not None and not math.isnan(v)]
    if not scored:
        return None
    best = max(scored, key=lambda sv: sv[1])  # max keeps the first of equal values
    return Choice(best[0], best[1], scores)


def choose(
    group: list[RunSpec], setting_of: Callable[[RunSpec], Setting], score: Callable[[RunSpec], float | None]
) -> Choice | None:
    """The group's choice once every one of its grid runs is finished (None before, or for no runs);
    the grid is ordered by the settings' values (``setting_of``'s key order)."""
    if not group or any(run_state(s) != "done" for s in group):
        return None
    ordered = sorted(group, key=lambda s: tuple(setting_of(s).values()))
    return choose_from([(setting_of(s), score(s)) for s in ordered])


LEARNED_POINTS = 2.0  # a choice within this many points of the reference rate learned nothing


def setting_text(setting: Setting) -> str:
    """``{"lr": 0.001, "server_lr": 0.003}`` -> ``"lr 0.001, server lr 0.003"``."""
    return ", ".join(f"{key.replace('_', ' ')} {value:g}" for key, value in setting.items())


def choice_text(
    choice: Choice | None, reference: float | None = None, reference_name: str = "majority-class rate"
) -> str:
    """A report's line for a group's choice: the setting, its margin over the runner-up, and a warning
    when it learned nothing (within :data:`LEARNED_POINTS` of ``reference``, a fraction) or lies at
    an end of the learning-rate grid."""
    if choice is None:
        return "waiting for the sweep"
    text = setting_text(choice.setting)
    runner_up = choice.runner_up
    if runner_up is not None:
        text += f" by {choice.margin:.2f} points over {setting_text(runner_up[0])}"
    if reference is not None and 100 * choice.score < 100 * reference + LEARNED_POINTS:
        return text + f" — no grid point learned (all within {LEARNED_POINTS:g} points of the {reference_name})"
    key = next(iter(choice.setting))  # the swept rate (a second key, such as a server rate, is not an edge)
    if choice.at_edge(key):
        text += f" (the grid's {choice.at_edge(key)} {key.replace('_', ' ')}: a rate beyond it might do better)"
    return text


def sweep_sections(
    panels: dict[str, dict[str, list[RunSpec]]],
    choices: dict[str, dict[str, Choice | None]],
    score: Callable[[RunSpec], float | None],
    png: Path,
    *,
    key: str = "lr",
    row_title: str = "method",
    reference_name: str = "majority-class rate",
    ylabel: str = "score (%)",
) -> list[str]:
    """A sweep report's markdown, one section per panel (a data set, a modality): a row per group
    (its runs, each labelled with its ``key`` value), a column per grid value with the run's score
    in percent (**bold**: the group's choice; ``pending`` until finished, ``–`` without a score),
    the :func:`choice_text` of the group, and the reference rate the panel's runs report
    (``majority_accuracy``); and a plot of the scores against ``key``, a panel each, at ``png``."""
    lines: list[str] = []
    with figure(png, 1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False) as (fig, axes):
        for ax, (panel, groups) in zip(axes[0], panels.items()):
            runs = [s for group in groups.values() for s in group]
            done = [x for x in map(load_summary, runs) if x]
            reference = done[0].get("majority_accuracy") if done else None
            rows = []
            for name, group in groups.items():
                group = sorted(group, key=lambda s: s.labels[key])
                choice = choices[panel].get(name)
                ended = [load_summary(s) is not None for s in group]  # read each run folder once
                scores = [score(s) if d else None for s, d in zip(group, ended)]
                scores = [None if v is None or math.isnan(v) else v for v in scores]
                cells = ["pending" if not d else "–" if v is None else f"{100 * v:.2f}" for d, v in zip(ended, scores)]
                finished = all(ended)
                chosen = (
                    "no grid point has a score"
                    if choice is None and finished
                    else choice_text(choice, reference, reference_name)
                )
                rows.append(
                    [
                        name,
                        *(
                            f"**{c}**" if choice and s.labels[key] == choice.setting[key] else c
                            for s, c in zip(group, cells)
                        ),
                        chosen,
                    ]
                )
                points = [(s.labels[key], 100 * v) for s, v in zip(group, scores) if v is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", ms=3, label=name)
            values = sorted({s.labels[key] for s in runs})
            name = key.replace("_", " ")
            lines += [
                f"## {panel}",
                "",
                *table_lines([row_title, *(f"{name} {v:g}" for v in values), "chosen"], rows),
                "",
                f"{reference_name[0].upper()}{reference_name[1:]}: "
                + (f"{100 * reference:.2f}%." if reference is not None else "pending."),
                "",
            ]
            ax.set_xscale("log")
            ax.set(title=f"{panel}: sweep seed", xlabel=name, ylabel=ylabel)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return lines


def sweep_note(groups: dict[str, list[RunSpec]], choices: dict[str, Choice | None], what: str) -> str:
    """A plan's line on the groups without a choice: those still waiting for their sweep runs, and
    those whose sweep finished without any score (they get no table runs)."""
    unchosen = [name for name in groups if choices.get(name) is None]
    waiting = [name for name in unchosen if any(run_state(s) != "done" for s in groups[name])]
    scoreless = [name for name in unchosen if name not in waiting]
    text = f"{len(waiting)} {what} wait for their sweep" + (f": {', '.join(waiting)}" if waiting else "")
    if scoreless:
        text += f"; {len(scoreless)} finished it without a score (no evaluation counted; no table runs): " + ", ".join(
            scoreless
        )
    return text
