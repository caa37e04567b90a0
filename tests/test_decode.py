"""The KV cache itself: its size against the formula, bucketed shapes (no recompiles), the
compute dtype, a sharded run equal to an unsharded one, and bad input. Decoding against
transformers is tests/test_generate.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import ModelConfig
from olmax.engine import Generator, Sampling, generate
from olmax.engine.sampling import knobs
from olmax.model.decode import cache_bytes, prefill, prepare
from olmax.model.params import init_params
from olmax.recipes.olmo3 import olmo3_7b_model
from trainlib import normal

TINY = ModelConfig(vocab_size=100, padded_vocab_size=128, d_model=64, n_layers=5, n_heads=4, n_kv_heads=2,
                   head_dim=16, mlp_hidden=96, norm_eps=1e-6, rope_theta=10000.0, sliding_window=8,
                   max_position_embeddings=256, compute_dtype="float32", attention_impl="reference")


def _cache(cfg: ModelConfig, batch: int, prompt: int, max_length: int):
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    prepared = jax.eval_shape(partial(prepare, cfg=cfg), params)
    return jax.eval_shape(partial(prefill, cfg=cfg, max_length=max_length), prepared,
                          jax.ShapeDtypeStruct((batch, prompt), jnp.int32),
                          jax.ShapeDtypeStruct((batch,), jnp.int32))[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_bytes_equal_the_formula(dtype: str) -> None:
    """Five layers with a full layer every fourth: a scanned group of four plus one unrolled
    layer. Full layers hold max_length slots, sliding ones a ring of `window`."""
    cfg = replace(TINY, compute_dtype=dtype)
    cache = _cache(cfg, batch=3, prompt=16, max_length=64)
    kv = [a for a in jax.tree.leaves(cache["kv"])]
    assert {a.dtype for a in kv} == {jnp.dtype(dtype)}
    item = jnp.dtype(dtype).itemsize
    full = [i for i in range(cfg.n_layers) if cfg.layer_window(i) is None]
    slots = len(full) * 64 + (cfg.n_layers - len(full)) * cfg.sliding_window
    want = 2 * 3 * slots * cfg.n_kv_heads * cfg.head_dim * item + 4 * 3 * (64 + cfg.sliding_window + 1)
    assert sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache)) == want == cache_bytes(cfg, 3, 64)


def test_7b_cache_is_a_third_of_a_dense_one() -> None:
    """OLMo 3 7B at 32K tokens: 8 full layers keep 32,768 slots, 24 sliding ones 4,096 (a dense
    cache keeps 32,768 in all 32): 2.9x less, computed from the config alone."""
    m = olmo3_7b_model()
    dense = 2 * 32 * m.n_layers * 32768 * m.n_kv_heads * m.head_dim * 2
    ours = cache_bytes(m, 32, 32768)
    assert 2.9 < dense / ours < 2.92


def test_bucketed_shapes_compile_once() -> None:
    """Prompts of 3 to 16 tokens share one prompt bucket, and at batch size 2 a short last batch
    is padded to 2 rows: one prefill and one decode program for all the calls."""
    params = init_params(TINY, jax.random.key(0))
    gen = Generator(params, TINY, Sampling())
    for prompts in ([[5, 6, 7], [4] * 5], [[1] * 16, [2] * 9, [3] * 11]):
        out = generate(params, TINY, prompts, max_new_tokens=4, batch_size=2, generator=gen)
        assert [len(c.token_ids) for c in out] == [4] * len(prompts)
    assert gen._prefill._cache_size() == 1
    assert gen._decode._cache_size() == 1


@pytest.mark.integration
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_repeated_prompts_are_prefilled_once(monkeypatch, batching: str) -> None:
    """Rows that repeat a prompt (GRPO's group of completions of one prompt) share one prefill:
    8 rows of 2 distinct prompts prefill 2 rows, and every row draws the tokens it draws run
    alone (same key, same cache contents), sampled and greedy; in either engine."""
    import importlib
    g = importlib.import_module(f"olmax.engine.{batching}")
    traced = []
    real = g.prefill

    def spy(prepared, tokens, *args, **kwargs):
        traced.append(tokens.shape[0])
        return real(prepared, tokens, *args, **kwargs)

    monkeypatch.setattr(g, "prefill", spy)
    params = init_params(TINY, jax.random.key(0))
    prompts = [[5, 6, 7, 8]] * 4 + [list(range(2, 21))] * 4
    for sampling in (Sampling(temperature=1.0, seed=3), Sampling()):
        traced.clear()
        together = generate(params, TINY, prompts, max_new_tokens=10, batch_size=8, sampling=sampling,
                            batching=batching)
        assert traced == [2]
        alone = generate(params, TINY, prompts, max_new_tokens=10, batch_size=1, sampling=sampling,
                         batching=batching)
        # one slot: the static engine prefills one prompt a batch; the continuous engine's first
        # prefill also takes the other prompt, which waits (``prefill_ahead``): each once either way
        assert traced == [2, 1 if batching == "static" else 2]
        assert [c.token_ids for c in together] == [c.token_ids for c in alone]
        assert max(abs(p - q) for a, b in zip(together, alone) for p, q in zip(a.logprobs, b.logprobs)) <= 1e-5
    sampled = generate(params, TINY, prompts, max_new_tokens=10, batch_size=8, sampling=Sampling(temperature=1.0))
    assert len({tuple(c.token_ids) for c in sampled[:4]}) > 1  # a group's rows draw their own tokens


def test_the_rl_compile_prefills_what_the_run_prefills(monkeypatch) -> None:
    """``olmax compile`` of an RL recipe predicts the generator's shapes from the generator's own
    rules: on one step's rows (4 groups of 3, generation batches of 8 that cut a group in two)
    the rows each batch prefills, the prompt bucket and the cache length are what the rollouts'
    ``generate`` call traces."""
    import olmax.engine.static as g
    from olmax.compile import rl_generation_shapes
    from olmax.recipes import get_recipe
    from olmax.sharding import make_mesh
    traced = []
    real = g.prefill

    def spy(prepared, tokens, lengths, cfg, max_length):
        traced.append((*tokens.shape, max_length))
        return real(prepared, tokens, lengths, cfg, max_length)

    monkeypatch.setattr(g, "prefill", spy)
    cfg = get_recipe("tiny_rl", ["rl.prompts_per_step=4", "rl.group_size=3", "rl.generation_batch=8",
                                 "train.global_batch_size=12", "rl.num_mini_batches=1"])
    cfg = replace(cfg, model=TINY)
    r = cfg.rl
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    shapes = rl_generation_shapes(cfg, mesh)
    assert shapes["batch"] == 8 and shapes["prompt_rows"] == 4    # the first batch: 3 groups in a block of 4
    prompts = [[(p * 7 + i) % 90 + 1 for i in range(r.max_prompt_length)] for p in range(r.prompts_per_step)]
    rows = [p for p in prompts for _ in range(r.group_size)]       # as the rollouts lay them out
    gen = Generator(init_params(TINY, jax.random.key(0)), TINY, Sampling(temperature=1.0), mesh)
    generate(None, TINY, rows, max_new_tokens=r.max_response_length, batch_size=r.generation_batch,
             sampling=Sampling(temperature=1.0), generator=gen)
    assert traced == [(4, shapes["prompt_len"], shapes["max_length"]), (2, shapes["prompt_len"], shapes["max_length"])]
    assert max(t[0] for t in traced) == shapes["prompt_rows"]


def test_bad_requests_name_the_problem() -> None:
    params = init_params(TINY, jax.random.key(0))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(params, TINY, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside the vocabulary \[0, 100\): \[100\]"):
        generate(params, TINY, [[1, 100]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(params, TINY, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        generate(params, TINY, [[1]], max_new_tokens=1, sampling=Sampling(temperature=1.0, top_p=0.0))


@pytest.mark.integration
def test_sharded_decoding_equals_one_device() -> None:
    """On 4 CPU devices (fsdp 2 x tensor 2: rows over fsdp, kv heads over tensor) greedy tokens
    equal the one-device run and log-probs agree, with distinct prompts and with repeated ones
    (prefilled once each and copied to their rows across the devices): to the bit where olmax's
    CPU kernels decode (each device runs them on its rows), else to fp32 rounding."""
    code = textwrap.dedent("""
        import json, jax
        from olmax.config import MeshConfig
        from olmax.engine import generate
        from olmax.model.params import init_params
        from olmax.sharding import make_mesh
        from test_decode import TINY
        params = init_params(TINY, jax.random.key(0))
        prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(2, 30))]
        one = generate(params, TINY, prompts, max_new_tokens=12)
        mesh = make_mesh(MeshConfig(fsdp=2, tensor=2))
        sharded = generate(params, TINY, prompts, max_new_tokens=12, mesh=mesh)
        # repeated prompts: each fsdp shard prefills its 2 distinct prompts once and copies them to its rows
        groups = [prompts[0]] * 3 + [prompts[2]] * 3
        alone = generate(params, TINY, groups, max_new_tokens=12, batch_size=1)
        shared = generate(params, TINY, groups, max_new_tokens=12, mesh=mesh)
        one, sharded = one + alone, sharded + shared
        from olmax.kernels import cpu as cpu_kernels
        print(json.dumps({"same": [a.token_ids == b.token_ids for a, b in zip(one, sharded)],
                          "lp": max(abs(p - q) for a, b in zip(one, sharded) for p, q in zip(a.logprobs, b.logprobs)),
                          "kernel": cpu_kernels.available()}))
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.path.dirname(__file__)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["same"] == [True] * 9
    assert out["lp"] == 0.0 if out["kernel"] else out["lp"] <= 1e-5


