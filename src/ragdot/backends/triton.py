"""Pallas-Triton backend (Ampere and Hopper fallback): not implemented yet."""

from __future__ import annotations


def gmm(*args, **kwargs):
  raise NotImplementedError("the Pallas-Triton kernels are not implemented yet")


def tgmm(*args, **kwargs):
  raise NotImplementedError("the Pallas-Triton kernels are not implemented yet")
