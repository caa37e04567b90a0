"""The platform kernels as a backend: ``olmax.model.dispatch`` is the only module of the model that
asks which platform the program targets and the only one that reaches ``olmax.kernels``; what it
picks on each platform; and a fresh run records it in ``run_info.json``."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from olmax.kernels import cpu as cpu_kernels
from olmax.model import dispatch
from olmax.recipes import get_recipe
from trainlib import small_overrides

MODEL = Path(__file__).resolve().parents[1] / "src" / "olmax" / "model"
# Names that ask which platform the program targets (attributes or calls): a device's or a
# backend's ``.platform``, JAX's default backend, the dispatch's own question; and the
# environment variables that choose JAX's platform.
PLATFORM_NAMES = {"platform", "default_backend", "get_backend", "target_platform", "device_platform", "backends"}
PLATFORM_ENV = {"JAX_PLATFORMS", "JAX_PLATFORM_NAME"}


def platform_queries(source: str) -> list[str]:
    """``line: what`` for every platform query in ``source`` (code only: comments and docstrings
    may name them)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
            node.name if isinstance(node, ast.alias) else None
        if name in PLATFORM_NAMES:
            found.append(f"{getattr(node, 'lineno', '?')}: {name}")
        elif isinstance(node, ast.Constant) and node.value in PLATFORM_ENV:
            found.append(f"{node.lineno}: {node.value}")
    return found


def test_the_scan_finds_each_kind_of_platform_query():
    for code in ("target_platform()", "mesh.devices.flat[0].platform == 'cpu'", "jax.default_backend()",
                 "jax.devices()[0].platform", "dispatch.target_platform()", "os.environ['JAX_PLATFORMS']",
                 "from olmax.model.dispatch import target_platform", "xla_bridge.get_backend().platform"):
        assert platform_queries(code), code
    assert not platform_queries('"""target_platform() and .platform, named in a docstring"""\nx = platform_name')


def test_only_the_dispatch_asks_which_platform_the_program_targets():
    """Every other module of the model describes the model and looks its choices up in the
    dispatch (``joined_projections``, ``head_major_cache``, ``attend``...): none asks the platform."""
    assert platform_queries((MODEL / "dispatch.py").read_text())  # the scan sees the one that does
    found = {p.name: q for p in sorted(MODEL.rglob("*.py")) if p.name != "dispatch.py"
             if (q := platform_queries(p.read_text()))}
    assert not found, f"platform queries outside olmax/model/dispatch.py: {found}"


def test_the_model_reaches_the_kernels_through_the_dispatch_only():
    def kernel_imports(path: Path) -> list[int]:
        out = []
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            out += [node.lineno for n in names if n.split(".")[:2] == ["olmax", "kernels"]]
        return out

    assert kernel_imports(MODEL / "dispatch.py")
    found = {p.name: lines for p in sorted(MODEL.rglob("*.py")) if p.name != "dispatch.py"
             if (lines := kernel_imports(p))}
    assert not found, f"olmax.kernels imported outside olmax/model/dispatch.py: {found}"


def test_describe_names_what_runs_on_each_platform():
    """The attention implementation "auto" resolves to on each platform and dtype, and where olmax's
    C++ kernels run SwiGLU and q/k/v: by default XLA's arithmetic for training on a CPU (the more
    faithful to OLMo-core), the kernels with ``model.cpu_training_kernels``, where the kernel's own
    limits count (heads of 8 take the blocked attention and XLA's q/k/v, not the kernel's)."""
    default = dispatch.describe(get_recipe("tiny").model, "cpu")
    assert (default["attention"], default["swiglu"], default["qkv"]) == ("blocked", dispatch.XLA, dispatch.XLA)
    tiny = get_recipe("tiny", ["model.cpu_training_kernels=true"]).model
    built = cpu_kernels.available()
    kernel = dispatch.KERNELS if built else dispatch.XLA
    cpu = dispatch.describe(tiny, "cpu")
    assert {k: cpu[k] for k in ("attention", "swiglu", "qkv", "decode_layout", "reproduces_decode_bits",
                                "kernels")} == {
        "attention": "cpu" if built else "blocked", "swiglu": kernel, "qkv": kernel,
        "decode_layout": "packed" if built else "plain", "reproduces_decode_bits": built, "kernels": kernel}
    assert cpu.get("kernel_isa") == (cpu_kernels.isa() if built else None)
    assert ("kernels_unavailable" in cpu) is not built
    narrow = dispatch.describe(replace(tiny, head_dim=8), "cpu")
    assert (narrow["attention"], narrow["qkv"], narrow["swiglu"]) == ("blocked", dispatch.XLA, kernel)
    bf16 = dispatch.describe(replace(tiny, compute_dtype="bfloat16"), "cpu")
    assert (bf16["attention"], bf16["swiglu"], bf16["qkv"]) == ("blocked", dispatch.XLA, dispatch.XLA)
    assert bf16["decode_layout"] == ("packed" if built else "plain")
    assert dispatch.describe(replace(tiny, compute_dtype="bfloat16"), "gpu") == {
        "attention": "cudnn", "swiglu": "xla", "qkv": "xla", "decode_layout": "plain",
        "reproduces_decode_bits": False, "kernels": "xla"}
    assert dispatch.describe(tiny, "gpu")["attention"] == "xla"  # cuDNN has no fp32 kernel
    # splash's fp32 backward is not exact: the reference where a sequence's scores are small, else blocked
    assert dispatch.describe(tiny, "tpu")["attention"] == "reference"
    assert dispatch.describe(tiny, "tpu", length=8192)["attention"] == "blocked"
    assert dispatch.describe(replace(tiny, compute_dtype="bfloat16"), "tpu")["attention"] == "splash"
    assert dispatch.describe(replace(tiny, attention_impl="reference"), "tpu")["attention"] == "reference"


