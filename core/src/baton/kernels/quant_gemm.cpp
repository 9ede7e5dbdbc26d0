// Quantized weights (ggml's block formats) on the CPU: y = x @ dequantize(w)^T for a few rows of
// x, and dequantization into float32 for everything else. Compiled by baton.kernels.loader.
//
// Weights are uint8 [N, row_bytes]: each of the N output rows is K / QK blocks of one format
// (ggml's layouts, as gguf files store them; baton.quant.formats lists them). Activations stay
// float32: the math is y = x . (D q + M) per group of G weights (D, M: the group's scale and
// offset), exact weight-only quantization up to float summation order.
//
// linear_q (decode: 1 to ~32 rows): every weight byte is read once per call. Each thread takes a
// range of weight rows; a row's groups are decoded into float vectors in registers and multiplied
// by up to 8 rows of x at once (a row's bytes stay in L1 for the next 8). The offset term is
// M * sum(x over the group), with the group sums of x computed once per call.
// dequantize_q: float32 rows, bit-identical to gguf's numpy reference (scale * q, then + offset,
// never fused into an FMA), for a slice of rows before a GEMM (prefill) or gathered embedding rows.
//
// qtype ids are ggml's: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

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
  vec v;
  for (int i = 0; i < VW; ++i) v[i] = f;
  return v;
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
  static void scales(const uint8_t* b, float* d, float* m) {
    d[0] = half_at(b);
    m[0] = half_at(b + 2);
  }
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
  const float dd = half_at(b), dmin = half_at(b + 2);
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

// y[m, n] for one weight row n and MR rows of x ([MR, K], row stride K). Formats with offsets
// (F::MIN): xsum holds the group sums of x ([MR, K / G]) and offs room for the row's K / G
// offsets, whose dot product with xsum is added at the end (out of the loop that holds the
// accumulators in registers).
template <class F, int MR>
inline void dot_row(const float* x, int64_t K, const float* xsum, float* offs, const uint8_t* row, float* y,
                    int64_t ys) {
  constexpr int NG = F::QK / F::G, NC = F::G / 16, NV = 16 / VW;
  const int64_t nb = K / F::QK, groups = K / F::G;
  vec acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = vec{};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * F::BYTES;
    float d[NG], mn[NG];
    F::scales(blk, d, mn);
    if constexpr (F::MIN)
      for (int g = 0; g < NG; ++g) offs[b * NG + g] = mn[g];
    for (int g = 0; g < NG; ++g) {
      u8x16 c[NC];
      F::quants(blk, g, c);
      const vec dv = splat(d[g]);
      for (int i = 0; i < NC; ++i) {  // 16 weights at a time: few vectors of q live at once
        vec q[NV];
        widen<F::SIGNED>(c[i], q);
        const float* xc = x + b * F::QK + g * F::G + i * 16;
        for (int m = 0; m < MR; ++m) {
          vec t = loadv(xc + m * K) * q[0];
          for (int v = 1; v < NV; ++v) t += loadv(xc + m * K + v * VW) * q[v];
          acc[m] += t * dv;
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    float s = hsum(acc[m]);
    if constexpr (F::MIN) {
      const float* xs = xsum + m * groups;
      vec o{};
      int64_t j = 0;
      for (; j + VW <= groups; j += VW) o += loadv(offs + j) * loadv(xs + j);
      s += hsum(o);
      for (; j < groups; ++j) s += offs[j] * xs[j];
    }
    y[m * ys] = s;
  }
}

constexpr int MAX_MR = 8;

template <class F>
void linear_rows(const float* x, int64_t M, int64_t K, const float* xsum, const uint8_t* w, int64_t row_bytes,
                 float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t groups = K / F::G;
  std::vector<float> offs(F::MIN ? groups : 0);
  float* o = offs.data();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    int64_t m = 0;
    for (; m + MAX_MR <= M; m += MAX_MR)
      dot_row<F, MAX_MR>(x + m * K, K, xsum + m * groups, o, row, y + m * N + n, N);
    const float* xm = x + m * K;
    const float* sm = xsum + m * groups;
    float* ym = y + m * N + n;
    switch (M - m) {
      case 7: dot_row<F, 7>(xm, K, sm, o, row, ym, N); break;
      case 6: dot_row<F, 6>(xm, K, sm, o, row, ym, N); break;
      case 5: dot_row<F, 5>(xm, K, sm, o, row, ym, N); break;
      case 4: dot_row<F, 4>(xm, K, sm, o, row, ym, N); break;
      case 3: dot_row<F, 3>(xm, K, sm, o, row, ym, N); break;
      case 2: dot_row<F, 2>(xm, K, sm, o, row, ym, N); break;
      case 1: dot_row<F, 1>(xm, K, sm, o, row, ym, N); break;
      default: break;
    }
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

void linear_q(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::Tensor out) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "linear_q: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "linear_q: float32 x and out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(),
              "linear_q: contiguous x [M, K] and out [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "linear_q: out must be [", M, ", ", N, "]");
  dispatch(qtype, "linear_q", [&]<class F>() {
    check_weights<F>("linear_q", w, K);
    if (M == 0 || N == 0) return;
    const float* xp = x.data_ptr<float>();
    std::vector<float> xsum;
    if constexpr (F::MIN) {
      const int64_t groups = K / F::G;
      xsum.resize(M * groups);
      for (int64_t i = 0; i < M * groups; ++i) {
        vec s{};
        for (int v = 0; v < F::G / VW; ++v) s += loadv(xp + i * F::G + v * VW);
        xsum[i] = hsum(s);
      }
    }
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = out.data_ptr<float>();
    const int64_t row_bytes = w.size(1);
    // ~8 weight rows a task at least: a 192-row matrix still goes to both cores at one row of x.
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
      linear_rows<F>(xp, M, K, xsum.data(), wp, row_bytes, yp, N, n0, n1);
    });
  });
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

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("linear_q(Tensor x, Tensor w, int qtype, Tensor(a!) out) -> ()");
  m.def("dequantize_q(Tensor w, int qtype, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("linear_q", linear_q);
  m.impl("dequantize_q", dequantize_q);
}
