"""The core ops as JAX primitives, so that every transformation reaches them.

``gmm`` (``lhs[m, k] x rhs[g, k|n, n|k] -> [m, n]``, rows ragged) and ``tgmm``
(``lhs[m, k], rhs[m, n] -> [num_groups, k, n]``, the contraction ragged) are
bilinear in (lhs, rhs); ``scaled_gmm`` is ``gmm`` on fp8 weights with block
scales (``ragdot.scales``), linear in lhs (its rules below the two others').
Each is a primitive (``ragdot.traced_primitive``)
whose implementation is the kernel call ``ragdot.api`` registers, with:

* a JVP rule, ``d op(a, b) = op(da, b) + op(a, db)`` skipping symbolic-zero
  tangents: ``jax.jvp``, ``jax.linearize``, ``jax.jacfwd`` and ``jax.hessian``
  work (a custom VJP allows reverse mode only);
* a transpose rule: lhs's cotangent through ``gmm`` (dX), rhs's through
  ``tgmm`` (dW) or ``gmm``, so reverse mode runs the kernels as a custom VJP
  did, and any order of forward and reverse mode works;
* a batching rule: ``lax.map`` over the batch axis, each element the
  unbatched call on the kernels the dispatcher picks for it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad
from jax.sharding import NamedSharding, PartitionSpec as P

from ragdot import scales
from ragdot import sharded
from ragdot import validate
from ragdot import traced_primitive as tp
from ragdot.manual_axes import match_varying

# The implementation of each op, ``impl(lhs, rhs, group_sizes, group_offset,
# **params)`` (group_offset may be None), set by ``ragdot.api``.
_IMPLS: dict[str, Callable[..., jax.Array]] = {}


def register(op: str, impl: Callable[..., jax.Array]) -> None:
  """Sets the implementation of op "gmm" or "tgmm"."""
  _IMPLS[op] = impl


def gmm(lhs, rhs, group_sizes, group_offset=None, *, transpose_rhs: bool, precision: Any,
        out_dtype: Any, implementation: str | None) -> jax.Array:
  """``out[m, n]``: the rows of group ``o + j`` times ``rhs[j]`` (``rhs[j]^T``
  when ``transpose_rhs``); other rows 0.  lhs and rhs of one dtype, or bf16 /
  f16 rows with fp8 weights (``validate.weight_only``)."""
  return _bind(gmm_p, lhs, rhs, group_sizes, group_offset, transpose_rhs=transpose_rhs,
               precision=precision, out_dtype=out_dtype, implementation=implementation)


def tgmm(lhs, rhs, group_sizes, group_offset=None, *, num_groups: int, precision: Any,
         out_dtype: Any, implementation: str | None) -> jax.Array:
  """``out[j] = lhs_rows(o + j)^T @ rhs_rows(o + j)`` for ``j < num_groups``."""
  return _bind(tgmm_p, lhs, rhs, group_sizes, group_offset, num_groups=num_groups,
               precision=precision, out_dtype=out_dtype, implementation=implementation)


def _bind(prim, lhs, rhs, group_sizes, group_offset, **params) -> jax.Array:
  args = (lhs, rhs, group_sizes) + (() if group_offset is None else (group_offset,))
  return tp.bind(prim, *args, **params)


def _make_fn(op: str, params: dict[str, Any]) -> Callable[..., jax.Array]:
  def fn(lhs, rhs, group_sizes, group_offset=None):
    return _IMPLS[op](lhs, rhs, group_sizes, group_offset, **params)
  return fn


def _offset(args: tuple[Any, ...]) -> Any:
  return args[3] if len(args) == 4 else None


def _jvp(op, primals, tangents, **params):
  params = tp.params_of(params)
  lhs, rhs, group_sizes = primals[:3]
  go = _offset(primals)
  dlhs, drhs = tangents[:2]
  out = op(lhs, rhs, group_sizes, go, **params)
  # rhs's term first: the transposed program then computes dX before dW, as
  # the backward of a custom VJP did.
  terms = []
  if not tp.is_zero(drhs):
    terms.append(op(lhs, drhs, group_sizes, go, **params))
  if not tp.is_zero(dlhs):
    terms.append(op(dlhs, rhs, group_sizes, go, **params))
  if not terms:
    return out, ad.Zero.from_primal_value(out)
  return out, functools.reduce(jnp.add, terms)


def _transpose(op, ct, lhs, rhs, group_sizes, *rest, **params):
  """Cotangents of the linear operand(s); None for the others."""
  params = tp.params_of(params)
  go = _offset((lhs, rhs, group_sizes, *rest))
  cts = [None] * (3 + len(rest))
  if tp.is_zero(ct):
    return cts
  lhs_linear, rhs_linear = ad.is_undefined_primal(lhs), ad.is_undefined_primal(rhs)
  # The cotangent is rounded to the operands' (common) dtype, as if the op had
  # produced that dtype: the backward ops then run on the same kernels. fp8
  # operands: bf16 (which holds them exactly), results rounded once from f32.
  dtype = (lhs.aval if lhs_linear else lhs).dtype
  wide = validate.widened(dtype)
  ct, ct_scale = _fitted_cotangent(ct, wide)
  if wide != dtype:
    lhs, rhs = (a if ad.is_undefined_primal(a) else a.astype(wide) for a in (lhs, rhs))
  common = dict(precision=params["precision"], implementation=params["implementation"])
  lhs_dtype = _backward_out_dtype(lhs.aval.dtype, ct_scale) if lhs_linear else None
  rhs_dtype = _backward_out_dtype(rhs.aval.dtype, ct_scale) if rhs_linear else None
  if op is gmm:
    transpose_rhs = params["transpose_rhs"]
    if lhs_linear:  # rows outside the shard get 0
      cts[0] = gmm(ct, rhs, group_sizes, go, transpose_rhs=not transpose_rhs,
                   out_dtype=lhs_dtype, **common)
    if rhs_linear:  # the shard's groups only
      a, b = (ct, lhs) if transpose_rhs else (lhs, ct)
      cts[1] = tgmm(a, b, group_sizes, go, num_groups=rhs.aval.shape[0], out_dtype=rhs_dtype,
                    **common)
  else:  # Y[i] = X_i^T D_i  =>  dX_i = D_i dY[i]^T,  dD_i = X_i dY[i].
    if lhs_linear:
      cts[0] = gmm(rhs, ct, group_sizes, go, transpose_rhs=True, out_dtype=lhs_dtype, **common)
    if rhs_linear:
      cts[1] = gmm(lhs, ct, group_sizes, go, transpose_rhs=False, out_dtype=rhs_dtype, **common)
  for i, a in enumerate((lhs, rhs)):
    if cts[i] is not None:
      cts[i] = _unscaled(cts[i], ct_scale).astype(a.aval.dtype)
  return cts


def _fitted_cotangent(ct: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array | None]:
  """``ct`` rounded to the operands' ``dtype`` for the backward kernels, and the
  power of two it was divided by first (None: not scaled).

  A cotangent of a wider exponent range than ``dtype`` (f32 or bf16 beside f16
  operands, e.g. an f32 result of f16 operands) is scaled so its largest value
  sits just below ``dtype``'s largest power of two: without that, values past
  f16's 65504 would become inf and those below ~6e-8 zero, where lax's
  gradients stay finite.  The division and the product back are exact."""
  if not (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(ct.dtype, jnp.floating)
          and jnp.finfo(ct.dtype).maxexp > jnp.finfo(dtype).maxexp):
    return ct.astype(dtype), None
  amax = jnp.max(jnp.abs(ct), initial=0.0).astype(jnp.float32)
  usable = jnp.isfinite(amax) & (amax > 0)
  exponent = jnp.floor(jnp.log2(jnp.where(usable, amax, 1.0)))
  scale = jnp.where(usable, jnp.exp2(exponent - (jnp.finfo(dtype).maxexp - 2)), 1.0)
  return (ct.astype(jnp.float32) / scale).astype(dtype), scale


def _backward_out_dtype(dtype: Any, ct_scale: jax.Array | None) -> jnp.dtype:
  # A scaled cotangent's products are unscaled in f32, then rounded once.
  return validate.backend_out_dtype(jnp.float32 if ct_scale is not None else dtype)


def _unscaled(x: jax.Array, ct_scale: jax.Array | None) -> jax.Array:
  return x if ct_scale is None else x * ct_scale


def _batch(op, axis_data, args, dims, **params):
  """The op mapped over the batch axis, one unbatched call per element (a
  batched kernel call would not be differentiable where a JVP trace sits
  below the batch trace, as in ``jax.grad`` of a function that vmaps).

  A batch split over mesh axes (explicit axes of the operands' types, or
  vmap's ``spmd_axis_name`` over the context mesh's automatic axes) is mapped
  per device: each device loops over its own elements."""
  params = tp.params_of(params)
  mapped = [i for i, d in enumerate(dims) if d is not None]
  xs = [jnp.moveaxis(args[i], dims[i], 0) for i in mapped]
  rest = [a for i, a in enumerate(args) if i not in mapped]

  def loop(xs, rest):
    def one(xs):
      it, others = iter(xs), iter(rest)
      full = [next(it) if i in mapped else next(others) for i in range(len(args))]
      full = match_varying(*full)
      return op(*full, **params)
    return lax.map(one, xs)

  split = _batch_split(xs)
  if split is not None and jax.sharding.get_abstract_mesh().manual_axes:
    # Inside a shard_map over other axes (vmap of ``sharded``'s per-shard body):
    # a shard_map over the batch axes nested there lowers, but its transpose
    # does not (Shardy: "axis already bound").  Loop over the gathered batch.
    mesh, axes = split
    return loop([_reshard(x, mesh, axes, batch=False) for x in xs], rest), 0
  if split is not None:
    # Split over explicit mesh axes, which lax.map cannot scan.
    mesh, axes = split
    xs = [_reshard(x, mesh, axes, batch=True) for x in xs]
    rest = [_reshard(a, mesh, axes, batch=False) for a in rest]
  else:
    split = _spmd_split(axis_data, xs[0].shape[0])
    if split is None:
      return loop(xs, rest), 0
    # vmap(spmd_axis_name=...): a loop over the whole batch would have XLA
    # gather it onto every device.
    mesh, axes = split
  in_specs = ([P(axes)] * len(xs), [P()] * len(rest))
  local = jax.shard_map(loop, mesh=mesh, in_specs=in_specs, out_specs=P(axes),
                        axis_names=set(axes))
  return local(xs, rest), 0


def _batch_split(xs: list[Any]) -> tuple[Any, tuple[str, ...]] | None:
  """The mesh and the explicit axes of the first batch dimension split over
  any, when they divide the batch; else None."""
  for x in xs:
    axes = sharded.split_dims(x)[0]
    if axes:
      mesh = jax.typeof(x).sharding.mesh
      if x.shape[0] % math.prod(mesh.shape[a] for a in axes) == 0:
        return mesh, axes
  return None


def _under_spmd_vmap() -> bool:
  """Whether an enclosing vmap also splits over mesh axes: its batching of
  this rule's shard_map would need those axes manual too (JAX raises), so
  the inner vmap then loops over its whole batch."""
  from jax._src import core  # pylint: disable=g-import-not-at-top  (the trace stack)
  from jax._src.interpreters import batching as jax_batching  # pylint: disable=g-import-not-at-top
  trace = getattr(getattr(core, "trace_ctx", None), "trace", None)  # the rule's parent
  while trace is not None:
    if isinstance(trace, jax_batching.BatchTrace) and trace.axis_data.spmd_name:
      return True
    trace = getattr(trace, "parent_trace", None)
  return False


def _spmd_split(axis_data: Any, size: int) -> tuple[Any, tuple[str, ...]] | None:
  """The context mesh and vmap's ``spmd_axis_name`` axes, when they are
  automatic axes of that mesh and divide the batch; else None."""
  names = axis_data.spmd_name
  if not names or _under_spmd_vmap():
    return None
  axes = tuple(names) if isinstance(names, (tuple, list)) else (names,)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(axes) <= set(mesh.axis_names):
    return None
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if any(types[a] != jax.sharding.AxisType.Auto for a in axes):
    return None
  if size % math.prod(mesh.shape[a] for a in axes):
    return None
  return mesh, axes


def _reshard(x: Any, mesh: Any, axes: tuple[str, ...], batch: bool) -> Any:
  """``x`` split over ``axes`` along its leading dimension if it is a batch,
  and over none of them along every other dimension."""
  dims = sharded.split_dims(x)
  keep = [tuple(a for a in d if a not in axes) for d in dims]
  if batch:
    keep[0] = axes
  if keep == list(dims):
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, sharded.partition_spec(*keep)))


def _exported(params: dict[str, Any]) -> dict[str, Any]:
  """The parameters an op is exported with (``jax.export``): an automatic
  call's XLA form, which runs on whatever device loads the artifact (a kernel
  the exporting host chose may not: Mosaic needs sm90, Pallas-Triton's custom
  call is not among those JAX exports); a chosen implementation is kept."""
  params = tp.params_of(params)
  return {**params, "implementation": params["implementation"] or "xla"}


def _define(name: str, op: Callable[..., jax.Array], op_name: str) -> Any:
  return tp.define(name, functools.partial(_make_fn, op_name),
                   jvp=functools.partial(_jvp, op), transpose=functools.partial(_transpose, op),
                   batch=functools.partial(_batch, op), batch_takes_axis=True,
                   portable=_exported)


gmm_p = _define("ragdot_gmm", gmm, "gmm")
tgmm_p = _define("ragdot_tgmm", tgmm, "tgmm")


# --- fp8 weights with block scales ------------------------------------------------


def scaled_gmm(lhs, rhs, scale, group_sizes, group_offset=None, *, transpose_rhs: bool,
               precision: Any, out_dtype: Any, implementation: str | None) -> jax.Array:
  """``gmm(lhs, scales.dequantize(rhs, scale, lhs.dtype), ...)``: fp8 weights
  ``rhs`` with ``scale`` in rhs's layout (``ragdot.scales``)."""
  args = (lhs, rhs, scale, group_sizes) + (() if group_offset is None else (group_offset,))
  return tp.bind(scaled_gmm_p, *args, transpose_rhs=transpose_rhs, precision=precision,
                 out_dtype=out_dtype, implementation=implementation)


