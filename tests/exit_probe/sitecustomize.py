"""Put on PYTHONPATH of a launch's workers: each reports, at exit, the process-group threads still running.

`trl_opd.tools.cli.end_processes` destroys the groups before the interpreter's finalization, where destroying a gloo
group can abort the process; a worker that exits with gloo's threads still running has left one for finalization.
"""

import atexit
import os
import sys


def _report() -> None:
    names = []
    for thread in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{thread}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    if os.environ.get("LOCAL_RANK") is not None:  # a worker, not the launcher
        left = sorted(name for name in names if "gloo" in name)
        sys.stderr.write(f"[exit probe] rank {os.environ.get('RANK')}: process-group threads at exit: {left}\n")


atexit.register(_report)
