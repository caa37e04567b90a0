"""``olmax launch local | slurm | tpu | status``."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from olmax import io, jsonout
from olmax.argtypes import nonneg_float, nonneg_int, positive_int
from olmax.config import ConfigError
from olmax.launch import latest_checkpoint, train_command
from olmax.launch.local import supervise
from olmax.launch.slurm import sbatch_script
from olmax.launch.tpu import gcloud_command, host_command, jobset_manifest, slice_name, slice_overrides
from olmax.recipes import add_recipe_args, get_recipe
from olmax.recipes.slices import slice_choice


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="train until done: local supervisor, Slurm script, TPU slice")
    lsub = p.add_subparsers(dest="launch_command", metavar="WHERE")
    lsub.required = True

    def common(q: argparse.ArgumentParser) -> None:
        add_recipe_args(q)
        q.add_argument("--run-dir", default=None, help="run directory (local, s3:// or gs://; default runs/RECIPE)")
        q.add_argument("--init-from", default=None, metavar="hf:DIR|olmax:PATH|state:PATH",
                       help="start from other weights, as olmax train --init-from")
        q.add_argument("--max-restarts", type=nonneg_int, default=3,
                       help="give up after this many restarts in a row without a new checkpoint (default 3)")

    q = lsub.add_parser("local", help="run training as a child process; restart it after a crash")
    common(q)
    q.add_argument("--backoff", type=nonneg_float, default=10.0, help="first wait before a restart, seconds (doubles)")
    q.add_argument("--max-backoff", type=nonneg_float, default=600.0,
                   help="longest wait between restarts, seconds (default 600)")
    q.add_argument("--status-file", default=None, help="write {pid, attempt, checkpoint} of the child here")
    q.add_argument("--json", action="store_true", help="print the final report as JSON")
    q.set_defaults(func=cmd_local)

    q = lsub.add_parser("slurm", help="write (and submit) an sbatch script that trains until done")
    common(q)
    q.add_argument("--nodes", type=positive_int, required=True, help="Slurm nodes of the job")
    q.add_argument("--gpus-per-node", type=nonneg_int, required=True, help="0 for CPU nodes")
    q.add_argument("--tasks-per-node", type=positive_int, default=1,
                   help="JAX processes per node (default 1: all GPUs)")
    q.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's)")
    q.add_argument("--time", default=None, help="time limit, e.g. 24:00:00 (the job requeues itself before it)")
    q.add_argument("--backoff", type=nonneg_int, default=60, help="seconds before a requeued job starts (doubles)")
    q.add_argument("--log-dir", default=None, help="Slurm log and launcher state folder (default: logs/slurm)")
    q.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="extra #SBATCH option, e.g. --sbatch=--account=abc (repeatable)")
    q.add_argument("--python", default=None, help="python on the compute nodes (default: this interpreter)")
    q.add_argument("--out", default=None, help="write the script here (default: LOG_DIR/olmax-JOB.sbatch)")
    q.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    q.set_defaults(func=cmd_slurm)

    q = lsub.add_parser("tpu", help="print the per-host command, a gcloud line and a JobSet manifest")
    common(q)
    q.add_argument("--tpu-name", default="my-tpu", help="the TPU VM's name")
    q.add_argument("--zone", default="us-central2-b", help="the TPU's zone")
    q.add_argument("--project", default=None, help="the Google Cloud project (default: gcloud's)")
    q.add_argument("--workdir", default=None, help="folder on the hosts to run from")
    q.add_argument("--accelerator", default="tpu-v5p-slice", help="GKE TPU accelerator label")
    q.add_argument("--topology", default="2x2x2", help="the TPU slice's topology")
    q.add_argument("--hosts", type=positive_int, default=2, help="hosts per slice")
    q.add_argument("--chips-per-host", type=positive_int, default=4, help="TPU chips per host (default 4)")
    q.add_argument("--num-slices", type=positive_int, default=1,
                   help="slices (multi-slice data parallelism over DCN); passes mesh.slice=N to the run, "
                        "as `olmax compile --slices N` compiles it")
    q.add_argument("--image", default="IMAGE_WITH_OLMAX", help="the container image holding olmax")
    q.add_argument("--python", default="python3", help="the Python that runs olmax on each host")
    q.add_argument("--manifest", default=None, help="write the JobSet manifest here instead of printing it")
    q.set_defaults(func=cmd_tpu)

    q = lsub.add_parser("status", help="the newest committed checkpoint step of a run directory (-1 if none)")
    q.add_argument("--run-dir", required=True, help="the run directory to report on")
    q.add_argument("--json", action="store_true", help="print the result as one JSON object (stable keys: docs/cli.md)")
    q.set_defaults(func=cmd_status)


def _resolve(args: argparse.Namespace, before: list[str] = ()):
    overrides = [*before, *args.overrides] + ([f"train.init_from={args.init_from}"] if args.init_from else [])
    cfg = get_recipe(args.recipe, overrides)
    run_dir = args.run_dir or os.path.join("runs", cfg.name)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    return cfg, run_dir, overrides


def _output_file(path: str, flag: str, ours: str) -> None:
    """Refuse an output path that cannot be written, or whose file olmax did not write: a launcher
    replaces its own script, manifest or status file, never a user's file given by mistake.
    ``ours`` is what the start of a file this command wrote contains."""
    io.check_local_output(path, flag, ConfigError)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                head = f.read(512)
        except (OSError, UnicodeDecodeError):
            head = ""
        if ours not in head:
            raise ConfigError(f"{flag} {path}: the file exists and was not written by olmax launch; it is left "
                              "as it is (remove it or give another path)")


def cmd_local(args: argparse.Namespace) -> int:
    cfg, run_dir, overrides = _resolve(args)
    if args.status_file:
        _output_file(args.status_file, "--status-file", '"pid"')
    cmd = train_command(args.recipe, run_dir, overrides, python=sys.executable)
    report = supervise(cmd, run_dir, cfg.train.steps, max_restarts=args.max_restarts, backoff=args.backoff,
                       max_backoff=args.max_backoff, status_file=args.status_file)
    print(report.summary(), file=sys.stderr)
    if args.json:
        print(jsonout.dumps(report.to_dict(), indent=2))
    if report.ok:
        return 0
    last = report.attempts[-1].returncode if report.attempts else 1
    return 2 if last == 2 else 1


def cmd_slurm(args: argparse.Namespace) -> int:
    cfg, run_dir, overrides = _resolve(args)
    if args.nodes < 1 or args.gpus_per_node < 0 or args.tasks_per_node < 1:
        raise ConfigError("--nodes and --tasks-per-node must be >= 1 and --gpus-per-node >= 0")
    if args.out and not args.dry_run:
        _output_file(args.out, "--out", "# Generated by `olmax launch slurm`")
    python = args.python or sys.executable
    log_dir = os.path.abspath(args.log_dir or os.path.join("logs", "slurm"))
    rd = run_dir if "://" in run_dir else os.path.abspath(run_dir)
    script = sbatch_script(train_command(args.recipe, rd, overrides, python=python), run_dir=rd,
                           total_steps=cfg.train.steps, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                           tasks_per_node=args.tasks_per_node, job_name=f"olmax-{cfg.name}", log_dir=log_dir,
                           partition=args.partition, time=args.time, max_restarts=args.max_restarts,
                           backoff=args.backoff, python=python, extra_sbatch=args.sbatch,
                           env={"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else None)
    if args.dry_run:
        print(script, end="")
        return 0
    if shutil.which("sbatch") is None:
        raise ConfigError("sbatch is not on PATH (not a Slurm login node?); use --dry-run to print the script")
    os.makedirs(log_dir, exist_ok=True)
    out = args.out or tempfile.NamedTemporaryFile("w", dir=log_dir, prefix=f"olmax-{cfg.name}-", suffix=".sbatch",
                                                  delete=False).name
    io.write_local_atomically(out, script)
    r = subprocess.run(["sbatch", "--parsable", out], capture_output=True, text=True)
    if r.returncode != 0:
        raise ConfigError(f"sbatch {out} failed: {r.stderr.strip() or r.stdout.strip()}")
    print(jsonout.dumps({"job_id": r.stdout.strip().split(";")[0], "script": out, "run_dir": rd}))
    return 0


def cmd_tpu(args: argparse.Namespace) -> int:
    name = slice_name(args.accelerator, args.topology, args.num_slices)
    choice = slice_choice(args.recipe, name)
    chosen = list(choice.overrides) if choice is not None else []
    # The slice's measured choice first, the user's --set lines after it (they win).
    cfg, run_dir, overrides = _resolve(args, before=chosen)
    if args.manifest:
        _output_file(args.manifest, "--manifest", "# Generated by `olmax launch tpu`")
    if not run_dir.startswith("gs://"):
        print(f"warning: run directory {run_dir} is not gs://; every host must reach it and a new slice must "
              "find the checkpoints", file=sys.stderr)
    cmd = train_command(args.recipe, run_dir, overrides + slice_overrides(cfg.mesh.slice, args.num_slices),
                        python=args.python)
    if choice is not None:
        print(f"# {args.recipe} on {name} runs with {' '.join('--set ' + o for o in chosen)}: {choice.why}")
    host = host_command(cmd)
    manifest = jobset_manifest(cmd, name=f"olmax-{cfg.name}".replace("_", "-").lower(), image=args.image,
                               accelerator=args.accelerator, topology=args.topology, hosts=args.hosts,
                               chips_per_host=args.chips_per_host, num_slices=args.num_slices,
                               max_restarts=args.max_restarts)
    print("# on every host of the slice:")
    print(host)
    print("# from a workstation (Cloud TPU VM):")
    print(gcloud_command(host, tpu_name=args.tpu_name, zone=args.zone, project=args.project, workdir=args.workdir))
    if args.manifest:
        io.write_local_atomically(args.manifest, manifest)
        print(f"# JobSet manifest written to {args.manifest}")
    else:
        print(manifest, end="")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if not io.is_remote(args.run_dir) and not os.path.isdir(args.run_dir):
        raise FileNotFoundError(2, "run directory not found (--run-dir)", args.run_dir)
    step = latest_checkpoint(args.run_dir)
    print(jsonout.dumps({"run_dir": args.run_dir, "checkpoint": step}) if args.json else (-1 if step is None else step))
    return 0
