// baton's decode layer stack (CPU; float32 activations and residual stream, float32, bfloat16 or
// GGUF-block weights), compiled on first use by baton.kernels.loader.
//
// decode_layers runs every decoder layer of a Llama-block model (RMSNorm, q/k/v projections,
// rotary, paged K/V write, paged decode attention, o_proj + residual, RMSNorm, gate/up, SiLU * up,
// down + residual) and the final norm for a decode-only step (one query token per request), in
// ONE call: a decode step through the model's Python modules costs ~0.4 ms of op dispatch per
// layer, which at batch 1 is more than the layer's matmuls. Up to the kernels' row limits (every
// decode step of up to 16 requests) the whole stack, and the LM head when given, runs in one
// OpenMP region on the kernels' row-range code (row_kernels.h; see one_region below). Above them
// the linears and the attention are the other baton ops (linear_small, linear_q, linear_q8a,
// linear_q_tiles, paged_write, paged_decode) called through the dispatcher, each parallelising
// itself; boxed calls, so that only the ops' schemas are relied upon.
//
// `part` (batch-invariant mode under tensor parallelism): one layer's attention or MLP half at a
// time, returning the rank's o_proj / down_proj partial sum for the caller to add across ranks in
// a fixed order (FastDecode's sharded path), or the final norm alone.
//
// Elementwise steps are compiled without FMA contraction, so that they round as transformers'
// separate torch ops do (rotary: q * cos + rotate_half(q) * sin is bit-identical).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "row_kernels.h"

// bfloat16 linears on AMX tiles through oneDNN's brgemm micro-kernel (at::native::cpublas, as
// torch's own CPU flash attention uses it): built only where the OS grants AMX (the loader adds
// -mno-amx-* elsewhere), used only where oneDNN packs bf16 for it at run time.
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BATON_BF16_TILES 1
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Linears per layer, in this order, in the weights / biases / qtypes / q8a lists.
enum Linear : int64_t { Q, K, V, O, GATE, UP, DOWN, PER_LAYER };

// qtypes: a GGUF block type (>= 0), float32 weights [N, K], or bfloat16 weights [N, K] (a
// bfloat16 model: oneDNN's brgemm on AMX tiles in the one region where they come packed
// (pack_bf16_tiles), else at::linear op by op; the row kernels do not read them).
constexpr int64_t FLOAT32_WEIGHTS = -1, BF16_WEIGHTS = -2;
// Output columns per packed block of bfloat16 weights (pack_bf16_tiles): [K / 2, 64, 2], oneDNN's
// VNNI layout, one brgemm call per block.
constexpr int64_t BF16_BLOCK = 64;

bool bf16_tiles() {
#ifdef BATON_BF16_TILES
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;
#endif
}

// w [N, K] bfloat16 -> [ceil(N / 64), K * 64]: each block of 64 output rows transposed and packed
// for brgemm (the last block padded with zero rows).
at::Tensor pack_bf16_tiles(const at::Tensor& w) {
  TORCH_CHECK(bf16_tiles(), "pack_bf16_tiles: this build or CPU has no bfloat16 AMX tiles (bf16_tiles())");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
              "pack_bf16_tiles: weights must be bfloat16 [N, K] with K even, got ", w.scalar_type(), " ",
              w.sizes());
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + BF16_BLOCK - 1) / BF16_BLOCK;
  at::Tensor out = at::empty({blocks, K * BF16_BLOCK}, w.options());
#ifdef BATON_BF16_TILES
  at::Tensor wc = w.contiguous();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t rows = std::min(BF16_BLOCK, N - b * BF16_BLOCK);
    at::Tensor blk = at::zeros({K, BF16_BLOCK}, w.options());  // [K, 64]: brgemm's B, row-major
    blk.narrow(1, 0, rows).copy_(wc.narrow(0, b * BF16_BLOCK, rows).t());
    at::native::cpublas::pack(K, BF16_BLOCK, BF16_BLOCK, BF16_BLOCK, at::kBFloat16, at::kBFloat16, blk.data_ptr(),
                              out[b].data_ptr());
  }
#endif
  return out;
}

// x [M, K] float32 rounded to bfloat16 (nearest even), the A of a brgemm, made once per input.
struct Bf16X {
  std::vector<at::BFloat16> data;
  uint64_t gen = ~uint64_t{0};
};

// A float buffer kept from call to call that only grows (never zeroed): the one region's
// buffers, so that their pages are faulted in once, not every step. In a virtual machine a first
// touch costs far more than the page's zeroing (AMD Zen 4 guest, workload.json exact: 3.2% of
// the run's samples in clear_page_erms, three quarters of the faults in these buffers).
struct Scratch {
  std::unique_ptr<float[]> data;
  int64_t size = 0;
  float* get(int64_t n) {
    if (n > size) {  // at least doubled: a step of one row more must not fault in a new buffer
      size = std::max(n, 2 * size);
      data.reset(new float[size]);
    }
    return data.get();
  }
};

// What each thread of the one region keeps from call to call (Scratch); its preparations
// invalidated at the start of every call (their gen counts from 0 in each).
struct ThreadBuffers {
  Scratch x;
  std::vector<float> scores, qbuf;
  baton_rows::QuantX prep;
  Bf16X xb;
};

c10::OperatorHandle find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// The dispatcher handles, looked up once (linear_q8a lazily: it may not exist).
struct Ops {
  c10::OperatorHandle linear_small = find_op("baton::linear_small");
  c10::OperatorHandle linear_q = find_op("baton::linear_q");
  c10::OperatorHandle linear_q_tiles = find_op("baton::linear_q_tiles");
  c10::OperatorHandle paged_write = find_op("baton::paged_write");
  c10::OperatorHandle paged_decode = find_op("baton::paged_decode");
  std::optional<c10::OperatorHandle> linear_q8a, linear_q8p, linear_qp, linear_qp_tiles;
};

Ops& ops() {
  static Ops o;
  return o;
}

const c10::OperatorHandle& q8a_op() {
  Ops& o = ops();
  if (!o.linear_q8a) o.linear_q8a = find_op("baton::linear_q8a");
  return *o.linear_q8a;
}

// The linear over pack_q8p's rows: linear_q8p (int8 activations) or linear_qp (exact) for
// decode-sized calls, linear_qp_tiles for more rows.
const c10::OperatorHandle& packed_op(bool q8a, bool tiles) {
  Ops& o = ops();
  std::optional<c10::OperatorHandle>& h = tiles ? o.linear_qp_tiles : q8a ? o.linear_q8p : o.linear_qp;
  if (!h) h = find_op(tiles ? "baton::linear_qp_tiles" : q8a ? "baton::linear_q8p" : "baton::linear_qp");
  return *h;
}

// Output rows of a linear: w's, or where w's rows are packed (pack_q8p: 16 rows a tile), packed's.
// A layer whose GGUF rows were dropped for their packed copy passes the packed tensor as w too.
int64_t out_rows(const at::Tensor& w, int64_t qtype, const at::Tensor& packed) {
  return packed.defined() && qtype >= 0 ? packed.size(0) * 16 : w.size(0);
}

