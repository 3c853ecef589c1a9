"""`check_environments` across 2 CPU processes where only rank 1's rollout lost its environment: run by
tests/test_distributed.py with 2 processes, not collected by pytest.

    python -m torch.distributed.run --nproc_per_node 2 tests/environments_run.py

Each rank prints one line: `rank R stopped: <message>`, or `rank R went on` if its check did not raise.
"""

from types import SimpleNamespace

from accelerate import Accelerator

from trl_opd import cli
from trl_opd.multiturn import check_environments

cli._cpu_process_group()
accelerator = Accelerator()
rank = accelerator.process_index
environments = [SimpleNamespace(failure=None), SimpleNamespace(failure=f"lost at rank {rank}" if rank == 1 else None)]
try:
    check_environments(environments, accelerator)
    print(f"rank {rank} went on", flush=True)
except RuntimeError as stopped:
    print(f"rank {rank} stopped: {stopped}", flush=True)
cli.end_processes(accelerator)
