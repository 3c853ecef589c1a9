"""`check_environments` across 2 CPU processes where only rank 1's rollout lost its environment: run by
tests/test_distributed.py with 2 processes, not collected by pytest.

    python -m torch.distributed.run --nproc_per_node 2 tests/environments_run.py

Each rank prints one line: `rank R stopped: <message>`, or `rank R went on` if its check did not raise. The line goes
out in one write: unbuffered, `print` writes the text and its newline apart, and the two ranks' lines can interleave.
"""

import os
from types import SimpleNamespace

import torch

from trl_opd.trainer.multiturn import check_environments

torch.distributed.init_process_group("gloo")  # a group of its own: the check must not depend on who set it up
rank = torch.distributed.get_rank()
accelerator = SimpleNamespace(device=torch.device("cpu"))  # all the check reads of the trainer's accelerator
environments = [SimpleNamespace(failure=None), SimpleNamespace(failure=f"lost at rank {rank}" if rank == 1 else None)]
try:
    check_environments(environments, accelerator)
    line = f"rank {rank} went on"
except RuntimeError as stopped:
    line = f"rank {rank} stopped: {stopped}"
os.write(1, f"{line}\n".encode())  # under the pipe's atomic size (4 KiB): one piece, whatever the other rank writes
torch.distributed.destroy_process_group()
