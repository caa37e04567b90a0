"""FLOPs per token (OLMo-core 3.0 formula) and MFU.

6 x (non-embedding parameters, LM head included) + 12 * n_heads * head_dim * P / L per layer,
where P counts the causal (query, key) pairs exactly: L(L+1)/2 for a full layer and
W(W+1)/2 + (L-W)W for a sliding one. (MaxText counts every OLMo 3 layer as full attention
and overstates by about 2.6% at 7B.)
"""

from __future__ import annotations

from olmax.config import ModelConfig
from olmax.model.params import count_params

# Peak dense bf16 FLOP/s per device, from vendor datasheets. Unknown devices get no MFU.
PEAK_BF16_FLOPS: dict[str, float] = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA B200": 2250e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,      # v5p's device_kind as JAX reports it
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "TPU7x": 2307e12,
}


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
