"""Checkpointer: bitwise roundtrip, async, retention, atomicity, compatibility, elastic restore."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from olmax.checkpoint.store import Checkpointer, CheckpointError, StopSignal
from olmax.config import CheckpointConfig, Config, ModelConfig


class AdamLike(NamedTuple):
    count: jax.Array
    mu: dict
    nu: dict


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class History:
    losses: jax.Array
    n: jax.Array


def make_state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    w[0, :3] = [np.nan, -0.0, np.inf]  # bitwise means NaN payloads and signed zeros too
    params = {"w": jnp.asarray(w), "emb": jnp.asarray(rng.standard_normal((16, 4)), jnp.bfloat16),
              "norm": jnp.ones((4,), jnp.float32)}
    mu = jax.tree.map(lambda p: (p * 0.5).astype(jnp.float32), params)
    nu = jax.tree.map(lambda p: (p * p).astype(jnp.float32), params)
    return {"params": params,
            "opt_state": AdamLike(jnp.int32(seed + 7), mu, nu),
            "skip": History(jnp.asarray(rng.standard_normal(129), jnp.float32), jnp.int32(64))}


def abstract_of(state: dict, sharding=None) -> dict:
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def assert_bitwise_equal(a, b) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def cfg_ckpt(**kw) -> CheckpointConfig:
    return CheckpointConfig(**{"interval": 1, "keep_last": 100, "async_save": False, **kw})


def small_config(**model) -> Config:
    m = ModelConfig(vocab_size=256, padded_vocab_size=256, d_model=128, n_layers=2, n_heads=2,
                    n_kv_heads=2, head_dim=64, mlp_hidden=256)
    return Config(model=dataclasses.replace(m, **model))


def test_roundtrip_bitwise_and_meta(tmp_path):
    state = make_state()
    meta = {"data_state": {"batches_processed": 3}, "rng": [1, 2, 3], "config_yaml": small_config().to_yaml()}
    with Checkpointer(tmp_path, cfg_ckpt()) as ck:
        assert ck.save(3, state, meta)
        assert ck.latest_step() == 3 and ck.all_steps() == [3]
    # A new process: nothing cached.
    with Checkpointer(tmp_path, cfg_ckpt()) as ck:
        restored, rmeta = ck.restore(3, abstract_of(state))
    assert_bitwise_equal(restored, state)
    assert isinstance(restored["opt_state"], AdamLike) and isinstance(restored["skip"], History)
    assert restored["opt_state"].count.dtype == jnp.int32
    # Numbering contract: checkpoint N says N updates are done; the loop trains batch N next.
    assert rmeta["step"] == 3 and rmeta["rng"] == [1, 2, 3] and rmeta["data_state"] == {"batches_processed": 3}
    assert Checkpointer.read_meta(tmp_path, 3) == rmeta == Checkpointer.read_meta(tmp_path)


def test_async_save_then_wait(tmp_path):
    state = make_state(1)
    expected = jax.tree.map(np.asarray, state)
    ck = Checkpointer(tmp_path, cfg_ckpt(async_save=True))
    assert ck.save(5, state, {"x": 1})
    # save() returns once the arrays are on the host: the loop may donate them to the next step.
    jax.tree.map(lambda x: x.delete(), state)
    ck.wait()
    names = os.listdir(tmp_path / "checkpoints")
    assert "5" in names and not [n for n in names if "tmp" in n]
    # No sharding given: restored replicated on all devices.
    restored, meta = ck.restore(5, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), expected))
    ck.close()
    assert_bitwise_equal(restored, expected)
    assert isinstance(restored["params"]["w"], jax.Array)
    assert meta == {"step": 5, "x": 1}


@pytest.mark.parametrize("async_save", [False, True])
def test_retention_keep_last_and_every(tmp_path, async_save):
    state = {"params": {"w": jnp.zeros((2,))}}
    with Checkpointer(tmp_path, cfg_ckpt(keep_last=2, keep_every=4, async_save=async_save)) as ck:
        for step in range(1, 11):
            ck.save(step, state, {})
        ck.wait()
        assert ck.all_steps() == [4, 8, 9, 10]
    assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints")) == [4, 8, 9, 10]


def test_interval_and_force(tmp_path):
    with Checkpointer(tmp_path, cfg_ckpt(interval=5)) as ck:
        assert [s for s in range(12) if ck.should_save(s)] == [0, 5, 10]
        assert not ck.save(3, {"a": jnp.zeros(1)}, {})
        assert ck.save(3, {"a": jnp.zeros(1)}, {}, force=True)  # e.g. on SIGTERM or at the end
        assert ck.all_steps() == [3]


def test_incomplete_checkpoint_is_invisible(tmp_path):
    state = make_state()
    with Checkpointer(tmp_path, cfg_ckpt()) as ck:
        ck.save(1, state, {"ok": True})
    # What a save killed half-way leaves behind: Orbax's temporary directories.
    root = tmp_path / "checkpoints"
    for name in ("2.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1712345678"):
        (root / name / "state").mkdir(parents=True)
        (root / name / "state" / "_METADATA").write_text("{truncated")
    reader = Checkpointer(tmp_path, cfg_ckpt(), read_only=True)
    assert reader.latest_step() == 1 and reader.all_steps() == [1]
    reader.close()
    assert (root / "2.orbax-checkpoint-tmp").exists()  # a reader never deletes (could be a live save)
    assert Checkpointer.read_meta(tmp_path)["ok"] is True
    with Checkpointer(tmp_path, cfg_ckpt()) as ck:
        assert ck.latest_step() == 1
        assert ck.save(2, make_state(2), {})  # the leftover does not block a real save of step 2
        restored, _ = ck.restore(2, abstract_of(state))
    assert_bitwise_equal(restored, make_state(2))


def test_existing_step_is_never_overwritten(tmp_path):
    first, second = make_state(0), make_state(1)
    with Checkpointer(tmp_path, cfg_ckpt()) as ck:
        assert ck.save(4, first, {"run": "first"})
        assert ck.save(4, second, {"run": "second"}, force=True) is False
    with Checkpointer(tmp_path, cfg_ckpt()) as ck:  # a second run in the same directory
        assert ck.save(4, second, {"run": "second"}, force=True) is False
        restored, meta = ck.restore(4, abstract_of(first))
    assert_bitwise_equal(restored, first)
    assert meta["run"] == "first"


def test_different_model_is_a_clear_error(tmp_path):
    meta = {"step": 10, "config_yaml": small_config().to_yaml(), "fingerprint": "abc"}
    Checkpointer.check_compatible(meta, small_config(), fingerprint="abc")
    # How the model is computed may change on resume; what it is may not.
    Checkpointer.check_compatible(meta, small_config(remat="full", attention_impl="reference"))
    with pytest.raises(CheckpointError) as e:
        Checkpointer.check_compatible(meta, small_config(d_model=256, n_layers=4))
    msg = str(e.value)
    assert "model.d_model: checkpoint 128, config 256" in msg and "model.n_layers: checkpoint 2, config 4" in msg
    assert "model.vocab_size" not in msg
    with pytest.raises(CheckpointError, match="fingerprint checkpoint 'abc', current data 'xyz'"):
        Checkpointer.check_compatible(meta, small_config(), fingerprint="xyz")
    with pytest.raises(CheckpointError, match="no resolved config"):
        Checkpointer.check_compatible({"step": 1}, small_config())


def test_shape_or_structure_mismatch_names_the_parameter(tmp_path):
    state = make_state()
    with Checkpointer(tmp_path, cfg_ckpt()) as ck:
        ck.save(1, state, {})
        bad = abstract_of(state)
        bad["params"]["w"] = jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=bad["params"]["w"].sharding)
        with pytest.raises(CheckpointError, match=r"params\.w shape: checkpoint \(8, 16\), requested \(8, 32\)"):
            ck.restore(1, bad)
        bad = abstract_of(state)
        bad["params"]["emb"] = jax.ShapeDtypeStruct((16, 4), jnp.float32)
        with pytest.raises(CheckpointError, match=r"params\.emb dtype: checkpoint bfloat16, requested float32"):
            ck.restore(1, bad)
        bad = abstract_of(state)
        bad["params"]["extra"] = jax.ShapeDtypeStruct((2,), jnp.float32)
        del bad["skip"]
        with pytest.raises(CheckpointError, match=r"not in the checkpoint: params\.extra.*not in this run's state: "
                                                  r"skip\.losses, skip\.n"):
            ck.restore(1, bad)
        with pytest.raises(CheckpointError, match="no complete checkpoint 2"):
            ck.restore(2, abstract_of(state))


def test_meta_must_be_json(tmp_path):
    with Checkpointer(tmp_path, cfg_ckpt()) as ck:
        with pytest.raises(TypeError, match=r"meta\['data'\]\['pos'\] is a int64"):
            ck.save(1, {"a": jnp.zeros(1)}, {"data": {"pos": np.int64(3)}})
        assert ck.all_steps() == []


_SAVE_ON_4_DEVICES = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from olmax.config import CheckpointConfig
    from olmax.checkpoint.store import Checkpointer
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 2), ("data", "fsdp"))
    w = jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8), NamedSharding(mesh, P("fsdp", "data")))
    b = jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, P("data")))
    state = {"params": {"w": w, "b": b}, "opt_state": {"count": jnp.int32(12), "mu": {"w": w * 2}}}
    assert len(w.sharding.device_set) == 4
    with Checkpointer(sys.argv[1], CheckpointConfig(interval=12, keep_last=1, async_save=True)) as ck:
        assert ck.save(12, state, {"devices": jax.device_count()})
""")


