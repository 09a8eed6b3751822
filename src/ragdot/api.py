"""Public ops: drop-in replacements for ``jax.lax.ragged_dot[_general]``.

Semantics (see README): group i owns rows ``[c[i-1], c[i])`` with
``c = cumsum(max(group_sizes, 0))`` cut at m; rows past the last group are 0.
With ``group_offset = o`` the rhs holds groups ``o .. o + g_local - 1`` only,
their rows use ``rhs[group - o]`` and every other row is exactly 0.

Both core ops are primitives (``ragdot.primitives``) whose transpose rules call
the same dispatch as the forward, so whichever backend runs the forward also
provides dX and dW; their JVP rules give forward-mode autodiff.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify

from ragdot import auto_sharding
from ragdot import dispatch
from ragdot import primitives
from ragdot import scales
from ragdot import sharded
from ragdot import traced_primitive
from ragdot.manual_axes import match_varying
from ragdot import validate
from ragdot.backends import get_backend
from ragdot.backends import xla_symbolic

RaggedDotDimensionNumbers = lax.RaggedDotDimensionNumbers


_ARRAYS = ("lhs", "rhs", "group_sizes", "group_offset")


def _run(op: dispatch.Op, implementation: str | None, **kwargs) -> jax.Array:
  if sharded.has_symbolic_dims(kwargs["lhs"], kwargs["rhs"], kwargs["group_sizes"]):
    return _run_symbolic(op, implementation, **kwargs)
  choice = dispatch.choose(op, implementation, **dispatch.facts(op, **kwargs))
  arrays = {name: kwargs.pop(name) for name in _ARRAYS if name in kwargs}
  # Op by op (no tracer: an eager call), the kernel runs as one compiled program
  # cached per choice and static arguments; else each call would lower and
  # compile its kernels anew (0.56 s a call on the H200, 49a).  Not the Mosaic
  # GPU interpret mode (a CPU harness whose kernels call back to the host): a
  # CPU test run hung once with it compiled in one program, so it stays op by op.
  eager = (traced_primitive.is_eager(arrays.values())
           and not (choice.interpret and choice.implementation == "mosaic"))
  static = tuple(sorted(kwargs.items()))
  call = _compiled if eager else _backend_call
  # The automatic choice, then (if its kernel refuses the call) Triton (any
  # shape) on a GPU, then XLA; a chosen implementation is not replaced.
  candidates = [(choice.implementation, choice.interpret, choice.config)]
  if choice.automatic and choice.implementation != "xla":
    if dispatch.has_gpu() and choice.implementation != "triton":
      candidates.append(("triton", False, None))
    candidates.append(("xla", False, None))
  # (the operand types key the refusals of eager calls only)
  types = (tuple((name, a.shape, a.dtype) for name, a in arrays.items() if a is not None)
           if eager else ())
  for i, (impl, interpret, config) in enumerate(candidates):
    last = i == len(candidates) - 1
    key = (op, impl, interpret, config, static, types)
    if eager and not last and key in _REFUSED:
      continue  # refused before: an eager call would trace the kernel again to find out
    native = _takes_operands(op, impl, arrays["lhs"], arrays["rhs"], kwargs.get("out_dtype"))
    try:
      return call(op, impl, interpret, config, static)(**_as_backend_takes(arrays, native))
    except NotImplementedError:
      if last:
        raise
      if eager:
        _REFUSED.add(key)
  raise AssertionError("unreachable")


def _run_symbolic(op: dispatch.Op, implementation: str | None, **kwargs) -> jax.Array:
  """A call whose shapes hold symbolic dimensions (``jax.export``): only the
  XLA backend's lax form takes it (kernels size their tiles from the shape)."""
  if implementation not in (None, "xla"):
    raise NotImplementedError(
        f"implementation={implementation!r} needs concrete shapes; a call with symbolic "
        "dimensions (jax.export) runs implementation=None or 'xla'")
  arrays = _as_backend_takes({name: kwargs.pop(name) for name in _ARRAYS}, native=False)
  return getattr(xla_symbolic, op)(**arrays, **kwargs)


