"""The code that only TPUs and GPUs run, run on the CPU: the model's accelerator branches
(separate q/k/v and gate/up projections, einsum projections) and splash attention in fp32 and
bf16 against the CPU path and the fp32 reference, logits and gradients; splash on sequences
shorter than its 128-position block (lm-eval's buckets, short evals and prompts) in Pallas
interpret mode and compiled for abstract TPU devices; the head-major copy of the CPU kernel
without a collective on a batch-sharded mesh; one RoPE table per distinct frequency set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.model import dispatch, olmo3
from olmax.model.attention import reference_attention, splash_attention, splash_length
from olmax.model.params import init_params
from olmax.recipes import get_recipe
from trainlib import normal

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _rel(a, b) -> float:
    """Largest |a - b| over the largest |b| (fp32)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _qkv(b, t, h, kv, e, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(normal(k, (b, t, n, e)).astype(dtype) for k, n in zip(ks, (h, kv, kv)))


# --------------------------------------------------------------------------- short sequences


def test_splash_length():
    """Multiples of 128 run as they are (a 640 that 512-blocks do not tile stays the caller's
    error); shorter or ragged lengths pad to the next length both blocks tile."""
    assert [splash_length(t, 512, 512) for t in (16, 100, 128, 200, 256, 640, 1000)] == [
        128, 128, 128, 256, 256, 640, 1024]
    assert splash_length(300, 256, 512) == 512  # 384 is not tiled by 256-blocks
    assert splash_length(300, 128, 128) == 384


@pytest.mark.parametrize("t,window,segments", [(16, None, False), (100, 64, True)])
def test_splash_pads_short_and_ragged_sequences(t, window, segments):
    """Splash (Pallas interpret mode) on a length below its 128-position block and a ragged one
    (padded to 128), causal and windowed, with and without segment ids (a prefill's: the prompt,
    then padding as segment 0), against the exact reference: output and gradients."""
    cfg = replace(get_recipe("tiny").model, attention_block_q=512, attention_block_kv=512)
    q, k, v = _qkv(1, t, 2, 1, 32, seed=t)
    seg = jnp.asarray((np.arange(t)[None, :] < t - 5).astype(np.int32)) if segments else None
    kernel = jax.jit(lambda q, k, v: splash_attention(q, k, v, window, cfg, segment_ids=seg))
    ref = lambda q, k, v: reference_attention(q, k, v, window, seg)
    out = kernel(q, k, v)
    assert out.shape == q.shape
    # The reference compiled whole: op by op, each of its ~60 operations compiles on its own.
    assert _rel(out, jax.jit(ref)(q, k, v)) <= 1e-5
    loss = lambda fn: (lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))))
    g = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g, g_ref):
        assert _rel(a, b) <= 1e-5, name


TPU_SCRIPT = textwrap.dedent("""
    import json, sys
    from dataclasses import replace
    from olmax.compile import abstract_devices, compile_generate, parse_topology, quiet_libtpu
    topo = parse_topology("v5p:2x2x1")
    quiet_libtpu(topo)
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from olmax.eval.heldout import make_eval_step
    from olmax.model.olmo3 import forward
    from olmax.model.params import init_params
    from olmax.recipes import get_recipe
    from olmax.sharding import activation_mesh, batch_sharding, make_mesh
    cfg = get_recipe("tiny", ["model.attention_impl=auto", "model.compute_dtype=bfloat16", "model.n_kv_heads=2"])
    devices = abstract_devices(topo)
    params = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))
    out = {}

    def compiled(fn, mesh, args):
        specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())),
                             args[0])
        lowered = jax.jit(fn).lower(specs, *args[1:])
        lowered.compile()
        return "tpu_custom_call" in lowered.as_text()  # the splash kernel, not a fallback

    # lm-eval's scoring forward on one chip (no shard_map), at its smallest buckets and a ragged length.
    one = make_mesh(cfg.mesh, devices[:1])
    for t in (16, 64, 100):
        ids = jax.ShapeDtypeStruct((2, t), jnp.int32, sharding=batch_sharding(one))
        def score(p, x):
            with activation_mesh(one):
                return forward(p, x, cfg.model)
        out[f"forward_{t}"] = compiled(score, one, (params, ids))
    # The held-out eval step at 48 tokens on four chips (splash under shard_map).
    mesh = make_mesh(cfg.mesh, devices)
    batch = {"input_ids": jax.ShapeDtypeStruct((4, 48), jnp.int32, sharding=batch_sharding(mesh)),
             "label_mask": jax.ShapeDtypeStruct((4, 48), jnp.bool_, sharding=batch_sharding(mesh))}
    out["eval_48"] = compiled(make_eval_step(cfg, mesh), mesh, (params, batch))
    # Generation: the prefill of 4 prompts of 32 tokens and a decode step.
    out["generate_32"] = compile_generate(cfg, topo, 4, 32, progress=False)["fits"]
    print(json.dumps(out))
""")


