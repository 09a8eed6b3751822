"""MoE building blocks on top of ragdot (routing; the NNX block lands here)."""
