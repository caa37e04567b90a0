"""``olmax compile``'s cost beside memory: XLA's cost analysis of the compiled TPU program, per
device, corrected for the loops XLA counts once (the layer scan, the micro-batches, its own
windowed einsums), the stable JSON keys, the MFU it implies, and ``--sweep``. The compiles are integration tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from olmax.compile import COST_KEYS, cost_summary, parse_topology, program_cost, xla_cost
from olmax.config import ConfigError
from olmax.metrics.flops import CHIPS, PEAK_BF16_FLOPS, decode_flops_per_token, device_peak_flops, flops_per_token
from olmax.recipes import get_recipe


class _Compiled:
    def __init__(self, flops, nbytes, seconds, as_list=False):
        d = {"flops": flops, "bytes accessed": nbytes, "optimal_seconds": seconds, "utilization0{}": 1.0}
        self.d = [d] if as_list else d

    def cost_analysis(self):
        return self.d


def test_xla_cost_reads_both_shapes_of_cost_analysis():
    assert xla_cost(_Compiled(2.0, 3.0, 4.0)) == {"flops": 2.0, "bytes": 3.0, "seconds": 4.0}
    assert xla_cost(_Compiled(2.0, 3.0, 4.0, as_list=True)) == {"flops": 2.0, "bytes": 3.0, "seconds": 4.0}


def test_program_cost_extrapolates_unrolled_periods_to_the_depth():
    """A scanned model is costed from its unrolled one- and two-period programs: outside + per
    layer x depth, times the micro-batches; an unscanned (or one-group) model from itself."""
    m = get_recipe("olmo3_7b_stage1").model           # 32 layers scanned in groups of 4
    seen = []

    def compile_at(mc):
        seen.append((mc.n_layers, mc.scan_layers))
        # outside 10, each layer 3 (FLOPs), 5 + 2/layer bytes, 1 + 0.5/layer seconds
        return _Compiled(10 + 3 * mc.n_layers, 5 + 2 * mc.n_layers, 1 + 0.5 * mc.n_layers)
    c = program_cost(m, compile_at, repeats=2)
    assert seen == [(4, False), (8, False)]
    assert c == {"flops": 2 * (10 + 3 * 32), "bytes": 2 * (5 + 2 * 32), "seconds": 2 * (1 + 0.5 * 32)}
    seen.clear()
    from dataclasses import replace
    flat = replace(m, scan_layers=False)
    assert program_cost(flat, compile_at) == {"flops": 10 + 96.0, "bytes": 5 + 64.0, "seconds": 17.0}
    assert seen == [(32, False)]


def test_the_share_xla_does_not_see_is_splash_attentions():
    """On a TPU the attention runs in the splash kernel, whose FLOPs XLA's estimate leaves out:
    the attention's share of the model's FLOPs at the recipe's length; none where it runs in XLA."""
    from olmax.compile import attention_unseen_fraction
    cfg = get_recipe("olmo3_7b_stage1")
    f = flops_per_token(cfg.model, cfg.data.sequence_length)
    assert attention_unseen_fraction(cfg) == pytest.approx(f["attention"] / f["total"])
    assert 0.1 < attention_unseen_fraction(cfg) < attention_unseen_fraction(get_recipe("olmo3_7b_think_sft")) < 0.3
    assert attention_unseen_fraction(cfg.override(["model.attention_impl=blocked"])) == 0.0


