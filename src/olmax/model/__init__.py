"""The OLMo 3 model: parameter specs (params), building blocks (layers, attention), forward
(olmo3), the KV-cache prefill and decode step (decode; the engine that schedules them is
``olmax.engine``), the loss (loss), and the safetensors weights directory
(weights_io). Which implementation runs an operation on the platform the program targets is
decided in one module (dispatch), the only one that asks which platform that is and the only door
to the platform kernels (``olmax.kernels``). Pure functions over a parameter pytree; imports
config, sharding (the logical-axis rules) and the kernels only, never training or a mesh axis."""

from olmax.model.olmo3 import forward
from olmax.model.params import ParamSpec, count_params, init_params, logical_axes, param_specs

__all__ = ["forward", "ParamSpec", "count_params", "init_params", "logical_axes", "param_specs"]
