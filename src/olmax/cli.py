"""The ``olmax`` command line. Subcommands live beside the code they drive: each module below
exposes ``register(subparsers)``, adds its parsers (a group such as ``eval`` or ``verify`` calls
its members' ``register`` in turn) and sets ``func(args) -> int`` on each. Command modules import
their implementation inside ``func``, so that the CLI starts without Orbax, Grain or torch."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback
import warnings

from olmax import commands, compile, jsonout
from olmax.compat import commands as convert_commands
from olmax.config import ConfigError
from olmax.data import commands as data_commands
from olmax.eval import commands as eval_commands
from olmax.extras import MissingExtra
from olmax.infer import commands as infer_commands
from olmax.launch import commands as launch_commands
from olmax.serve import commands as serve_commands
from olmax.train import commands as train_commands
from olmax.verify import commands as verify_commands
from olmax.verify import parity

# Exceptions that are the user's to fix (their messages name the field, file or flag). OSError
# covers a full disk, a missing permission or a run directory that is a file.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ValueError, OSError)

# Modules that add subcommands, in help order.
COMMAND_MODULES = [commands, compile, train_commands, data_commands, convert_commands, parity, verify_commands,
                   eval_commands, infer_commands, serve_commands, launch_commands]


class Parser(argparse.ArgumentParser):
    """argparse with the error contract: a bad flag or value is one line, exit 2, and also
    ``{"error": ...}`` on stdout when the command line asks for ``--json``."""

    json_errors = False  # set by main() when --json is on the command line

    def error(self, message: str):  # type: ignore[override]
        if Parser.json_errors:
            print(jsonout.dumps({"error": f"{self.prog}: {message}"}))
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="olmax", description="Faithful, verified LLM pre-training and post-training "
                                              "(SFT, DPO, RL with verifiable rewards) in JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def _user_error_message(e: BaseException) -> str:
    """One line for a user's error (bad config, data, checkpoint, disk); OSError names the path."""
    if isinstance(e, OSError) and not isinstance(e, (ConfigError,)) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        if e.filename2:  # a rename (an atomic write's last step): the target is the file the user named
            where = f": {e.filename2} (renaming {e.filename} to it)"
        return f"{e.strerror}{where}"
    msg = str(e) or type(e).__name__
    return " ".join(msg.split()) if "\n" in msg else msg


def _quiet_background_errors() -> None:
    """Orbax and Grain log the traceback of an error in their threads (ENOSPC in an async save
    came with dozens); the error itself reaches the main thread, which reports it in one line."""
    import logging
    for name in ("absl", "orbax", "jax._src.distributed", "grain", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # TensorStore's callbacks into an asyncio loop that a failed save already closed ("Event loop
    # is closed") arrive as unraisable exceptions and thread exceptions: one per pending write.
    def closed_loop(exc: BaseException | None) -> bool:
        return isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)

    sys.unraisablehook = lambda u: None if closed_loop(u.exc_value) else sys.__unraisablehook__(u)
    # The writes those callbacks would have awaited are garbage-collected at exit unawaited, and
    # Python warns once per coroutine ("coroutine 'async_serialize_from_host...' was never awaited").
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
    threading.excepthook = lambda a: None if closed_loop(a.exc_value) else threading.__excepthook__(a)


def _cache_every_program() -> None:
    """Where a persistent compilation cache is set (``JAX_COMPILATION_CACHE_DIR``), keep every
    program olmax compiles in it, as the test suite does, unless the user chose a threshold: JAX
    keeps only programs that took over a second to compile, and small ones (a decode engine's
    prefill and blank state, the weights' preparation) would compile again in every process."""
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        import jax
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def main(argv: list[str] | None = None) -> int:
    # Error contract: a user error (config, data, checkpoint, full disk, a missing extra) is one line
    # on stderr (and {"error": ...} on stdout with --json), exit status 2, no traceback unless --debug
    # or OLMAX_DEBUG=1. Anything else is a bug in olmax and keeps its traceback.
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("OLMAX_DEBUG", "") not in ("", "0")
    if "--debug" in argv:
        argv.remove("--debug")
        debug = True
    parser = build_parser()
    Parser.json_errors = "--json" in argv
    args = parser.parse_args(argv)
    if not debug:
        _quiet_background_errors()
    _cache_every_program()
    try:
        rc = args.func(args)
    except USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, MissingExtra):
            e = e.naming(f"olmax {args.command}")
        msg = _user_error_message(e)
        if getattr(args, "json", False):
            print(jsonout.dumps({"error": msg}))
        print(f"error: {msg}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
