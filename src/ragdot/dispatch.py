"""Picks a backend and its config for one call from static facts only.

Cheap at trace time (a cached table lookup) and never syncs to the host: it
sees only the device, dtypes, shapes (m, k, n, g), alignment and whether a
group_offset is used.

* An explicitly requested implementation is always honoured (in Pallas
  interpret mode when no GPU is present, so CPU tests run real kernel code); on
  a GPU it gets the table's config when the table names that backend for the
  shape.  A kernel that cannot take the case raises NotImplementedError and
  that error reaches the caller.
* The automatic choice: CPU/TPU -> xla; non-16-bit inputs or a non-default
  precision -> xla; otherwise the device's tuning table (``ragdot.tables``)
  names backend + config for the op ("gmm" forward, "gmm_t" the dX layout,
  "tgmm" dW), with statically misaligned shapes sent to xla.  ``api._run``
  still falls back to xla if a kernel refuses the case.

Table configs become the backend's Config dataclass here, lazily (the kernel
module is imported only when its config is first built).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Literal

import jax
import jax.numpy as jnp

from ragdot import tables
from ragdot import validate

Op = Literal["gmm", "tgmm"]

_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)

# (backend, table op) -> (module, Config class name).
CONFIG_CLASSES = {
    ("mosaic", "gmm"): ("ragdot.backends.mosaic_fwd", "MosaicFwdConfig"),
    ("mosaic", "gmm_t"): ("ragdot.backends.mosaic_fwd", "MosaicFwdConfig"),
    ("mosaic", "tgmm"): ("ragdot.backends.mosaic_dw", "MosaicDwConfig"),
    ("xla", "gmm"): ("ragdot.backends.xla", "XlaConfig"),
    ("xla", "gmm_t"): ("ragdot.backends.xla", "XlaConfig"),
    ("xla", "tgmm"): ("ragdot.backends.xla", "XlaConfig"),
    ("triton", "gmm"): ("ragdot.backends.triton", "TritonConfig"),
    ("triton", "gmm_t"): ("ragdot.backends.triton", "TritonConfig"),
    ("triton", "tgmm"): ("ragdot.backends.triton", "TritonConfig"),
}


@dataclasses.dataclass(frozen=True)
class Choice:
  """A backend name, its kernel config (None = the backend's default)."""

  implementation: str
  config: Any = None
  interpret: bool = False
  automatic: bool = False
  reason: str = ""
  measured: bool = False  # the config was timed on this device kind at a nearby shape


@dataclasses.dataclass(frozen=True)
class Device:
  """The static facts of the device dispatch decides for."""

  platform: str  # "gpu", "cpu", "tpu"
  kind: str = ""
  compute_capability: str | None = None


@functools.cache
def _platform() -> str:
  return jax.default_backend()


@functools.cache
def device_kind() -> str:
  return jax.devices()[0].device_kind


@functools.cache
def current_device() -> Device:
  platform = _platform()
  if platform != "gpu":
    return Device(platform, device_kind())
  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", None)
  return Device("gpu", dev.device_kind, None if cc is None else str(cc))


def simulated_device(kind: str, compute_capability: str | None = None) -> Device:
  """A GPU of ``kind`` as ``ragdot info`` / ``tune --device-kind`` explain it:
  without ``compute_capability``, the one its table names (kernels that need
  sm90 are chosen by it), None for a kind only the default table serves."""
  if compute_capability is None:
    table, _ = tables.table_for(kind)
    compute_capability = table.data.get("compute_capability")
  return Device("gpu", kind, compute_capability)


def has_gpu() -> bool:
  return _platform() == "gpu"


def _default_precision(precision: Any) -> bool:
  if precision is None:
    return True
  values = precision if isinstance(precision, tuple) else (precision,)
  return all(v in (None, jax.lax.Precision.DEFAULT, "default", "DEFAULT") for v in values)


def clear_cache() -> None:
  """Forget cached choices and tables (after a table file changed)."""
  tables.clear_cache()
  _choose.cache_clear()
  _weight_only_entry.cache_clear()
  _built_config.cache_clear()


def table_op(op: str, transpose_rhs: bool = False) -> str:
  """The table's op name: "gmm", "gmm_t" (rhs [g, n, k]) or "tgmm"."""
  if op == "gmm":
    return "gmm_t" if transpose_rhs else "gmm"
  if op == "tgmm":
    return "tgmm"
  raise ValueError(f"op must be 'gmm' or 'tgmm', got {op!r}")


@dataclasses.dataclass(frozen=True)
class BackendCall:
  """The backend entry point behind a user-level op of ``[m, k] x [g, k, n]``."""

  op: Op  # "gmm" or "tgmm"
  k: int  # contraction size the backend sees
  n: int  # output columns the backend sees
  transpose_rhs: bool

  @property
  def table_op(self) -> str:
    return table_op(self.op, self.transpose_rhs)


def backend_call(user_op: str, k: int, n: int) -> BackendCall:
  """fwd / fwdbwd -> gmm(k, n); dx -> gmm of dy [m, n] with rhs [g, k, n] read
  transposed (k and n swapped); dw -> tgmm(k, n)."""
  if user_op in ("fwd", "fwdbwd"):
    return BackendCall("gmm", k, n, False)
  if user_op == "dx":
    return BackendCall("gmm", n, k, True)
  if user_op == "dw":
    return BackendCall("tgmm", k, n, False)
  raise ValueError(f"user_op must be fwd, fwdbwd, dx or dw, got {user_op!r}")


def config_class(backend: str, op: str) -> type:
  """The Config dataclass of ``backend`` for table op ``op`` (imports it)."""
  module, name = CONFIG_CLASSES[(backend, op)]
  return getattr(importlib.import_module(module), name)


def make_config(backend: str, op: str, fields: dict[str, Any] | None) -> Any:
  """Builds the backend's Config from table fields (None -> None).  TypeError
  for a value unlike its field's type (``"num_stages": 4.0`` from a JSON file
  would reach the kernel's shapes)."""
  if fields is None:
    return None
  cls = config_class(backend, op)
  types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
  allowed = {"bool": (bool,), "int": (int,), "float": (int, float), "None": (type(None),)}
  for name, value in fields.items():
    ok = tuple(t for part in types.get(name, "").split(" | ") for t in allowed.get(part, ()))
    if ok and (not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok)):
      raise TypeError(f"{cls.__name__}.{name} takes {types[name]}, got {value!r}")
  return cls(**fields)


