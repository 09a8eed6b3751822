"""Primitives whose implementation is a JAX function, traced where they are bound.

``define`` makes a primitive from ``make_fn(params) -> fn(*args)`` and its
autodiff and batching rules; ``bind`` calls it.  At each bind under a trace,
``fn`` is traced (in the caller's context: a shard_map's manual axes, a mesh)
into the ``jaxpr`` parameter, which gives the result's type and effects and is
what the primitive lowers to.  With no tracer among the arguments (op by op)
``fn`` runs directly and nothing is bound.  Rules get the parameters with
``jaxpr`` among them; ``params_of`` drops it.

Lowered for ``jax.export``, a primitive defined with ``portable`` lowers a new
trace instead, of ``make_fn(portable(params))`` with ``exporting()`` true while
it is traced: an exported artifact runs wherever it is loaded (another GPU, the
CPU), not only on the device the bind's trace chose kernels for.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterable, Iterator

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

MakeFn = Callable[[dict[str, Any]], Callable[..., jax.Array]]
_FNS: dict[Any, MakeFn] = {}
_PORTABLE: dict[Any, Callable[[dict[str, Any]], dict[str, Any]]] = {}
_EXPORT_TRACE = threading.local()


def define(name: str, make_fn: MakeFn, *, jvp: Callable, transpose: Callable,
           batch: Callable, batch_takes_axis: bool = False,
           portable: Callable[[dict[str, Any]], dict[str, Any]] | None = None
           ) -> jex_core.Primitive:
  """A primitive computing ``make_fn(params)(*args)``, with the given JVP,
  transpose and batching rules (as ``ad.primitive_jvps`` etc. take them; with
  ``batch_takes_axis`` the batching rule takes vmap's axis data first, as
  ``batching.fancy_primitive_batchers`` rules do).  ``portable(params)``: the
  parameters it is traced with again when lowered for ``jax.export`` (module
  docstring); without it the bind's trace is exported."""
  prim = jex_core.Primitive(name)
  _FNS[prim] = make_fn
  if portable is not None:
    _PORTABLE[prim] = portable
  prim.def_impl(lambda *args, jaxpr, **params: make_fn(params)(*args))
  prim.def_effectful_abstract_eval(_abstract_eval)
  mlir.register_lowering(prim, functools.partial(_lowering, prim))
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


def exporting() -> bool:
  """Whether the current trace is one for ``jax.export`` (module docstring)."""
  return getattr(_EXPORT_TRACE, "on", False)


@contextlib.contextmanager
def _export_trace() -> Iterator[None]:
  before = exporting()
  _EXPORT_TRACE.on = True
  try:
    yield
  finally:
    _EXPORT_TRACE.on = before


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
  return _aval_struct(jax.typeof(x))


def _aval_struct(aval: Any) -> jax.ShapeDtypeStruct:
  mat = getattr(aval, "mat", None)  # the shard_map axes it varies over
  kwargs = {} if mat is None else {"manual_axis_type": mat}
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=aval.sharding,
                              weak_type=aval.weak_type, **kwargs)


def _abstract_eval(*avals, jaxpr, **params):
  del avals, params
  return jaxpr.out_avals[0], jaxpr.effects


def _lowering(prim, ctx, *args, jaxpr, **params):
  portable = _PORTABLE.get(prim)
  if portable is not None and ctx.module_context.lowering_parameters.for_export:
    with _export_trace():
      jaxpr = jax.make_jaxpr(_FNS[prim](portable(params)))(
          *[_aval_struct(a) for a in ctx.avals_in])
  return mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr), multiple_results=True)(ctx, *args)
