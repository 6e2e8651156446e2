"""The Linear-1 activation of the fused MoE kernel (both precisions' consumers)."""
from quack.activation import tanh


def swiglu_tanh(gate, up):
    """SwiGLU with sigmoid(g) = 0.5 + 0.5 tanh(g / 2): one MUFU op (tanh.approx, abs. error ~2^-11,
    below the bf16 rounding of h) per output instead of ex2 + rcp; the consumers' L1 handoff is
    MUFU-bound (64 outputs per thread, 256 threads, 16 MUFU ops/clock/SM)."""
    half = gate * 0.5
    return (half + half * tanh(half)) * up
