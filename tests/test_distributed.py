"""DeepSpeed ZeRO-3 across 2 CPU processes (gloo): student and teacher sharded, the same steps as one process.

Each test trains 3 steps with 2 processes x 8 rows and with 1 process x 16 rows (the same global batch; greedy
decoding, so a completion does not depend on the process that samples it), and compares the two in float32: every
logged loss, gradient norm and KL to a relative 1e-4 (measured: at most 3e-6), and every trained tensor after the 3
steps to 1e-2 of its largest entry (measured: up to 3e-3, on one element of LoRA's near-zero B matrices, where Adam's
normalised step magnifies round-off). `zero3_cpu.json` partitions every tensor, the LM heads included, as on a real
model.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from trl_opd.tools import cli, recipe

ROOT = Path(__file__).parents[1]
SMOKE = str(ROOT / "recipes" / "smoke_cpu.yaml")
ZERO3 = str(ROOT / "recipes" / "accelerate" / "zero3_cpu.yaml")
STEPS = 3
LOGGED = ("loss", "grad_norm", "opd/reverse_kl", *(f"opd/{divergence}_{term}" for divergence in
                                                   ("reverse_kl", "forward_kl", "jsd") for term in ("dense", "topk")))


def _args(tiny, output_dir, *extra, teacher=None, student=None):
    teacher = ["--teacher_model_name_or_path", str(tiny / "teacher") if teacher is None else teacher]
    student = str(tiny / "student") if student is None else str(student)
    return [
        "--config", SMOKE, "--model_name_or_path", student, "--dataset_name", str(tiny / "train.jsonl"),
        "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--logging_steps", "1",
        "--generation_kwargs", '{"do_sample": false}', "--save_strategy", "steps", "--save_steps", str(STEPS),
        *teacher, *extra,
    ]


def _train_both_ways(args, tmp_path, *, config=ZERO3, groups_ended=True) -> tuple[Path, Path]:
    """`args(output_dir)` trained with 2 sharded processes x 8 rows (ZeRO-3, or the accelerate `config` given) and
    with 1 process x 16 rows; `groups_ended`: each worker also ended its process groups before exit."""
    two, one = tmp_path / "shardedx2", tmp_path / "single"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "-m", "trl_opd",
               *args(two), "--per_device_train_batch_size", "8"]
    # a hung collective fails the test instead of the suite
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_probed_environment())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "Saved the trained" in result.stdout + result.stderr
    if groups_ended:
        _assert_no_group_left_for_exit(result.stderr, processes=2)
    cli.train(*recipe.make_parser().parse_args_and_config([*args(one), "--per_device_train_batch_size", "16"]))
    return two, one


def _probed_environment() -> dict:
    """The environment for a launch whose workers report, at exit, the process-group threads still running."""
    path = [str(ROOT / "tests" / "exit_probe"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _assert_no_group_left_for_exit(stderr: str, *, processes: int) -> None:
    """Every worker destroyed its process groups before the interpreter's finalization (`cli.end_processes`): a gloo
    group destroyed there sometimes aborts a rank whose run succeeded."""
    reports = [line for line in stderr.splitlines() if line.startswith("[exit probe]")]
    assert len(reports) == processes, reports
    assert all(line.endswith("at exit: []") for line in reports), reports


def _history(output_dir):
    state = json.loads((Path(output_dir) / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "opd/reverse_kl" in entry]


def _assert_same_training(two, one, *, dense_metric=None):
    sharded, single = _history(two), _history(one)
    assert [e["step"] for e in sharded] == [e["step"] for e in single] == list(range(1, STEPS + 1))
    for a, b in zip(sharded, single, strict=True):
        assert set(a).intersection(LOGGED) == set(b).intersection(LOGGED)
        for name in set(a).intersection(LOGGED):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), (a["step"], name)
    if dense_metric is not None:
        assert all(dense_metric in entry for entry in sharded)
    weights = "adapter_model.safetensors" if (one / "adapter_model.safetensors").exists() else "model.safetensors"
    after_sharded, after_single = load_file(two / weights), load_file(one / weights)
    assert after_sharded.keys() == after_single.keys()
    # Adam divides each gradient element by its own running scale, so an element whose gradient is near zero moves by
    # a sizeable fraction of the learning rate whichever way rounding tips it, and the two processes sum the
    # gradients in another order than one: measured up to 0.3% of a matrix's largest weight, on one element of 4096,
    # on some CPUs of this kind. A sharding error moves whole matrices by their own size; the logged metrics above
    # hold every step to 1e-4
    for name, expected in after_single.items():
        difference = (after_sharded[name].float() - expected.float()).abs().max()
        assert difference <= 1e-2 * expected.float().abs().max(), name
    return sharded


ZERO3_TRACES = ROOT / "tests" / "golden" / "zero3.json"


def _hold_to_golden_trace(request, sharded) -> None:
    """The 2-process ZeRO-3 run's log, step by step, against its golden trace in tests/golden/zero3.json (see
    tests/test_golden.py: the same comparison, recorded with OPD_RECORD_GOLDEN=1)."""
    from test_golden import RECORD, _differences

    case = request.node.callspec.id
    actual = {"steps": [{name: value for name, value in entry.items()
                         if name in ("loss", "grad_norm") or name.startswith("opd/")} for entry in sharded]}
    recorded = json.loads(ZERO3_TRACES.read_text()) if ZERO3_TRACES.exists() else {"cases": {}}
    if RECORD:
        recorded["cases"][case] = actual
        ZERO3_TRACES.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    assert case in recorded["cases"], f"No ZeRO-3 golden trace for {case}: record them (see tests/test_golden.py)."
    differences = _differences(recorded["cases"][case], actual)
    assert not differences, f"{case} under ZeRO-3 no longer logs its golden trace:\n  " + "\n  ".join(differences)


@pytest.mark.parametrize("use_peft", ["false", "true"], ids=["full_ft", "lora"])
@pytest.mark.parametrize(("estimator", "dense_metric"), [("sampled", None), ("full", "opd/reverse_kl_dense"),
                                                         ("topk", "opd/reverse_kl_topk")])
def test_two_process_zero3_matches_one_process(tiny, tmp_path, estimator, dense_metric, use_peft, request):
    two, one = _train_both_ways(
        lambda out: _args(tiny, out, "--opd_estimator", estimator, "--use_peft", use_peft), tmp_path
    )
    _hold_to_golden_trace(request, _assert_same_training(two, one, dense_metric=dense_metric))
    checkpoint = two / f"checkpoint-{STEPS}"
    assert any(p.name.startswith("global_step") for p in checkpoint.iterdir())  # ZeRO's own shards
    if use_peft == "false":  # the consolidated weights are the student's alone: no teacher-sized (hidden 96) tensor
        from safetensors import safe_open

        with safe_open(checkpoint / "model.safetensors", "pt") as saved:
            assert not any(96 in saved.get_slice(name).get_shape() for name in saved.keys())


def test_the_default_estimator_under_zero3_is_full_with_a_dense_and_sampled_term(tiny, tmp_path):
    # no opd_estimator: 'full' for a local teacher under ZeRO-3 as on one process; with opd_coef 1 the sampled term
    # runs GRPO's policy loss inside the same redirected forward as the dense term
    two, one = _train_both_ways(lambda out: _args(tiny, out, "--use_peft", "false", "--opd_coef", "1.0"), tmp_path)
    sharded = _assert_same_training(two, one, dense_metric="opd/reverse_kl_dense")
    assert all(entry["loss"] > entry["opd/reverse_kl_dense"] for entry in sharded)  # both terms in the loss


def test_another_divergence_under_zero3_matches_one_process(tiny, tmp_path):
    # the generalised JSD runs TRL's kernel through a second pass over the vocabulary, forward and backward
    two, one = _train_both_ways(
        lambda out: _args(tiny, out, "--use_peft", "false", "--opd_divergence_beta", "0.5"), tmp_path
    )
    _assert_same_training(two, one, dense_metric="opd/jsd_dense")


def test_the_control_under_zero3_takes_its_constant_over_both_processes(tiny, tmp_path):
    # each process holds 8 of the 16 rows: a constant from its own rows only would be another number on each, and
    # the step another than one process's over all 16
    two, one = _train_both_ways(lambda out: _args(tiny, out, "--opd_estimator", "sampled",
                                                  "--opd_constant_advantage", "true"), tmp_path)
    _assert_same_training(two, one)
    for a, b in zip(_history(two), _history(one), strict=True):
        assert a["opd/advantage_mean"] == pytest.approx(b["opd/advantage_mean"], rel=1e-4)
        assert a["opd/advantage_mean"] < 0


def test_a_student_with_tied_embeddings_under_zero3_matches_one_process(tiny, tmp_path):
    # the LM head is the input embedding (Qwen3 up to 4B, Qwen2.5 0.5B): one partitioned tensor that the embedding and
    # the dense term both read, whose gradient sums both uses
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny / "student")
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(tiny / "student").save_pretrained(tmp_path / "tied")
    two, one = _train_both_ways(
        lambda out: _args(tiny, out, "--use_peft", "false", student=tmp_path / "tied"), tmp_path
    )
    _assert_same_training(two, one, dense_metric="opd/reverse_kl_dense")


def test_a_teacher_of_another_family_under_zero3_matches_one_process(tiny, tiny_other_teacher, tmp_path):
    # teacher_tokenizer_mode cross: each rank renders its own rows for the teacher, whose sequences differ in length
    # from rank to rank; the sharded teacher's forwards still run in step (one per teacher batch on every rank)
    two, one = _train_both_ways(
        lambda out: _args(tiny, out, "--use_peft", "true", "--teacher_tokenizer_mode", "cross",
                          teacher=str(tiny_other_teacher)), tmp_path
    )
    sharded = _assert_same_training(two, one)
    single = _history(one)
    for a, b in zip(sharded, single, strict=True):
        assert a["opd/aligned_chunk_tokens_mean"] == pytest.approx(b["opd/aligned_chunk_tokens_mean"])


def test_a_served_teacher_under_zero3_trains_topk_like_one_process(teacher_server, tiny, tmp_path):
    two, one = _train_both_ways(lambda out: _args(tiny, out, "--use_peft", "true", teacher=teacher_server), tmp_path)
    _assert_same_training(two, one, dense_metric="opd/reverse_kl_topk")  # topk: the served teacher's default


def test_overlapped_served_scoring_under_zero3_trains_like_one_process(teacher_server, tiny, tmp_path):
    # the scoring thread only waits on HTTP; every collective stays on the main thread, in the same order on each rank
    two, one = _train_both_ways(lambda out: _args(tiny, out, "--use_peft", "true", "--opd_overlap_scoring", "true",
                                                  teacher=teacher_server), tmp_path)
    sharded = _assert_same_training(two, one, dense_metric="opd/reverse_kl_topk")
    assert [entry["opd/staleness"] for entry in sharded] == [0.0, 1.0, 1.0]


def test_a_hidden_state_server_under_zero3_trains_full_like_one_process(hidden_server, tiny, tmp_path):
    # the teacher's head, read from the served model's checkpoint, is whole on each rank; scoring overlapped
    two, one = _train_both_ways(lambda out: _args(tiny, out, "--use_peft", "true", "--opd_overlap_scoring", "true",
                                                  teacher=hidden_server), tmp_path)
    sharded = _assert_same_training(two, one, dense_metric="opd/reverse_kl_dense")  # full: that server's default
    assert [entry["opd/staleness"] for entry in sharded] == [0.0, 1.0, 1.0]


@pytest.mark.parametrize(("mode", "estimator"), [("same", "sampled"), ("same", "full"), ("cross", "sampled")])
def test_routed_local_teachers_under_zero3_with_a_teacher_absent_from_one_rank(tiny, tiny_other_teacher, tmp_path,
                                                                                mode, estimator):
    # 16 rows, one routed to "self": every global batch holds all 16, so one rank scores a "self" row and the other
    # none, and must still run the same forwards of that sharded teacher (else the collective hangs). In cross mode
    # "expert" is of another family, and the byte credit's head projections are collectives too. With 'full' each
    # rank projects its rows through both teachers' heads (96 and 64 wide), gathered whole, whatever its routes
    rows = [json.loads(line) for line in (tiny / "train.jsonl").read_text().splitlines()][:16]
    data = tmp_path / "routed.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "teacher": "self" if i == 5 else "expert"}) + "\n"
                            for i, r in enumerate(rows)))
    expert = tiny / "teacher" if mode == "same" else tiny_other_teacher
    teachers = json.dumps({"expert": str(expert), "self": str(tiny / "student")})

    def args(out):  # no teacher_model_name_or_path ("" unsets the recipe's): the routed teachers instead
        return [*_args(tiny, out, "--use_peft", "true", "--teachers", teachers, "--teacher_tokenizer_mode", mode,
                       "--opd_estimator", estimator, teacher=""), "--dataset_name", str(data)]

    two, one = _train_both_ways(args, tmp_path)
    dense = {"dense_metric": "opd/reverse_kl_dense"} if estimator == "full" else {}
    sharded = _assert_same_training(two, one, **dense)
    assert all(entry["opd/reverse_kl"] > 0 for entry in sharded)


@pytest.mark.parametrize(("kind", "use_peft"), [("initial", "false"), ("live", "true"), ("ema", "false"),
                                              ("ema", "true")])
def test_the_student_as_its_own_teacher_under_zero3_matches_one_process(tiny, tmp_path, kind, use_peft):
    # 'initial' with full fine-tuning scores with GRPO's sharded reference copy; 'live' with the student's own sharded
    # weights in a no-grad pass; 'ema' moves its copy (that reference copy, or the "ema" adapter) with gathered
    # parameters after each optimizer step and saves it whole in each checkpoint. The teacher's privileged context (a
    # system prompt the student never reads) keeps its scores apart from the student's. (The LoRA 'ema' run found the
    # "ema" adapter scoring with live dropout, which differed from rank to rank.)
    ema = ("--teacher_ema_rate", "0.5") if kind == "ema" else ()
    two, one = _train_both_ways(
        lambda out: _args(tiny, out, "--use_peft", use_peft, "--student_as_teacher", kind, *ema,
                          "--teacher_system_prompt", "Answer with the number only.", teacher=""), tmp_path
    )
    sharded = _assert_same_training(two, one, dense_metric="opd/reverse_kl_dense")  # 'full', the default here
    assert all(entry["opd/reverse_kl_dense"] > 1e-3 for entry in sharded)
    if kind == "ema":
        from trl_opd.trainer.self_distillation import EMA_WEIGHTS

        averaged = [load_file(out / f"checkpoint-{STEPS}" / EMA_WEIGHTS) for out in (two, one)]
        assert averaged[0].keys() == averaged[1].keys() and averaged[0]
        for name, expected in averaged[1].items():
            assert (averaged[0][name] - expected).abs().max() <= 1e-3 * expected.abs().max(), name


@pytest.mark.parametrize("processes", [1, 2])
def test_check_runs_under_zero3_with_zero_init_and_reports_once(tiny, tmp_path, processes):
    # zero.Init partitions the student as it loads, so the preflight must run where train() runs its first step
    # (inside the DeepSpeed engine's forwards); with 2 CPU processes it needs training's gloo set-up too
    launch = tmp_path / "zero3_init.yaml"
    launch.write_text(Path(ZERO3).read_text().replace("zero3_init_flag: false", "zero3_init_flag: true")
                      .replace("num_processes: 2", f"num_processes: {processes}"))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launch), "-m", "trl_opd",
               "check", "--config", SMOKE, "--model_name_or_path", str(tiny / "student"),
               "--teacher_model_name_or_path", str(tiny / "teacher"), "--dataset_name", str(tiny / "train.jsonl"),
               "--output_dir", str(tmp_path / "unused"), "--per_device_train_batch_size", str(16 // processes)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env=_probed_environment())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    _assert_no_group_left_for_exit(result.stderr, processes=processes)
    assert result.stdout.count("reference as teacher: opd/reverse_kl = 0.000000 (OK, 0 as expected)") == 1
    assert result.stdout.count("recipe's teacher:") == 1
    reverse_kl = float(result.stdout.split("recipe's teacher:")[1].split("opd/reverse_kl = ")[1].split(",")[0])
    assert reverse_kl > 1.0  # the real teacher is far from the tiny student


@pytest.mark.parametrize("kind", ["initial", "ema"])
def test_a_student_passed_as_a_moved_model_is_its_own_starting_teacher_under_zero3(tiny, tmp_path, kind):
    # GRPO builds its sharded reference copy from the checkpoint on disk; the student moved after loading, and the
    # first step's KL (the teacher reading what the student reads) is 0 only if the copy is the student as passed
    result = tmp_path / "history.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO3,
               str(ROOT / "tests" / "instance_run.py"), str(tiny), str(tmp_path / "out"), kind, str(result)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    first = next(entry for entry in json.loads(result.read_text()) if "opd/reverse_kl_dense" in entry)
    assert first["opd/reverse_kl_dense"] == pytest.approx(0.0, abs=1e-6)
    assert first["opd/reverse_kl"] == pytest.approx(0.0, abs=1e-5)


def test_the_teachers_head_is_gathered_once_per_loss_under_zero3(tiny, tmp_path):
    # TRL's divergence kernel gathers a partitioned head for each call of its (at most 4096 positions on a GPU, 256
    # on a CPU), forward and backward: held whole from the loss to the end of its backward, the teacher's head is
    # gathered once a micro-batch, and the loss is the same
    result = tmp_path / "gathers.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO3,
               str(ROOT / "tests" / "head_gathers_run.py"), str(tiny), str(tmp_path / "out"), str(result)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    report = json.loads(result.read_text())
    assert report["mean_length"] == 48  # 8 rows x 48 positions a process: two kernel calls
    assert report["counts"]["plain"] == 2  # what the kernel does alone, in the forward only
    assert report["counts"]["held"] == 1  # forward and backward
    assert report["losses"]["held"] == pytest.approx(report["losses"]["plain"], rel=1e-6, abs=1e-7)


def _recorded_step(tiny, tmp_path, estimator: str, opd_coef: float) -> dict:
    """tests/metric_means_run.py with 2 ZeRO-3 processes: the step's log entry (`logged`) and, per process, its
    micro-batches' per-token values (`ranks`)."""
    name = f"{estimator}_{opd_coef}"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO3,
               str(ROOT / "tests" / "metric_means_run.py"), str(tiny), str(tmp_path / name),
               str(tmp_path / f"{name}.json"), estimator, str(opd_coef)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    recorded = json.loads((tmp_path / f"{name}.json").read_text())
    for batch in (batch for rank in recorded["ranks"] for batch in rank if "mass" in batch):
        batch["student_mass"], batch["teacher_mass"] = batch.pop("mass")  # (positions,) each
    return recorded