def _takes_operands(op: dispatch.Op, impl: str, lhs: jax.Array, rhs: jax.Array,
                    out_dtype: Any) -> bool:
  """Whether ``impl`` computes ``op`` on 8-bit float operands as they are: the
  Mosaic forward, both e4m3 / e5m2 (8-bit wgmma) or bf16/f16 rows with e4m3 /
  e5m2 weights where it takes the call (W8A16: the weights widened as they
  are read); the Triton forward the W8A16 pair on sm89+ or in interpret mode
  (``dispatch.triton_takes_weight_only``) unless its offsets into the weights
  would wrap (``triton.offsets_wrap``: it gets them widened then)."""
  if op != "gmm" or not (validate.is_fp8(lhs.dtype) or validate.is_fp8(rhs.dtype)):
    return False
  if impl == "triton":
    from ragdot.backends import triton  # pylint: disable=g-import-not-at-top
    return (dispatch.triton_takes_weight_only(lhs.dtype, rhs.dtype)
            and not triton.offsets_wrap(rhs))
  if impl != "mosaic":
    return False
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  if lhs.dtype == rhs.dtype:
    return mosaic_fwd.takes_fp8(lhs.dtype)
  return mosaic_fwd.weight_only_refusal(lhs.dtype, rhs.dtype, out_dtype or lhs.dtype) is None


def _as_backend_takes(arrays: dict[str, Any], native: bool) -> dict[str, Any]:
  """fp8 operands widened (exactly) unless the backend takes them: fp8 weights
  to the rows' 16-bit dtype, two fp8 operands to bf16."""
  lhs, rhs = arrays["lhs"], arrays["rhs"]
  if native:
    return arrays
  if lhs.dtype != rhs.dtype:  # (16-bit rows, fp8 weights: ``_prepare``)
    return {**arrays, "rhs": rhs.astype(lhs.dtype)}
  if validate.is_fp8(lhs.dtype):
    return {**arrays, "lhs": lhs.astype(jnp.bfloat16), "rhs": rhs.astype(jnp.bfloat16)}
  return arrays


# Eager calls whose kernel refused them (NotImplementedError while tracing), by
# op, backend, config, static arguments and operand types.
_REFUSED: set[tuple[Any, ...]] = set()


def _backend_call(op: dispatch.Op, implementation: str, interpret: bool, config: Any,
                  static: tuple[tuple[str, Any], ...]):
  """The backend's entry point for ``op`` with its static arguments bound; it
  takes the arrays (lhs, rhs, group_sizes, group_offset) as keywords."""
  fn = getattr(get_backend(implementation), op)
  return functools.partial(fn, **dict(static), interpret=interpret, config=config)


@functools.lru_cache(maxsize=256)
def _compiled(op: dispatch.Op, implementation: str, interpret: bool, config: Any,
              static: tuple[tuple[str, Any], ...]):
  """``_backend_call`` under ``jax.jit``, one per choice (for eager calls)."""
  return jax.jit(_backend_call(op, implementation, interpret, config, static))


