"""Packed RL training rows (``rl.pack_length``): each completion with its prompt is one document of
a training row of ``pack_length`` tokens, instead of a row of its own padded to
``data.sequence_length``.

- Bins: first-fit-decreasing (``first_fit_decreasing``): documents by length, longest first (ties
  by batch order), each into the first row with room; a row's documents then in batch order. A
  pure function of the lengths: the same rollouts give the same rows (resume stays bitwise).
- Each mini-batch of the rollout batch (``rl.num_mini_batches`` contiguous blocks of whole groups)
  is packed on its own, so an update sees the completions it saw unpacked.
- Rows per mini-batch vary from step to step (``row_plan``): as few micro-batches as keep a
  device's rows per micro-batch within the unpacked update's (``train.max_micro_batch_size``: the
  same memory), each spread evenly over the data-parallel devices, and a device's rows rounded up
  to ``ROW_BITS`` significant bits (exact up to 32, then within 1/16 of the rows needed, 1/32 on
  average), so that the update compiles at most 16 programs per doubling of the row count and
  micro-batch count (a run's counts stay within a few of each other; the AI2 recipes, one row per
  device: one per count). The extra rows are empty (no token, no loss, no sequence).
- Groups that ``rl.filter_zero_std`` dropped (``row_valid`` False) train nothing and are left out.

A packed row carries ``positions`` (from 0 in each document) and ``segment_ids`` (1, 2, ... per
document, 0 on padding), which the model's attention and RoPE take (``olmax.model.olmo3.
hidden_states``), per-token ``advantages`` [rows, L] in ``token_logps`` layout (a token's
document's advantage), and ``row_sequences`` (documents per row, the ``sequence_mean`` count).
"""

from __future__ import annotations

import numpy as np

# The per-token arrays of a padded batch that are copied document by document into packed rows.
TOKEN_KEYS = ("input_ids", "completion_mask", "generated_mask", "gen_logps")


def first_fit_decreasing(lengths: list[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins of at most ``capacity`` tokens: longest first (ties by index),
    each into the first bin with room; each bin's indices ascending. Deterministic."""
    lengths = [int(x) for x in lengths]
    if any(x > capacity for x in lengths):
        raise ValueError(f"a document of {max(lengths)} tokens does not fit a packed row of {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


ROW_BITS = 5  # a device's rows per micro-batch keep this many significant bits (few programs, few empty rows)


def round_rows(n: int, bits: int = ROW_BITS) -> int:
    """``n`` rounded up to ``bits`` significant binary digits: exact below ``2**bits``, then steps
    of ``2**(n.bit_length() - bits)`` (at most 1/``2**(bits - 1)`` more than ``n``)."""
    shift = max(0, int(n).bit_length() - bits)
    return -(-int(n) >> shift) << shift


def row_plan(rows: int, data_parallel: int, micro_batch: int) -> tuple[int, int]:
    """``(accum_steps, rows per device per micro-batch)`` for ``rows`` packed rows of a mini-batch:
    the fewest micro-batches with at most ``micro_batch`` rows per device, the rows per device
    rounded up by ``round_rows`` (never past ``micro_batch``). The mini-batch then has
    ``accum_steps x data_parallel x`` that many rows (>= ``rows``)."""
    accum = max(1, -(-rows // (data_parallel * micro_batch)))
    per = -(-rows // (accum * data_parallel))
    return accum, max(1, min(micro_batch, round_rows(per)))


def pack_batch(batch: dict[str, np.ndarray], pack_length: int, mini_batches: int, data_parallel: int = 1,
               micro_batch: int = 1, pad_token_id: int = 0) -> tuple[dict[str, np.ndarray], int]:
    """The padded rollout batch (``olmax.rl.rollout``: one completion a row, ``lengths`` [n] its
    prompt + completion tokens) as packed rows, and the micro-batches of each mini-batch:
    ``mini_batches`` blocks of the same number of rows (``row_plan`` of the largest block's
    bins), each block the documents of the same block of the padded batch."""
    n = int(np.shape(batch["input_ids"])[0])
    if n % mini_batches:
        raise ValueError(f"{n} rows do not split into {mini_batches} mini-batches")
    size = n // mini_batches
    lengths = np.asarray(batch["lengths"], np.int64)
    valid = np.asarray(batch["row_valid"], bool)
    blocks = []
    for k in range(mini_batches):
        docs = [k * size + j for j in range(size) if valid[k * size + j] and lengths[k * size + j] > 0]
        blocks.append([[docs[i] for i in b] for b in first_fit_decreasing(lengths[docs], pack_length)])
    accum, per_device = row_plan(max(len(b) for b in blocks), data_parallel, micro_batch)
    per = accum * data_parallel * per_device
    rows = mini_batches * per
    out = {
        "input_ids": np.full((rows, pack_length), pad_token_id, np.int32),
        "completion_mask": np.zeros((rows, pack_length), bool),
        "generated_mask": np.zeros((rows, pack_length), bool),
        "gen_logps": np.zeros((rows, pack_length), np.float32),
        "advantages": np.zeros((rows, pack_length), np.float32),
        "positions": np.zeros((rows, pack_length), np.int32),
        "segment_ids": np.zeros((rows, pack_length), np.int32),
        "row_sequences": np.zeros(rows, np.float32),
        "lengths": np.zeros(rows, np.int32),  # real tokens of each packed row
    }
    for k, block in enumerate(blocks):
        for j, docs in enumerate(block):
            row, at = k * per + j, 0
            for s, d in enumerate(docs, 1):
                m = int(lengths[d])
                for key in TOKEN_KEYS:
                    out[key][row, at:at + m] = batch[key][d, :m]
                # token_logps layout: position i is trained for token i + 1, of the same document
                out["advantages"][row, at:at + m] = batch["advantages"][d]
                out["positions"][row, at:at + m] = np.arange(m)
                out["segment_ids"][row, at:at + m] = s
                at += m
            out["row_sequences"][row] = len(docs)
            out["lengths"][row] = at
    return out, accum


def padding_share(lengths: np.ndarray, rows: int, length: int) -> float:
    """Padding tokens / training row tokens: positions that hold no token of a prompt or a
    completion, over ``rows x length``."""
    total = rows * length
    return float(total - int(np.sum(lengths))) / total if total else 0.0
