// The extension's Python-visible functions (cpu_ext.FUNCTIONS), one declaration each; each is
// defined, with its documentation, in the source named beside it. Each source is its own
// translation unit; cpu_ext.py generates the Python binding from this list.
#pragma once
#include <torch/types.h>
#include <vector>

// *_dequantize: the whole weight in bfloat16 or float16, bit for bit the reference's
// dequantize(dtype), for aten's GEMM at many rows (kernels/cpu_gemm.py).
// int4.cpp: Int4Tensor on the pairs layout, and the repacking into it.
torch::Tensor int4pack_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size,
                              int64_t gemv_max_rows, bool int16_activations);
torch::Tensor int4_repack_pairs(torch::Tensor canonical, int64_t padded_k);
torch::Tensor int4pack_dequantize(torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size, int64_t k,
                                  torch::ScalarType dtype);

// *_amx_linear: F.linear for bfloat16 activations at many rows, the weight dequantized 32 output
// columns at a time as the reference dequantizes it into a small bf16 panel (amx_gemm.h), and
// multiplied on AMX tiles (tiles) or on AVX512-BF16's dot products (not tiles); bfloat16 [M, N].
// Tiles only where amx_available(), the dot products only in the avx512 build; elsewhere they raise.
torch::Tensor int4pack_amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size,
                                  c10::optional<torch::Tensor> bias, bool tiles);
torch::Tensor int4dq_amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams, torch::Tensor rparams,
                                torch::Tensor tparams, int64_t group_size, c10::optional<torch::Tensor> bias, bool tiles);
torch::Tensor int8_amx_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                              bool tiles);
// int8dyn.cpp: int8 weights with dynamic int8 activations in exact integer sums, x float32, bf16 or
// fp16 (quantized per row inside, as the reference does); [M, N] in x's dtype. On AMX's int8 tiles
// (where amx_available()), or on AVX-512 VNNI's dot products (the avx512 build): a GEMV at up to
// gemv_max_rows rows, a panel loop above. The same bits from each.
torch::Tensor int8dyn_amx_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias);
torch::Tensor int8dyn_vnni_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                  c10::optional<torch::Tensor> bias, int64_t gemv_max_rows);
torch::Tensor fp8_amx_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, int64_t shift,
                             c10::optional<torch::Tensor> bias, bool tiles);
// Float8 weight x bf16 x at few rows on AVX512-BF16's dot products (the avx512 build): the codes as
// their exact bf16 values, the row's scale on the float32 sum; bfloat16 [M, N].
torch::Tensor fp8_dpbf16_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, int64_t shift,
                                c10::optional<torch::Tensor> bias);
torch::Tensor intx_amx_linear(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale, c10::optional<torch::Tensor> zero,
                              int64_t bits, int64_t group_size, c10::optional<torch::Tensor> bias, bool tiles);
torch::Tensor intxdq_amx_linear(torch::Tensor x, torch::Tensor qdata, torch::Tensor gparams, torch::Tensor rparams,
                                torch::Tensor tparams, int64_t bits, int64_t group_size, c10::optional<torch::Tensor> bias,
                                bool tiles);
// amx.cpp: whether this binary has the AMX kernels and this process may run them.
bool amx_available();
// dense.cpp: a plain bf16 weight [N, K] against float32 rows [M, K] (float32 [M, N]); linear_io.cpp:
// F.linear with it in one call (x of any float dtype, the bias added in float32, x's dtype back).
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w);
torch::Tensor dense_linear_io(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
// attention.cpp: softmax(q k^T scale + mask) v for one query token per head (q [B, H, 1, D]) over
// k [B, Hk, L, D], v [B, Hk, L, Dv] (grouped-query heads read their KV head), as [B, 1, H, Dv].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               double scale);
// bandwidth.cpp: the XOR of a uint8 buffer's 8-byte words, read once over aten's threads (the
// benchmark's read-bandwidth probe).
int64_t read_xor(torch::Tensor buf);

// int8_int4.cpp: Int4Tensor with integer (int8 or int4) activation codes, F.linear in one call.
torch::Tensor int8_int4_linear_io(torch::Tensor codes, torch::Tensor act_scale, torch::Tensor packed,
                                  torch::Tensor scale_zero, int64_t group_size, int64_t k,
                                  c10::optional<torch::Tensor> bias, torch::ScalarType dtype);

// int4dq.cpp: Int4DQTensor on the pairs layout.
torch::Tensor int4dq_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams, torch::Tensor rparams,
                            torch::Tensor tparams, int64_t group_size, int64_t gemv_max_rows, bool int16_activations);
torch::Tensor int4dq_cpu_rows(torch::Tensor rparams, torch::Tensor tparams);
torch::Tensor int4dq_dequantize(torch::Tensor packed, torch::Tensor gparams, torch::Tensor rparams,
                                torch::Tensor tparams, int64_t group_size, int64_t k, torch::ScalarType dtype);

// int4dq_search.cpp: Int4DQTensor's (and IntxDQTensor's) quantize-time helpers.
torch::Tensor int4dq_row_params(torch::Tensor rparams, torch::Tensor tparams);
std::vector<torch::Tensor> int4dq_search(torch::Tensor x, torch::Tensor a0, torch::Tensor b0, torch::Tensor rows,
                                         int64_t g, int64_t k, int64_t levels);