def _promote(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
  dtype = validate.common_dtype(a, b)
  return a.astype(dtype), b.astype(dtype)


def _prepare(lhs, rhs, group_sizes, group_offset, weights: bool = False):
  """Promoted operands, all varying over the same shard_map axes.  ``weights``:
  rhs holds expert weights, kept as they are when fp8 beside bf16/f16 rows
  (``validate.weight_only``; each backend call widens them unless its kernel
  takes them).

  Marking replicated operands varying *outside* the ops lets JAX's own
  transpose of that marking psum their cotangents across the shards.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if not (weights and validate.weight_only(lhs, rhs)):
    lhs, rhs = _promote(lhs, rhs)
  return match_varying(lhs, rhs, group_sizes, group_offset)


# --- grouped matmul with ragged rows: out[m, n] --------------------------------


def _gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs, precision,
         out_dtype, implementation):
  return primitives.gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs=transpose_rhs,
                        precision=precision, out_dtype=out_dtype,
                        implementation=implementation)


def _gmm_impl(lhs, rhs, group_sizes, group_offset, *, transpose_rhs, precision,
              out_dtype, implementation):
  return auto_sharding.gmm(_gmm_kernel, (transpose_rhs, precision, out_dtype, implementation),
                           transpose_rhs, lhs, rhs, group_sizes, group_offset)


def _gmm_kernel(static, lhs, rhs, group_sizes, group_offset):
  transpose_rhs, precision, out_dtype, implementation = static
  return _run(
      "gmm", implementation, lhs=lhs, rhs=rhs, group_sizes=group_sizes,
      group_offset=group_offset, transpose_rhs=transpose_rhs,
      out_dtype=out_dtype, precision=precision,
  )


# --- ragged contracting dimension: out[g, k, n] --------------------------------


def _tgmm(lhs, rhs, group_sizes, group_offset, num_groups, precision,
          out_dtype, implementation):
  return primitives.tgmm(lhs, rhs, group_sizes, group_offset, num_groups=num_groups,
                         precision=precision, out_dtype=out_dtype,
                         implementation=implementation)


def _tgmm_impl(lhs, rhs, group_sizes, group_offset, *, num_groups, precision, out_dtype,
               implementation):
  return auto_sharding.tgmm(_tgmm_kernel, (precision, out_dtype, implementation),
                            num_groups, lhs, rhs, group_sizes, group_offset)


def _tgmm_kernel(static, lhs, rhs, group_sizes, group_offset, num_groups):
  precision, out_dtype, implementation = static
  return _run(
      "tgmm", implementation, lhs=lhs, rhs=rhs, group_sizes=group_sizes,
      group_offset=group_offset, num_groups=num_groups, out_dtype=out_dtype,
      precision=precision,
  )


primitives.register("gmm", _gmm_impl)
primitives.register("tgmm", _tgmm_impl)


# --- fp8 weights with block scales: out[m, n] ------------------------------------


def _scaled_gmm_impl(lhs, rhs, scale, group_sizes, group_offset, *, transpose_rhs, precision,
                     out_dtype, implementation):
  return auto_sharding.scaled_gmm(
      _scaled_gmm_kernel, (transpose_rhs, precision, out_dtype, implementation), transpose_rhs,
      lhs, rhs, scale, group_sizes, group_offset)


def _scaled_gmm_kernel(static, lhs, rhs, scale, group_sizes, group_offset):
  """One call's (or one shard's) scaled product: the W8A16 kernel the
  dispatcher picks (Mosaic, or Triton where Mosaic refuses), scaling each
  widened weight block, where it takes the scales' blocks; else (XLA, a
  refusal) the plain kernel on weights dequantized by XLA."""
  transpose_rhs, precision, out_dtype, implementation = static

  def dequantized():
    return _gmm_kernel(static, lhs, scales.dequantize(rhs, scale, lhs.dtype), group_sizes,
                       group_offset)  # (static: the plain op's too)

  choice = dispatch.choose("gmm", implementation, **dispatch.facts(
      "gmm", lhs=lhs, rhs=rhs, group_sizes=group_sizes, group_offset=group_offset,
      transpose_rhs=transpose_rhs, out_dtype=out_dtype, precision=precision))
  if choice.implementation not in ("mosaic", "triton") or not _takes_operands(
      "gmm", choice.implementation, lhs, rhs, out_dtype):
    return dequantized()
  kernel_static = (choice.implementation, transpose_rhs, precision, out_dtype,
                   choice.interpret, choice.config)
  run = (_scaled_kernel if choice.interpret or not traced_primitive.is_eager(
      (lhs, rhs, scale, group_sizes, group_offset)) else _scaled_compiled)(*kernel_static)
  try:
    return run(lhs, rhs, scale, group_sizes, group_offset)
  except NotImplementedError:  # (scale blocks not in whole k steps, ...)
    return dequantized()


@functools.lru_cache(maxsize=64)
def _scaled_kernel(implementation, transpose_rhs, precision, out_dtype, interpret, config):
  """The Mosaic or Triton W8A16 kernel, scales in rhs's layout (one function
  per static arguments)."""
  # pylint: disable=g-import-not-at-top
  if implementation == "mosaic":
    from ragdot.backends import mosaic_fwd as kernel
  else:
    from ragdot.backends import triton as kernel

  def run(lhs, rhs, scale, group_sizes, group_offset):
    return kernel.gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs=transpose_rhs,
                      out_dtype=out_dtype, precision=precision, interpret=interpret,
                      config=config, rhs_scale=scale)
  return run


@functools.lru_cache(maxsize=64)
def _scaled_compiled(*static):
  """``_scaled_kernel`` under ``jax.jit`` (eager calls)."""
  return jax.jit(_scaled_kernel(*static))


primitives.register("scaled_gmm", _scaled_gmm_impl)


def _scaled_call(lhs, rhs, scale, group_sizes, group_offset, transpose_rhs, precision,
                 preferred_element_type, out_sharding, implementation, checks):
  """``ragged_dot[_general]``'s forward modes with ``rhs_scale``."""
  problem, gs, go = validate.check_ragged_dot(lhs, rhs, group_sizes, group_offset,
                                              preferred_element_type,
                                              transpose_rhs=transpose_rhs)
  lhs, rhs, scale = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(scale)
  scales.check(lhs.dtype, rhs, scale)
  lhs, rhs, scale, gs, go = match_varying(lhs, rhs, scale, gs, go)
  static = (transpose_rhs, validate.check_precision(precision), problem.backend_out_dtype,
            implementation)
  layout = sharded.gmm_layout(lhs, rhs, transpose_rhs, gs, go, scale=scale)
  if layout is None:
    out = _local_scaled_gmm(*static)(lhs, rhs, scale, gs, go)
  elif sharded.in_manual_region() or sharded.has_symbolic_dims(lhs, rhs):
    # (the per-shard call's custom JVP splits its tangents per shard too: no
    # transpose inside a shard_map; this one gathers the operands)
    plain = sharded.gmm_layout(lhs, rhs, transpose_rhs, gs, go) or sharded.Layout(layout.mesh)
    out = sharded.whole(layout.mesh, _local_scaled_gmm(*static), (plain.rows, plain.n),
                        lhs, rhs, scale, gs, go)
  else:
    out = _scaled_per_shard(layout, *static)(lhs, rhs, scale, gs, go)
    # The result split as the plain call's would be (a split of rhs's n that the scale
    # blocks held back above is a slice of it here): its type does not depend on them.
    plain = (sharded.gmm_layout(lhs, rhs, transpose_rhs, gs, go)
             or sharded.Layout(layout.mesh))  # (None: only the scales were split)
    if (plain.rows, plain.n) != (layout.rows, layout.n):
      out = jax.sharding.reshard(out, jax.sharding.NamedSharding(
          layout.mesh, sharded.partition_spec(plain.rows, plain.n)))
  return _finish(out, problem, gs, go, checks, out_sharding)


