"""The demo's flag checks (usage errors before any work) and its verdicts: a
failed one-step check stops it before training; a run whose loss does not fall
fails on that, not on the check."""

from __future__ import annotations

import pytest

from ragdot import demo

TINY = ["--steps", "3", "--layers", "1", "--hidden", "16", "--intermediate", "16",
        "--experts", "8", "--batch", "4", "--seq", "8", "--vocab", "8"]


@pytest.mark.parametrize("flags, names", [
    (["--steps", "0"], "--steps"),
    (["--batch", "-1"], "--batch"),
    (["--hidden", "0"], "--hidden"),
    (["--layers", "0"], "--layers"),
    (["--lr", "0"], "--lr"),
    (["--dp", "-1"], "--dp"),
    (["--dp", "3"], "--dp"),
    (["--top-k", "20"], "--top-k"),
    (["--routing", "deepseek", "--experts", "6"], "--experts"),
    (["--vocab", "2"], "--branching"),
])
def test_bad_flags_are_usage_errors(flags, names, capsys):
  with pytest.raises(SystemExit) as e:
    demo.main(flags)
  assert e.value.code == 2
  assert names in capsys.readouterr().err


def test_a_failed_check_stops_before_training(monkeypatch, capsys):
  monkeypatch.setattr(demo, "check_step",
                      lambda *a, **k: (False, {"ep1": (0.0, 1.5, 2e-2), "dense": (0.0, 0.0, 1e-4)}))
  with pytest.raises(SystemExit) as e:
    demo.main(TINY)
  assert e.value.code == 1
  out = capsys.readouterr().out
  assert "check vs one shard and dense reference FAILED" in out and "  step " not in out


def test_a_short_run_passes_its_check_and_fails_on_the_loss(capsys):
  """Three steps cannot lower the loss by 0.5: the verdict says so, and that
  the check passed (on 8 CPU devices: dp=2 x ep=4)."""
  with pytest.raises(SystemExit) as e:
    demo.main(TINY)
  assert e.value.code == 1
  out = capsys.readouterr().out
  assert "dp=2 x ep=4" in out and "did NOT fall" in out
  assert "check vs one shard and dense reference passed" in out and out.rstrip().endswith("FAIL")
