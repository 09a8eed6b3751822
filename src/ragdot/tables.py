"""Shipped tuning tables: static facts of one call -> backend name + config fields.

Pure data and arithmetic: reading a table imports no kernel module (and no JAX),
so ``ragdot.dispatch`` can consult it at trace time and tools can print it on
any machine.  Config fields stay plain dicts here; ``ragdot.dispatch`` turns
them into the backend's Config dataclass.

Table files (``ragdot/tables/*.json``; a directory named by the environment
variable ``RAGDOT_TABLE_DIR`` is read first, so user-tuned tables override the
shipped ones)::

  {
    "format": "ragdot-table/1",
    "device_kind": "NVIDIA H200",          # jax.devices()[0].device_kind
    "also_for": {"H100": "why"},           # kinds (whole names within theirs) reusing it
    "compute_capability": "9.0",           # of the device kind (a simulated one takes it)
    "inherits": "nvidia_h200.json",        # optional: that table's entries, under these
    "dtype_aliases": {"float16": "bfloat16"},
    "max_distance": 3.0,                    # beyond it the op default is used
    "defaults": {"bfloat16": {"gmm": {"backend": ..., "config": null}, ...}},
    "entries": {
      "gmm/bfloat16/m32768,k2048,n1536,g128": {
        "backend": "mosaic", "config": {"block_m": 64, ...},
        "measured": true, "shape": [32768, 2048, 1536, 128],
        "ms": 0.491, "tflops": 420.1, "source": "..."}
    }
  }

Dtypes: the operands' (``bfloat16``), or for fp8 weights beside 16-bit rows
(W8A16) the pair ``bfloat16+float8_e4m3fn``.
Ops: ``gmm`` (forward), ``gmm_t`` (forward with rhs ``[g, n, k]``, i.e. dX),
``tgmm`` (ragged contracting, dW).  m, k, n, g are the shapes the backend call
sees (lhs ``[m, k]``, output ``[m, n]`` or ``[g, k, n]``, g local groups).
Keys hold the shapes rounded to buckets (powers of two and 1.5x powers of two,
nearest in log2).  Lookup takes the exact bucket when present, else the entry
nearest in summed |log2| distance over (m, k, n, g) for the same op and dtype,
if within ``max_distance``; else the table's default for the op.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

FORMAT = "ragdot-table/1"
OPS = ("gmm", "gmm_t", "tgmm")
TABLE_DIR = Path(__file__).parent / "tables"
ENV_DIR = "RAGDOT_TABLE_DIR"
DEFAULT_TABLE = "default.json"  # unknown GPUs
DEFAULT_MAX_DISTANCE = 3.0


def bucket(x: int) -> int:
  """Nearest (in log2) of 2**i and 3 * 2**(i-1); 0 and 1 stay."""
  x = int(x)
  if x <= 1:
    return max(x, 0)
  lo = 1 << (x.bit_length() - 1)
  cands = (lo, 3 * lo // 2 if lo >= 2 else lo, 2 * lo)
  return min(cands, key=lambda c: (abs(math.log2(c) - math.log2(x)), c))


def key(op: str, dtype: str, m: int, k: int, n: int, g: int) -> str:
  """Table key of the bucket holding (m, k, n, g)."""
  if op not in OPS:
    raise ValueError(f"op must be one of {OPS}, got {op!r}")
  b = [bucket(v) for v in (m, k, n, g)]
  return f"{op}/{dtype}/m{b[0]},k{b[1]},n{b[2]},g{b[3]}"


def parse_key(text: str) -> tuple[str, str, tuple[int, int, int, int]]:
  op, dtype, dims = text.split("/")
  vals = dict((d[0], int(d[1:])) for d in dims.split(","))
  return op, dtype, (vals["m"], vals["k"], vals["n"], vals["g"])


def distance(a: Iterable[int], b: Iterable[int]) -> float:
  """Summed |log2| distance between two (m, k, n, g) shapes."""
  return sum(abs(math.log2(max(x, 1)) - math.log2(max(y, 1))) for x, y in zip(a, b))


@dataclasses.dataclass(frozen=True)
class Hit:
  """What a table says for one call."""

  backend: str
  config: dict[str, Any] | None  # None: the backend's default_config
  measured: bool
  table: str  # file name
  key: str | None  # matched entry key; None for the op default
  distance: float | None
  reason: str

  @property
  def config_items(self) -> tuple[tuple[str, Any], ...] | None:
    return None if self.config is None else tuple(sorted(self.config.items()))


@dataclasses.dataclass
class Table:
  name: str
  data: dict[str, Any]
  path: Path | None = None

  @property
  def device_kind(self) -> str:
    return self.data.get("device_kind", "*")

  @property
  def entries(self) -> dict[str, dict[str, Any]]:
    return self.data.setdefault("entries", {})

  def matches(self, device_kind: str) -> str | None:
    """Why this table serves ``device_kind`` (None: it does not)."""
    mine = self.device_kind
    if mine != "*" and mine.lower() == device_kind.lower():
      return f"table for {mine}"
    for sub, why in self.data.get("also_for", {}).items():
      # A whole model name, not part of one ("A100" is not in "RTX A1000", "H20"
      # not in "H200"): no letter or digit before it, no digit after it.
      if re.search(rf"(?<![a-z0-9]){re.escape(sub.lower())}(?![0-9])", device_kind.lower()):
        return f"{self.name} ({mine}) reused for {device_kind}: {why}"
    return None

  def canonical_dtype(self, dtype: str) -> str:
    """The dtype whose entries serve ``dtype`` (each part of a W8A16 pair
    ``rows+weights``, e.g. ``bfloat16+float8_e4m3fn``, on its own)."""
    aliases = self.data.get("dtype_aliases", {})
    return "+".join(aliases.get(part, part) for part in dtype.split("+"))

  def lookup(self, op: str, dtype: str, m: int, k: int, n: int, g: int) -> Hit | None:
    """The entry for one call; None when the table has nothing for the dtype."""
    dt = self.canonical_dtype(dtype)
    via = f" (as {dt})" if dt != dtype else ""
    exact = self.entries.get(key(op, dt, m, k, n, g))
    if exact is not None:
      kind = "measured" if exact.get("measured") else "unmeasured"
      return self._hit(exact, key(op, dt, m, k, n, g), 0.0,
                       f"{kind} entry for this shape bucket{via}")
    shape = (m, k, n, g)
    best = None
    for text, entry in self.entries.items():
      e_op, e_dt, _ = parse_key(text)
      if e_op != op or e_dt != dt:
        continue
      d = distance(shape, entry.get("shape") or parse_key(text)[2])
      rank = (d, not entry.get("measured", False), text)
      if best is None or rank < best[0]:
        best = (rank, text, entry)
    limit = float(self.data.get("max_distance", DEFAULT_MAX_DISTANCE))
    if best is not None and best[0][0] <= limit:
      (d, _, _), text, entry = best
      kind = "measured" if entry.get("measured") else "unmeasured"
      return self._hit(entry, text, d,
                       f"nearest {kind} bucket {text.split('/')[2]} (log2 distance {d:.2f}){via}")
    default = self.data.get("defaults", {}).get(dt, {}).get(op)
    if default is None:
      return None
    far = ("no entry within log2 distance "
           f"{limit:g}" if best is not None else "no entries") + f" for {op}/{dt}"
    return Hit(backend=default["backend"], config=default.get("config"),
               measured=False, table=self.name, key=None, distance=None,
               reason=f"{far}: table default{via}"
               + (f" ({default['note']})" if default.get("note") else ""))

  def _hit(self, entry, text, d, reason) -> Hit:
    if entry.get("borrowed"):
      reason += f" (borrowed from {entry['borrowed']})"
    return Hit(backend=entry["backend"], config=entry.get("config"),
               measured=bool(entry.get("measured", False)), table=self.name,
               key=text, distance=d, reason=reason)

  def put(self, op: str, dtype: str, m: int, k: int, n: int, g: int,
          entry: dict[str, Any]) -> str:
    """Adds or replaces the entry of the bucket holding (m, k, n, g)."""
    text = key(op, self.canonical_dtype(dtype), m, k, n, g)
    entry = dict(entry)
    entry.setdefault("shape", [int(m), int(k), int(n), int(g)])
    self.entries[text] = entry
    return text

  def dumps(self) -> str:
    data = dict(self.data)
    data["entries"] = dict(sorted(self.entries.items()))
    return json.dumps(data, indent=1) + "\n"

  def save(self, path: str | os.PathLike | None = None) -> Path:
    path = Path(path or self.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(self.dumps())
    os.replace(tmp, path)
    self.path = path
    return path


_BACKENDS = ("xla", "mosaic", "triton")  # (ragdot.backends.IMPLEMENTATIONS; no JAX here)


def _check(data: Any, where: str) -> None:
  """Raises ValueError naming ``where`` and the item unless ``data`` has a
  table's form (what dispatch reads from it cannot fail later)."""
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    got = data.get("format") if isinstance(data, dict) else type(data).__name__
    raise ValueError(f"{where}: format must be {FORMAT!r}, got {got!r}")
  for field in ("entries", "defaults", "dtype_aliases", "also_for",
                "also_for_compute_capability"):
    if not isinstance(data.get(field, {}), dict):
      raise ValueError(f"{where}: {field} must be an object")
  if not _is_number(data.get("max_distance", 0.0)):
    raise ValueError(f"{where}: max_distance must be a number")
  for text, entry in data.get("entries", {}).items():
    try:
      op, _, _ = parse_key(text)
    except (ValueError, KeyError, IndexError):
      raise ValueError(f"{where}: bad entry key {text!r} (want op/dtype/mM,kK,nN,gG)") from None
    if (op not in OPS or not isinstance(entry, dict)
        or entry.get("backend") not in _BACKENDS):
      raise ValueError(f"{where}: bad entry {text!r}: op must be one of {OPS} and backend"
                       f" one of {_BACKENDS}")
    shape = entry.get("shape")
    if shape is not None and not (isinstance(shape, list) and len(shape) == 4
                                  and all(_is_int(v) for v in shape)):
      raise ValueError(f"{where}: entry {text!r}: shape must be 4 integers [m, k, n, g]")
    _check_config(entry.get("config"), f"{where}: entry {text!r}")
  for dt, ops in data.get("defaults", {}).items():
    if not isinstance(ops, dict):
      raise ValueError(f"{where}: defaults {dt!r} must be an object")
    for op, default in ops.items():
      if op not in OPS or not isinstance(default, dict) or default.get("backend") not in _BACKENDS:
        raise ValueError(f"{where}: bad default {dt}/{op}")
      _check_config(default.get("config"), f"{where}: default {dt}/{op}")