// y[:, n0:n1] += b[n0:n1] for y [M, N].
__attribute__((optimize("fp-contract=off"))) void add_bias_cols(float* y, const float* b, int64_t M, int64_t N,
                                                                  int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * N + n] += b[n];
}

struct LinearArgs {
  // rows up to which quantized (ggml rows), packed (pack_q8p) and float32 linears run the
  // decode-sized kernels, as the modules' forward decides (QuantLinear.max_kernel_rows)
  int64_t quant_max_rows, float_max_rows, packed_max_rows;
};

// Rows up to which a linear runs its decode-sized kernel (more: the tiled GEMM), as its module's
// forward decides: packed rows up to packed_max_rows (QuantLinear.max_kernel_rows: one limit for
// every packed linear of a model, whose linears share one activation mode).
int64_t row_limit(const LinearArgs& la, int64_t qtype, bool packed) {
  if (qtype == FLOAT32_WEIGHTS) return la.float_max_rows;
  return packed ? la.packed_max_rows : la.quant_max_rows;
}

// y = x @ W.T + b as the layer's module computes it for x's row count (QuantLinear.forward or
// SmallBatchLinear.forward): the same op, so the same summation order. `buf`: the float path's
// output, reused by the same linear of every layer (each is consumed before the next layer).
// `packed` (defined: the linear's weights repacked by pack_q8p) runs decode-sized calls through
// linear_q8p (q8a) or linear_qp, as QuantLinear.forward does, and more rows through
// linear_qp_tiles (linear_q_tiles' bits on the same rows).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t qtype, bool q8a,
                  const LinearArgs& la, at::Tensor& buf, const at::Tensor& packed = at::Tensor()) {
  const int64_t M = x.size(0);
  const bool has_bias = b.defined() && b.numel() > 0;
  if (qtype == BF16_WEIGHTS) {  // bfloat16 in, float32 accumulators, bfloat16 out; the bias in float32
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "decode_layers: a linear of qtype ", BF16_WEIGHTS,
                " needs bfloat16 weights, got ", w.scalar_type());
    at::Tensor y = at::linear(x.to(at::kBFloat16), w).to(at::kFloat);  // x.to: no copy when x is bfloat16
    if (has_bias) add_bias_cols(y.data_ptr<float>(), b.data_ptr<float>(), M, w.size(0), 0, w.size(0));
    return y;
  }
  const bool tiled = M > row_limit(la, qtype, packed.defined());  // past the decode-sized kernel
  if (qtype == FLOAT32_WEIGHTS) {  // float32 weights [N, K]
    if (tiled) return at::linear(x, w, has_bias ? std::optional<at::Tensor>(b) : std::nullopt);
    if (!buf.defined() || buf.size(1) != w.size(0)) buf = at::empty({M, w.size(0)}, x.options());
    at::Tensor& y = buf;
    std::vector<c10::IValue> stack{x, w, y};
    ops().linear_small.callBoxed(&stack);
    if (has_bias) add_bias_cols(y.data_ptr<float>(), b.data_ptr<float>(), M, w.size(0), 0, w.size(0));
    return y;
  }
  if (packed.defined()) {
    std::vector<c10::IValue> stack{x, packed, qtype, has_bias ? c10::IValue(b) : c10::IValue()};
    packed_op(q8a, tiled).callBoxed(&stack);
    return stack[0].toTensor();
  }
  const bool plain = !tiled && !q8a;  // linear_q: one argument more (invariant)
  const c10::OperatorHandle& op = tiled ? ops().linear_q_tiles : (q8a ? q8a_op() : ops().linear_q);
  std::vector<c10::IValue> stack{x, w, qtype, has_bias ? c10::IValue(b) : c10::IValue()};
  if (plain) stack.emplace_back(false);
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// LlamaRMSNorm: x * rsqrt(mean(x^2) + eps), then weight * that (two roundings, as in torch).
__attribute__((optimize("fp-contract=off"))) void rms_norm(const float* x, const float* w, float* y, int64_t M,
                                                            int64_t N, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * N;
    double ss = 0.0;  // torch's mean reduces in a tree; a double sum is as close to exact
    for (int64_t n = 0; n < N; ++n) ss += static_cast<double>(xr[n]) * xr[n];
    const float var = static_cast<float>(ss / static_cast<double>(N));
    const float r = 1.0f / std::sqrt(var + eps);
    float* yr = y + m * N;
    for (int64_t n = 0; n < N; ++n) yr[n] = w[n] * (xr[n] * r);
  }
}

// q * cos + rotate_half(q) * sin over [M, heads, D] rows with row stride `rs`, in place;
// cos/sin [M, D]. rotate_half(q) = cat(-q[D/2:], q[:D/2]).
__attribute__((optimize("fp-contract=off"))) void rotary(float* q, int64_t M, int64_t heads, int64_t D, int64_t rs,
                                                          const float* cos, const float* sin) {
  const int64_t h2 = D / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* c = cos + m * D;
    const float* s = sin + m * D;
    for (int64_t h = 0; h < heads; ++h) {
      float* r = q + m * rs + h * D;
      for (int64_t i = 0; i < h2; ++i) {
        const float a = r[i], b = r[i + h2];
        r[i] = a * c[i] + (-b) * s[i];
        r[i + h2] = b * c[i + h2] + a * s[i + h2];
      }
    }
  }
}

// silu_mul's exp(-g) in vectors: libm's expf is a call per element (a third of silu_mul's time
// and 3-4% of a prefill). In double precision, x = n + f (n = round(x log2 e), |f| <= 1/2), 2^f by
// its Taylor series to degree 11 (relative error < 1e-14), 2^n into the exponent bits, then
// rounded to float: correctly rounded but where the exact value lies within ~1e-14 of a rounding
// midpoint, as libm's (within 0.502 ulp) nearly always is. Every element runs this same code,
// the tail of a row through a padded vector, so a value never depends on where it falls.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define BATON_SILU_SIMD 1
constexpr double LN2 = 0.6931471805599453, LOG2E = 1.4426950408889634;
constexpr double ROUND_MAGIC = 6755399441055744.0;  // 1.5 * 2^52: x + it rounds x to an integer
constexpr int EXP2_DEGREE = 11;
// ln(2)^k / k!, the Taylor coefficients of 2^f
constexpr std::array<double, EXP2_DEGREE + 1> exp2_taylor() {
  std::array<double, EXP2_DEGREE + 1> c{};
  c[0] = 1.0;
  for (int k = 1; k <= EXP2_DEGREE; ++k) c[k] = c[k - 1] * LN2 / k;
  return c;
}
constexpr auto EXP2_C = exp2_taylor();
#endif

