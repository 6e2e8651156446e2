#!/usr/bin/env python
"""The FP8 WGMMA rate of the W8A8 mainloop's batch shapes (docs/moe-core.md, section 4): the command
line of :mod:`lab.megamoe.diag.wgmma_rate` (``--help``)."""
from lab.megamoe.diag.wgmma_rate import main

if __name__ == "__main__":
    main()