@functools.lru_cache(maxsize=256)
def _scaled_per_shard(layout, transpose_rhs, precision, out_dtype, implementation):
  """The scaled call on operands split over explicit mesh axes: the fused
  kernel per shard (``ragdot.sharded``).  Its JVP puts the weights' and
  scales' tangents through the plain op per shard on the tangent of the
  dequantized weights, taken whole (XLA), as the unsplit call does, so their
  cotangents are summed over row shards in the rows' dtype before they are
  rounded to the weights' fp8; lhs's goes through the fused call."""
  static = (transpose_rhs, precision, out_dtype, implementation)
  local = _local_scaled_gmm(*static)

  @jax.custom_jvp
  def call(lhs, rhs, scale, group_sizes, group_offset):
    return sharded.gmm(lhs, rhs, group_sizes, group_offset, layout, transpose_rhs, local,
                       scale=scale)

  def jvp(primals, tangents):
    lhs, rhs, scale, group_sizes, group_offset = primals
    dlhs, drhs, dscale = tangents[:3]
    out = call(*primals)
    zero = lambda t: isinstance(t, jax.custom_derivatives.SymbolicZero)
    terms = []
    if not (zero(drhs) and zero(dscale)):
      drhs, dscale = (jnp.zeros(t.shape, t.dtype) if zero(t) else t for t in (drhs, dscale))
      deq = lambda r, s: scales.dequantize(r, s, lhs.dtype)
      dw = jax.jvp(deq, (rhs, scale), (drhs, dscale))[1]
      terms.append(sharded.gmm(lhs, dw, group_sizes, group_offset, layout, transpose_rhs,
                               _local_gmm(*static)))  # (the primal's layout: its type)
    if not zero(dlhs):
      terms.append(call(dlhs, rhs, scale, group_sizes, group_offset))
    if not terms:
      return out, jnp.zeros_like(out)
    return out, functools.reduce(jnp.add, terms)

  call.defjvp(jvp, symbolic_zeros=True)
  return call


