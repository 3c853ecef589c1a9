"""Secrets are never written or shown: credentials inside URLs are masked, tokens are dropped from what is saved.

A URL such as `http://user:password@host:8000` works for requests (the client sends its credentials), but everything
this package writes or prints shows it as `http://***@host:8000`. `OPDConfig` pickles (`training_args.bin` in every
checkpoint) and serialises (logs, trackers) without the Hub token and with masked URLs.
"""

from __future__ import annotations

import re
from typing import Any

# scheme://userinfo@ : everything between the scheme and the last '@' before the host
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s'\"]+@")
MASK = "***"


def mask_urls(text: str) -> str:
    """`text` with the credentials of every URL in it masked."""
    return _USERINFO.sub(rf"\g<scheme>{MASK}@", text)


def has_credentials(url: str) -> bool:
    return isinstance(url, str) and _USERINFO.search(url) is not None


def masked(value: Any) -> Any:
    """`value` (a string, or lists, tuples and dicts of them) with URL credentials masked; other values unchanged."""
    if isinstance(value, str):
        return mask_urls(value)
    if isinstance(value, (list, tuple)):
        return type(value)(masked(item) for item in value)
    if isinstance(value, dict):
        return {key: masked(item) for key, item in value.items()}
    return value


def without_secrets(text: str, *secrets: str | None) -> str:
    """`text` with URL credentials and each given secret (a token, a key) masked."""
    text = mask_urls(text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return text
