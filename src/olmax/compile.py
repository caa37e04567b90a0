"""``olmax compile``: ahead-of-time compilation of the real train and eval steps for a TPU slice,
on any machine with the ``libtpu`` wheel (``pip install 'olmax[tpu]'``), no TPU needed.

``jax.experimental.topologies`` describes the slice's devices; the step is lowered on a mesh of
them with the run's exact shardings, and XLA's ``memory_analysis()`` (or its out-of-memory
error) gives the per-chip memory the run will need. Check a topology before renting it.

Beside the memory, each program's cost as XLA's TPU compiler estimates it (``cost_analysis()``:
FLOPs, bytes accessed and ``optimal_seconds`` per device): an estimate, not a measurement. XLA
counts a loop's body once, so a program that scans its layers (or its micro-batches) is costed
from the same program unrolled at one and two layer periods, extrapolated to the model's depth
(every layer is the same program), and multiplied by the micro-batches (``program_cost``).
The programs compiled for their cost are compiled without XLA's windowed einsums, loops XLA itself
adds (``COST_COMPILER_OPTIONS``). A Pallas kernel's work (splash attention) is invisible to XLA.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmax import jsonout
from olmax.argtypes import fraction, positive_int
from olmax.config import Config, ConfigError
from olmax.extras import require
from olmax.measure import compiled_memory
from olmax.recipes import add_recipe_args, get_recipe
from olmax.recipes.slices import slice_choice
from olmax.sharding import activation_mesh, batch_sharding, data_parallel_size, make_mesh, plan_batch

GiB = 1024 ** 3


@dataclass(frozen=True)
class Family:
    name: str
    dims: int                  # torus dimensions (3: v4/v5p/Ironwood, 2: v5e/v6e)
    cores_per_chip: int        # the number in "v5p-128" counts TensorCores (v5p, Ironwood) or chips
    devices_per_chip: int      # JAX devices per chip (megacore v5p: 1; Ironwood: 2 TensorCores)
    hbm_gib: float             # per device, as libtpu's compiler budgets it
    chip_config: str | None = None
    host_bounds: tuple[int, int, int] | None = None


# HBM per device as libtpu 0.0.42's compiler budgets it, read from its out-of-memory message
# ("exceeds available HBM (95.74G)"): what a compiled step may use.
FAMILIES = {
    "v5p": Family("v5p", 3, 2, 1, 95.74, "megacore", (2, 2, 1)),
    "v5e": Family("v5e", 2, 1, 1, 15.75),
    "v6e": Family("v6e", 2, 1, 1, 31.25),
    "tpu7x": Family("tpu7x", 3, 2, 2, 94.75),
}
ALIASES = {"v5litepod": "v5e", "v6litepod": "v6e", "ironwood": "tpu7x", "v7x": "tpu7x"}

# Slice shapes by chip count (Cloud TPU's standard topologies).
SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
             512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16", 8192: "16x16x32"}
SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclass(frozen=True)
class Topology:
    name: str          # as the user wrote it
    family: Family
    shape: str         # e.g. 4x4x4 (chips)
    slices: int

    @property
    def chips(self) -> int:
        return math.prod(int(x) for x in self.shape.split("x")) * self.slices

    @property
    def devices(self) -> int:
        return self.chips * self.family.devices_per_chip

    @property
    def slice_name(self) -> str | None:
        """One slice as Cloud TPU names its accelerator type (``v5p-128``: cores or chips as the
        family counts them), None for several slices."""
        if self.slices != 1:
            return None
        return f"{self.family.name}-{self.chips * self.family.cores_per_chip}"


def parse_topology(name: str, slices: int = 1) -> Topology:
    """``v5p-128`` / ``v6e-256`` / ``tpu7x-128`` / ``v5e-256`` (accelerator types as Cloud TPU
    names them) or ``FAMILY:AxBxC`` (chips per dimension)."""
    if slices < 1:
        raise ConfigError(f"--slices must be >= 1, got {slices}")
    known = ", ".join(sorted(FAMILIES))
    m = re.fullmatch(r"([a-z0-9]+)(?:-(\d+)|:(\d+(?:x\d+)+))", name.strip().lower())
    fam_name = ALIASES.get(m.group(1), m.group(1)) if m else None
    if not m or fam_name not in FAMILIES:
        raise ConfigError(f"unknown TPU topology {name!r}: expected e.g. v5p-128, v6e-256, tpu7x-128, v5e-256 or "
                          f"v5p:4x4x4 (families: {known})")
    fam = FAMILIES[fam_name]
    if m.group(3):
        shape = m.group(3)
        if len(shape.split("x")) != fam.dims:
            raise ConfigError(f"topology {name!r}: {fam.name} slices have {fam.dims} dimensions")
    else:
        count = int(m.group(2))
        if count % fam.cores_per_chip:
            raise ConfigError(f"topology {name!r}: {fam.name}-N counts {fam.cores_per_chip} cores per chip; "
                              f"{count} is not a whole number of chips")
        chips = count // fam.cores_per_chip
        table = SHAPES_3D if fam.dims == 3 else SHAPES_2D
        if chips not in table:
            raise ConfigError(f"topology {name!r}: no standard {fam.name} slice of {chips} chips "
                              f"(known: {', '.join(f'{fam.name}-{c * fam.cores_per_chip}' for c in table)})")
        shape = table[chips]
    return Topology(name, fam, shape, slices)


def quiet_libtpu(topology: Topology | None = None) -> None:
    """libtpu looks for a chip and prints alarming warnings on a machine without one unless JAX is
    told to stay on the CPU and libtpu what it would have found. Call before JAX initialises."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if topology is not None:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE",
                              f"{topology.family.name}-{topology.chips * topology.family.cores_per_chip}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # No chip is opened, so several compiles (or a compile beside a test run) may share the machine:
    # without this libtpu's lock file lets only one process load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def abstract_devices(topology: Topology) -> list:
    require("tpu", "libtpu")
    from jax.experimental import topologies
    fam = topology.family
    kw: dict[str, Any] = {}
    if fam.chip_config:
        kw["chip_config_name"] = fam.chip_config
    if fam.host_bounds:
        kw["chips_per_host_bounds"] = fam.host_bounds
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{fam.name}:{topology.shape}",
                                            num_slices=topology.slices, **kw)
    except jax.errors.JaxRuntimeError as e:  # e.g. a shape libtpu cannot lay out over its hosts
        raise ConfigError(f"topology {topology.name!r}: libtpu cannot build it: {str(e).splitlines()[0]}") from None
    return list(desc.devices)


def per_device_gib(abstract: Any) -> float:
    """GiB one device holds of a pytree of sharded ``jax.ShapeDtypeStruct``s (the largest shard
    of each leaf: uneven splits round up)."""
    total = 0
    for a in jax.tree.leaves(abstract):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += math.prod(shape) * a.dtype.itemsize  # a typed PRNG key's dtype knows its size too
    return total / GiB


# The cost keys of each program in ``olmax compile --json`` (stable).
COST_KEYS = ("flops_per_device", "model_flops_per_device", "recompute_overhead", "bytes_accessed_per_device",
             "optimal_seconds", "estimated_mfu")
# The train step's, with the splash kernel's work that XLA cannot see priced in (``with_attention``).
ATTENTION_KEYS = ("attention_kernel_flops_per_device", "recompute_overhead_with_attention", "seconds_with_attention",
                  "estimated_mfu_with_attention")


