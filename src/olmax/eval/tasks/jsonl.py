"""Dataset loader for the local test tasks: HF ``json`` datasets whose ``data_files`` are relative
to this directory (lm-eval would resolve them against the working directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(data_files: str | list | dict, **_: Any) -> Any:
    """``datasets.load_dataset("json", data_files=...)`` with paths resolved beside this file.

    lm-eval calls a task's ``custom_dataset`` with its metadata as extra keyword arguments;
    they are ignored."""
    import datasets

    def resolve(f: str) -> str:
        return str(HERE / f)

    if isinstance(data_files, dict):
        files: Any = {k: [resolve(f) for f in ([v] if isinstance(v, str) else v)] for k, v in data_files.items()}
    else:
        files = [resolve(f) for f in ([data_files] if isinstance(data_files, str) else data_files)]
    return datasets.load_dataset("json", data_files=files)
