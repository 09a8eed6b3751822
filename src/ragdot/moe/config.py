"""Static configuration of an MoE MLP (hashable: safe as a jit static argument)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ragdot.backends import IMPLEMENTATIONS
from ragdot.moe.routing import check_expert_groups, check_int


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Shape and routing of one MoE MLP.

  hidden, intermediate: d_model and the per-expert SwiGLU width.
  num_experts, top_k: E and k.
  scoring: "softmax" (Qwen3/Mixtral) or "deepseek" (sigmoid + bias, group-limited).
  n_group, topk_group: DeepSeek group-limited routing (ignored for softmax).
  routed_scaling_factor: multiplies the combine weights (finite, > 0); renormalize:
    make the k weights of a token sum to 1 before scaling.  DeepSeek-V3's values:
    ``scoring="deepseek", n_group=8, topk_group=4, routed_scaling_factor=2.5`` (its
    shared expert is not part of this block: add it beside, as the model does).
  fused_gate_up: one [E, d, 2f] projection instead of gate and up [E, d, f]; its
    columns [:f] are the gate, [f:] the up projection (transformers' fused
    ``gate_up_proj`` halves, transposed; gpt-oss interleaves them instead).
  num_adapters: LoRA adapters per expert (0: no LoRA); lora_rank, lora_alpha:
    LoRA rank r and scale alpha / r; lora_targets: projections with LoRA
    (names among "gate_up" or "gate", "up", and "down").
  freeze_base: stop gradients to the router and base expert weights.
  implementation: ragdot backend (None: automatic).
  precision: matmul precision passed to ragdot (None: default).
  """

  hidden: int
  intermediate: int
  num_experts: int
  top_k: int
  scoring: str = "softmax"
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  renormalize: bool = True
  fused_gate_up: bool = True
  num_adapters: int = 0
  lora_rank: int = 8
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] | None = None
  freeze_base: bool = False
  implementation: str | None = None
  precision: Any = None

  def __post_init__(self):
    for name in ("hidden", "intermediate", "num_experts", "top_k", "n_group", "topk_group"):
      check_int(name, getattr(self, name), minimum=1)
    check_int("num_adapters", self.num_adapters, minimum=0)
    if self.num_adapters:
      check_int("lora_rank", self.lora_rank, minimum=1)
    # (stored as Python floats and bools: the config stays hashable with numpy or jax scalars)
    reals = ("routed_scaling_factor", "lora_alpha") if self.num_adapters else (
        "routed_scaling_factor",)
    for name in reals:
      object.__setattr__(self, name, _finite(name, getattr(self, name)))
    if not self.routed_scaling_factor > 0:
      raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
    for name in ("renormalize", "fused_gate_up", "freeze_base"):
      object.__setattr__(self, name, _flag(name, getattr(self, name)))
    if self.implementation is not None and self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, "
                       f"got {self.implementation!r}")
    if self.scoring not in ("softmax", "deepseek"):
      raise ValueError(f"scoring must be 'softmax' or 'deepseek', got {self.scoring!r}")
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"need 1 <= top_k <= num_experts, got {self.top_k}, {self.num_experts}")
    if self.scoring == "deepseek":
      check_expert_groups(self.num_experts, self.top_k, self.n_group, self.topk_group)
    if self.lora_targets is not None:
      if isinstance(self.lora_targets, str):
        raise TypeError(f"lora_targets must be a sequence of names, got {self.lora_targets!r}")
      # (a tuple keeps the config hashable, as a jit static argument must be)
      object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
      if len(set(self.lora_targets)) != len(self.lora_targets):
        raise ValueError(f"lora_targets has duplicates: {self.lora_targets}")
    bad = set(self.targets) - set(self.projections)
    if bad:
      raise ValueError(f"lora_targets {sorted(bad)} not among projections {self.projections}")

  @property
  def projections(self) -> tuple[str, ...]:
    return ("gate_up", "down") if self.fused_gate_up else ("gate", "up", "down")

  @property
  def targets(self) -> tuple[str, ...]:
    """Projections that carry LoRA (all of them by default)."""
    if self.num_adapters <= 0:
      return ()
    return self.projections if self.lora_targets is None else tuple(self.lora_targets)

  @property
  def adapters(self) -> int:
    """Adapters per expert in the group layout (1 without LoRA)."""
    return max(self.num_adapters, 1)

  @property
  def lora_scale(self) -> float:
    return self.lora_alpha / self.lora_rank

  def proj_shape(self, name: str) -> tuple[int, int]:
    """(k, n) of one expert's matrix for projection ``name``."""
    d, f = self.hidden, self.intermediate
    return {"gate_up": (d, 2 * f), "gate": (d, f), "up": (d, f), "down": (f, d)}[name]


def _finite(name: str, value: Any) -> float:
  """``value`` as a finite Python float: a real number or a 0-d real array."""
  kind = np.asarray(value).dtype.kind if np.ndim(value) == 0 else None
  if isinstance(value, (bool, np.bool_, str)) or kind not in ("i", "u", "f"):
    raise TypeError(f"{name} must be a real number, got {value!r}")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}")
  return value


def _flag(name: str, value: Any) -> bool:
  """``value`` as a Python bool: a bool (numpy's or a 0-d jax one too) or the
  int 0 or 1."""
  kind = np.asarray(value).dtype.kind if np.ndim(value) == 0 else None
  if kind == "b" or (kind in ("i", "u") and not isinstance(value, str) and value in (0, 1)):
    return bool(value)
  raise TypeError(f"{name} must be a bool, got {value!r}")