# XLA's SPMD partitioner may split a sharded matmul into a "windowed einsum": a while loop that
# overlaps each step's all-gather or reduce-scatter with its share of the product. Its cost
# analysis counts that loop's body once, like any loop's, so such a program's FLOPs come out short
# by the loop's trip count (checked: the 7B's layers on v5p-64, FSDP over 32, reported 56% of the
# FLOPs they report on v5p-128, where XLA made no such loop). A program compiled for its cost only
# is compiled without them (the same dots, whole); the memory comes from the program as it runs.
COST_COMPILER_OPTIONS = {"tpu": {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                                 "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}}


def cost_options(mesh: Mesh) -> dict | None:
    """The compiler options of a program compiled for its cost on ``mesh``'s platform."""
    return COST_COMPILER_OPTIONS.get(mesh.devices.flat[0].platform)


def cost_compile(lowered: Any, mesh: Mesh) -> Any:
    """``lowered`` (a program on ``mesh``) compiled for its cost (``COST_COMPILER_OPTIONS``)."""
    return lowered.compile(compiler_options=cost_options(mesh))


def xla_cost(compiled: Any) -> dict:
    """XLA's cost analysis of a compiled program, per device (a sharded program's figures are one
    device's shard): ``flops``, ``bytes`` accessed and ``seconds`` (its ``optimal_seconds``)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older jax: one dict per program
        ca = ca[0] if ca else {}
    secs = float(ca.get("optimal_seconds", 0.0))
    # XLA's cost model answers -2 s where it has no estimate: with libtpu 0.0.42.1 any Ironwood
    # program with an all-gather, all-reduce or reduce-scatter (every sharded step has them), and
    # the 7B step on v6e and on Ironwood with 0.0.50.1 too, although that one costs Ironwood's
    # collectives (a small model's step is timed). NaN, so that no sum or extrapolation of it
    # looks like one.
    return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0)),
            "seconds": secs if secs >= 0 else math.nan}


def program_cost(model: Any, compile_at: Callable[[Any], Any], repeats: int = 1) -> dict:
    """XLA's cost of a program of ``model`` run ``repeats`` times (the micro-batches of a step),
    per device. ``compile_at(m)`` compiles the same program for model config ``m``.

    XLA's cost analysis counts a while loop's body once (checked: a scan over 2 and 4 groups of
    layers reports the FLOPs of one), so a program with more than one scanned layer group is
    costed from the unrolled program at one and two layer periods, whose difference is one
    period's cost, extrapolated linearly to ``model.n_layers`` (``compile_at`` compiles them with
    ``cost_compile``, without the loops XLA adds itself); a micro-batch loop is counted
    by multiplying by ``repeats`` (the optimizer update, outside that loop, is then counted
    ``repeats`` times: a few FLOPs per parameter against thousands per token)."""
    from olmax.model.olmo3 import layer_groups
    period, groups = layer_groups(model)
    if groups <= 1:
        c = xla_cost(compile_at(model))
    else:
        one = xla_cost(compile_at(dataclasses.replace(model, n_layers=period, scan_layers=False)))
        two = xla_cost(compile_at(dataclasses.replace(model, n_layers=2 * period, scan_layers=False)))
        c = {k: one[k] + (model.n_layers - period) / period * (two[k] - one[k]) for k in one}
    return {k: v * repeats for k, v in c.items()}


def attention_unseen_fraction(cfg: Config, platform: str = "tpu") -> float:
    """The share of the model's FLOPs (as the MFU metric counts them) that XLA's TPU cost estimate
    leaves out: splash attention is a Pallas kernel that declares no cost, so XLA counts none of
    its FLOPs and times it by its operands' bytes alone; 0 where the attention runs in XLA (on
    ``platform``, where the step compiles)."""
    from olmax.metrics.flops import flops_per_token
    from olmax.model.dispatch import resolve_attention
    if resolve_attention(cfg.model.attention_impl, cfg.model.compute_dtype, platform) != "splash":
        return 0.0
    f = flops_per_token(cfg.model, cfg.data.sequence_length)
    return f["attention"] / f["total"]


def matmul_rate(mesh: Mesh) -> float | None:
    """FLOP/s XLA's cost model gives one device of ``mesh`` for a large bf16 matmul (16384 cubed,
    unsharded): the rate at which the sweep prices work XLA cannot see. None where XLA gives no
    time. Compiled once per device kind (a sweep asks per row)."""
    device = mesh.devices.flat[0]
    if device.device_kind not in _MATMUL_RATES:
        n = 16384
        a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device))
        c = xla_cost(jax.jit(jnp.matmul).lower(a, a).compile())
        _MATMUL_RATES[device.device_kind] = c["flops"] / c["seconds"] if c["seconds"] > 0 else None
    return _MATMUL_RATES[device.device_kind]


_MATMUL_RATES: dict[str, float | None] = {}


def with_attention(summary: dict, cfg: Config, rate: float | None) -> dict:
    """The train step's estimate with the splash kernel's work that XLA does not see priced in:
    the attention's model FLOPs (``attention_unseen_fraction`` of the model's), a forward more
    where the remat policy recomputes the kernel, at XLA's own ``rate`` for a large matmul
    (``matmul_rate``). Keys ``attention_kernel_flops_per_device``,
    ``recompute_overhead_with_attention`` (compiled FLOPs and the kernel's over the model's),
    ``seconds_with_attention``, ``estimated_mfu_with_attention`` (None without an XLA time)."""
    from olmax.model.olmo3 import remat_recomputes_attention
    return price_attention(summary, attention_unseen_fraction(cfg), remat_recomputes_attention(cfg.model.remat),
                           rate)


def price_attention(summary: dict, fraction: float, recomputes: bool, rate: float | None) -> dict:
    """``with_attention``'s arithmetic for any program's cost summary, olmax's or a peer's: the
    unseen ``fraction`` of its model FLOPs (x4/3 where its remat ``recomputes`` the kernel's
    forward: forward + a backward of two forwards, + the forward again) at ``rate`` FLOP/s."""
    model, secs = summary.get("model_flops_per_device"), summary.get("optimal_seconds")
    flops = (model or 0.0) * fraction * (4 / 3 if recomputes else 1.0)
    compiled = summary.get("flops_per_device")
    total = secs + flops / rate if secs is not None and rate else None
    mfu = summary.get("estimated_mfu")
    return {"attention_kernel_flops_per_device": flops,
            "recompute_overhead_with_attention": (compiled + flops) / model if model and compiled is not None
            else None,
            "seconds_with_attention": total,
            "estimated_mfu_with_attention": mfu * secs / total if total and mfu is not None else None}


def cost_summary(cost: dict | None, model_flops: float, peak: float | None) -> dict:
    """The stable cost keys of one program from its XLA cost (per device) and its model FLOPs
    per device (as the MFU metric counts them); ``peak``: the device's bf16 FLOP/s."""
    if cost is None:
        return dict.fromkeys(COST_KEYS)
    secs = None if math.isnan(cost["seconds"]) else cost["seconds"]  # NaN: XLA gave no estimate
    return {"flops_per_device": cost["flops"], "model_flops_per_device": model_flops,
            "recompute_overhead": cost["flops"] / model_flops if model_flops else None,
            "bytes_accessed_per_device": cost["bytes"], "optimal_seconds": secs,
            "estimated_mfu": model_flops / (secs * peak) if peak and secs else None}


def _abstract_step(cfg: Config, mesh: Mesh) -> tuple[Any, Any, Any, Any]:
    """The train step of ``cfg`` on ``mesh``: (jitted update, params, opt_state, batch) as sharded shapes."""
    from olmax.checkpoint.state import abstract_train_state, shardings
    from olmax.objectives import get_objective
    objective = get_objective(cfg)
    plan = plan_batch(objective.update_batch_size(), dict(mesh.shape), cfg.train.micro_batch_size,
                      cfg.train.max_micro_batch_size)
    abstract = abstract_train_state(cfg, mesh)
    jitted = objective.jit_update(mesh, plan, shardings(abstract["params"]), shardings(abstract["opt_state"]))
    return jitted, abstract["params"], abstract["opt_state"], objective.abstract_batch(mesh, plan)


def train_step_cost(cfg: Config, mesh: Mesh, lowered: Any, accum_steps: int, compiled: Any = None) -> dict:
    """XLA's cost (``xla_cost``'s keys, per device) of ``cfg``'s train step on ``mesh``, whose
    ``lowered`` program runs ``accum_steps`` micro-batches (``program_cost``): for a TPU topology
    here, and for the devices a benchmark runs on (the accelerator check and ``--sweep --measure``
    set it beside the measured step). ``compiled``: ``lowered`` as compiled to run, whose own cost
    is read on one device, where XLA makes no windowed einsum (``COST_COMPILER_OPTIONS``), instead
    of compiling it again."""
    def compile_at(m: Any) -> Any:
        if m == cfg.model:
            return compiled if compiled is not None and mesh.size == 1 else cost_compile(lowered, mesh)
        jitted, *args = _abstract_step(dataclasses.replace(cfg, model=m), mesh)
        return cost_compile(jitted.lower(*args), mesh)
    return program_cost(cfg.model, compile_at, accum_steps)


