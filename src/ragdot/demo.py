"""End-to-end example (`make demo`): train a small MoE language model with
data and expert parallelism over every device (8 simulated CPU devices when
there is no GPU: the batch split 2 ways over mesh axis "dp", the experts 4 ways
over "ep"), built from ragdot's flax NNX ``MoEMLP``.

Model: token embedding -> N x [RMSNorm -> causal token-shift mixing (attention-
free: the previous two tokens' features) -> RMSNorm -> MoEMLP] -> RMSNorm -> LM head.
Data: a fixed random order-2 Markov chain over a small vocabulary, so the loss
falls from ln(V) towards the chain's entropy rate (printed as the floor).
The expert ragged_dots run in bf16 under ``jax.shard_map`` over mesh axes "dp"
(each device's slice of the tokens) and "ep" (its experts, through ragdot's
native ``group_offset``); master weights are f32 (optax AdamW).

Before training, one step (loss and every gradient) is checked against
(a) the same model on one shard (no shard_map) and (b) the per-token dense f32
reference of the MoE layers.  Ends with one line starting ``demo:``; exits
non-zero when the check fails.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # Only affects the CPU platform: a GPU machine keeps its GPUs.
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ragdot import argtypes  # noqa: E402
from ragdot.moe.block import MoEMLP, shard_moe_state  # noqa: E402
from ragdot.moe.config import MoEConfig  # noqa: E402

_SAME = object()


# --- model -----------------------------------------------------------------------


class TokenShift(nnx.Module):
  """Causal, attention-free token mixing: ``[x_t, x_{t-1}, x_{t-2}] @ W``."""

  def __init__(self, d: int, *, rngs: nnx.Rngs, shifts: int = 2):
    self.shifts = shifts
    self.proj = nnx.Linear((shifts + 1) * d, d, use_bias=False, rngs=rngs)

  def __call__(self, x):  # x[b, s, d]
    parts = [x]
    for s in range(1, self.shifts + 1):
      parts.append(jnp.pad(x, ((0, 0), (s, 0), (0, 0)))[:, :-s])
    return self.proj(jnp.concatenate(parts, axis=-1))


class Block(nnx.Module):

  def __init__(self, d: int, cfg: MoEConfig, *, rngs: nnx.Rngs, moe_dtype: Any, mesh: Any):
    self.norm1 = nnx.RMSNorm(d, rngs=rngs)
    self.mix = TokenShift(d, rngs=rngs)
    self.norm2 = nnx.RMSNorm(d, rngs=rngs)
    self.moe = MoEMLP(cfg, rngs=rngs, param_dtype=jnp.float32, dtype=moe_dtype, mesh=mesh)

  def __call__(self, x, *, mesh=_SAME, reference=False):
    x = x + self.mix(self.norm1(x))
    kwargs = {} if mesh is _SAME else {"mesh": mesh}
    return x + self.moe(self.norm2(x), reference=reference, **kwargs)


class MoELM(nnx.Module):

  def __init__(self, vocab: int, d: int, layers: int, cfg: MoEConfig, *, rngs: nnx.Rngs,
               moe_dtype: Any = jnp.bfloat16, mesh: Any = None):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, cfg, rngs=rngs, moe_dtype=moe_dtype, mesh=mesh)
                            for _ in range(layers)])
    self.norm = nnx.RMSNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens, *, mesh=_SAME, reference=False):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, mesh=mesh, reference=reference)
    return self.head(self.norm(x))


def lm_loss(model: MoELM, tokens: jax.Array, **kwargs) -> jax.Array:
  logits = model(tokens[:, :-1], **kwargs).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# --- data ------------------------------------------------------------------------


def markov_chain(vocab: int, branching: int, seed: int = 0):
  """Order-2 chain: each context (a, b) has ``branching`` successors with random
  probabilities.  Returns (successors[V, V, B], probs[V, V, B], entropy rate)."""
  rng = np.random.default_rng(seed)
  succ = np.stack([np.stack([rng.choice(vocab, branching, replace=False) for _ in range(vocab)])
                   for _ in range(vocab)])
  probs = rng.dirichlet(np.full(branching, 1.0), size=(vocab, vocab))
  entropy = float(-(probs * np.log(probs)).sum(-1).mean())  # uniform over contexts (approx.)
  return succ, probs, entropy


def sample_batches(succ, probs, steps: int, batch: int, seq: int, seed: int = 1) -> np.ndarray:
  rng = np.random.default_rng(seed)
  vocab, _, branching = succ.shape
  n = steps * batch
  out = np.empty((n, seq + 1), np.int32)
  out[:, :2] = rng.integers(0, vocab, (n, 2))
  cum = probs.cumsum(-1)
  for t in range(2, seq + 1):
    a, b = out[:, t - 2], out[:, t - 1]
    pick = (rng.random(n)[:, None] > cum[a, b]).sum(-1).clip(0, branching - 1)
    out[:, t] = succ[a, b, pick]
  return out.reshape(steps, batch, seq + 1)


# --- check -----------------------------------------------------------------------


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_step(graphdef, graphdef_f32, params, rest, tokens) -> tuple[bool, dict]:
  """Loss and gradients on the mesh vs one shard and vs the per-token dense reference."""

  def grads_of(gd, **kwargs):
    def loss_fn(p):
      return lm_loss(nnx.merge(gd, p, rest), tokens, **kwargs)
    return jax.jit(jax.value_and_grad(loss_fn))(params)

  results = {}
  # (a) training precision (bf16 experts): the (dp, ep) mesh vs one shard.
  l_ep, g_ep = grads_of(graphdef)
  l_one, g_one = grads_of(graphdef, mesh=None)
  # (b) f32 experts: the (dp, ep) mesh vs per-token dense f32 reference.
  with jax.default_matmul_precision("highest"):
    l_ep32, g_ep32 = grads_of(graphdef_f32)
    l_ref, g_ref = grads_of(graphdef_f32, reference=True)

  def worst(g, r):
    errs = jax.tree.leaves(jax.tree.map(rel_err, g, r))
    return max(errs)

  results["ep1"] = (abs(float(l_ep) - float(l_one)) / abs(float(l_one)), worst(g_ep, g_one), 2e-2)
  results["dense"] = (abs(float(l_ep32) - float(l_ref)) / abs(float(l_ref)), worst(g_ep32, g_ref), 1e-4)
  ok = all(math.isfinite(lv) and math.isfinite(gv) and lv <= tol and gv <= tol
           for lv, gv, tol in results.values())
  return ok, results


# --- main ------------------------------------------------------------------------


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  pos = argtypes.positive_int
  parser.add_argument("--steps", type=pos, default=300)
  parser.add_argument("--batch", type=pos, default=16, help="sequences a step")
  parser.add_argument("--seq", type=pos, default=64, help="tokens a sequence")
  parser.add_argument("--vocab", type=pos, default=32)
  parser.add_argument("--branching", type=pos, default=3,
                      help="successors of each token in the Markov chain the data follows")
  parser.add_argument("--hidden", type=pos, default=64)
  parser.add_argument("--intermediate", type=pos, default=64)
  parser.add_argument("--experts", type=pos, default=16)
  parser.add_argument("--top-k", type=pos, default=2)
  parser.add_argument("--layers", type=pos, default=2, help="MoE layers")
  parser.add_argument("--lr", type=argtypes.positive_float, default=3e-3, help="peak rate")
  parser.add_argument("--routing", choices=("softmax", "deepseek"), default="softmax",
                      help="softmax top-k (Qwen3, Mixtral) or DeepSeek-V3's sigmoid top-k,"
                           " here over 4 expert groups of which a token may use 2")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dp", type=argtypes.nonnegative_int, default=0,
                      help="data-parallel ways: the batch is split over mesh axis \"dp\", the"
                           " experts over \"ep\" (the other devices); 0: 2 where 4 or more"
                           " devices divide by 2, else 1")
  args = parser.parse_args(argv)
  if args.branching > args.vocab:
    parser.error(f"--branching {args.branching} must be at most --vocab {args.vocab}")
  try:
    cfg = MoEConfig(hidden=args.hidden, intermediate=args.intermediate,
                    num_experts=args.experts, top_k=args.top_k, scoring=args.routing,
                    n_group=4 if args.routing == "deepseek" else 1,
                    topk_group=2 if args.routing == "deepseek" else 1)
  except (TypeError, ValueError) as e:
    parser.error(f"--experts / --top-k / --routing: {e}")
  t0 = time.perf_counter()

  devices = jax.devices()
  dp = args.dp or (2 if len(devices) >= 4 and len(devices) % 2 == 0 and args.batch % 2 == 0
                   else 1)
  if len(devices) % dp or args.batch % dp:
    parser.error(f"--dp {dp} must divide the {len(devices)} devices and --batch {args.batch}")
  ep = len(devices) // dp
  while args.experts % ep:
    ep -= 1
  if dp * ep < len(devices):
    print(f"note: ep={len(devices) // dp} does not divide --experts {args.experts}: ep={ep},"
          f" {len(devices) - dp * ep} of the {len(devices)} devices idle")
  mesh = jax.make_mesh((dp, ep), ("dp", "ep"), devices=devices[:dp * ep],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  batches = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
  platform = devices[0].platform
  make = lambda dtype: MoELM(args.vocab, args.hidden, args.layers, cfg,
                             rngs=nnx.Rngs(args.seed), moe_dtype=dtype, mesh=mesh)
  model = make(jnp.bfloat16)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  graphdef_f32 = nnx.split(make(jnp.float32), nnx.Param, ...)[0]
  params = shard_moe_state(params, mesh)
  rest = shard_moe_state(rest, mesh)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"ragdot demo: MoE LM, {args.layers} layers, hidden {args.hidden}, {args.experts} experts"
        f" top-{args.top_k} ({args.routing} routing), {n_params / 1e6:.2f} M params;"
        f" dp={dp} x ep={ep} over {dp * ep} {platform} device(s)")

  succ, probs, entropy = markov_chain(args.vocab, args.branching, args.seed)
  data = sample_batches(succ, probs, args.steps, args.batch, args.seq, args.seed + 1)
  data = [jax.device_put(d, batches) for d in data]
  tokens_per_step = args.batch * args.seq

  # One step checked against ep=1 and the per-token dense reference.
  ok, results = check_step(graphdef, graphdef_f32, params, rest, data[0])
  for name, (lerr, gerr, tol) in results.items():
    what = {"ep1": f"dp={dp} x ep={ep} vs one shard (bf16 experts)",
            "dense": f"dp={dp} x ep={ep} vs per-token dense f32 reference (f32 experts)"}[name]
    print(f"  check {what}: loss rel err {lerr:.1e}, worst grad rel err {gerr:.1e} (tol {tol:.0e})")
  worst = max(max(lv, gv) for lv, gv, _ in results.values())
  if not ok:  # a wrong step trains a wrong model (whose loss may fall all the same)
    print(f"demo: one-step check vs one shard and dense reference FAILED (worst rel err"
          f" {worst:.1e}) -> FAIL")
    raise SystemExit(1)

  warmup = min(20, args.steps // 4)
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps,
                                                      args.lr / 10), weight_decay=0.01)
  opt_state = tx.init(params)
  # Pin the state's shardings so the step compiles once (expert leaves over "ep").
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  opt_state = jax.tree.map(
      lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding)
      else jax.device_put(x, replicated), opt_state)
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)

  @jax.jit(out_shardings=(shardings(params), shardings(opt_state), replicated))
  def train_step(params, opt_state, rest, tokens):
    def loss_fn(p):
      return lm_loss(nnx.merge(graphdef, p, rest), tokens)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  first_loss = None
  timed_tokens, timed_s = 0, 0.0
  bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True,
             bar_format="{l_bar}{bar:20}{r_bar}", mininterval=0.5)
  for step in bar:
    start = time.perf_counter()
    params, opt_state, loss = train_step(params, opt_state, rest, data[step])
    loss = float(loss)  # syncs: per-step timing below is honest
    dt = time.perf_counter() - start
    if step > 0:  # step 0 includes compilation
      timed_tokens += tokens_per_step
      timed_s += dt
    losses.append(loss)
    first_loss = loss if first_loss is None else first_loss
    if step % 10 == 0 or step == args.steps - 1:
      tps = timed_tokens / timed_s if timed_s else 0.0
      bar.set_postfix_str(f"loss {np.mean(losses[-10:]):.3f} tok/s {tps:,.0f}")
    if step % 50 == 0 or step == args.steps - 1:
      tqdm.write(f"  step {step:4d}  loss {np.mean(losses[-10:]):.4f}")
  bar.close()

  final = float(np.mean(losses[-10:]))
  tps = timed_tokens / max(timed_s, 1e-9)
  learned = math.isfinite(final) and final < first_loss - 0.5
  elapsed = time.perf_counter() - t0
  print(f"  loss {first_loss:.3f} -> {final:.3f} (ln V = {math.log(args.vocab):.3f},"
        f" chain entropy floor ~{entropy:.3f}); {tps:,.0f} tokens/s; {elapsed:.0f} s total")
  print(f"demo: {dp * ep} {platform} device(s), dp={dp} x ep={ep}, {args.experts} experts"
        f" top-{args.top_k},"
        f" {args.steps} steps, loss {first_loss:.2f} -> {final:.2f} (floor ~{entropy:.2f};"
        f" {'fell' if learned else 'did NOT fall'} by 0.5), {tps:,.0f} tok/s, one-step check"
        f" vs one shard and dense reference passed (worst rel err {worst:.1e})"
        f" -> {'PASS' if learned else 'FAIL'}")
  if not learned:
    raise SystemExit(1)


if __name__ == "__main__":
  main()
