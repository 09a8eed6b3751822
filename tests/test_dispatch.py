"""Dispatch rules: explicit names honoured, automatic choice safe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from ragdot import dispatch


def test_explicit_implementation_is_honoured_in_interpret_mode_without_gpu():
  choice = dispatch.choose("gmm", "mosaic", dtype=jnp.bfloat16)
  assert choice.implementation == "mosaic" and not choice.automatic
  assert choice.interpret == (jax.default_backend() != "gpu")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_automatic_choice_on_cpu_is_xla(dtype):
  if jax.default_backend() == "gpu":
    pytest.fail("CPU test run on a GPU machine")
  assert dispatch.choose("gmm", None, dtype=dtype).implementation == "xla"


def test_non_default_precision_is_recognised():
  assert dispatch._default_precision(None)
  assert dispatch._default_precision(jax.lax.Precision.DEFAULT)
  assert not dispatch._default_precision(jax.lax.Precision.HIGHEST)
  assert not dispatch._default_precision((jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST))
