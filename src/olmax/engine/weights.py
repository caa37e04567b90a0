"""The decoding weights both engines run: the parameters ``decode.prepare``d once (stacked, cast to
the compute dtype, on the CPU joined and in the kernel's layout), sharded on a mesh as in
training, reloaded in place when RL updates them; and the host <-> device moves of a batch."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmax.config import ModelConfig
from olmax.model.decode import layout_of, prepare, relayout
from olmax.model.dispatch import decode_layout
from olmax.model.params import logical_axes
from olmax.sharding import activation_mesh, batch_sharding, param_shardings


def on_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn`` traced with its activations (and the cache) pinned to ``mesh`` by logical axes."""
    def traced(*args, **kwargs):
        with activation_mesh(mesh):
            return fn(*args, **kwargs)
    return traced


class DecodeWeights:
    """One model's prepared decoding weights. ``rows``: the batch rows it will mostly run, where
    known: the weights are then prepared in that batch's layout from the start, so the first
    batch relayouts nothing and a ``load`` (RL reloads the weights every step) runs a program
    already compiled."""

    def __init__(self, params: Any, cfg: ModelConfig, mesh: Mesh | None = None, rows: int | None = None):
        self.cfg, self.mesh = cfg, mesh
        self._prepare = jax.jit(on_mesh(partial(prepare, cfg=cfg), mesh), static_argnames=("layout",))
        self._relayout = jax.jit(on_mesh(partial(relayout, cfg=cfg), mesh), static_argnames=("layout",))
        self.prepared: dict | None = None
        self.load(params, layout="plain" if rows is None else decode_layout(rows, cfg))

    def load(self, params: Any, layout: str | None = None) -> None:
        """Decode with these weights from now on (RL: the trainer's, after each update); the
        compiled programs are kept, and so is the layout of the weights unless ``layout`` names
        another."""
        if self.mesh is not None:
            params = jax.device_put(params, param_shardings(logical_axes(self.cfg), self.mesh))
        layout = layout or layout_of(self.prepared)
        self.prepared = None  # the previous weights' prepared copy goes before the next is made
        self.prepared = self._prepare(params, layout=layout)

    def __call__(self, rows: int) -> dict:
        """The prepared weights in the layout a batch of ``rows`` decodes fastest with
        (``dispatch.decode_layout``): one copy is kept, turned over when the batch size calls for
        another layout."""
        wanted = decode_layout(rows, self.cfg)
        if wanted != layout_of(self.prepared):
            self.prepared = self._relayout(self.prepared, layout=wanted)
        return self.prepared

    def put(self, a: np.ndarray) -> jax.Array:
        """A host array whose first axis is the batch, on the device(s): on a mesh split over the
        data-parallel axes (from the host array, which every process holds whole)."""
        if self.mesh is None:
            return jnp.asarray(a)
        return jax.device_put(a, batch_sharding(self.mesh, a.ndim))

    def host_readable(self, *arrays: jax.Array) -> tuple[jax.Array, ...]:
        """Arrays the host loop reads (sampled tokens, log-probs). On a mesh that spans processes
        each process holds only its own rows: they are gathered onto every device (a few bytes
        per row), so that every process reads the whole batch and takes the same decisions.
        Elsewhere they are left as they are."""
        if self.mesh is None or jax.process_count() == 1:
            return arrays
        everywhere = NamedSharding(self.mesh, PartitionSpec())
        return tuple(jax.lax.with_sharding_constraint(a, everywhere) for a in arrays)
