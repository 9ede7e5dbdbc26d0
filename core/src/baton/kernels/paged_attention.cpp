// baton's CPU paged-attention kernels, compiled on first use by baton.kernels.loader.
// Queries, keys/values written and outputs are float32; the cache is float32, float16 or bfloat16
// (cache.dtype), dispatched on the cache tensor's dtype, so the op schemas are the same for all.
//
// Cache layout per layer, as baton.worker.attention allocates it:
//   K: [num_blocks, kv_heads, head_dim, block_size]  (keys transposed within a block)
//   V: [num_blocks, kv_heads, block_size, head_dim]
// Transposed keys make a block's scores vertical FMAs over its tokens (no horizontal sums);
// values stay row-major because the output accumulates whole rows.
//
// paged_decode: one query token per request attends over its blocks, in place (no gather copy):
//   scores for every block, softmax over the request's context, then probabilities x values.
// paged_write: the step's new keys/values into their slots (slot = block * block_size + offset),
//   rounded to the cache dtype to nearest-even (as torch's .to() rounds).
// A float16/bfloat16 cache is read one (block, kv head) tile at a time: converted to float32 into a
// per-thread buffer (F16C's vcvtph2ps for float16, a 16-bit shift for bfloat16; portable bit code
// without F16C/AVX2), which stays in L1 while the G query heads sharing that kv head use it. The
// float32 cache is read in place, as before.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "row_kernels.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define BATON_CVT_AVX2 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// ---------------------------------------------------------------- cache element conversions

enum class Kind { F32, F16, BF16 };
template <Kind K>
using elem_t = std::conditional_t<K == Kind::F32, float, uint16_t>;

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, NaN -> 0x7FC0: c10::BFloat16's rule, so the kernel writes torch's bits.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE half <-> float without F16C (fp16 library's bit code, which c10::Half uses too).
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_f32(sign | (two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized)));
}

inline uint16_t f32_to_f16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// dst[0, n) = src[0, n) as float32
template <Kind K>
inline void to_f32(const elem_t<K>* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  // 16 at a time: a tile's conversion is half of a bfloat16 decode's instructions at 8
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    if constexpr (K == Kind::F16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
    else
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
#endif
#ifdef BATON_CVT_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    if constexpr (K == Kind::F16)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    else
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = K == Kind::F16 ? f16_to_f32(src[i]) : bf16_to_f32(src[i]);
}

// dst[0, n) = src[0, n) rounded to the cache dtype (nearest even)
template <Kind K>
inline void from_f32(const float* __restrict src, elem_t<K>* __restrict dst, int64_t n) {
  int64_t i = 0;
#ifdef BATON_CVT_AVX2
  if constexpr (K == Kind::F16)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i] = K == Kind::F16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
}

// A (block, kv head) tile of n cache elements as float32: in place for a float32 cache, else
// converted into buf; `next` (the tile read after this one, or nullptr) is prefetched meanwhile.
template <Kind K>
inline const float* tile_f32(const elem_t<K>* tile, int64_t n, float* buf, const elem_t<K>* next) {
  if constexpr (K == Kind::F32) {
    return tile;
  } else {
    if (next)
      for (int64_t j = 0; j < n; j += 32) __builtin_prefetch(next + j, 0, 3);  // 32 x 2 bytes: a line
    to_f32<K>(tile, buf, n);
    return buf;
  }
}

// exp for the softmax (std::exp is a libm call per element): exp(x) = 2^n e^r with n = round(x
// log2 e) and |r| <= ln 2 / 2, e^r by Cephes' expf polynomial (relative error < 1e-7 over [-87, 0],
// where softmax evaluates it: x = score - max <= 0). GCC does not vectorise loops over it;
// exp_scores runs the same operations in vectors, and this is its scalar tail.
inline float exp_approx(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.4426950408889634f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts: exact n * hi
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return p * pow2;
}