// Doubles at the build's vector width, the operations exp_pd needs.
#if defined(__AVX512F__)
struct SiluD {
  using V = __m512d;
  static V set1(double v) { return _mm512_set1_pd(v); }
  static V min(V a, V b) { return _mm512_min_pd(a, b); }
  static V max(V a, V b) { return _mm512_max_pd(a, b); }
  static V add(V a, V b) { return _mm512_add_pd(a, b); }
  static V sub(V a, V b) { return _mm512_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm512_mul_pd(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  // 2^n for kd = n + ROUND_MAGIC (n in kd's low mantissa bits), n + 1023 into the exponent bits
  static V pow2(V kd) {
    const __m512i n = _mm512_sub_epi64(_mm512_castpd_si512(kd), _mm512_castpd_si512(set1(ROUND_MAGIC)));
    return _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(n, _mm512_set1_epi64(1023)), 52));
  }
};
#elif defined(BATON_SILU_SIMD)
struct SiluD {
  using V = __m256d;
  static V set1(double v) { return _mm256_set1_pd(v); }
  static V min(V a, V b) { return _mm256_min_pd(a, b); }
  static V max(V a, V b) { return _mm256_max_pd(a, b); }
  static V add(V a, V b) { return _mm256_add_pd(a, b); }
  static V sub(V a, V b) { return _mm256_sub_pd(a, b); }
  static V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static V pow2(V kd) {
    const __m256i n = _mm256_sub_epi64(_mm256_castpd_si256(kd), _mm256_castpd_si256(set1(ROUND_MAGIC)));
    return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(n, _mm256_set1_epi64x(1023)), 52));
  }
};
#endif

#if defined(BATON_SILU_SIMD)
// exp of a vector of doubles, clamped to [-150, 150] (float's range and past it: 0 and inf once
// rounded to float)
inline SiluD::V exp_pd(SiluD::V x) {
  using D = SiluD;
  x = D::min(D::max(x, D::set1(-150.0)), D::set1(150.0));
  const D::V t = D::mul(x, D::set1(LOG2E));
  const D::V kd = D::add(t, D::set1(ROUND_MAGIC));
  const D::V f = D::sub(t, D::sub(kd, D::set1(ROUND_MAGIC)));
  D::V p = D::set1(EXP2_C[EXP2_DEGREE]);
  for (int k = EXP2_DEGREE - 1; k >= 0; --k) p = D::fmadd(p, f, D::set1(EXP2_C[k]));
  return D::mul(p, D::pow2(kd));
}
#endif

// One step of silu_mul: W floats of gate and up, as two vectors of doubles for the exp.
#if defined(__AVX512F__)
struct SiluSimd {
  static constexpr int64_t W = 16;
  static void step(float* g, const float* u) {
    const __m512 gv = _mm512_loadu_ps(g);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(gv));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(gv), 1)));
    const __m256 elo = _mm512_cvtpd_ps(exp_pd(_mm512_sub_pd(_mm512_setzero_pd(), lo)));
    const __m256 ehi = _mm512_cvtpd_ps(exp_pd(_mm512_sub_pd(_mm512_setzero_pd(), hi)));
    const __m512 e = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(elo)), _mm256_castps_pd(ehi), 1));
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(g, _mm512_mul_ps(s, _mm512_loadu_ps(u)));
  }
};
#elif defined(BATON_SILU_SIMD)
struct SiluSimd {
  static constexpr int64_t W = 8;
  static void step(float* g, const float* u) {
    const __m256 gv = _mm256_loadu_ps(g);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(gv));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(gv, 1));
    const __m128 elo = _mm256_cvtpd_ps(exp_pd(_mm256_sub_pd(_mm256_setzero_pd(), lo)));
    const __m128 ehi = _mm256_cvtpd_ps(exp_pd(_mm256_sub_pd(_mm256_setzero_pd(), hi)));
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_set_m128(ehi, elo)));
    _mm256_storeu_ps(g, _mm256_mul_ps(s, _mm256_loadu_ps(u)));
  }
};
#endif

// gate <- silu(gate) * up; silu(x) = x / (1 + exp(-x)) as torch computes it.
__attribute__((optimize("fp-contract=off"))) void silu_mul(float* g, const float* u, int64_t n) {
#if defined(BATON_SILU_SIMD)
  constexpr int64_t W = SiluSimd::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) SiluSimd::step(g + i, u + i);
  if (i < n) {
    float gt[W] = {}, ut[W] = {};
    std::memcpy(gt, g + i, (n - i) * sizeof(float));
    std::memcpy(ut, u + i, (n - i) * sizeof(float));
    SiluSimd::step(gt, ut);
    std::memcpy(g + i, gt, (n - i) * sizeof(float));
  }
#else
  for (int64_t i = 0; i < n; ++i) g[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
#endif
}

__attribute__((optimize("fp-contract=off"))) void add_into(float* h, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = h[i] + y[i];
}

// ------------------------------------------------------------------ one parallel region
//
// Up to a few rows (decode-sized calls of every linear), the whole stack runs in ONE OpenMP region:
// each thread takes its share of every phase (rows of the fused q/k/v, (request, kv head) pairs of
// the attention, rows of o, of gate/up with SiLU, of down, of the LM head) and the threads meet at
// a barrier between phases: five per layer, against ~9 fork/joins and dispatcher calls per layer
// otherwise, and the attention of one request is spread over its kv heads. Each output element is
// computed by the same code as in the operators (row_kernels.h), so the result does not depend on
// the split or the thread count.

using baton_rows::CacheDims;
using baton_rows::CacheType;
using baton_rows::QuantX;

struct Lin {
  const float* wf = nullptr;    // float32 weights [N, K], or
  const uint8_t* wq = nullptr;  // quantized rows [N, row_bytes]
  int64_t row_bytes = 0, N = 0, K = 0, qtype = -1;
  const float* bias = nullptr;
  bool q8a = false;
  bool packed = false;  // wq is pack_q8p's layout (linear_q8p, or linear_qp without q8a), not ggml's rows
  const at::BFloat16* wb = nullptr;  // bfloat16 weights in pack_bf16_tiles' blocks
};

// `packed` defined: w's rows repacked by pack_q8p, which the linear then reads (packed_rows).
Lin make_lin(const at::Tensor& w, const at::Tensor& b, int64_t qtype, bool q8a, int64_t K, const at::Tensor& packed) {
  Lin l;
  l.N = out_rows(w, qtype, packed);
  l.K = K;
  l.qtype = qtype;
  l.q8a = q8a;
  if (packed.defined() && qtype == BF16_WEIGHTS) {
    l.wb = packed.data_ptr<at::BFloat16>();
  } else if (packed.defined()) {
    l.packed = true;
    l.wq = packed.data_ptr<uint8_t>();
    l.row_bytes = packed.size(1);
  } else if (qtype < 0) {
    l.wf = w.data_ptr<float>();
  } else {
    l.wq = w.data_ptr<uint8_t>();
    l.row_bytes = w.size(1);
  }
  if (b.defined() && b.numel() > 0) l.bias = b.data_ptr<float>();
  return l;
}

