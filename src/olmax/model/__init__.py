"""The OLMo 3 model: parameter specs (params), building blocks (layers, attention), forward
(olmo3), and the safetensors weights directory (weights_io). Pure functions over a parameter
pytree; imports config and sharding (the logical-axis rules) only, never training or a mesh axis."""

from olmax.model.olmo3 import forward
from olmax.model.params import ParamSpec, count_params, init_params, logical_axes, param_specs

__all__ = ["forward", "ParamSpec", "count_params", "init_params", "logical_axes", "param_specs"]
