"""FlashAttention-4 (SM90) fused with the Ulysses post-attention All-to-All (paper Sections 4.3, 5.3).

Entry points:
  ulysses_attention(q, k, v, world, ...)  sequence-sharded [B, S/P, H, D] in and out
  UlyssesAttention(group_or_world)        drop-in for yunchang's UlyssesAttention (a process group or a World)
  attention_a2a(...) / attention_local(...)  one rank's fused / FA-only launch
  torch.ops.fa4_a2a.attention_a2a_ / attention_local_  the same as torch custom ops
  a2a_symm(...)                           the A2A-only baseline by a symmetric-memory copy kernel
  fa4_a2a.baselines                       FA-only / A2A-only / Serial baselines (stable names)
  fa4_a2a.selfcheck.check_world(world)    every path against the fp32 reference on a live world
"""

from fa4_a2a.validate import Fa4A2AInputError
from fa4_a2a.a2a_copy import A2ACopyConfig, a2a_symm
from fa4_a2a.interface import (
    KernelConfig,
    attention_a2a,
    attention_local,
    compile_kernel,
    ulysses_peer_table,
)
from fa4_a2a.ulysses import UlyssesAttention, UlyssesWorkspace, ulysses_attention

__all__ = [
    "A2ACopyConfig",
    "a2a_symm",
    "Fa4A2AInputError",
    "KernelConfig",
    "attention_a2a",
    "attention_local",
    "compile_kernel",
    "ulysses_peer_table",
    "ulysses_attention",
    "UlyssesAttention",
    "UlyssesWorkspace",
]