// The softmax's vector operations at the build's width (max_score, exp_scores); none without
// AVX2 + FMA, where both run their scalar loops.
#if defined(__AVX512F__)
#define BATON_SOFTMAX_SIMD 1
struct SimdF {
  using V = __m512;
  static constexpr int64_t W = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }  // b where either is NaN
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // 2^n for integral n, as exp_approx builds it: (int(n) + 127) << 23 read as a float
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define BATON_SOFTMAX_SIMD 1
struct SimdF {
  using V = __m256;
  static constexpr int64_t W = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V floor(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static float hmax(V v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
};
#endif

// The largest of sg[first, last) (a NaN score is passed over, as std::max(m, x) passes it; -inf
// for an empty range). Any order gives the same value but for the sign of a zero, which
// exp_approx(x - m) does not see.
inline float max_score(const float* sg, int64_t first, int64_t last) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = first;
#ifdef BATON_SOFTMAX_SIMD
  using S = SimdF;
  if (last - t >= S::W) {
    S::V v = S::set1(m);
    for (; t + S::W <= last; t += S::W) v = S::max(S::load(sg + t), v);  // a NaN keeps v
    m = S::hmax(v);
  }
#endif
  for (; t < last; ++t) m = std::max(m, sg[t]);
  return m;
}

// sums[j] = sg[j * span + first] + ... + sg[j * span + last - 1], added in that order from 0 (one
// chain per row, as the softmax always summed), for rows j < n: eight chains in flight, scalar
// (GCC's vectoriser would gather the rows' strided values into vectors, which is slower).
__attribute__((optimize("no-tree-slp-vectorize", "no-tree-loop-vectorize"))) void sum_rows(
    const float* sg, int64_t span, int64_t n, int64_t first, int64_t last, float* sums) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* p = sg + j * span;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f, a4 = 0.f, a5 = 0.f, a6 = 0.f, a7 = 0.f;
    for (int64_t t = first; t < last; ++t) {
      a0 += p[t];
      a1 += p[span + t];
      a2 += p[2 * span + t];
      a3 += p[3 * span + t];
      a4 += p[4 * span + t];
      a5 += p[5 * span + t];
      a6 += p[6 * span + t];
      a7 += p[7 * span + t];
    }
    sums[j] = a0, sums[j + 1] = a1, sums[j + 2] = a2, sums[j + 3] = a3;
    sums[j + 4] = a4, sums[j + 5] = a5, sums[j + 6] = a6, sums[j + 7] = a7;
  }
  for (; j < n; ++j) {
    const float* p = sg + j * span;
    float a = 0.f;
    for (int64_t t = first; t < last; ++t) a += p[t];
    sums[j] = a;
  }
}

// sg[t] = exp_approx(sg[t] - m) over [first, last). GCC leaves exp_approx's loop scalar, so the
// vectors here spell out the operations it compiles to (max with -87, an FMA for x log2 e + 1/2,
// floor, the two-part reduction as FNMA then FMA, Horner's FMAs, r + r (p r) as one FMA, + 1,
// times 2^n): every element gets exp_approx's bits.
inline void exp_scores(float* sg, int64_t first, int64_t last, float m) {
  int64_t t = first;
#ifdef BATON_SOFTMAX_SIMD
  using S = SimdF;
  const S::V mv = S::set1(m), floor_x = S::set1(-87.0f), log2e = S::set1(1.4426950408889634f),
             half = S::set1(0.5f), hi = S::set1(0.693359375f), lo = S::set1(2.12194440e-4f), one = S::set1(1.0f);
  for (; t + S::W <= last; t += S::W) {
    const S::V x = S::max(floor_x, S::sub(S::load(sg + t), mv));  // a NaN stays NaN
    const S::V n = S::floor(S::fmadd(x, log2e, half));
    const S::V r = S::fmadd(n, lo, S::fnmadd(n, hi, x));
    S::V p = S::set1(1.9875691500e-4f);
    p = S::fmadd(p, r, S::set1(1.3981999507e-3f));
    p = S::fmadd(p, r, S::set1(8.3334519073e-3f));
    p = S::fmadd(p, r, S::set1(4.1665795894e-2f));
    p = S::fmadd(p, r, S::set1(1.6666665459e-1f));
    p = S::fmadd(p, r, S::set1(5.0000001201e-1f));
    p = S::add(S::fmadd(r, S::mul(p, r), r), one);
    S::store(sg + t, S::mul(p, S::pow2(n)));
  }
#endif
  for (; t < last; ++t) sg[t] = exp_approx(sg[t] - m);
}

