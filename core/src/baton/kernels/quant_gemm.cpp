// Quantized weights (ggml's block formats) on the CPU: y = x @ dequantize(w)^T, and dequantization
// into float32. Compiled by baton.kernels.loader.
//
// Weights are uint8 [N, row_bytes]: each of the N output rows is K / QK blocks of one format
// (ggml's layouts, as gguf files store them; baton.quant.formats lists them). Activations stay
// float32: the math is y = x . (D q + M) per group of G weights (D, M: the group's scale and
// offset), exact weight-only quantization up to float summation order.
//
// linear_q (decode: a few rows of x): y = x @ w^T (+ bias), x [M, K] float32, every weight byte
// read once per call. Each thread takes a range of weight rows, in tiles that stay in cache while
// up to 8 rows of x at a time pass over them (from 5 rows, 2-3 weight rows at once); a row's
// groups are decoded into float vectors in registers. The offset term is M * sum(x over the
// group), the group sums of x computed once.
// linear_q_tiles (prefill: many rows), same arguments: each thread dequantizes tiles of weight
// rows into a buffer of its own and runs torch's GEMM on them.
// dequantize_q: float32 rows, bit-identical to gguf's numpy reference (scale * q, then + offset,
// never fused into an FMA), e.g. gathered embedding rows.
//
// qtype ids are ggml's: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "row_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// The float vector width follows the ISA the library is compiled for (16 with AVX-512, 8 with
// AVX2, 4 otherwise): a vector wider than the registers goes through the stack (small_gemm.cpp).
// Only the byte-to-float widening is written per ISA; everything else is width-generic code.
#if defined(__AVX512F__)
constexpr int VW = 16;
#elif defined(__AVX2__)
constexpr int VW = 8;
#else
constexpr int VW = 4;
#endif
typedef float vec __attribute__((vector_size(VW * sizeof(float))));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

inline vec loadv(const float* p) { vec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void storev(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }
inline u8x16 load16(const uint8_t* p) { u8x16 v; std::memcpy(&v, p, sizeof(v)); return v; }
inline vec splat(float f) {
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(f);
#elif defined(__AVX2__)
  return (vec)_mm256_set1_ps(f);
#else
  vec v;
  for (int i = 0; i < VW; ++i) v[i] = f;
  return v;
#endif
}

// fn(std::integral_constant<int, I>{}) for I = 0 .. N-1: loops whose index must be a constant
// (which accumulator register a chunk of weights goes to).
template <int N, class Fn>
inline void unroll(Fn&& fn) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (fn(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}
inline float hsum(vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float s = 0.0f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
#endif
}

// Keeps v in a register so that a following add is not contracted with the multiply that made it
// into an FMA (dequantize_q rounds like gguf's reference: the product, then the sum).
inline void no_contract(vec& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

// Two adjacent float16 values (a block's scale and minimum).
inline void halves_at(const uint8_t* p, float& a, float& b) {
#if defined(__F16C__)
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(v));
  a = _mm_cvtss_f32(f);
  b = _mm_cvtss_f32(_mm_movehdup_ps(f));
#else
  uint16_t h[2];
  std::memcpy(h, p, sizeof(h));
  a = c10::detail::fp16_ieee_to_fp32_value(h[0]);
  b = c10::detail::fp16_ieee_to_fp32_value(h[1]);
#endif
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// 16 bytes (unsigned, or signed two's complement when SIGNED) as 16 / VW float vectors.
template <bool SIGNED>
inline void widen(u8x16 b, vec* out) {
#if defined(__AVX512F__)
  const __m128i m = (__m128i)b;
  out[0] = (vec)_mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(m) : _mm512_cvtepu8_epi32(m));
#elif defined(__AVX2__)
  const __m128i lo = (__m128i)b, hi = _mm_unpackhi_epi64(lo, lo);
  out[0] = (vec)_mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(lo) : _mm256_cvtepu8_epi32(lo));
  out[1] = (vec)_mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi));
#else
  for (int v = 0; v < 16 / VW; ++v)
    for (int i = 0; i < VW; ++i)
      out[v][i] = SIGNED ? static_cast<float>(static_cast<int8_t>(b[v * VW + i])) : static_cast<float>(b[v * VW + i]);
#endif
}

// The formats. Each block of QK weights has NG = QK / G groups; group g's weights are
// D[g] * q + M[g] (M only when MIN), q the integers that quants() writes as G / 16 chunks of 16
// bytes, in element order.

struct Q4_0 {  // ggml block_q4_0: d (f16), qs[16] (element i: low nibble of qs[i], i + 16: high)
  static constexpr int ID = 2, QK = 32, BYTES = 18, G = 32;
  static constexpr bool SIGNED = true, MIN = false;
  static void scales(const uint8_t* b, float* d, float*) { d[0] = half_at(b); }
  static void quants(const uint8_t* b, int, u8x16* c) {
    const u8x16 q = load16(b + 2);
    c[0] = (q & 15) - 8;
    c[1] = (q >> 4) - 8;
  }
};

