"""FlashAttention-4 (SM90) fused with the Ulysses post-attention All-to-All (paper Sections 4.3, 5.3).

Entry points:
  ulysses_attention(q, k, v, world, ...)  sequence-sharded [B, S/P, H, D] in and out
  UlyssesAttention(world)                 nn.Module mirroring yunchang's UlyssesAttention
  attention_a2a(...) / attention_local(...)  one rank's fused / FA-only launch
  torch.ops.fa4_a2a.attention_a2a_ / attention_local_  the same as torch custom ops
"""

from fa4_a2a.validate import Fa4A2AInputError
from fa4_a2a.interface import (
    KernelConfig,
    attention_a2a,
    attention_local,
    compile_kernel,
    ulysses_peer_table,
)
from fa4_a2a.ulysses import UlyssesAttention, UlyssesWorkspace, ulysses_attention

__all__ = [
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