@functools.lru_cache(maxsize=256)
def _local_scaled_gmm(transpose_rhs, precision, out_dtype, implementation):
  """``primitives.scaled_gmm`` on one shard's operands (as ``_local_gmm``)."""
  def local(lhs, rhs, scale, group_sizes, group_offset):
    lhs, rhs, scale, group_sizes, group_offset = match_varying(lhs, rhs, scale, group_sizes,
                                                               group_offset)
    return primitives.scaled_gmm(lhs, rhs, scale, group_sizes, group_offset,
                                 transpose_rhs=transpose_rhs, precision=precision,
                                 out_dtype=out_dtype, implementation=implementation)
  return local


# --- per shard where operands are split over explicit mesh axes ---------------


@functools.lru_cache(maxsize=256)
def _local_gmm(transpose_rhs, precision, out_dtype, implementation):
  """``_gmm`` on one shard's operands: one function object per static
  arguments (``ragdot.sharded`` caches compiled eager calls by it)."""
  def local(lhs, rhs, group_sizes, group_offset):
    return _gmm(*match_varying(lhs, rhs, group_sizes, group_offset), transpose_rhs,
                precision, out_dtype, implementation)
  return local


@functools.lru_cache(maxsize=256)
def _local_tgmm(precision, out_dtype, implementation):
  """``_tgmm`` on one shard's operands (as ``_local_gmm``; the shard's number
  of groups is an argument)."""
  def local(lhs, rhs, group_sizes, group_offset, num_groups):
    return _tgmm(*match_varying(lhs, rhs, group_sizes, group_offset), num_groups,
                 precision, out_dtype, implementation)
  return local


def _gmm_sharded(lhs, rhs, group_sizes, group_offset, transpose_rhs, precision,
                 out_dtype, implementation):
  """``_gmm``, run per shard (``ragdot.sharded``) if an operand's type names
  explicit mesh axes."""
  local = _local_gmm(transpose_rhs, precision, out_dtype, implementation)
  layout = sharded.gmm_layout(lhs, rhs, transpose_rhs, group_sizes, group_offset)
  if layout is None:
    return local(lhs, rhs, group_sizes, group_offset)
  return sharded.split_call(
      lambda *args: sharded.gmm(*args, layout, transpose_rhs, local),
      lambda *args: sharded.whole(layout.mesh, local, (layout.rows, layout.n), *args),
      lhs, rhs, group_sizes, group_offset)


def _tgmm_sharded(lhs, rhs, group_sizes, group_offset, num_groups, precision,
                  out_dtype, implementation):
  """``_tgmm``, run per shard and summed over row shards where operands'
  types name explicit mesh axes."""
  local = _local_tgmm(precision, out_dtype, implementation)
  layout = sharded.tgmm_layout(lhs, rhs, group_sizes, group_offset)
  if layout is None:
    return local(lhs, rhs, group_sizes, group_offset, num_groups)
  return sharded.split_call(
      lambda *args: sharded.tgmm(*args, num_groups, layout, local),
      lambda *args: sharded.whole(layout.mesh, lambda *a: local(*a, num_groups),
                                  (layout.groups, layout.k, layout.n), *args),
      lhs, rhs, group_sizes, group_offset)


