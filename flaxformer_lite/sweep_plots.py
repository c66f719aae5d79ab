"""Figures that read at 100%: bars per row from zero, curves told apart, legends off the data.

bar_figure draws a sweep table, curve_figure a sweep's curves and
scatter_figure its scatters (flaxformer_lite/sweep.py); READABLE, curve_style and save are shared with the
benchmarks' figures (benchmarks/train_short_test_long.py).
matplotlib is imported on first use: the sweep imports this module at start.
"""
from __future__ import annotations

import math

DPI = 110
# 10 pt text, 9 pt at the smallest: legible at 100% without zooming.
READABLE = {'font.size': 10, 'axes.titlesize': 10, 'axes.labelsize': 10,
            'xtick.labelsize': 9, 'ytick.labelsize': 9, 'legend.fontsize': 9,
            'figure.titlesize': 11, 'savefig.dpi': DPI}


MARKERS = 'osD^vP*Xh<>p'
DASHES = ('-', '--', '-.', ':')

# Hollow: a seed on the error bar's line stays visible.
SEED_DOT = dict(marker='o', markersize=4, color='k', markerfacecolor='white', zorder=3)


def pyplot():
  """matplotlib.pyplot on the file-only backend (no display needed)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  return plt


SI = ((1e12, 'T'), (1e9, 'G'), (1e6, 'M'))


def fmt_value(x: float, like: float | None = None) -> str:
  """A metric as the tables print it: BLEU-sized values to 0.01, losses and
  accuracies to 0.001, counts from a million on in SI units to 4 digits
  (3.053G FLOPs); in the digits of `like`'s size, e.g. a std beside its mean."""
  size = abs(x if like is None else like)
  for scale, unit in SI:
    if size >= scale:
      return f'{x / scale:.3f}{unit}' if size < 10 * scale else f'{x / scale:.2f}{unit}'
  return f'{x:.2f}' if size >= 10 else f'{x:.3f}'


def seeds_phrase(counts: list[int]) -> str:
  """'one seed', '3 seeds' or '2-3 seeds' for the number of values per row."""
  lo, hi = min(counts), max(counts)
  if hi == 1:
    return 'one seed'
  return f'{hi} seeds' if lo == hi else f'{lo}-{hi} seeds'


def summarise(values: list[float]) -> tuple[float, float, int]:
  """(mean, sample standard deviation (n - 1; nan for one value), n)."""
  n = len(values)
  mean = sum(values) / n
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
  return mean, std, n


def bar_figure(title: str, rows: list[str], panels: dict[str, dict[str, list[float]]]):
  """A panel per metric (`panels`: label -> {row: per-seed values}), a
  horizontal bar per row: the mean over seeds from 0, its value written at
  the bar's end, with several seeds an error bar (± sample std) and a dot per
  seed. Rows without values are left empty. Returns the matplotlib Figure."""
  plt = pyplot()
  from matplotlib.lines import Line2D
  from matplotlib.patches import Patch
  counts = [len(v) for p in panels.values() for v in p.values() if v] or [1]
  several = max(counts) > 1
  spread = (f'mean ± sample std over {seeds_phrase(counts)}' if several
            else 'one seed: no spread shown')
  # Wide enough for the row labels, the panels and the title (~0.1 inch a character).
  width = max(1.2 + 0.08 * max(len(r) for r in rows) + 3.2 * len(panels),
              0.1 * max(len(title), len(spread)) + 0.5)
  height = 1.5 + 0.3 * len(rows) + 0.4 * several
  with plt.rc_context(READABLE):
    fig, axes = plt.subplots(1, len(panels), figsize=(width, height), sharey=True,
                             squeeze=False, layout='constrained')
    for ax, (label, values) in zip(axes[0], panels.items()):
      _bars(ax, rows, values)
      ax.set_title(label)
    axes[0][0].set_yticks(range(len(rows)), rows)
    axes[0][0].invert_yaxis()  # the table's first row on top
    fig.suptitle(f'{title}\n{spread}')
    if several:
      handles = [Patch(color='C0', alpha=0.6, label='mean'),
                 Line2D([], [], color='k', marker='|', markersize=8, label='± sample std'),
                 Line2D([], [], **SEED_DOT, linestyle='', label='each seed')]
      fig.legend(handles=handles, loc='outside lower center', ncol=3, frameon=False)
  return fig


