"""The production path computes what the simple one does: splash attention (Pallas interpret
mode on CPU) and the CPU's blocked attention against the exact reference, the hand-written
backward passes (SwiGLU, the LM-head loss) against autodiff, scanned against unrolled layers, the chunked loss
against whole logits, micro-batched against single-batch steps (losses *and* gradients), and
every remat policy. Plus ahead-of-time compilation for a small TPU slice and the `compile` CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.compile import parse_topology
from olmax.config import ConfigError
from olmax.eval.heldout import make_eval_step
from olmax.kernels import cpu as cpu_kernels
from olmax.model import layers, olmo3
from olmax.model.attention import _head_major, blocked_attention, reference_attention, splash_attention
from olmax.model.dispatch import resolve_attention
from olmax.model.loss import head_loss, loss_denominator, loss_sums
from olmax.model.olmo3 import REMAT_NAMES, layer_groups
from olmax.model.params import init_params
from olmax.objectives.lm import make_lm_step
from olmax.recipes import get_recipe
from trainlib import normal

RTOL = 1e-6

INTEGRATION = pytest.mark.integration  # the larger cases: `make test-integration`


def _qkv(b, t, h, kv, e, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (normal(ks[0], (b, t, h, e)), normal(ks[1], (b, t, kv, e)),
            normal(ks[2], (b, t, kv, e)))


def _assert_matches_reference(kernel, q, k, v, window):
    """``kernel(q, k, v)`` against ``reference_attention``: output and the gradients of a
    nonlinear function of it, within 1e-5 of the largest magnitude (fp32)."""
    ref_fn = lambda q, k, v: reference_attention(q, k, v, window)
    # Compiled whole: run op by op, each of the ~100 operations compiles on its own.
    out, ref = jax.jit(kernel)(q, k, v), jax.jit(ref_fn)(q, k, v)
    assert float(jnp.abs(out - ref).max()) <= 1e-5 * max(1.0, float(jnp.abs(ref).max()))

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
    g = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(loss(ref_fn), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g, g_ref):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * max(1.0, float(jnp.abs(b).max())), f"d{name}"


@pytest.mark.parametrize("window,heads,kv", [pytest.param(*c, marks=INTEGRATION)
                                             for c in [(None, 4, 4), (64, 4, 2), (200, 4, 1)]])
def test_splash_matches_reference_forward_and_gradients(window, heads, kv):
    """fp32, sequence 256 in 128-blocks: full causal, window 64 (blocks outside it skipped) and a
    window that does not align with the blocks; MHA, GQA and MQA."""
    cfg = replace(get_recipe("tiny").model, attention_block_q=128, attention_block_kv=128)
    _assert_matches_reference(lambda q, k, v: splash_attention(q, k, v, window, cfg), *_qkv(2, 256, heads, kv, 32),
                              window)


@pytest.mark.parametrize("t,window,heads,kv,block", [
    (96, 7, 2, 2, 32), *(pytest.param(*c, marks=INTEGRATION) for c in [
        (256, None, 4, 4, None), (256, 64, 4, 2, None), (200, 100, 4, 1, 64), (64, None, 2, 1, 64),
        (256, 64, 4, 2, 32), (200, 100, 4, 1, 32), (200, None, 4, 2, 24)])])
def test_blocked_attention_matches_reference_forward_and_gradients(t, window, heads, kv, block):
    """The CPU kernel and its hand-written backward pass: causal and windowed, windows that do and
    do not align with the blocks, a partial last block (200 = 3 x 64 + 8), GQA/MQA, one block for
    the whole sequence."""
    kernel = lambda q, k, v: blocked_attention(q, k, v, window, block)
    _assert_matches_reference(kernel, *_qkv(2, t, heads, kv, 32, seed=3), window)


@pytest.mark.parametrize("corner", [1.5, float("inf"), float("nan"), -0.0])
def test_head_major_copy_is_exact(corner):
    """The division that keeps the head-major copy a buffer is by exactly one, whatever the
    values (the one is built from the first element): every bit of the transpose, infs, NaNs and
    signed zeros included, and the gradient is the transposed cotangent bit for bit. Subnormals
    read as zero, as in every arithmetic operation of XLA CPU (the attention's matmuls too)."""
    x = normal(jax.random.key(5), (2, 6, 4, 8)).at[0, 0, 0, 0].set(corner)
    x = x.at[1, 2, 3].set(jnp.array([jnp.inf, -jnp.inf, jnp.nan, -0.0, 0.0, 3e-45, 3e38, -1.0]))
    want = np.asarray(x).reshape(2, 6, 2, 2, 8).transpose(0, 2, 3, 1, 4).copy()
    want[(np.abs(want) < np.finfo(np.float32).tiny) & (want != 0)] = 0.0
    got = np.asarray(jax.jit(_head_major, static_argnums=1)(x, 2))
    assert got.tobytes() == want.tobytes()
    w = normal(jax.random.key(6), want.shape)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(_head_major(x, 2) * w)))(x)
    assert np.asarray(grad).tobytes() == np.asarray(w).transpose(0, 3, 1, 2, 4).reshape(x.shape).tobytes()


