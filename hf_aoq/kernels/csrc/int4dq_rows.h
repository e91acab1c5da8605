// Int4DQTensor's per-row parameters, decoded from rparams (the format is described in
// int4dq.cpp): shared by its kernels (int4dq.cpp) and its quantize-time search (int4dq_search.cpp).
#pragma once
#include <torch/types.h>

// rparams: uint8 [N, 4]; tparams: float32 [2]. Returns float32 [N, 4]: (dlo, dstep, clo, cstep).
torch::Tensor int4dq_decode(const torch::Tensor& rparams, const torch::Tensor& tparams);
