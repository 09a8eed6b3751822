"""Primitives whose implementation is a JAX function, traced where they are bound.

``define`` makes a primitive from ``make_fn(params) -> fn(*args)`` and its
autodiff and batching rules; ``bind`` calls it.  At each bind under a trace,
``fn`` is traced (in the caller's context: a shard_map's manual axes, a mesh)
into the ``jaxpr`` parameter, which gives the result's type and effects and is
what the primitive lowers to.  With no tracer among the arguments (op by op)
``fn`` runs directly and nothing is bound.  Rules get the parameters with
``jaxpr`` among them; ``params_of`` drops it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

MakeFn = Callable[[dict[str, Any]], Callable[..., jax.Array]]
_FNS: dict[Any, MakeFn] = {}


def define(name: str, make_fn: MakeFn, *, jvp: Callable, transpose: Callable,
           batch: Callable, batch_takes_axis: bool = False) -> jex_core.Primitive:
  """A primitive computing ``make_fn(params)(*args)``, with the given JVP,
  transpose and batching rules (as ``ad.primitive_jvps`` etc. take them; with
  ``batch_takes_axis`` the batching rule takes vmap's axis data first, as
  ``batching.fancy_primitive_batchers`` rules do)."""
  prim = jex_core.Primitive(name)
  _FNS[prim] = make_fn
  prim.def_impl(lambda *args, jaxpr, **params: make_fn(params)(*args))
  prim.def_effectful_abstract_eval(_abstract_eval)
  mlir.register_lowering(prim, _lowering)
  ad.primitive_jvps[prim] = jvp
  ad.primitive_transposes[prim] = transpose
  if batch_takes_axis:
    def rule(axis_data, args, dims, **params):
      if all(d is None for d in dims):  # nothing batched: the plain primitive
        return prim.bind(*args, **params), None
      return batch(axis_data, args, dims, **params)
    batching.fancy_primitive_batchers[prim] = rule
  else:
    batching.primitive_batchers[prim] = batch
  return prim


def bind(prim: jex_core.Primitive, *args: Any, **params: Any) -> jax.Array:
  """``prim`` on ``args``: bound with the trace of its function, or, with no
  tracer among ``args``, its function called directly."""
  fn = _FNS[prim](params)
  if is_eager(args):
    return fn(*args)
  # Traced now, not lazily when first needed: JAX scans parameters for jaxprs
  # (e.g. for a custom_partitioning call, which needs the jit's devices when it
  # lowers), so the parameter must be the ClosedJaxpr itself.
  jaxpr = jax.make_jaxpr(fn)(*[_struct(a) for a in args])
  return prim.bind(*args, jaxpr=jaxpr, **params)


def is_eager(args: Iterable[Any]) -> bool:
  """Whether a call runs op by op: no argument is a tracer."""
  return not any(isinstance(a, jax.core.Tracer) for a in args)


def params_of(params: dict[str, Any]) -> dict[str, Any]:
  """A rule's parameters without the traced ``jaxpr``."""
  return {k: v for k, v in params.items() if k != "jaxpr"}


def is_zero(t: Any) -> bool:
  """Whether a tangent or cotangent is a symbolic zero."""
  return type(t) is ad.Zero  # pylint: disable=unidiomatic-typecheck


def _struct(x: Any) -> jax.ShapeDtypeStruct:
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # the shard_map axes it varies over
  kwargs = {} if mat is None else {"manual_axis_type": mat}
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=aval.sharding,
                              weak_type=aval.weak_type, **kwargs)


def _abstract_eval(*avals, jaxpr, **params):
  del avals, params
  return jaxpr.out_avals[0], jaxpr.effects


def _lowering(ctx, *args, jaxpr, **params):
  del params
  return mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)