def test_swiglu_backward_equals_autodiff():
    gu = normal(jax.random.key(4), (2, 16, 2 * 24)) * 3
    plain = lambda gu: jnp.sum(jnp.cos(jax.nn.silu(gu[..., :24]) * gu[..., 24:]))
    assert float(jnp.abs(layers.swiglu(gu) - jax.nn.silu(gu[..., :24]) * gu[..., 24:]).max()) == 0.0
    got = jax.jit(jax.grad(lambda gu: jnp.sum(jnp.cos(layers.swiglu(gu)))))(gu)
    want = jax.jit(jax.grad(plain))(gu)
    assert float(jnp.abs(got - want).max()) <= 1e-5 * float(jnp.abs(want).max())


def test_splash_window_is_w_keys_including_self():
    """A key exactly W positions back must not be seen; W-1 back must be."""
    cfg = replace(get_recipe("tiny").model, attention_block_q=128, attention_block_kv=128)
    W, qi = 16, 100
    q, k, v = _qkv(1, 128, 2, 2, 32, seed=1)
    base = splash_attention(q, k, v, W, cfg)[0, qi]
    for back, seen in ((W, False), (W - 1, True)):
        v2 = v.at[0, qi - back].add(10.0)
        changed = bool(jnp.abs(splash_attention(q, k, v2, W, cfg)[0, qi] - base).max() > 1e-3)
        assert changed == seen, back


def test_auto_attention_per_platform():
    assert resolve_attention("auto", jnp.bfloat16, "tpu") == "splash"
    assert resolve_attention("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert resolve_attention("auto", jnp.float32, "gpu") == "xla"
    assert resolve_attention("auto", jnp.float32, "cpu") == "blocked"
    assert resolve_attention("auto", jnp.float32, "cpu", True) == ("cpu" if cpu_kernels.available() else "blocked")
    assert resolve_attention("auto", jnp.bfloat16, "cpu") == "blocked"
    assert resolve_attention("splash", jnp.float32, "cpu") == "splash"


def test_splash_block_must_tile_sequence():
    """A length of whole 128-blocks that the configured blocks do not tile is refused (a training
    shape; shorter and ragged lengths are padded: tests/test_accelerator_paths.py)."""
    cfg = replace(get_recipe("tiny").model, attention_block_q=256, attention_block_kv=256)
    q, k, v = _qkv(1, 384, 2, 2, 32)
    with pytest.raises(ConfigError, match="attention_block_q=256 does not tile the sequence length 384"):
        splash_attention(q, k, v, None, cfg)


# --------------------------------------------------------------------------- loss and gradients


def _cfg(**model):
    cfg = get_recipe("tiny")
    return replace(cfg, model=replace(cfg.model, **model))


def _grads(cfg, params, ids, mask, accum=1):
    """(CE loss, z-loss, gradient pytree) of one train step, without the optimizer."""
    def keep(p, g, o, ce):
        return p, o, {"grads": g}
    step = jax.jit(make_lm_step(cfg, accum, keep))
    _, _, m = step(params, None, {"input_ids": ids, "label_mask": mask})
    return float(m["ce_loss"]), float(m["z_loss"]), m["grads"]


def _assert_same(a, b, what):
    (ce_a, z_a, g_a), (ce_b, z_b, g_b) = a, b
    assert abs(ce_a - ce_b) <= RTOL * abs(ce_b), (what, ce_a, ce_b)
    assert abs(z_a - z_b) <= RTOL * abs(z_b) + 1e-12, (what, z_a, z_b)
    na = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g_a))))
    nb = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g_b))))
    assert abs(na - nb) <= RTOL * nb, (what, "grad norm", na, nb)
    worst = max(float(jnp.abs(x - y).max() / (jnp.abs(y).max() + 1e-30))
                for x, y in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)))
    assert worst <= 1e-5, (what, "worst leaf", worst)


def _batch(cfg, b=4, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (b, cfg.data.sequence_length)), jnp.int32)
    mask = jnp.ones(ids.shape, bool).at[1, 40:90].set(False)
    return ids, mask


