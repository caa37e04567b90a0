"""MaxText 0.2.5 on the TPU VM beside olmax, for the accelerator check's ``peers`` section
(benchmarks/chip_check.py): installs MaxText into a site of its own under $TMPDIR, runs its
trainer, one process per remat policy, and reads its printed step times and TFLOP/s.

The lent v5e has Python 3.11, JAX 0.10.2 and libtpu, its own package index and no registry.
MaxText 0.2.5 says Python >= 3.12 and lists every dependency under extras, so here it is:

- its wheel and the wheels the VM's index lacks (``maxtext_wheels.txt``, carried in
  ``.whl-maxtext/``; ``make tpu-peer-wheels``) installed with ``--no-deps`` over the packages of
  ``maxtext_requirements.txt`` from the VM's index and ``.whl-tpu/`` (with their dependencies,
  under the VM's own jax and jaxlib versions; where that resolve fails, each one alone);
- its two Python 3.12 ``type X = ...`` statements (``maxtext/kernels/mhc/``) rewritten as plain
  assignments in the installed copy;
- ``jax.experimental.xla_metadata.must_fuse_call``, which JAX 0.10.2 lacks and only a GPU kernel
  calls, defined as a stub by the launcher that runs the trainer (``LAUNCHER``);
- ``DECOUPLE_GCLOUD=TRUE`` (no Google Cloud clients), ``skip_jax_distributed_system=true`` (the VM
  has no sockets) and ``inhomogeneous_layer_cycle_interval=1`` (OLMo 3's period of 4 layers does
  not divide a 2-layer slice).

The shape is olmax's (``shape_of``: layers, widths, vocabulary, window, sequence, sequences per
device) through ``peers.maxtext_model_args``, the mapping the CPU peers benchmark uses.

    python benchmarks/tpu/maxtext_peer.py --rehearse   # the plan, lists and parsing, on any CPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE.parent) not in sys.path:  # benchmarks/, for peers.py
    sys.path.insert(0, str(HERE.parent))
from peers import maxtext_model_args, parse_maxtext_steps  # noqa: E402

WHEEL_LIST = HERE / "maxtext_wheels.txt"
REQUIREMENTS = HERE / "maxtext_requirements.txt"
WHEELS = ROOT / ".whl-maxtext"
TPU_WHEELS = ROOT / ".whl-tpu"
INDEX = os.environ.get("TPU_INDEX", "file:///opt/pypi/simple")
VERSION = "0.2.5"
# MaxText's policies, in order: its default (full, the recipe's own), the one the published MaxText
# reproduction names, then the one that keeps the attention output too.
REMAT = "full,minimal,minimal_with_context"
STEPS, WARMUP = 12, 2  # steps run; steps left out of the median (MaxText compiles before step 0)
BUSY_WAIT_S = 5  # before a second start where the chip was still held (KINDS.md: 5 s)
# A child that found the chip still held by the process before it (the VM's note: wait 5 s, again).
_CHIP_BUSY = re.compile(r"already in use|Unable to initialize backend 'tpu'|TPU initialization failed|"
                        r"Couldn't open device|Device or resource busy")
# absl's prefix of a "completed step" line: I1207 23:56:10.541007 ... completed step: 3
_STAMP = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d(?:\.\d+)?) .*completed step: (\d+)")
# Python 3.12's type statement, ``type Name = ...``, as the plain assignment 3.11 parses.
_TYPE_STMT = re.compile(r"^(\s*)type ([A-Za-z_]\w*) = ", re.M)

# Runs MaxText's trainer as ``python -m maxtext.trainers.pre_train.train`` would, with the one JAX
# name that 0.10.2 lacks defined first (imported by a GPU kernel's module; never called on a TPU).
LAUNCHER = '''"""olmax's launcher of MaxText's trainer on a JAX without must_fuse_call (written by maxtext_peer.py)."""
import runpy
import sys

import jax.experimental.xla_metadata as _xm

if not hasattr(_xm, "must_fuse_call"):
    def must_fuse_call(*args, **kwargs):
        raise NotImplementedError("must_fuse_call: a stub (JAX 0.10.2 has none); MaxText's GPU kernel only")
    _xm.must_fuse_call = must_fuse_call

sys.argv = ["maxtext.trainers.pre_train.train", *sys.argv[1:]]
runpy.run_module("maxtext.trainers.pre_train.train", run_name="__main__", alter_sys=True)
'''
LAUNCHER_NAME = "olmax_maxtext_train.py"


def pins(path: Path = WHEEL_LIST) -> list[str]:
    """``name==version`` lines of a wheel list (comments and blank lines left out); a line that
    pins no version is an error."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!-]+", line):
            raise ValueError(f"{path.name}: {line!r} is not name==version")
        out.append(line)
    return out


