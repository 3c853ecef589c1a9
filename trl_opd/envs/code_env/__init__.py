"""The code-output task as a tool-using agent, against an environment server (OpenEnv, `pip install 'trl_opd[env]'`).

The agent may run Python snippets with a `run_python` tool, in a sandbox on the server, before it answers what a
program prints (scored by `trl_opd.envs.code_output.printed_output_reward`).

    trl-opd serve-env --port 8765                      # sandbox.py says what it confines and what it needs
    export OPD_ENV_SERVER_URL=http://127.0.0.1:8765
    # recipe: environment_factory: trl_opd.envs.code_env.CodeToolClient

Modules: `sandbox.py` (running snippets confined; `sandbox_init.py` its init, `seccomp.py` its system call
filter, `cgroups.py` its budget), `models.py` (wire types), `environment.py` (episodes, turn limit,
output format), `server.py` (the app and its command), `client.py` (OpenEnv's client and the GRPO environment class).
Importing this package is cheap; `CodeToolClient` and `EnvServerError` load OpenEnv on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["CodeToolClient", "EnvServerError"]

if TYPE_CHECKING:
    from .client import CodeToolClient, EnvServerError


def __getattr__(name: str):
    if name in __all__:
        value = getattr(importlib.import_module("trl_opd.envs.code_env.client"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trl_opd.envs.code_env' has no attribute {name!r}")