def _bars(ax, rows: list[str], values: dict[str, list[float]]):
  """One metric's bars on `ax`; the axis runs from 0 (or below it, for
  negative values) to past the longest bar's label."""
  ends = [0.0]
  for y, row in enumerate(rows):
    v = values.get(row)
    if not v:
      continue
    mean, std, n = summarise(v)
    std = std if n > 1 else 0.0  # one value: no error bar
    ax.barh(y, mean, color='C0', alpha=0.6, height=0.7)
    if len(v) > 1:
      ax.errorbar(mean, y, xerr=std, color='k', capsize=3, linewidth=1)
      ax.plot(v, [y] * len(v), **SEED_DOT, linestyle='')
    end = max(v + [mean + std]) if mean >= 0 else min(v + [mean - std])
    ax.annotate(fmt_value(mean), (end, y), xytext=(3 if mean >= 0 else -3, 0),
                textcoords='offset points', va='center', ha='left' if mean >= 0 else 'right',
                fontsize=9)
    ends.append(end)
  lo, hi = min(ends), max(ends)
  span = (hi - lo) or 1.0
  # Room for the value labels: about 8 characters of 9 pt in a 3.2 inch panel.
  # (Every value 0, as a task no row learns: still an axis from 0.)
  ax.set_xlim(lo - (0.25 * span if lo < 0 else 0),
              hi + (0.25 * span if hi > 0 or lo == hi else 0))
  ax.axvline(0, color='k', linewidth=0.8)
  ax.grid(axis='x', alpha=0.3)


def curve_style(i: int) -> dict:
  """The i-th curve's colour, marker and dash: any two of 40 curves differ in
  at least one, so overlapping curves stay told apart."""
  return dict(color=f'C{i % 10}', marker=MARKERS[i % len(MARKERS)],
              linestyle=DASHES[i % len(DASHES)], markersize=5)


def curve_figure(title: str, xlabel: str, ylabel: str,
                 panels: dict[str, dict[str, tuple[list[float], list[float]]]]):
  """A panel per entry of `panels` (panel title -> {curve: (xs, ys)}), the
  y axis from 0 to 1 (accuracies), one legend below. A curve keeps its style
  in every panel. Returns the matplotlib Figure."""
  plt = pyplot()
  names = list(dict.fromkeys(c for curves in panels.values() for c in curves))
  with plt.rc_context(READABLE):
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 0.6, 4.6),
                             sharey=True, squeeze=False, layout='constrained')
    for ax, (panel, curves) in zip(axes[0], panels.items()):
      for name, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=name, **curve_style(names.index(name)))
      if not curves:  # a half-done grid
        ax.text(0.5, 0.5, 'no results yet', transform=ax.transAxes, ha='center')
      ax.set_title(panel)
      ax.set_xlabel(xlabel)
      ax.set_ylim(0, 1.02)
      ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # every curve once, whichever panel has it
      for h, l in zip(*ax.get_legend_handles_labels()):
        if l not in labels:
          handles.append(h), labels.append(l)
    fig.suptitle(title)
    if labels:
      fig.legend(handles, labels, loc='outside lower center', ncol=min(6, len(labels)))
  return fig


def scatter_figure(title: str, xlabel: str, ylabel: str,
                   panels: dict[str, dict[str, tuple[list[float], list[float]]]]):
  """A panel per entry of `panels` (title -> {row: (x per seed, y per seed)}):
  per row a large marker at the means and a small hollow one per seed, in
  the row's style (curve_style), named in one legend below (points that
  coincide stay told apart by it). Rows without both values are left out.
  Returns the matplotlib Figure."""
  plt = pyplot()
  names = list(dict.fromkeys(r for rows in panels.values() for r in rows))
  with plt.rc_context(READABLE):
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 0.6, 4.8),
                             squeeze=False, layout='constrained')
    for ax, (panel, rows) in zip(axes[0], panels.items()):
      drawn = 0
      for row, (xs, ys) in rows.items():
        if not xs or not ys:
          continue
        style = curve_style(names.index(row))
        color, marker = style['color'], style['marker']
        ax.plot(xs, ys, linestyle='', marker=marker, markersize=5, color=color,
                markerfacecolor='white', alpha=0.8)
        ax.plot([sum(xs) / len(xs)], [sum(ys) / len(ys)], linestyle='', marker=marker,
                markersize=9, color=color, label=row)
        drawn += 1
      if not drawn:
        ax.text(0.5, 0.5, 'no results yet', transform=ax.transAxes, ha='center')
      ax.set_title(panel)
      ax.set_xlabel(xlabel)
      ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles, labels = [], []
    for ax in axes[0]:  # every row once, whichever panel has it
      for h, l in zip(*ax.get_legend_handles_labels()):
        if l not in labels:
          handles.append(h), labels.append(l)
    counts = [len(ys) for rows in panels.values() for _, ys in rows.values() if ys] or [1]
    fig.suptitle(f'{title}\nmean of {seeds_phrase(counts)} (large), each seed (small)')
    if labels:
      fig.legend(handles, labels, loc='outside lower center', ncol=min(4, len(labels)))
  return fig


def save(fig, path: str) -> str:
  """Writes `fig` as a PNG at DPI and closes it; returns the path."""
  plt = pyplot()
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return path
