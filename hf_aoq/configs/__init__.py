"""Quantization configs: one dataclass per scheme (a module per tensor family), FqnToConfig for
per-layer recipes (precedence in .recipe), their strict JSON, and the scheme names."""
from __future__ import annotations

from .recipe import (AOQBaseConfig, FqnToConfig, OPTIONAL, recipe_from_dict, recipe_to_dict)
from .integer import (Float8DynamicActivationInt4WeightConfig, Int4DQWeightOnlyConfig,
                      Int4DynamicActivationInt4WeightConfig, Int4WeightOnlyConfig,
                      Int8DynamicActivationInt4WeightConfig, Int8DynamicActivationInt8WeightConfig,
                      Int8WeightOnlyConfig, IntxDQWeightOnlyConfig)
from .float8 import (Float8DynamicActivationFloat8SemiSparseWeightConfig, Float8DynamicActivationFloat8WeightConfig,
                     Float8StaticActivationFloat8WeightConfig, Float8WeightOnlyConfig)
from .microscaling import (MXDynamicActivationMXWeightConfig, MXFPInferenceConfig, NVFP4InferenceConfig,
                           NVFP4WeightOnlyConfig)
from .fpx import FPXWeightOnlyConfig
from .intx import (GemliteUIntXWeightOnlyConfig, INT_DTYPES, INT_DTYPES_BY_BITS,
                   Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, MAPPING_TYPES,
                   UINT_DTYPES, UIntXWeightOnlyConfig)
from .schemes import (INTX_DEFAULT_GROUP, INTX_SCHEME_BITS, SCHEMES, config_for_scheme)

__all__ = [
    'OPTIONAL', 'AOQBaseConfig', 'Int4WeightOnlyConfig', 'Int4DQWeightOnlyConfig',
    'Int8WeightOnlyConfig', 'Int8DynamicActivationInt8WeightConfig', 'Float8WeightOnlyConfig',
    'Float8DynamicActivationFloat8WeightConfig', 'Float8StaticActivationFloat8WeightConfig',
    'Float8DynamicActivationFloat8SemiSparseWeightConfig',
    'Int8DynamicActivationInt4WeightConfig', 'Int4DynamicActivationInt4WeightConfig',
    'Float8DynamicActivationInt4WeightConfig', 'MXFPInferenceConfig',
    'MXDynamicActivationMXWeightConfig', 'NVFP4InferenceConfig', 'NVFP4WeightOnlyConfig', 'FPXWeightOnlyConfig', 'INT_DTYPES', 'INT_DTYPES_BY_BITS', 'UINT_DTYPES',
    'MAPPING_TYPES', 'IntxWeightOnlyConfig', 'IntxDQWeightOnlyConfig', 'Int8DynamicActivationIntxWeightConfig',
    'UIntXWeightOnlyConfig', 'GemliteUIntXWeightOnlyConfig', 'FqnToConfig', 'recipe_to_dict',
    'recipe_from_dict', 'SCHEMES', 'INTX_SCHEME_BITS', 'INTX_DEFAULT_GROUP', 'config_for_scheme'
]