def _fit_smem(backend: str, op: str, config: Any, dtype: str, out_dtype: str) -> Any:
  """The kernel's own SMEM fitting of ``config`` (None: it cannot fit)."""
  if backend != "mosaic":
    return config
  module = importlib.import_module(CONFIG_CLASSES[(backend, op)][0])
  return module.fit_config(config, dtype, out_dtype)


@functools.lru_cache(maxsize=512)
def _built_config(backend: str, op: str, items: tuple | None, dtype: str,
                  out_dtype: str) -> tuple[Any, str]:
  """(config or None, note): table fields -> Config, shrunk to fit SMEM."""
  if items is None:
    return None, ""
  try:
    config = make_config(backend, op, dict(items))
  except (TypeError, ValueError) as e:  # the kernel's Config changed under the table
    return None, f"; table config rejected ({e}), backend default used"
  try:
    fitted = _fit_smem(backend, op, config, dtype, out_dtype)
  except ValueError as e:  # a refit the Config refuses: the default, not an error
    return None, f"; table config not refittable for {dtype}->{out_dtype} ({e}), default used"
  if fitted is None:
    return None, f"; table config exceeds SMEM for {dtype}->{out_dtype}, default used"
  if fitted != config:
    return fitted, f"; table config refitted to SMEM for {dtype}->{out_dtype}"
  return config, ""


def _misaligned(op: str, m: int, k: int, n: int) -> str | None:
  """Why the Mosaic kernel for ``op`` refuses the shape (static), or None."""
  module = importlib.import_module(CONFIG_CLASSES[("mosaic", op)][0])
  reason = module.unsupported_shape(m, k, n)
  return None if reason is None else f"mosaic {op}: {reason}"


def _name(dtype: Any) -> str | None:
  return None if dtype is None else jnp.dtype(dtype).name


def facts(op: Op, *, lhs, rhs, group_sizes, group_offset=None, transpose_rhs=False,
          num_groups=None, out_dtype=None, precision=None) -> dict[str, Any]:
  """``choose`` keyword arguments from one backend call's arguments (static only)."""
  m, k = lhs.shape
  if op == "gmm":
    g = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  else:
    g = num_groups
    n = rhs.shape[1]
  return dict(dtype=lhs.dtype, precision=precision, out_dtype=out_dtype, m=m, k=k,
              n=n, g=g, num_groups=group_sizes.shape[0],
              transpose_rhs=bool(transpose_rhs), has_offset=group_offset is not None,
              rhs_dtype=rhs.dtype)