def test_shared_prefill_copies_rows_within_each_shard() -> None:
    """``expand_rows`` on a 4-device mesh (rows over fsdp): every row gets its block's prefilled
    row, and the compiled copy has no collective: each device copies from its own shard (a
    gather from the whole batch would first bring every prompt's cache to every device)."""
    code = textwrap.dedent("""
        import json, jax, jax.numpy as jnp, numpy as np
        from olmax.config import MeshConfig
        from olmax.model.decode import expand_rows
        from olmax.sharding import activation_mesh, batch_sharding, make_mesh
        mesh = make_mesh(MeshConfig(fsdp=4))
        rng = np.random.default_rng(0)
        fill, per = 8, 4                                    # 2 prefilled rows per shard, 4 rows each
        logits = rng.standard_normal((fill, 128)).astype(np.float32)
        k = rng.standard_normal((1, fill, 2, 32, 16)).astype(np.float32)   # [layers, b, kv, S, e]
        pos = rng.integers(0, 99, (fill, 32)).astype(np.int32)
        length = np.arange(fill, dtype=np.int32)
        source = rng.integers(0, 2, (4, per)).astype(np.int32)
        put = lambda a, axis=0: jax.device_put(a, batch_sharding(mesh, a.ndim) if axis == 0 else
                                               jax.sharding.NamedSharding(
                                                   mesh, jax.sharding.PartitionSpec(None, ("slice", "data", "fsdp"))))
        cache = {"kv": {"groups": [], "rest": [{"k": put(k, 1), "v": put(-k, 1)}]}, "pos": {"full": put(pos)},
                 "length": put(length)}
        def fn(logits, cache, source):
            with activation_mesh(mesh):
                return expand_rows(logits, cache, source)
        compiled = jax.jit(fn).lower(put(logits), cache, put(source)).compile()
        text = compiled.as_text()
        out_logits, out = compiled(put(logits), cache, put(source))
        want = (np.arange(4)[:, None] * 2 + source).reshape(-1)   # the prefilled row of each row
        print(json.dumps({
            "collectives": [c for c in ("all-gather", "all-reduce", "all-to-all", "collective-permute") if c in text],
            "logits": bool(np.array_equal(np.asarray(out_logits), logits[want])),
            "k": bool(np.array_equal(np.asarray(out["kv"]["rest"][0]["k"]), k[:, want])),
            "v": bool(np.array_equal(np.asarray(out["kv"]["rest"][0]["v"]), -k[:, want])),
            "pos": bool(np.array_equal(np.asarray(out["pos"]["full"]), pos[want])),
            "length": bool(np.array_equal(np.asarray(out["length"]), length[want]))}))
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"collectives": [], "logits": True, "k": True, "v": True, "pos": True, "length": True}


def test_admission_writes_rows_in_place_within_each_shard() -> None:
    """``write_rows`` (the continuous engine's admission) on a 4-device mesh (slots over fsdp), in
    the CPU's head-major cache and the accelerators' slot-major one: each written slot takes its
    shard's prefilled row in its first T slots, positions past T become -1 (the previous
    occupant's keys stay behind, never seen), padding writes nothing, the other slots keep
    everything; and the compiled write has no collective, works in place and copies one row at a
    time."""
    code = textwrap.dedent("""
        import json, jax, jax.numpy as jnp, numpy as np
        import olmax.model.dispatch as dispatch
        from olmax.config import MeshConfig
        from olmax.model.decode import write_rows
        from olmax.sharding import activation_mesh, batch_sharding, make_mesh
        mesh = make_mesh(MeshConfig(fsdp=4))
        put = lambda a, axis=0: jax.device_put(a, batch_sharding(mesh, a.ndim) if axis == 0 else
                                               jax.sharding.NamedSharding(
                                                   mesh, jax.sharding.PartitionSpec(None, ("slice", "data", "fsdp"))))
        slots, S, fill, T = 8, 64, 8, 12                    # 2 slots and 2 prefilled rows per shard
        source = np.array([[1, 0], [0, 0], [1, 1], [0, 1]], np.int32)
        dest = np.array([[0, 1], [1, 2], [2, 0], [1, 1]], np.int32)         # 2: past the shard's slots
        out = {}
        for layout, platform in (("head-major", "cpu"), ("slot-major", "gpu")):
            dispatch.target_platform = lambda platform=platform: platform
            rng = np.random.default_rng(0)
            shape = lambda b, n: (1, b, 2, n, 16) if layout == "head-major" else (1, b, n, 2, 16)
            k = rng.standard_normal(shape(slots, S)).astype(np.float32)
            pos = rng.integers(0, 99, (slots, S)).astype(np.int32)
            rk = rng.standard_normal(shape(fill, T)).astype(np.float32)
            rpos = rng.integers(0, 99, (fill, T)).astype(np.int32)
            rlen = np.arange(fill, dtype=np.int32) + 3
            cache = lambda: {"kv": {"groups": [], "rest": [{"k": put(k, 1), "v": put(-k, 1)}]},
                             "pos": {"full": put(pos)}, "length": put(np.zeros(slots, np.int32))}
            rows = {"kv": {"groups": [], "rest": [{"k": put(rk, 1), "v": put(-rk, 1)}]},
                    "pos": {"full": put(rpos)}, "length": put(rlen)}
            def fn(cache, rows, source, dest):
                with activation_mesh(mesh):
                    return write_rows(cache, rows, source, dest)
            compiled = jax.jit(fn, donate_argnums=0).lower(cache(), rows, put(source), put(dest)).compile()
            text = compiled.as_text()
            got = compiled(cache(), rows, put(source), put(dest))
            wk, wpos, wlen = k.copy(), pos.copy(), np.zeros(slots, np.int32)
            for d in range(4):
                for s, r in zip(dest[d], source[d]):
                    if s < 2:
                        if layout == "head-major":
                            wk[:, 2 * d + s, :, :T] = rk[:, 2 * d + r]
                        else:
                            wk[:, 2 * d + s, :T] = rk[:, 2 * d + r]
                        wpos[2 * d + s] = np.r_[rpos[2 * d + r], np.full(S - T, -1)]
                        wlen[2 * d + s] = rlen[2 * d + r]
            out[layout] = {
                "collectives": [c for c in ("all-gather", "all-reduce", "all-to-all", "collective-permute")
                                if c in text],
                "k": bool(np.array_equal(np.asarray(got["kv"]["rest"][0]["k"]), wk)),
                "v": bool(np.array_equal(np.asarray(got["kv"]["rest"][0]["v"]), -wk)),
                "pos": bool(np.array_equal(np.asarray(got["pos"]["full"]), wpos)),
                "length": bool(np.array_equal(np.asarray(got["length"]), wlen)),
                # per device: the keys and values aliased to the output, and less temporary memory
                # than the shard's written rows at once (they go one at a time)
                "in place": (compiled.memory_analysis().alias_size_in_bytes >= 2 * k.nbytes // 4
                             and compiled.memory_analysis().temp_size_in_bytes < 2 * rk.nbytes // 4)}
        print(json.dumps(out))
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    want = {"collectives": [], "k": True, "v": True, "pos": True, "length": True, "in place": True}
    assert out == {"head-major": want, "slot-major": want}


@pytest.mark.cpu_only
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_streamed_weights_equal_the_plain_matmul(rows: int) -> None:
    """``OutIn`` (a weight stored [out, in] for the CPU's decode steps) gives x @ w for one row
    (the plain matrix-vector layout is not used here: this checks the [out, in] contraction), a
    few rows (multiply-and-reduce) and many (contraction of the last axes), to fp32 rounding."""
    from olmax.model.olmo3 import OutIn
    kx, kw = jax.random.split(jax.random.key(rows))
    x = normal(kx, (rows, 1, 96))
    w = normal(kw, (96, 40))
    got = jax.jit(lambda x, t: OutIn(t).apply(x))(x, w.T)
    assert got.shape == (rows, 1, 40) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), rtol=1e-5, atol=1e-5)


@pytest.mark.cpu_only
def test_streamed_decode_compiles_to_ynnpack_and_switches_layout(monkeypatch) -> None:
    """Where olmax's CPU kernel is not used (``cpu_kernels``: no compiler, no AVX2, turned off)
    the streamed form is the fast one for a few rows, and only because XLA CPU hands its
    multiply-and-reduce to YNNPACK (its own reduction loop ran 13x to 72x slower): if a jax
    upgrade stops doing so, this fails. The generator keeps one copy of the weights, in the
    layout of the batch it runs, and the tokens do not depend on it; XLA_FLAGS that set
    YNNPACK's fusion types keep the plain one."""
    from olmax.kernels import cpu as cpu_kernels
    from olmax.model.decode import layout_of
    from olmax.model.dispatch import decode_layout
    from olmax.model.olmo3 import OutIn
    monkeypatch.setattr(cpu_kernels, "_STATE", {"why": "off for this test"})
    hlo = jax.jit(lambda x, t: OutIn(t).apply(x)).lower(jnp.zeros((8, 1, 512)),
                                                         jnp.zeros((1024, 512))).compile().as_text()
    assert "__ynn_fusion" in hlo and "reduce(" in hlo
    params = init_params(TINY, jax.random.key(0))
    gen = Generator(params, TINY, Sampling())
    assert layout_of(gen.weights.prepared) == "plain"
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    alone = [generate(params, TINY, [p], max_new_tokens=6, generator=gen)[0].token_ids for p in prompts]
    assert layout_of(gen.weights.prepared) == "plain"
    together = [c.token_ids for c in generate(params, TINY, prompts, max_new_tokens=6, generator=gen)]
    assert layout_of(gen.weights.prepared) == "streamed" and together == alone
    gen.load(params)  # RL after an update: the new weights come in the layout in use
    assert layout_of(gen.weights.prepared) == "streamed"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")
    assert decode_layout(8, TINY) == "plain"
    monkeypatch.delenv("XLA_FLAGS")
    assert decode_layout(8, TINY) == "streamed" and decode_layout(1, TINY) == "plain"
    # Inside the whole decode step too (a neighbour fused into the reduction would take it off
    # YNNPACK): every layer's four projections and the LM head.
    rows, length = 4, 64
    prepared = gen.weights(rows)
    _, cache = jax.eval_shape(partial(prefill, cfg=TINY, max_length=length), prepared,
                              jax.ShapeDtypeStruct((rows, 8), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32))
    step = gen._decode.lower(prepared, jnp.zeros((rows,), jnp.int32), cache, jax.random.split(jax.random.key(0), rows),
                             np.int32(1), {k: jnp.asarray(v) for k, v in knobs([Sampling()] * rows).items()},
                             max_length=length, greedy=True).compile().as_text()
    entry = step[step.index("ENTRY"):]
    called = re.findall(r"calls=(%[\w.\-]+), [^\n]*__ynn_fusion", entry)
    bodies = {m.group(1): m.group(2) for m in re.finditer(r"^(%[\w.\-]+) \([^\n]*\{\n(.*?)\n\}", step, re.M | re.S)}
    assert sum(" reduce(" in bodies.get(name, "") for name in called) == 4 * TINY.n_layers + 1


@pytest.mark.cpu_only
def test_one_row_decode_step_copies_no_cache() -> None:
    """At batch 1 XLA CPU used to copy every layer's key cache four times per token (a fused
    second write of the new key into the attention's read; ``decode_step``): no instruction of
    the compiled step may copy a whole cache array. (That the tokens stay transformers' is
    ``tests/test_generate.py``'s.)"""
    length = 64
    params = init_params(TINY, jax.random.key(0))
    gen = Generator(params, TINY, Sampling())
    prepared = gen.weights(1)
    _, cache = jax.eval_shape(partial(prefill, cfg=TINY, max_length=length), prepared,
                              jax.ShapeDtypeStruct((1, 8), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32))
    step = gen._decode.lower(prepared, jnp.zeros((1,), jnp.int32), cache, jax.random.split(jax.random.key(0), 1),
                             np.int32(1), {k: jnp.asarray(v) for k, v in knobs([Sampling()]).items()},
                             max_length=length, greedy=True).compile().as_text()
    entry = step[step.index("ENTRY"):]
    shapes = {"f32[" + ",".join(map(str, x.shape)) + "]" for x in jax.tree.leaves(cache["kv"])}
    copies = [line for line in entry.splitlines() if " copy(" in line and any(s in line.split("=")[1] for s in shapes)]
    assert not copies, copies


@pytest.mark.cpu_only
@pytest.mark.parametrize("kernel", [True, False])
def test_a_generator_told_its_rows_compiles_one_prepare(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """RL reloads the weights after every update. A generator told the batch rows it will run
    prepares them in that batch's layout from the start (the packed one where the kernel is
    built, else the streamed one): the batches relayout nothing, and a reload runs the prepare
    program compiled at the start (one that only the second RL step compiled used to cost
    0.5 s of that step's generation time). The tokens are those of a generator not told."""
    from olmax.kernels import cpu as cpu_kernels
    from olmax.model.decode import layout_of
    from olmax.model.dispatch import decode_layout
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "_STATE", {"why": "off for this test"})
    params = init_params(TINY, jax.random.key(0))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14]]
    gen = Generator(params, TINY, Sampling(), rows=4)
    want = "packed" if cpu_kernels.available() else "streamed"
    assert layout_of(gen.weights.prepared) == decode_layout(4, TINY) == want
    got = [c.token_ids for c in generate(params, TINY, prompts, max_new_tokens=5, batch_size=4, generator=gen)]
    for _ in range(2):
        gen.load(params)
        again = [c.token_ids for c in generate(params, TINY, prompts, max_new_tokens=5, batch_size=4, generator=gen)]
        assert again == got
    assert gen.weights._prepare._cache_size() == 1 and gen.weights._relayout._cache_size() == 0
    untold = Generator(params, TINY, Sampling())
    assert [c.token_ids
            for c in generate(params, TINY, prompts, max_new_tokens=5, batch_size=4, generator=untold)] == got
    assert untold.weights._relayout._cache_size() == 1   # the untold one turned its plain weights over