def test_describe_agrees_with_what_the_model_traces():
    """``describe`` asks the same functions the forward does: the implementation it names for the
    CPU is the one ``attend`` and ``swiglu`` call (their FFI targets in the traced program)."""
    import jax

    from olmax.model.olmo3 import forward
    from olmax.model.params import init_params
    fast = get_recipe("tiny", ["model.cpu_training_kernels=true"]).model
    for m in (get_recipe("tiny").model, fast, replace(fast, head_dim=8)):
        info = dispatch.describe(m, dispatch.target_platform())
        params = jax.eval_shape(lambda m=m: init_params(m, jax.random.key(0)))
        loss = lambda p, m=m: jnp.sum(forward(p, jnp.zeros((2, 64), jnp.int32), m))
        text = jax.jit(jax.grad(loss)).lower(params).as_text()
        assert (cpu_kernels.FLASH_FWD in text) is (info["attention"] == "cpu"), info
        assert (cpu_kernels.SWIGLU_FWD in text) is (info["swiglu"] == dispatch.KERNELS), info
        assert (cpu_kernels.QKV_FWD in text) is (info["qkv"] == dispatch.KERNELS), info


@pytest.mark.integration
def test_a_fresh_run_records_the_implementations_in_run_info(tmp_path, corpus):
    """The tiny recipe at test size (heads of 8: the blocked attention) for one step: run_info.json
    names the attention implementation and kernels the run used, as ``describe`` gives them."""
    from olmax.train.loop import train
    cfg = get_recipe("tiny", small_overrides(corpus, "train.steps=1"))
    train(cfg, tmp_path / "run", progress=False)
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["implementations"] == dispatch.describe(cfg.model, "cpu")
    assert info["implementations"]["attention"] == "blocked"
    assert info["implementations"]["kernels"] == (dispatch.KERNELS if cpu_kernels.available() else dispatch.XLA)


def test_tpu_auto_attention_is_splash_in_bf16_and_exact_xla_in_fp32():
    # splash's fp32 backward is not exact on a TPU (measured on a v5e: dq/dk/dv up to 5.6e-3 off the
    # reference), so fp32 compute takes the XLA blocked kernel under exact products there
    from olmax.model.dispatch import resolve_attention
    assert resolve_attention("auto", jnp.bfloat16, "tpu") == "splash"
    assert resolve_attention("auto", jnp.float32, "tpu") == "blocked"
    assert resolve_attention("splash", jnp.float32, "tpu") == "splash"  # asked for by name, it runs


def test_tpu_auto_attention_in_fp32_is_the_reference_where_its_scores_fit():
    # On a v5e the reference's fp32 gradients were 1.1e-6 off the CPU's, the blocked kernel's 5.0e-5:
    # "auto" takes the reference while one sequence's fp32 scores fit EXACT_SCORES_BYTES, else
    # blocked; a kernel named in the config is what runs, and bf16 keeps splash.
    from olmax.model.dispatch import EXACT_SCORES_BYTES, attention_impl
    cfg = get_recipe("tiny").model
    qkv = lambda b, t, dt: (jax.ShapeDtypeStruct((b, t, 32, 128), dt), jax.ShapeDtypeStruct((b, t, 8, 128), dt))
    side = int((EXACT_SCORES_BYTES // (32 * 4)) ** 0.5)  # a sequence of `side` tokens fills the bound
    assert attention_impl(cfg, *qkv(8, side, jnp.float32), platform="tpu") == "reference"
    assert attention_impl(cfg, *qkv(1, side + 1, jnp.float32), platform="tpu") == "blocked"
    assert attention_impl(cfg, *qkv(1, side, jnp.bfloat16), platform="tpu") == "splash"
    named = replace(cfg, attention_impl="blocked")
    assert attention_impl(named, *qkv(1, 128, jnp.float32), platform="tpu") == "blocked"


def test_the_engines_round_trip_is_longer_on_a_tpu():
    # a v5e's round trip cost about a decode step (batch 1: 6.82 ms a step at 8 a round trip, 6.02
    # at 32); on the CPU a step is long next to a round trip
    from olmax.engine import Engine
    assert dispatch.round_trip_steps("tpu") == 32 and dispatch.round_trip_steps("cpu") == 8
    assert Engine.reset.__kwdefaults__["chunk"] is None  # None: the platform's