def _make_scaled_fn(params: dict[str, Any]) -> Callable[..., jax.Array]:
  def fn(lhs, rhs, scale, group_sizes, group_offset=None):
    return _IMPLS["scaled_gmm"](lhs, rhs, scale, group_sizes, group_offset, **params)
  return fn


def _dequantized_tangent(lhs, rhs, scale, drhs, dscale):
  """The tangent of the dequantized weights (rounding to lhs's dtype taken as
  the identity, as JAX's convert does)."""
  drhs = ad.instantiate_zeros(drhs)
  dscale = ad.instantiate_zeros(dscale)
  return jax.jvp(lambda r, s: scales.dequantize(r, s, lhs.dtype), (rhs, scale),
                 (drhs, dscale))[1]


def _scaled_jvp(primals, tangents, **params):
  params = tp.params_of(params)
  lhs, rhs, scale, group_sizes, *rest = primals
  go = rest[0] if rest else None
  dlhs, drhs, dscale = tangents[:3]
  out = scaled_gmm(lhs, rhs, scale, group_sizes, go, **params)
  terms = []
  if not (tp.is_zero(drhs) and tp.is_zero(dscale)):  # through the dequantized weights
    terms.append(gmm(lhs, _dequantized_tangent(lhs, rhs, scale, drhs, dscale), group_sizes, go,
                     **params))
  if not tp.is_zero(dlhs):
    terms.append(scaled_gmm(dlhs, rhs, scale, group_sizes, go, **params))
  if not terms:
    return out, ad.Zero.from_primal_value(out)
  return out, functools.reduce(jnp.add, terms)


