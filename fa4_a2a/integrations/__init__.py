"""Hooks that put the fused Ulysses attention into DiT serving stacks (imported on demand: each
module needs its stack installed). ``diffusers``: an attention backend for context parallelism;
``xfuser``: xDiT's Ulysses USP path replaced."""