def test_elastic_restore_4_devices_to_1(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _SAVE_ON_4_DEVICES, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]

    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    expected = {"params": {"w": w, "b": np.arange(8).astype(jnp.bfloat16)},
                "opt_state": {"count": np.int32(12), "mu": {"w": w * 2}}}
    meshes = [Mesh(np.asarray(jax.devices()[:1]), ("fsdp",))]
    if jax.device_count() >= 2:  # also onto a different multi-device layout when this process has one
        meshes.append(Mesh(np.asarray(jax.devices()[:2]), ("fsdp",)))
    ck = Checkpointer(tmp_path, CheckpointConfig(interval=12, keep_last=1))
    for mesh in meshes:
        shard = {"params": {"w": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P())},
                 "opt_state": {"count": NamedSharding(mesh, P()), "mu": {"w": NamedSharding(mesh, P(None, "fsdp"))}}}
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), expected, shard)
        state, meta = ck.restore(12, abstract)
        assert meta["devices"] == 4
        assert_bitwise_equal(state, expected)
        assert state["params"]["w"].sharding == shard["params"]["w"]
        assert len(state["params"]["w"].sharding.device_set) == mesh.size
    ck.close()


def test_stop_signal_sets_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignal() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if stop.requested:
                break
            time.sleep(0.01)
        assert stop.requested and stop.signum == signal.SIGTERM
        # A SIGINT after a stop request means "now".
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):
                time.sleep(0.01)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_stop_signal_first_sigint_only_sets_flag():
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):
            if stop.requested:
                break
            time.sleep(0.01)
        assert stop.signum == signal.SIGINT
