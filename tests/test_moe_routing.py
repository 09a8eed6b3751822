"""Routing: softmax / DeepSeek-V3 top-k properties and the sorted group layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ragdot.moe import routing as rt


def _deepseek_numpy(logits, bias, top_k, n_group, topk_group, scale, renorm):
  """Straight transcription of DeepSeek-V3's gate (per token, numpy f64)."""
  t, e = logits.shape
  scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
  experts = np.zeros((t, top_k), np.int64)
  weights = np.zeros((t, top_k))
  for i in range(t):
    choice = scores[i] + bias
    groups = choice.reshape(n_group, -1)
    gscore = np.sort(groups, axis=1)[:, -2:].sum(1)
    keep = np.argsort(-gscore, kind="stable")[:topk_group]
    masked = np.full(e, -np.inf)
    for g in keep:
      masked[g * (e // n_group):(g + 1) * (e // n_group)] = choice[g * (e // n_group):(g + 1) * (e // n_group)]
    idx = np.argsort(-masked, kind="stable")[:top_k]
    w = scores[i, idx]
    if renorm:
      w = w / w.sum()
    experts[i], weights[i] = idx, w * scale
  return weights, experts


@pytest.mark.parametrize("n_group,topk_group,renorm", [(4, 2, True), (8, 3, False)])
def test_deepseek_matches_numpy_transcription(n_group, topk_group, renorm):
  logits = np.asarray(jax.random.normal(jax.random.key(0), (64, 32)), np.float32)
  bias = np.asarray(jax.random.normal(jax.random.key(1), (32,)) * 0.3, np.float32)
  w, e = rt.deepseek_top_k(jnp.asarray(logits), 4, bias=jnp.asarray(bias), n_group=n_group,
                           topk_group=topk_group, renormalize=renorm, routed_scaling_factor=2.5)
  w_ref, e_ref = _deepseek_numpy(logits, bias.astype(np.float64), 4, n_group, topk_group, 2.5, renorm)
  np.testing.assert_array_equal(np.sort(np.asarray(e), 1), np.sort(e_ref, 1))
  order = np.argsort(np.asarray(e), 1)
  order_ref = np.argsort(e_ref, 1)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                             np.take_along_axis(w_ref, order_ref, 1), rtol=1e-5)


def test_deepseek_properties():
  t, e, k, n_group, topk_group, scale = 128, 16, 4, 4, 2, 2.5
  logits = jax.random.normal(jax.random.key(2), (t, e))
  w, ex = rt.deepseek_top_k(logits, k, n_group=n_group, topk_group=topk_group,
                            routed_scaling_factor=scale)
  ex = np.asarray(ex)
  # renormalised weights sum to the routed scaling factor; experts are distinct
  np.testing.assert_allclose(np.asarray(w).sum(-1), scale, rtol=1e-5)
  assert all(len(set(row)) == k for row in ex)
  # experts come from at most topk_group groups
  assert max(len(set(row // (e // n_group))) for row in ex) <= topk_group
  # the bias changes the choice but not the weights: a huge bias forces expert 5 in,
  # and its weight is its plain sigmoid score (before renormalisation).
  bias = jnp.zeros(e).at[5].set(100.0)
  w_b, ex_b = rt.deepseek_top_k(logits, k, bias=bias, n_group=n_group, topk_group=topk_group,
                                renormalize=False)
  assert np.all(np.any(np.asarray(ex_b) == 5, axis=1))
  sig = jax.nn.sigmoid(logits)
  np.testing.assert_allclose(np.asarray(w_b), np.take_along_axis(np.asarray(sig), np.asarray(ex_b), 1),
                             rtol=1e-6)
  # gradients reach the logits through the weights; none reach the bias
  g_logits, g_bias = jax.grad(lambda l, b: jnp.sum(rt.deepseek_top_k(
      l, k, bias=b, n_group=n_group, topk_group=topk_group)[0] ** 2), argnums=(0, 1))(logits, bias)
  assert float(jnp.abs(g_logits).sum()) > 0 and float(jnp.abs(g_bias).sum()) == 0


def test_deepseek_rejects_bad_groups():
  with pytest.raises(ValueError):
    rt.deepseek_top_k(jnp.zeros((2, 10)), 2, n_group=3, topk_group=1)
  with pytest.raises(ValueError):
    rt.deepseek_top_k(jnp.zeros((2, 8)), 4, n_group=4, topk_group=1)
  with pytest.raises(ValueError, match="n_group"):  # (not a ZeroDivisionError)
    rt.deepseek_top_k(jnp.zeros((2, 8)), 2, n_group=0)
  for top_k in (0, 9):
    for fn in (rt.deepseek_top_k, rt.softmax_top_k):
      with pytest.raises(ValueError, match="top_k"):
        fn(jnp.zeros((2, 8)), top_k)


def test_softmax_top_k_and_layout_with_adapters():
  t, e, k, a = 50, 8, 2, 3
  logits = jax.random.normal(jax.random.key(3), (t, e))
  w, ex = rt.softmax_top_k(logits, k)
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
  ids = jax.random.randint(jax.random.key(4), (t,), 0, a)
  r = rt.make_routing(w, ex, e, adapter_ids=ids, num_adapters=a)
  gs = np.asarray(r.group_sizes)
  assert gs.shape == (e * a,) and gs.sum() == t * k
  groups = groups_of(ex, ids, a).reshape(-1)[np.asarray(r.order)]
  assert np.all(np.diff(groups) >= 0)  # sorted by (expert, adapter) => by expert too
  np.testing.assert_array_equal(np.bincount(groups, minlength=e * a), gs)
  np.testing.assert_array_equal(np.asarray(rt.expert_group_sizes(r, e)),
                                np.bincount(np.asarray(ex).reshape(-1), minlength=e))
  # sort then combine with unit weights returns k copies summed
  x = jax.random.normal(jax.random.key(5), (t, 4))
  r1 = rt.make_routing(jnp.ones((t, k)), ex, e)
  np.testing.assert_allclose(np.asarray(rt.combine(rt.sort_tokens(x, r1, k), r1, k)),
                             k * np.asarray(x), rtol=1e-6)
  # bf16 rows, f32 sum kept in f32 (expert parallelism psums these partials)
  xb = x.astype(jnp.bfloat16)
  y32 = rt.combine(rt.sort_tokens(xb, r1, k), r1, k, out_dtype=jnp.float32)
  assert y32.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y32), k * np.asarray(xb, np.float32))
  # a slice of the tokens (a data-parallel shard's) regrouped from the per-token
  # fields lays out like routing the slice alone, with its adapters
  np.testing.assert_array_equal(np.asarray(r.groups), groups_of(ex, ids, a))
  part = rt.regroup(rt.Assignment(r.weights[20:], r.experts[20:], r.groups[20:], r.num_groups))
  alone = rt.make_routing(w[20:], ex[20:], e, adapter_ids=ids[20:], num_adapters=a)
  jax.tree.map(np.testing.assert_array_equal, part, alone)
  assert int(part.group_sizes.sum()) == (t - 20) * k


def groups_of(experts, adapter_ids, num_adapters):
  return np.asarray(experts) * num_adapters + np.asarray(adapter_ids)[:, None]


def test_routing_is_jittable_without_host_sync():
  f = jax.jit(lambda l: rt.make_routing(*rt.deepseek_top_k(l, 2, n_group=2, topk_group=1), 8))
  r = f(jnp.ones((4, 8)))
  assert int(r.group_sizes.sum()) == 8


@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_layout_gradients_match_plain_autodiff(tokens):
  """sort_tokens / combine have gather-only VJPs; they must equal autodiff of
  the plain gather / scatter formulation."""
  e, k, d = 6, 3, 5
  key = jax.random.key(tokens)
  logits = jax.random.normal(key, (tokens, e))
  r = rt.top_k_routing(logits, k)
  x = jax.random.normal(jax.random.key(1), (tokens, d))
  c = jax.random.normal(jax.random.key(2), (tokens, d))

  def ours(x):
    return jnp.sum(rt.combine(rt.sort_tokens(x, r, k) * 1.5, r, k) * c)

  def plain(x):
    xs = x[r.order // k]
    y = jnp.zeros_like(xs).at[r.order].set(xs * 1.5).reshape(tokens, k, d)
    return jnp.sum(jnp.einsum("tkd,tk->td", y, r.weights) * c)

  np.testing.assert_allclose(ours(x), plain(x), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(plain)(x), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(r.position[r.order], np.arange(tokens * k))


def test_sort_tokens_gradient_with_trailing_dims():
  r = rt.top_k_routing(jax.random.normal(jax.random.key(3), (5, 4)), 2)
  x = jax.random.normal(jax.random.key(4), (5, 2, 3))
  got = jax.grad(lambda x: jnp.sum(rt.sort_tokens(x, r, 2) ** 2))(x)
  want = jax.grad(lambda x: jnp.sum(x[r.order // 2] ** 2))(x)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_layout_under_vmap_is_one_gather_and_keeps_gather_only_gradients():
  """vmap of sort_tokens / combine (a batch of sequences, each with its own
  routing) equals the per-sequence calls, value, gradient and JVP; the batch is
  one gather on the concatenated layouts, so its gradient has no scatter-add
  (a plain batched gather would scatter-add the cotangent)."""
  e, k, d, t = 6, 2, 5, 7
  logits = jax.random.normal(jax.random.key(5), (3, t, e))
  xs = jax.random.normal(jax.random.key(6), (3, t, d))
  c = jax.random.normal(jax.random.key(7), (3, t, d))

  def one(x, logits, c):
    r = rt.top_k_routing(logits, k)
    return jnp.sum(rt.combine(rt.sort_tokens(x, r, k) * 1.5, r, k) * c)

  batched = lambda xs: jnp.sum(jax.vmap(one)(xs, logits, c))
  per_seq = lambda xs: sum(one(xs[b], logits[b], c[b]) for b in range(3))
  np.testing.assert_allclose(batched(xs), per_seq(xs), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(batched)(xs), jax.grad(per_seq)(xs), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(jax.jvp(batched, (xs,), (c,))[1], jax.jvp(per_seq, (xs,), (c,))[1],
                             rtol=1e-5)
  jaxpr = jax.make_jaxpr(jax.grad(lambda xs: batched(xs)))(xs)
  scatters = [e_ for e_ in jaxpr.eqns if e_.primitive.name == "scatter-add"
              and jnp.issubdtype(e_.outvars[0].aval.dtype, jnp.floating)]
  assert not scatters, scatters


def test_layout_keeps_a_weak_type_under_jit_as_eagerly():
  """A weakly typed input stays weak through sort_tokens traced as eagerly (so
  weak f32 times bf16 is bf16 in both)."""
  r = rt.top_k_routing(jax.random.normal(jax.random.key(0), (8, 4)), 2)
  weak = jnp.full((8, 4), 2.0)
  f = lambda x: rt.sort_tokens(x, r, 2) * jnp.ones((16, 4), jnp.bfloat16)
  assert f(weak).dtype == jax.jit(f)(weak).dtype == jnp.bfloat16