@pytest.mark.parametrize("n_layers", [pytest.param(8, marks=INTEGRATION), 6])
def test_scanned_layers_equal_unrolled(n_layers):
    """8 layers: two scanned groups of (3 sliding + 1 full). 6 layers: one group, then layers 4-5
    unrolled (the last forced to full attention)."""
    cfg = _cfg(n_layers=n_layers, scan_layers=True)
    period, groups = layer_groups(cfg.model)
    assert (period, groups) == (4, n_layers // 4)
    params = init_params(cfg.model, jax.random.key(0))
    ids, mask = _batch(cfg, b=2)
    scanned = _grads(cfg, params, ids, mask)
    unrolled = _grads(replace(cfg, model=replace(cfg.model, scan_layers=False)), params, ids, mask)
    _assert_same(scanned, unrolled, "scan")


@pytest.mark.parametrize("chunk", [32, pytest.param(48, marks=INTEGRATION)])
def test_chunked_loss_equals_whole_logits(chunk):
    """48 does not divide the 128 positions: the padded tail carries no label. One layer: the head
    is what chunks, and every layer below only carries its gradient (a compile each of the 4)."""
    cfg = _cfg(logits_chunk=chunk, n_layers=1)
    params = init_params(cfg.model, jax.random.key(1))
    ids, mask = _batch(cfg, b=2, seed=1)
    _assert_same(_grads(cfg, params, ids, mask),
                 _grads(replace(cfg, model=replace(cfg.model, logits_chunk=None)), params, ids, mask), "chunk")


@pytest.mark.parametrize("chunk,z_loss", [pytest.param(None, 1e-4, marks=INTEGRATION),
                                          pytest.param(48, 1e-4, marks=INTEGRATION), (32, None)])
def test_head_loss_gradient_equals_autodiff_of_the_loss(chunk, z_loss):
    """The LM-head loss computes its gradient in the forward pass; it must equal autodiff of the
    plain loss (CE + z-loss over the valid labels), and report the same sums. One layer under the
    head: the layers only carry the head's gradient back (a compile each of the 4)."""
    cfg = _cfg(logits_chunk=chunk, n_layers=1)
    cfg = replace(cfg, optim=replace(cfg.optim, z_loss=z_loss))
    params = init_params(cfg.model, jax.random.key(5))
    ids, mask = _batch(cfg, b=2)
    batch = {"input_ids": ids, "label_mask": mask}
    zm = z_loss or 0.0
    # Each compiled whole, as training and evaluation run them (op by op, ~100 operations compile
    # one by one): head_loss's sums as the train step's gradient computes them, loss_sums's as eval's.
    plain = jax.jit(jax.value_and_grad(lambda p: (lambda ce, z: (ce + zm * z) / 300.0)(*loss_sums(p, batch, cfg))))
    fused = jax.jit(jax.value_and_grad(lambda p: (lambda loss, sums: (loss / 300.0, sums))(*head_loss(p, batch, cfg)),
                                       has_aux=True))
    (l_p, g_p), ((l_f, sums_f), g_f) = plain(params), fused(params)
    assert abs(float(l_p) - float(l_f)) <= RTOL * abs(float(l_p))
    assert [float(x) for x in sums_f] == [float(x) for x in jax.jit(lambda p: loss_sums(p, batch, cfg))(params)]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_f), jax.tree.leaves(g_p)):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(b).max() + 1e-30), jax.tree_util.keystr(path)


@pytest.mark.integration
def test_eval_step_follows_the_training_rule():
    """One rule for training and held-out eval: the label mask is honoured, and a row whose labels
    are all masked adds its length L to the denominator (OLMo-core's "tokens with a zero loss")."""
    cfg = _cfg()
    params = init_params(cfg.model, jax.random.key(6))
    ids, mask = _batch(cfg, b=4, seed=6)
    mask = mask.at[3].set(False)
    batch = {"input_ids": ids, "label_mask": mask}
    L = cfg.data.sequence_length
    assert float(loss_denominator(mask)) == 4 * (L - 1) - 50 - (L - 1) + L
    ce, n = jax.jit(make_eval_step(cfg))(params, batch)
    assert float(n) == float(loss_denominator(mask))
    assert abs(float(ce) - float(loss_sums(params, batch, cfg)[0])) <= RTOL * float(ce)
    ce_train, _, _ = _grads(cfg, params, ids, mask)
    assert abs(float(ce) / float(n) - ce_train) <= RTOL * ce_train
    ce_all, _ = jax.jit(make_eval_step(cfg))(params, {"input_ids": ids, "label_mask": jnp.ones_like(mask)})
    assert float(ce_all) > float(ce)


@pytest.mark.integration
def test_document_masking_reaches_the_forward_in_train_and_eval():
    """``data.document_masking``: the train and eval steps compute positions and segment ids from
    EOS and pass them to the forward; the loss rule is unchanged."""
    cfg = _cfg()
    docs = replace(cfg, data=replace(cfg.data, document_masking=True, eos_token_id=1))
    params = init_params(cfg.model, jax.random.key(7))
    ids, mask = _batch(cfg, b=2, seed=7)
    ids = ids.at[0, 30].set(1).at[1, 70].set(1).at[1, 100].set(1)
    positions, segment_ids = olmo3.document_segments(ids, 1)
    packed = {"input_ids": ids, "label_mask": mask, "positions": positions, "segment_ids": segment_ids}
    ce_docs, n = jax.jit(make_eval_step(docs))(params, {"input_ids": ids, "label_mask": mask})
    assert abs(float(ce_docs) - float(jax.jit(lambda p: loss_sums(p, packed, cfg)[0])(params))) <= RTOL * float(ce_docs)
    ce_plain, _ = jax.jit(make_eval_step(cfg))(params, {"input_ids": ids, "label_mask": mask})
    assert float(ce_plain) != float(ce_docs)
    ce_train, _, _ = _grads(docs, params, ids, mask, accum=2)
    assert abs(float(ce_docs) / float(n) - ce_train) <= RTOL * ce_train