@pytest.mark.integration
def test_short_sequences_compile_for_tpu():
    """On (abstract) TPU devices, where "auto" is splash: lm-eval's forward at 16, 64 and 100
    tokens on one chip, the eval step at 48 tokens sharded over four, and the prefill of 32-token
    prompts all compile, through the splash kernel (a Mosaic custom call in the program). Before
    the padding each refused: "attention_block_q=512 does not tile the sequence length 16"."""
    pytest.importorskip("libtpu")
    r = subprocess.run([sys.executable, "-c", TPU_SCRIPT], capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"forward_16": True, "forward_64": True, "forward_100": True, "eval_48": True,
                   "generate_32": True}, out


# --------------------------------------------------------------------------- accelerator branches


def _model(dtype="float32", **kw):
    """tiny, smaller (splash runs in interpret mode): 2 layers (sliding, full), GQA 2:1."""
    cfg = get_recipe("tiny", [f"model.compute_dtype={dtype}", "model.n_layers=2", "model.n_heads=2",
                              "model.n_kv_heads=1", "model.full_attention_every=2"])
    return replace(cfg.model, attention_block_q=128, attention_block_kv=128, **kw)


def _logits_and_grads(m, params, ids, platform=None, monkeypatch=None):
    """fp32 logits and the gradient of the mean next-token CE, with the model's projections
    forced onto ``platform``'s branch (the model looks it up in ``dispatch.target_platform``)."""
    if platform is not None:
        monkeypatch.setattr(dispatch, "target_platform", lambda: platform)

    def loss(p):
        logits = olmo3.forward(p, ids, m)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)), logits

    (_, logits), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    if platform is not None:
        monkeypatch.undo()
    return logits, g


def _worst(g, g_ref) -> float:
    return max(_rel(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)))


@pytest.fixture(scope="module")
def tiny():
    m = _model()
    params = init_params(m, jax.random.key(7))
    ids = jnp.asarray(np.random.default_rng(7).integers(0, m.vocab_size, (1, 128)), jnp.int32)
    ref = _logits_and_grads(replace(m, attention_impl="reference"), params, ids)
    cpu = _logits_and_grads(replace(m, attention_impl="blocked"), params, ids)
    return m, params, ids, ref, cpu


@pytest.mark.integration
def test_accelerator_branches_match_the_cpu_path(tiny, monkeypatch):
    """Separate q/k/v and gate/up projections and einsum matmuls (the TPU/GPU branch: the model only
    asks the dispatch whether the target is the CPU) through the fp32 reference kernel and through splash
    (interpret mode), against the CPU's joined 2-D matmuls and blocked kernel and against the
    fp32 reference on the CPU branch: logits and every parameter's gradient (they agreed within
    2.4e-6 relative when this test was written)."""
    m, params, ids, (ref_logits, ref_g), (cpu_logits, cpu_g) = tiny
    for impl in ("reference", "splash"):
        logits, g = _logits_and_grads(replace(m, attention_impl=impl), params, ids, "tpu", monkeypatch)
        for what, (want_logits, want_g) in (("cpu", (cpu_logits, cpu_g)), ("reference", (ref_logits, ref_g))):
            assert _rel(logits, want_logits) <= 1e-5, (impl, what, _rel(logits, want_logits))
            assert _worst(g, want_g) <= 1e-5, (impl, what, _worst(g, want_g))