def test_the_unseen_attention_is_priced_in_where_it_runs_and_again_where_remat_recomputes_it():
    """``with_attention`` adds the splash kernel's FLOPs at the given rate to XLA's time (a forward
    more, 4/3 of them, where the policy keeps no kernel output) and lowers the MFU by as much."""
    from olmax.compile import price_attention, with_attention
    cfg = get_recipe("olmo3_7b_stage3")
    f = flops_per_token(cfg.model, cfg.data.sequence_length)
    share = f["attention"] / f["total"]
    summary = {"model_flops_per_device": 1e15, "optimal_seconds": 2.0, "estimated_mfu": 0.5}
    kept = with_attention(summary, cfg.override(["model.remat=save_attn_out"]), rate=1e14)
    redone = with_attention(summary, cfg.override(["model.remat=full"]), rate=1e14)
    assert kept["attention_kernel_flops_per_device"] == pytest.approx(1e15 * share)
    assert redone["attention_kernel_flops_per_device"] == pytest.approx(1e15 * share * 4 / 3)
    assert kept["seconds_with_attention"] == pytest.approx(2.0 + 10 * share)
    assert kept["estimated_mfu_with_attention"] == pytest.approx(0.5 * 2.0 / (2.0 + 10 * share))
    assert redone["seconds_with_attention"] > kept["seconds_with_attention"]
    assert kept["recompute_overhead_with_attention"] is None  # the summary has no compiled FLOPs
    compiled = {**summary, "flops_per_device": 0.9e15}  # XLA counted the model less its attention
    assert with_attention(compiled, cfg.override(["model.remat=save_attn_out"]), rate=1e14)[
        "recompute_overhead_with_attention"] == pytest.approx(0.9 + share)
    no_time = with_attention({**summary, "optimal_seconds": None, "estimated_mfu": None}, cfg, rate=1e14)
    assert no_time["seconds_with_attention"] is None and no_time["estimated_mfu_with_attention"] is None
    in_xla = with_attention(summary, cfg.override(["model.attention_impl=blocked"]), rate=1e14)
    assert in_xla["attention_kernel_flops_per_device"] == 0 and in_xla["seconds_with_attention"] == 2.0
    # A peer's program (MaxText's, in bench_tpu_aot) is priced by the same arithmetic from its own
    # remat policy's answer to "does it run the kernel again".
    assert price_attention(summary, share, True, 1e14) == redone
    assert price_attention(summary, share, False, 1e14) == kept


def test_maxtext_compiles_with_its_own_libtpu_and_packages():
    """MaxText runs from its own venv: the environment it gets keeps nothing that points into
    olmax's. The libtpu package sets ``TPU_LIBRARY_PATH`` when olmax imports it; left in place,
    MaxText's newer JAX would compile with olmax's older libtpu, which cannot parse its kernels."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from peers import maxtext_env

    ours = {"PYTHONPATH": "olmax/src", "TPU_LIBRARY_PATH": "olmax-venv/libtpu/libtpu.so", "HOME": "home",
            "JAX_PLATFORMS": "tpu"}
    env = maxtext_env(ours)
    assert "PYTHONPATH" not in env and "TPU_LIBRARY_PATH" not in env
    assert env["HOME"] == "home" and env["JAX_PLATFORMS"] == "cpu" and env["DECOUPLE_GCLOUD"] == "TRUE"
    assert ours["TPU_LIBRARY_PATH"] == "olmax-venv/libtpu/libtpu.so"  # the caller's own is untouched


def test_bench_tpu_aot_refuses_a_plan_of_no_sequences(monkeypatch, capsys):
    """A micro-batch of no sequences is refused by name before any compile starts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_tpu_aot

    monkeypatch.setattr(bench_tpu_aot, "olmax_compile", lambda *a, **k: pytest.fail("compiled anyway"))
    monkeypatch.setattr(sys, "argv", ["bench_tpu_aot.py", "--max-micro-batch", "0", "--no-maxtext"])
    with pytest.raises(SystemExit) as e:
        bench_tpu_aot.main()
    assert e.value.code == 2 and "--max-micro-batch 0" in capsys.readouterr().err


