"""FSDP2 across 2 CPU processes (gloo): the student sharded by accelerate's `fully_shard`, the teacher by layers, the
same steps as one process.

The same comparison as tests/test_distributed.py makes for ZeRO-3, with the same tolerances and their reasons: 3 steps
with 2 processes x 8 rows against 1 process x 16 rows, greedy decoding, every logged loss, gradient norm and KL to a
relative 1e-4, every trained tensor to 1e-2 of its largest entry. accelerate engages FSDP only on GPU-like devices;
`trl-opd` sets the same state on CPU processes (tools/cli.py `_fsdp_state_on_cpu`), so these runs shard for real:
parameters are `DTensor`s and the checkpoint holds FSDP's own shards.

Known and open: under FSDP2 the gloo groups' threads outlive `cli.end_processes` (with plain torch too: `fully_shard`
and one forward over two gloo ranks leave them after `destroy_process_group`), so these runs' exit is not checked as
ZeRO-3's is; `test_every_group_ends_before_exit_under_fsdp2` holds that as an expected failure.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_distributed import (
    STEPS,
    _args,
    _assert_no_group_left_for_exit,
    _assert_same_training,
    _probed_environment,
    _train_both_ways,
)

ROOT = Path(__file__).parents[1]
FSDP2 = str(ROOT / "recipes" / "accelerate" / "fsdp2_cpu.yaml")


@pytest.mark.parametrize("use_peft", ["false", "true"], ids=["full_ft", "lora"])
@pytest.mark.parametrize(("estimator", "dense_metric"), [("sampled", None), ("full", "opd/reverse_kl_dense"),
                                                         ("topk", "opd/reverse_kl_topk")])
def test_two_process_fsdp2_matches_one_process(tiny, tmp_path, estimator, dense_metric, use_peft):
    two, one = _train_both_ways(
        lambda out: _args(tiny, out, "--opd_estimator", estimator, "--use_peft", use_peft), tmp_path, config=FSDP2,
        groups_ended=False,
    )
    _assert_same_training(two, one, dense_metric=dense_metric)
    checkpoint = two / f"checkpoint-{STEPS}"
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir()  # FSDP's own sharded checkpoint, beside the whole weights
    if use_peft == "false":  # the gathered weights are the student's alone: no teacher-sized (hidden 96) tensor
        from safetensors import safe_open

        with safe_open(checkpoint / "model.safetensors", "pt") as saved:
            assert not any(96 in saved.get_slice(name).get_shape() for name in saved.keys())


@pytest.mark.xfail(strict=True, reason="FSDP2's gloo groups outlive end_processes (see the module's docstring)")
def test_every_group_ends_before_exit_under_fsdp2(tiny, tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP2, "-m", "trl_opd",
               *_args(tiny, tmp_path / "out", "--opd_estimator", "sampled", "--max_steps", "1"),
               "--per_device_train_batch_size", "8"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_probed_environment())
    assert result.returncode == 0, result.stderr[-5000:]
    _assert_no_group_left_for_exit(result.stderr, processes=2)


def _fsdp2_both_ways(args, tmp_path):
    return _train_both_ways(args, tmp_path, config=FSDP2, groups_ended=False)


def test_another_divergence_under_fsdp2_matches_one_process(tiny, tmp_path):
    two, one = _fsdp2_both_ways(
        lambda out: _args(tiny, out, "--use_peft", "false", "--opd_divergence_beta", "0.5"), tmp_path
    )
    _assert_same_training(two, one, dense_metric="opd/jsd_dense")


def test_a_student_with_tied_embeddings_under_fsdp2_matches_one_process(tiny, tmp_path):
    # the LM head is the input embedding: accelerate puts the two in one FSDP2 unit, unsharded for the whole forward,
    # where the dense term reads the head
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny / "student")
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(tiny / "student").save_pretrained(tmp_path / "tied")
    two, one = _fsdp2_both_ways(lambda out: _args(tiny, out, "--use_peft", "false", student=tmp_path / "tied"),
                                tmp_path)
    _assert_same_training(two, one, dense_metric="opd/reverse_kl_dense")


def test_a_teacher_of_another_family_under_fsdp2_matches_one_process(tiny, tiny_other_teacher, tmp_path):
    two, one = _fsdp2_both_ways(
        lambda out: _args(tiny, out, "--use_peft", "true", "--teacher_tokenizer_mode", "cross",
                          teacher=str(tiny_other_teacher)), tmp_path
    )
    _assert_same_training(two, one)


def test_the_control_under_fsdp2_takes_its_constant_over_both_processes(tiny, tmp_path):
    two, one = _fsdp2_both_ways(lambda out: _args(tiny, out, "--opd_estimator", "sampled",
                                                  "--opd_constant_advantage", "true"), tmp_path)
    _assert_same_training(two, one)


def test_a_served_teacher_under_fsdp2_trains_topk_like_one_process(teacher_server, tiny, tmp_path):
    two, one = _fsdp2_both_ways(lambda out: _args(tiny, out, "--use_peft", "true", teacher=teacher_server), tmp_path)
    _assert_same_training(two, one, dense_metric="opd/reverse_kl_topk")


def test_a_hidden_state_server_under_fsdp2_trains_full_like_one_process(hidden_server, tiny, tmp_path):
    two, one = _fsdp2_both_ways(lambda out: _args(tiny, out, "--use_peft", "true", "--opd_overlap_scoring", "true",
                                                  teacher=hidden_server), tmp_path)
    _assert_same_training(two, one, dense_metric="opd/reverse_kl_dense")


@pytest.mark.parametrize(("mode", "estimator"), [("same", "sampled"), ("same", "full"), ("cross", "sampled")])
def test_routed_local_teachers_under_fsdp2_with_a_teacher_absent_from_one_rank(tiny, tiny_other_teacher, tmp_path,
                                                                                mode, estimator):
    rows = [json.loads(line) for line in (tiny / "train.jsonl").read_text().splitlines()][:16]
    data = tmp_path / "routed.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "teacher": "self" if i == 5 else "expert"}) + "\n"
                            for i, r in enumerate(rows)))
    expert = tiny / "teacher" if mode == "same" else tiny_other_teacher
    teachers = json.dumps({"expert": str(expert), "self": str(tiny / "student")})

    def args(out):
        return [*_args(tiny, out, "--use_peft", "true", "--teachers", teachers, "--teacher_tokenizer_mode", mode,
                       "--opd_estimator", estimator, teacher=""), "--dataset_name", str(data)]

    two, one = _fsdp2_both_ways(args, tmp_path)
    _assert_same_training(two, one, **({"dense_metric": "opd/reverse_kl_dense"} if estimator == "full" else {}))


@pytest.mark.parametrize(("kind", "use_peft"), [("initial", "false"), ("live", "true"), ("ema", "false"),
                                              ("ema", "true")])
def test_the_student_as_its_own_teacher_under_fsdp2_matches_one_process(tiny, tmp_path, kind, use_peft):
    ema = ("--teacher_ema_rate", "0.5") if kind == "ema" else ()
    two, one = _fsdp2_both_ways(
        lambda out: _args(tiny, out, "--use_peft", use_peft, "--student_as_teacher", kind, *ema,
                          "--teacher_system_prompt", "Answer with the number only.", teacher=""), tmp_path
    )
    sharded = _assert_same_training(two, one, dense_metric="opd/reverse_kl_dense")
    assert all(entry["opd/reverse_kl_dense"] > 1e-3 for entry in sharded)


def test_grpo_reference_as_teacher_under_fsdp2_matches_one_process(tiny, tmp_path):
    two, one = _fsdp2_both_ways(
        lambda out: _args(tiny, out, "--use_peft", "false", "--ref_as_teacher", "true", "--opd_estimator", "sampled",
                          teacher=""), tmp_path
    )
    _assert_same_training(two, one)


def _launch(tiny, output_dir, *extra, steps=6):
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP2, "-m", "trl_opd",
            *_args(tiny, output_dir, "--max_steps", str(steps), "--save_steps", "2", *extra),
            "--per_device_train_batch_size", "8"]


def _logged(output_dir, step) -> dict[int, dict]:
    state = json.loads((Path(output_dir) / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return {entry["step"]: entry for entry in state["log_history"] if "opd/reverse_kl" in entry}


def test_a_sigkilled_fsdp2_run_resumes_to_the_same_metrics_and_its_checkpoints_load_in_one_process(tiny, tmp_path):
    # LoRA with the full estimator: FSDP's sharded model and optimizer state resumed on 2 processes, and every
    # checkpoint's adapter (gathered whole) loadable by one process without FSDP
    import os
    import signal
    import time

    from peft import AutoPeftModelForCausalLM

    from trl_opd.trainer.checkpoints import is_complete, last_complete_checkpoint

    extra = ("--use_peft", "true", "--opd_estimator", "full")
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    subprocess.run(_launch(tiny, uninterrupted, *extra), check=True, capture_output=True, timeout=600)

    process = subprocess.Popen(_launch(tiny, killed, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    deadline = time.monotonic() + 300
    while not is_complete(killed / "checkpoint-2"):
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)  # the launcher and both workers
    process.wait()
    resumed_from = last_complete_checkpoint(killed)
    stopped_at = int(resumed_from.rsplit("-", 1)[1])
    assert stopped_at < 6  # it really was stopped mid-training
    reloaded = AutoPeftModelForCausalLM.from_pretrained(resumed_from)  # one process, no FSDP
    assert any("lora_B" in name and parameter.abs().sum() > 0 for name, parameter in reloaded.named_parameters())

    subprocess.run(_launch(tiny, killed, *extra, "--resume_from_checkpoint", "true"), check=True,
                   capture_output=True, timeout=600)
    expected, got = _logged(uninterrupted, 6), _logged(killed, 6)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for step in range(stopped_at + 1, 7):
        for name in ("loss", "opd/reverse_kl", "opd/reverse_kl_dense", "grad_norm"):
            assert got[step][name] == pytest.approx(expected[step][name], rel=1e-4, abs=1e-6), (step, name)
    final = AutoPeftModelForCausalLM.from_pretrained(killed)  # the final save, in one process
    assert final.peft_config["default"].r > 0


def test_check_runs_under_fsdp2_and_reports_once(tiny, tmp_path):
    # the documented preflight, `accelerate launch --config_file recipes/accelerate/fsdp2.yaml -m trl_opd check`,
    # on its CPU twin: two trainers built in turn on one FSDP2 state, each scoring where train() runs its first step
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP2, "-m", "trl_opd",
               "check", "--config", str(ROOT / "recipes" / "smoke_cpu.yaml"),
               "--model_name_or_path", str(tiny / "student"), "--teacher_model_name_or_path", str(tiny / "teacher"),
               "--dataset_name", str(tiny / "train.jsonl"), "--output_dir", str(tmp_path / "unused"),
               "--per_device_train_batch_size", "8", "--use_peft", "false"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert result.stdout.count("reference as teacher: opd/reverse_kl = 0.000000 (OK, 0 as expected)") == 1
    reverse_kl = float(result.stdout.split("recipe's teacher:")[1].split("opd/reverse_kl = ")[1].split(",")[0])
    assert reverse_kl > 1.0  # the real teacher is far from the tiny student


def test_two_machines_of_one_process_under_fsdp2_train_like_one_launch_of_two(tiny, tmp_path):
    # fsdp2_cpu.yaml as 2 "machines" of one process each, meeting at a loopback address, against one 2-process launch
    import socket

    import torch
    import yaml
    from safetensors.torch import load_file

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = yaml.safe_load(Path(FSDP2).read_text())
    nodes.update(num_machines=2, num_processes=2, main_process_ip="127.0.0.1", main_process_port=port)
    config = tmp_path / "two_machines.yaml"
    config.write_text(yaml.safe_dump(nodes))

    def args(out):
        return [*_args(tiny, out, "--use_peft", "true"), "--max_steps", "2", "--save_steps", "2",
                "--per_device_train_batch_size", "8"]

    machines = [subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                                  "--machine_rank", str(rank), "-m", "trl_opd", *args(tmp_path / "machines")],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
                for rank in (0, 1)]
    try:
        outputs = [machine.communicate(timeout=600)[0] for machine in machines]
    finally:
        for machine in machines:
            machine.kill()
    assert [machine.returncode for machine in machines] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    one = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", FSDP2, "-m", "trl_opd",
                          *args(tmp_path / "one_launch")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-5000:]
    machines_history, launch_history = (_logged(tmp_path / name, 2) for name in ("machines", "one_launch"))
    assert sorted(machines_history) == sorted(launch_history) == [1, 2]
    for step, expected in launch_history.items():
        for name in ("loss", "grad_norm", "opd/reverse_kl", "opd/reverse_kl_dense"):
            assert machines_history[step][name] == pytest.approx(expected[name], rel=1e-6, abs=1e-7), (step, name)
    after = [load_file(tmp_path / name / "adapter_model.safetensors") for name in ("machines", "one_launch")]
    for name, expected in after[1].items():
        torch.testing.assert_close(after[0][name], expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_the_adapter_trained_under_fsdp2_is_pushed_once_with_its_card(tiny, tmp_path):
    # the main process pushes the folder the final save wrote (the adapter gathered whole); the token is in no card
    import os

    token = "hf_thisIsNotARealTokenButMustNeverBePrinted"
    record = tmp_path / "uploads.jsonl"
    path = [str(ROOT / "tests" / "recording_hub"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OPD_RECORDING_HUB": str(record)}
    command = [*_launch(tiny, tmp_path / "run", "--use_peft", "true", steps=2), "--push_to_hub", "true",
               "--hub_model_id", "opd-tests/tiny-fsdp2-adapter", "--hub_token", token]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    uploads = [json.loads(line) for line in record.read_text().splitlines()]
    final = [upload for upload in uploads if upload["message"] == "Model save"]
    assert len(final) == 1 and final[0]["rank"] == "0" and final[0]["repo"] == "opd-tests/tiny-fsdp2-adapter"
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= set(final[0]["files"])
    assert "library_name: peft" in final[0]["card"]
    assert token not in "".join(upload["card"] or "" for upload in uploads)