def names(path: Path = REQUIREMENTS) -> list[str]:
    return [n for n in (line.split("#", 1)[0].strip() for line in path.read_text().splitlines()) if n]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def check_wheels(folder: Path = WHEELS, wanted: list[str] | None = None) -> dict:
    """The carried folder against the list: each pin's wheel present exactly once (a wheel file is
    ``{name}-{version}-...whl``), nothing else there, and the size the call carries."""
    wanted = pins() if wanted is None else wanted
    files = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    have = {}
    for f in files:
        name, version = f.name.split("-")[:2]
        have.setdefault((_norm(name), version), []).append(f.name)
    want = {(_norm(p.split("==")[0]), p.split("==")[1]) for p in wanted}
    return {"folder": folder.name, "present": folder.is_dir(), "wheels": len(files),
            "missing": sorted(f"{n}=={v}" for n, v in want - set(have)),
            "unlisted": sorted(f for k, fs in have.items() if k not in want for f in fs),
            "duplicates": sorted(f for fs in have.values() if len(fs) > 1 for f in fs),
            "mib": round(sum(f.stat().st_size for f in files) / 2 ** 20, 1)}


def _pip(site: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--isolated", "-q", "--disable-pip-version-check",
            "--no-warn-script-location", "--no-compile", "--target", str(site)]


def install_plan(site: Path, index: str = INDEX, jax_pins: tuple[str, ...] = (),
                 wheels: Path = WHEELS, tpu_wheels: Path = TPU_WHEELS) -> dict[str, list[list[str]]]:
    """The pip commands, by stage: ``resolve`` (the requirements with their dependencies from the
    VM's index and both carried folders, under ``jax_pins``, a constraints file next to ``site``),
    else ``plain`` (the same names without dependencies), else ``each`` (one name a command, what
    is missing skipped); then ``carried`` (every wheel of the list, without dependencies, over
    what the index gave)."""
    src = ["--index-url", index, "--find-links", str(tpu_wheels), "--find-links", str(wheels), "--only-binary=:all:"]
    constraints = site.parent / (site.name + "-constraints.txt")
    carried = [str(wheels / f) for f in sorted(os.listdir(wheels))] if wheels.is_dir() else [str(wheels / "*.whl")]
    return {"resolve": [_pip(site) + src + ["-r", str(REQUIREMENTS)] + (["-c", str(constraints)] if jax_pins else [])],
            "plain": [_pip(site) + src + ["--no-deps", "-r", str(REQUIREMENTS)]],
            "each": [_pip(site) + src + ["--no-deps", n] for n in names()],
            "carried": [_pip(site) + ["--no-index", "--no-deps", "--ignore-requires-python", "--upgrade", *carried]]}


def patch_py311(site: Path) -> list[str]:
    """Rewrites each ``type Name = ...`` statement under ``site/maxtext`` as ``Name = ...``;
    returns ``file:line`` of each (two in MaxText 0.2.5, both in ``kernels/mhc/``)."""
    done = []
    for path in sorted((site / "maxtext").rglob("*.py")):
        text = path.read_text()
        if "type " not in text or not _TYPE_STMT.search(text):
            continue
        for m in _TYPE_STMT.finditer(text):
            done.append(f"{path.relative_to(site)}:{text.count(chr(10), 0, m.start()) + 1}")
        path.write_text(_TYPE_STMT.sub(r"\1\2 = ", text))
    return done