// Rows from which the threads of one region share the packed linears' preparation of x (each
// norming and preparing its share of the rows, then a barrier: four more a layer) instead of each
// preparing every row: int8 prefill of 100 rows spent 7.5% of its time in every thread quantizing
// and norming every row (AMD Zen 4, 2 threads); sharing it, its TTFT went 71-95 -> 63-92 ms (min
// of 40, four alternating pairs). At decode sizes that work is a few rows.
constexpr int64_t SHARED_PREP_MIN_ROWS = 32;

// float32 weight bytes per tile of weight rows in batch-invariant mode (a thread's tile stays in
// its L2 while every row of x passes over it: prefill-sized M).
constexpr int64_t INVARIANT_TILE_BYTES = 131072;

// Rows [n0, n1) of y = x @ W^T + b, as the operator for this linear computes them. invariant: the
// quantized rows' batch-invariant sums, and float weights in tiles of rows (the same sums: a tile
// only changes which weight rows run together, never how one output is summed).
void lin_rows(const Lin& l, const float* x, int64_t M, uint64_t gen, QuantX& prep, Bf16X& xb, float* y, int64_t n0,
              int64_t n1, bool invariant) {
  if (n0 >= n1) return;
  if (l.wb != nullptr) {
#ifdef BATON_BF16_TILES
    const int64_t K = l.K;
    if (xb.gen != gen) {  // x as bfloat16, once per input (every linear reading it shares it)
      xb.data.resize(M * K);
      int64_t i = 0;
      for (; i + 16 <= M * K; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb.data.data() + i),
                            reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i))));
      for (; i < M * K; ++i) xb.data[i] = at::BFloat16(x[i]);
      xb.gen = gen;
    }
    // columns [n0, n1) exactly, block by block (a block entered mid-way starts at its column)
    for (int64_t c = n0; c < n1;) {
      const int64_t b = c / BF16_BLOCK, o = c % BF16_BLOCK, w = std::min(BF16_BLOCK - o, n1 - c);
      at::native::cpublas::brgemm(M, w, K, K, BF16_BLOCK, l.N, false, xb.data.data(),
                                  l.wb + b * K * BF16_BLOCK + 2 * o, y + c, true);
      c += w;
    }
    if (l.bias) add_bias_cols(y, l.bias, M, l.N, n0, n1);
#endif
  } else if (l.qtype < 0) {
    const int64_t tile = invariant ? std::max<int64_t>(8, INVARIANT_TILE_BYTES / (4 * l.K) / 8 * 8) : n1 - n0;
    for (int64_t t0 = n0; t0 < n1; t0 += tile)
      baton_rows::float_rows(x, M, l.K, l.wf, y, l.N, t0, std::min(n1, t0 + tile));
    if (l.bias) add_bias_cols(y, l.bias, M, l.N, n0, n1);
  } else if (l.packed) {
    baton_rows::packed_rows(l.qtype, !l.q8a, x, M, l.K, gen, prep, l.wq, l.bias, y, l.N, n0, n1);
  } else {
    baton_rows::quant_rows(l.qtype, l.q8a, x, M, l.K, gen, prep, l.wq, l.row_bytes, l.bias, y, l.N, n0, n1,
                           invariant);
  }
}

// Thread tid's share [lo, hi) of n items split over nt threads, boundaries on multiples of `align`.
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t nt, int64_t tid, int64_t align) {
  const int64_t units = (n + align - 1) / align;
  const int64_t lo = units * tid / nt * align, hi = units * (tid + 1) / nt * align;
  return {std::min(lo, n), std::min(hi, n)};
}

struct Stack {
  int64_t L, M, Hd, H, KVH, D, I, BS;
  const float *cos, *sin;
  float eps, scale;
  const std::vector<const float*>* norms;
  const std::vector<Lin>* lins;
  const std::vector<void*>*k_caches, *v_caches;
  CacheType cache_type;
  const int64_t *slots, *block_table, *ctx_lens;
  int64_t max_blocks;
  float* h;  // [M, Hd] residual stream
  // shared outputs of the phases: q [M, H*D], k and v [M, KVH*D], attn [M, H*D], gate and up [M, I],
  // o / down [M, Hd]
  float *q, *k, *v, *attn, *gate, *up, *tmp;
  float* out;  // [M, Hd] final normed hidden (without a head), or nullptr
  const Lin* head;
  float* logits;  // [M, V] with a head
  // rows read K/V that other rows write this step (one request's drafts being verified): every
  // row's cache write then comes before any row's attention, one more barrier a layer
  bool shared_context;
  // batch-invariant mode (lin_rows): every output summed in an order independent of M
  bool invariant;
  // -1: every layer, then the final norm. p in [0, 2L): only layer p/2's attention (p even) or MLP
  // (p odd), its o_proj / down_proj output written to `out` without the residual add (a tensor-
  // parallel rank's partial sum, added across ranks by the caller); 2L: only the final norm.
  int64_t part;
  // a thread's share of a linear's outputs starts on a multiple of this: 8, or BF16_BLOCK where
  // bfloat16 tiles run (whole packed blocks per thread)
  int64_t align;
  // the packed linears' preparation of x, shared: each thread norms and prepares its share of the
  // rows, against every thread preparing every row (nullptr: each thread for itself; see
  // SHARED_PREP_MIN_ROWS); prep_exact: linear_qp's three pieces, else linear_q8p's int8
  QuantX* shared_prep;
  bool prep_exact;
  float* xn;  // [M, Hd] the normed input where shared_prep is set
  // per layer, the next (request, kv head) pair whose attention a thread takes (take_pairs)
  std::atomic<int64_t>* next_pair;
};

// The next pairs [first, first + count) of n a thread attends, from the layer's shared counter:
// a share of what is left (guided: big early, one pair at the end), so that the threads finish
// together whatever each pair costs. A static split by the keys each pair reads left the thread
// with the decode rows (keys from memory) ~2x the attention of the one with the prompt rows
// (a chunk's keys in cache after its first row): AMD Zen 4, workload.json, exact.
inline std::pair<int64_t, int64_t> take_pairs(std::atomic<int64_t>& next, int64_t n, int64_t nt) {
  int64_t first = next.load(std::memory_order_relaxed);
  for (;;) {
    if (first >= n) return {n, 0};
    const int64_t count = std::max<int64_t>(1, (n - first) / (2 * nt));
    if (next.compare_exchange_weak(first, first + count, std::memory_order_relaxed)) return {first, count};
  }
}

