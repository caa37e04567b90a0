"""olmax against OLMo-core and MaxText: the same OLMo 3 model, each through its own trainer, in one run.

For each size, one token file (raw uint32, EOS-separated documents) is written and each system
trains on it with its own loader, optimizer and logging, fp32 on this machine's devices. Each
step's wall time is taken the way the system reports it (olmax: metrics.jsonl throughput;
OLMo-core: time between its trainer's pre-step callbacks; MaxText: its "completed step"
lines); the median after the warm-up steps gives tokens/s, and the ratios olmax / peer are
printed, with each system's model FLOP/s (OLMo-core's formula) as a share of this machine's
fp32 matmul peak measured in the same run. Run nothing else on the machine meanwhile.

    .venv/bin/python benchmarks/peers.py [--sizes tiny,small,100m,...] [--systems olmax,olmo-core,maxtext]
        [--repeats N] [--allocator kept|glibc|both] [--steps N] [--warmup N] [--out DIR] [--json FILE]

Every size is run ``--repeats`` times per system (3 by default), interleaved: round r starts
with the r-th system, so no system always runs first or last on a warming or loaded machine.
The table gives each system's median tokens/s over its runs with the lowest and highest, and
each ratio of medians with the range the runs' extremes allow. Every system runs with the same
allocator choice (``--allocator``; see ``ALLOCATORS``), or with each choice in turn (``both``).

OLMo-core (``ai2-olmo-core``, torch CPU) comes with the test install. MaxText needs Python
3.12: the first run makes a venv in ``.peers/maxtext-venv`` (ignored by git; about 3 minutes,
2.8 GB) with ``maxtext[tpu]==0.2.5`` and reuses it afterwards. A peer that cannot run is named
with the reason, and the others still run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAXTEXT = "maxtext[tpu]==0.2.5"

# name: (layers, d_model, heads, kv heads, head dim, mlp, vocab, window, sequence, batch, default steps)
SIZES = {
    "tiny": (4, 256, 4, 4, 64, 768, 512, 64, 256, 4, 40),
    "small": (6, 512, 8, 8, 64, 1536, 8192, 128, 512, 4, 20),
    "100m": (8, 768, 12, 12, 64, 2048, 50304, 256, 1024, 2, 12),
    # a fourth shape, measured beside the first three
    "d384": (6, 384, 6, 6, 64, 1024, 512, 128, 512, 4, 20),
    # grouped-query attention (4 query heads per key/value head, as the 32B's 40 / 8 = 5)
    "gqa": (6, 512, 8, 2, 64, 1536, 8192, 128, 512, 4, 20),
    # heads of 128 (the 7B's width per head)
    "head128": (4, 512, 4, 4, 128, 1536, 8192, 256, 512, 4, 20),
    # OLMo 3's own vocabulary size (100,278 padded to 100,352)
    "vocab100k": (4, 256, 4, 4, 64, 768, 100352, 64, 256, 4, 20),
}
EOS, PAD = 0, 1
# The allocator choice every system runs with. glibc's tunables set, for any process, what
# `olmax.keep_freed_memory` sets with mallopt (one arena, no mmap'd blocks, never trim, grow the
# heap 64 MiB at a time); olmax is told to leave glibc alone (OLMAX_MALLOC=system) so that all
# three get the same settings the same way.
ALLOCATORS = {
    "kept": {"GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                               f"glibc.malloc.trim_threshold={1 << 62}:glibc.malloc.top_pad={64 << 20}"},
    "glibc": {},  # glibc's defaults
}


def shape(size: str) -> dict:
    L, d, h, kv, hd, mlp, vocab, window, seq, batch, steps = SIZES[size]
    return dict(layers=L, d=d, heads=h, kv_heads=kv, head_dim=hd, mlp=mlp, vocab=vocab, window=window, seq=seq,
                batch=batch, steps=steps)


def allocator_env(allocator: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    return dict(env, OLMAX_MALLOC="system", **ALLOCATORS[allocator])


def write_tokens(path: Path, vocab: int, n: int) -> None:
    import numpy as np
    rng = np.random.default_rng(0)
    parts, total = [], 0
    while total < n:
        doc = rng.integers(2, vocab, int(rng.integers(50, 2000)))
        parts += [doc, [EOS]]
        total += len(doc) + 1
    np.concatenate(parts).astype("<u4").tofile(path)


def olmax_overrides(s: dict, tokens: Path) -> list[str]:
    return [f"data.paths={tokens}", "data.dtype=uint32", f"data.eos_token_id={EOS}", f"data.pad_token_id={PAD}",
            f"model.vocab_size={s['vocab']}", f"model.padded_vocab_size={s['vocab']}", f"model.d_model={s['d']}",
            f"model.n_layers={s['layers']}", f"model.n_heads={s['heads']}", f"model.n_kv_heads={s['kv_heads']}",
            f"model.head_dim={s['head_dim']}", f"model.mlp_hidden={s['mlp']}", f"model.sliding_window={s['window']}",
            f"data.sequence_length={s['seq']}", f"train.global_batch_size={s['batch']}", f"train.steps={s['steps']}",
            "train.log_interval=1", "checkpoint.interval=1000000", "eval.heldout_paths="]


class PeerUnavailable(Exception):
    """A system that cannot run here; the message says why."""


def _run(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> None:
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if r.returncode != 0:
        tail = "".join(open(log).readlines()[-15:])
        raise PeerUnavailable(f"exited {r.returncode}; last lines of {log}:\n{tail}")


def run_olmax(s: dict, tokens: Path, out: Path, env: dict) -> list[float]:
    run = out / "olmax"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "olmax.cli", "train", "tiny", "--run-dir", str(run), "--no-progress"]
    for o in olmax_overrides(s, tokens):
        cmd += ["--set", o]
    _run(cmd, out / "olmax.log", env=env)
    tok = s["seq"] * s["batch"]
    times = {}
    for line in open(run / "metrics.jsonl"):
        r = json.loads(line)
        if "throughput/device/TPS" in r and r["throughput/device/TPS"] > 0:
            times[r["step"]] = tok / r["throughput/device/TPS"]  # one device on a CPU machine
    return [times[k] for k in sorted(times)]


def run_olmo_core(s: dict, tokens: Path, out: Path, env: dict) -> list[float]:
    try:
        import olmo_core  # noqa: F401
    except ImportError as e:
        raise PeerUnavailable(f"OLMo-core is not installed ({e}); `pip install -e '.[verify]'` brings it") from None
    res = out / "olmo_core.json"
    cmd = [sys.executable, __file__, "--_olmo-core-worker", json.dumps({"shape": s, "tokens": str(tokens),
                                                                         "work": str(out / "olmo_core"),
                                                                         "result": str(res)})]
    _run(cmd, out / "olmo_core.log", env=env)
    return json.load(open(res))


def _olmo_core_worker(spec: dict) -> None:
    """OLMo-core's own Trainer, SkipStepAdamW, schedule, NumpyFSLDataset and loader on the model and
    optimizer ``olmax.verify.olmo_core.run_olmo_core`` builds for the same olmax config (the
    training-parity reference), collecting metrics every 5 steps as OLMo-core does by default."""
    from olmax.recipes import get_recipe
    from olmax.verify.olmo_core import run_olmo_core

    work = Path(spec["work"])
    shutil.rmtree(work, ignore_errors=True)
    cfg = get_recipe("tiny", olmax_overrides(spec["shape"], Path(spec["tokens"])))
    starts = run_olmo_core(cfg, [spec["tokens"]], work, None, metrics_interval=5).starts
    json.dump([b - a for a, b in zip(starts, starts[1:])], open(spec["result"], "w"))


def _python312() -> str | None:
    for c in [shutil.which("python3.12")] + sorted(
            glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))):
        if c and subprocess.run([c, "--version"], capture_output=True).returncode == 0:
            return c
    return None


def maxtext_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import maxtext"], capture_output=True).returncode == 0:
        return py
    base = _python312()
    if base is None:
        raise PeerUnavailable("MaxText needs Python 3.12 (every MaxText release does) and none was found "
                              "(python3.12 on PATH or ~/.pyenv/versions/3.12*)")
    print(f"installing {MAXTEXT} into {venv} (once; about 3 minutes)...", file=sys.stderr, flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / "maxtext-install.log"
    _run([base, "-m", "venv", str(venv)], log)
    _run([str(py), "-m", "pip", "install", "--quiet", MAXTEXT], log)
    return py


def maxtext_env(base: dict | None = None) -> dict:
    """The environment MaxText runs in, from ``base`` (default this process's): JAX on the CPU, no
    Google Cloud lookups, and nothing that points into olmax's venv. MaxText has its own: olmax's
    ``PYTHONPATH`` would shadow its packages, and ``TPU_LIBRARY_PATH`` (which the libtpu package sets
    when olmax imports it) would make MaxText's newer JAX compile with olmax's older libtpu, which
    cannot read the Pallas kernels that JAX writes ("unknown attribute code" in the Mosaic module)."""
    env = dict(os.environ if base is None else base, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE",
               PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="1")
    for inherited in ("PYTHONPATH", "TPU_LIBRARY_PATH"):
        env.pop(inherited, None)
    return env


# MaxText's per-step line: "completed step: 3, seconds: 0.340, TFLOP/s/device: 82.8, Tokens/s/device:
# 24094.1, total_weights: 8192, loss: 10.4, ..." (its metric_logger).
_MT_STEP = re.compile(r"completed step: (\d+), seconds: ([\d.]+)(?:, TFLOP/s/device: ([\d.]+))?"
                      r"(?:, Tokens/s/device: ([\d.]+))?(?:.*?, loss: ([\d.naif]+))?")


def parse_maxtext_steps(lines) -> dict[int, dict]:
    """Each "completed step" line MaxText printed: step -> its seconds and, where printed, its
    TFLOP/s and tokens/s per device and its loss."""
    steps = {}
    for m in map(_MT_STEP.search, lines):
        if m:
            steps[int(m[1])] = {"seconds": float(m[2]), "tflops_per_device": float(m[3]) if m[3] else None,
                                "tokens_per_device": float(m[4]) if m[4] else None,
                                "loss": float(m[5]) if m[5] else None}
    return steps


def maxtext_model_args(s: dict) -> list[str]:
    """MaxText's own OLMo 3 model (``olmo3-7b-pt``, its olmo3 decoder block) at the shape ``s``
    (``shape``'s keys) and ``s['batch']`` sequences of ``s['seq']`` tokens per device."""
    return ["model_name=olmo3-7b-pt", "override_model_config=true", f"base_num_decoder_layers={s['layers']}",
            f"base_emb_dim={s['d']}", f"base_num_query_heads={s['heads']}", f"base_num_kv_heads={s['kv_heads']}",
            f"head_dim={s['head_dim']}", f"base_mlp_dim={s['mlp']}", f"vocab_size={s['vocab']}",
            f"sliding_window_size={s['window']}", f"max_target_length={s['seq']}",
            f"per_device_batch_size={s['batch']}"]


def run_maxtext(s: dict, tokens: Path, out: Path, venv: Path, env: dict) -> list[float]:
    py = maxtext_venv(venv)
    work = out / "maxtext"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    index = work / f"index_seq{s['seq']}.json"
    _run([str(py), "-c", "import sys\nfrom maxtext.input_pipeline.olmo_data import build_index, "
          "read_raw_metadata_from_path\nbuild_index([(sys.argv[1], 'bench')], int(sys.argv[2]), tokenizer='none', "
          "header_reader=lambda p: read_raw_metadata_from_path(p, 'uint32')).save(sys.argv[3])",
          str(tokens), str(s["seq"]), str(index)], out / "maxtext_index.log")
    env = maxtext_env(env)
    log = out / "maxtext.log"
    # MaxText's olmo3 decoder block shrunk to the shape, fp32, its own grain reader of OLMo token files.
    _run([str(py), "-m", "maxtext.trainers.pre_train.train", "run_name=bench", f"base_output_directory={work / 'out'}",
          "hardware=cpu", "skip_jax_distributed_system=true", "dataset_type=olmo_grain",
          f"olmo_index_path={index}", "olmo_apply_ngram_filter=False", *maxtext_model_args(s),
          f"steps={s['steps']}", "learning_rate=3e-4", "dtype=float32", "weight_dtype=float32",
          "remat_policy=minimal_with_context", "enable_checkpointing=false", "enable_tensorboard=false"],
         log, env=env, cwd=work)
    with open(log) as f:
        steps = parse_maxtext_steps(f)
    if not steps:
        raise PeerUnavailable(f"no 'completed step' lines in {log}")
    return [steps[k]["seconds"] for k in sorted(steps)]


def _stats(tps: list[float]) -> dict:
    med = statistics.median(tps)
    return {"tokens_per_s": med, "runs": tps, "min": min(tps), "max": max(tps), "spread": (max(tps) - min(tps)) / med}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--systems", default="olmax,olmo-core,maxtext")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: per size)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the median (default: a quarter)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per system and size, interleaved (each round starts with the next system)")
    ap.add_argument("--allocator", choices=("kept", "glibc", "both"), default="kept",
                    help="kept: every system with glibc tuned to keep freed memory (olmax's own choice, set the "
                         "same way for all through GLIBC_TUNABLES); glibc: glibc's defaults for all; both: each")
    ap.add_argument("--out", default=str(REPO / "runs" / "peers"))
    ap.add_argument("--maxtext-venv", default=str(REPO / ".peers" / "maxtext-venv"))
    ap.add_argument("--json", default=None, help="also write the table here")
    ap.add_argument("--_olmo-core-worker", dest="worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _olmo_core_worker(json.loads(a.worker))
        return 0
    sizes = a.sizes.split(",")
    systems = a.systems.split(",")
    bad = [x for x in sizes if x not in SIZES] + [x for x in systems if x not in ("olmax", "olmo-core", "maxtext")]
    if bad:
        ap.error(f"unknown size or system: {', '.join(bad)}")
    if a.repeats < 1:
        ap.error(f"--repeats {a.repeats}: at least 1")
    allocators = ["kept", "glibc"] if a.allocator == "both" else [a.allocator]
    out_root = Path(a.out).resolve()  # the peers run in other working directories
    # Measured in a child process: a JAX runtime idling in this one would share the cores.
    peak = float(subprocess.run([sys.executable, "-c", "import olmax, sys; sys.path.insert(0, sys.argv[1]); "
                                 "from bench_train import matmul_peak; print(matmul_peak())",
                                 str(Path(__file__).parent)],
                                capture_output=True, text=True, check=True).stdout.split()[-1])
    print(f"peers benchmark, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, fp32 matmul peak "
          f"{peak / 1e9:.0f} GFLOP/s; load average before: {os.getloadavg()[0]:.2f}; {a.repeats} interleaved "
          f"run(s) per system, allocator {' and '.join(allocators)}", flush=True)
    rows = [{"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "matmul_peak_flops": peak,
             "repeats": a.repeats, "allocators": allocators}]
    from olmax.metrics.flops import flops_per_token
    from olmax.recipes import get_recipe
    for size in sizes:
        s = shape(size)
        if a.steps:
            s["steps"] = a.steps
        warm = a.warmup if a.warmup is not None else max(2, s["steps"] // 4)
        if s["steps"] <= warm:
            ap.error(f"--steps {s['steps']} leaves no step after {warm} warm-up steps")
        out = out_root / size
        out.mkdir(parents=True, exist_ok=True)
        tokens = out / "tokens.u32"
        write_tokens(tokens, s["vocab"], max(2_000_000, 4 * s["steps"] * s["seq"] * s["batch"]))
        tok = s["seq"] * s["batch"]
        fl_tok = flops_per_token(get_recipe("tiny", olmax_overrides(s, tokens)).model, s["seq"])["total"]
        print(f"{size}: {s['layers']} layers, d_model {s['d']}, {s['heads']} heads ({s['kv_heads']} kv) x "
              f"{s['head_dim']}, MLP {s['mlp']}, vocab {s['vocab']}, window {s['window']}, sequence {s['seq']}, "
              f"batch {s['batch']} ({tok} tokens/step), {s['steps']} steps, median after {warm}", flush=True)
        result: dict = {"size": size, "shape": s, "warmup": warm}
        tps: dict[tuple[str, str], list[float]] = {(n, al): [] for n in systems for al in allocators}
        down: dict[str, str] = {}
        for rep in range(a.repeats):
            k = rep % len(systems)
            for al in allocators:
                env = allocator_env(al)
                for name in systems[k:] + systems[:k]:
                    if name in down:
                        continue
                    t0 = time.perf_counter()
                    try:
                        if name == "olmax":
                            times = run_olmax(s, tokens, out, env)
                        elif name == "olmo-core":
                            times = run_olmo_core(s, tokens, out, env)
                        else:
                            times = run_maxtext(s, tokens, out, Path(a.maxtext_venv), env)
                        if not times[warm:]:
                            raise PeerUnavailable(f"reported only {len(times)} step times")
                    except PeerUnavailable as e:
                        print(f"  {name:10s} cannot run: {e}", flush=True)
                        down[name] = str(e)
                        continue
                    med = statistics.median(times[warm:])
                    tps[(name, al)].append(tok / med)
                    print(f"  run {rep + 1}/{a.repeats} {name:10s} [{al}] median step {med:8.4f} s  "
                          f"{tok / med:10.0f} tokens/s  (run {time.perf_counter() - t0:.0f} s)", flush=True)
        for al in allocators:
            res = {n: _stats(tps[(n, al)]) if tps[(n, al)] else None for n in systems}
            for n, r in res.items():
                if r:
                    r["of_matmul_peak"] = r["tokens_per_s"] * fl_tok / peak
                    print(f"  {n:10s} [{al}] median {r['tokens_per_s']:8.0f} tokens/s over {len(r['runs'])} run(s), "
                          f"{r['min']:.0f} to {r['max']:.0f} ({100 * r['spread']:.1f}% spread), "
                          f"{r['of_matmul_peak']:.2f} of peak", flush=True)
            mine = res.get("olmax")
            for peer in ("olmo-core", "maxtext"):
                other = res.get(peer)
                if mine and other:
                    res[f"olmax/{peer}"] = {"median": mine["tokens_per_s"] / other["tokens_per_s"],
                                            "low": mine["min"] / other["max"], "high": mine["max"] / other["min"]}
                    q = res[f"olmax/{peer}"]
                    print(f"  olmax/{peer} [{al}] {q['median']:.2f}x (medians; {q['low']:.2f}x to {q['high']:.2f}x "
                          f"over the runs' extremes)", flush=True)
            result[al] = res
        result["unavailable"] = down
        rows.append(result)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
