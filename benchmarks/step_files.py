"""Which of the package's files one training step runs through: the measure behind docs/development.md's "One training
step" (how many files a reader following the default path touches).

    .venv/bin/python benchmarks/step_files.py                          # the default path: a local teacher, 'full'
    .venv/bin/python benchmarks/step_files.py --opd_estimator sampled  # any OPDConfig option, as --name value

Trains the tiny pair (`trl-opd make-tiny`, built in a scratch directory) for one step and records, from the first
call of `_generate_and_score_completions` to the end of that step's optimizer update, every function of `trl_opd/`
that runs, with the file it is in (a profiler hook on calls). Prints, per file, the functions called and how often,
and the number of files; `--out` also writes them as JSON. The count is of the package's files only: TRL's,
transformers' and torch's own are not the package's to lay out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

PACKAGE = Path(__file__).resolve().parents[1] / "trl_opd"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the files and functions as JSON here")
    known, extra = parser.parse_known_args()
    options = {name.removeprefix("--"): json.loads(value) if value[:1] in "[{0123456789-" or value in (
        "true", "false") else value for name, value in zip(extra[::2], extra[1::2], strict=True)}

    from datasets import load_dataset
    from transformers import TrainerCallback

    from trl_opd import OPDConfig, OPDTrainer
    from trl_opd.tiny import make_tiny

    scratch = Path(tempfile.mkdtemp(prefix="opd-step-files-"))
    tiny = make_tiny(scratch / "tiny")
    prompts = load_dataset("json", data_files=str(tiny / "train.jsonl"), split="train").select(range(8))
    args = OPDConfig(output_dir=str(scratch / "out"), per_device_train_batch_size=4, num_generations=1,
                     max_completion_length=8, max_steps=1, save_strategy="no", report_to="none", bf16=False,
                     **{"opd_estimator": "full", **options})
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=args,
                         train_dataset=prompts)
    calls: Counter = Counter()

    def record(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            calls[(str(Path(frame.f_code.co_filename).relative_to(PACKAGE.parent)), frame.f_code.co_qualname)] += 1

    generate = OPDTrainer._generate_and_score_completions

    def traced(self, inputs):
        sys.setprofile(record)  # from the step's first stage on
        return generate(self, inputs)

    class StopTracing(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            sys.setprofile(None)

    OPDTrainer._generate_and_score_completions = traced  # this measuring script's own hook, not the package's
    trainer.add_callback(StopTracing())
    trainer.train()
    sys.setprofile(None)

    files: dict[str, dict[str, int]] = {}
    for (path, function), count in sorted(calls.items()):
        files.setdefault(path, {})[function] = count
    for path, functions in files.items():
        print(f"{path}: {len(functions)} functions")
        for function, count in functions.items():
            print(f"    {function} x{count}")
    print(f"{len(files)} files, {sum(len(f) for f in files.values())} functions, "
          f"options {json.dumps({'opd_estimator': args.opd_estimator, **options})}")
    if known.out:
        known.out.write_text(json.dumps({"options": options, "files": files}, indent=1))


if __name__ == "__main__":
    main()