void stack_thread(const Stack& s, int64_t tid, int64_t nt) {
  const int64_t M = s.M, Hd = s.Hd, D = s.D, H = s.H, KVH = s.KVH, G = H / KVH, I = s.I;
  const int64_t QW = H * D, KW = KVH * D;
  const CacheDims cd{H, KVH, D, s.BS};
  thread_local ThreadBuffers buffers;
  float* const x = buffers.x.get(M * Hd);  // this thread's normed input (each thread norms for itself)
  std::vector<float>& scores = buffers.scores;
  std::vector<float>& qbuf = buffers.qbuf;
  QuantX& prep = buffers.prep;
  prep.gen = ~uint64_t{0};
  const bool sp = s.shared_prep != nullptr && nt > 1;
  QuantX& lp = sp ? *s.shared_prep : prep;  // the preparation the layers' linears read
  const float* xin = sp ? s.xn : x;  // their normed input
  const auto [r0, r1] = share(M, nt, tid, 1);  // this thread's rows of a shared preparation
  Bf16X& xb = buffers.xb;
  xb.gen = ~uint64_t{0};
  uint64_t gen = 0;
  const Lin* lins = s.lins->data();
  auto barrier = [nt]() {
    if (nt > 1) {
#pragma omp barrier
    }
  };
  const bool partial = s.part >= 0 && s.part < 2 * s.L;
  // a new input `in` [M, K] of the layers' linears: with a shared preparation this thread's rows
  // of it, then every thread waits for every row
  auto next_input = [&](const float* in, int64_t K) {
    ++gen;
    if (!sp) return;
    baton_rows::packed_prep_rows(s.prep_exact, in, M, K, r0, r1, *s.shared_prep);
    if (tid == 0) baton_rows::packed_prep_done(s.prep_exact, gen, *s.shared_prep);  // read after the barrier
    barrier();
  };
  // the residual stream normed by norm w into the linears' input (this thread's rows of the shared
  // one, or every row into its own)
  auto norm_input = [&](const float* w) {
    if (sp)
      rms_norm(s.h + r0 * Hd, w, s.xn + r0 * Hd, r1 - r0, Hd, s.eps);
    else
      rms_norm(s.h, w, x, M, Hd, s.eps);
    next_input(xin, Hd);
  };
  // the o_proj / down_proj output: added into the residual stream, or (one part) the result
  auto residual = [&](const Lin& lin, const float* in, int64_t K) {
    next_input(in, K);
    const auto [a, b] = share(Hd, nt, tid, s.align);
    lin_rows(lin, in, M, gen, lp, xb, partial ? s.out : s.tmp, a, b, s.invariant);
    if (!partial)
      for (int64_t m = 0; m < M; ++m) add_into(s.h + m * Hd + a, s.tmp + m * Hd + a, b - a);
  };
  for (int64_t l = 0; l < s.L; ++l) {
    const Lin* lw = lins + l * PER_LAYER;
    if (s.part < 0 || s.part == 2 * l) {
      // attention block: this thread's rows of q, k and v (one x, so one preparation of it)
      norm_input((*s.norms)[2 * l]);
      {
        const int64_t nq = lw[Q].N, nk = lw[K].N;
        const auto [a, b] = share(nq + nk + lw[V].N, nt, tid, s.align);
        const int64_t off[3] = {0, nq, nq + nk};
        float* dst[3] = {s.q, s.k, s.v};
        for (int i = 0; i < 3; ++i) {
          const Lin& li = lw[Q + i];
          lin_rows(li, xin, M, gen, lp, xb, dst[i], std::max<int64_t>(a - off[i], 0),
                   std::min<int64_t>(b - off[i], li.N), s.invariant);
        }
      }
      barrier();
      {  // (request, kv head) pairs: rotary, cache write, attention of the head group
        auto write = [&](int64_t u) {
          const int64_t m = u / KVH, j = u % KVH;
          float* q = s.q + m * QW;
          float* k = s.k + m * KW;
          rotary(k + j * D, 1, 1, D, KW, s.cos + m * D, s.sin + m * D);
          rotary(q + j * G * D, 1, G, D, QW, s.cos + m * D, s.sin + m * D);
          baton_rows::write_kv(s.cache_type, k, s.v + m * KW, (*s.k_caches)[l], (*s.v_caches)[l], s.slots[m], cd, j,
                               j + 1);
        };
        auto attend = [&](int64_t u) {
          const int64_t m = u / KVH, j = u % KVH;
          baton_rows::decode_heads(s.cache_type, s.q + m * QW, D, (*s.k_caches)[l], (*s.v_caches)[l],
                                   s.block_table + m * s.max_blocks, s.ctx_lens[m], 0, cd, s.scale, s.attn + m * QW, D,
                                   j, j + 1, scores, qbuf);
        };
        const int64_t pairs = M * KVH;
        if (s.shared_context) {  // every pair's keys written before any pair attends
          const auto [a, b] = share(pairs, nt, tid, 1);
          for (int64_t u = a; u < b; ++u) write(u);
          barrier();
        }
        // each pair on one thread (its bits do not depend on which), taken as the threads free up
        for (auto [u, n] = take_pairs(s.next_pair[l], pairs, nt); n > 0; std::tie(u, n) = take_pairs(s.next_pair[l], pairs, nt))
          for (int64_t e = u + n; u < e; ++u) {
            if (!s.shared_context) write(u);  // a row that reads only its own context: written just before
            attend(u);
          }
      }
      barrier();
      residual(lw[O], s.attn, QW);
      barrier();
    }
    if (s.part >= 0 && s.part != 2 * l + 1) continue;
    // MLP block: this thread's rows of gate and up, then SiLU(gate) * up on them
    norm_input((*s.norms)[2 * l + 1]);
    {
      const auto [a, b] = share(I, nt, tid, s.align);
      lin_rows(lw[GATE], xin, M, gen, lp, xb, s.gate, a, b, s.invariant);
      lin_rows(lw[UP], xin, M, gen, lp, xb, s.up, a, b, s.invariant);
      for (int64_t m = 0; m < M; ++m) silu_mul(s.gate + m * I + a, s.up + m * I + a, b - a);
    }
    barrier();
    residual(lw[DOWN], s.gate, I);
    barrier();
  }
  if (partial) return;
  rms_norm(s.h, (*s.norms)[2 * s.L], x, M, Hd, s.eps);
  if (s.out != nullptr && tid == 0) std::memcpy(s.out, x, M * Hd * sizeof(float));
  if (s.head != nullptr) {
    const auto [a, b] = share(s.head->N, nt, tid, s.align);
    lin_rows(*s.head, x, M, ++gen, prep, xb, s.logits, a, b, s.invariant);
  }
#ifdef BATON_BF16_TILES
  if (xb.gen != ~uint64_t{0}) at::native::cpublas::brgemm_release(true);  // this thread's AMX tile state
#endif
}