// Scores of one block's tokens for GC query heads sharing one kv head (queries GC rows of qr, DC
// apart; scores GC rows of s, `ss` apart): keys stored [D, BS] (transposed), so every step is a
// vertical FMA over the block's BS tokens. Each score is U chains over d, then (a0 + a1) + (a2 +
// a3), whatever GC: the heads are interleaved so that GC * U chains are in flight (one head's U
// chains wait on an FMA's latency) and each key row is loaded once for all of them.
template <int64_t DC, int64_t BSC, int64_t GC>
inline void group_scores(const float* __restrict qr, const float* __restrict kt, float* __restrict s,
                         int64_t ss, const float* next) {
  constexpr int64_t U = 4;
  static_assert(DC % U == 0, "group_scores: head_dim a multiple of 4");
  float acc[GC][U][BSC] = {};
  for (int64_t d = 0; d < DC; d += U) {
    for (int64_t u = 0; u < U; ++u) {
      if (next) __builtin_prefetch(next + (d + u) * BSC, 0, 3);
      const float* kr = kt + (d + u) * BSC;
      for (int64_t g = 0; g < GC; ++g) {
        const float qd = qr[g * DC + d + u];
#pragma omp simd
        for (int64_t t = 0; t < BSC; ++t) acc[g][u][t] += qd * kr[t];
      }
    }
  }
  for (int64_t g = 0; g < GC; ++g)
#pragma omp simd
    for (int64_t t = 0; t < BSC; ++t) s[g * ss + t] = (acc[g][0][t] + acc[g][1][t]) + (acc[g][2][t] + acc[g][3][t]);
}

// block_scores' sizes known at compile time (DC, BSC; else 0): group_scores for one head.
template <int64_t DC, int64_t BSC>
inline void block_scores(const float* __restrict qr, const float* __restrict kt, float* __restrict s,
                         int64_t D, int64_t BS, const float* next) {
  if constexpr (DC > 0 && BSC > 0) {
    group_scores<DC, BSC, 1>(qr, kt, s, 0, next);
  } else {
    for (int64_t t = 0; t < BS; ++t) s[t] = 0.f;
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = 0; t < BS; ++t) s[t] += qr[d] * kt[d * BS + t];
  }
}

// acc[g, :] += sum over tokens [t0, t1) of p[g, t] * v[t, :] for GC query heads sharing one kv head
// (probabilities GC rows of p, `ps` apart; accumulators GC rows of acc, DC apart): two chains per
// head, consecutive tokens alternating, whatever GC; the value rows loaded once for all the heads.
template <int64_t DC, int64_t GC>
inline void group_values(const float* __restrict p, int64_t ps, const float* __restrict v, int64_t t0, int64_t t1,
                         float* __restrict acc, const float* next) {
  float a0[GC][DC] = {}, a1[GC][DC] = {};
  int64_t t = t0;
  for (; t + 2 <= t1; t += 2) {
    if (next)
      for (int64_t j = 0; j < 2 * DC; j += 16) __builtin_prefetch(next + t * DC + j, 0, 3);
    const float* v0 = v + t * DC;
    const float* v1 = v0 + DC;
    for (int64_t g = 0; g < GC; ++g) {
      const float p0 = p[g * ps + t], p1 = p[g * ps + t + 1];
#pragma omp simd
      for (int64_t d = 0; d < DC; ++d) {
        a0[g][d] += p0 * v0[d];
        a1[g][d] += p1 * v1[d];
      }
    }
  }
  if (t < t1) {
    const float* v0 = v + t * DC;
    for (int64_t g = 0; g < GC; ++g) {
      const float p0 = p[g * ps + t];
#pragma omp simd
      for (int64_t d = 0; d < DC; ++d) a0[g][d] += p0 * v0[d];
    }
  }
  for (int64_t g = 0; g < GC; ++g)
#pragma omp simd
    for (int64_t d = 0; d < DC; ++d) acc[g * DC + d] += a0[g][d] + a1[g][d];
}

