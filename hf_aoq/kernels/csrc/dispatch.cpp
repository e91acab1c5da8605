// The CPU kernels of hf_aoq's opaque ops (kernels/registry.py's OpaqueOp defines each op, its
// fake and its Python kernel), registered with torch's dispatcher once the extension has loaded.
//
// A compiled graph calls each op through the dispatcher, at every quantized linear of every
// token. With only its Python kernel, that is a boxed call into Python and the binding's
// conversions back: a tiny int4 call of the op took 6.7 us, 5.7 us with the kernel registered
// here, 4.0 us through the binding alone (AMD EPYC Zen 4, 2 threads). The Python kernel stays for
// a process that has not loaded the extension yet. Each function here takes the op's schema as
// torch infers it from the Python signature (an `int` is a SymInt) and calls the entry point
// that the Python kernel calls, with the same arguments.
#include <torch/library.h>
#include <torch/types.h>
#include <memory>

#include "hf_aoq_cpu.h"

namespace {

using OptTensor = c10::optional<torch::Tensor>;

torch::Tensor int4_linear_io_cpu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale_zero,
                                 c10::SymInt group_size, c10::SymInt k, const OptTensor& bias, c10::SymInt gemv_max_rows) {
  return int4pack_linear_io(x, packed, scale_zero, group_size.expect_int(), k.expect_int(), bias,
                            gemv_max_rows.expect_int());
}

torch::Tensor int4dq_linear_io_cpu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& gparams,
                                   const torch::Tensor& rparams, const torch::Tensor& tparams, c10::SymInt group_size,
                                   c10::SymInt k, const OptTensor& bias, c10::SymInt gemv_max_rows) {
  return int4dq_linear_io(x, packed, gparams, rparams, tparams, group_size.expect_int(), k.expect_int(), bias,
                          gemv_max_rows.expect_int());
}

torch::Tensor int8_linear_io_cpu(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                                 const OptTensor& bias, c10::SymInt gemv_max_rows) {
  return int8_linear_io(x, q, scale, bias, gemv_max_rows.expect_int());
}

torch::Tensor int8dyn_linear_io_cpu(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                                    const OptTensor& bias, c10::SymInt gemv_max_rows) {
  return int8dyn_linear_io(x, q, scale, bias, gemv_max_rows.expect_int());
}

torch::Tensor int8dyn_vnni_linear_cpu(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                                      const OptTensor& bias, c10::SymInt gemv_max_rows) {
  return int8dyn_vnni_linear(x, q, scale, bias, gemv_max_rows.expect_int());
}

torch::Tensor fp8_linear_io_cpu(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                                c10::SymInt shift, const OptTensor& bias, c10::SymInt gemv_max_rows) {
  return fp8_linear_io(x, codes, scale, shift.expect_int(), bias, gemv_max_rows.expect_int());
}

torch::Tensor fp8_dpbf16_linear_cpu(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                                    c10::SymInt shift, const OptTensor& bias) {
  return fp8_dpbf16_linear(x, codes, scale, shift.expect_int(), bias);
}

torch::Tensor dense_linear_io_cpu(const torch::Tensor& x, const torch::Tensor& weight, const OptTensor& bias) {
  return dense_linear_io(x, weight, bias);
}

torch::Tensor decode_attention_cpu(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                   const OptTensor& mask, double scale) {
  return decode_attention(query, key, value, mask, scale);
}

}  // namespace

// Registers the kernels above (kernels/cpu_ext.py calls it once the ops are defined). On a schema
// that does not match the op's, raises and leaves none registered: the ops keep their Python
// kernels. Registered once per process; a second call returns false.
bool register_cpu_kernels() {
  static std::unique_ptr<torch::Library> registered;
  if (registered) return false;
  auto m = std::make_unique<torch::Library>(torch::Library::IMPL, "hf_aoq", c10::DispatchKey::CPU, __FILE__, __LINE__);
  m->impl("int4_linear_io_cpu", TORCH_FN(int4_linear_io_cpu));
  m->impl("int4dq_linear_io_cpu", TORCH_FN(int4dq_linear_io_cpu));
  m->impl("int8_linear_io_cpu", TORCH_FN(int8_linear_io_cpu));
  m->impl("int8dyn_linear_io_cpu", TORCH_FN(int8dyn_linear_io_cpu));
  m->impl("int8dyn_vnni_linear_cpu", TORCH_FN(int8dyn_vnni_linear_cpu));
  m->impl("fp8_linear_io_cpu", TORCH_FN(fp8_linear_io_cpu));
  m->impl("fp8_dpbf16_linear_cpu", TORCH_FN(fp8_dpbf16_linear_cpu));
  m->impl("dense_linear_io_cpu", TORCH_FN(dense_linear_io_cpu));
  m->impl("decode_attention_cpu", TORCH_FN(decode_attention_cpu));
  registered = std::move(m);
  return true;
}
