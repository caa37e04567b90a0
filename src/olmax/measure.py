"""A train step compiled, run and timed on this machine's devices: the state it runs on
(``train_state``: parameters from key 0, the optimizer state, random tokens), the compile step and
the median of a few steps (``time_step``), an out-of-memory error told from a bug
(``out_of_memory``: at XLA's compile or at run time), XLA's memory analysis of a lowered program
(``compiled_memory``, which ``olmax compile`` reads for a TPU topology too) and the rates an
estimate without XLA's time is priced at (``device_rates``: the datasheet's, else measured).
``olmax compile --sweep --measure`` times each candidate with it and the accelerator check
(``benchmarks/chip_check.py``) its train rows: one place for how a step is timed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import Config

GiB = 1024 ** 3


@dataclass
class TrainState:
    """What a train step runs on: the mesh, the batch plan, the state's shardings, the parameters
    and optimizer state (replaced by each step, which donates them) and a batch of random tokens.
    Unpacks as ``mesh, plan, pshard, oshard, params, opt, data``."""
    mesh: Any
    plan: Any
    pshard: Any
    oshard: Any
    params: Any
    opt: Any
    data: dict

    def __iter__(self):
        return iter((self.mesh, self.plan, self.pshard, self.oshard, self.params, self.opt, self.data))

    def deleted(self) -> bool:
        """Whether a step that failed after taking the state (donated) left it unusable."""
        return any(a.is_deleted() for a in jax.tree.leaves((self.params, self.opt)))


def plan_for(cfg: Config, mesh: Any, batch: int | None = None) -> Any:
    from olmax.sharding import plan_batch
    return plan_batch(batch or cfg.train.global_batch_size, dict(mesh.shape), cfg.train.micro_batch_size,
                      cfg.train.max_micro_batch_size)


def train_state(cfg: Config, batch: int | None = None) -> TrainState:
    """``cfg``'s train state on this process's devices (``cfg.mesh``): parameters initialised from
    key 0, the optimizer state, and ``batch`` (default ``train.global_batch_size``) sequences of
    random tokens, every label trained."""
    from olmax.checkpoint.state import abstract_train_state, shardings
    from olmax.model.params import init_params
    from olmax.optim import init_opt_state
    from olmax.sharding import batch_sharding, make_mesh
    mesh = make_mesh(cfg.mesh)
    batch = batch or cfg.train.global_batch_size
    plan = plan_for(cfg, mesh, batch)
    abstract = abstract_train_state(cfg, mesh)
    pshard, oshard = shardings(abstract["params"]), shardings(abstract["opt_state"])
    params = jax.jit(lambda k: init_params(cfg.model, k), out_shardings=pshard)(jax.random.key(0))
    opt = jax.jit(lambda p: init_opt_state(p, optim_cfg=cfg.optim), out_shardings=oshard)(params)
    L = cfg.data.sequence_length
    rng = np.random.default_rng(0)
    rows = batch_sharding(mesh)
    data = {"input_ids": jax.device_put(jnp.asarray(rng.integers(0, cfg.model.vocab_size, (batch, L)), jnp.int32),
                                        rows),
            "label_mask": jax.device_put(jnp.ones((batch, L), bool), rows)}
    return TrainState(mesh, plan, pshard, oshard, params, opt, data)


_OOM = re.compile(r"(?:required for HLO temporaries|memory required)[^(]*\(([\d.]+)([KMGTP]?)\)[^(]*"
                  r"available HBM \(([\d.]+)([KMGTP]?)\)")
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40, "P": 2 ** 50}


def _parse_oom(msg: str) -> tuple[float, float] | None:
    m = _OOM.search(msg)
    if not m:
        return None
    return float(m.group(1)) * _UNITS[m.group(2)] / GiB, float(m.group(3)) * _UNITS[m.group(4)] / GiB


def compiled_memory(lowered: Any, compiler_options: dict | None = None) -> dict:
    """Per-device GiB of a lowered step: XLA's memory analysis by part and in all (``need``), or,
    where XLA runs out of memory, the need and capacity its error names (with ``oom`` set). The
    compiled executable is under ``compiled`` when there is one, the lowered program under
    ``lowered``."""
    try:
        compiled = lowered.compile(compiler_options=compiler_options)
        ma = compiled.memory_analysis()
    except Exception as e:  # XLA raises a plain XlaRuntimeError/JaxRuntimeError for out-of-memory
        oom = _parse_oom(str(e))
        if oom is None:
            raise
        return {"need": oom[0], "hbm": oom[1], "oom": str(e).splitlines()[0][:300], "lowered": lowered}
    m = {"argument": ma.argument_size_in_bytes / GiB, "output": ma.output_size_in_bytes / GiB,
         "alias": ma.alias_size_in_bytes / GiB, "temp": ma.temp_size_in_bytes / GiB,
         "code": getattr(ma, "generated_code_size_in_bytes", 0) / GiB}
    return {**m, "need": m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"], "compiled": compiled,
            "lowered": lowered}


_USED = re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm", re.I)


def out_of_memory(e: BaseException) -> str | None:
    """The first line of ``e``'s message where it says the device ran out of memory (XLA's compile
    or an allocation at run time: ``RESOURCE_EXHAUSTED``), else None (a bug: not a verdict)."""
    msg = str(e)
    if "RESOURCE_EXHAUSTED" in msg or re.search(r"out of memory|exceeds available HBM", msg, re.I):
        return next((line for line in msg.splitlines() if line.strip()), msg)[:300]
    return None


def _oom_need(msg: str) -> float | None:
    """GiB the out-of-memory message says the program needs, where it says."""
    parsed = _parse_oom(msg)
    if parsed:
        return parsed[0]
    m = _USED.search(msg)
    return float(m.group(1)) * _UNITS[m.group(2).upper()] / GiB if m else None


def time_step(cfg: Config, state: TrainState, steps: int) -> dict:
    """Compile ``cfg``'s train step for ``state``'s devices and plan, run it once (the compile
    step: ``first_step_seconds`` counts the lowering, the compile and that step), then ``steps``
    times, each synchronised: ``step_seconds`` and their median. ``state`` carries the updated
    parameters. Out of memory (at compile or at run time): ``{"oom": message, "oom_at": "compile"
    | "run", "compiled_gib": {"need": GiB or None}}``. The program, lowered and compiled, is under
    ``lowered`` and ``compiled`` (for ``step_estimate``), not for JSON."""
    from olmax.objectives import get_objective
    objective = get_objective(cfg)
    t0 = time.perf_counter()
    jitted = objective.jit_update(state.mesh, state.plan, state.pshard, state.oshard)
    lowered = jitted.lower(state.params, state.opt, state.data)
    try:
        mem = compiled_memory(lowered)
    except Exception as e:  # an out-of-memory error compiled_memory cannot read
        if (oom := out_of_memory(e)) is None:
            raise
        return {"oom": oom, "oom_at": "compile", "compiled_gib": {"need": _oom_need(str(e))}}
    if "oom" in mem:
        return {"oom": mem["oom"], "oom_at": "compile", "compiled_gib": {"need": mem["need"]}}
    compiled_gib = {k: mem[k] for k in ("argument", "output", "alias", "temp", "need")}
    compile_seconds = time.perf_counter() - t0
    step = mem["compiled"]
    times = []
    try:
        state.params, state.opt, m = step(state.params, state.opt, state.data)
        jax.block_until_ready(m)
        first = time.perf_counter() - t0
        for _ in range(steps):
            t = time.perf_counter()
            state.params, state.opt, m = step(state.params, state.opt, state.data)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t)
    except Exception as e:  # the program fit XLA's count but not the device beside what it holds
        if (oom := out_of_memory(e)) is None:
            raise
        return {"oom": oom, "oom_at": "run", "compiled_gib": compiled_gib}
    return {"compiled_gib": compiled_gib, "compile_seconds": compile_seconds, "first_step_seconds": first,
            "step_seconds": times, "step_seconds_median": float(np.median(times)),
            "loss_last": float(objective.loss(jax.device_get(m))), "lowered": lowered, "compiled": step}


def device_rates(device: Any = None) -> dict:
    """What an estimate without XLA's time prices FLOPs and bytes at, per device: the datasheet's
    bf16 peak and HBM bandwidth (``olmax.metrics.flops``), each measured on ``device`` where the
    table has none (a CPU: a matmul and a copy, a fraction of a second); ``*_source`` says which."""
    from olmax.metrics.flops import device_hbm_bandwidth, device_peak_flops
    d = device or jax.devices()[0]
    flops, bw = device_peak_flops(d.device_kind), device_hbm_bandwidth(d.device_kind)
    out = {"flops_per_second": flops, "flops_source": "datasheet", "bytes_per_second": bw, "bytes_source": "datasheet"}
    cpu = d.platform == "cpu"
    if flops is None:
        n = 512 if cpu else 4096
        dtype = jnp.float32 if cpu else jnp.bfloat16
        a = jax.device_put(jnp.ones((n, n), dtype), d)
        mm = jax.jit(lambda x: x @ x)
        out.update(flops_per_second=2 * n ** 3 / _seconds(lambda: mm(a)), flops_source="measured")
    if bw is None:
        x = jax.device_put(jnp.ones(((32 if cpu else 512) << 20) // 4, jnp.float32), d)
        add = jax.jit(lambda v: v + 1)
        out.update(bytes_per_second=2 * x.nbytes / _seconds(lambda: add(x)), bytes_source="measured")
    return out


def _seconds(fn: Callable[[], Any], reps: int = 5) -> float:
    """Median seconds of ``fn`` (synchronised), after one call to compile it."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def memory_limit_gib(device: Any = None) -> float | None:
    """GiB the runtime lets a program use on ``device`` (None where it does not say: the CPU)."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    return stats["bytes_limit"] / GiB if stats.get("bytes_limit") else None


