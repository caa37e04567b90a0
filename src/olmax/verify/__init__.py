"""Verification surfaces: each claim of equivalence has a command that measures it (logit parity
against HF transformers lives in ``olmax.verify.parity``)."""
