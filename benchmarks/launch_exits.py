"""How often a finished multi-process launch exits 0: N launches of a short ZeRO-3 run with 2 CPU processes.

    .venv/bin/trl-opd make-tiny artifacts/tiny
    .venv/bin/python benchmarks/launch_exits.py --runs 30 --json benchmarks/results/launch_exits_smoke.json
    .venv/bin/python benchmarks/launch_exits.py --runs 30 --json benchmarks/results/launch_exits_ema_loaded.json \
        --extra --use_peft false --teacher_model_name_or_path "" --student_as_teacher ema --teacher_ema_rate 0.5 \
        --teacher_system_prompt "Answer with the number only."     # with a CPU-bound process beside it

Measured (2-core AMD EPYC, 2026-12-04). Before the fix: the smoke recipe 30 of 30 launches exited 0; full
fine-tuning with the 'ema' self-teacher beside one CPU-bound process 122 of 126 in four rounds (each failure one rank
ended by SIGABRT after both ranks saved: "terminate called without an active exception" during the interpreter's
finalization, launch_exits_ema_loaded_stacks.json), and every rank exited with gloo's threads still running. The cause:
under ZeRO-3 the process groups outlived `destroy_process_group` (each partitioned parameter names its group, and
DeepSpeed keeps each model it wrapped), so they were destroyed during finalization. After
`trl_opd.tools.cli.end_processes`: 'ema' beside a CPU-bound process 30 of 30, the smoke recipe 30 of 30, and no rank of
the 60 launches exited with a process group left (launch_exits_ema_loaded.json, launch_exits_smoke.json).

Each launch is what the suite's multi-process tests run (the smoke recipe, 2 steps, `recipes/accelerate/zero3_cpu.yaml`,
saving a checkpoint), with Python's fault handler on, so that a process that aborts prints every thread's stack, and
with tests/exit_probe on PYTHONPATH, so that each worker reports the process-group threads it leaves for exit. The
report counts exit codes and such ranks, and keeps, for every launch that did not exit 0, the end of its output.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def launch(tiny: Path, output_dir: Path, *, timeout: int, extra: list[str]) -> tuple[int, str, float]:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "recipes" / "accelerate" / "zero3_cpu.yaml"), "-m", "trl_opd",
        "--config", str(ROOT / "recipes" / "smoke_cpu.yaml"), "--model_name_or_path", str(tiny / "student"),
        "--teacher_model_name_or_path", str(tiny / "teacher"), "--dataset_name", str(tiny / "train.jsonl"),
        "--output_dir", str(output_dir), "--max_steps", "2", "--per_device_train_batch_size", "8",
        "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2", *extra,
    ]
    probe = os.pathsep.join([str(ROOT / "tests" / "exit_probe"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": probe}
    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
                                start_new_session=True)
        return result.returncode, result.stdout + result.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"").decode(errors="replace") + (error.stderr or b"").decode(errors="replace")
        return -1, output + "\n[timed out]", time.perf_counter() - start


def abort_report(output: str) -> str:
    """What a failed launch said: from the fault handler's first report (every thread's stack at the abort) or the
    C++ runtime's message, if any, else the end of its output."""
    markers = [output.find(marker) for marker in ("terminate called", "Fatal Python error")]
    start = min((index for index in markers if index >= 0), default=max(0, len(output) - 6000))
    return output[max(0, start - 2000) : start + 12000]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", type=Path, default=Path("artifacts/tiny"), help="`trl-opd make-tiny`'s directory")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more recipe options for each launch, e.g. --extra --use_peft false")
    args = parser.parse_args(argv)
    if not (args.tiny / "student").is_dir():
        sys.exit(f"No tiny pair in {args.tiny}: run `trl-opd make-tiny {args.tiny}` first.")
    codes, failures, seconds, left = collections.Counter(), [], [], 0
    with tempfile.TemporaryDirectory() as scratch:
        for run in range(args.runs):
            code, output, elapsed = launch(args.tiny.resolve(), Path(scratch) / f"run{run}", timeout=args.timeout,
                                           extra=args.extra)
            codes[code] += 1
            seconds.append(elapsed)
            # each worker's exit probe: the process-group threads it left for the interpreter's finalization
            left += sum(1 for line in output.splitlines()
                        if line.startswith("[exit probe]") and not line.endswith("at exit: []"))
            if code != 0:
                failures.append({"run": run, "returncode": code, "output": abort_report(output)})
            print(f"launch {run + 1}/{args.runs}: exit {code} in {elapsed:.0f} s", flush=True)
    report = {"runs": args.runs, "options": args.extra, "exited_0": codes[0],
              "exit_codes": {str(k): v for k, v in sorted(codes.items())},
              "ranks_exiting_with_process_group_threads": left,
              "seconds_per_launch": round(sum(seconds) / len(seconds), 1), "date": time.strftime("%Y-%m-%d"),
              "failures": failures}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=1))
    sys.exit(0 if codes[0] == args.runs else 1)


if __name__ == "__main__":
    main()
