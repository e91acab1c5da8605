"""Quantized tensor types, one file per dtype family."""
from . import experts  # noqa: F401  (the fused-experts ops)
from .float8 import Float8Tensor
from .fpx import FPxTensor
from .float8_sparse import Float8SemiSparseTensor
from .int4 import Int4Tensor
from .int4dq import Int4DQTensor
from .int8 import Int8Tensor
from .intx import IntxTensor
from .intxdq import IntxDQTensor
from .mx import MXTensor
from .nvfp4 import NVFP4Tensor
from . import sharding  # noqa: F401  (the ops tensor-parallel shards use)

__all__ = ["Int4Tensor", "Int4DQTensor", "Int8Tensor", "IntxTensor", "IntxDQTensor", "Float8Tensor", "MXTensor", "NVFP4Tensor", "FPxTensor",
           "Float8SemiSparseTensor"]
