"""Measurements beside the model: FLOPs and MFU (flops), the per-device memory estimate (memory),
metric sinks: JSONL, TensorBoard, progress bar (sinks). Imports config, model.params and sharding."""
