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
