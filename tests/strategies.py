"""Hypothesis strategies for group sizes and shard layouts."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

KINDS = ("random", "all_zero", "one_owner", "under", "over", "skewed",
         "empty_ends", "negative")


@st.composite
def group_sizes(draw, m: int, num_groups: int, kinds=KINDS) -> np.ndarray:
  """int32[num_groups] sizes of one of the layouts users hit."""
  kind = draw(st.sampled_from(kinds))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  g = num_groups
  if kind == "all_zero":
    return np.zeros(g, np.int32)
  if kind == "one_owner":
    sizes = np.zeros(g, np.int32)
    sizes[rng.integers(g)] = m
    return sizes
  if kind == "skewed":
    p = np.full(g, 0.1 / max(g - 1, 1))
    p[rng.integers(g)] = 0.9 if g > 1 else 1.0
    return rng.multinomial(m, p / p.sum()).astype(np.int32)
  total = {"under": int(rng.integers(0, m + 1) * 0.75), "over": m + int(rng.integers(1, m + 2))}.get(kind, m)
  sizes = rng.multinomial(total, np.ones(g) / g).astype(np.int32)
  if kind == "empty_ends" and g >= 3:
    sizes[1] += sizes[0] + sizes[-1]
    sizes[0] = sizes[-1] = 0
  if kind == "negative":
    sizes[rng.integers(g)] = -int(rng.integers(1, 5))
  return sizes


@st.composite
def shard(draw, num_groups: int):
  """(group_offset or None, num_local): no offset, or first/middle/last/empty shard."""
  kind = draw(st.sampled_from(["none", "first", "middle", "last", "past", "one"]))
  if kind == "none":
    return None, num_groups
  num_local = draw(st.integers(1, num_groups))
  offset = {
      "first": 0,
      "middle": (num_groups - num_local) // 2,
      "last": num_groups - num_local,
      "past": num_groups - max(num_local // 2, 1),  # part of the shard past G
      "one": draw(st.integers(0, num_groups - 1)),
  }[kind]
  return offset, num_local