# --- checked mode ---------------------------------------------------------------


def _runtime_checks(group_sizes: jax.Array, group_offset: jax.Array | None,
                    num_groups: int) -> None:
  checkify.check(
      jnp.all(group_sizes >= 0),
      "group_sizes has negative entries (ragdot treats them as 0): {}",
      group_sizes,
  )
  if group_offset is not None:
    checkify.check(
        (group_offset >= 0) & (group_offset < max(num_groups, 1)),
        f"group_offset must be in [0, {num_groups}), got {{}}",
        group_offset,
    )


def _finish(out: jax.Array, problem: validate.Problem, group_sizes: jax.Array,
            group_offset: jax.Array | None, checks: bool, out_sharding: Any) -> jax.Array:
  """A public op's result: in the problem's result dtype (the backends wrote
  ``problem.backend_out_dtype``), its runtime checks (when asked for) and the
  resharding to ``out_sharding``.  The checks come after the op: checkify
  failed to carry an error state into the per-shard shard_map of operands split
  over explicit mesh axes (jax 0.11.2)."""
  if checks:
    _runtime_checks(group_sizes, group_offset, problem.num_groups)
  return sharded.constrain(out.astype(problem.out_dtype), out_sharding)


def checked(fn):
  """Wraps ``fn`` so that ``checks=True`` calls inside it report errors.

  ``err, out = ragdot.checked(f)(*args)``; ``err.throw()`` raises if any
  group size was negative or a group_offset was out of range.  Thin wrapper
  over ``jax.experimental.checkify.checkify``.
  """
  return checkify.checkify(fn, errors=checkify.user_checks)


# --- public API ------------------------------------------------------------------


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision: Any = None,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
    out_sharding: Any = None,
    *,
    implementation: str | None = None,
    checks: bool = False,
    rhs_scale: jax.Array | None = None,
) -> jax.Array:
  """Grouped matmul with ragged rows: ``lhs[m, k] x rhs[g, k, n] -> [m, n]``.

  Args:
    lhs: ``[m, k]``, rows sorted by group.
    rhs: ``[g, k, n]``: one matrix per group; with ``group_offset`` only the
      shard's ``g_local <= G`` groups.
    group_sizes: int ``[G]`` rows per group (negative entries count as 0; a
      sum above m cuts the groups at m; rows past the sum are 0).
    precision, preferred_element_type: as in ``jax.lax.dot``.  Low-precision
      inputs accumulate in f32; the result has ``preferred_element_type`` or
      the dtype ``jax.lax.ragged_dot`` gives the pair (``validate.result_dtype``).
    group_offset: optional int scalar (shape ``()`` or ``(1,)``, may be
      traced): rhs[j] is group ``group_offset + j``; every row outside those
      groups is exactly 0 and costs no matmul work.
    out_sharding: optional ``NamedSharding`` / ``PartitionSpec`` the result
      is resharded to (as in ``jax.lax.ragged_dot``).  Without it, operands
      split over explicit mesh axes give a result split the same way (rows as
      lhs, columns as rhs; see ``ragdot.sharded``).
    implementation: None (automatic), "xla", "mosaic" or "triton".
    checks: report negative sizes / out-of-range offsets through checkify
      (wrap the caller with ``ragdot.checked``; a jitted caller without it
      fails to lower: "a checkify.check which was not functionalized").
    rhs_scale: optional block scales of fp8 (e4m3 / e5m2) weights, ``[g,
      k // bk, n // bn]`` (``ragdot.scales``): the product then uses
      ``rhs * scale`` (each scale over its bk x bn block) rounded once to
      lhs's dtype (bf16 / f16 / f32), and the Hopper kernel dequantizes the
      weights as it reads them.  Differentiable in every operand.

  Returns:
    ``[m, n]``.
  """
  impl = validate.check_implementation(implementation)
  if rhs_scale is not None:
    return _scaled_call(lhs, rhs, rhs_scale, group_sizes, group_offset, False, precision,
                        preferred_element_type, out_sharding, impl, checks)
  problem, gs, go = validate.check_ragged_dot(
      lhs, rhs, group_sizes, group_offset, preferred_element_type)
  lhs, rhs, gs, go = _prepare(lhs, rhs, gs, go, weights=True)
  out = _gmm_sharded(lhs, rhs, gs, go, False, validate.check_precision(precision),
                     problem.backend_out_dtype, impl)
  return _finish(out, problem, gs, go, checks, out_sharding)


