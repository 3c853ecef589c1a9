"""Pushing trained adapters: everything up to the upload, and an unreachable Hub that loses nothing."""

from pathlib import Path

import pytest
import torch

from trl_opd.tools import cli
from trl_opd.tools.testing import free_port
from trl_opd.trainer.hub import HubPushError, merged_copy, push

SMOKE = str(Path(__file__).parents[1] / "recipes" / "smoke_cpu.yaml")
TOKEN = "hf_thisIsNotARealTokenButMustNeverBePrinted"


@pytest.fixture
def unreachable_hub(monkeypatch):
    """A Hub endpoint where nothing listens, with the test session's offline mode lifted for the client."""
    import huggingface_hub.constants

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    return endpoint


class RecordingHub:
    """Stands in for the Hub client the Trainer pushes through (no Hub can be reached here): records each upload with
    the files and the model card the folder held at that moment, and the training step then."""

    def __init__(self, trainer_state):
        self.state, self.uploads, self.repos = trainer_state, [], []

    def create_repo(self, repo_id, **kwargs):
        from huggingface_hub import RepoUrl

        self.repos.append(repo_id)
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, run_as_future=False, **kwargs):
        from concurrent.futures import Future

        folder = Path(folder_path)
        card = folder / "README.md"
        self.uploads.append({"repo": repo_id, "folder": folder.name, "path_in_repo": path_in_repo,
                             "files": sorted(p.name for p in folder.iterdir()), "step": self.state["step"],
                             "card": card.read_text() if card.exists() else None,
                             "message": kwargs.get("commit_message")})
        if not run_as_future:
            return "commit"
        done = Future()
        done.set_result("commit")
        return done


@pytest.fixture
def recording_hub(monkeypatch):
    import transformers.trainer
    from transformers import TrainerCallback

    state = {"step": 0}
    hub = RecordingHub(state)
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)

    class Step(TrainerCallback):  # the step at which each upload happened
        def on_step_end(self, args, trainer_state, control, **kwargs):
            state["step"] = trainer_state.global_step

    monkeypatch.setattr(transformers.trainer, "DEFAULT_CALLBACKS", [*transformers.trainer.DEFAULT_CALLBACKS, Step])
    return hub


def _push_argv(tiny, output_dir, *extra):
    return [
        "--config", SMOKE, "--model_name_or_path", str(tiny / "student"),
        "--teacher_model_name_or_path", str(tiny / "teacher"), "--dataset_name", str(tiny / "train.jsonl"),
        "--output_dir", str(output_dir), "--max_steps", "2", "--logging_steps", "1",
        "--push_to_hub", "true", "--hub_model_id", "opd-tests/tiny-adapter", "--hub_token", TOKEN, *extra,
    ]


@pytest.mark.parametrize("strategy", ["end", "checkpoint"])
def test_the_cli_pushes_as_hub_strategy_says_each_time_with_its_model_card(tiny, tmp_path, recording_hub, strategy):
    # the Trainer's own pushes, as the Python API gets them: with hub_strategy checkpoint a run stopped after step 1
    # already has that step's adapter, card and resumable checkpoint on the Hub
    output_dir = tmp_path / "run"
    cli.main(_push_argv(tiny, output_dir, "--hub_strategy", strategy, "--save_strategy", "steps", "--save_steps", "1"))
    uploads = recording_hub.uploads
    assert recording_hub.repos == ["opd-tests/tiny-adapter"]
    during = [u for u in uploads if u["message"] != "Model save"]
    if strategy == "end":
        assert during == []
    else:
        assert [(u["step"], u["folder"], u["path_in_repo"]) for u in during] == [
            (1, "run", None), (1, "checkpoint-1", "last-checkpoint"),
            (2, "run", None), (2, "checkpoint-2", "last-checkpoint")]
    final = [u for u in uploads if u["message"] == "Model save"]
    assert len(final) == 1 and final[0]["folder"] == "run"
    for upload in [u for u in uploads if u["path_in_repo"] is None]:
        assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= set(upload["files"])
        for expected in ("library_name: peft", f"**Teacher:** {tiny / 'teacher'}", f"**Recipe:** {SMOKE}",
                         "| `opd_estimator` | full |", "AutoPeftModelForCausalLM"):
            assert expected in upload["card"], (upload["step"], expected)
    assert "| `step` | 2 |" in final[0]["card"]
    assert TOKEN not in "".join(u["card"] for u in uploads if u["card"])


def test_push_merged_with_a_per_save_hub_strategy_is_refused_before_training(tiny, tmp_path, recording_hub):
    with pytest.raises(ValueError, match="push_merged pushes the merged model once, at the end, but hub_strategy "
                                         "every_save also pushes"):  # the value as the user writes it
        cli.main(_push_argv(tiny, tmp_path / "run", "--hub_strategy", "every_save", "--push_merged", "true"))
    assert recording_hub.repos == []


def test_an_unreachable_hub_stops_the_run_before_training(tiny, tmp_path, unreachable_hub, capfd):
    output_dir = tmp_path / "run"
    with pytest.raises(HubPushError, match=r"Could not create the Hub repo 'opd-tests/tiny-adapter' .*so nothing was "
                                           r"trained") as error:
        cli.main(_push_argv(tiny, output_dir))
    captured = capfd.readouterr()
    assert TOKEN not in str(error.value) + captured.out + captured.err
    assert not (output_dir / "adapter_model.safetensors").exists()