def test_prepare_casts_the_lm_head_once() -> None:
    """``prepare`` leaves the LM head in the compute dtype, as every step casts it: a bf16 step
    reads half its bytes (on an H200 a step of the 7B-width slice read 4.06 GB instead of 4.88),
    and the logits are the ones a step casting the fp32 head itself gives."""
    m = replace(TINY, compute_dtype="bfloat16")
    params = init_params(m, jax.random.key(3))
    new = prepare(params, m)
    old = {**new, "lm_head": params["lm_head"]}  # fp32, cast by each step (before)
    assert params["lm_head"].dtype == jnp.float32 and new["lm_head"].dtype == jnp.bfloat16
    from olmax.model.decode import step_weight_bytes
    assert step_weight_bytes(old) - step_weight_bytes(new) == params["lm_head"].nbytes // 2
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, m.vocab_size, (2, 12)), jnp.int32)
    lengths = jnp.asarray([12, 7], jnp.int32)
    run = jax.jit(partial(prefill, cfg=m, max_length=64))
    (a, _), (b, _) = run(new, tokens, lengths), run(old, tokens, lengths)
    assert a.dtype == jnp.float32 and np.array_equal(np.asarray(a), np.asarray(b))
    assert prepare(params, TINY)["lm_head"].dtype == jnp.float32  # fp32 compute: as it was
