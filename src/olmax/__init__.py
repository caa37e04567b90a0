"""olmax: faithful, verified reproductions of published LLM pre-training runs in JAX."""

__version__ = "0.1.0"
