"""Checkpoints survive a SIGKILL: resuming reaches the same metrics as a run that was never stopped."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trl_opd.trainer.checkpoints import is_complete, last_complete_checkpoint, resolve_resume

SMOKE = str(Path(__file__).parents[1] / "recipes" / "smoke_cpu.yaml")
STEPS, SAVE_EVERY = 30, 2


def _command(tiny, output_dir, *extra):
    return [
        sys.executable, "-m", "trl_opd", "--config", SMOKE,
        "--model_name_or_path", str(tiny / "student"), "--teacher_model_name_or_path", str(tiny / "teacher"),
        "--dataset_name", str(tiny / "train.jsonl"), "--output_dir", str(output_dir),
        "--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", str(SAVE_EVERY), "--logging_steps", "1",
        *extra,
    ]


def _history(output_dir) -> dict[int, dict]:
    state = json.loads((Path(output_dir) / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return {entry["step"]: entry for entry in state["log_history"] if "opd/reverse_kl" in entry}


def test_sigkilled_run_resumes_to_the_same_metrics(tiny, tmp_path):
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    subprocess.run(_command(tiny, uninterrupted), check=True, capture_output=True)

    process = subprocess.Popen(_command(tiny, killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not is_complete(killed / "checkpoint-4"):
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed_from = last_complete_checkpoint(killed)
    assert int(resumed_from.rsplit("-", 1)[1]) < STEPS  # it really was stopped mid-training

    # a checkpoint whose save was interrupted: newer than the rest, but without a readable trainer state
    partial = killed / "checkpoint-1000"
    partial.mkdir()
    (partial / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    (partial / "trainer_state.json").write_text('{"global_step": 10')
    assert last_complete_checkpoint(killed) == resumed_from
    with pytest.raises(ValueError, match="checkpoint-1000 is incomplete"):
        resolve_resume(str(partial), killed)

    subprocess.run(_command(tiny, killed, "--resume_from_checkpoint", "true"), check=True, capture_output=True)
    expected, got = _history(uninterrupted), _history(killed)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in range(int(resumed_from.rsplit("-", 1)[1]) + 1, STEPS + 1):
        for name in ("loss", "opd/reverse_kl", "opd/teacher_logp", "grad_norm"):
            assert got[step][name] == pytest.approx(expected[step][name], rel=1e-4, abs=1e-5), (step, name)

    from safetensors.torch import load_file

    final = [load_file(d / f"checkpoint-{STEPS}" / "adapter_model.safetensors") for d in (uninterrupted, killed)]
    for name, tensor in final[0].items():
        torch.testing.assert_close(final[1][name], tensor, rtol=1e-4, atol=1e-6)