def test_cost_summary_keys_overhead_and_mfu():
    s = cost_summary({"flops": 1.5e12, "bytes": 1e9, "seconds": 0.01}, 1.2e12, 459e12)
    assert tuple(s) == COST_KEYS
    assert s["recompute_overhead"] == pytest.approx(1.25)
    assert s["estimated_mfu"] == pytest.approx(1.2e12 / (0.01 * 459e12))
    assert cost_summary({"flops": 1.0, "bytes": 1.0, "seconds": 1.0}, 1.0, None)["estimated_mfu"] is None
    assert cost_summary(None, 1.0, 1.0) == dict.fromkeys(COST_KEYS)


def test_peak_table_is_per_chip_and_divides_into_devices():
    """Ironwood's 2,307 TFLOP/s are a chip's, over two TensorCores that JAX sees as two devices."""
    assert CHIPS["TPU7x"].devices == 2 and device_peak_flops("TPU7x") == pytest.approx(2307e12 / 2)
    assert device_peak_flops("TPU v5") == 459e12 and device_peak_flops("TPU v6 lite") == 918e12
    assert all(c.source for c in CHIPS.values()) and set(PEAK_BF16_FLOPS) == set(CHIPS)
    assert device_peak_flops("a chip nobody knows") is None


def test_decode_flops_count_the_window():
    m = get_recipe("olmo3_7b_stage1").model
    short, long = decode_flops_per_token(m, 1024), decode_flops_per_token(m, 16384)
    # 8 full layers see every key; 24 sliding layers at most 4,096
    per_key = 4 * m.n_heads * m.head_dim
    assert long - short == pytest.approx(per_key * (8 * (16384 - 1024) + 24 * (4096 - 1024)))
    # a training token's forward is a third of flops_per_token (attention over the whole sequence aside)
    assert short < flops_per_token(m, 8192)["total"] / 3


def _compile(*args):
    return subprocess.run([sys.executable, "-m", "olmax.cli", "compile", *args], capture_output=True, text=True)


def test_sweep_refuses_an_unknown_policy():
    from olmax.compile import sweep_choices
    with pytest.raises(ConfigError, match="fastest"):
        sweep_choices(get_recipe("tiny"), parse_topology("v5p:2x2x1"), ["full", "fastest"], None, None)


def test_where_xla_times_no_row_the_sweep_picks_the_fewest_flops_and_says_so(monkeypatch, capsys):
    """v6e steps and every Ironwood program get no time from XLA's cost model: the sweep then
    ranks what fits by recompute overhead (the kernel's work counted) and names that rank."""
    import olmax.compile as oc
    overheads = {"full": 1.30, "save_attn_out": 1.22, "none": 1.0}
    gib = {"full": 10.0, "save_attn_out": 20.0, "none": 31.0}  # none leaves under 10% of 31.25 free

    def fake(cfg, topology, **kw):
        r = cfg.model.remat
        return {"per_device_gib": gib[r], "hbm_gib": 31.25, "fits": True, "verdict": "fits",
                "plan": {"accum_steps": 1}, "compile_seconds": 0.0, **dict.fromkeys(oc.COST_KEYS),
                "recompute_overhead": overheads[r] - 0.1, "recompute_overhead_with_attention": overheads[r]}
    monkeypatch.setattr(oc, "compile_for", fake)
    s = oc.sweep(get_recipe("tiny"), parse_topology("v5p:2x2x1"), remats=list(overheads), micro_batches=[4])
    assert s["best"]["remat"] == "save_attn_out" and s["best_by"] == "recompute_overhead"
    err = capsys.readouterr().err  # each row says what it found as it finishes, a long sweep's progress
    assert "sweep: remat=none micro_batch=4 block=" in err and ": 31.00 of 31.25 GiB a device (fits)" in err
    oc.print_sweep(s)  # the table shows the figure it ranked by, and says why
    out = capsys.readouterr().out
    assert "computes least" in out and "1.22x" in out and "<- best" in out
    timed = {"estimated_mfu": 0.5, "optimal_seconds": 1.0}
    monkeypatch.setattr(oc, "compile_for", lambda cfg, topology, **kw: {**fake(cfg, topology), **(
        timed if cfg.model.remat == "full" else {})})
    s = oc.sweep(get_recipe("tiny"), parse_topology("v5p:2x2x1"), remats=list(overheads), micro_batches=[4],
                 progress=False)
    assert s["best"]["remat"] == "full" and s["best_by"] == "estimated_mfu"  # a time, where there is one, wins