// acc[D] += sum over tokens [t0, t1) of p[t] * v[t, :]: group_values for one head when DC is known.
template <int64_t DC>
inline void accumulate_values(const float* __restrict p, const float* __restrict v, int64_t t0,
                              int64_t t1, float* __restrict acc, int64_t D, const float* next) {
  if constexpr (DC > 0) {
    group_values<DC, 1>(p, 0, v, t0, t1, acc, next);
  } else {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t d = 0; d < D; ++d) acc[d] += p[t] * v[t * D + d];
  }
}

struct Dims {
  int64_t H, KVH, G, D, BS;
};

// One request: the query heads of kv heads [h0, h1) over keys [lo, L) of its blocks `row`.
template <Kind K, int64_t DC, int64_t BSC>
void decode_request(const float* q, int64_t qs1, const elem_t<K>* k_ptr, const elem_t<K>* v_ptr,
                    const int64_t* row, int64_t L, int64_t lo, const Dims& dm, float scale,
                    float* o, int64_t os1, std::vector<float>& scores, std::vector<float>& qbuf,
                    int64_t h0, int64_t h1) {
  constexpr bool in_place = K == Kind::F32;  // float32 tiles are read where they are
  const int64_t D = DC > 0 ? DC : dm.D, BS = BSC > 0 ? BSC : dm.BS;
  const int64_t H = dm.H, KVH = dm.KVH, G = dm.G;
  const int64_t blk = KVH * BS * D, head = BS * D;
  const int64_t b_lo = lo / BS, b_hi = (L - 1) / BS;
  const int64_t span = (b_hi - b_lo + 1) * BS;  // whole blocks; slots outside [lo, L) get p = 0
  const int64_t first = lo - b_lo * BS, last = L - b_lo * BS;
  scores.resize(H * span);
  qbuf.resize(H * D * 2 + H + (in_place ? 0 : head));
  float* qs = qbuf.data();
  float* acc = qbuf.data() + H * D;
  float* tile = qbuf.data() + 2 * H * D + H;  // a converted (block, kv head) tile (low-precision caches)
  const int64_t hq0 = h0 * G, hq1 = h1 * G;
  for (int64_t hq = hq0; hq < hq1; ++hq)
    for (int64_t d = 0; d < D; ++d) qs[hq * D + d] = q[hq * qs1 + d] * scale;
  for (int64_t b = b_lo; b <= b_hi; ++b) {
    const elem_t<K>* kb = k_ptr + row[b] * blk;
    // the next block's keys (or, after the last, this block's values) are fetched while computing
    const elem_t<K>* kn = b < b_hi ? k_ptr + row[b + 1] * blk : v_ptr + row[b_lo] * blk;
    for (int64_t h = h0; h < h1; ++h) {
      const float* kt = tile_f32<K>(kb + h * head, head, tile, kn + h * head);
      // the first query head of each KV head prefetches the next block's rows as it goes
      const float* pf0 = nullptr;
      if constexpr (in_place) pf0 = kn + h * head;
      float* sh = scores.data() + h * G * span + (b - b_lo) * BS;
      if constexpr (DC > 0 && BSC > 0) {
        if (G == 3) {  // SmolLM2 (Llama 3 8B: 4): the group's heads at once
          group_scores<DC, BSC, 3>(qs + h * G * D, kt, sh, span, pf0);
          continue;
        }
        if (G == 4) {
          group_scores<DC, BSC, 4>(qs + h * G * D, kt, sh, span, pf0);
          continue;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        block_scores<DC, BSC>(qs + hq * D, kt, sh + g * span, D, BS, g == 0 ? pf0 : nullptr);
      }
    }
  }
  // Softmax of each query head's scores over [first, last). The max and the exps run in vectors
  // (the max is exact in any order, exp_scores gives exp_approx's bits); the sum stays one chain
  // per head in t order, as the loop that fused it with the exps summed it (GCC never vectorised
  // that loop), the heads' chains interleaved so that an add's latency is not paid per score.
  for (int64_t hq = hq0; hq < hq1; ++hq) {
    float* sg = scores.data() + hq * span;
    exp_scores(sg, first, last, max_score(sg, first, last));
  }
  float* sums = qbuf.data() + 2 * H * D;
  sum_rows(scores.data() + hq0 * span, span, hq1 - hq0, first, last, sums + hq0);
  for (int64_t hq = hq0; hq < hq1; ++hq) {
    float* sg = scores.data() + hq * span;
    const float inv = 1.f / sums[hq];
#pragma omp simd
    for (int64_t t = first; t < last; ++t) sg[t] *= inv;
  }
  std::fill(acc + hq0 * D, acc + hq1 * D, 0.f);
  for (int64_t b = b_lo; b <= b_hi; ++b) {
    const elem_t<K>* vb = v_ptr + row[b] * blk;
    const elem_t<K>* vn = b < b_hi ? v_ptr + row[b + 1] * blk : nullptr;
    const int64_t t0 = b == b_lo ? first : 0;
    const int64_t t1 = b == b_hi ? last - (b - b_lo) * BS : BS;
    for (int64_t h = h0; h < h1; ++h) {
      const float* vt = tile_f32<K>(vb + h * head, head, tile, vn ? vn + h * head : nullptr);
      if constexpr (DC > 0) {
        if (G == 3 || G == 4) {
          const float* ph = scores.data() + h * G * span + (b - b_lo) * BS;
          const float* pf = nullptr;
          if constexpr (in_place) pf = vn ? vn + h * head : nullptr;
          if (G == 3)
            group_values<DC, 3>(ph, span, vt, t0, t1, acc + h * G * D, pf);
          else
            group_values<DC, 4>(ph, span, vt, t0, t1, acc + h * G * D, pf);
          continue;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        const float* pf = nullptr;
        if constexpr (in_place) pf = vn && g == 0 ? vn + h * head : nullptr;
        accumulate_values<DC>(scores.data() + hq * span + (b - b_lo) * BS, vt, t0, t1, acc + hq * D, D, pf);
      }
    }
  }
  for (int64_t hq = hq0; hq < hq1; ++hq)
    std::memcpy(o + hq * os1, acc + hq * D, D * sizeof(float));
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "baton kernels: CPU tensors only");
  const auto t = k_cache.scalar_type();
  TORCH_CHECK(t == v_cache.scalar_type() && (t == at::kFloat || t == at::kHalf || t == at::kBFloat16),
              "baton kernels: K and V caches must share one dtype of float32, float16 or bfloat16, got ",
              k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "baton kernels: caches must be contiguous [blocks, kv_heads, ., .]");
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2),
              "baton kernels: K must be [blocks, kv_heads, head_dim, block_size] and V [blocks, kv_heads, block_size, head_dim]");
}