def test_a_failed_final_push_loses_nothing(tiny, tmp_path, recording_hub, capfd):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def refuse(**kwargs):
        raise ConnectionError(f"the Hub went away (token {TOKEN})")

    recording_hub.upload_folder = refuse
    output_dir = tmp_path / "run"
    with pytest.raises(HubPushError, match=r"Could not push .*run to the Hub repo 'opd-tests/tiny-adapter'") as error:
        cli.main(_push_argv(tiny, output_dir))
    assert f"trl-opd push {output_dir} --repo-id opd-tests/tiny-adapter" in str(error.value)
    captured = capfd.readouterr()
    assert TOKEN not in str(error.value) + captured.out + captured.err

    # nothing lost: the adapter (not merged weights), its card, and a model that loads and runs
    files = {p.name for p in output_dir.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    card = (output_dir / "README.md").read_text()
    front = card.split("---")[1]
    assert "base_model:" not in front and f"> **base_model is a local path** ({tiny / 'student'})" in card
    for expected in ("library_name: peft", f"**Teacher:** {tiny / 'teacher'}",
                     f"**Recipe:** {SMOKE}", f"**Dataset:** {tiny / 'train.jsonl'}", "| `opd_estimator` | full |",
                     "| `opd_coef` | 0.0 |", "| `opd/reverse_kl` |", "| `step` | 2 |", "AutoPeftModelForCausalLM"):
        assert expected in card, expected
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "student"), output_dir)
    assert torch.isfinite(model(torch.tensor([[1, 263, 264]])).logits).all()

    # the merged copy gets the same facts in a card for full weights
    merged_card = (merged_copy(output_dir, tmp_path / "merged") / "README.md").read_text()
    assert "library_name: transformers" in merged_card and "# Model trained by on-policy distillation" in merged_card
    assert "AutoPeftModelForCausalLM" not in merged_card and "| `opd/reverse_kl` |" in merged_card


@pytest.mark.parametrize("estimator, objective", [
    ("sampled", "The per-token difference log pi_teacher - log pi_student of each sampled token was the advantage of "
                "GRPO's clipped policy-gradient objective (opd_coef 1)."),
    ("full", "The loss was the reverse KL(student || teacher) at each sampled position, over the full vocabulary "
             "(opd_dense_coef 1), with no sampled-token advantage (opd_coef 0)."),
])
def test_the_card_says_which_objective_ran_how_to_load_it_and_with_what(tiny, prompts, make_config, estimator,
                                                                        objective):
    import transformers
    import trl

    from trl_opd import OPDTrainer

    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), train_dataset=prompts,
                         args=make_config(opd_estimator=estimator, max_steps=1, hub_model_id="me/tiny-opd"))
    trainer.train()
    trainer.create_model_card()
    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert f"the teacher scored exactly those tokens (trl_opd's OPDTrainer on TRL's GRPOTrainer). {objective}\n" in card
    assert f"| `opd_estimator` | {estimator} |" in card
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-opd")' in card  # the Hub id, known, not a placeholder
    assert f"- trl: {trl.__version__}" in card and f"- transformers: {transformers.__version__}" in card


def test_push_command_and_merged_weights(tiny, tmp_path, unreachable_hub):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir = tmp_path / "adapter"
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny / "student"),
                           LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    model.save_pretrained(adapter_dir)
    AutoTokenizer.from_pretrained(tiny / "student").save_pretrained(adapter_dir)

    merged = merged_copy(adapter_dir, tmp_path / "merged")
    ids = torch.tensor([[1, 263, 264, 201, 272]])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(merged)(ids).logits, model(ids).logits,
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(SystemExit, match=r"Could not push .*adapter to the Hub repo 'me/x'"):
        cli.main(["push", str(adapter_dir), "--repo-id", "me/x", "--merge"])
    with pytest.raises(FileNotFoundError, match="holds no saved model or adapter"):
        push(tmp_path / "empty", "me/x")


def test_a_reward_that_applies_to_no_completion_shows_as_not_applicable_in_the_card(tiny, prompts, make_config):
    # GRPO logs None for a metric all of whose values are NaN, a reward function's None ("not applicable") for every
    # completion: the card written with each checkpoint shows it as n/a, and the facts behind the card keep it null
    import json

    from trl_opd import OPDTrainer

    def not_applicable(completions, **kwargs):
        return [None] * len(completions)

    config = make_config(max_steps=2, num_generations=2, save_strategy="steps", save_steps=1)
    trainer = OPDTrainer(model=str(tiny / "student"), teacher_model=str(tiny / "teacher"), args=config,
                         train_dataset=prompts, reward_funcs=[not_applicable])
    trainer.train()
    output_dir = Path(config.output_dir)
    assert (output_dir / "checkpoint-2" / "trainer_state.json").exists()
    logged = [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]
    assert [entry["rewards/not_applicable/mean"] for entry in logged] == [None, None]
    card = (output_dir / "README.md").read_text()
    assert "| `step` | 2 |" in card
    assert "| `rewards/not_applicable/mean` | n/a |" in card and "| `reward` | n/a |" in card
    assert "None" not in card.split("## Final metrics")[1]
    assert json.loads((output_dir / "opd_training.json").read_text())["metrics"]["reward"] is None
