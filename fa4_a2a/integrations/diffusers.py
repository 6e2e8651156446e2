"""The fused Ulysses attention as a diffusers attention backend.

    from fa4_a2a.integrations import diffusers as fa4_diffusers
    fa4_diffusers.register()                                   # once per process
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size))
    model.set_attention_backend(fa4_diffusers.BACKEND)         # "xstage_fa4_a2a"

diffusers' attention dispatch (``diffusers.models.attention_dispatch``) keys its registry by the
closed enum ``AttentionBackendName`` and has no public hook for a third-party backend, so
:func:`register` adds one member to that enum and registers :func:`fa4_a2a_attention` through
the registry's own ``register`` decorator, marked as supporting context parallelism. Tested with
diffusers 0.42.1 (the ``dit`` extra); older than 0.36 (no context parallelism) is refused, newer
releases get a warning until tested.

Under ``ContextParallelConfig(ulysses_degree=P)`` (ring degree 1) each call is
:func:`fa4_a2a.ulysses_attention` on the Ulysses mesh's process group: the pre-attention A2A, then
one launch of FlashAttention-4 with the post-attention A2A fused. Without context parallelism it
is FlashAttention-4 alone (:func:`fa4_a2a.attention_local`). Calls the kernel cannot take (a
mask, dropout, the log-sum-exp, ring attention, "ulysses anything", another head_dim or dtype, no
Hopper GPU) go to diffusers' native backend, which does its own context parallelism; the reason is
logged once.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from fa4_a2a import interface
from fa4_a2a.integrations._common import kernel_reason, on_hopper as _on_hopper
from fa4_a2a.ulysses import ulysses_attention, world_for_group

BACKEND = "xstage_fa4_a2a"
MIN_VERSION = (0, 36)
TESTED_VERSION = (0, 42, 1)

logger = logging.getLogger(__name__)
_logged: set = set()


def _version(text: str) -> tuple:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("xstage_fa4_a2a: %s; using diffusers' native attention", message)


def _dispatch_module():
    import diffusers

    version = _version(diffusers.__version__)
    if version[:2] < MIN_VERSION:
        raise RuntimeError(f"diffusers {diffusers.__version__}: the fa4_a2a backend needs diffusers >= "
                           f"{'.'.join(map(str, MIN_VERSION))} (ContextParallelConfig and the attention registry)")
    if version > TESTED_VERSION:
        _log_once(f"diffusers {diffusers.__version__} is newer than the tested {'.'.join(map(str, TESTED_VERSION))}"
                  " (registration still attempted)")
    from diffusers.models import attention_dispatch as dispatch

    for name in ("AttentionBackendName", "_AttentionBackendRegistry"):
        if not hasattr(dispatch, name):
            raise RuntimeError(f"diffusers {diffusers.__version__}: attention_dispatch has no {name}; "
                               "the fa4_a2a backend cannot register")
    return dispatch


def _add_enum_member(enum_cls, name: str, value: str):
    """A new member of a (str, Enum) class: what AttentionBackendName(value), ``__members__`` and
    attribute access see. Enum has no API for it; this sets the three maps the class reads."""
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def register() -> str:
    """Adds the backend to diffusers' attention registry (idempotent); returns its name."""
    dispatch = _dispatch_module()
    member = _add_enum_member(dispatch.AttentionBackendName, "XSTAGE_FA4_A2A", BACKEND)
    registry = dispatch._AttentionBackendRegistry
    if registry._backends.get(member) is not fa4_a2a_attention:
        registry.register(member, constraints=[], supports_context_parallel=True)(fa4_a2a_attention)
    return BACKEND


def _unsupported(query, key, value, attn_mask, dropout_p, return_lse, cp) -> Optional[str]:
    """Why the fused kernel cannot take this call (None: it can)."""
    if attn_mask is not None:
        return "attention masks are not supported"
    if dropout_p:
        return "dropout is not supported"
    if return_lse:
        return "return_lse is not supported"
    if key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
        return "grouped-query attention (fewer key/value heads) is not supported"
    reason = kernel_reason(query, key, value, _on_hopper(query))
    if reason is not None:
        return reason
    if key.shape[1] != query.shape[1]:
        return "different query and key lengths"
    if cp is not None:
        if cp.ring_degree > 1:
            return "ring attention (ring_degree > 1)"
        if getattr(cp, "ulysses_anything", False):
            return "ulysses_anything"
        if query.shape[2] % cp.ulysses_degree:
            return f"{query.shape[2]} heads not divisible by ulysses_degree {cp.ulysses_degree}"
    return None


def fa4_a2a_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                      scale: Optional[float] = None, enable_gqa: bool = False, return_lse: bool = False,
                      _parallel_config=None) -> torch.Tensor:
    """diffusers backend: [B, S, H, D] in and out (under context parallelism S is this rank's
    sequence shard). See the module docstring."""
    cp = getattr(_parallel_config, "context_parallel_config", None) if _parallel_config is not None else None
    if cp is not None and cp.ulysses_degree <= 1 and cp.ring_degree <= 1:
        cp = None
    reason = _unsupported(query, key, value, attn_mask, dropout_p, return_lse, cp)
    if reason is not None:
        _log_once(reason)
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        native = _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]
        return native(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                      scale=scale, enable_gqa=enable_gqa, return_lse=return_lse, _parallel_config=_parallel_config)
    q, k, v = (x.contiguous() for x in (query, key, value))
    if cp is None:
        out = torch.empty_like(q)
        interface.attention_local(q, k, v, out, softmax_scale=scale, causal=is_causal)
        return out
    world = world_for_group(cp._ulysses_mesh.get_group())
    return ulysses_attention(q, k, v, world, softmax_scale=scale, causal=is_causal)