def install(site: Path, log: Path, index: str = INDEX) -> dict:
    """MaxText into ``site`` (made afresh) by ``install_plan``, then ``patch_py311`` and the
    launcher. Raises RuntimeError when the carried wheels do not install."""
    import jax
    import jaxlib
    t0 = time.perf_counter()
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    jax_pins = (f"jax=={jax.__version__}", f"jaxlib=={jaxlib.__version__}")
    (site.parent / (site.name + "-constraints.txt")).write_text("\n".join(jax_pins) + "\n")
    plan = install_plan(site, index, jax_pins)
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    out: dict = {"jax_pins": list(jax_pins), "missing_from_index": []}

    def pip(cmd: list[str]) -> bool:
        with open(log, "a") as f:
            f.write(f"$ pip {' '.join(cmd[3:])}\n")
            f.flush()
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode == 0

    if pip(plan["resolve"][0]):
        out["index_stage"] = "resolve"
    elif pip(plan["plain"][0]):
        out["index_stage"] = "plain"
    else:
        out["index_stage"] = "each"
        out["missing_from_index"] = [cmd[-1] for cmd in plan["each"] if not pip(cmd)]
    if not pip(plan["carried"][0]):
        raise RuntimeError(f"the carried MaxText wheels did not install (log: {log.name}): "
                           + "".join(open(log).readlines()[-8:]))
    out["py311_rewrites"] = patch_py311(site)
    (site / LAUNCHER_NAME).write_text(LAUNCHER)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def shape_of(cfg) -> dict:
    """An olmax config's model and step as ``peers``' shape keys (one device's sequences)."""
    m = cfg.model
    return {"layers": m.n_layers, "d": m.d_model, "heads": m.n_heads, "kv_heads": m.n_kv_heads,
            "head_dim": m.head_dim, "mlp": m.mlp_hidden, "vocab": m.vocab_size, "window": m.sliding_window,
            "seq": cfg.data.sequence_length, "batch": cfg.train.global_batch_size}


def train_args(shape: dict, remat: str, steps: int, out_dir: str) -> list[str]:
    """MaxText's trainer on the chip at ``shape``: synthetic data, its flash (splash) kernel, bf16
    compute, fp32 weights, scanned layers, ``remat``; no checkpoints, no TensorBoard."""
    return [f"run_name=peer_{remat}", f"base_output_directory={out_dir}", "hardware=tpu",
            "skip_jax_distributed_system=true", "dataset_type=synthetic", *maxtext_model_args(shape),
            "inhomogeneous_layer_cycle_interval=1", f"steps={steps}", "attention=flash", "dtype=bfloat16",
            "weight_dtype=float32", "scan_layers=true", f"remat_policy={remat}", "enable_checkpointing=false",
            "enable_tensorboard=false"]


def child_env(site: Path, base: dict | None = None) -> dict:
    """The trainer's environment: this one's (the TPU_ variables, the VM's JAX on PYTHONPATH) with
    MaxText's site right after the PYTHONPATH entry that holds the VM's JAX (so that JAX stays the
    VM's and MaxText's packages come before olmax's), and olmax's ``src`` left out."""
    env = dict(os.environ if base is None else base, DECOUPLE_GCLOUD="TRUE", PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="1")
    src = str(ROOT / "src")
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != src]
    at = max([i + 1 for i, p in enumerate(path) if os.path.isdir(os.path.join(p, "jax"))], default=len(path))
    env["PYTHONPATH"] = os.pathsep.join(path[:at] + [str(site)] + path[at:])
    return env


def log_clock(lines: list[str], warmup: int = WARMUP) -> float | None:
    """Seconds a step by the log's own clock: from the line of step ``warmup - 1`` to the last
    step's, over the steps between (a cross-check of MaxText's per-step figures, which an
    asynchronous dispatch can shift between neighbouring steps)."""
    t = {}
    for m in map(_STAMP.search, lines):
        if m:
            t[int(m[4])] = int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
    last = max(t, default=-1)
    if warmup - 1 not in t or last <= warmup - 1:
        return None
    return ((t[last] - t[warmup - 1]) % 86400) / (last - warmup + 1)