struct Q4_1 {  // ggml block_q4_1: d (f16), m (f16), qs[16]
  static constexpr int ID = 3, QK = 32, BYTES = 20, G = 32;
  static constexpr bool SIGNED = false, MIN = true;
  static void scales(const uint8_t* b, float* d, float* m) { halves_at(b, d[0], m[0]); }
  static void quants(const uint8_t* b, int, u8x16* c) {
    const u8x16 q = load16(b + 4);
    c[0] = q & 15;
    c[1] = q >> 4;
  }
};

struct Q8_0 {  // ggml block_q8_0: d (f16), qs[32] (int8)
  static constexpr int ID = 8, QK = 32, BYTES = 34, G = 32;
  static constexpr bool SIGNED = true, MIN = false;
  static void scales(const uint8_t* b, float* d, float*) { d[0] = half_at(b); }
  static void quants(const uint8_t* b, int, u8x16* c) {
    c[0] = load16(b + 2);
    c[1] = load16(b + 18);
  }
};

// The 6-bit scales and mins of Q4_K and Q5_K: 12 bytes for 8 groups. Groups 0-3 in the low 6 bits
// of bytes 0-3 (scales) and 4-7 (mins); groups 4-7 in the nibbles of bytes 8-11, with their top
// two bits in the high bits of bytes 0-3 (scales) and 4-7 (mins).
inline void k_scales(const uint8_t* b, float* d, float* m) {
  float dd, dmin;
  halves_at(b, dd, dmin);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    d[j] = dd * static_cast<float>(sc);
    m[j] = -(dmin * static_cast<float>(mn));
  }
}

struct Q4_K {  // ggml block_q4_K: d, dmin (f16), scales[12], qs[128]; 64 weights per 32 bytes of qs
  static constexpr int ID = 12, QK = 256, BYTES = 144, G = 32;
  static constexpr bool SIGNED = false, MIN = true;
  static void scales(const uint8_t* b, float* d, float* m) { k_scales(b, d, m); }
  static void quants(const uint8_t* b, int g, u8x16* c) {
    const uint8_t* qs = b + 16 + 32 * (g / 2);  // group 2j: low nibbles of qs[32j..], 2j+1: high
    const u8x16 lo = load16(qs), hi = load16(qs + 16);
    c[0] = g & 1 ? lo >> 4 : lo & 15;
    c[1] = g & 1 ? hi >> 4 : hi & 15;
  }
};

struct Q5_K {  // ggml block_q5_K: d, dmin (f16), scales[12], qh[32], qs[128]; bit g of qh[i]: 16
  static constexpr int ID = 13, QK = 256, BYTES = 176, G = 32;
  static constexpr bool SIGNED = false, MIN = true;
  static void scales(const uint8_t* b, float* d, float* m) { k_scales(b, d, m); }
  static void quants(const uint8_t* b, int g, u8x16* c) {
    const uint8_t* qs = b + 48 + 32 * (g / 2);
    const u8x16 lo = load16(qs), hi = load16(qs + 16);
    const u8x16 h0 = load16(b + 16), h1 = load16(b + 32);
    c[0] = (g & 1 ? lo >> 4 : lo & 15) | (((h0 >> g) & 1) << 4);
    c[1] = (g & 1 ? hi >> 4 : hi & 15) | (((h1 >> g) & 1) << 4);
  }
};

struct Q6_K {  // ggml block_q6_K: ql[128], qh[64], scales[16] (int8), d (f16); 16 weights a scale
  static constexpr int ID = 14, QK = 256, BYTES = 210, G = 16;
  static constexpr bool SIGNED = true, MIN = false;
  static void scales(const uint8_t* b, float* d, float*) {
    const float dd = half_at(b + 208);
    for (int g = 0; g < 16; ++g) d[g] = dd * static_cast<float>(static_cast<int8_t>(b[192 + g]));
  }
  // Each half of 128 weights: quarter t (32 weights) takes the low (t < 2) or high nibbles of
  // ql[64h + 32(t & 1) + i] and bits 2t, 2t+1 of qh[32h + i] as its top two bits; q - 32.
  static void quants(const uint8_t* b, int g, u8x16* c) {
    const int h = g / 8, t = (g % 8) / 2, i0 = (g % 2) * 16;
    const u8x16 ql = load16(b + 64 * h + 32 * (t & 1) + i0);
    const u8x16 qh = load16(b + 128 + 32 * h + i0);
    c[0] = ((t < 2 ? ql & 15 : ql >> 4) | (((qh >> (2 * t)) & 3) << 4)) - 32;
  }
};

// Group g of a block as G / VW float vectors of q.
template <class F>
inline void decode(const uint8_t* blk, int g, vec* q) {
  u8x16 c[F::G / 16];
  F::quants(blk, g, c);
  for (int i = 0; i < F::G / 16; ++i) widen<F::SIGNED>(c[i], q + i * (16 / VW));
}

template <class F>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t K, float* out, int64_t r0, int64_t r1) {
  constexpr int NG = F::QK / F::G, NV = F::G / VW;
  const int64_t nb = K / F::QK;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    float* o = out + r * K;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * F::BYTES;
      float d[NG], m[NG];
      F::scales(blk, d, m);
      for (int g = 0; g < NG; ++g) {
        vec q[NV];
        decode<F>(blk, g, q);
        const vec dv = splat(d[g]);
        for (int v = 0; v < NV; ++v) {
          vec y = q[v] * dv;
          if constexpr (F::MIN) {
            no_contract(y);
            y += splat(m[g]);
          }
          storev(o + b * F::QK + g * F::G + v * VW, y);
        }
      }
    }
  }
}

