"""Verification surfaces: each claim of equivalence has a command that measures it: logit parity
against HF transformers (parity), resume A/B (resume), per-step parity with OLMo-core
(olmo_core, noise_floor, _worker). Above train, eval and compat; imports anything but the CLI."""
