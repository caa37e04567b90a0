"""FLOPs per token (OLMo-core 3.0 formula) and MFU.

6 x (non-embedding parameters, LM head included) + 12 * n_heads * head_dim * P / L per layer,
where P counts the causal (query, key) pairs exactly: L(L+1)/2 for a full layer and
W(W+1)/2 + (L-W)W for a sliding one. (MaxText counts every OLMo 3 layer as full attention
and overstates by about 2.6% at 7B.)
"""

from __future__ import annotations

from dataclasses import dataclass

from olmax.config import ModelConfig
from olmax.model.params import count_params


@dataclass(frozen=True)
class Chip:
    peak_bf16: float   # dense bf16 FLOP/s of the whole chip, from the vendor's datasheet
    devices: int       # JAX devices per chip (Ironwood: one per TensorCore)
    source: str
    hbm_bandwidth: float | None = None  # bytes/s of the whole chip's HBM, same datasheet; None: not entered


# Peak dense bf16 FLOP/s per chip, keyed by JAX's ``device_kind`` (or its prefix). One table:
# the training loop's MFU and ``olmax compile``'s estimated MFU both read it. Unknown devices get
# no MFU. The HBM bandwidth (where entered) prices a program's bytes where XLA gives no time
# (``olmax compile --sweep --measure``).
CHIPS: dict[str, Chip] = {
    "NVIDIA H100 80GB HBM3": Chip(989e12, 1, "NVIDIA H100 datasheet: SXM, bf16 dense (1,979 with sparsity), 3.35 TB/s",
                                   3.35e12),
    "NVIDIA H100": Chip(989e12, 1, "NVIDIA H100 datasheet: SXM, bf16 dense, 3.35 TB/s", 3.35e12),
    "NVIDIA H200": Chip(989e12, 1, "NVIDIA H200 datasheet: SXM, bf16 dense, 4.8 TB/s", 4.8e12),
    "NVIDIA A100-SXM4-80GB": Chip(312e12, 1, "NVIDIA A100 datasheet: bf16 dense"),
    "NVIDIA A100-SXM4-40GB": Chip(312e12, 1, "NVIDIA A100 datasheet: bf16 dense"),
    "NVIDIA B200": Chip(2250e12, 1, "NVIDIA DGX B200 datasheet: bf16 dense per GPU"),
    "TPU v4": Chip(275e12, 1, "Cloud TPU docs, TPU v4: 275 TFLOP/s bf16 per chip (megacore: one device), 1,200 GB/s",
                     1200e9),
    "TPU v5 lite": Chip(197e12, 1, "Cloud TPU docs, TPU v5e: 197 TFLOP/s bf16 per chip, 819 GB/s", 819e9),
    "TPU v5e": Chip(197e12, 1, "Cloud TPU docs, TPU v5e: 197 TFLOP/s bf16 per chip, 819 GB/s", 819e9),
    "TPU v5p": Chip(459e12, 1, "Cloud TPU docs, TPU v5p: 459 TFLOP/s bf16 per chip (megacore: one device), "
                               "2,765 GB/s", 2765e9),
    "TPU v5": Chip(459e12, 1, "v5p's device_kind as JAX reports it; Cloud TPU docs, TPU v5p", 2765e9),
    "TPU v6 lite": Chip(918e12, 1, "Cloud TPU docs, TPU v6e (Trillium): 918 TFLOP/s bf16 per chip, 1,640 GB/s",
                          1640e9),
    "TPU v6e": Chip(918e12, 1, "Cloud TPU docs, TPU v6e (Trillium): 918 TFLOP/s bf16 per chip, 1,640 GB/s", 1640e9),
    "TPU7x": Chip(2307e12, 2, "Cloud TPU docs, TPU7x (Ironwood): 2,307 TFLOP/s bf16 per chip, two "
                              "TensorCores, each a JAX device"),
}
# Per JAX device, what an MFU divides by.
PEAK_BF16_FLOPS: dict[str, float] = {k: c.peak_bf16 / c.devices for k, c in CHIPS.items()}


def causal_pairs(seq_len: int, window: int | None) -> int:
    L = seq_len
    if window is None or window >= L:
        return L * (L + 1) // 2
    W = window
    return W * (W + 1) // 2 + (L - W) * W


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    dense = 6 * count_params(cfg)["non_embedding"]
    attn = sum(12 * cfg.n_heads * cfg.head_dim * causal_pairs(seq_len, cfg.layer_window(i)) / seq_len
               for i in range(cfg.n_layers))
    return {"dense": float(dense), "attention": float(attn), "total": float(dense + attn)}


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """A forward pass only (evaluation, a prefill): a third of ``flops_per_token``'s total."""
    return flops_per_token(cfg, seq_len)["total"] / 3


def decode_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """One decode step of one row against ``context`` cached positions: 2 x non-embedding
    parameters plus 4 x n_heads x head_dim per attended key (QK and PV), each layer seeing at
    most its window."""
    dense = 2 * count_params(cfg)["non_embedding"]
    attn = sum(4 * cfg.n_heads * cfg.head_dim * min(context, cfg.layer_window(i) or context)
               for i in range(cfg.n_layers))
    return float(dense + attn)


def _chip(device_kind: str) -> Chip | None:
    if device_kind in CHIPS:
        return CHIPS[device_kind]
    return next((c for k, c in CHIPS.items() if device_kind.startswith(k)), None)


def device_peak_flops(device_kind: str) -> float | None:
    c = _chip(device_kind)
    return c.peak_bf16 / c.devices if c else None


def device_hbm_bandwidth(device_kind: str) -> float | None:
    """Bytes/s of HBM per JAX device, from the datasheet; None where the table has none."""
    c = _chip(device_kind)
    return c.hbm_bandwidth / c.devices if c and c.hbm_bandwidth else None


def mfu(flops_per_tok: float, tokens_per_sec_per_device: float, peak: float | None) -> float | None:
    if not peak:
        return None
    return flops_per_tok * tokens_per_sec_per_device / peak
