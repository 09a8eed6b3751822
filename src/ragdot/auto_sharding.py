"""Operands under automatic sharding (``AxisType.Auto``, GSPMD / Shardy): the
ops per shard through ``custom_partitioning``.

Under ``jax.jit`` with operands split over automatic mesh axes, XLA cannot
split a Pallas kernel (an opaque custom call) and would gather its operands
onto every device.  Each op is therefore a custom-partitioned call: when XLA
partitions the program it hands over the operands' shardings, and the op runs
on each device's block with the split of ``ragdot.sharded`` (rows, rhs
columns, rhs experts through ``group_offset`` plus a psum, the contraction's
partial products summed; dW summed over row shards in the output dtype, its
groups split where the result's sharding asks; fp8 weights' block scales
split as the weights are).  The kernel is then chosen for the shard's
shapes.  Eager calls on arrays over several devices run
jitted, so that they are partitioned too.

Not partitioned (the plain call, operands gathered): inside ``shard_map``
(manual axes; a full-manual region is already per device), under a context
mesh of explicit axes (``ragdot.sharded`` splits those calls; custom
partitioning there fails to compile, jax 0.11.2), on one device (JAX inlines
the call), operands split over part of a mesh axis, kernels whose trace has side effects
(the Mosaic GPU interpret mode on a CPU), in ``jax.export`` (which cannot
serialize the partitioner's callback), and with ``RAGDOT_AUTO_PARTITION=0``
in the environment.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
from jax._src import sharding_impls
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from ragdot import dispatch
from ragdot import sharded
from ragdot import traced_primitive as tp

# The kernels: ``gmm_kernel(static, lhs, rhs, group_sizes, group_offset)``,
# ``scaled_gmm_kernel(static, lhs, rhs, scale, group_sizes, group_offset)`` and
# ``tgmm_kernel(static, lhs, rhs, group_sizes, group_offset, num_groups)``,
# with hashable ``static`` (the op's other static arguments).
Kernel = Callable[..., jax.Array]


def enabled() -> bool:
  """Whether calls are custom-partitioned: yes unless the context mesh has
  manual axes (inside shard_map) or explicit ones (operand types carry their
  split: ``ragdot.sharded``), or ``RAGDOT_AUTO_PARTITION=0`` (or false / no / off) is set."""
  if os.environ.get("RAGDOT_AUTO_PARTITION", "1").strip().lower() in ("0", "false", "no", "off"):
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return not (mesh.manual_axes or mesh.explicit_axes)


def gmm(kernel: Kernel, static: Any, transpose_rhs: bool, lhs: jax.Array, rhs: jax.Array,
        group_sizes: jax.Array, group_offset: jax.Array | None) -> jax.Array:
  """``kernel(static, lhs, rhs, group_sizes, group_offset)`` (``lhs[m, k] x
  rhs[g, k|n, n|k] -> [m, n]``), per shard of the operands' automatic split."""
  return _call(("gmm", transpose_rhs, None), kernel, static, lhs, rhs, group_sizes,
               group_offset)


def scaled_gmm(kernel: Kernel, static: Any, transpose_rhs: bool, lhs: jax.Array,
               rhs: jax.Array, scale: jax.Array, group_sizes: jax.Array,
               group_offset: jax.Array | None) -> jax.Array:
  """``kernel(static, lhs, rhs, scale, group_sizes, group_offset)``: ``gmm``
  on fp8 weights with their block scales (rhs's layout), per shard, the
  scales split as the weights are (rhs's k and n split only along whole
  blocks, ``sharded.gmm_split``)."""
  return _call(("scaled_gmm", transpose_rhs, None), kernel, static, lhs, rhs, scale,
               group_sizes, group_offset)


def tgmm(kernel: Kernel, static: Any, num_groups: int, lhs: jax.Array, rhs: jax.Array,
         group_sizes: jax.Array, group_offset: jax.Array | None) -> jax.Array:
  """``kernel(static, lhs, rhs, group_sizes, group_offset, num_groups)``
  (``lhs[m, k], rhs[m, n] -> [num_groups, k, n]``), per shard: summed over
  row shards, and the groups split where the result's sharding asks for it."""
  return _call(("tgmm", False, num_groups), kernel, static, lhs, rhs, group_sizes,
               group_offset)


def _call(op: tuple[str, bool, int | None], kernel: Kernel, static: Any,
          *args: jax.Array | None) -> jax.Array:
  """``kernel(static, *args)`` (lhs, rhs, the scales of ``scaled_gmm``, group
  sizes and offset),
  custom-partitioned unless ``enabled()`` says no or the kernel has side
  effects.  ``op``: the op's name, transpose_rhs, and tgmm's number of groups."""
  partition = enabled()
  eager = tp.is_eager(args)
  if partition and eager and over_devices(args):  # op by op, it would not be partitioned
    return _jitted(op, kernel, static)(*args)
  fixed = len(args) - 1  # the arguments before the (optional) group_offset
  args = tuple(a for a in args if a is not None)
  plain = _plain(kernel, static, op[2], fixed)
  # Eager on one device there is nothing to split, and the plain call compiles
  # its kernel once (``api._run``); a custom-partitioned one would trace anew.
  # In jax.export's trace (tp.exporting) the plain call too: export cannot serialize
  # the partitioner's callback, and custom_partitioning caches its trace per
  # function, so it would reuse the bind's (whose schedule kernel export refuses).
  if eager or not partition or tp.exporting() or _has_effects(
      kernel, static, op[2], fixed, tuple((a.shape, a.dtype) for a in args)):
    return plain(*args)
  return _partitioned(op, kernel, static, len(args), fixed)(*args)