// How far ahead of the block being decoded the row kernels prefetch (a weight row is one stream
// of blocks, and the rows of a thread's range follow one another in memory). On a Xeon with AMX
// (a VM), 30 layers of Q4_1 at one row of x: linear_q 13.8 -> 10.7 ms on one thread, 10.3 -> 7.9
// ms on two (medians of 3 alternating runs); the hardware prefetchers alone left it waiting.
constexpr int64_t PREFETCH_BYTES = 1024;

// One output of the float path from its accumulated vector: its lanes summed, then (formats with
// offsets) the dot product of the weight row's K / G offsets with x's group sums, then the bias.
template <class F>
inline float finish_row(vec acc, const float* offs, const float* xs, int64_t groups, float bias) {
  float s = hsum(acc);
  if constexpr (F::MIN) {
    vec o{};
    int64_t j = 0;
    for (; j + VW <= groups; j += VW) o += loadv(offs + j) * loadv(xs + j);
    s += hsum(o);
    for (; j < groups; ++j) s += offs[j] * xs[j];
  }
  return s + bias;
}

// y[m, n] for one weight row n and MR rows of x ([MR, K], row stride K). Formats with offsets
// (F::MIN): xsum holds the group sums of x ([MR, K / G]) and offs room for the row's K / G
// offsets, whose dot product with xsum is added at the end (out of the loop that holds the
// accumulators in registers). Weights are widened 16 at a time (few vectors of q live at once).
// With one or two rows of x, each row's products with a group's q are summed (t) and scaled once
// per group (t * d), into A accumulators per row (one FMA chain would wait on its latency): one
// multiply fewer per group of 32 than scaling every 16 (Zen 4, 30 layers of Q4_1, one thread:
// 1 row 8.9 -> 8.4 ms, 2 rows 13.3 -> 11.0). With three or more, q is scaled once and shared by
// the rows, one FMA per vector and row, into one accumulator per row (three rows' chains already
// overlap; two accumulators each measured 1.5x slower at 3-4 rows on an AVX-512 Zen 4).
// INV (batch-invariant mode): one and two rows take the shared path too, so that every row is
// summed in the same order whatever the number of rows beside it (executor.batch_invariant).
template <class F, int MR, bool INV = false>
inline void dot_row(const float* x, int64_t K, const float* xsum, float* offs, const uint8_t* row, float bias,
                    float* y, int64_t ys) {
  constexpr int NG = F::QK / F::G, NC = F::G / 16, NV = 16 / VW;
  constexpr bool SHARED = INV || MR >= 3;                              // q * d computed once for all rows
  constexpr int A = SHARED ? 1 : (MR == 1 ? 4 : 2);                   // accumulators per row of x
  // what goes to one accumulator at a time: a chunk (shared path) or a group (scaled once)
  constexpr int UNITS = SHARED ? NG * NC : NG;         // per block
  constexpr int U = A > UNITS ? A / UNITS : 1;         // blocks per step: every accumulator in use
  const int64_t nb = K / F::QK, groups = K / F::G;
  vec acc[MR][A];
  for (int m = 0; m < MR; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = vec{};
  auto block = [&](int64_t b, auto u) {
    const uint8_t* blk = row + b * F::BYTES;
    __builtin_prefetch(blk + PREFETCH_BYTES, 0, 3);
    float d[NG], mn[NG];
    F::scales(blk, d, mn);
    if constexpr (F::MIN)
      for (int g = 0; g < NG; ++g) offs[b * NG + g] = mn[g];
    unroll<NG>([&](auto g) {
      u8x16 c[NC];
      F::quants(blk, g, c);
      const vec dv = splat(d[g]);
      const float* xg = x + b * F::QK + g * F::G;
      if constexpr (SHARED) {
        unroll<NC>([&](auto i) {
          constexpr int a = (decltype(u)::value * UNITS + decltype(g)::value * NC + decltype(i)::value) % A;
          vec q[NV];
          widen<F::SIGNED>(c[i], q);
          for (int v = 0; v < NV; ++v) q[v] *= dv;
          for (int m = 0; m < MR; ++m)
            for (int v = 0; v < NV; ++v) acc[m][(a + v) % A] += loadv(xg + i * 16 + m * K + v * VW) * q[v];
        });
      } else {  // a row's products with the group's q summed, then scaled by d once
        constexpr int a = (decltype(u)::value * UNITS + decltype(g)::value) % A;
        vec t[MR];
        unroll<NC>([&](auto i) {
          vec q[NV];
          widen<F::SIGNED>(c[i], q);
          for (int m = 0; m < MR; ++m)
            for (int v = 0; v < NV; ++v) {
              const vec p = loadv(xg + i * 16 + m * K + v * VW);
              if (decltype(i)::value == 0 && v == 0) t[m] = p * q[0];
              else t[m] += p * q[v];
            }
        });
        for (int m = 0; m < MR; ++m) acc[m][a] += t[m] * dv;
      }
    });
  };
  int64_t b = 0;
  for (; b + U <= nb; b += U) unroll<U>([&](auto u) { block(b + u, u); });
  for (; b < nb; ++b) block(b, std::integral_constant<int, 0>{});
  for (int m = 0; m < MR; ++m) {
    vec v = acc[m][0];
    for (int a = 1; a < A; ++a) v += acc[m][a];
    y[m * ys] = finish_row<F>(v, offs, xsum + m * groups, groups, bias);
  }
}

// Weight rows taken at once by dot_rows for MR rows of x (1: dot_row alone). Each vector of x is
// then loaded once for NR weight rows. With AVX-512 (32 registers: MR x NR accumulators and NR
// vectors of q) on a Zen 4, 30 layers of Q4_1 streamed from memory, one thread: 6 rows of x
// 27 -> 24 ms, 8 rows 37 -> 29, 16 rows 70 -> 54; at 3-4 rows two or four weight rows were no
// faster. With AVX2 (16 registers, two vectors per 16 weights) it stays one weight row: a
// two-row variant measured slower streamed from memory on an AVX2-only host.
template <int MR>
constexpr int weight_rows() {
  if constexpr (VW == 16 && MR >= 5) return MR <= 6 ? 3 : 2;
  else return 1;
}

// dot_row's shared path (MR >= 3) for NR consecutive weight rows: y[m, n + j]. Every output is
// summed exactly as dot_row sums it (one accumulator, the chunks in order, q * d then an FMA), so
// the result does not depend on NR. offs: room for NR rows' offsets, K / G each.
template <class F, int MR, int NR>
inline void dot_rows(const float* x, int64_t K, const float* xsum, float* offs, const uint8_t* row,
                     int64_t row_bytes, const float* bias, float* y, int64_t ys) {
  static_assert(MR >= 3, "dot_rows shares the scaled q between rows of x");
  constexpr int NG = F::QK / F::G, NC = F::G / 16, NV = 16 / VW;
  const int64_t nb = K / F::QK, groups = K / F::G;
  vec acc[MR][NR];
  unroll<MR>([&](auto m) { unroll<NR>([&](auto j) { acc[m][j] = vec{}; }); });
  for (int64_t b = 0; b < nb; ++b) {
    float d[NR][NG], mn[NR][NG];
    unroll<NR>([&](auto j) {
      __builtin_prefetch(row + j * row_bytes + b * F::BYTES + PREFETCH_BYTES, 0, 3);
      F::scales(row + j * row_bytes + b * F::BYTES, d[j], mn[j]);
      if constexpr (F::MIN)
        for (int g = 0; g < NG; ++g) offs[j * groups + b * NG + g] = mn[j][g];
    });
    unroll<NG>([&](auto g) {
      u8x16 c[NR][NC];
      unroll<NR>([&](auto j) { F::quants(row + j * row_bytes + b * F::BYTES, g, c[j]); });
      unroll<NC>([&](auto i) {
        vec q[NR][NV];
        unroll<NR>([&](auto j) {
          widen<F::SIGNED>(c[j][i], q[j]);
          const vec dv = splat(d[j][g]);
          for (int v = 0; v < NV; ++v) q[j][v] *= dv;
        });
        const float* xc = x + b * F::QK + g * F::G + i * 16;
        unroll<MR>([&](auto m) {
          for (int v = 0; v < NV; ++v) {
            const vec xv = loadv(xc + m * K + v * VW);
            unroll<NR>([&](auto j) { acc[m][j] += xv * q[j][v]; });
          }
        });
      });
    });
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j)
      y[m * ys + j] =
          finish_row<F>(acc[m][j], offs + j * groups, xsum + m * groups, groups, bias ? bias[j] : 0.0f);
}

constexpr int MAX_MR = 8;
constexpr int MAX_NR = 3;  // weight_rows' largest: linear_rows keeps room for that many rows' offsets
// Weight rows per tile: a tile's bytes stay in L1/L2 while each group of up to MAX_MR rows of x
// (which stays in L1) passes over it, so neither x nor the weights stream from farther away.
constexpr int64_t TILE_BYTES = 16384;

template <class F, int MR, bool INV>
void tile_rows(const float* x, int64_t K, const float* xsum, float* offs, const uint8_t* w, int64_t row_bytes,
               const float* bias, float* y, int64_t N, int64_t t0, int64_t t1) {
  constexpr int NR = weight_rows<MR>();
  static_assert(NR <= MAX_NR, "linear_rows' offsets hold MAX_NR weight rows");
  int64_t n = t0;
  if constexpr (NR > 1)
    for (; n + NR <= t1; n += NR)
      dot_rows<F, MR, NR>(x, K, xsum, offs, w + n * row_bytes, row_bytes, bias ? bias + n : nullptr, y + n, N);
  for (; n < t1; ++n)
    dot_row<F, MR, INV>(x, K, xsum, offs, w + n * row_bytes, bias ? bias[n] : 0.0f, y + n, N);
}

// fn(m, std::integral_constant<int, MR>{}) for the rows of x in groups of MR = MAX_MR and one
// group of the MR < MAX_MR left: the row count of a dot product must be a compile-time constant.
template <class Fn>
inline void row_groups(int64_t M, Fn&& fn) {
  int64_t m = 0;
  for (; m + MAX_MR <= M; m += MAX_MR) fn(m, std::integral_constant<int, MAX_MR>{});
  switch (M - m) {
    case 7: fn(m, std::integral_constant<int, 7>{}); break;
    case 6: fn(m, std::integral_constant<int, 6>{}); break;
    case 5: fn(m, std::integral_constant<int, 5>{}); break;
    case 4: fn(m, std::integral_constant<int, 4>{}); break;
    case 3: fn(m, std::integral_constant<int, 3>{}); break;
    case 2: fn(m, std::integral_constant<int, 2>{}); break;
    case 1: fn(m, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// INV: the batch-invariant sums (dot_row); with three or more rows of x the same as without.
template <class F, bool INV = false>
void linear_rows(const float* x, int64_t M, int64_t K, const float* xsum, const uint8_t* w, int64_t row_bytes,
                 const float* bias, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t groups = K / F::G;
  const int64_t tile = std::max<int64_t>(1, TILE_BYTES / row_bytes);
  std::vector<float> offs(F::MIN ? MAX_NR * groups : 0);
  float* o = offs.data();
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    row_groups(M, [&](int64_t m, auto mr) {
      tile_rows<F, decltype(mr)::value, INV>(x + m * K, K, xsum + m * groups, o, w, row_bytes, bias, y + m * N, N, t0,
                                        t1);
    });
  }
}

// ------------------------------------------------------------------ int8 activations (linear_q8a)
//
// x is quantized per 32 values, as llama.cpp does for its CPU dot products: xq = round(x / dx),
// dx = max |x| / 127 (round half to even; xq in [-127, 127]). A 32-weight unit of a row is then
// one integer dot product of q and xq, scaled by d * dx; formats with offsets add M * sum(x) over
// the group with sum(x) = dx * sum(xq). Not exact: the activations lose ~8 bits.

constexpr int QX = 32;  // activations per int8 block

}  // namespace

// x [M, K] -> xq [M, K], dx [M, K / QX], and (xs, when not null) dx * sum(xq) per G values [M, K / G]
// (row_kernels.h: packed_q8.cpp quantizes x with it too).
void baton_rows::quantize_x(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs, int64_t G) {
  const int64_t nb = K / QX;
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QX;
    float amax = 0.0f;
    for (int j = 0; j < QX; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    dx[i] = d;
    int8_t* q = xq + i * QX;
    for (int j = 0; j < QX; ++j) q[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
    if (xs)
      for (int64_t g = 0; g < QX / G; ++g) {
        int32_t s = 0;
        for (int64_t j = g * G; j < (g + 1) * G; ++j) s += q[j];
        xs[i * (QX / G) + g] = d * static_cast<float>(s);
      }
  }
}

namespace {

#if defined(__AVX2__)
// 32 weights [32u, 32u + 32) of a block as bytes: unsigned for formats with offsets, two's
// complement otherwise (as F::quants writes them).
template <class F>
inline __m256i quants32(const uint8_t* blk, int u) {
  if constexpr (F::G == 32) {
    u8x16 c[2];
    F::quants(blk, u, c);
    return _mm256_set_m128i((__m128i)c[1], (__m128i)c[0]);
  } else {  // G == 16
    u8x16 c0[1], c1[1];
    F::quants(blk, 2 * u, c0);
    F::quants(blk, 2 * u + 1, c1);
    return _mm256_set_m128i((__m128i)c1[0], (__m128i)c0[0]);
  }
}

// Eight int32 sums of q * xq, lane j over weights 4j .. 4j + 3: one VNNI dpbusd where the CPU has
// AVX-512 VNNI (its 256-bit form: on AMD's Zen 4 the 512-bit kernels measured slower), else maddubs
// and madd. Both multiply unsigned by signed bytes: signed q gives its magnitude and its sign to xq
// (|xq| <= 127, so maddubs's 16-bit pair sums do not saturate); the int32 sums are the same.
template <bool SIGNED>
inline __m256 dot32(__m256i q, __m256i x) {
  const __m256i a = SIGNED ? _mm256_sign_epi8(q, q) : q, b = SIGNED ? _mm256_sign_epi8(x, q) : x;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b));
#else
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[m, n] for one weight row n and MR rows of quantized x. Two accumulators per row whatever MR
// (one FMA chain would wait on its latency at one row), so that a row's sum runs in the same order
// alone or beside others: a speculative verify step gives each row a decode step's bits. (At 5-8
// rows a CPU with 16 vector registers, AVX2 without AVX-512, spills some of them.)
template <class F, int MR>
inline void dot_row_q8(const int8_t* xq, const float* dx, int64_t K, const float* xsum, float* offs,
                       const uint8_t* row, float bias, float* y, int64_t ys) {
  constexpr int NG = F::QK / F::G, U = F::QK / QX, A = 2;
  const int64_t nb = K / F::QK, units = K / QX, groups = K / F::G;
  __m256 acc[MR][A];
  for (int m = 0; m < MR; ++m)
    for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
  // Block b's unit u goes to accumulator (slot + u) % A; with one unit a block (32-weight
  // formats) blocks alternate slots, so consecutive FMAs do not wait on each other.
  auto block = [&](int64_t b, auto slot) {
    const uint8_t* blk = row + b * F::BYTES;
    __builtin_prefetch(blk + PREFETCH_BYTES, 0, 3);
    float d[NG], mn[NG];
    F::scales(blk, d, mn);
    if constexpr (F::MIN)
      for (int g = 0; g < NG; ++g) offs[b * NG + g] = mn[g];
    unroll<U>([&](auto uc) {
      constexpr int u = decltype(uc)::value, a = (decltype(slot)::value + u) % A;
      const __m256i q = quants32<F>(blk, u);
      const int64_t xu = b * U + u;
      for (int m = 0; m < MR; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + xu * QX));
        const float e = dx[m * units + xu];
        __m256 sc;
        if constexpr (F::G == 32)
          sc = _mm256_set1_ps(d[u] * e);
        else
          sc = _mm256_set_m128(_mm_set1_ps(d[2 * u + 1] * e), _mm_set1_ps(d[2 * u] * e));
        acc[m][a] = _mm256_fmadd_ps(dot32<F::SIGNED>(q, xv), sc, acc[m][a]);
      }
    });
  };
  int64_t b = 0;
  if constexpr (U == 1)  // blocks in pairs, one per accumulator
    for (; b + 2 <= nb; b += 2) {
      block(b, std::integral_constant<int, 0>{});
      block(b + 1, std::integral_constant<int, 1>{});
    }
  for (; b < nb; ++b) block(b, std::integral_constant<int, 0>{});
  for (int m = 0; m < MR; ++m) {
    __m256 v = acc[m][0];
    for (int a = 1; a < A; ++a) v = _mm256_add_ps(v, acc[m][a]);
    if constexpr (F::MIN) {  // the offsets' dot product with the group sums of x
      const float* xs = xsum + m * groups;
      int64_t j = 0;
      for (; j + 8 <= groups; j += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(offs + j), _mm256_loadu_ps(xs + j), v);
      float s = hsum8(v);
      for (; j < groups; ++j) s += offs[j] * xs[j];
      y[m * ys] = s + bias;
    } else {
      y[m * ys] = hsum8(v) + bias;
    }
  }
}
#else
// Portable: the same integer dot products per 32 weights, scalar.
template <class F, int MR>
inline void dot_row_q8(const int8_t* xq, const float* dx, int64_t K, const float* xsum, float* offs,
                       const uint8_t* row, float bias, float* y, int64_t ys) {
  constexpr int NG = F::QK / F::G, NC = F::G / 16;
  const int64_t nb = K / F::QK, units = K / QX, groups = K / F::G;
  float acc[MR] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * F::BYTES;
    float d[NG], mn[NG];
    F::scales(blk, d, mn);
    for (int g = 0; g < NG; ++g) {
      if constexpr (F::MIN) offs[b * NG + g] = mn[g];
      u8x16 c[NC];
      F::quants(blk, g, c);
      const int64_t k0 = b * F::QK + g * F::G;
      for (int m = 0; m < MR; ++m) {
        int32_t s = 0;
        for (int i = 0; i < F::G; ++i) {
          const uint8_t qb = c[i / 16][i % 16];
          const int32_t qv = F::SIGNED ? static_cast<int32_t>(static_cast<int8_t>(qb)) : static_cast<int32_t>(qb);
          s += qv * xq[m * K + k0 + i];
        }
        acc[m] += static_cast<float>(s) * (d[g] * dx[m * units + k0 / QX]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    float s = acc[m];
    if constexpr (F::MIN)
      for (int64_t j = 0; j < groups; ++j) s += offs[j] * xsum[m * groups + j];
    y[m * ys] = s + bias;
  }
}
#endif

template <class F, int MR>
void tile_rows_q8(const int8_t* xq, const float* dx, int64_t K, const float* xsum, float* offs, const uint8_t* w,
                  int64_t row_bytes, const float* bias, float* y, int64_t N, int64_t t0, int64_t t1) {
  for (int64_t n = t0; n < t1; ++n)
    dot_row_q8<F, MR>(xq, dx, K, xsum, offs, w + n * row_bytes, bias ? bias[n] : 0.0f, y + n, N);
}

template <class F>
void linear_rows_q8(const int8_t* xq, const float* dx, int64_t M, int64_t K, const float* xsum, const uint8_t* w,
                    int64_t row_bytes, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t groups = K / F::G, units = K / QX;
  const int64_t tile = std::max<int64_t>(1, TILE_BYTES / row_bytes);
  std::vector<float> offs(F::MIN ? groups : 0);
  float* o = offs.data();
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    row_groups(M, [&](int64_t m, auto mr) {
      tile_rows_q8<F, decltype(mr)::value>(xq + m * K, dx + m * units, K, xsum + m * groups, o, w, row_bytes, bias,
                                           y + m * N, N, t0, t1);
    });
  }
}

// xsum [M, K / G]: the sums of x over each group of G values (the offset term's factor).
template <class F>
void group_sums(const float* xp, int64_t M, int64_t K, std::vector<float>& xsum) {
  const int64_t groups = K / F::G;
  xsum.resize(M * groups);
  for (int64_t i = 0; i < M * groups; ++i) {
    vec s{};
    for (int v = 0; v < F::G / VW; ++v) s += loadv(xp + i * F::G + v * VW);
    xsum[i] = hsum(s);
  }
}

// Calls fn.template operator()<Format>() for the format with ggml type id qtype.
template <class Fn>
void dispatch(int64_t qtype, const char* op, Fn&& fn) {
  switch (qtype) {
    case Q4_0::ID: fn.template operator()<Q4_0>(); break;
    case Q4_1::ID: fn.template operator()<Q4_1>(); break;
    case Q8_0::ID: fn.template operator()<Q8_0>(); break;
    case Q4_K::ID: fn.template operator()<Q4_K>(); break;
    case Q5_K::ID: fn.template operator()<Q5_K>(); break;
    case Q6_K::ID: fn.template operator()<Q6_K>(); break;
    default:
      TORCH_CHECK(false, op, ": unsupported qtype ", qtype,
                  " (supported ggml types: Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
  }
}

template <class F>
void check_weights(const char* op, const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": w must be a contiguous CPU uint8 tensor [N, row_bytes]");
  TORCH_CHECK(K % F::QK == 0, op, ": K = ", K, " is not a multiple of the block size ", F::QK);
  TORCH_CHECK(w.size(1) == K / F::QK * F::BYTES, op, ": w has ", w.size(1), " bytes per row, K = ", K, " needs ",
              K / F::QK * F::BYTES);
}

// x [M, K] float32 (made contiguous), bias [N] float32 or none; returns out [M, N].
at::Tensor new_output(const char* op, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, op,
              ": x must be a CPU float32 tensor [M, K]");
  TORCH_CHECK(w.dim() == 2, op, ": w must be [N, row_bytes]");
  if (bias)
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == w.size(0) && bias->is_contiguous(),
                op, ": bias must be a contiguous CPU float32 tensor [", w.size(0), "]");
  return at::empty({x.size(0), w.size(0)}, x.options());
}