@pytest.mark.integration  # four CLI processes that load libtpu
def test_sweep_bad_input_exits_2():
    for args, said in [(["--sweep", "--remat", "fastest"], "fastest"), (["--sweep", "--micro-batches", "3"], "3"),
                       (["--headroom", "1.5"], "--headroom"), (["--sweep", "--no-cost"], "--sweep")]:
        r = _compile("tiny", "--topology", "v5p:2x2x1", "--json", *args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert said in json.loads(r.stdout.strip().splitlines()[-1])["error"], args


# --------------------------------------------------------------------------- compiles


@pytest.mark.integration
def test_cost_analysis_is_per_device_for_a_sharded_matmul():
    """A bf16 matmul with its rows split over the 4 devices of v5p:2x2x1: XLA reports one
    device's share of the FLOPs, 2 N^3 / 4 (a replicated one: all of them)."""
    code = """
import json
from olmax.compile import abstract_devices, parse_topology, quiet_libtpu, xla_cost
t = parse_topology("v5p:2x2x1"); quiet_libtpu(t)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(abstract_devices(t)), ("x",))
N = 4096
split = jax.ShapeDtypeStruct((N, N), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", None)))
whole = jax.ShapeDtypeStruct((N, N), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
mm = jax.jit(lambda a, b: a @ b)
print(json.dumps([xla_cost(mm.lower(split, whole).compile()), xla_cost(mm.lower(whole, whole).compile())]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    sharded, replicated = json.loads(r.stdout.strip().splitlines()[-1])
    assert sharded["flops"] == pytest.approx(2 * 4096 ** 3 / 4, rel=1e-3)
    assert replicated["flops"] == pytest.approx(2 * 4096 ** 3, rel=1e-3)
    assert 0 < sharded["seconds"] < replicated["seconds"]


@pytest.mark.integration
def test_a_windowed_einsum_is_costed_whole():
    """XLA splits an FSDP matmul over 8 devices of v5p-16 into windowed einsums (loops that
    overlap the weight's all-gather and its gradient's reduce-scatter with the product) and
    counts each loop's body once; compiled for its cost (``cost_compile``) the program has no
    such loop and reports the forward's and the weight gradient's FLOPs, 2 x 2 T D F a device."""
    code = """
import json
from olmax.compile import abstract_devices, cost_compile, parse_topology, quiet_libtpu, xla_cost
t = parse_topology("v5p-16"); quiet_libtpu(t)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(abstract_devices(t)), ("fsdp",))
rows = NamedSharding(mesh, P("fsdp", None))
x = jax.ShapeDtypeStruct((mesh.size * 2048, 4096), jnp.bfloat16, sharding=rows)
w = jax.ShapeDtypeStruct((4096, 11008), jnp.bfloat16, sharding=rows)
grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.square((x @ w).astype(jnp.float32)))), out_shardings=rows)
lowered = grad.lower(w, x)
out = {}
for name, c in (("as_run", lowered.compile()), ("for_cost", cost_compile(lowered, mesh))):
    out[name] = dict(xla_cost(c), loops=c.as_text().count("windowed_dot_general_body"))
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    expected = 2 * 2 * 2048 * 4096 * 11008
    assert out["as_run"]["loops"] > 0, "XLA made no windowed einsum here: the test no longer tests the case"
    assert out["as_run"]["flops"] < 0.75 * expected
    assert out["for_cost"]["loops"] == 0
    assert out["for_cost"]["flops"] == pytest.approx(expected, rel=1e-3)