def trans_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    group_offset: jax.Array | None = None,
    num_groups: int | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
    implementation: str | None = None,
    checks: bool = False,
) -> jax.Array:
  """Ragged contracting dimension (the weight gradient).

  ``out[j] = lhs_rows(o + j)^T @ rhs_rows(o + j)`` for ``lhs[m, k]`` and
  ``rhs[m, n]`` ragged along m; empty groups give zeros.

  Args:
    lhs: ``[m, k]``; rhs: ``[m, n]``; group_sizes: int ``[G]``.
    group_offset: optional int scalar ``o``; then ``num_groups`` (default G)
      groups starting at ``o`` are returned (groups past G are zeros).
    num_groups: static int in ``[1, G]``, only with ``group_offset``.
    precision, preferred_element_type, out_sharding, implementation, checks:
      as in ``ragged_dot``.  Rows split over explicit mesh axes give per-shard
      results summed over those axes (in the output dtype).

  Returns:
    ``[num_groups or G, k, n]``.
  """
  impl = validate.check_implementation(implementation)
  problem, gs, go = validate.check_trans_ragged_dot(
      lhs, rhs, group_sizes, group_offset, num_groups, preferred_element_type)
  lhs, rhs, gs, go = _prepare(lhs, rhs, gs, go)
  out = _tgmm_sharded(lhs, rhs, gs, go, problem.num_local,
                      validate.check_precision(precision), problem.backend_out_dtype, impl)
  return _finish(out, problem, gs, go, checks, out_sharding)


def _ints(xs: Sequence[int]) -> tuple[int, ...]:
  return tuple(int(x) for x in xs)


def _mode(lhs_ndim: int, rhs_ndim: int, dn: RaggedDotDimensionNumbers) -> str:
  """Names the MoE mode of ``dn``, or "other"."""
  (lc, rc), (lb, rb) = dn.dot_dimension_numbers
  lc, rc, lb, rb = map(_ints, (lc, rc, lb, rb))
  ragged, group = _ints(dn.lhs_ragged_dimensions), _ints(dn.rhs_group_dimensions)
  if lb or rb or len(lc) != 1 or len(rc) != 1 or len(ragged) != 1:
    return "other"
  if lhs_ndim == 2 and rhs_ndim == 3 and group == (0,):
    if ragged == (0,) and lc == (1,) and rc == (1,):
      return "forward"
    if ragged == (0,) and lc == (1,) and rc == (2,):
      return "forward_rhs_nk"
  if lhs_ndim == 2 and rhs_ndim == 2 and not group and ragged == lc:
    return "ragged_contracting"
  return "other"


