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


# Peak dense bf16 FLOP/s per chip, keyed by JAX's ``device_kind`` (or its prefix). One table:
# the training loop's MFU and ``olmax compile``'s estimated MFU both read it. Unknown devices get
# no MFU.
CHIPS: dict[str, Chip] = {
    "NVIDIA H100 80GB HBM3": Chip(989e12, 1, "NVIDIA H100 datasheet: SXM, bf16 dense (1,979 with sparsity)"),
    "NVIDIA H100": Chip(989e12, 1, "NVIDIA H100 datasheet: SXM, bf16 dense"),
    "NVIDIA H200": Chip(989e12, 1, "NVIDIA H200 datasheet: SXM, bf16 dense"),
    "NVIDIA A100-SXM4-80GB": Chip(312e12, 1, "NVIDIA A100 datasheet: bf16 dense"),
    "NVIDIA A100-SXM4-40GB": Chip(312e12, 1, "NVIDIA A100 datasheet: bf16 dense"),
    "NVIDIA B200": Chip(2250e12, 1, "NVIDIA DGX B200 datasheet: bf16 dense per GPU"),
    "TPU v4": Chip(275e12, 1, "Cloud TPU docs, TPU v4: 275 TFLOP/s bf16 per chip (megacore: one device)"),
    "TPU v5 lite": Chip(197e12, 1, "Cloud TPU docs, TPU v5e: 197 TFLOP/s bf16 per chip"),
    "TPU v5e": Chip(197e12, 1, "Cloud TPU docs, TPU v5e: 197 TFLOP/s bf16 per chip"),
    "TPU v5p": Chip(459e12, 1, "Cloud TPU docs, TPU v5p: 459 TFLOP/s bf16 per chip (megacore: one device)"),
    "TPU v5": Chip(459e12, 1, "v5p's device_kind as JAX reports it; Cloud TPU docs, TPU v5p"),
    "TPU v6 lite": Chip(918e12, 1, "Cloud TPU docs, TPU v6e (Trillium): 918 TFLOP/s bf16 per chip"),
    "TPU v6e": Chip(918e12, 1, "Cloud TPU docs, TPU v6e (Trillium): 918 TFLOP/s bf16 per chip"),
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


def device_peak_flops(device_kind: str) -> float | None:
    if device_kind in PEAK_BF16_FLOPS:
        return PEAK_BF16_FLOPS[device_kind]
    for k, v in PEAK_BF16_FLOPS.items():
        if device_kind.startswith(k):
            return v
    return None


def mfu(flops_per_tok: float, tokens_per_sec_per_device: float, peak: float | None) -> float | None:
    if not peak:
        return None
    return flops_per_tok * tokens_per_sec_per_device / peak