def over_devices(args: tuple[jax.Array | None, ...]) -> bool:
  """Whether any concrete array among ``args`` lives on more than one device."""
  return any(len(a.sharding.device_set) > 1 for a in args if isinstance(a, jax.Array))


@functools.lru_cache(maxsize=256)
def _jitted(op: tuple[str, bool, int | None], kernel: Kernel, static: Any) -> Any:
  return jax.jit(functools.partial(_call, op, kernel, static))


@functools.lru_cache(maxsize=256)
def _has_effects(kernel: Kernel, static: Any, num_groups: int | None, fixed: int,
                 types: tuple[Any, ...]) -> bool:
  """Whether the kernel's trace has side effects (the interpret mode of the
  Mosaic GPU kernels calls back to the host in order), which
  ``custom_partitioning`` cannot carry."""
  if dispatch.has_gpu():  # kernels compile there: no interpret mode (dispatch.choose)
    return False
  avals = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in types]
  return bool(jax.make_jaxpr(_plain(kernel, static, num_groups, fixed))(*avals).effects)


def _plain(kernel: Kernel, static: Any, num_groups: int | None,
           fixed: int) -> Callable[..., jax.Array]:
  """The unpartitioned kernel call on the op's arrays (the ``fixed`` ones:
  lhs, rhs, rhs's scales for ``scaled_gmm``, group sizes; then the
  group_offset if there is one)."""
  tail = () if num_groups is None else (num_groups,)

  def plain(*args):
    return kernel(static, *args, *((None,) if len(args) == fixed else ()), *tail)
  return plain


# Shardy's view of each op: the factors of the operands and the result.  Group
# sizes / offset are never split ("G" needs replication); a split of the
# forward's groups or contraction, or of the weight gradient's rows, is summed.
# The scales' block counts along k and n are factors of their own (a and b).
_RULES = {
    ("gmm", False): "m k, g k n, G{} -> m n",
    ("gmm", True): "m k, g n k, G{} -> m n",
    ("scaled_gmm", False): "m k, g k n, g a b, G{} -> m n",
    ("scaled_gmm", True): "m k, g n k, g b a, G{} -> m n",
    ("tgmm", False): "m k, m n, G{} -> g k n",
}
_FACTORS = {
    "gmm": dict(reduction_factors=("k", "g"), need_replication_factors=("G",)),  # in rule order
    "scaled_gmm": dict(reduction_factors=("k", "g", "a"), need_replication_factors=("G",)),
    "tgmm": dict(reduction_factors=("m",), need_replication_factors=("G",)),
}


@functools.lru_cache(maxsize=256)
def _partitioned(op: tuple[str, bool, int | None], kernel: Kernel, static: Any,
                 num_args: int, fixed: int) -> Any:
  name, transpose_rhs, num_groups = op
  local = functools.partial(kernel, static)
  scaled = name == "scaled_gmm"

  def partition(mesh, arg_shapes, result_shape):
    lhs, rhs = arg_shapes[:2]
    _dims = functools.partial(_split_dims, mesh)
    if name != "tgmm":
      layout = sharded.gmm_split(mesh, _dims(lhs), _dims(rhs), lhs.shape, rhs.shape,
                                 transpose_rhs, arg_shapes[2].shape if scaled else None,
                                 out_cols=_dims(result_shape)[1])
      body, in_specs, out_spec = sharded.gmm_shard(layout, transpose_rhs, local, lhs.shape,
                                                   rhs.shape, num_args, scaled)
    else:
      layout = sharded.tgmm_split(mesh, _dims(lhs), _dims(rhs), lhs.shape, rhs.shape,
                                  _dims(result_shape)[0], num_groups)
      body, in_specs, out_spec = sharded.tgmm_shard(layout, local, lhs.shape, num_groups,
                                                    num_args)
    return (mesh, body, NamedSharding(mesh, out_spec),
            tuple(NamedSharding(mesh, s) for s in in_specs))

  wrapped = custom_partitioning(_plain(kernel, static, num_groups, fixed))
  offset = ", " if num_args > fixed else ""
  # decode_shardings=False: JAX's own decoding asserts on a split over part of
  # a mesh axis (e.g. rows of a micro-batch sliced from split tokens) before
  # the callback runs; _split_dims reads those as unsplit instead.
  wrapped.def_partition(partition, sharding_rule=_RULES[name, transpose_rhs].format(offset),
                        decode_shardings=False, **_FACTORS[name])
  return wrapped




def _split_dims(mesh: Any, shape: Any) -> tuple[sharded.Axes, ...]:
  """The mesh axes of each dimension of an operand (or result) XLA hands over;
  none where its sharding has no form in whole mesh axes."""
  sharding = shape.sharding
  if isinstance(sharding, NamedSharding):
    spec = sharding.spec
  else:
    try:
      spec = sharding_impls.parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0]  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
      spec = None  # e.g. a sub-axis split: the operand is gathered
  return sharded.spec_dims(spec, len(shape.shape))
