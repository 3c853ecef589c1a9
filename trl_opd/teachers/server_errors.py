"""The error a teacher server's failure raises, and the guard that turns a misshapen answer into one; shared by the
client (`vllm_server`) and the reading of the stock completions answer (`completions_response`)."""

from __future__ import annotations

from contextlib import contextmanager

from ..secrets import mask_urls


class TeacherServerError(RuntimeError):
    """A teacher server could not be reached, refused a request, or answered something unusable. The message never
    shows credentials of a server URL."""

    def __init__(self, message: str):
        super().__init__(mask_urls(message))


@contextmanager
def reading(url: str, path: str, answer: dict):
    """Within the block, an answer of the wrong shape (a missing key, a wrong type) is a TeacherServerError that names
    the server, the endpoint and the start of the answer."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
        raise TeacherServerError(
            f"Teacher server {url} answered {path} with an unexpected shape ({type(error).__name__}: {error}): "
            f"{str(answer)[:200]!r}. Is this URL a vLLM server?"
        ) from None