def choose(op: Op, implementation: str | None, *, dtype: Any = None,
           precision: Any = None, out_dtype: Any = None, m: int | None = None,
           k: int | None = None, n: int | None = None, g: int | None = None,
           num_groups: int | None = None, transpose_rhs: bool = False,
           has_offset: bool = False, device: Device | None = None,
           rhs_dtype: Any = None) -> Choice:
  """The backend (and config) for ``op``; ``implementation`` was validated.

  Args:
    op: "gmm" or "tgmm" (the backend entry point).
    implementation: None (automatic) or a backend name.
    dtype, out_dtype, precision: of the call.
    m, k, n, g: lhs ``[m, k]``, output columns n, local groups g (None when
      unknown: then the table's op default is used).
    num_groups: G, the length of group_sizes.
    transpose_rhs: rhs laid out ``[g, n, k]`` (the dX mode).
    has_offset: a group_offset is given: the shard's groups have the full
      call's rows per group, so the lookup uses the full call (m, G).
    device: override the current device (``ragdot info --device-kind``, tests).
    rhs_dtype: rhs's dtype when it differs from ``dtype`` (fp8 weights beside
      bf16/f16 rows, see ``validate.weight_only``; None: the same).
  """
  precision_ok = _default_precision(precision)
  device = device or current_device()
  if rhs_dtype is not None and jnp.dtype(rhs_dtype) != jnp.dtype(dtype):
    return _weight_only(op, implementation, dtype, rhs_dtype, precision_ok, out_dtype, m, k, n,
                        g, num_groups, transpose_rhs, has_offset, device)
  if _fp8_native(op, implementation, dtype, precision_ok, m, k, n, device):
    if not transpose_rhs:
      widened = _fp8_rows_widened(implementation, dtype, precision_ok, out_dtype, m, k, n, g,
                                  num_groups, has_offset, device)
      if widened is not None:
        return widened
    # 8-bit wgmma: the Mosaic forward on rhs [g, n, k] (a [g, k, n] rhs is copied
    # to that layout in fp8), with an fp8 entry of the table, else the bf16 one's
    # config with its k step doubled.
    return _choose(op, implementation, _name(dtype), precision_ok,
                   _name(out_dtype) or "bfloat16", m, k, n, g, num_groups, True,
                   bool(has_offset), device)
  fp8 = dtype is not None and validate.is_fp8(dtype)  # else: bf16 copies
  return _choose(op, implementation, "bfloat16" if fp8 else _name(dtype), precision_ok,
                 _name(out_dtype) or ("bfloat16" if fp8 else _name(dtype)), m, k, n, g,
                 num_groups, bool(transpose_rhs), bool(has_offset), device)


def _fp8_rows_widened(implementation, dtype, precision_ok, out_dtype, m, k, n, g, num_groups,
                      has_offset, device: Device) -> Choice | None:
  """fp8 rows and fp8 weights laid out [g, k, n] (8-bit wgmma takes K-major
  operands only): the W8A16 choice for bf16 rows with ``widen_rows`` (the rows
  widened to bf16, the weights read as stored), where that kernel takes the
  call (a 16-bit output); None: the fp8 form on a [g, n, k] copy of
  the weights."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  out = _name(out_dtype) or "bfloat16"
  if mosaic_fwd.weight_only_refusal(jnp.bfloat16, dtype, out) is not None:
    return None
  choice = _weight_only("gmm", implementation, jnp.bfloat16, dtype, precision_ok, out, m, k, n,
                        g, num_groups, False, has_offset, device)
  if not isinstance(choice.config, mosaic_fwd.MosaicFwdConfig):
    return None  # (a table's W8A16 entry may name Triton, which cannot widen the rows)
  return dataclasses.replace(
      choice, config=dataclasses.replace(choice.config, widen_rows=True),
      reason=f"{_name(dtype)} rows widened to bf16 (weights [g, k, n] read as stored); "
             + choice.reason)


def _fp8_native(op: Op, implementation: str | None, dtype: Any, precision_ok: bool, m, k, n,
                device: Device) -> bool:
  """Whether an fp8 call runs the native Mosaic forward: e4m3 / e5m2 on sm90,
  automatic or Mosaic chosen, shapes Mosaic takes.  It ran in 0.56-0.70x the
  bf16 call's time where bf16 copies cost 2.6-3.7x (v51a)."""
  if dtype is None or not validate.is_fp8(dtype) or op != "gmm" or not precision_ok:
    return False
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  return (mosaic_fwd.takes_fp8(dtype) and implementation in (None, "mosaic")
          and _hopper_takes(device, m, k, n))


