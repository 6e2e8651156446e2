"""xDiT (xfuser) Ulysses attention through the fused kernel.

    import xfuser                                   # and its distributed set-up, as usual
    from fa4_a2a.integrations import xfuser as fa4_xfuser
    hook = fa4_xfuser.enable()                      # once per process
    ...                                             # xfuser's pipelines, unchanged
    hook.disable()                                  # optional: xfuser's own USP again

xfuser 0.7 does the Ulysses All-to-Alls in its ``USP`` function
(``xfuser.model_executor.layers.usp``), outside the attention function that its
``register_attention_function`` registry selects, so a registered backend cannot fuse the
post-attention A2A. :func:`enable` therefore replaces ``USP`` in that module and in every loaded
xfuser module that imported it by name (the attention processors, some transformers and
pipelines). Each call whose parallel layout is Ulysses degree > 1 with ring degree 1 runs as
:func:`fa4_a2a.ulysses_attention` on xfuser's Ulysses process group: the pre-attention A2A, then
FlashAttention-4 with the post-attention A2A fused. Every other call goes to xfuser's own USP,
with the reason logged once (:func:`unsupported_reason` lists them): ring attention, joint
tensors, attention_kwargs (padding, extra inputs), GQA repetition, dropout, FP8 communication,
head balancing, a PipeFusion KV cache, a non-exact attention backend (FP8 / FP4 / sparse / Sage),
another head_dim or dtype, no Hopper GPU.

xfuser's USP takes and returns [B, H, S_local, D]; the fused path transposes to the kernel's
[B, S_local, H, D] and back and returns a new tensor, as xfuser's USP does (the kernel's output is
a reused workspace). Tested against xfuser 0.7.0 (the ``dit`` extra): signature, selection and
the patching on the CPU; :func:`fused_usp` on an H200 (one-rank group, against SDPA and fp32).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from fa4_a2a.integrations._common import kernel_reason, on_hopper as _on_hopper
from fa4_a2a.ulysses import ulysses_attention, world_for_group

USP_MODULE = "xfuser.model_executor.layers.usp"
TESTED_VERSION = "0.7.0"
# xfuser AttentionBackendType names that compute exact softmax attention (what the fused FA4
# kernel computes); the others are quantized, sparse or other hardware and are left to xfuser.
EXACT_BACKENDS = ("SDPA", "SDPA_MATH", "SDPA_EFFICIENT", "SDPA_FLASH", "FLASH", "CUDNN", "FLASH_3", "FLASH_4",
                  "AITER", "AITER_BF16")

logger = logging.getLogger(__name__)
_logged: set = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("fa4_a2a xfuser hook: %s; using xfuser's USP", message)


@dataclass(frozen=True)
class UspCall:
    """What :func:`unsupported_reason` needs to know about one USP call (no xfuser import)."""

    ulysses_degree: int
    ring_degree: int
    backend: Optional[str] = None  # AttentionBackendType name
    dropout_p: float = 0.0
    joint_strategy: Optional[str] = None
    attention_kwargs: bool = False  # any attention_kwargs given
    kv_head_repeat: int = 1
    fp8_comms: bool = False
    head_balance: bool = False
    kv_cache: bool = False


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: UspCall,
                       on_hopper: Optional[bool] = None) -> Optional[str]:
    """Why the fused path cannot take this USP call (None: it can). ``query`` etc. are xfuser's
    [B, H, S_local, D]; ``on_hopper`` defaults to the query's device."""
    if call.ulysses_degree <= 1:
        return "no Ulysses parallelism (ulysses_degree 1)"
    if call.ring_degree > 1:
        return "ring attention (ring_degree > 1)"
    if call.joint_strategy:
        return "joint tensors (joint_strategy)"
    if call.attention_kwargs:
        return "attention_kwargs (padding, extra Ulysses inputs)"
    if call.kv_head_repeat != 1:
        return "grouped-query attention (kv_head_repeat > 1)"
    if call.dropout_p:
        return "dropout is not supported"
    if call.fp8_comms:
        return "FP8 communication (use_fp8_comms)"
    if call.head_balance:
        return "head balancing (use_spargeattn_head_balance)"
    if call.kv_cache:
        return "a PipeFusion KV cache"
    if call.backend is not None and call.backend not in EXACT_BACKENDS:
        return f"attention backend {call.backend} (not exact softmax attention)"
    if query.dim() != 4 or key.shape != query.shape or value.shape != query.shape:
        return "query, key and value of different shapes"
    reason = kernel_reason(query, key, value, on_hopper if on_hopper is not None else _on_hopper(query))
    if reason is not None:
        return reason
    if query.shape[1] % call.ulysses_degree:
        return f"{query.shape[1]} heads not divisible by ulysses_degree {call.ulysses_degree}"
    return None


