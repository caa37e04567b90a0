"""The OLMo 3 model: parameter specs (params), building blocks (layers), forward (olmo3)."""

from olmax.model.olmo3 import forward
from olmax.model.params import ParamSpec, count_params, init_params, logical_axes, param_specs

__all__ = ["forward", "ParamSpec", "count_params", "init_params", "logical_axes", "param_specs"]