// invariant: every row summed as at three or more rows (dot_row's INV), whatever M.
at::Tensor linear_q(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, const std::optional<at::Tensor>& bias,
                    bool invariant) {
  at::Tensor out = new_output("linear_q", x_in, w, bias);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  dispatch(qtype, "linear_q", [&]<class F>() {
    check_weights<F>("linear_q", w, K);
    if (M == 0 || N == 0) return;
    const float* xp = x.data_ptr<float>();
    std::vector<float> xsum;
    if constexpr (F::MIN) group_sums<F>(xp, M, K, xsum);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    float* yp = out.data_ptr<float>();
    const int64_t row_bytes = w.size(1);
    // ~8 weight rows a task at least: a 192-row matrix still goes to both cores at one row of x.
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
      if (invariant)
        linear_rows<F, true>(xp, M, K, xsum.data(), wp, row_bytes, bp, yp, N, n0, n1);
      else
        linear_rows<F>(xp, M, K, xsum.data(), wp, row_bytes, bp, yp, N, n0, n1);
    });
  });
  return out;
}

// y = xhat @ w^T (+ bias) with xhat = x quantized to int8 per 32 values (see quantize_x).
at::Tensor linear_q8a(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype,
                      const std::optional<at::Tensor>& bias) {
  at::Tensor out = new_output("linear_q8a", x_in, w, bias);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  dispatch(qtype, "linear_q8a", [&]<class F>() {
    check_weights<F>("linear_q8a", w, K);
    if (M == 0 || N == 0) return;
    std::vector<int8_t> xq(M * K);
    std::vector<float> dx(M * K / QX), xsum(F::MIN ? M * K / F::G : 0);
    baton_rows::quantize_x(x.data_ptr<float>(), M, K, xq.data(), dx.data(), F::MIN ? xsum.data() : nullptr, F::G);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    float* yp = out.data_ptr<float>();
    const int64_t row_bytes = w.size(1);
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
      linear_rows_q8<F>(xq.data(), dx.data(), M, K, xsum.data(), wp, row_bytes, bp, yp, N, n0, n1);
    });
  });
  return out;
}