def fused_usp(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, *,
              causal: bool = False) -> torch.Tensor:
    """The fused path of one Ulysses-only USP call: [B, H, S_local, D] in and out, on the
    Ulysses process group ``group``."""
    q, k, v = (x.transpose(1, 2).contiguous() for x in (query, key, value))
    out = ulysses_attention(q, k, v, world_for_group(group), causal=causal)
    return out.transpose(1, 2).contiguous()


def _call_of(usp_module, args: inspect.BoundArguments) -> UspCall:
    """The UspCall of a bound USP call, read from xfuser's runtime and parallel state."""
    a = args.arguments
    state = usp_module.get_runtime_state()
    backend = a.get("backend") or state.attention_backend
    fp8_layer = a.get("attn_layer") if a.get("attn_layer") is not None else a.get("head_balance_layer")
    return UspCall(
        ulysses_degree=usp_module.get_ulysses_parallel_world_size(),
        ring_degree=usp_module.get_ring_parallel_world_size(),
        backend=getattr(backend, "name", None if backend is None else str(backend)),
        dropout_p=a.get("dropout_p", 0.0), joint_strategy=a.get("joint_strategy"),
        attention_kwargs=bool(a.get("attention_kwargs")), kv_head_repeat=a.get("kv_head_repeat", 1),
        fp8_comms=state.fp8_comms is not None and fp8_layer is not None,
        head_balance=bool(getattr(state.runtime_config, "use_spargeattn_head_balance", False))
        and a.get("head_balance_layer") is not None,
        kv_cache=usp_module._has_kv_cache(a.get("attn_layer")))


@dataclass
class Hook:
    """The installed replacement: :meth:`disable` puts xfuser's USP back everywhere."""

    original: Callable
    replacement: Callable
    patched: list = field(default_factory=list)  # module names whose USP was replaced

    def disable(self) -> None:
        for name in self.patched:
            mod = sys.modules.get(name)
            if mod is not None and getattr(mod, "USP", None) is self.replacement:
                mod.USP = self.original
        self.patched = []
        global _hook
        if _hook is self:
            _hook = None


_hook: Optional[Hook] = None


def enable() -> Hook:
    """Route xfuser's Ulysses-only USP calls through the fused kernel (idempotent); returns the
    :class:`Hook`. Modules imported later that take ``USP`` from xfuser's module get the
    replacement too; call it again after importing other xfuser modules that already hold USP."""
    global _hook
    version = importlib.metadata.version("xfuser")
    if version != TESTED_VERSION:
        _log_once(f"xfuser {version} is not the tested {TESTED_VERSION} (hook still installed)")
    usp_module = importlib.import_module(USP_MODULE)
    parallel_state = importlib.import_module("xfuser.core.distributed.parallel_state")
    if _hook is None:
        original = usp_module.USP
        signature = inspect.signature(original)

        @functools.wraps(original)
        def usp(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            q, k, v = (bound.arguments[n] for n in ("query", "key", "value"))
            reason = unsupported_reason(q, k, v, _call_of(usp_module, bound))
            if reason is not None:
                _log_once(reason)
                return original(*args, **kwargs)
            return fused_usp(q, k, v, parallel_state.get_sp_group().ulysses_group,
                             causal=bound.arguments["is_causal"])

        _hook = Hook(original=original, replacement=usp)
    for name, mod in list(sys.modules.items()):
        if name.startswith("xfuser") and getattr(mod, "USP", None) is _hook.original:
            mod.USP = _hook.replacement
            if name not in _hook.patched:
                _hook.patched.append(name)
    return _hook