def compile_for(cfg: Config, topology: Topology, *, eval_step: bool = True, progress: bool = True,
                cost: bool = True, generate: bool = True) -> dict:
    """Lower and compile the train step (and the held-out eval step, and an RL recipe's sampling)
    of ``cfg`` for ``topology``; return the per-device memory report, with each program's cost
    as XLA estimates it unless ``cost`` is False (``COST_KEYS``). Allocates nothing."""
    # Imported here, not at the top: the CLI imports this module for its parser, and the step
    # brings Optax (``olmax inspect --topology`` and ``--help`` stay light).
    from olmax.checkpoint.state import abstract_train_state, shardings
    from olmax.eval.heldout import check_batch_divides, make_eval_step
    from olmax.metrics.flops import device_peak_flops, flops_per_token, forward_flops_per_token
    from olmax.objectives import get_objective

    objective = get_objective(cfg)
    devices = abstract_devices(topology)
    # mesh.slice is taken from the devices' slice_index, as in the launched run (make_mesh).
    mesh = make_mesh(cfg.mesh, devices)
    sizes = dict(mesh.shape)
    # What one optimizer update sees, as the loop plans it (RL: one mini-batch of the step's completions)
    plan = plan_batch(objective.update_batch_size(), sizes, cfg.train.micro_batch_size, cfg.train.max_micro_batch_size)
    L = cfg.data.sequence_length
    abstract = abstract_train_state(cfg, mesh)
    pshard, oshard = shardings(abstract["params"]), shardings(abstract["opt_state"])
    bshard = batch_sharding(mesh)
    batch = objective.abstract_batch(mesh, plan)
    eval_step = eval_step and (objective.eval_by_default or bool(cfg.eval.heldout_paths))
    report: dict[str, Any] = {
        "recipe": cfg.name, "topology": topology.name, "slices": topology.slices,
        "device_kind": devices[0].device_kind, "devices": len(devices), "chips": topology.chips,
        "mesh": sizes, "plan": dataclasses.asdict(plan), "sequence_length": L, "hbm_gib": topology.family.hbm_gib,
        "attention": cfg.model.attention_impl, "remat": cfg.model.remat, "scan_layers": cfg.model.scan_layers,
        "logits_chunk": cfg.model.logits_chunk, "compute_dtype": cfg.model.compute_dtype,
    }
    if progress:
        rows = objective.rows_per_example
        what = f"{plan.per_device} x {L}" if rows == 1 else f"{plan.per_device} examples of {rows} x {L}"
        print(f"compiling the {cfg.name} train step for {topology.name} ({mesh.size} devices, mesh "
              f"{sizes}, {what} tokens per device in {plan.accum_steps} micro-batch(es))...",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    jitted = objective.jit_update(mesh, plan, pshard, oshard)
    m = compiled_memory(jitted.lower(abstract["params"], abstract["opt_state"], batch))
    report["compile_seconds"] = time.perf_counter() - t0
    peak = device_peak_flops(devices[0].device_kind)
    report["peak_flops_per_device"] = peak
    if "oom" in m:
        report.update(memory_verdict(need=m["need"], hbm=m["hbm"]), hbm_gib=m["hbm"], argument_gib=None,
                      temp_gib=None, output_gib=None, oom_message=m["oom"], **cost_summary(None, 0.0, peak))
        return report
    report.update({f"{k}_gib": m[k] for k in ("argument", "output", "alias", "temp", "code")},
                  **memory_verdict(need=m["need"], hbm=topology.family.hbm_gib))
    # Model FLOPs as the MFU metric counts them: the update's tokens x flops_per_token, over the devices.
    update_tokens = objective.update_batch_size() * objective.rows_per_example * L
    model_flops = update_tokens * flops_per_token(cfg.model, L)["total"] / mesh.size
    report["attention_unseen_fraction"] = attention_unseen_fraction(cfg)
    if cost:
        t1 = time.perf_counter()
        report.update(cost_summary(train_step_cost(cfg, mesh, m["lowered"], plan.accum_steps), model_flops, peak))
        rate = matmul_rate(mesh) if report["attention_unseen_fraction"] else None
        report["matmul_flops_per_second"] = rate  # what the unseen attention is priced at
        report.update(with_attention(report, cfg, rate))
        report["cost_seconds"] = time.perf_counter() - t1
    else:
        report.update(cost_summary(None, model_flops, peak))
    if eval_step:
        bs = cfg.eval.batch_size
        check_batch_divides(bs, mesh)  # the run would stop on this before training
        ev_batch = {"input_ids": jax.ShapeDtypeStruct((bs, L), jnp.int32, sharding=bshard),
                    "label_mask": jax.ShapeDtypeStruct((bs, L), jnp.bool_, sharding=bshard)}
        t1 = time.perf_counter()

        def lower_eval(c: Config) -> Any:
            params = abstract["params"] if c is cfg else abstract_train_state(c, mesh)["params"]
            return jax.jit(make_eval_step(c, mesh), in_shardings=(shardings(params), bshard)).lower(params, ev_batch)
        em = compiled_memory(lower_eval(cfg))
        # The in-loop eval runs between train steps: the optimizer state (Adam's moments) stays
        # resident beside the eval step's own arguments (the parameters), temporaries and outputs.
        resident = per_device_gib(abstract["opt_state"])
        need = em["need"] + resident
        report["eval"] = {"batch_size": bs, "per_device_gib": need, "step_gib": em["need"],
                          "resident_gib": resident, "temp_gib": em.get("temp"),
                          "fits": "oom" not in em and need <= topology.family.hbm_gib,
                          "compile_seconds": time.perf_counter() - t1}
        ev_cost = None
        if cost and "oom" not in em:
            ev_cost = program_cost(cfg.model, lambda mc: cost_compile(
                em["lowered"] if mc == cfg.model else lower_eval(dataclasses.replace(cfg, model=mc)), mesh))
        report["eval"].update(cost_summary(ev_cost, bs * L * forward_flops_per_token(cfg.model, L) / mesh.size, peak))
        if not report["eval"]["fits"]:
            report["verdict"] += (f"; the eval step at batch {bs} does not fit "
                                  f"({report['eval']['per_device_gib']:.1f} GiB): lower eval.batch_size")
        report["fits"] = report["fits"] and report["eval"]["fits"]
    if objective.samples and generate:  # sampling runs between updates: the optimizer state stays resident beside it
        shapes = rl_generation_shapes(cfg, mesh)
        gb = shapes.pop("batch")
        waiting = shapes["rows"] > gb  # rows of a kept prompt block wait for slots
        g = compile_generate(cfg, topology, gb, shapes["max_length"], prompt_len=shapes["prompt_len"],
                             prompt_rows=shapes["prompt_rows"], progress=progress, mesh=mesh, cost=cost,
                             batching=cfg.rl.batching, waiting=waiting)
        resident = per_device_gib(abstract["opt_state"])
        need = g["per_device_gib"] + resident
        programs = [w for w in ("prefill", "admit", "decode") if w in g]
        report["generate"] = {"batch": gb, **shapes, "batching": g["batching"], "chunk": g["chunk"],
                              "prefill_rows": g["prefill_rows"], "per_device_gib": need, "resident_gib": resident,
                              **{f"{w}_gib": g[w].get("with_resident", g[w]["need"]) for w in programs},
                              "cache_gib_total": g["cache_gib_total"],
                              "fits": bool(g["fits"]) and need <= topology.family.hbm_gib,
                              "compile_seconds": g["compile_seconds"],
                              **{w: {k: g[w].get(k) for k in COST_KEYS} for w in programs}}
        if not report["generate"]["fits"]:
            report["verdict"] += (f"; generation at rl.generation_batch={gb} x {L} tokens does not fit "
                                  f"({need:.1f} GiB with the optimizer state): lower rl.generation_batch")
        report["fits"] = report["fits"] and report["generate"]["fits"]
    return report


def rl_generation_shapes(cfg: Config, mesh: Mesh) -> dict:
    """The shapes an RL run's rollouts decode with on ``mesh``, from ``olmax.engine.shapes``'
    own bucketing applied to one step's rows (``rl.prompts_per_step`` groups of
    ``rl.group_size`` rows that share a prompt): ``batch``, the rows of each generation batch
    (the continuous engine's slots); ``rows``, the step's rows;
    ``prompt_len``, the bucket of ``rl.max_prompt_length``; ``max_length``, the cache of that
    plus ``rl.max_response_length`` tokens; ``prompt_rows``, the most rows a batch prefills
    (each shard's distinct prompts), None where no batch saves a row."""
    from olmax.engine.shapes import batch_rows, cache_length, prefill_rows, prompt_bucket

    r = cfg.rl
    dp = data_parallel_size(dict(mesh.shape))
    step = [[g] for g in range(r.prompts_per_step) for _ in range(r.group_size)]  # a prompt per group
    rows = batch_rows(len(step), r.generation_batch or len(step), dp)
    prefilled = max(len(prefill_rows(step[s:s + rows], rows, dp)[0]) for s in range(0, len(step), rows))
    prompt_len = prompt_bucket(r.max_prompt_length, cfg.model, mesh)
    return {"batch": rows, "rows": len(step), "max_length": cache_length(prompt_len, r.max_response_length),
            "prompt_len": prompt_len, "prompt_rows": prefilled if prefilled < rows else None}


def compile_generate(cfg: Config, topology: Topology, batch: int, max_length: int, *, prompt_len: int | None = None,
                     prompt_rows: int | None = None, progress: bool = True, mesh: Mesh | None = None,
                     cost: bool = True, batching: str = "continuous", chunk: int | None = None,
                     waiting: bool = False, prefill_tokens: int | None = None) -> dict:
    """Lower and compile KV-cache decoding of ``cfg``'s model for ``topology`` as an engine of
    ``olmax.engine`` runs it, with the parameters sharded as in training and their stacked
    compute-dtype copy (``decode.prepare``) made once beside them. ``batch`` rows decode together
    over a cache of ``max_length`` positions; prompts are padded to ``prompt_len`` (default
    ``max_length``, the longest a cache of that length takes); ``prompt_rows``: the distinct
    prompts among them, prefilled once (GRPO's groups share a prompt; default ``batch``).

    - ``continuous`` (``olmax.engine.continuous``, the default): the slots' state (the cache of
      ``batch`` rows) made once; the prefill of a block of ``prompt_rows`` prompts; the admission
      that writes ``batch`` rows from it into the slots and samples their first tokens; a decode
      chunk of ``chunk`` steps in one while loop. The per-device need is the largest of: the
      prefill beside the resident slots, the admission, the chunk (beside the kept block where
      ``waiting``: rows of its prompts wait for a slot, and the engine keeps it for them).
      ``prefill_tokens``: the engine's bound on the prompt tokens one round trip prefills
      (``Engine(prefill_tokens=)``): the block holds that many prompts at most (at least one a
      shard), and the admission writes their rows.
    - ``static`` (``olmax.engine.static``): the prefill (and the copy of each prompt's cache to its
      rows) and one decode step against the full cache.

    ``mesh``: the abstract mesh of ``topology`` when the caller has built it. With ``cost``, each
    program's cost as XLA estimates it (``COST_KEYS``; XLA counts a loop's body once: a chunk's
    figures are one decode step's, an admission's one written row per shard's). Allocates nothing."""
    from olmax.checkpoint.state import abstract_train_state, shardings
    from olmax.engine import check_prefill_bound
    from olmax.engine.continuous import MAX_EOS, bounded_rows, programs
    from olmax.engine.sampling import Sampling
    from olmax.engine.sampling import knobs as sampling_knobs
    from olmax.engine.shapes import bucket
    from olmax.metrics.flops import decode_flops_per_token, device_peak_flops, forward_flops_per_token
    from olmax.model.decode import cache_bytes, decode_step, expand_rows, prefill, prepare
    from olmax.model.dispatch import decode_layout, round_trip_steps

    if batching not in ("continuous", "static"):
        raise ConfigError(f"batching must be continuous or static, got {batching!r}")
    mesh = mesh if mesh is not None else make_mesh(cfg.mesh, abstract_devices(topology))
    m = cfg.model
    chunk = chunk or round_trip_steps("tpu")
    dp = data_parallel_size(dict(mesh.shape))
    if batch % dp:
        raise ConfigError(f"--batch-size {batch} does not divide over the {dp} data-parallel "
                          f"shards of mesh {dict(mesh.shape)}")
    bshard = batch_sharding(mesh)
    rows = batch_sharding(mesh, 1)
    replicated = NamedSharding(mesh, PartitionSpec())
    plen = prompt_len or max_length
    continuous = batching == "continuous"
    check_prefill_bound(batching, prefill_tokens)
    per_prompt = batch // (prompt_rows or batch)  # rows that share a prompt (a GRPO group)
    # Prompts a shard's part of the block holds, and the rows a shard writes from it at the first
    # round trip (every slot, or as many as the bounded block's prompts serve).
    q = bucket(-(-(prompt_rows or batch) // dp), lo=1)
    bound = bounded_rows(prefill_tokens, dp, plen)
    q = q if bound is None else min(q, bound)
    filled = dp * q if continuous else prompt_rows or batch
    written = dp * bucket(min(batch // dp, q * per_prompt), lo=1)
    report: dict[str, Any] = {"recipe": cfg.name, "topology": topology.name, "devices": mesh.size,
                              "mesh": dict(mesh.shape), "batching": batching, "batch": batch,
                              "max_length": max_length, "prompt_len": plen, "prompt_rows": prompt_rows,
                              "prefill_rows": filled, "chunk": chunk if continuous else None,
                              "prefill_tokens": prefill_tokens,
                              "compute_dtype": m.compute_dtype, "attention": m.attention_impl,
                              "hbm_gib": topology.family.hbm_gib,
                              "cache_gib_total": cache_bytes(m, batch, max_length) / GiB}
    names = ("prefill", "admit", "decode") if continuous else ("prefill", "decode")
    if progress:
        what = (f"the {batching} engine's prefill, admission and {chunk}-step decode chunk" if continuous
                else "the static engine's prefill and decode step")
        print(f"compiling {what} of {cfg.name} for {topology.name} ({mesh.size} devices, mesh "
              f"{dict(mesh.shape)}), {batch} rows x {max_length} tokens"
              + (f" ({prompt_rows} distinct prompts of {plen} prefilled once)" if prompt_rows else "") + "...",
              file=sys.stderr, flush=True)
    built: dict[Any, dict[str, dict]] = {}

    def sds(tree: Any, out_shardings: Any) -> Any:
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, out_shardings)

    def host(shape: tuple, dtype: Any) -> jax.ShapeDtypeStruct:  # a host array the engine puts on the mesh
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))

    def build(mc: Any) -> dict[str, dict]:
        """Each program's compiled memory for model config ``mc`` (stopping at the first that
        runs out of memory); ``resident``: GiB per device of what stays between programs. A
        config other than the recipe's is compiled for its cost only (``cost_compile``)."""
        if mc in built:
            return built[mc]
        opts = None if mc == m else cost_options(mesh)
        params = abstract_train_state(dataclasses.replace(cfg, model=mc), mesh)["params"]
        layout = decode_layout(batch, mc)
        prep = jax.jit(partial(prepare, cfg=mc, layout=layout), in_shardings=(shardings(params),)).lower(params)
        prepared = sds(jax.eval_shape(partial(prepare, cfg=mc, layout=layout), params), prep.compile().output_shardings)
        tokens = jax.ShapeDtypeStruct((filled, plen), jnp.int32, sharding=bshard)
        lengths = jax.ShapeDtypeStruct((filled,), jnp.int32, sharding=rows)
        out: dict[str, dict] = {}
        if not continuous:
            args = (prepared, tokens, lengths)
            if prompt_rows:
                def fill(prepared, tokens, lengths, source):
                    return expand_rows(*prefill(prepared, tokens, lengths, mc, max_length), source)
                args += (jax.ShapeDtypeStruct((dp, batch // dp), jnp.int32, sharding=bshard),)
            else:
                fill = partial(prefill, cfg=mc, max_length=max_length)
            out["prefill"] = compiled_memory(jax.jit(fill).lower(*args), opts)
            if "oom" not in out["prefill"]:
                cache = sds(jax.eval_shape(fill, *args)[1], out["prefill"]["compiled"].output_shardings[1])
                tok = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
                out["decode"] = compiled_memory(jax.jit(partial(decode_step, cfg=mc, max_length=max_length),
                                                         donate_argnums=(2,)).lower(prepared, tok, cache), opts)
            out["resident"] = {}
            built[mc] = out
            return out
        init, prefill_block, admit, decode_chunk = programs(mc, mesh)
        with activation_mesh(mesh):
            blank = init.lower(prepared, slots=batch, max_length=max_length).compile()
            state = sds(jax.eval_shape(lambda p: init(p, slots=batch, max_length=max_length), prepared),
                        blank.output_shardings)
            out["prefill"] = compiled_memory(prefill_block.lower(prepared, tokens, lengths), opts)
            if "oom" in out["prefill"]:
                built[mc] = out
                return out
            block = sds(jax.eval_shape(prefill_block, prepared, tokens, lengths),
                        out["prefill"]["compiled"].output_shardings)
            w = written
            knobs = {k: host(v.shape, v.dtype) for k, v in sampling_knobs([Sampling(temperature=1.0)] * w).items()}
            out["admit"] = compiled_memory(admit.lower(
                prepared, state, *block, host((dp, w // dp), jnp.int32), host((dp, w // dp), jnp.int32),
                host((w,), jnp.uint32),
                host((w,), jnp.int32), knobs, host((w,), jnp.int32), host((w, MAX_EOS), jnp.int32),
                greedy=False, top_n=0), opts)
            if "oom" in out["admit"]:
                built[mc] = out
                return out
            scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
            out["decode"] = compiled_memory(decode_chunk.lower(
                prepared, state, host((batch,), jnp.bool_), scalar, scalar, chunk=chunk, max_length=max_length,
                greedy=False, top_n=0), opts)
        out["resident"] = {"state": per_device_gib(state), "block": per_device_gib(block)}
        built[mc] = out
        return out

    t0 = time.perf_counter()
    with activation_mesh(mesh):
        progs = build(m)
    report["compile_seconds"] = time.perf_counter() - t0
    resident = progs.pop("resident", {})
    report["resident_gib"] = resident
    for what in names:
        if what not in progs:
            continue
        if "oom" in progs[what]:
            report.update({w: _without_compiled(progs[w]) for w in progs},
                          **memory_verdict(need=progs[what]["need"], hbm=progs[what]["hbm"]))
            return report
    # What each program needs beside what stays resident while it runs (its own arguments counted once).
    need = {"prefill": progs["prefill"]["need"] + resident.get("state", 0.0),
            "decode": progs["decode"]["need"] + (resident.get("block", 0.0) if waiting else 0.0)}
    if continuous:
        need["admit"] = progs["admit"]["need"]
    peak = device_peak_flops(jax.tree.leaves(mesh.devices.tolist())[0].device_kind)
    model_flops = {"prefill": filled * plen * forward_flops_per_token(m, plen) / mesh.size, "admit": 0.0,
                   "decode": batch * decode_flops_per_token(m, max_length) / mesh.size}
    with activation_mesh(mesh):
        for what in names:
            prog = progs[what]
            prog["with_resident"] = need[what]
            c = None
            if cost and what == "admit":
                c = xla_cost(cost_compile(prog["lowered"], mesh))  # no layer loop; its loop over rows counted once
            elif cost:
                c = program_cost(m, lambda mc, what=what, prog=prog: cost_compile(prog["lowered"], mesh) if mc == m
                                 else build(mc)[what]["compiled"])
            prog.update(cost_summary(c, model_flops[what], peak))
    for what in names:
        report[what] = _without_compiled(progs[what])
    report.update(memory_verdict(need=max(need.values()), hbm=topology.family.hbm_gib))
    return report


def _without_compiled(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in ("compiled", "lowered")}


def memory_verdict(need: float, hbm: float) -> dict:
    fits = need <= hbm
    text = (f"fits with {hbm - need:.1f} GiB to spare" if fits else f"does not fit by {need - hbm:.1f} GiB")
    return {"per_device_gib": need, "fits": fits, "verdict": text}


def _cost_line(c: dict) -> str:
    """One program's cost keys as a line of text (XLA's estimate)."""
    if c.get("flops_per_device") is None:
        return "-"
    mfu = f", est. MFU {c['estimated_mfu']:.1%}" if c.get("estimated_mfu") is not None else ""
    secs = c["optimal_seconds"]
    est = ("no time estimate from XLA" if secs is None else f"est. {secs:.3f} s" if secs >= 0.1
           else f"est. {secs * 1e3:.3f} ms")
    model = (f" ({c['recompute_overhead']:.2f}x the model's {c['model_flops_per_device'] / 1e12:.2f})"
             if c.get("recompute_overhead") is not None else "")  # a copy (the engine's admission) has no model FLOPs
    return (f"{c['flops_per_device'] / 1e12:.2f} TFLOP per device{model}, "
            f"{c['bytes_accessed_per_device'] / GiB:.2f} GiB accessed, {est}{mfu}")


# --------------------------------------------------------------------------- --sweep


def sweep_choices(cfg: Config, topology: Topology, remats: list[str] | None, micro_batches: list[int] | None,
                  blocks: list[int] | None) -> tuple[list[str], list[int], list[int]]:
    """What ``--sweep`` compiles: remat policies (default: every one the target has; ``policy@n``:
    that policy at ``n`` sequences a micro-batch only), per-device micro-batches (default: the
    recipe's and the whole per-device batch in one pass) and splash block sizes (default: the
    recipe's)."""
    # Every sweep target is a TPU, whose host memory offload_proj uses.
    return grid_choices(cfg, dict(make_mesh(cfg.mesh, abstract_devices(topology)).shape), remats, micro_batches,
                        blocks)


def grid_choices(cfg: Config, sizes: dict[str, int], remats: list[str] | None, micro_batches: list[int] | None,
                 blocks: list[int] | None, host_offload: bool = True) -> tuple[list[str], list[int], list[int]]:
    """``sweep_choices`` for a mesh of ``sizes`` (``--sweep --measure``: this machine's);
    ``host_offload``: whether the default policies hold ``offload_proj`` (a TPU's host memory)."""
    from olmax.model.olmo3 import REMAT_NAMES
    from olmax.objectives import get_objective
    for r in remats or []:
        policy, _, n = r.partition("@")
        if policy not in REMAT_NAMES:
            raise ConfigError(f"--remat: unknown policy {policy!r} (known: {', '.join(REMAT_NAMES)})")
        if n and not (n.isdigit() and int(n) > 0):
            raise ConfigError(f"--remat: {r!r}: expected policy@N, N sequences a micro-batch")
    remats = remats or [r for r in REMAT_NAMES if host_offload or r != "offload_proj"]
    plan = plan_batch(get_objective(cfg).update_batch_size(), sizes, cfg.train.micro_batch_size,
                      cfg.train.max_micro_batch_size)
    for mb in [*(micro_batches or []), *(int(r.partition("@")[2]) for r in remats if "@" in r)]:
        if plan.per_device % mb:
            raise ConfigError(f"--micro-batches: {mb} does not divide the {plan.per_device} sequences per device")
    micro = micro_batches or sorted({plan.micro_batch, plan.per_device})
    return remats, micro, blocks or [cfg.model.attention_block_q]


def sweep_grid(remats: list[str], micro: list[int], blocks: list[int]) -> list[tuple[str, int, int]]:
    """``(policy, micro-batch, block)`` in the order a sweep runs them: each ``--remat`` entry in
    turn, its blocks, then its micro-batches as given (``policy@n``: ``n`` alone)."""
    out = []
    for r in remats:
        policy, _, n = r.partition("@")
        for blk in blocks:
            out += [(policy, mb, blk) for mb in ([int(n)] if n else micro)]
    return out


def sweep(cfg: Config, topology: Topology, *, remats: list[str] | None = None, micro_batches: list[int] | None = None,
          blocks: list[int] | None = None, headroom: float = 0.10, progress: bool = True) -> dict:
    """Compile ``cfg``'s train step for ``topology`` under each remat policy x micro-batch x splash
    block size; each row has the memory and XLA's cost. ``best``: the row with the highest
    estimated MFU among those that leave ``headroom`` of the HBM free; where XLA times none of
    them, the one with the lowest recompute overhead (``best_by`` says which). A micro-batch that
    runs out of memory skips the larger ones of the same policy and blocks."""
    remats, micro, blks = sweep_choices(cfg, topology, remats, micro_batches, blocks)
    rows: list[dict] = []
    oom_at: dict[tuple[str, int], int] = {}
    for remat, mb, blk in sweep_grid(remats, micro, blks):
        label = f"remat={remat} micro_batch={mb} block={blk}"
        if mb > oom_at.get((remat, blk), 1 << 30):
            rows.append({"remat": remat, "micro_batch": mb, "block": blk, "skipped": True,
                         "verdict": f"skipped: micro-batch {oom_at[(remat, blk)]} does not fit"})
            continue
        c = candidate_config(cfg, remat, mb, blk)
        if progress:
            print(f"sweep: {label}...", file=sys.stderr, flush=True)
        try:
            r = compile_for(c, topology, eval_step=False, progress=False, generate=False)
        except ConfigError as e:  # e.g. a block that does not tile the sequence
            rows.append({"remat": remat, "micro_batch": mb, "block": blk, "error": str(e)})
            continue
        row = {"remat": remat, "micro_batch": mb, "block": blk, "accum_steps": r["plan"]["accum_steps"],
               "per_device_gib": r["per_device_gib"], "hbm_gib": r["hbm_gib"], "fits": r["fits"],
               "headroom": 1 - r["per_device_gib"] / r["hbm_gib"], "verdict": r["verdict"],
               "compile_seconds": r["compile_seconds"], "cost_seconds": r.get("cost_seconds"),
               **{k: r.get(k) for k in COST_KEYS + ATTENTION_KEYS}}
        rows.append(row)
        if progress:
            print(f"sweep: {label}: {row['per_device_gib']:.2f} of {row['hbm_gib']:.2f} GiB a device"
                  f" ({'fits' if row['fits'] else 'does not fit'}), compiled in {r['compile_seconds']:.0f} s",
                  file=sys.stderr, flush=True)
        if not r["fits"]:
            oom_at[(remat, blk)] = min(mb, oom_at.get((remat, blk), 1 << 30))
    unseen = attention_unseen_fraction(cfg)
    room = [r for r in rows if r.get("fits") and r["headroom"] >= headroom]
    timed = [r for r in room if _rank(r) is not None]
    if timed:
        best, best_by = max(timed, key=_rank), "estimated_mfu"
    elif room:  # XLA gives no time (the 7B step on v6e and Ironwood): the fewest FLOPs, compute-bound
        best, best_by = min(room, key=_flops_rank), "recompute_overhead"
    else:
        best, best_by = None, None
    return {"recipe": cfg.name, "topology": topology.name, "slices": topology.slices, "headroom": headroom,
            "sequence_length": cfg.data.sequence_length, "global_batch": cfg.train.global_batch_size,
            "recipe_choice": {"remat": cfg.model.remat, "micro_batch": cfg.train.micro_batch_size,
                              "max_micro_batch": cfg.train.max_micro_batch_size,
                              "block": cfg.model.attention_block_q},
            "rows": rows, "best": best, "best_by": best_by, "attention_unseen_fraction": unseen,
            "note": "cost columns are XLA's estimate for the compiled TPU program, not a measurement"
                    + ("; it leaves out the splash attention kernel's work (attention_unseen_fraction of the "
                       "model's FLOPs), so the estimated MFU is an upper bound; *_with_attention prices that "
                       "work at XLA's rate for a large matmul, and the best is chosen by it" if unseen else "")}


def candidate_config(cfg: Config, remat: str, micro_batch: int, block: int) -> Config:
    """``cfg`` as one sweep row runs it: ``remat``, ``micro_batch`` sequences per device a pass,
    splash blocks of ``block`` for queries and keys."""
    return cfg.override([f"model.remat={remat}", f"train.micro_batch_size={micro_batch}",
                         "train.max_micro_batch_size=null", f"model.attention_block_q={block}",
                         f"model.attention_block_kv={block}"])


def _flops_rank(row: dict) -> float:
    """The fallback rank where XLA times no row: compiled FLOPs over the model's, the splash
    kernel's counted where it runs (no FLOPs at all: last)."""
    x = row.get("recompute_overhead_with_attention") or row.get("recompute_overhead")
    return math.inf if x is None else x


def _rank(row: dict) -> float | None:
    """What the sweep ranks by: the estimated MFU with the unseen attention priced in, where the
    attention runs in splash and XLA gives a time, else XLA's own."""
    priced = row.get("estimated_mfu_with_attention")
    return priced if priced is not None else row.get("estimated_mfu")


def _unseen_note(fraction: float) -> str:
    return (f" (it leaves out splash attention's work, {fraction:.0%} of the model's FLOPs here: the est. MFU "
            "is an upper bound)") if fraction else ""


def _col(row: dict, key: str, fmt: str, width: int) -> str:
    """One figure of a sweep row, right-aligned, or '-' where there is none (no time from XLA)."""
    return f"{format(row[key], fmt):>{width}s}" if row.get(key) is not None else f"{'-':>{width}s}"


def print_sweep(s: dict) -> None:
    print(f"recipe {s['recipe']} on {s['topology']} x {s['slices']} slice(s), global batch {s['global_batch']} x "
          f"{s['sequence_length']} tokens; cost columns are XLA's estimate, not a measurement"
          + _unseen_note(s["attention_unseen_fraction"]))
    head = (f"{'remat':14s} {'micro':>5s} {'accum':>5s} {'block':>5s} {'GiB/dev':>9s} {'free':>6s} "
            f"{'overhead':>8s} {'est. step s':>11s} {'est. MFU':>8s} {'+attn x':>8s} {'+attn s':>8s} "
            f"{'+attn MFU':>9s}")
    print(head)
    for r in s["rows"]:
        if "per_device_gib" not in r:
            why = r.get("verdict") or r.get("error")
            print(f"{r['remat']:14s} {r['micro_batch']:5d} {'':5s} {r['block']:5d} {why}")
            continue
        cost = " ".join([_col(r, "recompute_overhead", ".2f", 7) + "x", _col(r, "optimal_seconds", ".3f", 11),
                         _col(r, "estimated_mfu", ".1%", 8)])
        if r.get("recompute_overhead_with_attention") is not None:
            cost += " " + " ".join([_col(r, "recompute_overhead_with_attention", ".2f", 7) + "x",
                                    _col(r, "seconds_with_attention", ".3f", 8),
                                    _col(r, "estimated_mfu_with_attention", ".1%", 9)])
        mark = "  <- best" if r is s["best"] else ""
        print(f"{r['remat']:14s} {r['micro_batch']:5d} {r['accum_steps']:5d} {r['block']:5d} "
              f"{r['per_device_gib']:9.2f} {r['headroom']:6.1%} {cost}{mark}")
    if s["best"] is None:
        print(f"no configuration leaves {s['headroom']:.0%} of the HBM free")
    else:
        b = s["best"]
        if s.get("best_by") == "recompute_overhead":
            print("XLA gives no step time on this chip: the best is the one that computes least (lowest overhead), "
                  "as if the step were compute-bound")
        print(f"best with >= {s['headroom']:.0%} HBM free: --set model.remat={b['remat']} "
              f"--set train.micro_batch_size={b['micro_batch']} --set model.attention_block_q={b['block']} "
              f"--set model.attention_block_kv={b['block']}")


# --------------------------------------------------------------------------- --sweep --measure


def step_estimate(cfg: Config, state: Any, run: dict, rates: dict | None) -> dict:
    """XLA's estimate of the program ``time_step`` ran (``run``), per device, beside its measured
    median: the cost keys of ``olmax compile`` (``COST_KEYS``; ``optimal_seconds`` None where XLA
    gives no time), ``roofline_seconds`` (the larger of FLOPs at ``rates``' peak and bytes at its
    bandwidth), ``estimated_seconds`` and ``estimate_by`` (``optimal_seconds``, else ``flops`` or
    ``bytes``, whichever bound the roofline), ``estimated_seconds_with_attention`` (the splash
    kernel's FLOPs, which XLA does not see, added at the peak; as the estimate where attention runs
    in XLA) and each over the measured median (``estimate_over_measured``,
    ``estimate_with_attention_over_measured``: below 1, the chip was slower than estimated)."""
    from olmax.metrics.flops import device_peak_flops, flops_per_token
    from olmax.model.olmo3 import remat_recomputes_attention
    t0 = time.perf_counter()
    mesh, plan, L = state.mesh, state.plan, cfg.data.sequence_length
    device = mesh.devices.flat[0]
    cost = train_step_cost(cfg, mesh, run["lowered"], plan.accum_steps, compiled=run["compiled"])
    model_flops = plan.global_batch * L * flops_per_token(cfg.model, L)["total"] / mesh.size
    out = cost_summary(cost, model_flops, device_peak_flops(device.device_kind))
    if not out["optimal_seconds"]:  # no time: a CPU's cost analysis has none (read as 0.0), a v5e's is negative
        out.update(optimal_seconds=None, estimated_mfu=None)
    peak = (rates or {}).get("flops_per_second")
    bw = (rates or {}).get("bytes_per_second")
    bounds = {"flops": cost["flops"] / peak if peak else None, "bytes": cost["bytes"] / bw if bw else None}
    known = {k: v for k, v in bounds.items() if v is not None}
    roofline = max(known.values()) if known else None
    if out["optimal_seconds"]:
        est, by = out["optimal_seconds"], "optimal_seconds"
    elif roofline is not None:
        est, by = roofline, max(known, key=known.get)
    else:
        est, by = None, None
    fraction = attention_unseen_fraction(cfg, device.platform)
    attn = price_attention({**out, "optimal_seconds": est}, fraction, remat_recomputes_attention(cfg.model.remat),
                           peak)
    with_attn = attn["seconds_with_attention"] if fraction else est
    measured = run["step_seconds_median"]
    out.update(roofline_seconds=roofline, roofline_flops_seconds=bounds["flops"],
               roofline_bytes_seconds=bounds["bytes"], estimated_seconds=est, estimate_by=by,
               attention_unseen_fraction=fraction,
               attention_kernel_flops_per_device=attn["attention_kernel_flops_per_device"],
               estimated_seconds_with_attention=with_attn,
               estimate_over_measured=est / measured if est else None,
               estimate_with_attention_over_measured=with_attn / measured if with_attn else None,
               seconds_to_cost=time.perf_counter() - t0)
    return out


# The keys of a measured row (``olmax compile --sweep --measure --json``; stable).
MEASURED_KEYS = ("remat", "micro_batch", "block", "accum_steps", "fits", "per_device_gib", "memory_limit_gib",
                 "headroom", "compile_seconds", "first_step_seconds", "step_seconds", "step_seconds_median",
                 "tokens_per_second", "mfu", "loss_last", "rank", "rank_by_estimate")


def measured_sweep(cfg: Config, *, remats: list[str] | None = None, micro_batches: list[int] | None = None,
                   blocks: list[int] | None = None, steps: int = 5, headroom: float = 0.0,
                   progress: bool = True) -> dict:
    """Run ``cfg``'s train step on this machine's devices under each remat policy x micro-batch x
    splash block (``olmax.compile.sweep_grid``), ``steps`` timed steps each after a compile step,
    beside XLA's estimate of the same program (``step_estimate``). ``best``: the fastest measured
    row that fits (and, where the runtime states its memory limit, leaves ``headroom`` of it free
    by XLA's count). A micro-batch that runs out of memory skips the larger ones of its policy and
    block, as in ``sweep``. The state (parameters, optimizer, batch) is made once and carried from
    row to row (no row changes its shapes); made again after a row that failed holding it."""
    from olmax.measure import device_rates, memory_limit_gib, plan_for, time_step, train_state
    from olmax.metrics.flops import flops_per_token
    from olmax.objectives import get_objective
    if get_objective(cfg).name != "lm":
        raise ConfigError(f"--measure runs the language-model train step (pre-training, SFT); train.objective="
                          f"{cfg.train.objective!r} is not measured yet: drop --measure for XLA's estimate")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    mesh = make_mesh(cfg.mesh)
    device = mesh.devices.flat[0]
    remats, micro, blks = grid_choices(cfg, dict(mesh.shape), remats, micro_batches, blocks,
                                       host_offload=device.platform == "tpu")
    grid = sweep_grid(remats, micro, blks)
    rates = device_rates(device)
    limit = memory_limit_gib(device)
    L = cfg.data.sequence_length
    say: Callable[[str], None] = (lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None)
    say(f"measure: {len(grid)} candidate(s) of {cfg.name} on {mesh.size} x {device.device_kind} "
        f"(mesh {dict(mesh.shape)}), {cfg.train.global_batch_size} x {L} tokens a step, {steps} timed step(s) each")
    rows: list[dict] = []
    oom_at: dict[tuple[str, int], int] = {}
    state: Any = None
    for remat, mb, blk in grid:
        label = f"remat={remat} micro_batch={mb} block={blk}"
        base = {"remat": remat, "micro_batch": mb, "block": blk}
        if mb > oom_at.get((remat, blk), 1 << 30):
            rows.append({**base, "fits": False, "skipped": True,
                         "verdict": f"skipped: micro-batch {oom_at[(remat, blk)]} does not fit"})
            continue
        say(f"measure: {label}...")
        t0 = time.perf_counter()
        try:
            c = candidate_config(cfg, remat, mb, blk)
            if state is None or state.deleted():
                state = None
                gc.collect()
                state = train_state(c)
            state.plan = plan_for(c, state.mesh)
            run = time_step(c, state, steps)
        except ConfigError as e:  # e.g. a block that does not tile the sequence
            rows.append({**base, "error": str(e)})
            say(f"measure: {label}: {e}")
            continue
        except Exception as e:  # a bug, not a verdict: the other rows still run
            traceback.print_exc()
            rows.append({**base, "error": f"{type(e).__name__}: {e}"[:2000]})
            say(f"measure: {label}: failed ({type(e).__name__})")
            continue
        row: dict[str, Any] = {**base, "accum_steps": state.plan.accum_steps, "memory_limit_gib": limit,
                               "per_device_gib": run["compiled_gib"]["need"]}
        need = row["per_device_gib"]
        row["headroom"] = 1 - need / limit if need is not None and limit else None
        if "oom" in run:
            row.update(fits=False, oom=run["oom"], oom_at=run["oom_at"],
                       verdict=f"does not fit: out of memory at {run['oom_at']}")
            rows.append(row)
            oom_at[(remat, blk)] = min(mb, oom_at.get((remat, blk), 1 << 30))
            say(f"measure: {label}: out of memory at {run['oom_at']} ({time.perf_counter() - t0:.0f} s)")
            continue
        median = run["step_seconds_median"]
        model_flops = state.plan.global_batch * L * flops_per_token(c.model, L)["total"] / mesh.size
        row.update({k: run[k] for k in ("compile_seconds", "first_step_seconds", "step_seconds",
                                        "step_seconds_median", "loss_last")},
                   fits=True, verdict="ran", tokens_per_second=state.plan.global_batch * L / median,
                   mfu=model_flops / median / rates["flops_per_second"])
        try:
            row.update(step_estimate(c, state, run, rates))
        except Exception as e:  # the measurement stands without XLA's figures
            traceback.print_exc()
            row["estimate_error"] = f"{type(e).__name__}: {e}"[:2000]
        rows.append(row)
        del run
        gc.collect()
        est = row.get("estimate_over_measured")
        say(f"measure: {label}: {median:.4f} s a step (median of {steps}), {row['mfu']:.1%} MFU, "
            f"{need:.2f} GiB compiled; est./measured "
            + (f"{est:.2f} (by {row['estimate_by']})" if est else "-") + f" ({time.perf_counter() - t0:.0f} s)")
    state = None
    ran = sorted((r for r in rows if r.get("step_seconds_median")), key=lambda r: r["step_seconds_median"])
    for i, r in enumerate(ran):
        r["rank"] = i + 1
    priced = sorted((r for r in ran if r.get("estimated_seconds_with_attention")),
                    key=lambda r: r["estimated_seconds_with_attention"])
    for i, r in enumerate(priced):
        r["rank_by_estimate"] = i + 1
    room = [r for r in ran if not headroom or r["headroom"] is None or r["headroom"] >= headroom]
    best = room[0] if room else None
    return {"recipe": cfg.name, "measured": True, "device_kind": device.device_kind, "platform": device.platform,
            "devices": mesh.size, "mesh": dict(mesh.shape), "steps": steps, "headroom": headroom,
            "memory_limit_gib": limit, "sequence_length": L, "global_batch": cfg.train.global_batch_size,
            "recipe_choice": {"remat": cfg.model.remat, "micro_batch": cfg.train.micro_batch_size,
                              "max_micro_batch": cfg.train.max_micro_batch_size,
                              "block": cfg.model.attention_block_q},
            "rates": rates, "rows": rows, "best": best, "best_by": "step_seconds_median" if best else None,
            "note": "step_seconds_median is measured on this device; estimated_seconds is XLA's cost analysis of the "
                    "same compiled program (its optimal_seconds, else the larger of its FLOPs at the peak and its "
                    "bytes at the bandwidth in rates: estimate_by says which); estimate_over_measured below 1: "
                    "the step took longer than estimated"}


def print_measured(s: dict) -> None:
    """The measured sweep as a table (stdout)."""
    r = s["rates"]
    print(f"recipe {s['recipe']} measured on {s['devices']} x {s['device_kind']} (mesh {s['mesh']}), global batch "
          f"{s['global_batch']} x {s['sequence_length']} tokens, median of {s['steps']} step(s) after a compile step")
    print(f"estimate: XLA's cost analysis of the same program; where it gives no time, the larger of FLOPs at "
          f"{r['flops_per_second'] / 1e12:.3g} TFLOP/s ({r['flops_source']}) and bytes at "
          f"{r['bytes_per_second'] / 1e9:.4g} GB/s ({r['bytes_source']})")
    print(f"{'remat':20s} {'micro':>5s} {'accum':>5s} {'block':>5s} {'GiB/dev':>8s} {'step s':>8s} {'MFU':>6s} "
          f"{'est. s':>8s} {'by':>15s} {'est/meas':>8s} {'+attn':>6s} {'rank':>4s} {'est.rank':>8s}")
    for x in s["rows"]:
        head = f"{x['remat']:20s} {x['micro_batch']:5d} "
        if not x.get("step_seconds_median"):
            why = x.get("error") or x.get("verdict") or ""
            print(head + f"{'':5s} {x['block']:5d} {why}" + (f" ({x['oom']})" if x.get("oom") else ""))
            continue

        def col(key: str, fmt: str, width: int) -> str:
            return f"{format(x[key], fmt):>{width}s}" if x.get(key) is not None else f"{'-':>{width}s}"
        mark = "  <- best" if s["best"] and all(x[k] == s["best"][k] for k in ("remat", "micro_batch", "block")) else ""
        print(head + f"{x['accum_steps']:5d} {x['block']:5d} {col('per_device_gib', '.2f', 8)} "
              f"{x['step_seconds_median']:8.4f} {col('mfu', '.1%', 6)} {col('estimated_seconds', '.4f', 8)} "
              f"{col('estimate_by', 's', 15)} {col('estimate_over_measured', '.2f', 8)} "
              f"{col('estimate_with_attention_over_measured', '.2f', 6)} {x['rank']:4d} "
              f"{col('rank_by_estimate', 'd', 8)}{mark}")
    print("est/meas: XLA's estimate over the measured median (below 1: slower than estimated); +attn: with the "
          "splash kernel's FLOPs, which XLA does not see, at the peak")
    if s["best"] is None:
        print("no candidate ran" + (f" leaving {s['headroom']:.0%} of the device's memory free" if s["headroom"]
                                    else ""))
    else:
        b = s["best"]
        print(f"fastest that fits: --set model.remat={b['remat']} --set train.micro_batch_size={b['micro_batch']} "
              f"--set model.attention_block_q={b['block']} --set model.attention_block_kv={b['block']}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="ahead-of-time compile the train step for a TPU slice: per-chip memory, "
                                       "fits or not (needs the libtpu wheel, not a TPU)")
    add_recipe_args(p)
    p.add_argument("--topology", default=None,
                   help="v5p-128, v6e-256, tpu7x-128, v5e-256 or v5p:4x4x4 (required, except with --sweep --measure)")
    p.add_argument("--slices", type=positive_int, default=1,
                   help="number of slices (multi-slice data parallelism over DCN)")
    p.add_argument("--no-eval", action="store_true", help="compile the train step only")
    p.add_argument("--step", choices=("train", "generate"), default="train",
                   help="train (default): the train and eval steps; generate: the generation engine's programs "
                        "(continuous: prefill, admission and a decode chunk; static: prefill and one decode step)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="--step generate: prompts per batch")
    p.add_argument("--max-length", type=positive_int, default=None,
                   help="--step generate: cache length = prompt length (default: data.sequence_length)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="--step generate: the engine whose programs compile (as olmax generate --batching)")
    p.add_argument("--prefill-tokens", type=positive_int, default=None, metavar="N",
                   help="--step generate: the continuous engine's bound on the prompt tokens one round trip prefills "
                        "(as olmax generate / serve --prefill-tokens; default: every slot's prompt at once)")
    p.add_argument("--no-cost", action="store_true",
                   help="memory only: skip XLA's cost estimate (its extra compiles of one and two layer periods)")
    p.add_argument("--sweep", action="store_true",
                   help="compile the train step under each remat policy x micro-batch x splash block and tabulate "
                        "memory against XLA's estimated cost; the best that leaves --headroom free")
    p.add_argument("--remat", type=_remats, default=None, metavar="A,B", help="--sweep: remat policies (default: all)")
    p.add_argument("--micro-batches", type=_ints, default=None, metavar="N,M",
                   help="--sweep: sequences per device per micro-batch (default: the recipe's and all in one pass)")
    p.add_argument("--attention-blocks", type=_ints, default=None, metavar="N,M",
                   help="--sweep: splash block sizes, queries and keys alike (default: the recipe's)")
    p.add_argument("--measure", action="store_true",
                   help="--sweep: run each candidate on this machine's devices instead (no --topology): the median "
                        "of --steps steps after a compile step, out of memory = does not fit, the fastest that fits "
                        "wins; beside it XLA's estimate of the same program and estimate / measured")
    p.add_argument("--steps", type=positive_int, default=None, metavar="N",
                   help="--sweep --measure: timed steps per candidate (default 5)")
    p.add_argument("--headroom", type=fraction, default=None,
                   help="--sweep: HBM fraction the best must leave free (default 0.10; with --measure 0: running is "
                        "fitting)")
    p.add_argument("--no-slice-choice", action="store_true",
                   help="compile the recipe as written, without the settings measured best for this slice "
                        "(olmax.recipes.slices; e.g. to compare like for like with another system)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (stable keys: docs/cli.md)")
    p.set_defaults(func=cmd_compile)


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _remats(text: str) -> list[str]:
    import typing

    from olmax.config import ModelConfig
    known = typing.get_args(typing.get_type_hints(ModelConfig)["remat"])
    names = _names(text)

    def bad(name: str) -> bool:  # policy, or policy@N: that policy at N sequences a micro-batch only
        policy, at, n = name.partition("@")
        return policy not in known or bool(at) and not (n.isdigit() and int(n) > 0)
    wrong = [n for n in names if bad(n)]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"unknown remat policy {', '.join(map(repr, wrong or [text]))}: expected "
                                         f"policies separated by commas ({', '.join(known)}), each optionally "
                                         f"@N (N sequences a micro-batch), got {text!r}")
    return names


def _ints(text: str) -> list[int]:
    out = []
    for x in _names(text):
        if not x.isdigit() or int(x) < 1:
            raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
        out.append(int(x))
    return out


def cmd_measure(args: argparse.Namespace) -> int:
    """``--sweep --measure``: the candidates run on this machine's devices (``olmax.measure``)."""
    wrong = [flag for flag, given in (("--topology", args.topology), ("--slices", args.slices != 1),
                                      ("--step generate", args.step != "train"), ("--no-cost", args.no_cost),
                                      ("--no-slice-choice", args.no_slice_choice)) if given]
    if wrong:
        raise ConfigError(f"--measure runs the train step on this machine's devices: drop {', '.join(wrong)}")
    cfg = get_recipe(args.recipe, args.overrides)
    s = measured_sweep(cfg, remats=args.remat, micro_batches=args.micro_batches, blocks=args.attention_blocks,
                       steps=args.steps or 5, headroom=args.headroom or 0.0)
    if args.json:
        print(jsonout.dumps(s, indent=2))
    else:
        print_measured(s)
    return 0 if s["best"] is not None else 1


def cmd_compile(args: argparse.Namespace) -> int:
    if args.measure and not args.sweep:
        raise ConfigError("--measure goes with --sweep: olmax compile --sweep --measure")
    if args.steps is not None and not args.measure:
        raise ConfigError("--steps goes with --sweep --measure")
    if args.headroom is not None and not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom must be in [0, 1), got {args.headroom}")
    if args.measure:
        return cmd_measure(args)
    if args.topology is None:
        raise ConfigError("--topology is required (e.g. v5p-128), except with --sweep --measure, which runs on this "
                          "machine's devices")
    args.headroom = 0.10 if args.headroom is None else args.headroom
    topology = parse_topology(args.topology, args.slices)
    quiet_libtpu(topology)
    name = None if args.no_slice_choice else topology.slice_name
    cfg = get_recipe(args.recipe, args.overrides, slice_name=name)
    choice = slice_choice(args.recipe, name)
    if choice is not None and not args.json:
        print(f"slice choice   {args.recipe} on {topology.slice_name}: --set {' --set '.join(choice.overrides)} "
              f"({choice.why}); your --set lines come after it", file=sys.stderr)
    chosen = None if choice is None else {"overrides": list(choice.overrides), "why": choice.why}
    if args.sweep:
        if args.step != "train" or args.no_cost:
            raise ConfigError("--sweep compiles the train step with its cost: drop --step generate / --no-cost")
        s = sweep(cfg, topology, remats=args.remat, micro_batches=args.micro_batches, blocks=args.attention_blocks,
                  headroom=args.headroom)
        s["slice_choice"] = chosen
        if args.json:
            print(jsonout.dumps(s, indent=2))
        else:
            print_sweep(s)
        return 0 if s["best"] is not None else 1
    if args.step == "generate":
        r = compile_generate(cfg, topology, args.batch_size, args.max_length or cfg.data.sequence_length,
                             cost=not args.no_cost, batching=args.batching,
                             prefill_tokens=args.prefill_tokens)
        r["slice_choice"] = chosen
        if args.json:
            print(jsonout.dumps(r, indent=2))
        else:
            print(f"recipe         {r['recipe']} ({r['compute_dtype']} compute, attention {r['attention']})")
            print(f"topology       {r['topology']}: {r['devices']} devices, mesh {r['mesh']}, "
                  f"{r['hbm_gib']:.2f} GiB HBM each")
            print(f"engine         {r['batching']}: {r['batch']} rows x {r['max_length']} tokens (KV cache "
                  f"{r['cache_gib_total']:.2f} GiB in all), prompts of {r['prompt_len']} prefilled "
                  f"{r['prefill_rows']} at a time"
                  + (f", {r['chunk']} decode steps per round trip" if r["chunk"] else ""))
            for what in ("prefill", "admit", "decode"):
                if what in r:
                    oom = " (XLA: out of memory)" if "oom" in r[what] else ""
                    beside = r[what].get("with_resident")
                    extra = (f" ({beside:.2f} with what stays resident beside it)"
                             if beside is not None and abs(beside - r[what]["need"]) > 1e-3 else "")
                    print(f"{what:<15}{r[what]['need']:.2f} GiB per device{oom}{extra}")
                    if not args.no_cost and "oom" not in r[what]:
                        print(f"{'  cost':<15}{_cost_line(r[what])} (XLA's estimate"
                              + ("; one decode step" if what == "decode" and r["chunk"] else "") + ")")
            print(f"compile time   {r['compile_seconds']:.1f} s")
            print(f"verdict        {r['verdict']}")
        return 0 if r["fits"] else 1
    r = compile_for(cfg, topology, eval_step=not args.no_eval, cost=not args.no_cost)
    r["slice_choice"] = chosen
    if args.json:
        print(jsonout.dumps(r, indent=2))
    else:
        plan = r["plan"]
        print(f"recipe         {r['recipe']} ({r['compute_dtype']} compute, attention {r['attention']}, "
              f"remat {r['remat']}, scanned layers {r['scan_layers']}, logits chunk {r['logits_chunk']})")
        print(f"topology       {r['topology']} x {r['slices']} slice(s): {r['devices']} x {r['device_kind']}, "
              f"{r['hbm_gib']:.2f} GiB HBM each")
        print(f"mesh           {r['mesh']}")
        print(f"batch plan     {plan['global_batch']} sequences per step, {plan['per_device']} per device in "
              f"{plan['accum_steps']} micro-batch(es) of {plan['micro_batch']}")
        if r.get("temp_gib") is not None:
            print(f"per device     {r['per_device_gib']:.2f} GiB: arguments {r['argument_gib']:.2f}, temporaries "
                  f"{r['temp_gib']:.2f}, outputs {r['output_gib']:.2f} (aliased with arguments {r['alias_gib']:.2f})")
        else:
            print(f"per device     {r['per_device_gib']:.2f} GiB (XLA: out of memory)")
        if not args.no_cost:
            print(f"cost (XLA)     {_cost_line(r)}")
            if r.get("seconds_with_attention") is not None:
                print(f"  + attention  est. {r['seconds_with_attention']:.3f} s, est. MFU "
                      f"{r['estimated_mfu_with_attention']:.1%}, overhead "
                      f"{r['recompute_overhead_with_attention']:.2f}x: "
                      f"the splash kernel's {r['attention_kernel_flops_per_device'] / 1e12:.2f} TFLOP per device, "
                      "priced at XLA's rate for a large matmul")
        if "generate" in r:
            g = r["generate"]
            print(f"generation     {g['per_device_gib']:.2f} GiB per device, {g['batching']} engine with {g['batch']} "
                  f"slots x {g['max_length']} tokens (KV cache {g['cache_gib_total']:.1f} GiB in all; with the "
                  f"optimizer state that stays resident, {g['resident_gib']:.2f}); prompts of {g['prompt_len']} tokens"
                  + (f", {g['prompt_rows']} distinct ones prefilled once" if g["prompt_rows"] else ""))
            print("  " + ", ".join(f"{w} {g[w + '_gib']:.2f}" for w in ("prefill", "admit", "decode")
                                   if w + "_gib" in g) + " GiB per device (before the optimizer state)")
            for what in ("prefill", "admit", "decode"):
                if not args.no_cost and what in g:
                    print(f"  {what + ' cost':<13}{_cost_line(g[what])}")
        if "eval" in r:
            print(f"eval step      {r['eval']['per_device_gib']:.2f} GiB per device at batch {r['eval']['batch_size']} "
                  f"(with the optimizer state that stays resident, {r['eval']['resident_gib']:.2f})")
            if not args.no_cost:
                print(f"  eval cost    {_cost_line(r['eval'])}")
        print(f"compile time   {r['compile_seconds']:.1f} s"
              + (f" (+ {r['cost_seconds']:.1f} s for the cost's compiles)" if r.get("cost_seconds") else ""))
        if not args.no_cost:
            print("cost           XLA's estimate for the compiled TPU program (FLOPs, bytes, optimal_seconds), not a "
                  "measurement; MFU = model FLOPs / (est. seconds x the chip's peak)"
                  + _unseen_note(r.get("attention_unseen_fraction", 0.0)))
        print(f"verdict        {r['verdict']}")
    return 0 if r["fits"] else 1