// Whether every linear of the stack (and the head) takes its decode-sized kernel at M rows (any M
// when `invariant`: batch-invariant mode runs every step here).
// bfloat16 linears fit with packed tiles (pack_bf16_tiles), at any row count but not batch-invariant.
bool one_region_fits(int64_t M, at::TensorList weights, at::IntArrayRef qtypes, const std::vector<at::Tensor>& packed,
                     const LinearArgs& la, int64_t head_qtype, bool has_head, const at::Tensor& head_packed,
                     bool invariant) {
  int64_t limit = INT64_MAX;  // the least row limit of the linears' kernels (bfloat16 tiles: none)
  auto fits = [&](int64_t qtype, bool tiles) {
    if (qtype == BF16_WEIGHTS) return tiles && !invariant;
    limit = std::min(limit, row_limit(la, qtype, tiles));
    return qtype == FLOAT32_WEIGHTS || (qtype >= 0 && baton_rows::quant_supported(qtype));
  };
  for (size_t i = 0; i < qtypes.size(); ++i)
    if (!weights[i].is_contiguous() || !fits(qtypes[i], packed[i].defined())) return false;
  if (has_head && !fits(head_qtype, head_packed.defined())) return false;
  return invariant || M <= limit;
}

CacheType cache_type_of(const at::Tensor& c) {
  switch (c.scalar_type()) {
    case at::kHalf: return CacheType::F16;
    case at::kBFloat16: return CacheType::BF16;
    case at::kFloat: return CacheType::F32;
    default: TORCH_CHECK(false, "decode_layers: KV cache dtype ", c.scalar_type(), " (float32, float16 or bfloat16)");
  }
  return CacheType::F32;
}

at::Tensor one_region(const at::Tensor& hidden, const float* cp, const float* sp, at::TensorList norms,
                      at::TensorList weights, at::TensorList biases, at::IntArrayRef qtypes, at::IntArrayRef q8a,
                      const std::vector<at::Tensor>& packed, at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
                      const at::Tensor& block_table, const at::Tensor& ctx_lens, int64_t H, int64_t KVH, float eps,
                      float scale, const at::Tensor* head, int64_t head_qtype, bool head_q8a, const at::Tensor& head_packed,
                      const at::Tensor& head_bias,
                      bool shared_context, bool invariant, int64_t part, int64_t align) {
  const int64_t L = static_cast<int64_t>(k_caches.size()), M = hidden.size(0), Hd = hidden.size(1);
  const at::Tensor& v0 = v_caches[0];
  const int64_t D = v0.size(3), BS = v0.size(2), blocks = v0.size(0);
  TORCH_CHECK(D <= 512, "decode_layers: head_dim ", D, " above 512");
  const CacheType ct = cache_type_of(v0);
  std::vector<void*> kc(L), vc(L);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor &k = k_caches[l], &v = v_caches[l];
    TORCH_CHECK(k.scalar_type() == v0.scalar_type() && v.scalar_type() == v0.scalar_type() && k.dim() == 4 &&
                    v.dim() == 4 && k.is_contiguous() && v.is_contiguous() && v.sizes() == v0.sizes() &&
                    k.size(0) == blocks && k.size(1) == KVH && k.size(2) == D && k.size(3) == BS,
                "decode_layers: layer ", l, ": caches must be contiguous K [blocks, ", KVH, ", ", D, ", ", BS,
                "] and V [blocks, ", KVH, ", ", BS, ", ", D, "] of one dtype");
    kc[l] = k.data_ptr();
    vc[l] = v.data_ptr();
  }
  TORCH_CHECK(v0.size(1) == KVH && H % KVH == 0, "decode_layers: ", H, " query heads over ", v0.size(1),
              " cached kv heads (", KVH, " expected)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && block_table.scalar_type() == at::kLong &&
                  block_table.is_contiguous() && ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous(),
              "decode_layers: slots, block_table and ctx_lens must be contiguous int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_table.size(1);
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(sl[m] >= 0 && sl[m] < blocks * BS, "decode_layers: slot ", sl[m], " outside the cache's ",
                blocks * BS);
    TORCH_CHECK(lens[m] >= 1 && lens[m] <= max_blocks * BS, "decode_layers: context length ", lens[m],
                " of request ", m, " outside [1, ", max_blocks * BS, "]");
  }
  std::vector<const float*> nw(norms.size());
  for (size_t i = 0; i < norms.size(); ++i) {
    TORCH_CHECK(norms[i].is_contiguous() && norms[i].numel() == Hd, "decode_layers: norm ", i, " is not [", Hd, "]");
    nw[i] = norms[i].data_ptr<float>();
  }
  const int64_t I = out_rows(weights[GATE], qtypes[GATE], packed[GATE]);
  std::vector<Lin> lins(weights.size());
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < PER_LAYER; ++i) {
      const size_t j = l * PER_LAYER + i;
      const int64_t inputs = i == O ? H * D : (i == DOWN ? I : Hd);
      lins[j] = make_lin(weights[j], biases[j], qtypes[j], q8a[j] != 0, inputs, packed[j]);
    }
  for (int64_t l = 0; l < L; ++l) {
    Lin* lw = lins.data() + l * PER_LAYER;
    TORCH_CHECK(lw[Q].N == H * D && lw[K].N == KVH * D && lw[V].N == KVH * D && lw[O].N == Hd &&
                    lw[GATE].N == I && lw[UP].N == I && lw[DOWN].N == Hd,
                "decode_layers: layer ", l, ": linear widths q/k/v/o/gate/up/down ", lw[Q].N, "/", lw[K].N, "/",
                lw[V].N, "/", lw[O].N, "/", lw[GATE].N, "/", lw[UP].N, "/", lw[DOWN].N, " do not fit ", H,
                " heads, ", KVH, " kv heads of ", D, ", hidden ", Hd, " and intermediate ", I);
    for (int64_t i = 0; i < PER_LAYER; ++i) {
      const Lin& li = lw[i];
      if (li.qtype < 0)
        TORCH_CHECK(weights[l * PER_LAYER + i].size(1) == li.K, "decode_layers: layer ", l, " linear ", i,
                    ": weight has ", weights[l * PER_LAYER + i].size(1), " inputs, expected ", li.K);
      if (li.bias)
        TORCH_CHECK(biases[l * PER_LAYER + i].numel() == li.N, "decode_layers: layer ", l, " linear ", i,
                    ": bias of ", biases[l * PER_LAYER + i].numel(), " for ", li.N, " outputs");
    }
  }
  Lin head_lin;
  at::Tensor logits;
  if (head != nullptr) {
    head_lin = make_lin(*head, head_bias, head_qtype, head_q8a, Hd, head_packed);
    logits = at::empty({M, head_lin.N}, hidden.options());
  }
  // the residual stream, the shared preparation and the phases' outputs: the calling thread's
  // buffers, kept from call to call (Scratch)
  thread_local Scratch h_buf, xn_buf, work_buf;
  thread_local QuantX shared_prep;
  const at::Tensor hc = hidden.contiguous();
  float* const h = h_buf.get(M * Hd);
  std::memcpy(h, hc.data_ptr<float>(), M * Hd * sizeof(float));
  const int64_t QW = H * D, KW = KVH * D;
  // every layer's linears packed for one kind of x (linear_q8p's int8 or linear_qp's three pieces)
  // and enough rows: the threads share x's preparation, each doing its rows
  bool packed_all = !lins.empty();
  const bool prep_exact = packed_all && !lins[0].q8a;
  for (const Lin& l : lins) packed_all = packed_all && l.packed && !l.q8a == prep_exact;
  const bool share_prep = packed_all && M >= SHARED_PREP_MIN_ROWS && at::get_num_threads() > 1;
  float* xn = nullptr;
  if (share_prep) {
    baton_rows::packed_prep_size(prep_exact, M, std::max({Hd, QW, I}), shared_prep);
    xn = xn_buf.get(M * Hd);
  }
  float* const wp = work_buf.get(M * (2 * QW + 2 * KW + 2 * I + Hd));
  const std::unique_ptr<std::atomic<int64_t>[]> next_pair(new std::atomic<int64_t>[L]);
  for (int64_t l = 0; l < L; ++l) next_pair[l].store(0, std::memory_order_relaxed);
  at::Tensor out = head != nullptr ? at::Tensor() : at::empty_like(hc);
  float* q = wp;
  float* k = q + M * QW;
  float* v = k + M * KW;
  float* attn = v + M * KW;
  float* gate = attn + M * QW;
  float* up = gate + M * I;
  float* tmp = up + M * I;
  Stack st{L,
           M,
           Hd,
           H,
           KVH,
           D,
           I,
           BS,
           cp,
           sp,
           eps,
           scale,
           &nw,
           &lins,
           &kc,
           &vc,
           ct,
           sl,
           block_table.data_ptr<int64_t>(),
           lens,
           max_blocks,
           h,
           q,
           k,
           v,
           attn,
           gate,
           up,
           tmp,
           head != nullptr ? nullptr : out.data_ptr<float>(),
           head != nullptr ? &head_lin : nullptr,
           head != nullptr ? logits.data_ptr<float>() : nullptr,
           shared_context,
           invariant,
           part,
           align,
           share_prep ? &shared_prep : nullptr,
           prep_exact,
           xn,
           next_pair.get()};
  at::internal::lazy_init_num_threads();
  const int64_t want = at::get_num_threads();
  if (want <= 1 || at::in_parallel_region()) {
    stack_thread(st, 0, 1);
  } else {
    // no num_threads clause, as in at::parallel_for (GOMP's thread pool, pytorch#32008)
#pragma omp parallel
    {
      const int64_t nt = omp_get_num_threads();
      stack_thread(st, omp_get_thread_num(), nt);
    }
  }
  return head != nullptr ? logits : out;
}