@pytest.mark.integration
def test_scanned_and_micro_batched_costs_match_the_unrolled_program():
    """XLA counts a loop's body once: the cost of 12 scanned layers (3 groups) and of 4
    micro-batches must still be what the unrolled, single-pass program costs."""
    base = ["--set", "model.attention_impl=auto", "--set", "model.compute_dtype=bfloat16", "--set",
            "model.n_layers=12", "--set", "model.remat=full", "--no-eval", "--json"]
    runs = {}
    for name, extra in [("scanned", []), ("unrolled", ["--set", "model.scan_layers=false"]),
                        ("micro", ["--set", "train.micro_batch_size=1"])]:
        r = _compile("tiny", "--topology", "v5p:2x2x1", *base, *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[name] = json.loads(r.stdout)
    s, u, mb = runs["scanned"], runs["unrolled"], runs["micro"]
    assert mb["plan"]["accum_steps"] == 4 and s["plan"]["accum_steps"] == 1
    for out in (s, u, mb):
        assert set(COST_KEYS) <= set(out) and out["peak_flops_per_device"] == 459e12
        assert out["model_flops_per_device"] == u["model_flops_per_device"]
    assert s["flops_per_device"] == pytest.approx(u["flops_per_device"], rel=0.02)
    assert mb["flops_per_device"] == pytest.approx(u["flops_per_device"], rel=0.02)
    assert s["optimal_seconds"] == pytest.approx(u["optimal_seconds"], rel=0.10)
    # full remat recomputes each layer's forward: more FLOPs than the model's
    assert 1.05 < u["recompute_overhead"] < 1.34


@pytest.mark.integration
def test_sweep_tabulates_policies_and_picks_the_best_that_leaves_headroom():
    r = _compile("tiny", "--topology", "v5p:2x2x1", "--sweep", "--remat", "none,full", "--micro-batches", "2,4",
                 "--set", "model.attention_impl=auto", "--set", "model.compute_dtype=bfloat16", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    rows = {(x["remat"], x["micro_batch"]): x for x in s["rows"]}
    assert set(rows) == {("none", 2), ("none", 4), ("full", 2), ("full", 4)}
    assert rows[("full", 4)]["recompute_overhead"] > rows[("none", 4)]["recompute_overhead"]
    assert rows[("none", 2)]["accum_steps"] == 2
    assert s["best"] == max(s["rows"], key=lambda x: x["estimated_mfu_with_attention"])
    assert "estimate" in s["note"] and s["attention_unseen_fraction"] > 0 and "upper bound" in s["note"]
    for x in s["rows"]:  # splash's work priced in: slower than XLA alone says, by more where full remat redoes it
        assert x["seconds_with_attention"] > x["optimal_seconds"]
        assert x["recompute_overhead_with_attention"] > x["recompute_overhead"]
    assert (rows[("full", 4)]["attention_kernel_flops_per_device"]
            == pytest.approx(4 / 3 * rows[("none", 4)]["attention_kernel_flops_per_device"]))


def test_a_program_xla_does_not_time_has_no_time_and_no_mfu():
    """XLA's cost model answers -2 s where it has no estimate (every Ironwood program with libtpu
    0.0.42.1): no step time and no MFU are reported, and no extrapolation turns it into one."""
    class Compiled:
        def __init__(self, secs):
            self.secs = secs

        def cost_analysis(self):
            return {"flops": 1e12, "bytes accessed": 1e9, "optimal_seconds": self.secs}

    none = xla_cost(Compiled(-1.9997))
    assert none["flops"] == 1e12 and none["seconds"] != none["seconds"]   # NaN
    s = cost_summary(none, 0.9e12, 459e12)
    assert s["optimal_seconds"] is None and s["estimated_mfu"] is None and s["flops_per_device"] == 1e12
    timed = cost_summary(xla_cost(Compiled(0.01)), 0.9e12, 459e12)
    assert timed["optimal_seconds"] == 0.01 and timed["estimated_mfu"] == pytest.approx(0.9e12 / (0.01 * 459e12))