def ragged_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    ragged_dot_dimension_numbers: RaggedDotDimensionNumbers,
    precision: Any = None,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
    out_sharding: Any = None,
    *,
    num_groups: int | None = None,
    implementation: str | None = None,
    checks: bool = False,
    rhs_scale: jax.Array | None = None,
) -> jax.Array:
  """``jax.lax.ragged_dot_general`` with native group_offset for MoE modes.

  Natively handled (any backend):
    * forward: ``lhs[m,k], rhs[g,k,n] -> [m,n]`` (lhs ragged dim 0);
    * forward with rhs laid out ``[g,n,k]`` (the dX of the forward);
    * ragged contracting: ``lhs[m,k], rhs[m,n] -> [g,k,n]`` (the weight
      gradient; the ragged dimension may be either axis of each operand).
      ``num_groups`` (static) sets the shard size when group_offset is given.
  Other modes are delegated to ``jax.lax.ragged_dot_general`` when no
  group_offset is given and raise NotImplementedError otherwise.
  ``rhs_scale`` (the two forward modes only): block scales of fp8 weights in
  rhs's layout, as in ``ragged_dot``.
  """
  impl = validate.check_implementation(implementation)
  dn = ragged_dot_dimension_numbers
  if not isinstance(dn, RaggedDotDimensionNumbers):
    raise TypeError(
        "ragged_dot_dimension_numbers must be a jax.lax.RaggedDotDimensionNumbers,"
        f" got {type(dn).__name__}"
    )
  mode = _mode(jnp.ndim(lhs), jnp.ndim(rhs), dn)
  if num_groups is not None and mode != "ragged_contracting":
    raise ValueError(
        "num_groups applies to the ragged contracting mode only (the weight"
        f" gradient); these dimension numbers are mode {mode!r}")
  if rhs_scale is not None and mode not in ("forward", "forward_rhs_nk"):
    raise ValueError(f"rhs_scale applies to the forward modes only (rhs [g, k, n] or [g, n, k]"
                     f" expert weights); these dimension numbers are mode {mode!r}")
  if rhs_scale is not None:
    return _scaled_call(lhs, rhs, rhs_scale, group_sizes, group_offset,
                        mode == "forward_rhs_nk", precision, preferred_element_type,
                        out_sharding, impl, checks)
  common = dict(precision=precision,
                preferred_element_type=preferred_element_type,
                out_sharding=out_sharding, implementation=impl, checks=checks)
  if mode == "forward":
    return ragged_dot(lhs, rhs, group_sizes, group_offset=group_offset, **common)
  if mode == "forward_rhs_nk":
    problem, gs, go = validate.check_ragged_dot(
        lhs, rhs, group_sizes, group_offset, preferred_element_type,
        transpose_rhs=True)
    lhs, rhs, gs, go = _prepare(lhs, rhs, gs, go, weights=True)
    out = _gmm_sharded(lhs, rhs, gs, go, True, validate.check_precision(precision),
                       problem.backend_out_dtype, impl)
    return _finish(out, problem, gs, go, checks, out_sharding)
  if mode == "ragged_contracting":
    (lc, rc), _ = dn.dot_dimension_numbers
    lhs_rows_first = lhs if int(lc[0]) == 0 else jnp.swapaxes(lhs, 0, 1)
    rhs_rows_first = rhs if int(rc[0]) == 0 else jnp.swapaxes(rhs, 0, 1)
    return trans_ragged_dot(lhs_rows_first, rhs_rows_first, group_sizes,
                            group_offset=group_offset, num_groups=num_groups,
                            **common)
  if group_offset is not None:
    # (operands lax refuses with these dimension numbers get lax's TypeError first)
    jax.eval_shape(functools.partial(lax.ragged_dot_general,
                                     ragged_dot_dimension_numbers=dn), lhs, rhs, group_sizes)
    raise NotImplementedError(
        f"ragged_dot_general with group_offset supports the MoE modes only"
        f" (forward, forward with rhs [g,n,k], ragged contracting); got"
        f" dimension numbers {dn} for lhs rank {jnp.ndim(lhs)}, rhs rank"
        f" {jnp.ndim(rhs)}"
    )
  if impl not in (None, "xla"):
    raise NotImplementedError(
        f"implementation={impl!r} supports the MoE modes only; got dimension"
        f" numbers {dn}"
    )
  if checks:
    raise NotImplementedError(
        "checks=True covers the MoE modes only; this mode is delegated to"
        " jax.lax.ragged_dot_general unchecked")
  return lax.ragged_dot_general(
      lhs, rhs, group_sizes, dn, precision=precision,
      preferred_element_type=preferred_element_type, out_sharding=out_sharding)