// float32 weights per tile of tiled_gemm (256 KiB: a thread's tile stays in its L2).
constexpr int64_t TILE_FLOATS = 65536;

// Many rows of x (prefill): each thread dequantizes tiles of weight rows into a float32 buffer of
// its own and multiplies x by them with torch's GEMM (one thread each, inside the parallel region)
// straight into their columns of out. Bounded memory: one tile per thread.
at::Tensor linear_q_tiles(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype,
                          const std::optional<at::Tensor>& bias) {
  at::Tensor out = new_output("linear_q_tiles", x_in, w, bias);
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(1);
  dispatch(qtype, "linear_q_tiles", [&]<class F>() {
    check_weights<F>("linear_q_tiles", w, K);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const int64_t row_bytes = w.size(1);
    baton_rows::tiled_gemm(x, bias, out, [&](int64_t n0, int64_t rows, float* buf) {
      dequantize_rows<F>(wp + n0 * row_bytes, row_bytes, K, buf, 0, rows);
    });
  });
  return out;
}

void dequantize_q(const at::Tensor& w, int64_t qtype, at::Tensor out) {
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(),
              "dequantize_q: out must be a contiguous CPU float32 tensor [N, K]");
  const int64_t N = out.size(0), K = out.size(1);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == N, "dequantize_q: w has ", w.dim() == 2 ? w.size(0) : -1,
              " rows, out ", N);
  dispatch(qtype, "dequantize_q", [&]<class F>() {
    check_weights<F>("dequantize_q", w, K);
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    const int64_t row_bytes = w.size(1);
    at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) { dequantize_rows<F>(wp, row_bytes, K, op, r0, r1); });
  });
}

}  // namespace