@pytest.mark.integration  # the unit tier has test_train's gradient-accumulation check
def test_micro_batched_step_equals_single_batch():
    cfg = _cfg()
    params = init_params(cfg.model, jax.random.key(2))
    ids, mask = _batch(cfg, b=4, seed=2)
    _assert_same(_grads(cfg, params, ids, mask, accum=2), _grads(cfg, params, ids, mask, accum=1), "micro")


@pytest.mark.integration
def test_remat_policies_keep_the_gradients():
    """Every policy that runs on the CPU (offload_proj needs host memory of an accelerator)."""
    cfg = _cfg(remat="none")
    params = init_params(cfg.model, jax.random.key(3))
    ids, mask = _batch(cfg, b=2, seed=3)
    base = _grads(cfg, params, ids, mask)
    for remat in REMAT_NAMES:
        if remat not in ("none", "offload_proj"):
            _assert_same(_grads(replace(cfg, model=replace(cfg.model, remat=remat)), params, ids, mask), base, remat)


def _saved_names(remat: str) -> set[str]:
    """The tensors one layer keeps for its backward pass under ``model.remat=remat``, by name
    (from JAX's own account of them, ``print_saved_residuals``)."""
    import contextlib
    import io
    import re

    cfg = _cfg(remat=remat).model
    p = init_params(cfg, jax.random.key(0))["layers"][cfg.full_attention_every - 1]
    cos, sin = layers.rope_cos_sin(cfg, np.arange(64), True)
    x = jnp.ones((1, 64, cfg.d_model), jnp.float32)
    fn = olmo3._layer_fn(cfg, None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p, x: fn(p, x, cos, sin).sum(), p, x)
    return set(re.findall(r"named '(\w+)'", out.getvalue()))


def test_save_proj_except_out_keeps_save_projs_tensors_but_the_output_projections():
    """It keeps the attention kernel's output (the kernel does not run again) and every projection
    output save_proj keeps but attention's o and the MLP's down, which run again."""
    proj, except_out = _saved_names("save_proj"), _saved_names("save_proj_except_out")
    assert {"query", "key", "value", "attn_out", "attn_proj", "mlp_out"} <= proj
    assert proj - except_out == {"attn_proj", "mlp_out"} and except_out < proj
    assert not olmo3.remat_recomputes_attention("save_proj_except_out")


def test_offload_remat_is_refused_on_cpu():
    cfg = _cfg(remat="offload_proj")
    params = init_params(cfg.model, jax.random.key(3))
    ids, mask = _batch(cfg, b=2, seed=3)
    with pytest.raises(ConfigError, match="offload_proj"):
        _grads(cfg, params, ids, mask)


@pytest.mark.integration  # a train step in interpret mode: `make test` stays under 8 minutes
def test_splash_train_step_matches_reference():
    """The whole step through splash (interpret mode) against the reference kernel."""
    cfg = _cfg(attention_block_q=128, attention_block_kv=128)
    params = init_params(cfg.model, jax.random.key(4))
    ids, mask = _batch(cfg, b=2, seed=4)
    ce_s, z_s, g_s = _grads(replace(cfg, model=replace(cfg.model, attention_impl="splash")), params, ids, mask)
    ce_r, z_r, g_r = _grads(cfg, params, ids, mask)
    assert abs(ce_s - ce_r) <= 1e-5 * ce_r
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_r)):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * max(1e-3, float(jnp.abs(b).max()))


# --------------------------------------------------------------------------- topologies, AOT


@pytest.mark.parametrize("name,shape,devices,chips", [
    ("v5p-128", "4x4x4", 64, 64), ("v6e-256", "16x16", 256, 256), ("tpu7x-128", "4x4x4", 128, 64),
    ("v5e-256", "16x16", 256, 256), ("v5p:2x2x1", "2x2x1", 4, 4), ("v5p-512", "4x8x8", 256, 256)])
def test_parse_topology(name, shape, devices, chips):
    t = parse_topology(name)
    assert (t.shape, t.devices, t.chips) == (shape, devices, chips)
    assert parse_topology(name, slices=2).devices == 2 * devices


@pytest.mark.parametrize("bad", ["v9-8", "v5p-7", "v5p-96", "v6e:4x4x4", "gpu"])
def test_parse_topology_rejects(bad):
    with pytest.raises(ConfigError, match="topology"):
        parse_topology(bad)


def _compile(*args):
    return subprocess.run([sys.executable, "-m", "olmax.cli", "compile", *args], capture_output=True, text=True)