def _total(batches, key) -> float:
    return sum(torch.tensor(batch[key], dtype=torch.float64).sum().item() for batch in batches)


def _token_mean(ranks, key) -> float:
    """Over the whole generation batch: every process's micro-batches' sum of `key`, over their distilled tokens."""
    batches = [batch for rank in ranks for batch in rank]
    return _total(batches, key) / _total(batches, "mask")


def _micro_batch_mean(ranks, key) -> float:
    """GRPO's `entropy`: each micro-batch's token mean over all processes, then the mean over the micro-batches."""
    means = [_token_mean([[batch] for batch in step], key) for step in zip(*ranks, strict=True)]
    return sum(means) / len(means)


def test_each_token_metric_means_one_thing_on_every_path_with_uneven_processes(tiny, tmp_path):
    # the dense-only path (full, no sampled term: the student's hidden states alone, see dense.py) and GRPO's loss
    # (topk beside the sampled term) on the same sampled completions, 2 micro-batches a process, where each process
    # and each micro-batch holds its own number of tokens
    lean, grpo = _recorded_step(tiny, tmp_path, "full", 0.0), _recorded_step(tiny, tmp_path, "topk", 1.0)
    assert [[b["completion_ids"] for b in rank] for rank in lean["ranks"]] == [
        [b["completion_ids"] for b in rank] for rank in grpo["ranks"]]
    counts = [[_total([batch], "mask") for batch in rank] for rank in lean["ranks"]]
    assert sum(counts[0]) != sum(counts[1]) and counts[0][0] + counts[1][0] != counts[0][1] + counts[1][1], counts
    token_means = {"opd/reverse_kl": "reverse_kl", "opd/reverse_kl_dense": "dense", "opd/reverse_kl_topk": "dense",
                   "opd/student_topk_mass": "student_mass", "opd/teacher_topk_mass": "teacher_mass"}
    for run in (lean, grpo):
        logged, ranks = run["logged"], run["ranks"]
        for name in set(token_means).intersection(logged):
            assert logged[name] == pytest.approx(_token_mean(ranks, token_means[name]), rel=1e-6), name
            # the uneven micro-batches tell this definition from a mean of micro-batch means
            assert abs(_token_mean(ranks, token_means[name]) / _micro_batch_mean(ranks, token_means[name]) - 1) > 1e-5
        assert logged["entropy"] == pytest.approx(_micro_batch_mean(ranks, "entropy"), rel=1e-6)
        assert abs(_micro_batch_mean(ranks, "entropy") / _token_mean(ranks, "entropy") - 1) > 1e-5
    assert set(token_means) <= set(lean["logged"]) | set(grpo["logged"])
    # the same per-token values (the same weights, the same completions) log the same numbers on either path
    for name in ("entropy", "opd/reverse_kl"):
        assert lean["logged"][name] == pytest.approx(grpo["logged"][name], rel=1e-5), name


