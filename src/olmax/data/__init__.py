"""Data pipeline: corpus -> token files -> topology-invariant global order -> per-process batches.

- ``tokenize``: text / JSONL(.gz/.zst) -> raw token files + ``manifest.json`` (OLMo-core layout).
- ``chat``: chat JSONL -> token ids + label masks (SFT) or chosen/rejected pairs (DPO).
- ``dataset``: token files and OLMo-core mix files, instances, fingerprint, repetition filter.
- ``order``: the global order per epoch and the ONE place where indices are split.
- ``loader``: Grain loader of this process's share of batch k, data state, global jax.Array.
- ``audit``: proves each instance is read exactly once for any process / worker count.
- ``commands``: ``olmax tokenize`` and ``olmax data {batches,audit}``.

Imports config, io and sharding (to place a batch on the mesh) only: data knows nothing of training.
"""


class DataError(ValueError):
    """Bad data input (a file, a mix line, a size); the message names the file or field."""
