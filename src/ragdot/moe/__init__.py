"""MoE building blocks on top of ragdot.

- ``config.MoEConfig``: static shape / routing / LoRA settings.
- ``routing``: softmax and DeepSeek-V3 (sigmoid + bias, group-limited) top-k,
  the sorted (expert[, adapter]) row layout, unsort + weighted combine.
- ``functional``: pure-function MoE MLP (params pytree in, activations out) and
  the per-token dense reference.
- ``parallel``: expert parallelism with shard_map over a mesh axis ("ep"),
  ragdot's ``group_offset`` and a psum.
- ``block``: flax NNX ``MoEMLP`` (LoRA adapters as ``LoRAParam``).
- ``bench``: block forward+backward benchmark at Qwen3-30B-A3B dimensions.

``block`` (flax) is imported lazily: ``from ragdot.moe.block import MoEMLP``.
"""

from ragdot.moe.config import MoEConfig
from ragdot.moe.functional import init_params, moe_mlp, reference_moe_mlp
from ragdot.moe.routing import Routing, deepseek_top_k, make_routing, softmax_top_k

__all__ = ["MoEConfig", "Routing", "deepseek_top_k", "init_params", "make_routing",
           "moe_mlp", "reference_moe_mlp", "softmax_top_k"]