def test_two_machines_of_one_process_train_like_one_launch_of_two(tiny, tmp_path):
    # recipes/accelerate/zero3_2nodes.yaml with CPU settings: each "machine" a launch of its own with its
    # --machine_rank, meeting at a loopback address; the 2 steps equal one 2-process launch's
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = yaml.safe_load((ROOT / "recipes" / "accelerate" / "zero3_2nodes.yaml").read_text())
    del nodes["mixed_precision"]  # zero3_cpu.json sets the precision
    nodes.update(num_processes=2, main_process_port=port,
                 deepspeed_config={"deepspeed_config_file": str(ROOT / "recipes" / "accelerate" / "zero3_cpu.json"),
                                   "deepspeed_multinode_launcher": "standard", "zero3_init_flag": False})
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
    one = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO3, "-m", "trl_opd",
                          *args(tmp_path / "one_launch")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-5000:]

    def history(out):
        state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
        return [{k: v for k, v in entry.items() if k in LOGGED} for entry in state["log_history"] if "loss" in entry]

    machines_history, launch_history = history(tmp_path / "machines"), history(tmp_path / "one_launch")
    assert len(machines_history) == 2 and machines_history[0].keys() == launch_history[0].keys()
    for a, b in zip(machines_history, launch_history, strict=True):
        for name in b:
            assert a[name] == pytest.approx(b[name], rel=1e-6, abs=1e-7), name
    after = [load_file(out / "adapter_model.safetensors") for out in (tmp_path / "machines", tmp_path / "one_launch")]
    for name, expected in after[1].items():
        torch.testing.assert_close(after[0][name], expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_a_rollout_that_lost_its_environment_on_one_rank_stops_every_rank():
    from trl_opd.tools.testing import free_port

    # GRPO shows the model the tool's error and goes on; the check before scoring must stop both processes, or the
    # rank that lost nothing would wait forever in the next collective
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "tests" / "environments_run.py")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith("rank 0 stopped: Rollouts of this batch lost their environment on another process.")
    assert lines[1].startswith("rank 1 stopped: Rollouts of this batch lost their environment: lost at rank 1.")


def test_cpu_processes_without_deepspeed_are_refused(tiny, tmp_path):
    # torchrun without accelerate's DeepSpeed settings: the Trainer does not wrap the model for data parallelism, and
    # each process would train its own copy, saving one of them as if it were the run's
    from trl_opd.tools.testing import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "trl_opd", *_args(tiny, tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode != 0
    assert "2 CPU processes, and no DeepSpeed configuration to train them as one" in result.stderr
    assert not (tmp_path / "out").exists()
