"""Summaries of Mosaic GPU profiler traces (``backends.sm90.profiling``).

A trace is the Chrome-trace JSON Mosaic writes per call: for every CTA and
warpgroup ("tid" ``1 + warpgroup + warpgroups * cta``) the begin/end events of
the kernel's named ranges.  Their "ts" is the CTA's start (ns) plus the SM's
clock counter over 1000, so differences within one tid, times 1000, are SM
cycles.  Mosaic's JSON also takes a per-event profiling overhead off each
time, more for later events, which skews one warpgroup's times against
another's; ``raw_dumps`` keeps the raw buffer beside it, and ``load_raw``
turns that into the same events with exact SM cycles from the CTA's first
event (the warpgroups of a CTA share one clock).  ``summarize`` folds all CTAs
into one row per warpgroup role: the cycles each range name takes (outermost
ranges only) as a share of the warpgroup's recorded span, and what no range
covers ("other").  ``ring_latency`` pairs the producer's loads with the
consumers' waits for them.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np


def load(path: str) -> list[dict[str, Any]]:
  """The trace events of one trace file (gzipped when its name ends in .gz)."""
  with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
    return json.load(f)["traceEvents"]


@contextlib.contextmanager
def raw_dumps() -> Iterator[None]:
  """Inside it, each Mosaic profile written as ``X-trace.json`` also leaves its
  raw buffer in ``X-trace.json.npz`` (``load_raw``)."""
  from jax.experimental.mosaic.gpu import profiler as mgpu_profiler  # (private API)

  spec = mgpu_profiler.ProfilerSpec
  json_dump = spec.dump

  def dump(self, buffer, f, grid, block):
    np.savez_compressed(f.name + ".npz", buffer=np.asarray(buffer), grid=np.asarray(grid),
                        block=np.asarray(block),
                        names=np.asarray(sorted(self.interned_names,
                                                key=self.interned_names.get)))
    return json_dump(self, buffer, f, grid, block)

  spec.dump = dump
  try:
    yield
  finally:
    spec.dump = json_dump


_EXIT = 1 << 31  # Mosaic's end-of-range flag on an event's name id
_HEADER = 3  # a trace's start time, SM id and entry count come first


def load_raw(path: str, warpgroup_threads: int = 128) -> list[dict[str, Any]]:
  """The events of a ``raw_dumps`` buffer: "ts" is SM cycles from the CTA's
  first event over 1000 (the JSON's scale), "tid" and "pid" as in Mosaic's
  JSON (pid: 1 + SM id), in each trace's order."""
  with np.load(path) as z:
    buffer, names = z["buffer"].astype(np.uint32), [str(n) for n in z["names"]]
    ctas, traces = math.prod(z["grid"]), math.prod(z["block"]) // warpgroup_threads
  entries = buffer.reshape(ctas, traces, -1)
  events = []
  for cta in range(ctas):
    used = entries[cta, :, 2]
    firsts = [int(entries[cta, t, _HEADER + 1]) for t in range(traces) if used[t] >= 2]
    if not firsts:
      continue
    # The clock is a 32-bit counter: times are taken modulo 2**32 from the
    # CTA's first event (the smallest offset from any of the traces' firsts).
    ref = min(firsts, key=lambda c: max(((o - c) & 0xFFFFFFFF) for o in firsts))
    for t in range(traces):
      body = entries[cta, t, _HEADER:_HEADER + int(used[t])].reshape(-1, 2)
      for tag, clock in body:
        tag = int(tag)
        events.append(dict(name=names[tag & ~_EXIT], ph="E" if tag & _EXIT else "B",
                           ts=((int(clock) - ref) & 0xFFFFFFFF) / 1e3,
                           pid=1 + int(entries[cta, t, 1]), tid=1 + t + traces * cta))
  return events


def ranges_by_trace(events: Sequence[Mapping[str, Any]], per_trace_origin: bool = True
                    ) -> dict[int, list[tuple[str, float, float, int]]]:
  """tid -> its ranges ``(name, begin, end, depth)`` in cycles from the
  trace's first event (``per_trace_origin``; else from ts 0, which
  ``load_raw`` sets at the CTA's first event) (depth 0: not inside another
  range).  ValueError when an end does not close the innermost open range of
  its name."""
  out: dict[int, list[tuple[str, float, float, int]]] = collections.defaultdict(list)
  open_: dict[int, list[tuple[str, float]]] = collections.defaultdict(list)
  origin: dict[int, float] = {}
  for e in events:
    tid, ts = int(e["tid"]), float(e["ts"]) * 1e3
    origin.setdefault(tid, ts if per_trace_origin else 0.0)
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


def _percentiles(xs: Sequence[float]) -> dict[str, float]:
  if not xs:
    return dict(n=0)
  p10, p50, p90 = np.percentile(np.asarray(xs, float), [10, 50, 90])
  return dict(n=len(xs), p10=float(p10), p50=float(p50), p90=float(p90))


def ring_latency(events: Sequence[Mapping[str, Any]], warpgroups: int, producer: int,
                 alternate: bool, min_wait: float = 64.0) -> dict[str, Any]:
  """How long a ring step's TMA loads take to land, from a ``load_raw`` trace
  (one clock per CTA).  The producer's k-th ``load`` range issues ring step
  k; the consumers' ``wait`` ranges wait for the steps in ring order: with
  ``alternate`` (dW's pingpong) consumer ``q % 2`` takes the CTA's item q
  whole (its items end with a ``store``), else both wait for every step.  A
  wait of at least ``min_wait`` cycles ended when its step landed, so
  ``landed - issued`` (the load range's end) is the step's latency under the
  kernel's own traffic (with a ``mask_warpgroup`` the consumers wait for the
  masker, so the masking's time is in it too).  Returns the latency's and the waits' p10/p50/p90 (in
  cycles) and the share of steps a consumer waited for."""
  lat, waits, waited, steps = [], [], 0, 0
  by_tid = ranges_by_trace(events, per_trace_origin=False)
  ctas = {(tid - 1) // warpgroups for tid in by_tid}
  for cta in sorted(ctas):
    def outer(wg, name):
      return [(b, e) for n, b, e, d in by_tid.get(1 + wg + warpgroups * cta, ())
              if d == 0 and n == name]

    loads = outer(producer, "load")
    consumers = [wg for wg in range(warpgroups) if wg != producer][:2]
    if alternate:
      per_item = []
      for wg in consumers:
        items, current = [], []
        for n, b, e, d in by_tid.get(1 + wg + warpgroups * cta, ()):
          if d == 0 and n == "wait":
            current.append((b, e))
          elif d == 0 and n == "store":
            items.append(current)
            current = []
        # (a last item without its store was cut off by the profile buffer:
        # dropped, and the ring ends before it)
        per_item.append(items)
      ring = []
      for q in range(2 * max(len(x) for x in per_item)):
        mine = per_item[q % 2]
        if q // 2 >= len(mine):
          break
        ring += mine[q // 2]
      rings = [ring]
    else:
      rings = [outer(wg, "wait") for wg in consumers]
    for ring in rings:
      for (issued_b, issued), (w_b, w_e) in zip(loads, ring):
        steps += 1
        waits.append(w_e - w_b)
        if w_e - w_b >= min_wait:
          waited += 1
          lat.append(w_e - issued)
  return dict(latency=_percentiles(lat), wait=_percentiles(waits),
              waited_share=waited / steps if steps else 0.0, steps=steps)


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