template <Kind K>
void paged_decode_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& ctx_lens, int64_t window,
                       double scale, at::Tensor& out) {
  const Dims dm{query.size(1), v_cache.size(1), query.size(1) / v_cache.size(1), query.size(2), v_cache.size(2)};
  const int64_t n = query.size(0), max_blocks = block_table.size(1);
  const float* q_ptr = query.data_ptr<float>();
  const auto* k_ptr = static_cast<const elem_t<K>*>(k_cache.data_ptr());
  const auto* v_ptr = static_cast<const elem_t<K>*>(v_cache.data_ptr());
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * dm.BS, "paged_decode: context length ", lens[i],
                " of request ", i, " outside [1, ", max_blocks * dm.BS, "]");
  float* o_ptr = out.data_ptr<float>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);
  auto first_key = [&](int64_t L) { return window > 0 ? std::max<int64_t>(0, L - window) : 0; };
  // rows go to the threads by the keys they read, not by count (split_by_work)
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const std::vector<int64_t> cut = baton_rows::split_by_work(
      n, nt, [&](int64_t i) { return lens[i] - first_key(lens[i]) + baton_rows::ATTEND_ROW_COST; });
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores, qbuf;
    for (int64_t i = cut[t0]; i < cut[t1]; ++i) {
      const int64_t L = lens[i];
      const int64_t lo = first_key(L);
      const auto args = std::make_tuple(q_ptr + i * qs0, qs1, k_ptr, v_ptr, bt + i * max_blocks, L, lo,
                                        std::cref(dm), fscale, o_ptr + i * os0, os1, std::ref(scores),
                                        std::ref(qbuf), int64_t{0}, dm.KVH);
      if (dm.BS == 16 && dm.D == 64)
        std::apply(decode_request<K, 64, 16>, args);
      else if (dm.BS == 16 && dm.D == 128)
        std::apply(decode_request<K, 128, 16>, args);
      else
        std::apply(decode_request<K, 0, 0>, args);
    }
  });
}

