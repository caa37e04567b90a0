"""Compatibility with other frameworks: HF transformers conversion, both directions, config and
weights (``olmax.compat.hf``). Imports config and the model's weights format only (checkpoint.load
reads ``hf:`` checkpoints through it); ``compat.commands`` (the CLI) also reads training checkpoints."""

from olmax.compat.hf import (
                             ConversionError,
                             config_from_hf,
                             hf_config_to_olmax,
                             hf_to_olmax,
                             load_hf_params,
                             olmax_to_hf,
                             olmax_to_hf_config,
)

__all__ = ["ConversionError", "config_from_hf", "hf_config_to_olmax", "hf_to_olmax", "load_hf_params",
           "olmax_to_hf", "olmax_to_hf_config"]
