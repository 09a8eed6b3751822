"""The ``ragdot`` command: ``info``, ``bench`` and ``tune``.

  ragdot info [--preset ...] [--device-kind "NVIDIA H200"]
      versions, device, tuning table, and per preset shape the backend and
      config the dispatcher would pick for fwd / dX / dW, with the reason.
  ragdot bench [--preset ...] [--shape m,k,n,g] [--ops fwd dx dw fwdbwd] ...
      side-by-side timings (ragdot.bench), peak memory per call, and the check
      that the automatic choice is within 5% of the best implementation run.
  ragdot tune [--preset ...] [--shape m,k,n,g] [--dry-run] [--force] ...
      measure kernel configs on this GPU and merge the best into its table.
"""

from __future__ import annotations

import argparse
import platform
import sys

from ragdot import argtypes


def _info_parser(sub) -> None:
  from ragdot import bench  # pylint: disable=g-import-not-at-top

  p = sub.add_parser("info", help="versions, device, and what would run for preset shapes")
  p.add_argument("--preset", nargs="+", default=None, choices=sorted(bench.PRESETS),
                 help="default: the model presets (" + ", ".join(bench.MODELS)
                 + "), ep-models and ep-local")
  p.add_argument("--shape", action="append", default=[], type=bench.parse_shape,
                 help="m,k,n,g[,top_k] (repeatable)")
  p.add_argument("--device-kind", default=None,
                 help="explain the choice for this GPU kind instead of the current device"
                      " (e.g. 'NVIDIA H200')")
  p.add_argument("--compute-capability", default=None, type=argtypes.compute_capability,
                 help="with --device-kind (default: the compute capability its table names)")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  p.add_argument("--weights-dtype", default=None,
                 choices=["float8_e4m3fn", "float8_e5m2"],
                 help="fp8 expert weights beside --dtype rows (W8A16; bf16/f16 rows)")


def _versions() -> dict[str, str]:
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  import numpy  # pylint: disable=g-import-not-at-top
  import ragdot  # pylint: disable=g-import-not-at-top

  out = {"ragdot": ragdot.__version__, "jax": jax.__version__,
         "jaxlib": jaxlib.__version__, "numpy": numpy.__version__,
         "python": platform.python_version()}
  try:
    import tokamax  # pylint: disable=g-import-not-at-top,unused-import
    out["tokamax"] = getattr(tokamax, "__version__", "installed")
  except Exception:  # pylint: disable=broad-except
    out["tokamax"] = "not installed"
  return out


def run_info(args: argparse.Namespace) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ragdot import auto_sharding, bench, dispatch, tables  # pylint: disable=g-import-not-at-top

  if args.device_kind is not None and not args.device_kind.strip():
    print("--device-kind needs a GPU kind, e.g. 'NVIDIA H200'", file=sys.stderr)
    return 2
  if args.compute_capability and not args.device_kind:
    print("--compute-capability needs --device-kind", file=sys.stderr)
    return 2
  print("versions: " + "  ".join(f"{k} {v}" for k, v in _versions().items()))
  devs = jax.devices()
  cur = dispatch.current_device()
  cc = f", compute capability {cur.compute_capability}" if cur.compute_capability else ""
  print(f"device: {len(devs)} x {devs[0].device_kind} (platform {cur.platform}{cc})")
  device = cur
  if args.device_kind:
    device = dispatch.simulated_device(args.device_kind, args.compute_capability)
    cc = (f", compute capability {device.compute_capability}" if device.compute_capability
          else ", compute capability unknown")
    print(f"explaining choices for: {args.device_kind}{cc} (simulated, --device-kind)")
  if device.platform == "gpu":
    table, why = tables.table_for(device.kind, device.compute_capability)
    counts = sum(bool(e.get("measured")) for e in table.entries.values())
    print(f"tuning table: {table.path} ({why}); {len(table.entries)} entries, {counts} measured")
  else:
    print(f"tuning table: none (platform {device.platform}: every op runs on the xla backend;"
          " --device-kind 'NVIDIA H200' shows the H200 choices)")
  print("tables read from: " + ", ".join(str(d) for d in tables.table_dirs()))
  print("automatic sharding: " + ("per shard (custom_partitioning; RAGDOT_AUTO_PARTITION=0 turns it"
                                  " off)" if auto_sharding.enabled() else
                                  "off: operands gathered (RAGDOT_AUTO_PARTITION=0)"))

  presets = args.preset
  if presets is None:
    presets = [] if args.shape else [*bench.MODELS, "ep-models", "ep-local"]
  shapes = [s for p in presets for s in bench.PRESETS[p]] + list(args.shape)
  dtype = jnp.dtype(args.dtype)
  weights = None if args.weights_dtype is None else jnp.dtype(args.weights_dtype)
  if weights is not None and dtype == jnp.float32:
    print("--weights-dtype takes bf16 or f16 rows (--dtype)", file=sys.stderr)
    return 2
  rows = []
  for s in shapes:
    for op in ("fwd", "dx", "dw"):
      c = bench.dispatch_choice(op, s, None, dtype, device, weights)
      cfg = "default config" if c.config is None else bench._short_config(c.config)  # pylint: disable=protected-access
      rows.append((s.name, f"{s.m},{s.k},{s.n},{s.g}", op, c.implementation, cfg, c.reason))
  try:
    from rich.console import Console  # pylint: disable=g-import-not-at-top
    from rich.table import Table  # pylint: disable=g-import-not-at-top
  except ImportError:
    for r in rows:
      print("  ".join(r))
    return 0
  t = Table(title=f"what runs ({dtype.name}" + (f" rows, {weights.name} weights)" if weights
                                                else ")"))
  for col in ("shape", "m,k,n,g", "op", "backend", "config", "why"):
    t.add_column(col, overflow="fold")
  for r in rows:
    t.add_row(*r)
  Console(width=220).print(t)
  return 0


def main(argv=None) -> int:
  from ragdot import bench, tune  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(prog="ragdot", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  _info_parser(sub)
  bench.add_arguments(sub.add_parser("bench", help="benchmark (ragdot.bench)",
                                     description=bench.__doc__))
  tune.add_arguments(sub.add_parser("tune", help="tune kernel configs on this GPU",
                                    description=tune.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter))
  args = parser.parse_args(argv)
  if args.command == "info":
    return run_info(args)
  if args.command == "bench":
    return bench.run(args)
  return tune.run(args)


if __name__ == "__main__":
  sys.exit(main())