void paged_decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& ctx_lens, int64_t window,
                  double scale, at::Tensor out) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "paged_decode: query and out must be [n, heads, head_dim]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_decode: query and out must be float32 (the cache may be float16/bfloat16)");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "paged_decode: head_dim must be contiguous");
  TORCH_CHECK(query.size(2) == v_cache.size(3) && query.size(1) % v_cache.size(1) == 0,
              "paged_decode: query heads must be a multiple of the cache's kv heads, with its head_dim");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.is_contiguous() &&
                  block_table.size(0) == query.size(0),
              "paged_decode: block_table must be contiguous int64 [n, max_blocks]");
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous() && ctx_lens.numel() == query.size(0),
              "paged_decode: ctx_lens must be contiguous int64 [n]");
  switch (k_cache.scalar_type()) {
    case at::kHalf:
      return paged_decode_impl<Kind::F16>(query, k_cache, v_cache, block_table, ctx_lens, window, scale, out);
    case at::kBFloat16:
      return paged_decode_impl<Kind::BF16>(query, k_cache, v_cache, block_table, ctx_lens, window, scale, out);
    default:
      return paged_decode_impl<Kind::F32>(query, k_cache, v_cache, block_table, ctx_lens, window, scale, out);
  }
}

// One token's keys and values of kv heads [h0, h1) (rows k + h * ks1, v + h * vs1) into `slot`.
template <Kind K>
void write_token(const float* k, int64_t ks1, const float* v, int64_t vs1, elem_t<K>* kc, elem_t<K>* vc,
                 int64_t slot, int64_t KVH, int64_t BS, int64_t D, int64_t h0, int64_t h1) {
  const int64_t blk = KVH * BS * D, b = slot / BS, off = slot % BS;
  elem_t<K> row[K == Kind::F32 ? 1 : 512];  // a key row rounded, before its strided store (D <= 512)
  for (int64_t h = h0; h < h1; ++h) {
    const float* kr = k + h * ks1;
    elem_t<K>* kt = kc + b * blk + h * BS * D + off;  // column `off` of [D, BS]
    elem_t<K>* vr = vc + b * blk + (h * BS + off) * D;
    if constexpr (K == Kind::F32) {
      for (int64_t d = 0; d < D; ++d) kt[d * BS] = kr[d];
      std::memcpy(vr, v + h * vs1, D * sizeof(float));
    } else {
      from_f32<K>(kr, row, D);
      for (int64_t d = 0; d < D; ++d) kt[d * BS] = row[d];
      from_f32<K>(v + h * vs1, vr, D);
    }
  }
}

template <Kind K>
void paged_write_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                      const int64_t* sl) {
  const int64_t T = key.size(0), KVH = v_cache.size(1), BS = v_cache.size(2), D = v_cache.size(3);
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  auto* kc = static_cast<elem_t<K>*>(k_cache.data_ptr());
  auto* vc = static_cast<elem_t<K>*>(v_cache.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      write_token<K>(k + t * ks0, ks1, v + t * vs0, vs1, kc, vc, sl[t], KVH, BS, D, 0, KVH);
  });
}