def _check_config(config: Any, where: str) -> None:
  if config is None:
    return
  if not isinstance(config, dict):
    raise ValueError(f"{where}: config must be an object or null")
  for name, value in config.items():  # (each field's own type: dispatch.make_config)
    if not (value is None or isinstance(value, bool) or _is_number(value)):
      raise ValueError(f"{where}: config {name!r} must be a number, true/false or null, "
                       f"got {value!r}")


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def load_file(path: str | os.PathLike) -> Table:
  path = Path(path)
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not JSON: {e}") from None
  _check(data, str(path))
  return Table(name=path.name, data=data, path=path)


def table_dirs() -> list[Path]:
  dirs = []
  if os.environ.get(ENV_DIR):
    dirs.append(Path(os.environ[ENV_DIR]))
  dirs.append(TABLE_DIR)
  return dirs


@functools.cache
def _all_tables(dirs: tuple[Path, ...]) -> tuple[Table, ...]:
  layers = [{path.name: load_file(path) for path in sorted(d.glob("*.json"))}
            for d in dirs if d.is_dir()]
  out = {}
  for level, layer in enumerate(layers):
    for name, table in layer.items():
      if name not in out:  # the first directory wins
        out[name] = _with_inherited(table, level, layers)
  return tuple(out.values())


def _with_inherited(table: Table, level: int, layers: list[dict[str, Table]],
                    chain: tuple[tuple[int, str], ...] = ()) -> Table:
  """``table`` (of directory ``layers[level]``) with the entries of the table it
  ``inherits`` under its own (a table ``ragdot tune`` started for a GPU that
  borrowed another's keeps them).  A table inheriting its own name extends the
  one it shadows in a later directory (a user table started over a shipped one)."""
  parent_name = table.data.get("inherits")
  if not parent_name:
    return table
  here = chain + ((level, table.name),)
  start = level + 1 if parent_name == table.name else 0
  found = next(((j, layer[parent_name]) for j, layer in enumerate(layers[start:], start)
                if parent_name in layer), None)
  if found is None or (found[0], parent_name) in here:
    raise ValueError(f"{table.path}: inherits {parent_name!r}, which is not a table of"
                     f" {', '.join(str(d) for d in table_dirs())} (or inherits it back)")
  parent = _with_inherited(found[1], found[0], layers, here)
  # (an entry the parent borrowed in turn keeps the name of the table it came from)
  entries = {text: {**entry, "borrowed": entry.get("borrowed", parent.name)}
             for text, entry in parent.entries.items() if text not in table.entries}
  return Table(table.name, {**table.data, "entries": {**entries, **table.entries}}, table.path)


