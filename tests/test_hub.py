"""Pushing trained adapters: everything up to the upload, and an unreachable Hub that loses nothing."""

from pathlib import Path

import pytest
import torch

from trl_opd import cli
from trl_opd.hub import HubPushError, merged_copy, push
from trl_opd.testing import free_port

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


def test_push_to_an_unreachable_hub_fails_once_after_a_complete_local_save(tiny, tmp_path, unreachable_hub, capfd):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    output_dir = tmp_path / "run"
    argv = [
        "--config", SMOKE, "--model_name_or_path", str(tiny / "student"),
        "--teacher_model_name_or_path", str(tiny / "teacher"), "--dataset_name", str(tiny / "train.jsonl"),
        "--output_dir", str(output_dir), "--max_steps", "2", "--logging_steps", "1",
        "--push_to_hub", "true", "--hub_model_id", "opd-tests/tiny-adapter", "--hub_token", TOKEN,
    ]
    with pytest.raises(HubPushError, match=r"Could not push .*run to the Hub repo 'opd-tests/tiny-adapter'") as error:
        cli.main(argv)
    assert f"trl-opd push {output_dir} --repo-id opd-tests/tiny-adapter" in str(error.value)
    captured = capfd.readouterr()
    assert TOKEN not in str(error.value) + captured.out + captured.err

    # nothing lost: the adapter (not merged weights), its card, and a model that loads and runs
    files = {p.name for p in output_dir.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    card = (output_dir / "README.md").read_text()
    for expected in (f"base_model: {tiny / 'student'}", "library_name: peft", f"**Teacher:** {tiny / 'teacher'}",
                     f"**Recipe:** {SMOKE}", f"**Dataset:** {tiny / 'train.jsonl'}", "| `opd_estimator` | full |",
                     "| `opd_coef` | 0.0 |", "| `opd/reverse_kl` |", "| `step` | 2 |", "AutoPeftModelForCausalLM"):
        assert expected in card, expected
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "student"), output_dir)
    assert torch.isfinite(model(torch.tensor([[1, 263, 264]])).logits).all()

    # the merged copy gets the same facts in a card for full weights
    merged_card = (merged_copy(output_dir, tmp_path / "merged") / "README.md").read_text()
    assert "library_name: transformers" in merged_card and "# Model trained by on-policy distillation" in merged_card
    assert "AutoPeftModelForCausalLM" not in merged_card and "| `opd/reverse_kl` |" in merged_card


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
