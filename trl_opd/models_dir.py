"""Hub model ids read from a local mirror, for offline machines that hold copies of Hub models by name in one directory.

With `OPD_MODELS_DIR` set, `Qwen/Qwen2.5-Coder-0.5B-Instruct` names `$OPD_MODELS_DIR/qwen2.5-coder-0.5b-instruct`
(the layout `make real-models` writes) or `$OPD_MODELS_DIR/Qwen/Qwen2.5-Coder-0.5B-Instruct`, whichever exists.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"[\w-][\w.-]*/[\w.-]+")


def resolve_model(name: str | None) -> str | None:
    """The directory that holds Hub id `name` under `OPD_MODELS_DIR`, if there is one; otherwise `name` unchanged
    (a path, an id not mirrored there, None), for `from_pretrained` to read as it would."""
    mirror = os.environ.get("OPD_MODELS_DIR")
    if not mirror or not name or not _HUB_ID.fullmatch(name) or Path(name).exists():
        return name
    org, model = name.split("/")
    for directory in (Path(mirror).expanduser() / model.lower(), Path(mirror).expanduser() / org / model):
        if directory.is_dir():
            return str(directory)
    return name