def test_accelerator_branches_trace_separate_projections(monkeypatch):
    """The forced branch is the accelerator's: q, k, v, out, gate, up, down and the LM head as
    einsums over [b, t, i]; on the CPU's, joined qkv and gate/up, 2-D matmuls (the LM head aside)."""
    # Traced only: the parameters as shapes, and not the ``tiny`` fixture, whose reference logits and
    # gradients (two compiles of the model's step) only the integration tier's tests use.
    m = replace(_model(), scan_layers=False, n_layers=1, attention_impl="reference")
    ids = jnp.zeros((1, 128), jnp.int32)
    params = jax.eval_shape(lambda: init_params(m, jax.random.key(1)))

    def dots(platform):
        monkeypatch.setattr(dispatch, "target_platform", lambda: platform)
        jaxpr = jax.make_jaxpr(lambda p: olmo3.forward(p, ids, m))(params)
        monkeypatch.undo()
        shapes = [len(e.invars[0].aval.shape) for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
        return shapes.count(2), shapes.count(3)  # the attention kernel's own einsums are 4- and 5-D

    assert dots("tpu") == (0, 8)
    assert dots("cpu") == (4, 1)


@pytest.mark.integration
def test_bf16_splash_matches_the_cpu_path_and_the_fp32_reference(tiny):
    """bf16 compute through splash (q scaled in fp32 and rounded to bf16 before the kernel) is as
    close to the fp32 reference as the CPU's bf16 path is, logits and gradients, and close to the
    CPU's bf16 path itself."""
    m, params, ids, (ref_logits, ref_g), _ = tiny
    bf = _model("bfloat16")
    cpu_logits, cpu_g = _logits_and_grads(replace(bf, attention_impl="blocked"), params, ids)
    sp_logits, sp_g = _logits_and_grads(replace(bf, attention_impl="splash"), params, ids)
    cpu_err, sp_err = _rel(cpu_logits, ref_logits), _rel(sp_logits, ref_logits)
    assert 0 < sp_err <= 2 * cpu_err, (sp_err, cpu_err)  # bf16 rounding, no worse than the CPU's
    assert _rel(sp_logits, cpu_logits) <= 2 * cpu_err, (_rel(sp_logits, cpu_logits), cpu_err)
    cpu_gerr, sp_gerr = _worst(cpu_g, ref_g), _worst(sp_g, ref_g)
    assert sp_gerr <= 2 * cpu_gerr, (sp_gerr, cpu_gerr)
    print(f"bf16 vs fp32 reference: logits cpu {cpu_err:.2e} splash {sp_err:.2e}; grads cpu {cpu_gerr:.2e} "
          f"splash {sp_gerr:.2e}")


# --------------------------------------------------------------------------- collectives, RoPE


MESH_SCRIPT = textwrap.dedent("""
    import json, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from olmax.model.attention import _head_major
    from olmax.model.olmo3 import forward
    from olmax.model.params import init_params
    from olmax.recipes import get_recipe
    from olmax.sharding import activation_mesh, batch_sharding, make_mesh
    cfg = get_recipe("tiny")
    mesh = make_mesh(cfg.mesh, jax.devices())
    params = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))
    rep = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), params)
    ids = jax.ShapeDtypeStruct((4, cfg.data.sequence_length), jnp.int32, sharding=batch_sharding(mesh))
    def fwd(p, x):
        with activation_mesh(mesh):
            return forward(p, x, cfg.model)
    text = jax.jit(fwd).lower(rep, ids).compile().as_text()
    out = {op: text.count(f" {op}(") for op in ("all-reduce", "all-gather", "collective-permute", "all-to-all")}
    # The copy is exact on the mesh too: first elements of rows and heads of every kind.
    x = jax.random.normal(jax.random.key(5), (4 * 6 * 4 * 8,)).reshape(4, 6, 4, 8)  # trainlib.normal's draw
    x = x.at[1, 0, 2, 0].set(jnp.inf).at[2, 0, 1, 0].set(jnp.nan).at[3, 0, 0, 0].set(-0.0)
    x = jax.device_put(x, batch_sharding(mesh, 4))
    def hm(x):
        with activation_mesh(mesh):
            return _head_major(x, 2)
    want = np.asarray(x).reshape(4, 6, 2, 2, 8).transpose(0, 2, 3, 1, 4)
    out["exact"] = np.asarray(jax.jit(hm)(x)).tobytes() == want.tobytes()
    print(json.dumps(out))
""")


def test_head_major_adds_no_collective_on_a_batch_sharded_mesh():
    """The tiny forward on two CPU devices (batch-sharded, replicated weights) is collective-free:
    the head-major copy's one is read per row and head, not from one element of the whole array
    (which cost an all-reduce per layer: 4 in this program before), and the copy stays exact."""
    env = {**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    r = subprocess.run([sys.executable, "-c", MESH_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"all-reduce": 0, "all-gather": 0, "collective-permute": 0, "all-to-all": 0, "exact": True}, out


def test_rope_tables_built_once_per_distinct_frequencies():
    """Full and sliding layers share one cos/sin table (one pair of constants in the program)
    unless YaRN rescales the full ones; with per-row positions the same."""
    m = get_recipe("tiny").model
    for positions in (None, jnp.zeros((2, 8), jnp.int32)):
        tables = olmo3.rope_tables(m, 8, positions)
        assert set(tables) == {True, False} and tables[True] is tables[False]
    yarn = get_recipe("olmo3_7b_stage3").model
    assert yarn.rope_scaling is not None
    tables = olmo3.rope_tables(yarn, 8)
    assert tables[True] is not tables[False]
    assert not np.array_equal(np.asarray(tables[True][0]), np.asarray(tables[False][0]))
    params = jax.eval_shape(lambda: init_params(m, jax.random.key(0)))
    text = jax.jit(lambda p, x: olmo3.forward(p, x, m)).lower(params,
                                                               jax.ShapeDtypeStruct((1, 16), jnp.int32)).as_text()
    import re
    assert len(re.findall(r"= stablehlo.constant dense[^\n]*tensor<16x32xf32>", text)) == 2  # one cos, one sin


# --------------------------------------------------------------------------- float32 products


def _dot_precisions(closed) -> list:
    """The ``precision`` of every dot_general in a jaxpr, nested ones (scan, remat, custom_vjp,
    jit) included."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                found.append(e.params["precision"])
            for v in e.params.values():
                for x in v if isinstance(v, (list, tuple)) else (v,):
                    if hasattr(x, "eqns"):
                        walk(x)
                    elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                        walk(x.jaxpr)
    walk(closed.jaxpr)
    return found


@pytest.mark.parametrize("platform", ["gpu", "tpu", "cpu"])
def test_float32_compute_multiplies_in_float32_on_accelerators(platform, monkeypatch):
    """JAX's default precision lets a GPU multiply float32 on TF32 tensor cores and a TPU in one
    bf16 pass (on an H200 RL's fp32 log-prob gap was 4.4e-3 that way, 8.6e-6 exact). With the compute
    dtype float32, every dot the training step (forward, the loss head and every gradient, the
    blocked kernel's hand-written backward) and decoding (prefill, decode step) trace for a GPU or
    TPU asks for float32 ("highest"); bf16 compute keeps the backend's default, and the CPU's
    programs (float32 either way) are as they were: no dot asks for more."""
    from olmax.config import Config
    from olmax.model import decode, loss
    monkeypatch.setattr(dispatch, "target_platform", lambda: platform)
    impls = ("xla", "blocked") if platform != "cpu" else ("auto",)
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 200, (2, 64)), jnp.int32)
    batch = {"input_ids": ids, "label_mask": jnp.ones(ids.shape, bool)}
    for dtype in ("float32", "bfloat16"):
        for impl in impls:
            m = _model(dtype, attention_impl=impl)
            cfg = Config(model=m)
            # Traced, never run: shapes stand for the parameters, the prepared weights and the cache.
            params = jax.eval_shape(lambda: init_params(m, jax.random.key(0)))
            grad = _dot_precisions(jax.make_jaxpr(jax.grad(lambda p: loss.head_loss(p, batch, cfg)[0]))(params))
            prepared = jax.eval_shape(lambda p: decode.prepare(p, m), params)
            lengths = jnp.full((2,), 64, jnp.int32)
            pre = jax.make_jaxpr(lambda w, t, n: decode.prefill(w, t, n, m, 128))(prepared, ids, lengths)
            _, cache = jax.eval_shape(lambda w, t, n: decode.prefill(w, t, n, m, 128), prepared, ids, lengths)
            step = jax.make_jaxpr(lambda w, t, c: decode.decode_step(w, t, c, m, 128))(prepared, ids[:, 0], cache)
            dots = grad + _dot_precisions(pre) + _dot_precisions(step)
            assert len(grad) >= 20 and len(_dot_precisions(step)) >= 8, (len(grad), impl)
            if dtype == "float32" and platform != "cpu":
                assert all(p == highest for p in dots), (platform, impl, {str(p) for p in dots})
            else:
                assert not any(p == highest for p in dots), (platform, dtype, impl)