def _hopper_takes(device: Device, m, k, n) -> bool:
  """An sm90 device and a shape the Mosaic forward on rhs [g, n, k] takes."""
  return (device.platform == "gpu" and (device.compute_capability or "").startswith("9")
          and None not in (m, k, n) and not _misaligned("gmm_t", m, k, n))


def triton_takes_weight_only(lhs_dtype: Any, rhs_dtype: Any, device: Device | None = None
                             ) -> bool:
  """Whether the Triton forward / dX kernel gets e4m3 / e5m2 weights beside
  bf16 / f16 rows as they are (widened after each load) on ``device``
  (default: the current one): off the GPU (interpret mode), or from sm89 on
  (Triton's fp8 conversions); elsewhere it gets a widened copy."""
  from ragdot.backends import triton  # pylint: disable=g-import-not-at-top
  if not triton.takes_weight_only(lhs_dtype, rhs_dtype):
    return False
  device = device or current_device()
  if device.platform != "gpu":
    return True
  major, _, minor = (device.compute_capability or "0.0").partition(".")
  return (int(major), int(minor or 0)) >= (8, 9)


def _weight_only(op, implementation, dtype, rhs_dtype, precision_ok, out_dtype, m, k, n, g,
                 num_groups, transpose_rhs, has_offset, device: Device) -> Choice:
  """fp8 weights beside 16-bit rows: on sm90, where it takes the call, the
  Mosaic swap kernel widening them as it reads them (W8A16), with the config
  ``mosaic_fwd.weight_only_config`` makes of the 16-bit entry's when that is
  Mosaic, except at decode size (fewer than 48 rows per group: its
  ``decode_rows`` tiles), else of none; elsewhere (an f32 result, rows not in
  whole 8-row tiles) on sm89+ the Triton kernel on the weights as they are
  (``triton_takes_weight_only``), else the 16-bit choice on a widened copy."""
  from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
  out = _name(out_dtype) or _name(dtype)
  native = (op == "gmm" and precision_ok and implementation in (None, "mosaic")
            and _hopper_takes(device, m, k, n)
            and mosaic_fwd.weight_only_refusal(dtype, rhs_dtype, out) is None)
  if not native:
    args = (_name(dtype), precision_ok, out, m, k, n, g, num_groups, bool(transpose_rhs),
            bool(has_offset), device)
    choice = _choose(op, implementation, *args)
    if (op != "gmm" or implementation not in (None, "triton") or device.platform != "gpu"
        or not triton_takes_weight_only(dtype, rhs_dtype, device)):
      return choice
    # The Triton kernel on the weights as they are, rather than any kernel on a
    # widened copy of them (2.3-2.9x the bf16 call, docs/performance.md v54a).
    why = choice.reason
    if choice.implementation != "triton":
      why = (f"the Mosaic W8A16 kernel refuses the call; instead of the {_name(dtype)} choice"
             f" ({choice.implementation}) on a widened copy")
      choice = dataclasses.replace(_choose(op, "triton", *args), automatic=implementation is None)
    return dataclasses.replace(choice, reason=f"{_name(rhs_dtype)} weights widened after each"
                               f" load (Triton W8A16); {why}")
  # A shard takes the full call's entry (a shard's own is mapped to the row-major ring).
  groups = num_groups if has_offset and num_groups else g
  tuned = _weight_only_entry(table_op(op, transpose_rhs), implementation, _name(dtype),
                             _name(rhs_dtype), m, k, n, groups, device)
  if tuned is not None:
    return tuned
  choice = _choose(op, implementation, _name(dtype), precision_ok, out, m, k, n, groups,
                   groups if has_offset else num_groups, bool(transpose_rhs), False, device)
  decode = mosaic_fwd.weight_only_decode(m, groups or 0)
  entry = choice.implementation == "mosaic" and not decode
  # (the config the kernel runs: ``weight_only_config`` of it is itself)
  config = mosaic_fwd.weight_only_config(choice.config if entry else None, m, groups or 0, k,
                                         bool(transpose_rhs))
  why = ("the 16-bit entry's tiles" if entry else
         f"decode size: {config.swap_rows}-row tiles" if decode else
         f"its own tiles (the {_name(dtype)} choice, {choice.implementation}, would run on a"
         " widened copy)")
  return Choice("mosaic", config=config, automatic=implementation is None,
                reason=f"{_name(rhs_dtype)} weights: the W8A16 swap kernel, {why}; {choice.reason}")