at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList norms, at::TensorList weights, at::TensorList biases,
                         at::IntArrayRef qtypes, at::IntArrayRef q8a, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& ctx_lens,
                         int64_t num_heads, int64_t num_kv_heads, double eps, double scale, int64_t quant_max_rows,
                         int64_t float_max_rows, const std::optional<at::Tensor>& head, int64_t head_qtype,
                         int64_t head_q8a, const std::optional<at::Tensor>& head_bias, bool shared_context,
                         bool invariant, int64_t part, std::optional<at::TensorList> packed_opt,
                         const std::optional<at::Tensor>& head_packed_in, int64_t packed_max_rows) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.dim() == 2,
              "decode_layers: hidden must be float32 [tokens, hidden] on the CPU");
  TORCH_CHECK(L > 0 && static_cast<int64_t>(v_caches.size()) == L,
              "decode_layers: k_caches and v_caches must hold one cache per layer, got ", L, " and ", v_caches.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L + 1,
              "decode_layers: norms must hold 2 per layer and the final one: ", norms.size(), " for ", L, " layers");
  const size_t nl = static_cast<size_t>(PER_LAYER * L);
  TORCH_CHECK(weights.size() == nl && biases.size() == nl && qtypes.size() == nl && q8a.size() == nl,
              "decode_layers: weights, biases, qtypes and q8a must hold ", PER_LAYER, " entries per layer (", nl,
              "), got ", weights.size(), ", ", biases.size(), ", ", qtypes.size(), ", ", q8a.size());
  const at::TensorList packed_in = packed_opt.value_or(at::TensorList());
  TORCH_CHECK(packed_in.empty() || packed_in.size() == nl, "decode_layers: packed must be empty or hold ", nl,
              " entries (an empty tensor for a linear that is not packed), got ", packed_in.size());
  // a linear's pack_q8p layout (undefined: none), used where its q8a flag is set
  std::vector<at::Tensor> packed(nl);
  bool tiles = false;  // any linear on bfloat16 tiles
  auto check_tiles = [&](const at::Tensor& p, const at::Tensor& w, const char* what) {
    TORCH_CHECK(bf16_tiles() && p.scalar_type() == at::kBFloat16 && p.dim() == 2 && w.dim() == 2 &&
                    p.size(0) == (w.size(0) + BF16_BLOCK - 1) / BF16_BLOCK && p.size(1) == w.size(1) * BF16_BLOCK,
                "decode_layers: ", what, ": packed bfloat16 weights must be pack_bf16_tiles(weight) of this "
                "build (bf16_tiles() is ", bf16_tiles(), ")");
    tiles = true;
    return p.contiguous();
  };
  for (size_t j = 0; j < packed_in.size(); ++j)
    if (qtypes[j] == BF16_WEIGHTS && packed_in[j].numel() > 0) {
      packed[j] = check_tiles(packed_in[j], weights[j], "a linear");
    } else if (qtypes[j] >= 0 && packed_in[j].numel() > 0) {  // pack_q8p's rows: linear_q8p, or linear_qp (exact)
      TORCH_CHECK(baton_rows::packed_supported(qtypes[j]), "decode_layers: linear ", j, " is packed in qtype ",
                  qtypes[j], ", which linear_q8p / linear_qp do not read here");
      packed[j] = packed_in[j].contiguous();
    }
  const bool head_given = head.has_value() && head->defined() && head_packed_in.has_value() &&
                          head_packed_in->numel() > 0;
  const at::Tensor head_packed = !head_given ? at::Tensor()
                                 : head_qtype == BF16_WEIGHTS ? check_tiles(*head_packed_in, *head, "the head")
                                 : head_qtype >= 0            ? head_packed_in->contiguous()
                                                              : at::Tensor();
  const int64_t M = hidden.size(0), Hd = hidden.size(1);
  const int64_t D = v_caches[0].size(3), H = num_heads, KVH = num_kv_heads;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == M * D && sin.numel() == M * D,
              "decode_layers: cos and sin must be contiguous float32 [tokens, head_dim=", D, "]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == M && ctx_lens.numel() == M && slots.numel() == M,
              "decode_layers: one query token per request: block_table [", M, ", blocks], ctx_lens and slots [", M,
              "]");
  const LinearArgs la{quant_max_rows, float_max_rows, packed_max_rows < 0 ? quant_max_rows : packed_max_rows};
  const float feps = static_cast<float>(eps);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const bool has_head = head.has_value() && head->defined();
  const at::Tensor no_bias;
  const at::Tensor& hb = head_bias.has_value() ? *head_bias : no_bias;
  if (has_head)
    TORCH_CHECK(head->dim() == 2 && (head_qtype >= 0 ? head->scalar_type() == at::kByte : head->size(1) == Hd),
                "decode_layers: head must be [vocab, hidden] float32 or [vocab, row_bytes] uint8 quantized rows");
  TORCH_CHECK(part < 0 || (invariant && !has_head && part <= 2 * L), "decode_layers: part ", part,
              " needs invariant=True, no head and a part in [0, ", 2 * L, "]");
  const bool one =
      one_region_fits(M, weights, qtypes, packed, la, head_qtype, has_head, head_packed, invariant);
  TORCH_CHECK(one || !invariant,
              "decode_layers: invariant=True needs contiguous weights in formats the row kernels read (float32, "
              "Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; not bfloat16)");
  if (one)
    return one_region(hidden, cp, sp, norms, weights, biases, qtypes, q8a, packed, k_caches, v_caches, slots,
                      block_table, ctx_lens, H, KVH, feps, static_cast<float>(scale), has_head ? &*head : nullptr,
                      head_qtype, head_q8a != 0, head_packed, hb, shared_context, invariant, part,
                      tiles ? BF16_BLOCK : 8);

  at::Tensor h = hidden.contiguous().clone();  // the residual stream
  at::Tensor x = at::empty_like(h);            // normed input of the attention / MLP
  at::Tensor attn = at::empty({M, H, D}, h.options());
  at::Tensor attn2 = attn.view({M, H * D});
  float* hp = h.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  at::Tensor bufs[PER_LAYER];

  // elementwise steps over rows on every thread (each row's result is the same whatever the split)
  auto norm_rows = [&](const at::Tensor& w) {
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
      rms_norm(hp + m0 * Hd, wp, xp + m0 * Hd, m1 - m0, Hd, feps);
    });
  };
  at::Tensor xb;  // x in bfloat16, made once per norm when a bfloat16 linear reads it
  for (int64_t l = 0; l < L; ++l) {
    const int64_t w0 = l * PER_LAYER;
    auto lin = [&](const at::Tensor& in, Linear i) {
      return linear(in, weights[w0 + i], biases[w0 + i], qtypes[w0 + i], q8a[w0 + i] != 0, la, bufs[i],
                    packed[w0 + i]);
    };
    auto lin_x = [&](Linear i) {  // a linear of the normed x
      if (qtypes[w0 + i] != BF16_WEIGHTS) return lin(x, i);
      if (!xb.defined()) xb = x.to(at::kBFloat16);
      return lin(xb, i);
    };
    // attention block
    norm_rows(norms[2 * l]);
    xb.reset();
    at::Tensor q = lin_x(Q), k = lin_x(K), v = lin_x(V);
    TORCH_CHECK(q.size(1) == H * D && k.size(1) == KVH * D && v.size(1) == KVH * D,
                "decode_layers: layer ", l, ": q/k/v widths ", q.size(1), "/", k.size(1), "/", v.size(1),
                " do not match ", H, " heads and ", KVH, " KV heads of ", D);
    rotary(q.data_ptr<float>(), M, H, D, H * D, cp, sp);
    rotary(k.data_ptr<float>(), M, KVH, D, KVH * D, cp, sp);
    const at::Tensor& k_cache = k_caches[l];  // [blocks, kv_heads, head_dim, block_size]: keys transposed
    const at::Tensor& v_cache = v_caches[l];  // [blocks, kv_heads, block_size, head_dim]
    {
      std::vector<c10::IValue> stack{k.view({M, KVH, D}), v.view({M, KVH, D}), k_cache, v_cache, slots};
      ops().paged_write.callBoxed(&stack);
    }
    {
      std::vector<c10::IValue> stack{q.view({M, H, D}), k_cache, v_cache, block_table, ctx_lens,
                                     static_cast<int64_t>(0), scale, attn};
      ops().paged_decode.callBoxed(&stack);
    }
    at::Tensor o = lin(attn2, O);
    add_into(hp, o.data_ptr<float>(), M * Hd);
    // MLP block
    norm_rows(norms[2 * l + 1]);
    xb.reset();
    at::Tensor g = lin_x(GATE), u = lin_x(UP);
    TORCH_CHECK(g.sizes() == u.sizes() && g.is_contiguous() && u.is_contiguous(), "decode_layers: layer ", l,
                ": gate and up outputs must be contiguous and of one width, got ", g.sizes(), " and ", u.sizes());
    {
      float* gp = g.data_ptr<float>();
      const float* up = u.data_ptr<float>();
      const int64_t width = g.size(1);
      at::parallel_for(0, M, 2, [&](int64_t m0, int64_t m1) {
        silu_mul(gp + m0 * width, up + m0 * width, (m1 - m0) * width);
      });
    }
    at::Tensor d = lin(g, DOWN);
    add_into(hp, d.data_ptr<float>(), M * Hd);
  }
  at::Tensor out = at::empty_like(h);
  rms_norm(hp, norms[2 * L].data_ptr<float>(), out.data_ptr<float>(), M, Hd, feps);
  if (!has_head) return out;
  at::Tensor head_buf;  // the float path's output buffer: returned as is (nothing else holds it)
  return linear(out, *head, hb, head_qtype, head_q8a != 0, la, head_buf, head_packed);
}

