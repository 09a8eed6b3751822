"""How fast can every SM pull TMA loads into SMEM? (GPU machine; a probe)

  python3 scripts/probe_l2_ingress.py [--steps 4000] [--stages 2 3 4 5] [--sm-counts 132 66]
      [--json OUT]

The dW ring's profile (docs/performance.md v70, 69d) showed each SM receiving
~33 B a cycle of loads whether 2 or 3 of its 40 KB slots were in flight: the
latency grew with the slots.  This asks what the hardware gives with nothing
else running: one warpgroup per SM (a persistent grid of one CTA per SM) keeps
``stages`` slots of TMA loads in flight, the dW ring's step (a 64 x 128 and a
64 x 192 bf16 box, 40 KB, 128-byte swizzle), and re-issues each slot as soon as
its loads land.  No math and no stores.  Every CTA allocates 5 slots (200 KB)
whatever ``stages`` it uses, so no two CTAs share an SM.

Sources: ``l2``, 64 blocks (2.6 MB) that every SM cycles through, so L2 serves
them; ``hbm``, a 2.7 GB array whose blocks are each read 8 times (fewer with
``--sm-counts`` below the device's), 2.7 GB of loads apart (so never from L2).  Prints the loads' rate over all SMs (TB/s) and
per SM per cycle at the median SM clock nvidia-smi sampled while the timed
calls ran.  If the l2 rate at 3-5 stages is well above the dW ring's (~6.5 TB/s
of loads on the H100: 2.7 GB in 0.41 ms), its limit is not the SMs' intake; if
near it, a 128 x 192 tile cannot be fed faster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ragdot import timing
from ragdot.backends import sm90

_ROWS, _COLS_A, _COLS_B = 64, 128, 192  # the dW ring's step: lhs and rhs row blocks
_STEP_BYTES = _ROWS * (_COLS_A + _COLS_B) * 2
_SLOTS = 5  # allocated per CTA: 200 KB, so one CTA per SM at any ``stages``


def ingress_kernel(num_blocks: int, steps: int, stages: int, num_sms: int, *,
                   stream: bool, interpret=False):
  """A jitted ``(a [num_blocks * 64, 128], b [num_blocks * 64, 192]) -> out`` that
  loads ``steps`` row blocks of both per SM through ``stages`` slots.  ``stream``:
  SM s reads blocks s, s + num_sms, ... (each once when num_blocks >= steps *
  num_sms); else blocks (7 s + t) % num_blocks, shared by all SMs."""
  dtype = jnp.bfloat16

  def body(a_gmem, b_gmem, out_gmem, a_smem, b_smem, landed):
    sm = lax.axis_index("sm")

    def issue(t, slot):
      blk = (sm + t * num_sms) % num_blocks if stream else (7 * sm + t) % num_blocks
      rows = pl.ds(blk * _ROWS, _ROWS)
      plgpu.copy_gmem_to_smem(a_gmem.at[rows], a_smem.at[slot], landed.at[slot])
      plgpu.copy_gmem_to_smem(b_gmem.at[rows], b_smem.at[slot], landed.at[slot])

    for s in range(min(stages, steps)):
      issue(s, s)

    @pl.loop(0, steps)
    def _step(t):
      slot = lax.rem(t, stages)
      plgpu.barrier_wait(landed.at[slot])
      pl.when(t + stages < steps)(lambda: issue(t + stages, slot))

    # Something of what landed leaves, so nothing above is dead.
    plgpu.copy_smem_to_gmem(a_smem.at[lax.rem(steps - 1, stages)], out_gmem.at[sm])
    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_sms, _ROWS, _COLS_A), dtype),
      scratch_types=[
          plgpu.SMEM((max(stages, _SLOTS), _ROWS, _COLS_A), dtype,
                     transforms=sm90.swizzled(_COLS_A, dtype)),
          plgpu.SMEM((max(stages, _SLOTS), _ROWS, _COLS_B), dtype,
                     transforms=sm90.swizzled(_COLS_B, dtype)),
          plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      ],
      grid=(num_sms,), grid_names=("sm",),
      compiler_params=sm90.compiler_params(interpret),
      interpret=plgpu.InterpretGPUParams() if interpret is True else (interpret or None))
  return jax.jit(kernel)


def _timed_with_clock(fn, *args) -> tuple[float, str, float | None]:
  """``timing.device_time_ms(fn, *args)`` and the median SM clock (MHz) that
  nvidia-smi sampled every 20 ms meanwhile (None without nvidia-smi)."""
  jax.block_until_ready(fn(*args))  # compiled before the clock is sampled
  try:
    sampler = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-lms", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  except OSError:
    sampler = None
  ms, method = timing.device_time_ms(fn, *args, iterations=10, warmup_s=0.3)
  if sampler is None:
    return ms, method, None
  sampler.terminate()
  text, _ = sampler.communicate()
  mhz = sorted(float(v) for v in text.split() if v.replace(".", "", 1).isdigit())
  return ms, method, (mhz[len(mhz) // 2] if mhz else None)


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=4000, help="40 KB steps per SM")
  p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 5])
  p.add_argument("--sources", nargs="+", default=["l2", "hbm"], choices=["l2", "hbm"])
  p.add_argument("--sm-counts", type=int, nargs="+", default=None,
                 help="CTAs (one an SM, 1 to the device's SMs) to run with, e.g. all and"
                      " half: an l2 intake that rises per SM with fewer SMs is capped by L2"
                      " (an hbm one, by HBM), not by the SM")
  p.add_argument("--json", default=None)
  args = p.parse_args()
  device_sms = sm90.device_sm_count()
  if any(not 1 <= c <= device_sms for c in args.sm_counts or []):
    p.error(f"--sm-counts must be 1 to {device_sms} (more CTAs than SMs run in waves)")
  rows = []
  for source in args.sources:
    num_blocks = 64 if source == "l2" else args.steps * device_sms // 8  # hbm: 1/8 of the steps
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (num_blocks * _ROWS, _COLS_A), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (num_blocks * _ROWS, _COLS_B), jnp.float32).astype(jnp.bfloat16)
    # hbm: all SMs together read the array 8 times over (8 x num_sms / device_sms
    # with fewer SMs); 2.7 GB of loads pass between two reads of a block, so none
    # is still in the 50 MB L2.
    for num_sms, stages in itertools.product(args.sm_counts or [device_sms], args.stages):
      fn = ingress_kernel(num_blocks, args.steps, stages, num_sms, stream=source == "hbm")
      ms, method, mhz = _timed_with_clock(fn, a, b)
      total = num_sms * args.steps * _STEP_BYTES
      tbps = total / (ms * 1e-3) / 1e12
      per_cycle = total / num_sms / (ms * 1e-3 * mhz * 1e6) if mhz else float("nan")
      rows.append(dict(source=source, stages=stages, num_sms=num_sms, ms=ms, tbps=tbps, sm_mhz=mhz,
                       bytes_per_sm_cycle=per_cycle, method=method, steps=args.steps,
                       device=jax.devices()[0].device_kind))
      print(f"{source:3s} {num_sms:3d} SMs, {stages} stages of 40 KB: {ms:.4f} ms  {tbps:5.2f} TB/s  "
            f"{per_cycle:5.1f} B / SM cycle (SM {mhz} MHz)", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