def summarize(steps: dict[int, dict], tokens_per_step: int, peak_tflops: float, warmup: int = WARMUP) -> dict:
    """Median step time after ``warmup`` steps, tokens/s, MaxText's own TFLOP/s per device (the
    median of what it printed for the same steps) and that as a share of ``peak_tflops``."""
    timed = [steps[k] for k in sorted(steps) if k >= warmup]
    if not timed:
        raise ValueError(f"no step after the {warmup} warm-up steps ({len(steps)} printed)")
    dt = statistics.median(s["seconds"] for s in timed)
    tf = [s["tflops_per_device"] for s in timed if s["tflops_per_device"] is not None]
    tflops = statistics.median(tf) if tf else None
    loss = timed[-1]["loss"]
    return {"steps_printed": len(steps), "steps_timed": len(timed), "step_seconds": [s["seconds"] for s in timed],
            "step_seconds_median": dt, "tokens_per_second": tokens_per_step / dt, "tflops_per_second": tflops,
            "mfu_vs_datasheet": tflops / peak_tflops if tflops else None, "loss_last": loss,
            "finite": loss is not None and loss == loss and abs(loss) != float("inf")}


def run_row(site: Path, shape: dict, remat: str, work: Path, peak_tflops: float, steps: int = STEPS,
            timeout_s: float = 300) -> dict:
    """One MaxText run (its own process, ``work/remat`` its directory) and its ``summarize``d row;
    started again once, 5 s later, where the chip was still held by the process before it."""
    d = work / remat
    args = train_args(shape, remat, steps, str(d / "out"))
    row: dict = {"remat": remat, "args": [a for a in args if not a.startswith("base_output_directory=")]}
    for attempt in (1, 2):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        log = d / "maxtext.log"
        t0 = time.perf_counter()
        try:
            with open(log, "w") as f:
                rc = subprocess.run([sys.executable, str(site / LAUNCHER_NAME), *args], stdout=f,
                                    stderr=subprocess.STDOUT, env=child_env(site), cwd=d, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        row["wall_seconds"] = round(time.perf_counter() - t0, 1)
        text = log.read_text(errors="replace")
        if rc != 0 and attempt == 1 and _CHIP_BUSY.search(text):
            row["retried"] = _CHIP_BUSY.search(text)[0]
            time.sleep(BUSY_WAIT_S)
            continue
        break
    steps_seen = parse_maxtext_steps(text.splitlines())
    if rc != 0 or not steps_seen:
        row["error"] = f"exit {rc}, {len(steps_seen)} steps printed"
        row["log_tail"] = text[-3000:].replace(str(site), "$SITE").replace(str(work), "$WORK")
        return row
    return {**row, **summarize(steps_seen, shape["seq"] * shape["batch"], peak_tflops),
            "step_seconds_log_clock": log_clock(text.splitlines())}


def run_rows(shape: dict, policies: list[str], peak_tflops: float, on_row: Callable[[dict], None],
             budget_s: float = 300, steps: int = STEPS) -> dict:
    """Install, then one ``run_row`` per policy while ``budget_s`` (from the start) allows; calls
    ``on_row`` with the result so far after the install and after each row. Call it while this
    process holds no JAX backend: each trainer opens the chip itself."""
    t0 = time.perf_counter()
    tmp = Path(os.environ.get("TMPDIR") or "/tmp")
    site, work = tmp / "olmax-maxtext-site", tmp / "olmax-maxtext-runs"
    res: dict = {"version": VERSION, "shape": shape, "tokens_per_step": shape["seq"] * shape["batch"],
                 "wheels": check_wheels(), "rows": {}}
    if res["wheels"]["missing"] or not res["wheels"]["present"]:
        res["error"] = (f"{WHEELS.name}/ lacks {', '.join(res['wheels']['missing']) or 'everything'}: run "
                        f"'make tpu-peer-wheels' where the registry is and carry {WHEELS.name}")
        on_row(res)
        return res
    work.mkdir(parents=True, exist_ok=True)
    try:
        res["install"] = install(site, work / "install.log")
    except Exception as e:  # the olmax rows still run
        res["error"] = f"install: {type(e).__name__}: {e}"[:3000]
        on_row(res)
        return res
    on_row(res)
    for remat in policies:
        if time.perf_counter() - t0 > budget_s:
            res["rows"][remat] = {"skipped": f"past the MaxText budget of {budget_s:.0f} s"}
            continue
        res["rows"][remat] = run_row(site, shape, remat, work, peak_tflops, steps)
        on_row(res)
        time.sleep(2)  # the chip is taken back a moment after its process ends
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def ratios(olmax: dict[str, dict], maxtext: dict[str, dict]) -> dict:
    """olmax's tokens/s over MaxText's at each side's fastest row and at full remat on both (the
    recipe's own policy, and MaxText's default); ``olmax`` keyed by its policies (``recipe``: the
    recipe's own, full remat)."""
    ok = lambda rows: {k: r for k, r in rows.items() if r.get("tokens_per_second")}  # noqa: E731
    o, m = ok(olmax), ok(maxtext)
    out: dict = {}
    if o and m:
        bo, bm = max(o, key=lambda k: o[k]["tokens_per_second"]), max(m, key=lambda k: m[k]["tokens_per_second"])
        out["at_each_best"] = {"olmax_remat": bo, "maxtext_remat": bm,
                               "olmax_over_maxtext": o[bo]["tokens_per_second"] / m[bm]["tokens_per_second"]}
    full = next((k for k in sorted(o, key=lambda k: k != "recipe") if o[k].get("remat") == "full"), None)
    if full and "full" in m:
        out["at_full_remat"] = {"olmax_remat": full, "maxtext_remat": "full",
                                "olmax_over_maxtext": o[full]["tokens_per_second"] / m["full"]["tokens_per_second"]}
    return out


def _canned() -> str:
    """MaxText's lines at the slice's numbers (the first v5e run's full-remat step, about 0.34 s and
    83 TFLOP/s), stamped by a clock that passes midnight, for the rehearsal."""
    lines, t = [], 86400.0 - 42.5  # steps 1 and 2 either side of midnight
    for k in range(STEPS):
        sec = 41.95 if k == 0 else 0.412 if k == 1 else 0.338 + 0.001 * (k % 3)
        tf = 82.9 - 0.2 * (k % 3) if k > 1 else 0.671 if k == 0 else 68.3
        t += sec
        hh, rest = divmod(t % 86400, 3600)
        mm, ss = divmod(rest, 60)
        lines.append(f"I1207 {int(hh):02d}:{int(mm):02d}:{ss:09.6f} 1 metric_logger.py:265] completed step: {k}, "
                     f"seconds: {sec:.3f}, TFLOP/s/device: {tf:.3f}, Tokens/s/device: {8192 / sec:.1f}, "
                     f"total_weights: 8192, loss: {10.4 - 0.05 * k:.3f}, lm_loss: {10.4 - 0.05 * k:.3f}, "
                     f"perplexity: 1.0\n")
    return "".join(lines)


CANNED_LOG = _canned()


def rehearse(shape: dict | None = None) -> dict:
    """What the chip will run, checked on any CPU: the lists, the install plan, the launcher, the
    3.11 rewrite (on a file written for it), the trainer's command line and environment, and the
    parsing of MaxText's log lines into a row and the ratios. Raises AssertionError on a fault."""
    import tempfile
    shape = shape or {"layers": 2, "d": 4096, "heads": 32, "kv_heads": 32, "head_dim": 128, "mlp": 11008,
                      "vocab": 32768, "window": 4096, "seq": 4096, "batch": 2}
    wanted = pins()
    assert wanted[0] == f"maxtext=={VERSION}" and any(p.startswith("tokamax==0.0.12") for p in wanted), wanted
    listed = {_norm(p.split("==")[0]) for p in wanted}
    both = listed & {_norm(n) for n in names()}
    assert not both, f"in both {WHEEL_LIST.name} and {REQUIREMENTS.name}: {sorted(both)}"
    tpu = {_norm(p.split("==")[0]) for p in pins(HERE / "wheels.txt")}
    assert not listed & tpu, f"already carried in .whl-tpu: {sorted(listed & tpu)}"
    with tempfile.TemporaryDirectory() as d:
        site = Path(d) / "site"
        plan = install_plan(site, "file:///index", ("jax==0.10.2", "jaxlib==0.10.2"))
        assert "--ignore-requires-python" in plan["carried"][0] and "--no-deps" in plan["carried"][0]
        assert plan["resolve"][0][-2:] == ["-c", str(Path(d) / "site-constraints.txt")]
        assert all("--target" in c and str(site) in c for cs in plan.values() for c in cs)
        assert len(plan["each"]) == len(names())
        mhc = site / "maxtext" / "kernels" / "mhc"
        mhc.mkdir(parents=True)
        (mhc / "common.py").write_text("import jax\n# type hints\ntype KernelContext = tuple[jax.Array, jax.Array]\n"
                                       "def f(type=None):\n    return type\n")
        rewrites = patch_py311(site)
        assert rewrites == ["maxtext/kernels/mhc/common.py:3"], rewrites
        compile((mhc / "common.py").read_text(), "common.py", "exec")  # parses as 3.11 (and 3.10) code
        compile(LAUNCHER, LAUNCHER_NAME, "exec")
        vm, other = Path(d) / "vm", Path(d) / "other"  # the VM's folder holds its JAX
        (vm / "jax").mkdir(parents=True)
        env = child_env(site, {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(vm), str(other)]),
                               "TPU_ACCELERATOR_TYPE": "v5e"})
        assert env["DECOUPLE_GCLOUD"] == "TRUE" and env["TPU_ACCELERATOR_TYPE"] == "v5e"
        assert env["PYTHONPATH"].split(os.pathsep) == [str(vm), str(site), str(other)], env["PYTHONPATH"]
    args = train_args(shape, "full", STEPS, "OUT")
    for a in ("skip_jax_distributed_system=true", "inhomogeneous_layer_cycle_interval=1", "attention=flash",
              "dtype=bfloat16", "weight_dtype=float32", "scan_layers=true", "remat_policy=full",
              "dataset_type=synthetic", "model_name=olmo3-7b-pt", f"base_num_decoder_layers={shape['layers']}",
              f"vocab_size={shape['vocab']}", f"max_target_length={shape['seq']}",
              f"per_device_batch_size={shape['batch']}", f"steps={STEPS}"):
        assert a in args, (a, args)
    keys = [a.split("=")[0] for a in args]
    assert len(keys) == len(set(keys)), f"a key given twice: {args}"
    row = summarize(parse_maxtext_steps(CANNED_LOG.splitlines()), shape["seq"] * shape["batch"], 197.0)
    assert row["steps_timed"] == STEPS - WARMUP and abs(row["step_seconds_median"] - 0.339) < 1e-9, row
    assert abs(row["tflops_per_second"] - 82.7) < 1e-9 and row["finite"], row
    clock = log_clock(CANNED_LOG.splitlines())
    assert clock is not None and abs(clock - 0.339) < 2e-3, clock
    r = ratios({"recipe": {"remat": "full", "tokens_per_second": 2 * row["tokens_per_second"]},
                "none": {"remat": "none", "tokens_per_second": 3 * row["tokens_per_second"]}},
               {"full": row, "minimal": {**row, "tokens_per_second": 1.5 * row["tokens_per_second"]}})
    assert r["at_full_remat"]["olmax_over_maxtext"] == 2.0 and r["at_each_best"]["olmax_over_maxtext"] == 2.0, r
    assert (r["at_each_best"]["olmax_remat"], r["at_each_best"]["maxtext_remat"]) == ("none", "minimal"), r
    return {"wheels": len(wanted), "index_names": len(names()), "args": args, "row": row, "ratios": r,
            "carried": check_wheels()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rehearse", action="store_true", help="check the plan, lists and parsing here (no install)")
    args = ap.parse_args()
    if not args.rehearse:
        ap.error("on a chip, run the check's peers section (benchmarks/chip_check.py --only ...,peers)")
    print(json.dumps(rehearse(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