def test_a_shape_libtpu_cannot_build_is_named():
    """v5p:1x1x1 parses (three dimensions) but libtpu cannot lay it out over its 2x2x1 hosts:
    exit 2 with the topology named, not a JaxRuntimeError traceback."""
    r = _compile("tiny", "--topology", "v5p:1x1x1", "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    err = json.loads(r.stdout.strip().splitlines()[-1])["error"]
    assert "'v5p:1x1x1'" in err and "libtpu cannot build it" in err


@pytest.mark.integration
def test_compile_small_model_for_a_tpu_slice():
    """AOT compile of the real train and eval steps (splash attention under shard_map, scanned
    layers, chunked loss, bf16, full remat) for two v5p:2x2x1 slices: data parallel across the
    slices, FSDP x tensor parallel within each. No TPU needed; XLA's memory analysis decides."""
    r = _compile("tiny", "--topology", "v5p:2x2x1", "--slices", "2", "--set", "model.attention_impl=auto",
                 "--set", "model.compute_dtype=bfloat16", "--set", "model.remat=full", "--set", "mesh.tensor=2",
                 "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["fits"] is True and out["devices"] == 8
    assert out["mesh"] == {"slice": 2, "data": 1, "fsdp": 2, "tensor": 2}
    assert 0 < out["per_device_gib"] < out["hbm_gib"] and out["temp_gib"] > 0 and out["argument_gib"] > 0
    assert out["plan"]["per_device"] == 4 and out["plan"]["data_parallel"] == 4 and out["eval"]["fits"] is True
    # The in-loop eval's figure counts the optimizer state that stays resident beside the eval step:
    # Adam's two fp32 moments, two thirds of the train step's logical arguments (parameters, moments,
    # batch; XLA's figure also has the TPU's tile padding: 0.52 of it here).
    ev = out["eval"]
    assert ev["per_device_gib"] == pytest.approx(ev["step_gib"] + ev["resident_gib"])
    assert 0.4 < ev["resident_gib"] / out["argument_gib"] <= 2 / 3, (ev, out["argument_gib"])
    assert "fits with" in out["verdict"]
    # The stderr of a CPU-only machine stays free of libtpu's chip-probing warnings.
    assert "TPU_WORKER_HOSTNAMES" not in r.stderr and "could not determine TPU" not in r.stderr


@pytest.mark.integration  # a TPU compile: `make test` stays under 8 minutes
def test_compile_reports_does_not_fit_with_exit_1():
    r = _compile("tiny", "--topology", "v5e:2x2", "--no-eval", "--set", "model.attention_impl=xla",
                 "--set", "train.global_batch_size=4096", "--set", "data.sequence_length=4096",
                 "--set", "model.logits_chunk=null", "--json")
    assert r.returncode == 1, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["fits"] is False and out["per_device_gib"] > out["hbm_gib"]
    assert out["verdict"].startswith("does not fit by")


def test_compile_bad_topology_exits_2():
    r = _compile("tiny", "--topology", "v5p-7", "--json")
    assert r.returncode == 2
    assert "v5p-7" in json.loads(r.stdout)["error"]


class _Dev:
    """A stand-in device: what the slice count is read from."""
    def __init__(self, i: int, slice_index: int | None, platform: str = "tpu"):
        self.id, self.platform = i, platform
        if slice_index is not None:
            self.slice_index = slice_index


def _devs(slices: int, per_slice: int = 4, platform: str = "tpu") -> list:
    return [_Dev(s * per_slice + i, s if platform == "tpu" else None, platform)
            for s in range(slices) for i in range(per_slice)]


def test_the_slice_count_comes_from_the_devices():
    """mesh.slice left at 1 takes the count from the devices' slice_index (a run on N slices
    builds the mesh `olmax compile --slices N` measured); an explicit value must agree."""
    from olmax.config import MeshConfig
    from olmax.sharding import device_slices, mesh_shape, slice_mesh_config
    assert (device_slices(_devs(2)) == 2 and device_slices(_devs(1)) == 1
            and device_slices(_devs(2, platform="cpu")) is None)
    cfg = slice_mesh_config(MeshConfig(), _devs(2))
    assert cfg.slice == 2 and mesh_shape(cfg, 8) == {"slice": 2, "data": 1, "fsdp": 4, "tensor": 1}
    assert slice_mesh_config(MeshConfig(slice=2), _devs(2)).slice == 2     # as `launch tpu --num-slices 2` sets it
    assert slice_mesh_config(MeshConfig(slice=-1, fsdp=4), _devs(2)).slice == -1  # resolves to 2
    assert slice_mesh_config(MeshConfig(), _devs(1)).slice == 1
    # Off TPU no device carries a slice: mesh.slice stays a plain data-parallel axis.
    assert slice_mesh_config(MeshConfig(slice=2), _devs(2, platform="cpu")).slice == 2


@pytest.mark.parametrize("mesh,devices,said", [
    (dict(slice=3), (3, 4), None),                       # 12 devices over 3 slices: fine
    (dict(slice=3), (2, 6), "mesh.slice=3 but the 12 devices span 2 slice"),
    (dict(slice=2), (1, 8), "mesh.slice=2 but the 8 devices span 1 slice"),  # a launch whose slices came up alone
    (dict(slice=-1, fsdp=2), (2, 4), "mesh.slice=-1 (resolved to 4) but the 8 devices span 2 slice"),
])
def test_a_slice_count_that_disagrees_with_the_devices_is_refused(mesh, devices, said):
    from olmax.config import MeshConfig
    from olmax.sharding import slice_mesh_config
    if said is None:
        assert slice_mesh_config(MeshConfig(**mesh), _devs(*devices)).slice == mesh["slice"]
        return
    with pytest.raises(ConfigError, match="slice_index") as e:
        slice_mesh_config(MeshConfig(**mesh), _devs(*devices))
    assert said in str(e.value)


_SAME_PROGRAM = """
import hashlib, json, shlex, sys
from olmax.compile import abstract_devices, parse_topology, quiet_libtpu
quiet_libtpu(parse_topology("v5p:2x2x1", 2))
import jax, jax.numpy as jnp
from olmax.checkpoint.state import abstract_train_state, shardings
from olmax.config import ConfigError
from olmax.objectives.lm import jit_lm_step
from olmax.recipes import get_recipe
from olmax.sharding import batch_sharding, make_mesh, plan_batch

def build(cfg, devices):
    # What the train loop and compile_for both do with a config and the global devices.
    mesh = make_mesh(cfg.mesh, devices)
    plan = plan_batch(cfg.train.global_batch_size, dict(mesh.shape), cfg.train.micro_batch_size,
                      cfg.train.max_micro_batch_size)
    st = abstract_train_state(cfg, mesh)
    b = batch_sharding(mesh)
    n, L = cfg.train.global_batch_size, cfg.data.sequence_length
    batch = {"input_ids": jax.ShapeDtypeStruct((n, L), jnp.int32, sharding=b),
             "label_mask": jax.ShapeDtypeStruct((n, L), jnp.bool_, sharding=b)}
    low = jit_lm_step(cfg, mesh, plan, shardings(st["params"]), shardings(st["opt_state"])).lower(
        st["params"], st["opt_state"], batch)
    return {"mesh": dict(mesh.shape), "devices": [d.id for d in mesh.devices.flat],
            "params": sorted(str(s.spec) for s in jax.tree.leaves(shardings(st["params"]))),
            "hlo": hashlib.sha256(low.as_text().encode()).hexdigest()}

user, launched = json.loads(sys.argv[1]), json.loads(sys.argv[2])
two, one = abstract_devices(parse_topology("v5p:2x2x1", 2)), abstract_devices(parse_topology("v5p:2x4x1", 1))
out = {"compile": build(get_recipe("tiny", user), two),        # `olmax compile --slices 2` with the user's --set
       "launched": build(get_recipe("tiny", launched), two)}   # the run `launch tpu --num-slices 2` starts
try:  # the same launched command on hosts that came up as one slice of 8 chips
    build(get_recipe("tiny", launched), one)
except ConfigError as e:
    out["one_slice_error"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.integration  # a TPU compile: `make test` stays under 8 minutes
def test_a_launched_multislice_run_builds_the_program_its_compile_measured():
    """`olmax launch tpu --num-slices 2` starts a run whose mesh, shardings and lowered train step on
    two abstract v5p slices are those of `olmax compile --slices 2` (the same lowered HLO); on
    hosts that came up as one slice the launched run stops with an error naming both counts."""
    import shlex
    user = ["mesh.tensor=2", "model.compute_dtype=bfloat16"]
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "launch", "tpu", "tiny", "--run-dir", "gs://b/r",
                        "--num-slices", "2", *[a for o in user for a in ("--set", o)]],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    host = next(line for line in r.stdout.splitlines() if line.startswith("OLMAX_DISTRIBUTED="))
    words = shlex.split(host)
    launched = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    assert launched == [*user, "mesh.slice=2"]
    r = subprocess.run([sys.executable, "-c", _SAME_PROGRAM, json.dumps(user), json.dumps(launched)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["compile"]["mesh"] == {"slice": 2, "data": 1, "fsdp": 2, "tensor": 2}
    assert out["launched"] == out["compile"]
    assert "mesh.slice=2 but the 8 devices span 1 slice" in out["one_slice_error"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,topology", [
    ("olmo3_7b_stage1", "v5p-128"), ("olmo3_7b_stage1", "v6e-256"), ("olmo3_7b_stage1", "tpu7x-128"),
    ("olmo3_7b_stage2", "v5p-128"), ("olmo3_7b_stage3", "v5p-512"), ("olmo3_32b", "v5p-512"),
    ("olmo3_7b_think_sft", "v5p-128"), ("olmo3_7b_think_sft", "v6e-256"),
    ("olmo3_7b_think_dpo", "v5p-128"), ("olmo3_7b_think_dpo", "v6e-256"),
    ("olmo3_7b_think_rl", "v5p-128"), ("olmo3_7b_instruct_rl", "v5p-128")])
def test_production_recipes_fit_their_slices(recipe, topology):
    """Full-size AOT compiles (minutes each on 2 cores): every recipe fits with its defaults; the
    7B on v5p-128 is also held to a like-for-like bound (below)."""
    r = _compile(recipe, "--topology", topology, "--no-eval", "--no-cost", "--json")  # memory only
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["fits"] is True and out["flops_per_device"] is None
    if recipe.endswith("_rl"):  # the rollouts' generation is compiled and fits too
        assert out["generate"]["fits"] is True and out["generate"]["batch"] >= 128
    if (recipe, topology) == ("olmo3_7b_stage1", "v5p-128"):
        # The slice's measured choice (save_proj, micro-batches of 2) leaves the headroom it was
        # chosen with; the like-for-like bound holds the recipe as written (full remat, as MaxText's).
        assert out["slice_choice"] is not None and out["remat"] == "save_proj"
        assert out["per_device_gib"] <= 0.9 * out["hbm_gib"], out["per_device_gib"]
        r = _compile(recipe, "--topology", topology, "--no-eval", "--no-cost", "--no-slice-choice", "--json")
        assert r.returncode == 0, r.stderr[-3000:]
        _like_for_like(recipe, topology, json.loads(r.stdout))


def _like_for_like(recipe: str, topology: str, out: dict) -> None:
    """Where MaxText is installed (``.peers/maxtext-venv``), olmax's step needs no more per chip
    than MaxText's own step compiled in the same run at the same micro-batch and accumulation.
    Without it, the recipe's micro-batched plan must need less than olmax's own step with every
    sequence of a chip in one pass (what micro-batching is for)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import compile_targets as ct

    plan = out["plan"]
    assert plan["accum_steps"] > 1  # the recipe micro-batches on this slice
    venv = Path(__file__).resolve().parents[1] / ".peers" / "maxtext-venv"
    if ct.maxtext_available(venv) is None:
        ref = ct.maxtext_compile(venv, ct.MAXTEXT_MODEL[recipe], topology, plan["micro_batch"], plan["accum_steps"],
                                 out["sequence_length"])
        assert out["per_device_gib"] <= ref["per_device_gib"], (out["per_device_gib"], ref)
    else:
        whole = ct.olmax_compile(recipe, topology, *ct.UNBATCHED, "--no-slice-choice", eval_step=False)
        assert whole["plan"]["accum_steps"] == 1 and whole["plan"]["micro_batch"] == plan["per_device"]
        assert out["per_device_gib"] < whole["per_device_gib"], (out["per_device_gib"], whole["per_device_gib"])


_REUSE = """
import resource, sys
import olmax, numpy as np
olmax.keep_freed_memory()  # as `olmax train` and `olmax demo` do
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(64 << 18)  # 128 MiB, freed at once: the shape of a jitted step's buffers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del a
print(min(faults[1:]))
"""



def test_cpu_processes_reuse_freed_memory():
    """On the CPU a training process keeps freed memory (``olmax.keep_freed_memory``): a large buffer
    allocated again after being freed is not faulted in again; with ``OLMAX_MALLOC=system``
    glibc gives it back to the kernel and every allocation faults its pages in anew."""
    import os

    def faults(malloc: str) -> int:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "OLMAX_MALLOC": malloc}
        out = subprocess.run([sys.executable, "-c", _REUSE], env=env, capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    system, kept = faults("system"), faults("")
    assert system > 0 and kept * 10 < system, (kept, system)


@pytest.mark.integration
def test_compile_generate_for_a_tpu_slice():
    """`olmax compile --step generate`: the prefill (splash attention with the prompts' padding as
    a segment) and a decode step with the cache donated and updated in place, on a v5p:2x2x1
    slice with kv heads over tensor. The decode step's output cache aliases its input."""
    r = _compile("tiny", "--topology", "v5p:2x2x1", "--step", "generate", "--batch-size", "4", "--max-length", "256",
                 "--set", "model.compute_dtype=bfloat16", "--set", "mesh.tensor=2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["fits"] is True and out["mesh"] == {"slice": 1, "data": 1, "fsdp": 2, "tensor": 2}
    assert out["prompt_rows"] is None and out["devices"] == 4  # every row prefilled: nothing shared
    # The continuous engine's programs: the chunk and the admission take the slots' state donated,
    # so at least each device's share of the cache comes back in the input's buffers (not a copy).
    assert out["batching"] == "continuous" and out["chunk"] >= 1 and out["prefill_rows"] == 4
    assert out["decode"]["alias"] >= out["cache_gib_total"] / out["devices"]
    assert out["admit"]["alias"] >= out["cache_gib_total"] / out["devices"]
    assert out["resident_gib"]["state"] >= out["cache_gib_total"] / out["devices"]
    assert out["prefill"]["with_resident"] > out["prefill"]["need"]  # the slots' state beside the prefill
    assert out["cache_gib_total"] > 0 and out["prefill"]["need"] < out["hbm_gib"]
    r = _compile("tiny", "--topology", "v5p:2x2x1", "--step", "generate", "--batch-size", "4", "--max-length", "256",
                 "--set", "model.compute_dtype=bfloat16", "--set", "mesh.tensor=2", "--batching", "static", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    static = json.loads(r.stdout)
    assert static["batching"] == "static" and "admit" not in static and static["chunk"] is None
    assert static["decode"]["alias"] >= static["cache_gib_total"] / static["devices"]
    # A bound on the prompt tokens a round trip prefills: one 256-token prompt a shard, not two,
    # so a smaller prefill beside the slots; the static engine has no such bound.
    r = _compile("tiny", "--topology", "v5p:2x2x1", "--step", "generate", "--batch-size", "4", "--max-length", "256",
                 "--set", "model.compute_dtype=bfloat16", "--set", "mesh.tensor=2", "--prefill-tokens", "256",
                 "--no-cost", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    bounded = json.loads(r.stdout)
    assert bounded["prefill_tokens"] == 256 and bounded["prefill_rows"] == 2 and out["prefill_tokens"] is None
    assert bounded["prefill"]["need"] < out["prefill"]["need"] and bounded["admit"]["need"] > 0
    r = _compile("tiny", "--topology", "v5p:2x2x1", "--step", "generate", "--batching", "static",
                 "--prefill-tokens", "256", "--json")
    assert r.returncode == 2 and "--prefill-tokens bounds the continuous engine" in r.stderr


@pytest.mark.integration
def test_compile_an_rl_recipe_counts_generation_beside_the_optimizer_state():
    """`olmax compile` of a grpo recipe compiles the GRPO update for one mini-batch and the
    rollouts' prefill + decode at rl.generation_batch in the shapes the run's generator uses,
    with Adam's moments resident during sampling (the slow test below: a generation batch too
    large for the chip is named)."""
    args = ("tiny_rl", "--topology", "v5p:2x2x1", "--no-eval", "--set", "model.compute_dtype=bfloat16",
            "--set", "rl.num_mini_batches=2", "--json")
    r = _compile(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["plan"]["global_batch"] == 8          # 16 completions in 2 mini-batches
    g = out["generate"]
    # what the run's generator decodes with: prompts of up to 48 tokens padded to splash's 128,
    # a cache of 128 + 16 new tokens rounded up to 64, the 4 prompts of the 16 rows prefilled once
    assert g["batch"] == 16 and g["prompt_len"] == 128 and g["max_length"] == 192 and g["prompt_rows"] == 4
    assert g["batching"] == "continuous" and g["rows"] == 16 and g["prefill_rows"] == 4
    assert all(g[f"{w}_gib"] > 0 for w in ("prefill", "admit", "decode")) and g["decode"]["flops_per_device"] > 0
    assert g["fits"] is True
    assert g["resident_gib"] > 0 and g["per_device_gib"] > g["resident_gib"]


@pytest.mark.slow
def test_compile_an_rl_recipe_names_a_generation_batch_that_does_not_fit():
    args = ("tiny_rl", "--topology", "v5p:2x2x1", "--no-eval", "--set", "model.compute_dtype=bfloat16",
            "--set", "rl.num_mini_batches=2", "--json")
    big = _compile(*args, "--set", "rl.prompts_per_step=256", "--set", "rl.group_size=16", "--set",
                   "train.global_batch_size=4096", "--set", "train.max_micro_batch_size=1", "--set",
                   "model.sliding_window=null", "--set", "rl.max_response_length=65000", "--set",
                   "data.sequence_length=65536")   # a 512 GiB cache over 4 chips
    assert big.returncode == 1, big.stderr[-2000:]
    out = json.loads(big.stdout)
    assert out["generate"]["fits"] is False and "lower rl.generation_batch" in out["verdict"]


@pytest.mark.slow
def test_7b_generates_at_batch_32_and_32k_tokens_on_v5p_8():
    """The 7B (stage-3 model, bf16) at 32 slots x 32,768 tokens on a v5p-8: the static engine's
    prefill + decode fit, and so do the continuous engine's programs with a bound on the prompt
    tokens a round trip prefills (unbounded, 32 prompts as long as the cache are a second cache
    beside the slots': docs/generation.md)."""
    args = ("olmo3_7b_stage3", "--topology", "v5p-8", "--step", "generate", "--batch-size", "32",
            "--max-length", "32768", "--no-cost", "--json")
    r = _compile(*args, "--batching", "static")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["fits"] is True and out["decode"]["need"] < out["hbm_gib"] and out["prefill"]["need"] < out["hbm_gib"]
    r = _compile(*args, "--prefill-tokens", "262144")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["fits"] is True and out["prefill_rows"] == 8
    assert out["admit"]["temp"] < 1.0   # prompts written into their slots in place: no copy of cache rows


def test_compile_generate_reports_a_prefill_that_does_not_fit():
    r = _compile("tiny", "--topology", "v5e:2x2", "--step", "generate", "--batch-size", "4096", "--max-length", "4096",
                 "--set", "model.d_model=1024", "--json")
    assert r.returncode == 1, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["fits"] is False and "oom" in out["prefill"] and "decode" not in out
    assert out["verdict"].startswith("does not fit by")
