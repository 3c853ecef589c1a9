"""Test infrastructure for tests and benchmarks: a free loopback port, a tensor-memory meter, a wheel install, a
served teacher process, and loopback HTTP servers that inject faults or delay a teacher. The tiny models and prompts
they run on are built in `trl_opd.tiny`."""

from __future__ import annotations

import json
from pathlib import Path


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(process, *, timeout: float) -> None:
    """SIGTERM the process group a server was started in (`start_new_session=True`), SIGKILL it after `timeout` s,
    and wait until its leader is gone; nothing if it is not running."""
    import os
    import signal
    import subprocess

    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class TensorMemoryMeter:
    """Peak bytes of tensor storage allocated while active (CPU or GPU), via a dispatch mode.

    Counts each new storage once, from the op that creates it until the storage is freed. Views and `out=` writes
    into existing buffers add nothing. `largest` is the biggest single allocation.

        with TensorMemoryMeter() as meter:
            score(...)
        meter.peak, meter.largest
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                meter._record(out, inputs=(args, kwargs))
                return out

        self._mode = _Mode()
        self._live: dict[int, int] = {}
        self.current = self.peak = self.largest = 0

    def _record(self, out, inputs) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_flatten

        def storage_of(tensor):
            """The tensor's storage and its address, or None for a storage freed in place (FSDP2 frees an unsharded
            parameter's between its uses) or none at all (a wrapper such as a DTensor)."""
            try:
                storage = tensor.untyped_storage()
                return storage, storage.data_ptr()
            except RuntimeError:
                return None

        def storages(tree):
            return {found[1] for t in tree_flatten(tree)[0]
                    if isinstance(t, torch.Tensor) and (found := storage_of(t)) is not None}

        existing = storages(inputs)  # an output on an input's storage is a view or an in-place write
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or (found := storage_of(tensor)) is None:
                continue
            storage, key = found
            size = storage.nbytes()
            if size == 0 or key in self._live or key in existing:
                continue
            self._live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            self.largest = max(self.largest, size)
            weakref.finalize(storage, self._free, key)  # storages outlive the tensor that made them

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def install_wheel(source: str | Path, directory: str | Path) -> Path:
    """Build a wheel of the project at `source` and install it, without dependencies, into `directory`/site: what a
    non-editable `pip install` puts on a user's machine. Returns the site directory."""
    import subprocess
    import sys

    directory = Path(directory)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(directory / "wheel"), str(source)],
                   check=True, capture_output=True, timeout=300)
    wheel = next((directory / "wheel").glob("trl_opd-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(directory / "site"), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    return directory / "site"


class TeacherServerProcess:
    """`trl-opd serve-teacher` on a local model, for tests and benchmarks: start, wait until ready, stop.

    `python` is an interpreter with vllm installed (here vLLM's CPU build lives in `.venv-vllm`). With `site`, the
    command runs the trl_opd installed there (e.g. from a wheel) instead of this one.
    """

    def __init__(self, model, log, python: str, *, port: int | None = None, max_model_len: int = 512,
                 site: str | Path | None = None, extra: tuple[str, ...] = ()):
        self.model, self.log, self.python, self.max_model_len = model, Path(log), python, max_model_len
        self.site, self.extra = site, list(extra)  # more vLLM flags
        self.url = f"http://127.0.0.1:{port or free_port()}"
        self.process = None

    def start(self) -> None:
        import os
        import subprocess
        import sys

        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        if self.site is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.site), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "trl_opd", "serve-teacher", str(self.model), "--python", self.python,
                   "--port", self.url.rsplit(":", 1)[1], "--dtype", "float32",
                   "--max-model-len", str(self.max_model_len), "--enforce-eager", *self.extra]
        with open(self.log, "a") as out:
            # `-m` puts the working directory first on sys.path: run from the site, not from a source checkout
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, cwd=self.site)

    def stop(self) -> None:
        """Stop the server's whole process group (vLLM starts engine processes) and wait until it is gone."""
        stop_process_group(self.process, timeout=30)

    def wait_ready(self, timeout: float = 600) -> None:
        """Until /health answers 200, then one scoring request (the first one is slow)."""
        import time

        import requests

        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"The vLLM server exited ({self.process.returncode}):\n{tail}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"The vLLM server was not healthy after {timeout} s:\n{tail}")
            time.sleep(2)
        model = requests.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        if "--hidden-states" in self.extra:  # a pooling server: it cannot generate
            warm_up = {"sequences": [[1, 2, 3]], "score_from": [1]}
            requests.post(self.url + "/opd/hidden", json=warm_up, timeout=300).raise_for_status()
            return
        warm_up = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 0}
        requests.post(self.url + "/v1/completions", json=warm_up, timeout=300).raise_for_status()

    def __enter__(self):
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc):
        self.stop()


MAX_LOOPBACK_BODY = 64 * 2**20  # bytes: a loopback test server refuses larger requests


def padded_batch(seed: int = 0):
    """A scoring batch for the tiny pair (ids in [3, 480)): five sequences of a 6-token prompt and a 7-token
    completion, with a left-padded prompt, a short completion, and a fully masked (truncated) completion."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt_ids, completion_ids = torch.randint(3, 480, (5, 6), generator=g), torch.randint(3, 480, (5, 7), generator=g)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    prompt_mask[0, :2] = 0
    completion_mask[1, 4:] = 0
    completion_mask[2, :] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


class LoopbackHTTPServer:
    """An HTTP server on 127.0.0.1 for injecting server faults in tests. Every request is recorded in `requests` as
    (path, headers, body parsed as JSON where it is JSON) and answered by `respond(path, headers, body)`, which
    returns (status, answer) or (status, answer, headers to add): bytes are sent as they are, anything else as
    JSON. `port` 0 takes a free one. Close it, or use it as a context manager."""

    def __init__(self, respond, *, record: bool = True, port: int = 0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, dict, object]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_LOOPBACK_BODY:
                    self.send_error(413, f"request body over {MAX_LOOPBACK_BODY} bytes")
                    return
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw
                if record:
                    server.requests.append((self.path, dict(self.headers), body))
                status, answer, *extra = respond(self.path, self.headers, body)  # headers: case-insensitive
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                self.send_response(status)
                if not isinstance(answer, bytes):
                    self.send_header("Content-Type", "application/json")
                for name, value in (extra[0] if extra else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_HEAD = _reply

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DelayedTeacherProxy(LoopbackHTTPServer):
    """A teacher server on 127.0.0.1 that forwards every request to the server at `target` (also on this machine)
    after `delay` seconds: a far or busy teacher, for measuring what overlapping its scoring saves without one.
    Requests over `MAX_LOOPBACK_BODY` are refused; nothing is recorded."""

    def __init__(self, target: str, delay: float):
        import time
        from urllib.parse import urlsplit

        import requests

        if urlsplit(target).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"DelayedTeacherProxy forwards to a server on this machine only, not {target!r}.")
        session = requests.Session()

        def forward(path, headers, body):
            time.sleep(delay)
            method = "GET" if body is None else "POST"
            answer = session.request(method, target.rstrip("/") + path, json=body, timeout=(5, 600))
            return answer.status_code, answer.content

        super().__init__(forward, record=False)