def weight_only_dtype(dtype: Any, rhs_dtype: Any) -> str:
  """The table dtype of W8A16 entries: ``rows+weights``."""
  return f"{_name(dtype)}+{_name(rhs_dtype)}"


@functools.lru_cache(maxsize=4096)
def _weight_only_entry(top, implementation, dtype, rhs_dtype, m, k, n, groups,
                       device: Device) -> Choice | None:
  """The table's W8A16 entry for the call (``ragdot tune --weights-dtype``):
  Mosaic (its config as ``weight_only_config`` fits it) or Triton (sm89+), when
  one is within reach and ``implementation`` allows it; else None."""
  if None in (m, k, n, groups) or not groups:
    return None
  table, why = tables.table_for(device.kind, device.compute_capability)
  hit = table.lookup(top, weight_only_dtype(dtype, rhs_dtype), m, k, n, groups)
  if (hit is None or hit.backend not in ("mosaic", "triton") or hit.config_items is None
      or implementation not in (None, hit.backend)):
    return None
  if hit.backend == "triton" and not triton_takes_weight_only(dtype, rhs_dtype, device):
    return None
  try:
    config = make_config(hit.backend, top, dict(hit.config_items))
  except (TypeError, ValueError):  # the kernel's Config changed under the table
    return None
  if hit.backend == "mosaic":
    from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
    if not config.swap:
      return None
    # A decode entry's tiles fit its rows per group: a call with other ones (16-row
    # tiles tuned on 4 rows a group, called on 32: each group's weights read 2-3
    # times) takes the rule's instead.
    e_m, _, _, e_g = tables.parse_key(hit.key)[2] if hit.key else (m, k, n, groups)
    if (mosaic_fwd.weight_only_tile_rows(m, groups)
        != mosaic_fwd.weight_only_tile_rows(e_m, e_g)):
      return None
    config = mosaic_fwd.weight_only_config(config, m, groups, k, top == "gmm_t")
  return Choice(hit.backend, config=config, automatic=implementation is None,
                measured=hit.measured,
                reason=f"{rhs_dtype} weights: the W8A16 {hit.reason}; {why}")


@functools.lru_cache(maxsize=4096)
def _choose(op, implementation, dtype, precision_ok, out_dtype, m, k, n, g,
            num_groups, transpose_rhs, has_offset, device: Device) -> Choice:
  top = table_op(op, transpose_rhs)
  on_gpu = device.platform == "gpu"
  if implementation is not None:
    choice = Choice(implementation, interpret=not on_gpu,
                    reason=f"implementation={implementation!r} requested")
    if not on_gpu:
      return choice
    auto = _automatic(top, dtype, precision_ok, out_dtype, m, k, n, g, num_groups,
                      has_offset, device)
    if auto.implementation == implementation and auto.config is not None:
      return dataclasses.replace(auto, automatic=False,
                                 reason=f"requested; config: {auto.reason}")
    return choice
  return _automatic(top, dtype, precision_ok, out_dtype, m, k, n, g, num_groups,
                    has_offset, device)


