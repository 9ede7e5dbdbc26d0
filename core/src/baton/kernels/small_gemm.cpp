// y = x @ w^T for a few rows of x (float32, CPU), compiled on first use by baton.kernels.loader.
//
// Decode steps multiply a handful of rows by every weight matrix: the weights stream from memory
// once per step and MKL's sgemm, built for large M, reaches about half of the memory bandwidth
// there (and packs the weights on every call). Here each thread takes a range of weight rows and
// computes MR x NR tiles with vector accumulators over K, reading every weight row once for up
// to 8 rows of x. Measured on SmolLM2's 30 layers: 1 row 35 -> 17 ms, 8 rows 40 -> 30 ms,
// 32 rows 66 -> 63 ms (docs/benchmarks.md).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "row_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// The vector width follows the ISA the library is compiled for (-march=native): 16 floats in one
// zmm register with AVX-512, 8 in a ymm otherwise. A 16-float vector type without AVX-512 is
// lowered by GCC through the stack (measured on an AVX2 EPYC: 5-14x slower than torch's sgemm).
#if defined(__AVX512F__)
constexpr int VW = 16;
constexpr int REGS = 32;
#else
constexpr int VW = 8;
constexpr int REGS = 16;
#endif
typedef float vec __attribute__((vector_size(VW * sizeof(float))));

// memcpy into an aligned vector: an unaligned load (a vector typedef with aligned(4) makes GCC
// go through the stack).
inline vec loadv(const float* p) { vec v; __builtin_memcpy(&v, p, sizeof(v)); return v; }
// c + a * b, one rounding wherever the build has FMA. Left to GCC, `acc += x * w` was contracted in
// some instantiations of tile and not in others (AVX2 build: tile<1, 1>, the last weight row at
// one row of x, kept the multiply and the add apart), so a row's sums depended on the rows of x
// beside it (tests/core/test_batch_invariant.py, built with BATON_KERNEL_ISA=avx2).
inline vec fmadd(vec a, vec b, vec c) {
#if defined(__AVX512F__)
  return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;  // no FMA instruction: nothing to contract into
#endif
}

inline float fmadd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

inline float hsum(vec v) {
  float s = 0.0f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}

// y[m, n] = x[m, :] . w[n, :] for MR rows of x and NR rows of w; kv = K rounded down to VW.
template <int MR, int NR>
inline void tile(const float* x, int64_t xs, const float* w, int64_t K, float* y, int64_t ys, int64_t kv) {
  vec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = vec{};
  for (int64_t k = 0; k < kv; k += VW) {
    vec wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = loadv(w + r * K + k);
    for (int m = 0; m < MR; ++m) {
      const vec xv = loadv(x + m * xs + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = fmadd(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t k = kv; k < K; ++k) s = fmadd(x[m * xs + k], w[r * K + k], s);
      y[m * ys + r] = s;
    }
}

// Weight rows per tile: as many as keep MR x NR accumulators, NR weights and one x in registers.
template <int MR>
constexpr int pick_nr() {
  for (int nr : {4, 2}) if (MR * nr + nr + 1 <= REGS) return nr;
  return 1;
}

template <int MR>
void rows(const float* x, int64_t xs, const float* w, int64_t K, float* y, int64_t ys, int64_t n0, int64_t n1) {
  constexpr int NR = pick_nr<MR>();
  const int64_t kv = K / VW * VW;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<MR, NR>(x, xs, w + n * K, K, y + n, ys, kv);
  for (; n < n1; ++n) tile<MR, 1>(x, xs, w + n * K, K, y + n, ys, kv);
}

// Rows [n0, n1) of y = x @ w^T for M rows of x: groups of 8 rows of x, then the rest.
void all_rows(const float* xp, int64_t M, int64_t K, const float* wp, float* yp, int64_t N, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) rows<8>(xp + m * K, K, wp, K, yp + m * N, N, n0, n1);
  switch (M - m) {
    case 7: rows<7>(xp + m * K, K, wp, K, yp + m * N, N, n0, n1); break;
    case 6: rows<6>(xp + m * K, K, wp, K, yp + m * N, N, n0, n1); break;
    case 5: rows<5>(xp + m * K, K, wp, K, yp + m * N, N, n0, n1); break;
    case 4: rows<4>(xp + m * K, K, wp, K, yp + m * N, N, n0, n1); break;
    case 3: rows<3>(xp + m * K, K, wp, K, yp + m * N, N, n0, n1); break;
    case 2: rows<2>(xp + m * K, K, wp, K, yp + m * N, N, n0, n1); break;
    case 1: rows<1>(xp + m * K, K, wp, K, yp + m * N, N, n0, n1); break;
  }
}

void linear_small(const at::Tensor& x, const at::Tensor& w, at::Tensor y) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && y.device().is_cpu(), "linear_small: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "linear_small: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && y.dim() == 2 && x.size(1) == w.size(1) && y.size(0) == x.size(0) &&
                  y.size(1) == w.size(0),
              "linear_small: x [M, K], w [N, K], out [M, N]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && y.is_contiguous(), "linear_small: contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { all_rows(xp, M, K, wp, yp, N, n0, n1); });
}

}  // namespace

void baton_rows::float_rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t n0,
                            int64_t n1) {
  all_rows(x, M, K, w, y, N, n0, n1);
}

TORCH_LIBRARY_FRAGMENT(baton, m) { m.def("linear_small(Tensor x, Tensor w, Tensor(a!) out) -> ()"); }

TORCH_LIBRARY_IMPL(baton, CPU, m) { m.impl("linear_small", linear_small); }
