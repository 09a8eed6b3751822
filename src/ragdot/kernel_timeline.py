"""Summaries of Mosaic GPU profiler traces (``backends.sm90.profiling``).

A trace is the Chrome-trace JSON Mosaic writes per call: for every CTA and
warpgroup ("tid" ``1 + warpgroup + warpgroups * cta``) the begin/end events of
the kernel's named ranges.  Their "ts" is the CTA's start (ns) plus the SM's
clock counter over 1000, so differences within one tid, times 1000, are SM
cycles.  ``summarize`` folds all CTAs into one row per warpgroup role: the
cycles each range name takes (outermost ranges only) as a share of the
warpgroup's recorded span, and what no range covers ("other").
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping, Sequence
from typing import Any


def load(path: str) -> list[dict[str, Any]]:
  """The trace events of one trace file."""
  with open(path) as f:
    return json.load(f)["traceEvents"]


def ranges_by_trace(events: Sequence[Mapping[str, Any]]
                    ) -> dict[int, list[tuple[str, float, float, int]]]:
  """tid -> its ranges ``(name, begin, end, depth)`` in cycles from the
  trace's first event (depth 0: not inside another range).  ValueError when
  an end does not close the innermost open range of its name."""
  out: dict[int, list[tuple[str, float, float, int]]] = collections.defaultdict(list)
  open_: dict[int, list[tuple[str, float]]] = collections.defaultdict(list)
  origin: dict[int, float] = {}
  for e in events:
    tid, ts = int(e["tid"]), float(e["ts"]) * 1e3
    origin.setdefault(tid, ts)
    stack = open_[tid]
    if e["ph"] == "B":
      stack.append((e["name"], ts - origin[tid]))
    elif e["ph"] == "E":
      if not stack or stack[-1][0] != e["name"]:
        raise ValueError(f"trace {tid}: end of {e['name']!r} does not close"
                         f" {stack[-1][0] if stack else 'anything'}")
      name, begin = stack.pop()
      out[tid].append((name, begin, ts - origin[tid], len(stack)))
    else:
      raise ValueError(f"trace {tid}: event phase {e['ph']!r} (expected B or E)")
  return dict(out)


def summarize(events: Sequence[Mapping[str, Any]], warpgroups: int,
              roles: Mapping[int, str] | None = None) -> dict[str, dict[str, Any]]:
  """Per warpgroup role (``roles``: warpgroup index -> name; default "wgN"):
  ``traces`` (CTAs seen), ``span`` (mean cycles from a trace's first event to
  its last end), and per range name ``{"cycles": mean per trace, "count":
  mean per trace, "share": of the span}``, plus ``other`` (span no outermost
  range covers)."""
  if warpgroups < 1:
    raise ValueError(f"warpgroups must be >= 1, got {warpgroups}")
  roles = dict(roles or {})
  per_role: dict[str, list[list[tuple[str, float, float, int]]]] = collections.defaultdict(list)
  for tid, rs in ranges_by_trace(events).items():
    wg = (tid - 1) % warpgroups
    per_role[roles.get(wg, f"wg{wg}")].append(rs)
  summary = {}
  for role, traces in sorted(per_role.items()):
    spans, cycles, counts = [], collections.Counter(), collections.Counter()
    for rs in traces:
      spans.append(max(end for _, _, end, _ in rs))
      for name, begin, end, depth in rs:
        if depth == 0:
          cycles[name] += end - begin
          counts[name] += 1
    n = len(traces)
    span = sum(spans) / n
    names = {name: dict(cycles=cycles[name] / n, count=counts[name] / n,
                        share=cycles[name] / n / span if span else 0.0)
             for name in sorted(cycles)}
    covered = sum(v["cycles"] for v in names.values())
    names["other"] = dict(cycles=span - covered, count=0.0,
                          share=(span - covered) / span if span else 0.0)
    summary[role] = dict(traces=n, span=span, ranges=names)
  return summary


def format_summary(summary: Mapping[str, Mapping[str, Any]]) -> str:
  """One line per role and range name: share of the span, mean cycles a
  range, ranges per CTA."""
  lines = []
  for role, s in summary.items():
    lines.append(f"{role}: {s['traces']} CTAs, span {s['span']:.0f} cycles")
    for name, r in sorted(s["ranges"].items(), key=lambda kv: -kv[1]["share"]):
      per = r["cycles"] / r["count"] if r["count"] else float("nan")
      lines.append(f"  {name:<10} {100 * r['share']:5.1f}%  {per:8.0f} cycles each"
                   f"  x {r['count']:.1f}")
  return "\n".join(lines)
