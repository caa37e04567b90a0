"""Optional dependencies. ``pip install olmax`` pre-trains from token files, checkpoints, inspects,
compiles and generates; the rest comes with an extra (pyproject.toml's optional-dependencies):

- ``hf``: torch, transformers (``olmax parity``, the HF reference models of the tests);
- ``eval``: lm-eval, accelerate (``olmax eval lm-eval``, the lm-eval adapter), with ``hf``;
- ``rl``: math-verify (the ``math`` reward);
- ``remote``: fsspec, aiohttp, pyarrow, google-cloud-storage (``s3://``, ``gs://``, ``http(s)://`` paths);
- ``wandb``: wandb (``wandb.project``);
- ``serve``: starlette, uvicorn (``olmax serve``);
- ``plots``: matplotlib (``olmax compare`` plots);
- ``tpu``: libtpu (``olmax compile`` for a TPU slice, running on TPUs);
- ``verify``: OLMo-core and TRL (``olmax verify olmo-core``, ``olmax verify trl``), with ``hf``.

Code that needs one says so with :func:`require` before its optional imports; a missing package
is then a user error (exit 2) that names the extra and the pip command installing it."""

from __future__ import annotations

import importlib.util
import sys

from olmax.config import ConfigError

# Each extra and the packages (import names) it provides.
EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("torch", "transformers"),
    "eval": ("lm_eval", "accelerate"),
    "rl": ("math_verify",),
    "remote": ("fsspec", "aiohttp", "pyarrow", "google.cloud.storage"),
    "wandb": ("wandb",),
    "serve": ("starlette", "uvicorn"),
    "plots": ("matplotlib",),
    "tpu": ("libtpu",),
    "verify": ("olmo_core", "trl"),
}


class MissingExtra(ConfigError):
    """An optional package is not installed; the message gives the pip command that installs it."""

    def __init__(self, extra: str, module: str, who: str = "this"):
        self.extra, self.module = extra, module
        super().__init__(f"{who} needs the '{extra}' extra ({module} is not installed): "
                         f"pip install 'olmax[{extra}]'")

    def naming(self, who: str) -> MissingExtra:
        """The same error, saying who needs the extra (``olmax convert``)."""
        return MissingExtra(self.extra, self.module, who)


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (a blocked or absent package: False)."""
    if module in sys.modules:  # imported already, or set to None to block it
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package; a module set to None in sys.modules
        return False


def require(extra: str, *modules: str) -> None:
    """Raise :class:`MissingExtra` unless every one of ``modules`` (import names that ``extra``
    provides, or pulls in) is installed. Cheap: nothing is imported, so callers check when a
    command starts rather than when the package is first used."""
    if extra not in EXTRAS:
        raise KeyError(f"no extra {extra!r}; known: {', '.join(EXTRAS)}")
    for m in modules or EXTRAS[extra]:
        if not installed(m):
            raise MissingExtra(extra, m)