void baton_rows::tiled_gemm(const at::Tensor& x, const std::optional<at::Tensor>& bias, at::Tensor& out,
                            const std::function<void(int64_t, int64_t, float*)>& fill) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  if (M == 0 || N == 0) return;
  // At most TILE_FLOATS a tile, as many tiles as a multiple of the threads, of one size (a multiple
  // of 16 rows): each thread gets the same share. 576 rows of K = 576 as 5 tiles of 112 and one of 16
  // left one thread 336 rows and the other 240 (2 threads): 10-13% longer q / o projections at
  // 37-2048 rows of x. A tile only changes which output columns one GEMM call writes, so the bits
  // stay.
  const int64_t max_tile = std::max<int64_t>(16, TILE_FLOATS / K / 16 * 16);
  const int64_t threads = at::get_num_threads();
  const int64_t want = ((N + max_tile - 1) / max_tile + threads - 1) / threads * threads;
  const int64_t tile = std::min(N, ((N + want - 1) / want + 15) / 16 * 16);
  const int64_t tiles = (N + tile - 1) / tile;
  // The GEMMs go through the dispatcher on the pool's threads, which do not inherit the caller's
  // thread-local state: without it, InferenceMode is off there and writing into an
  // inference-mode `out` fails.
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    at::Tensor buf = at::empty({tile, K}, x.options());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      fill(n0, rows, buf.data_ptr<float>());
      at::Tensor part = out.narrow(1, n0, rows);
      const at::Tensor wt = buf.narrow(0, 0, rows).t();
      if (bias)
        at::addmm_out(part, bias->narrow(0, n0, rows), x, wt);
      else
        at::mm_out(part, x, wt);
    }
  });
}