def all_tables() -> tuple[Table, ...]:
  """Every table, user directory first (cached; ``clear_cache`` to reload)."""
  return _all_tables(tuple(table_dirs()))


def clear_cache() -> None:
  _all_tables.cache_clear()
  table_for.cache_clear()


def slug(device_kind: str) -> str:
  """File name for a device kind: 'NVIDIA H200' -> 'nvidia_h200.json'."""
  s = "".join(c if c.isalnum() else "_" for c in device_kind.lower()).strip("_")
  return f"{s or 'unknown'}.json"


@functools.cache
def table_for(device_kind: str, compute_capability: str | None = None) -> tuple[Table, str]:
  """(table, why) for a GPU; unknown kinds get ``default.json``.

  Exact device kinds first, then a table's ``also_for`` substrings, then its
  ``also_for_compute_capability`` (e.g. an unlisted sm90 part).
  """
  tables = all_tables()
  for t in tables:
    if t.device_kind != "*" and t.device_kind.lower() == device_kind.lower():
      return t, f"table {t.name} for {t.device_kind}"
  for t in tables:
    why = t.matches(device_kind)
    if why:
      return t, why
  if compute_capability:
    for t in tables:
      why = t.data.get("also_for_compute_capability", {}).get(str(compute_capability))
      if why:
        return t, (f"{t.name} ({t.device_kind}) reused for {device_kind}"
                   f" (compute capability {compute_capability}): {why}")
  for t in tables:
    if t.name == DEFAULT_TABLE:
      return t, f"unknown GPU {device_kind!r}: safe default table {t.name}"
  raise FileNotFoundError(f"no table for {device_kind!r} and no {DEFAULT_TABLE}")


def lookup(device_kind: str, op: str, dtype: str, m: int, k: int, n: int,
           g: int, compute_capability: str | None = None) -> Hit | None:
  """The table entry for one call on a GPU of ``device_kind``."""
  table, why = table_for(device_kind, compute_capability)
  hit = table.lookup(op, dtype, m, k, n, g)
  if hit is None:
    return None
  return dataclasses.replace(hit, reason=f"{hit.reason}; {why}")