void paged_write(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                 const at::Tensor& slots) {
  check_cache(k_cache, v_cache);
  const int64_t T = key.size(0), KVH = v_cache.size(1), BS = v_cache.size(2), D = v_cache.size(3);
  TORCH_CHECK(key.dim() == 3 && key.size(1) == KVH && key.size(2) == D && value.sizes() == key.sizes(),
              "paged_write: key/value must be [tokens, kv_heads, head_dim] matching the cache");
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "paged_write: key/value must be float32 (the cache may be float16/bfloat16)");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "paged_write: head_dim must be contiguous");
  TORCH_CHECK(D <= 512, "paged_write: head_dim ", D, " above 512");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "paged_write: slots must be contiguous int64 [tokens]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t capacity = v_cache.size(0) * BS;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < capacity, "paged_write: slot ", sl[t], " outside the cache's ", capacity);
  switch (k_cache.scalar_type()) {
    case at::kHalf:
      return paged_write_impl<Kind::F16>(key, value, k_cache, v_cache, sl);
    case at::kBFloat16:
      return paged_write_impl<Kind::BF16>(key, value, k_cache, v_cache, sl);
    default:
      return paged_write_impl<Kind::F32>(key, value, k_cache, v_cache, sl);
  }
}

template <Kind K>
void decode_heads_as(const float* q, int64_t qs1, const void* k_cache, const void* v_cache, const int64_t* row,
                     int64_t L, int64_t lo, const Dims& dm, float scale, float* o, int64_t os1, int64_t h0, int64_t h1,
                     std::vector<float>& scores, std::vector<float>& qbuf) {
  const auto* k = static_cast<const elem_t<K>*>(k_cache);
  const auto* v = static_cast<const elem_t<K>*>(v_cache);
  if (dm.BS == 16 && dm.D == 64)
    decode_request<K, 64, 16>(q, qs1, k, v, row, L, lo, dm, scale, o, os1, scores, qbuf, h0, h1);
  else if (dm.BS == 16 && dm.D == 128)
    decode_request<K, 128, 16>(q, qs1, k, v, row, L, lo, dm, scale, o, os1, scores, qbuf, h0, h1);
  else
    decode_request<K, 0, 0>(q, qs1, k, v, row, L, lo, dm, scale, o, os1, scores, qbuf, h0, h1);
}

}  // namespace

void baton_rows::write_kv(CacheType t, const float* k, const float* v, void* k_cache, void* v_cache, int64_t slot,
                          const CacheDims& dm, int64_t h0, int64_t h1) {
  const int64_t D = dm.D;
  switch (t) {
    case CacheType::F16:
      return write_token<Kind::F16>(k, D, v, D, static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache),
                                    slot, dm.KVH, dm.BS, D, h0, h1);
    case CacheType::BF16:
      return write_token<Kind::BF16>(k, D, v, D, static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache),
                                     slot, dm.KVH, dm.BS, D, h0, h1);
    default:
      return write_token<Kind::F32>(k, D, v, D, static_cast<float*>(k_cache), static_cast<float*>(v_cache), slot,
                                    dm.KVH, dm.BS, D, h0, h1);
  }
}

void baton_rows::decode_heads(CacheType t, const float* q, int64_t qs1, const void* k_cache, const void* v_cache,
                              const int64_t* row, int64_t L, int64_t lo, const CacheDims& cd, float scale, float* o,
                              int64_t os1, int64_t h0, int64_t h1, std::vector<float>& scores,
                              std::vector<float>& qbuf) {
  const Dims dm{cd.H, cd.KVH, cd.H / cd.KVH, cd.D, cd.BS};
  switch (t) {
    case CacheType::F16:
      return decode_heads_as<Kind::F16>(q, qs1, k_cache, v_cache, row, L, lo, dm, scale, o, os1, h0, h1, scores, qbuf);
    case CacheType::BF16:
      return decode_heads_as<Kind::BF16>(q, qs1, k_cache, v_cache, row, L, lo, dm, scale, o, os1, h0, h1, scores,
                                         qbuf);
    default:
      return decode_heads_as<Kind::F32>(q, qs1, k_cache, v_cache, row, L, lo, dm, scale, o, os1, h0, h1, scores, qbuf);
  }
}

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def(
      "paged_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor ctx_lens, "
      "int window, float scale, Tensor(a!) out) -> ()");
  m.def("paged_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("paged_decode", paged_decode);
  m.impl("paged_write", paged_write);
}