// int8.cpp
// int16_activations: at most gemv_max_rows rows meet the codes as int16 codes (x came in half
// precision: int8.cpp's int8_code_gemv), else float32 compute.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t gemv_max_rows,
                          bool int16_activations);
torch::Tensor int8_dequantize(torch::Tensor q, torch::Tensor scale, torch::ScalarType dtype);

// fp8.cpp
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor row_scale, int64_t shift);
torch::Tensor fp8_dequant_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, int64_t shift);
torch::Tensor fp8_dequantize(torch::Tensor codes, torch::Tensor scale, int64_t shift, torch::ScalarType dtype);

// mx.cpp: MXTensor (e2m1 / e4m3 / e5m2 elements), weight-only or with MX activations, F.linear
// in one call. mx_quant.cpp: MX quantization and dequantization as tensors/mx.py's, bit for bit.
torch::Tensor mx_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale, int64_t kind, int64_t k,
                           c10::optional<torch::Tensor> bias, int64_t act_kind);
std::vector<torch::Tensor> mx_quantize_rows(torch::Tensor x, int64_t kind);
torch::Tensor mx_fake_quantize(torch::Tensor x, int64_t kind);
torch::Tensor mx_dequantize(torch::Tensor qdata, torch::Tensor scale, int64_t kind, int64_t k, torch::ScalarType dtype);

// nvfp4.cpp: NVFP4Tensor, weight-only or with NVFP4 activations, F.linear in one call.
// nvfp4_quant.cpp: NVFP4 quantization and dequantization as tensors/nvfp4.py's, bit for bit.
torch::Tensor nvfp4_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale,
                              torch::Tensor per_tensor_scale, int64_t k, c10::optional<torch::Tensor> bias,
                              bool act_quant);
std::vector<torch::Tensor> nvfp4_quantize_rows(torch::Tensor x, torch::Tensor per_tensor_scale);
torch::Tensor nvfp4_fake_quantize(torch::Tensor x);
torch::Tensor nvfp4_dequantize(torch::Tensor qdata, torch::Tensor scale, torch::Tensor per_tensor_scale, int64_t k,
                               torch::ScalarType dtype);
// fp8_sparse.cpp: Float8SemiSparseTensor (2:4 sparse e4m3), F.linear in one call at few rows.
torch::Tensor fp8_sparse_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor positions, torch::Tensor scale,
                                   int64_t k, c10::optional<torch::Tensor> bias);
torch::Tensor fp8_sparse_dequantize(torch::Tensor qdata, torch::Tensor positions, torch::Tensor scale, int64_t k,
                                    torch::ScalarType dtype);

// intx.cpp: IntxTensor (1-8 bit codes, canonical bit streams), F.linear in one call.
torch::Tensor intx_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale, c10::optional<torch::Tensor> zero,
                             int64_t bits, int64_t group_size, int64_t k, c10::optional<torch::Tensor> bias,
                             int64_t gemv_max_rows, bool int8_activations);
torch::Tensor intx_dequantize(torch::Tensor qdata, torch::Tensor scale, c10::optional<torch::Tensor> zero, int64_t bits,
                              int64_t group_size, int64_t k, torch::ScalarType dtype);
// intx.cpp: IntxDQTensor (2-3 bit codes on Int4DQ's group grid), weight-only F.linear and dequantize.
torch::Tensor intxdq_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor gparams, torch::Tensor rparams,
                               torch::Tensor tparams, int64_t bits, int64_t group_size, int64_t k,
                               c10::optional<torch::Tensor> bias, int64_t gemv_max_rows);
torch::Tensor intxdq_dequantize(torch::Tensor qdata, torch::Tensor gparams, torch::Tensor rparams, torch::Tensor tparams,
                                int64_t bits, int64_t group_size, int64_t k, torch::ScalarType dtype);

// fpx.cpp: FPxTensor (sub-byte floats, canonical bit streams, a scale per row), F.linear in one call.
torch::Tensor fpx_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale, int64_t ebits, int64_t mbits,
                            int64_t k, c10::optional<torch::Tensor> bias, int64_t gemv_max_rows);
torch::Tensor fpx_dequantize(torch::Tensor qdata, torch::Tensor scale, int64_t ebits, int64_t mbits, int64_t k,
                             torch::ScalarType dtype);

// linear_io.cpp: F.linear(x, weight, bias) per format in one call.
torch::Tensor int4pack_linear_io(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size,
                                 int64_t k, c10::optional<torch::Tensor> bias, int64_t gemv_max_rows);
torch::Tensor int4dq_linear_io(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams, torch::Tensor rparams,
                               torch::Tensor tparams, int64_t group_size, int64_t k, c10::optional<torch::Tensor> bias,
                               int64_t gemv_max_rows);
torch::Tensor int8_linear_io(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                             int64_t gemv_max_rows);
torch::Tensor int8dyn_linear_io(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                                int64_t gemv_max_rows);
torch::Tensor fp8_linear_io(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, int64_t shift,
                            c10::optional<torch::Tensor> bias, int64_t gemv_max_rows);

// dispatch.cpp: the opaque ops' CPU kernels registered with torch's dispatcher.
bool register_cpu_kernels();
