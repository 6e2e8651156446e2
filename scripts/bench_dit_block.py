#!/usr/bin/env python
"""One DiT attention block (QKV projections, pre-A2A, attention, post-A2A, output projection)
through the stock Ulysses path and the fused one: the command line of :mod:`lab.fa4_a2a.dit_block`
(variants, method and flags: ``--help``).

  python scripts/bench_dit_block.py                                  # loopback, P = 8
  python scripts/bench_dit_block.py --world host --seqs 8192 32768
  torchrun --nproc-per-node 8 scripts/bench_dit_block.py --world torch-symm
"""
import sys

from lab.fa4_a2a.dit_block import main

if __name__ == "__main__":
    sys.exit(main())
