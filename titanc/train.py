"""`python -m titanc.train SPEC --out RUN ...`: one rank of `titanc train`, for torchrun.

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m titanc.train SPEC --out RUN

Takes the flags of `titanc train`; the process group comes from the environment torchrun
sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Exit status as the titanc CLI's.
"""
from __future__ import annotations

import sys

from titanc.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["train", *sys.argv[1:]]))