def _scaled_transpose(ct, lhs, rhs, scale, group_sizes, *rest, **params):
  """lhs's cotangent: the same scaled weights used transposed (dX).  The JVP
  puts rhs's and the scales' tangents through ``gmm``, so under ``jax.grad``
  only lhs is linear; ``jax.linear_transpose`` in rhs or the scales goes to
  ``_scaled_weights_transpose``."""
  params = tp.params_of(params)
  cts = [None] * (4 + len(rest))
  if tp.is_zero(ct):
    return cts
  go = rest[0] if rest else None
  if ad.is_undefined_primal(rhs) or ad.is_undefined_primal(scale):
    return _scaled_weights_transpose(ct, lhs, rhs, scale, group_sizes, go, cts, **params)
  dtype = lhs.aval.dtype
  ct, ct_scale = _fitted_cotangent(ct, dtype)
  cts[0] = scaled_gmm(ct, rhs, scale, group_sizes, go,
                      transpose_rhs=not params["transpose_rhs"], precision=params["precision"],
                      out_dtype=_backward_out_dtype(dtype, ct_scale),
                      implementation=params["implementation"])
  cts[0] = _unscaled(cts[0], ct_scale).astype(dtype)
  return cts


def _scaled_weights_transpose(ct, lhs, rhs, scale, group_sizes, go, cts, *, transpose_rhs,
                              precision, out_dtype, implementation):
  """Cotangent of the fp8 weights or of the scales (``jax.linear_transpose``;
  ``jax.grad`` goes through the JVP's ``gmm`` instead): the dequantized
  weights' cotangent (a dW), put back through the dequantization, which is
  linear in each of the two."""
  if ad.is_undefined_primal(lhs) or (ad.is_undefined_primal(rhs)
                                     and ad.is_undefined_primal(scale)):
    raise ValueError("scaled_gmm is linear in one operand at a time")
  dtype = lhs.dtype
  r = jnp.zeros(rhs.aval.shape, rhs.aval.dtype) if ad.is_undefined_primal(rhs) else rhs
  s = jnp.zeros(scale.aval.shape, scale.aval.dtype) if ad.is_undefined_primal(scale) else scale
  weights = jax.core.ShapedArray(r.shape, dtype)
  w_ct = _transpose(gmm, ct, lhs, ad.UndefinedPrimal(weights), group_sizes,
                    *(() if go is None else (go,)), transpose_rhs=transpose_rhs,
                    precision=precision, out_dtype=out_dtype, implementation=implementation)[1]
  _, pullback = jax.vjp(lambda r, s: scales.dequantize(r, s, dtype), r, s)
  r_ct, s_ct = pullback(w_ct)
  cts[1 if ad.is_undefined_primal(rhs) else 2] = (
      r_ct if ad.is_undefined_primal(rhs) else s_ct)
  return cts


scaled_gmm_p = tp.define("ragdot_scaled_gmm", _make_scaled_fn, jvp=_scaled_jvp,
                         transpose=_scaled_transpose,
                         batch=functools.partial(_batch, scaled_gmm), batch_takes_axis=True,
                         portable=_exported)