void baton_rows::dequantize_raw(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t K, float* out, int64_t r0,
                                int64_t r1) {
  dispatch(qtype, "dequantize_raw", [&]<class F>() { dequantize_rows<F>(w, row_bytes, K, out, r0, r1); });
}

bool baton_rows::quant_supported(int64_t qtype) {
  switch (qtype) {
    case Q4_0::ID: case Q4_1::ID: case Q8_0::ID: case Q4_K::ID: case Q5_K::ID: case Q6_K::ID: return true;
    default: return false;
  }
}

void baton_rows::quant_rows(int64_t qtype, bool q8a, const float* x, int64_t M, int64_t K, uint64_t gen,
                            QuantX& prep, const uint8_t* w, int64_t row_bytes, const float* bias, float* y, int64_t N,
                            int64_t n0, int64_t n1, bool invariant) {
  dispatch(qtype, "quant_rows", [&]<class F>() {
    // x's preparation depends on the format only through its group size and offsets
    const int64_t key = (q8a ? 1000 : 0) + (F::MIN ? F::G : 0);
    if (prep.gen != gen || prep.key != key) {
      if (q8a) {
        prep.xq.resize(M * K);
        prep.dx.resize(M * K / QX);
        prep.xsum.resize(F::MIN ? M * K / F::G : 0);
        quantize_x(x, M, K, prep.xq.data(), prep.dx.data(), F::MIN ? prep.xsum.data() : nullptr, F::G);
      } else if constexpr (F::MIN) {
        group_sums<F>(x, M, K, prep.xsum);
      }
      prep.gen = gen;
      prep.key = key;
    }
    if (q8a)
      linear_rows_q8<F>(prep.xq.data(), prep.dx.data(), M, K, prep.xsum.data(), w, row_bytes, bias, y, N, n0, n1);
    else if (invariant)
      linear_rows<F, true>(x, M, K, prep.xsum.data(), w, row_bytes, bias, y, N, n0, n1);
    else
      linear_rows<F>(x, M, K, prep.xsum.data(), w, row_bytes, bias, y, N, n0, n1);
  });
}

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("linear_q(Tensor x, Tensor w, int qtype, Tensor? bias=None, bool invariant=False) -> Tensor");
  m.def("linear_q_tiles(Tensor x, Tensor w, int qtype, Tensor? bias=None) -> Tensor");
  m.def("linear_q8a(Tensor x, Tensor w, int qtype, Tensor? bias=None) -> Tensor");
  m.def("dequantize_q(Tensor w, int qtype, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("linear_q", linear_q);
  m.impl("linear_q_tiles", linear_q_tiles);
  m.impl("linear_q8a", linear_q8a);
  m.impl("dequantize_q", dequantize_q);
}
