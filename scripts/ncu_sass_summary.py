"""Where the warps of each Mosaic kernel stall, from an ncu source page (CSV).

  ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
  python3 scripts/ncu_sass_summary.py sass.csv [--top 25] [--chunk 64]

For every kernel whose name holds ``--kernel`` (default "mosaic"): the stall
reasons over all samples, the instructions with the most samples (with their
top two reasons), the sample share of each run of ``--chunk`` instructions
with its commonest opcodes (to tell the producer's loop, the masking, the
mainloop and the epilogue apart), and the shared-memory wavefronts per
instruction against ncu's ideal (bank conflicts).
"""

from __future__ import annotations

import argparse
import collections
import csv

_SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path: str):
  """[(kernel name, header, rows)] of an ncu ``--page source --csv`` file."""
  out = []
  for row in csv.reader(open(path)):
    if row and row[0] == "Kernel Name":
      out.append([row[1], None, []])
    elif out and out[-1][1] is None:
      out[-1][1] = row
    elif out:
      out[-1][2].append(row)
  return out


def _opcode(source: str) -> str:
  words = source.split()
  return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or [""])[0]


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("csv")
  p.add_argument("--kernel", default="mosaic")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--chunk", type=int, default=64)
  args = p.parse_args()
  for name, header, rows in kernels(args.csv):
    if args.kernel not in name:
      continue
    col = {h: i for i, h in enumerate(header)}
    val = lambda r, h: float(r[col[h]] or 0)
    total = sum(val(r, _SAMPLES) for r in rows) or 1.0
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    print(f"== {name}: {len(rows)} instructions, {total:.0f} samples")
    by_reason = collections.Counter({s: sum(val(r, s) for r in rows) for s in stalls})
    print("  reasons:", ", ".join(f"{s[6:]} {v / total:.1%}" for s, v in by_reason.most_common(8)))
    for r in sorted(rows, key=lambda r: -val(r, _SAMPLES))[:args.top]:
      top2 = sorted(stalls, key=lambda s: -val(r, s))[:2]
      print(f"  {r[col['Address']]:>16} {val(r, _SAMPLES) / total:6.1%} "
            f"{r[col['Source']][:64]:64s} " + " ".join(f"{s[6:]} {val(r, s) / total:.1%}" for s in top2))
    print("  by region:")
    for i in range(0, len(rows), args.chunk):
      part = rows[i:i + args.chunk]
      ops = collections.Counter(_opcode(r[col["Source"]]) for r in part).most_common(3)
      share = sum(val(r, _SAMPLES) for r in part) / total
      print(f"  {part[0][col['Address']]:>16} {share:6.1%} " + ", ".join(f"{o} x{n}" for o, n in ops))
    waves = [(val(r, "L1 Wavefronts Shared"), val(r, "L1 Wavefronts Shared Ideal"), r) for r in rows]
    waves = [w for w in waves if w[0] > 0]
    print(f"  shared wavefronts {sum(w[0] for w in waves):.3g}, ideal {sum(w[1] for w in waves):.3g}")
    for w, ideal, r in sorted(waves, key=lambda w: -w[0])[:10]:
      print(f"    {w:10.3g} (ideal {ideal:.3g}) {r[col['Source']][:70]}")


if __name__ == "__main__":
  main()