// silu_mul on tensors, in place: gate <- silu(gate) * up (the stacks' MLP step, for tests).
void silu_mul_op(at::Tensor gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.is_contiguous() &&
                  up.is_contiguous() && gate.sizes() == up.sizes(),
              "silu_mul: gate and up must be contiguous float32 tensors of one shape, got ", gate.sizes(), " ",
              gate.scalar_type(), " and ", up.sizes(), " ", up.scalar_type());
  silu_mul(gate.data_ptr<float>(), up.data_ptr<float>(), gate.numel());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("silu_mul(Tensor(a!) gate, Tensor up) -> ()", &silu_mul_op);
  m.def(
      "decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, Tensor[] biases, "
      "int[] qtypes, int[] q8a, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor block_table, Tensor ctx_lens, "
      "int num_heads, int num_kv_heads, float eps, float scale, int quant_max_rows, int float_max_rows, "
      "Tensor? head=None, int head_qtype=-1, int head_q8a=0, Tensor? head_bias=None, bool shared_context=False, "
      "bool invariant=False, int part=-1, Tensor[]? packed=None, Tensor? head_packed=None, "
      "int packed_max_rows=-1) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("bf16_tiles() -> bool", &bf16_tiles);
  m.def("pack_bf16_tiles(Tensor weight) -> Tensor", &pack_bf16_tiles);
}

TORCH_LIBRARY_IMPL(baton, CPU, m) { m.impl("decode_layers", decode_layers); }
