"""The shapes a generation call compiles with, in one place (the engines, ``olmax compile`` and the
benchmarks ask here).

Prompts are right-padded to a power of two (at least 16; 128 for splash attention), the cache
holds the prompt bucket plus the new tokens rounded up to 64, batches run a power of two of rows
(whole rows per data-parallel shard). A prompt that several rows share (GRPO samples a group of
completions of each prompt) is prefilled once per data-parallel shard, in a block of the shard's
distinct prompts (a power of two as well), and its cache copied to each of its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from olmax.config import ModelConfig
from olmax.model.dispatch import resolve_attention
from olmax.sharding import activation_mesh, data_parallel_size


def bucket(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (n - 1).bit_length())


def prompt_bucket(longest: int, cfg: ModelConfig, mesh: Mesh | None = None) -> int:
    """The padded prompt length of a call whose longest prompt has ``longest`` tokens: a power of
    two, at least 16, or 128 where ``cfg``'s attention resolves to splash under ``mesh`` (TPU:
    it tiles the prompt in blocks of 128)."""
    with activation_mesh(mesh):
        splash = resolve_attention(cfg.attention_impl, jnp.dtype(cfg.compute_dtype)) == "splash"
    return bucket(longest, lo=128 if splash else 16)


def batch_rows(prompts: int, batch_size: int, data_parallel: int = 1) -> int:
    """The rows every batch of a call of ``prompts`` prompts runs with: ``batch_size`` at most,
    fewer (a power of two) for a smaller call, whole rows per data-parallel shard."""
    rows = min(batch_size, bucket(prompts, lo=1))
    return -(-rows // data_parallel) * data_parallel


def mesh_data_parallel(mesh: Mesh | None) -> int:
    return data_parallel_size(dict(mesh.shape)) if mesh is not None else 1


def call_rows(prompts: int, batch_size: int, mesh: Mesh | None = None) -> int:
    """``batch_rows`` of a ``generate`` call of ``prompts`` prompts on ``mesh`` (None: one device):
    the ``rows`` to build its ``Generator`` with."""
    return batch_rows(prompts, batch_size, mesh_data_parallel(mesh))


def _share(keys: Sequence[tuple], data_parallel: int) -> tuple[list[int], np.ndarray] | None:
    """``prefill_rows``' plan for the padded batch's rows (as hashable ``keys``): the rows to
    prefill (each shard's distinct prompts, every shard's block padded with its first to one
    power-of-two width) and, per shard, the block row each of its rows copies; None where that
    saves no row."""
    per = len(keys) // data_parallel
    blocks, source = [], np.zeros((data_parallel, per), np.int32)
    for d in range(data_parallel):
        first: dict[tuple, int] = {}  # a prompt -> its row in the shard's block
        block: list[int] = []
        for j in range(per):
            key = keys[d * per + j]
            if key not in first:
                first[key] = len(block)
                block.append(d * per + j)
            source[d, j] = first[key]
        blocks.append(block)
    width = bucket(max(map(len, blocks)), lo=1)
    if width * data_parallel >= len(keys):
        return None
    return [r for b in blocks for r in [*b, *[b[0]] * (width - len(b))]], source


def prefill_rows(prompts: Sequence[Sequence[int]], rows: int,
                 data_parallel: int = 1) -> tuple[list[Sequence[int]], np.ndarray | None]:
    """What one batch prefills: ``prompts`` padded to ``rows`` with copies of the first. Where
    real rows repeat a prompt (a GRPO group), each of the ``data_parallel`` shards (consecutive
    rows) prefills its distinct prompts once and ``decode.expand_rows`` copies their cache to its
    rows: then the prefilled prompts and, per shard, the block row each row copies
    ([data_parallel, rows / data_parallel]); otherwise the padded rows and None. Padding alone
    never shares, so a batch of distinct prompts keeps its one program."""
    filled = [*prompts, *[prompts[0]] * (rows - len(prompts))]
    keys = [tuple(int(t) for t in p) for p in filled]
    if len(set(keys[:len(prompts)])) == len(prompts):
        return filled, None
    shared = _share(keys, data_parallel)
    if shared is None:
        return filled, None
    return [filled[r] for r in shared[0]], shared[1]


def cache_length(prompt_len: int, max_new_tokens: int) -> int:
    """The cache a call holds: its prompt bucket plus the new tokens, rounded up to 64."""
    return -(-(prompt_len + max_new_tokens) // 64) * 64


