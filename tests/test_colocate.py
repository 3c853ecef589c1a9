"""The student generating through vLLM colocated in the trainer (`use_vllm`, `vllm_mode: colocate`), as the GPU
recipes run it, here on vLLM's CPU build (`.venv-vllm`, with this package installed). Each run trains 2 steps of the
tiny pair in a subprocess (tests/colocate_run.py) and records what GRPO passed on."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "MASTER_ADDR": "127.0.0.1"}


def _colocated_run(tiny, tmp_path, estimator) -> dict:
    python = os.environ.get("OPD_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    if not Path(python).exists():
        pytest.fail(f"No vLLM interpreter at {python}: run `make test` (it builds .venv-vllm) or set OPD_VLLM_PYTHON.")
    result = tmp_path / "result.json"
    command = [python, str(ROOT / "tests" / "colocate_run.py"), str(tiny), str(tmp_path / "out"), estimator,
               str(result)]
    # from the scratch directory: `python script` puts the script's folder, not a source checkout, on sys.path
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, **VLLM_ENV})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(result.read_text())


def _max_gap(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_a_dense_term_alone_with_colocated_vllm_takes_one_student_forward_a_step(tiny, tmp_path):
    # opd_coef 0 and no rewards: GRPO's policy term is 0, so its importance-sampling correction of that term and the
    # extra forward for old log-probs it needs are skipped; the sampler's log-prob gap is logged from the loss forward
    run = _colocated_run(tiny, tmp_path, "full")
    assert run["importance_sampling"] is False
    assert run["forwards_per_step"] == [1, 1]
    for batch, entry in zip(run["batches"], run["history"], strict=True):
        assert "old_per_token_logps" not in batch
        gap = _max_gap(batch["recomputed"], batch["sampling"])
        assert entry["sampling/sampling_logp_difference/max"] == pytest.approx(gap, rel=1e-4, abs=1e-6)
        assert entry["loss"] == pytest.approx(entry["opd/reverse_kl_dense"], rel=1e-5)


def test_the_sampled_estimator_with_colocated_vllm_corrects_by_the_old_log_probs(tiny, tmp_path):
    run = _colocated_run(tiny, tmp_path, "sampled")
    assert run["importance_sampling"] is True
    assert run["forwards_per_step"] == [2, 2]  # GRPO's old log-probs, then the loss forward
    for step, batch in enumerate(run["batches"]):
        # the old log-probs are the student's own, at the weights that sampled
        assert _max_gap(batch["old_per_token_logps"], batch["recomputed"]) <= 1e-5
        # GRPO's default sequence_mask ratio: exp of the summed per-token gap to vLLM's sampling log-probs
        assert batch["importance_sampling_mode"] == "sequence_mask"
        start = 0
        for length, ratio in zip(batch["lengths"], batch["importance_sampling_ratio"], strict=True):
            gap = sum(batch["old_per_token_logps"][start:start + length]) - sum(batch["sampling"][start:start + length])
            assert ratio == pytest.approx(math.exp(gap), rel=1e-5)
            start += length
        # vLLM samples from the student as it is at that step: after the first update it is synced to the new
        # weights, far from the initial ones
        assert _max_gap(batch["sampling"], batch["recomputed"]) < 0.1
        if step:
            assert _max_gap(batch["sampling"], batch["initial"]) > 10 * _max_gap(batch["sampling"], batch["recomputed"])
