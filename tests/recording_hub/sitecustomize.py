"""Put on PYTHONPATH of a launch's workers with OPD_RECORDING_HUB=FILE: the Trainer's Hub client (no Hub can be
reached here) is replaced by one that records each upload, with the files and the model card its folder held then,
as a JSON line in FILE. tests/test_hub.py's `recording_hub` does the same within one process."""

import json
import os


def _install(record: str) -> None:
    from concurrent.futures import Future
    from pathlib import Path

    import transformers.trainer
    from huggingface_hub import RepoUrl

    class RecordingHub:
        def create_repo(self, repo_id, **kwargs):
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, run_as_future=False, **kwargs):
            folder = Path(folder_path)
            card = folder / "README.md"
            with open(record, "a") as out:
                out.write(json.dumps({"rank": os.environ["RANK"], "repo": repo_id, "folder": folder.name,
                                      "path_in_repo": path_in_repo, "files": sorted(p.name for p in folder.iterdir()),
                                      "card": card.read_text() if card.exists() else None,
                                      "message": kwargs.get("commit_message")}) + "\n")
            if not run_as_future:
                return "commit"
            done = Future()
            done.set_result("commit")
            return done

    transformers.trainer.hf_api = RecordingHub


if os.environ.get("OPD_RECORDING_HUB") and os.environ.get("LOCAL_RANK") is not None:  # a worker, not the launcher
    _install(os.environ["OPD_RECORDING_HUB"])