def _automatic(top, dtype, precision_ok, out_dtype, m, k, n, g, num_groups,
               has_offset, device: Device) -> Choice:
  def xla(reason):
    return Choice("xla", automatic=True, reason=reason)

  if device.platform != "gpu":
    return xla(f"platform {device.platform}: the GPU kernels do not run here")
  fp8 = dtype is not None and top == "gmm_t" and validate.is_fp8(dtype)  # (see choose)
  if dtype is None or not (fp8 or jnp.dtype(dtype) in _KERNEL_DTYPES):
    return xla(f"dtype {dtype}: the kernels take bf16/f16 only")
  if not precision_ok:
    return xla("non-default precision requested")
  table, why = tables.table_for(device.kind, device.compute_capability)
  g_eff = None
  from_16 = False  # fp8 on a bf16 entry
  if None in (m, k, n, g):
    from_16 = fp8
    default = table.data.get("defaults", {}).get(
        table.canonical_dtype("bfloat16" if fp8 else dtype), {}).get(top)
    if default is None:
      return xla(f"{why}: no default for {top}/{dtype}")
    hit = tables.Hit(default["backend"], default.get("config"), False, table.name, None,
                     None, f"shape unknown: table default; {why}")
  else:
    # An expert-parallel shard has the full call's rows per group: look up the
    # full call (all rows, all G groups), not a shape with fewer rows *and* groups.
    g_eff = num_groups if has_offset and num_groups else g
    hit = table.lookup(top, dtype, m, k, n, g_eff)
    if hit is None and fp8:  # no fp8 entries: the bf16 ones, k steps doubled below
      from_16, hit = True, table.lookup(top, "bfloat16", m, k, n, g_eff)
    if hit is None:
      return xla(f"{why}: no entries for {top}/{dtype}")
    hit = dataclasses.replace(hit, reason=f"{hit.reason}; {why}")
  if fp8 and hit.backend != "mosaic":
    return Choice("mosaic", automatic=True,
                  reason=f"fp8: native 8-bit wgmma with the kernel's default config (the"
                         f" table's choice, {hit.backend}, would run on bf16 copies);"
                         f" {hit.reason}")
  if hit.backend == "mosaic" and m is not None:
    bad = _misaligned(top, m, k, n)
    if bad:
      return Choice("triton", automatic=True,
                    reason=f"{bad}; table said mosaic; the Triton kernels take any shape")
  config, note = _built_config(hit.backend, top, hit.config_items,
                               "bfloat16" if from_16 else dtype, out_dtype or dtype)
  if fp8 and config is not None and k is not None:
    from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
    if from_16:
      wide = mosaic_fwd.for_one_byte(config, k)
      if wide != config:
        note += f"; bf16 entry, k step {wide.block_k} for 1-byte operands"
        config = wide
    elif k % mosaic_fwd.k_tile(config, dtype):
      # An fp8 entry borrowed by a call whose k its TMA tiles do not cut (the
      # kernel refuses it): 64 columns, which every k Mosaic takes divides.
      config = dataclasses.replace(config, block_k=64)
      note += f"; k step 64 (k = {k})"
  if hit.backend == "mosaic" and top == "tgmm" and config is not None and g_eff:
    from ragdot.backends import mosaic_dw  # pylint: disable=g-import-not-at-top
    wide = out_dtype or dtype
    if not mosaic_dw.pingpong_pays(config, wide, m, g_eff):
      note += (f"; {jnp.dtype(wide).name} output over {m / g_eff:.3g} rows per group: the"
               " kernel's default, not the table's pingpong ring")
      config = None
  if hit.backend == "mosaic" and top in ("gmm", "gmm_t") and config is not None:
    from ragdot.backends import mosaic_fwd  # pylint: disable=g-import-not-at-top
    if has_offset:
      if g_eff:
        kept = mosaic_fwd.shard_keeps_swap(config, m, g_eff, k, n, jnp.dtype(dtype).itemsize,
                                           transpose_rhs=top == "gmm_t")
        if kept != config:
          note += f"; swap with consumer-written zeros for {m / g_eff:.0f} rows per group"
          if kept.shard_ring_above is not None:
            note += (f", the row-major ring above {kept.shard_ring_above:g}x the shard's"
                     " fair share of rows")
          config = kept
      # The config a shard call runs (the kernel resolves it the same way):
      # producer_zeros made concrete, its epilogue split widened to fit.
      config = mosaic_fwd.resolve_producer_zeros(config, True, dtype, out_dtype or dtype)
    if g_eff:
      # Swap tiles sized for this call's rows per group (an entry may come from
      # a bucket with more of them).
      fitted = mosaic_fwd.fit_rows_per_group(config, m, g_eff)
      if fitted != config:
        tail = f" + {fitted.tail_rows}" if fitted.tail_rows else ""
        note += (f"; swap tiles of {fitted.swap_rows}{tail} rows for {m / g_eff:.0f} rows "
                 "per group")
        config = fitted
  return Choice(hit.backend, config=config, automatic=True,
                reason=hit.reason + note, measured=hit.measured and not note)
