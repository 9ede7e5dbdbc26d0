// baton::build_isa(): the instruction-set macros this build of the kernels was compiled with
// (-march=native and $BATON_KERNEL_ISA decide them). The kernels choose their paths from these
// macros at compile time; baton.kernels.report turns the list into the path each kernel takes.
#include <torch/library.h>

#include <string>

namespace {

std::string build_isa() {
  std::string s;
  auto add = [&s](const char* name) {
    if (!s.empty()) s += ' ';
    s += name;
  };
#if defined(__x86_64__)
  add("x86_64");
#endif
#if defined(__aarch64__)
  add("aarch64");
#endif
#if defined(__AVX2__)
  add("avx2");
#endif
#if defined(__FMA__)
  add("fma");
#endif
#if defined(__F16C__)
  add("f16c");
#endif
#if defined(__AVX512F__)
  add("avx512f");
#endif
#if defined(__AVX512VL__)
  add("avx512vl");
#endif
#if defined(__AVX512BW__)
  add("avx512bw");
#endif
#if defined(__AVX512VNNI__)
  add("avx512vnni");
#endif
#if defined(__AVX512BF16__)
  add("avx512bf16");
#endif
#if defined(__AVXVNNI__)
  add("avxvnni");
#endif
#if defined(__AMX_TILE__)
  add("amx_tile");
#endif
#if defined(__AMX_INT8__)
  add("amx_int8");
#endif
#if defined(__AMX_BF16__)
  add("amx_bf16");
#endif
  return s;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) { m.def("build_isa() -> str", &build_isa); }
