"""DeepSpeed ZeRO-3 across 2 CPU processes (gloo): student and teacher sharded, the same steps as one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_opd import cli

ROOT = Path(__file__).parents[1]
SMOKE = str(ROOT / "recipes" / "smoke_cpu.yaml")
STEPS = 3


def _args(tiny, output_dir, *extra):
    # greedy decoding: each prompt's completion then does not depend on which process samples it; the sampled
    # estimator in both runs (the default under ZeRO-3, where the dense terms are not supported)
    return [
        "--config", SMOKE, "--model_name_or_path", str(tiny / "student"),
        "--teacher_model_name_or_path", str(tiny / "teacher"), "--dataset_name", str(tiny / "train.jsonl"),
        "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--logging_steps", "1",
        "--generation_kwargs", '{"do_sample": false}', "--opd_estimator", "sampled",
        "--save_strategy", "steps", "--save_steps", str(STEPS),
        *extra,
    ]


def _history(output_dir):
    state = json.loads((Path(output_dir) / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "opd/reverse_kl" in entry]


@pytest.mark.parametrize("use_peft", ["false", "true"], ids=["full", "lora"])
def test_two_process_zero3_matches_one_process(tiny, tmp_path, use_peft):
    two = tmp_path / "zero3x2"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "recipes" / "accelerate" / "zero3_cpu.yaml"), "-m", "trl_opd",
        *_args(tiny, two, "--per_device_train_batch_size", "8", "--use_peft", use_peft),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "Saved the trained" in result.stdout + result.stderr

    one = tmp_path / "single"
    cli.train(*cli.make_parser().parse_args_and_config(
        _args(tiny, one, "--per_device_train_batch_size", "16", "--use_peft", use_peft)
    ))
    sharded, single = _history(two), _history(one)
    assert [e["step"] for e in sharded] == [e["step"] for e in single] == list(range(1, STEPS + 1))
    for a, b in zip(sharded, single, strict=True):
        assert a["opd/reverse_kl"] == pytest.approx(b["opd/reverse_kl"], rel=1e-4, abs=1e-5), a["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5), a["step"]
    checkpoint = two / f"checkpoint-{STEPS}"
    assert any(p.name.startswith("global_step") for p in checkpoint.iterdir())  # ZeRO's own shards
    if use_peft == "false":  # the consolidated weights are the student's alone: no teacher-sized (hidden 96) tensor
        from safetensors import safe_open

        with safe_open(checkpoint / "model.safetensors", "pt") as saved:
            assert not any(96 in saved.get_slice(name).get_shape() for name in saved.keys())
