// Whether the *_amx_linear kernels (amx_gemm.h, instantiated in each format's source) can run in
// this process: built into this binary (the avx512 build, a compiler with AMX intrinsics) and the
// tile state granted by Linux.
#include "amx_gemm.h"
#include "hf_aoq_cpu.h"

bool amx_available() { return amx_usable(); }
