// Int8-activation linears on weights repacked for VNNI dot products (linear_q8p), compiled by
// baton.kernels.loader.
//
// linear_q8a (quant_gemm.cpp) reads ggml's row-major blocks: 32 weights of one output row at a
// time, scales broadcast from scalars, then a horizontal sum per output. Here the weights are
// repacked once, at load (pack_q8p), so that one vector holds 4 consecutive weights of each of 16
// output rows: a broadcast of 4 activation bytes and one vpdpbusd advance 16 outputs by 4 products
// each, no horizontal sums, and a block's scales for the 16 rows are one vector load. Per 512
// weights of Q4_1 that is ~30 instructions against ~150 row-major (llama.cpp's AMX build decodes
// one row the same way: ggml-cpu/amx/mmq.cpp, tinygemm_kernel_vnni).
//
// Activations are quantized exactly as linear_q8a quantizes them (quantize_x: per 32 values,
// round(x / dx), dx = max |x| / 127), so y differs from linear_q8a's only in float summation
// order.
//
// The packed layout, per tile of 16 output rows (rows 16t .. 16t + 15) and block b of 32 inputs,
// tiles after one another and a tile's blocks in order ([N / 16, K / 32 * bytes] uint8); the
// scales stay float16, so the packed rows are exactly as many bytes as ggml's (a decode step
// streams them from memory):
//   Q4_0: 4 x 64 quant bytes, then d (16 float16)                                    = 288 bytes
//   Q4_1: 4 x 64 quant bytes, then d, then m (16 float16 each)                       = 320 bytes
//     byte 4c + j of quant vector i (row c): low nibble = q[c][8i + j], high = q[c][8i + 4 + j]
//   Q8_0: 8 x 64 quant bytes (byte 4c + j of vector i: w[c][4i + j] + 128, unsigned), then d
//                                                                                    = 544 bytes
// vpdpbusd multiplies these unsigned bytes by the signed xq; a block of row c is then
// d_c * dx * (q . xq - z * sum(xq)) (z: 8 for Q4_0, 128 for Q8_0, the offset the unsigned
// bytes carry) + m_c * dx * sum(xq) (Q4_1), the integer part exact.
//
// The kernels need AVX-512 VNNI (vpdpbusd on zmm) and BW. Where the build has AVX2 (with FMA and
// F16C) but not those, linear_q8p and linear_qp run an AVX2 loop on the same layout (each 64-byte
// vector as two halves of 8 rows, vpmaddubsw + vpmaddwd for vpdpbusd: the same integer sums, so
// the same bits). Elsewhere pack_q8p still works, q8p_kernel() says False, and callers keep
// linear_q8a / linear_q.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "row_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cstdlib>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define BATON_Q8P 1
// AMX tiles for 5 or more rows of x: compiled only where the OS granted tile data to the process
// that built the library (loader.isa_flags adds -mno-amx-* otherwise), and every process that
// loads it asks the OS first (loader.library_path -> os_grant.amx_grant).
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define BATON_Q8P_AMX 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BATON_Q8P_AVX2 1  // avx2_rows
#endif
#if defined(BATON_Q8P) || defined(BATON_Q8P_AVX2)
#define BATON_Q8P_INT8 1  // linear_q8p is built
#endif

namespace {

constexpr int TN = 16;  // output rows per tile (one float32 vector of outputs)
constexpr int QK = 32;  // weights per block (the formats' and the activations')
// The keys of the two preparations of x in a QuantX (int8, and exact's three pieces).
constexpr int64_t PREP_INT8 = 3000, PREP_EXACT = 3001;
// Blocks ahead that tiles() prefetches (Xeon with AMX, 30 layers of Q4_1 at one row: 5.8 -> 4.3
// ms on one thread, medians of 3 alternating runs; two threads are held by memory bandwidth).
constexpr int PREFETCH = 8;
// How the VNNI loop streams the weights at decode sizes: "l2", one tile at a time with its blocks
// prefetched into L2, or "l1", four (two) tiles at a time prefetched into L1. A core has few L1
// miss buffers, and four interleaved streams of a few KB each leave the hardware prefetchers
// little to follow: on AMD Zen 4 (2 threads, a 30 MB Q8_0 head streamed from memory at one row)
// "l2" took the loop from 19.4 to 28.2 GB/s (int8: 21.6 to 30.0; medians of 15 interleaved runs of
// a stand-alone copy of the loop; batch-1 exact decode 1.26x). The default is "l2" on AMD CPUs,
// "l1" elsewhere (the Xeon's figures above were measured with "l1"); BATON_PACKED_STREAM=l1|l2
// overrides it (kernels/packed_stream.py checks the value when the library loads).
bool stream_into_l2() {
  static const bool l2 = [] {
    const char* env = std::getenv("BATON_PACKED_STREAM");
    if (env != nullptr && (std::strcmp(env, "l1") == 0 || std::strcmp(env, "l2") == 0))
      return std::strcmp(env, "l2") == 0;
#if defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u)
      return true;  // "AuthenticAMD"
#endif
    return false;
  }();
  return l2;
}

// Tiles a pass of packed_rows_p takes before the next four rows of x come (32 tiles of Q8_0 at
// K = 576: 313 KB, in L2).
constexpr int64_t CHUNK_TILES = 32;

// Z: the offset of the unsigned bytes (q - Z are the format's integers, Q4_1's q need none).
struct P4_0 {
  static constexpr int ID = 2, RAW = 18, BB = 288, QV = 4, Z = 8;
  static constexpr bool NIBBLES = true, MIN = false;
};
struct P4_1 {
  static constexpr int ID = 3, RAW = 20, BB = 320, QV = 4, Z = 0;
  static constexpr bool NIBBLES = true, MIN = true;
};
struct P8_0 {
  static constexpr int ID = 8, RAW = 34, BB = 544, QV = 8, Z = 128;
  static constexpr bool NIBBLES = false, MIN = false;
};

template <class Fn>
void dispatch_p(int64_t qtype, const char* op, Fn&& fn) {
  switch (qtype) {
    case P4_0::ID: fn.template operator()<P4_0>(); break;
    case P4_1::ID: fn.template operator()<P4_1>(); break;
    case P8_0::ID: fn.template operator()<P8_0>(); break;
    default:
      TORCH_CHECK(false, op, ": qtype ", qtype, " has no packed layout (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 have)");
  }
}

// Tile t's block b from ggml's rows (raw [N, K / 32 * RAW]) into out (P::BB bytes).
template <class P>
void pack_block(const uint8_t* raw, int64_t row_bytes, int64_t t, int64_t b, uint8_t* out) {
  uint8_t* scales = out + P::QV * 64;  // d of the 16 rows (float16 as stored), then m (Q4_1)
  for (int c = 0; c < TN; ++c) {
    const uint8_t* blk = raw + (t * TN + c) * row_bytes + b * P::RAW;
    uint8_t q[QK];  // the block's 32 weights as unsigned bytes: nibbles 0..15, or Q8_0's w + 128
    if constexpr (P::NIBBLES) {
      const uint8_t* qs = blk + (P::MIN ? 4 : 2);
      for (int i = 0; i < 16; ++i) {
        q[i] = qs[i] & 15;
        q[i + 16] = qs[i] >> 4;
      }
    } else {
      for (int k = 0; k < QK; ++k) q[k] = blk[2 + k] ^ 0x80u;
    }
    std::memcpy(scales + 2 * c, blk, 2);
    if constexpr (P::MIN) std::memcpy(scales + 2 * TN + 2 * c, blk + 2, 2);
    for (int i = 0; i < P::QV; ++i)
      for (int j = 0; j < 4; ++j)
        out[i * 64 + 4 * c + j] =
            P::NIBBLES ? static_cast<uint8_t>(q[8 * i + j] | (q[8 * i + 4 + j] << 4)) : q[4 * i + j];
  }
}

// Row c of tile t's block b (P::BB bytes at blk) back into ggml's block (P::RAW bytes at out):
// pack_block's inverse.
template <class P>
void unpack_block(const uint8_t* blk, int c, uint8_t* out) {
  const uint8_t* scales = blk + P::QV * 64;
  std::memcpy(out, scales + 2 * c, 2);
  if constexpr (P::MIN) std::memcpy(out + 2, scales + 2 * TN + 2 * c, 2);
  uint8_t q[QK];
  for (int i = 0; i < P::QV; ++i)
    for (int j = 0; j < 4; ++j) {
      const uint8_t v = blk[i * 64 + 4 * c + j];
      if constexpr (P::NIBBLES) {
        q[8 * i + j] = v & 15;
        q[8 * i + 4 + j] = v >> 4;
      } else {
        q[4 * i + j] = v;
      }
    }
  if constexpr (P::NIBBLES) {
    uint8_t* qs = out + (P::MIN ? 4 : 2);
    for (int i = 0; i < 16; ++i) qs[i] = static_cast<uint8_t>(q[i] | (q[i + 16] << 4));
  } else {
    for (int k = 0; k < QK; ++k) out[2 + k] = q[k] ^ 0x80u;
  }
}

// Rows [r0, r1) of packed (nb blocks a row) as ggml's rows into out ([r1 - r0, nb * P::RAW]).
template <class P>
void unpack_rows(const uint8_t* packed, int64_t nb, int64_t r0, int64_t r1, uint8_t* out) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < nb; ++b)
      unpack_block<P>(packed + ((r / TN) * nb + b) * P::BB, static_cast<int>(r % TN),
                      out + ((r - r0) * nb + b) * P::RAW);
}

// The packed tensor's shape checked for format P: [N / 16, K / 32 * P::BB] uint8.
template <class P>
void check_packed(const char* op, const at::Tensor& packed) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous() && packed.size(1) % P::BB == 0,
              op, ": packed must be pack_q8p's contiguous uint8 tensor [N / 16, K / 32 * ", P::BB, "]");
}

// ggml's rows [N, K / 32 * RAW] of a pack_q8p tensor (the bytes pack_q8p was given).
at::Tensor unpack_q8p(const at::Tensor& packed, int64_t qtype) {
  at::Tensor out;
  dispatch_p(qtype, "unpack_q8p", [&]<class P>() {
    check_packed<P>("unpack_q8p", packed);
    const int64_t nb = packed.size(1) / P::BB, N = packed.size(0) * TN;
    out = at::empty({N, nb * P::RAW}, packed.options());
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    uint8_t* op = out.data_ptr<uint8_t>();
    at::parallel_for(0, N, TN, [&](int64_t r0, int64_t r1) { unpack_rows<P>(pp, nb, r0, r1, op + r0 * nb * P::RAW); });
  });
  return out;
}

// float32 rows ids of a pack_q8p tensor ([len(ids), K]): the same bits as dequantize_q on the
// rows it was packed from (an embedding over packed rows).
at::Tensor dequantize_q8p_rows(const at::Tensor& packed, int64_t qtype, const at::Tensor& ids_in) {
  at::Tensor out;
  dispatch_p(qtype, "dequantize_q8p_rows", [&]<class P>() {
    check_packed<P>("dequantize_q8p_rows", packed);
    const at::Tensor ids = ids_in.to(at::kLong).contiguous().view(-1);
    const int64_t nb = packed.size(1) / P::BB, N = packed.size(0) * TN, K = nb * QK, n = ids.numel();
    out = at::empty({n, K}, packed.options().dtype(at::kFloat));
    const int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "dequantize_q8p_rows: row ", ip[i], " of ", N);
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
      std::vector<uint8_t> row(nb * P::RAW);
      for (int64_t i = i0; i < i1; ++i) {
        unpack_rows<P>(pp, nb, ip[i], ip[i] + 1, row.data());
        baton_rows::dequantize_raw(P::ID, row.data(), nb * P::RAW, K, op + i * K, 0, 1);
      }
    });
  });
  return out;
}

at::Tensor pack_q8p(const at::Tensor& raw, int64_t qtype) {
  at::Tensor out;
  dispatch_p(qtype, "pack_q8p", [&]<class P>() {
    TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
                "pack_q8p: raw must be a contiguous CPU uint8 tensor [N, row_bytes]");
    const int64_t N = raw.size(0), row_bytes = raw.size(1), nb = row_bytes / P::RAW;
    TORCH_CHECK(row_bytes % P::RAW == 0, "pack_q8p: ", row_bytes, " bytes per row is not a whole number of ",
                P::RAW, "-byte blocks");
    TORCH_CHECK(N % TN == 0, "pack_q8p: ", N, " output rows is not a multiple of ", TN,
                ": keep this layer on linear_q8a");
    out = at::empty({N / TN, nb * P::BB}, raw.options());
    const uint8_t* rp = raw.data_ptr<uint8_t>();
    uint8_t* op = out.data_ptr<uint8_t>();
    at::parallel_for(0, N / TN, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t b = 0; b < nb; ++b) pack_block<P>(rp, row_bytes, t, b, op + (t * nb + b) * P::BB);
    });
  });
  return out;
}

// The number of inputs K of a packed tensor in format P.
template <class P>
int64_t packed_k(const at::Tensor& packed) {
  return packed.size(1) / P::BB * QK;
}

#if defined(BATON_Q8P_INT8)

// The rows of x a kernel call reads, quantized (baton_rows::QuantX): xq int8, dx and the integer
// sums of xq per block.
// Exact (three pieces): xq holds three planes of the same shape (plane values apart), dx the units'
// dx1 then (units later) their dx2, isum three planes of sums, xs each unit's float sum of x.
struct XView {
  const int8_t* xq;
  const float* dx;
  const int32_t* isum;
  int64_t K;
  int64_t plane = 0, units = 0;
  const float* xs = nullptr;
};

// x's rows [m, M) as a view of their own (the pieces' planes stay where they are).
inline XView rows_from(const XView& x, int64_t m) {
  const int64_t u = m * (x.K / QK);
  return XView{x.xq + m * x.K, x.dx + u, x.isum + u, x.K, x.plane, x.units, x.xs ? x.xs + u : nullptr};
}

// Calls fn(std::integral_constant<int, MR>{}, m) for x's rows four at a time from m = 0, then the
// 3, 2 or 1 left: the rows of x a kernel's pass over the weights takes.
template <class Fn>
inline void row_blocks(int64_t M, Fn&& fn) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) fn(std::integral_constant<int, 4>{}, m);
  switch (M - m) {
    case 3: fn(std::integral_constant<int, 3>{}, m); break;
    case 2: fn(std::integral_constant<int, 2>{}, m); break;
    case 1: fn(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// The float steps after a block's integer sums, on W's lanes (one output row each): W16 for the
// VNNI loop's 16 rows, W8 for the AVX2 loop's 8. One source, so both loops give the same bits.
#if defined(BATON_Q8P)
struct W16 {
  using F = __m512;
  using I = __m512i;
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I times254(I a) { return _mm512_sub_epi32(_mm512_slli_epi32(a, 8), _mm512_slli_epi32(a, 1)); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F splat(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};
// The VNNI loop sums unsigned bytes: Q4_0's and Q8_0's carry their offset.
template <class P>
constexpr bool OFF16 = P::Z != 0;
#else
struct W8 {
  using F = __m256;
  using I = __m256i;
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I times254(I a) { return _mm256_sub_epi32(_mm256_slli_epi32(a, 8), _mm256_slli_epi32(a, 1)); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F splat(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};
// The AVX2 loop sums Q8_0's signed w: only Q4_0's nibbles carry their offset.
template <class P>
constexpr bool OFF8 = P::Z != 0 && P::NIBBLES;
#endif

// acc + one block of one row of x: s its exact integer sums (W's rows of the tile), unit u of x.
// OFF: s carries the format's offset Z (sums of unsigned bytes), taken out through x's block sum.
template <class P, class W, bool OFF>
inline typename W::F add_block(typename W::F acc, typename W::I s, typename W::F d, typename W::F mn, const XView& x,
                               int64_t u) {
  if constexpr (OFF) s = W::sub(s, W::set1(P::Z * x.isum[u]));
  const float dx = x.dx[u];
  acc = W::fmadd(W::cvt(s), W::mul(d, W::splat(dx)), acc);
  if constexpr (P::MIN) acc = W::fmadd(mn, W::splat(dx * static_cast<float>(x.isum[u])), acc);
  return acc;
}

// acc + one block of one row of x in three pieces (split_rows): s0, s1, s2 the exact integer sums
// by each piece. The pieces' sum 254 s0 + s1 stays an exact integer (|.| < 2^24 for Q4 formats, so
// its float is exact too), then one rounding joins s2's term.
template <class P, class W, bool OFF>
inline typename W::F add_block_exact(typename W::F acc, typename W::I s0, typename W::I s1, typename W::I s2,
                                     typename W::F d, typename W::F mn, const XView& x, int64_t u) {
  if constexpr (OFF) {
    const int64_t pu = x.units;
    s0 = W::sub(s0, W::set1(P::Z * x.isum[u]));
    s1 = W::sub(s1, W::set1(P::Z * x.isum[pu + u]));
    s2 = W::sub(s2, W::set1(P::Z * x.isum[2 * pu + u]));
  }
  const typename W::I t = W::add(W::times254(s0), s1);
  const typename W::F v = W::fmadd(W::cvt(t), W::splat(x.dx[u]), W::mul(W::cvt(s2), W::splat(x.dx[x.units + u])));
  acc = W::fmadd(v, d, acc);
  if constexpr (P::MIN) acc = W::fmadd(mn, W::splat(x.xs[u]), acc);
  return acc;
}

#endif  // BATON_Q8P_INT8

#if defined(BATON_Q8P)

// A block's 16 scales d (and Q4_1's offsets mn) from its float16 tail.
template <class P>
inline void block_scales(const uint8_t* blk, __m512& d, __m512& mn) {
  const uint8_t* scales = blk + P::QV * 64;
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
  if constexpr (P::MIN) mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + 2 * TN)));
}

// Quant vector i of a Q4 block as bytes: 2i its low nibbles, 2i + 1 its high ones.
inline __m512i nibbles(const uint8_t* blk, int j) {
  const __m512i v = _mm512_loadu_si512(blk + 64 * (j / 2)), low = _mm512_set1_epi8(15);
  return _mm512_and_si512(j % 2 ? _mm512_srli_epi16(v, 4) : v, low);
}

// y[m, n0 + c] = acc[m] + bias for rows m in [0, M), where lo <= n0 + c < hi.
inline void store_tile(const __m512* acc, int64_t stride, int64_t M, const float* bias, float* y, int64_t ys,
                       int64_t n0, int64_t lo, int64_t hi) {
  const int64_t a = std::max<int64_t>(lo - n0, 0), e = std::min<int64_t>(hi - n0, TN);
  const __mmask16 mask = static_cast<__mmask16>(((1u << e) - 1u) & ~((1u << a) - 1u));
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * ys + n0, mask, _mm512_add_ps(acc[m * stride], bv));
}

// The 16 rows' exact integer sums of a block's unsigned weight bytes w times the 32 signed bytes at
// xq. Two partial sums (one vpdpbusd chain waits on its latency).
inline __m512i piece_sum(const __m512i* w, const int8_t* xq) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int i = 0; i < 8; i += 2) {
    int32_t a0, a1;
    std::memcpy(&a0, xq + 4 * i, 4);
    std::memcpy(&a1, xq + 4 * i + 4, 4);
    s0 = _mm512_dpbusd_epi32(s0, w[i], _mm512_set1_epi32(a0));
    s1 = _mm512_dpbusd_epi32(s1, w[i + 1], _mm512_set1_epi32(a1));
  }
  return _mm512_add_epi32(s0, s1);
}

// y[m, 16 t + c] for rows m of x in [0, MR) and COLS tiles from tile t, written where
// lo <= 16 t + c < hi (a thread's share need not start on a tile). EX: x in three pieces
// (split_rows), else quantized to int8.
template <class P, int MR, int COLS, bool EX, bool L2>
inline void tiles(const XView& x, const uint8_t* pw, int64_t nb, int64_t t, const float* bias, float* y, int64_t ys,
                  int64_t lo, int64_t hi) {
  __m512 acc[MR][COLS];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < COLS; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int c = 0; c < COLS; ++c) {
      const uint8_t* blk = pw + ((t + c) * nb + b) * P::BB;
      // a tile's blocks are one stream, COLS streams at once; past a tile's end the next tile's
      // blocks follow in memory, so the prefetch runs on into them (it never faults past the end)
      for (int l = 0; l < P::BB; l += 64) __builtin_prefetch(blk + PREFETCH * P::BB + l, 0, L2 ? 1 : 3);
      __m512i w[8];
      for (int i = 0; i < 8; ++i) w[i] = P::NIBBLES ? nibbles(blk, i) : _mm512_loadu_si512(blk + 64 * i);
      __m512 d, mn;
      block_scales<P>(blk, d, mn);
      for (int m = 0; m < MR; ++m) {
        const int64_t xb = m * x.K + b * QK, u = m * (x.K / QK) + b;
        if constexpr (EX) {
          acc[m][c] = add_block_exact<P, W16, OFF16<P>>(acc[m][c], piece_sum(w, x.xq + xb),
                                                        piece_sum(w, x.xq + x.plane + xb),
                                                        piece_sum(w, x.xq + 2 * x.plane + xb), d, mn, x, u);
        } else {
          acc[m][c] = add_block<P, W16, OFF16<P>>(acc[m][c], piece_sum(w, x.xq + xb), d, mn, x, u);
        }
      }
    }
  }
  for (int c = 0; c < COLS; ++c) store_tile(&acc[0][c], COLS, MR, bias, y, ys, (t + c) * TN, lo, hi);
}

// Rows [0, MR) of x over tiles [t0, t1). L2 (stream_into_l2): one tile at a time, its blocks
// prefetched into L2; else four tiles at a time at one or two rows (the x broadcasts shared), two
// at three or four rows (accumulators stay in registers), prefetched into L1.
template <class P, int MR, bool EX, bool L2>
void tile_range(const XView& x, const uint8_t* pw, int64_t nb, int64_t t0, int64_t t1, const float* bias, float* y,
                int64_t ys, int64_t lo, int64_t hi) {
  constexpr int COLS = L2 ? 1 : MR <= 2 ? 4 : 2;
  int64_t t = t0;
  for (; t + COLS <= t1; t += COLS) tiles<P, MR, COLS, EX, L2>(x, pw, nb, t, bias, y, ys, lo, hi);
  for (; t < t1; ++t) tiles<P, MR, 1, EX, L2>(x, pw, nb, t, bias, y, ys, lo, hi);
}

#if defined(BATON_Q8P_AMX)
// Rows of x from which packed_rows_p takes the AMX tiles (below: the VNNI loop above). A tile
// multiplies 16 rows for the price of one, but each block's int32 sums go through memory to the
// per-row float steps: on a 2-core Xeon (30 Q4_1 layers, 2 threads, medians of 3 alternating
// runs) tiles took 9.2 against 8.5 ms at 5 rows, 10.8 against 10.5 at 8, 16.9 against 20.2 at 16.
constexpr int64_t AMX_MIN_ROWS = 12;
// The same for x in three pieces (linear_qp), where the VNNI loop runs three chains per block and
// amx_tile_exact hides the sums' trip through memory a block ahead (same host and layers, medians
// of 7, three alternating runs each: 4 rows 12.6-14.2 against 10.7-12.2 ms, 8 rows 15.5-19.7
// against 15.0-20.3, 12 rows 19.2-22.2 against 21.0-31.5, 16 rows 22.4-33.4 against 26.5-50.3, 64
// rows 93-97 against 153-158).
constexpr int64_t AMX_MIN_ROWS_EXACT = 8;

// _tile_loadconfig's 64-byte layout (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Whether this process may run tile instructions: Linux grants tile data per process only after
// arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA), and the first tile instruction without it is a
// SIGILL. baton.kernels.loader asks before it loads the library, but a process that loads the
// library by itself must not crash: the library asks once too, and takes the VNNI loop where the
// answer is no or BATON_NO_AMX is set (kernels/os_grant.py's switch).
bool amx_usable() {
  static const bool ok = [] {
    const char* off = std::getenv("BATON_NO_AMX");
    if (off != nullptr && off[0] != '\0' && !(off[0] == '0' && off[1] == '\0')) return false;
#if defined(__linux__) && defined(__x86_64__)
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

// Configures this thread's tiles for M rows of x (amx_tile's shapes); _tile_release() undoes it.
// Tiles 0 and 3-7 hold sums (C: amx_tile uses 0, amx_tile_exact all six), 1 x (A), 2 weights (B).
void amx_configure(int64_t M) {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int c : {0, 3, 4, 5, 6, 7}) {
    cfg.rows[c] = static_cast<uint8_t>(M);
    cfg.colsb[c] = 64;  // C: M x 16 int32
  }
  cfg.rows[1] = static_cast<uint8_t>(M);
  cfg.colsb[1] = QK;  // A: M x 32 int8 (one block of x)
  cfg.rows[2] = QK / 4;
  cfg.colsb[2] = 64;  // B: 8 x (16 rows x 4 bytes)
  // GCC does not see _tile_loadconfig read cfg: without this barrier it dropped the shape stores
  // above as dead and reused cfg's stack slot (a SIGILL at the first tile load).
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// A block's 8 x 64 weight bytes into tile 2 (AMX's B layout is the packed one): Q4 nibbles
// widened to bytes in wb first, Q8_0's bytes as they are.
template <class P>
inline void amx_load_weights(const uint8_t* blk, uint8_t (*wb)[64]) {
  if constexpr (P::NIBBLES) {
    for (int i = 0; i < 8; ++i) _mm512_store_si512(wb[i], nibbles(blk, i));
    _tile_loadd(2, wb, 64);
  } else {
    _tile_loadd(2, blk, 64);
  }
}

// Rows [0, M) of x (M <= 16, the tiles configured for M) over tile t, as tiles() computes them:
// per block, one TDPBSUD of x's M x 32 int8 bytes (tile 1) by the block's 8 x 64 weight bytes
// (tile 2: the packed layout is AMX's B layout, 4 bytes of each of 16 rows per 64) into 16 int32
// sums per row (tile 0), then the same float steps per row as tiles(): the integer sums are exact
// either way, so a row gets the same bits on tiles as on the VNNI loop (batch invariance holds
// across the switch).
template <class P>
void amx_tile(const XView& x, int64_t M, const uint8_t* pw, int64_t nb, int64_t t, const float* bias, float* y,
              int64_t ys, int64_t lo, int64_t hi) {
  alignas(64) int32_t c[16][TN];
  alignas(64) uint8_t wb[8][64];  // a Q4 block's nibbles as bytes
  __m512 acc[16];
  for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t units = x.K / QK;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = pw + (t * nb + b) * P::BB;
    amx_load_weights<P>(blk, wb);
    _tile_zero(0);
    _tile_loadd(1, x.xq + b * QK, x.K);
    _tile_dpbsud(0, 1, 2);  // signed x by unsigned weight bytes
    _tile_stored(0, c, 64);
    __m512 d, mn;
    block_scales<P>(blk, d, mn);
    for (int64_t m = 0; m < M; ++m)
      acc[m] = add_block<P, W16, OFF16<P>>(acc[m], _mm512_load_si512(c[m]), d, mn, x, m * units + b);
  }
  store_tile(acc, 1, M, bias, y, ys, t * TN, lo, hi);
}

// x's three pieces of block b (rows as configured) by its weights (tile 2, loaded) into tiles C0,
// C1, C2, stored to c. A macro: GCC's tile intrinsics take the tile's number as written.
#define BATON_AMX_PIECES(C0, C1, C2, x, b, c)          \
  do {                                                 \
    const int8_t* xb_ = (x).xq + (b) * QK;             \
    _tile_zero(C0);                                    \
    _tile_zero(C1);                                    \
    _tile_zero(C2);                                    \
    _tile_loadd(1, xb_, (x).K);                        \
    _tile_dpbsud(C0, 1, 2);                            \
    _tile_loadd(1, xb_ + (x).plane, (x).K);            \
    _tile_dpbsud(C1, 1, 2);                            \
    _tile_loadd(1, xb_ + 2 * (x).plane, (x).K);        \
    _tile_dpbsud(C2, 1, 2);                            \
    _tile_stored(C0, (c)[0], 64);                      \
    _tile_stored(C1, (c)[1], 64);                      \
    _tile_stored(C2, (c)[2], 64);                      \
  } while (0)

// amx_tile for x in three pieces, one block ahead: block b's tile work (sums into tiles 0, 3, 4 or
// 5, 6, 7, alternating) is issued before block b - 1's float steps, which read the sums stored a
// block earlier (a tile's sums reach the vector loads through memory). The float steps are
// add_block_exact's in block order, so the same bits as tiles<P, MR, COLS, true>.
template <class P>
void amx_tile_exact(const XView& x, int64_t M, const uint8_t* pw, int64_t nb, int64_t t, const float* bias,
                    float* y, int64_t ys, int64_t lo, int64_t hi) {
  alignas(64) int32_t c[2][3][16][TN];
  alignas(64) uint8_t wb[8][64];
  __m512 acc[16], d[2], mn[2];
  for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t units = x.K / QK;
  auto issue = [&](int64_t b) {
    const uint8_t* blk = pw + (t * nb + b) * P::BB;
    __builtin_prefetch(blk + 2 * P::BB, 0, 3);
    amx_load_weights<P>(blk, wb);
    if (b & 1)
      BATON_AMX_PIECES(5, 6, 7, x, b, c[1]);
    else
      BATON_AMX_PIECES(0, 3, 4, x, b, c[0]);
    block_scales<P>(blk, d[b & 1], mn[b & 1]);
  };
  auto finish = [&](int64_t b) {
    const int h = static_cast<int>(b & 1);
    for (int64_t m = 0; m < M; ++m)
      acc[m] = add_block_exact<P, W16, OFF16<P>>(acc[m], _mm512_load_si512(c[h][0][m]),
                                                 _mm512_load_si512(c[h][1][m]), _mm512_load_si512(c[h][2][m]), d[h],
                                                 mn[h], x, m * units + b);
  };
  issue(0);
  for (int64_t b = 1; b < nb; ++b) {
    issue(b);
    finish(b - 1);
  }
  finish(nb - 1);
  store_tile(acc, 1, M, bias, y, ys, t * TN, lo, hi);
}
#endif  // BATON_Q8P_AMX

template <class P, bool EX>
void packed_rows_p(const XView& x, int64_t M, const uint8_t* pw, int64_t nb, const float* bias, float* y, int64_t N,
                   int64_t n0, int64_t n1) {
  if (n0 >= n1) return;
  const int64_t t0 = n0 / TN, t1 = (n1 + TN - 1) / TN;
#if defined(BATON_Q8P_AMX)
  if (M >= (EX ? AMX_MIN_ROWS_EXACT : AMX_MIN_ROWS) && amx_usable()) {
    for (int64_t m = 0; m < M; m += 16) {
      const int64_t rows = std::min<int64_t>(16, M - m);
      amx_configure(rows);
      for (int64_t t = t0; t < t1; ++t) {
        if constexpr (EX)
          amx_tile_exact<P>(rows_from(x, m), rows, pw, nb, t, bias, y + m * N, N, n0, n1);
        else
          amx_tile<P>(rows_from(x, m), rows, pw, nb, t, bias, y + m * N, N, n0, n1);
      }
      _tile_release();
    }
    return;
  }
#endif
  // more than four rows of x pass over the tiles several times: CHUNK_TILES at a time, so that
  // the passes after the first read them from L2 (an LM head is tens of MB)
  const int64_t step = M > 4 ? CHUNK_TILES : t1 - t0;
  const bool l2 = stream_into_l2();
  for (int64_t c0 = t0; c0 < t1; c0 += step) {
    const int64_t c1 = std::min(t1, c0 + step);
    row_blocks(M, [&](auto mr, int64_t m) {
      if (l2)
        tile_range<P, decltype(mr)::value, EX, true>(rows_from(x, m), pw, nb, c0, c1, bias, y + m * N, N, n0, n1);
      else
        tile_range<P, decltype(mr)::value, EX, false>(rows_from(x, m), pw, nb, c0, c1, bias, y + m * N, N, n0, n1);
    });
  }
}

#endif  // BATON_Q8P

#if defined(BATON_Q8P_AVX2)
// The AVX2 loop (no VNNI): a tile's 16 rows run as two halves of 8, a 256-bit vector holding 4
// bytes of each of 8 rows (the 64-byte vectors' two halves), each half over all of the tile's
// blocks (its bytes stay in L1 for the second). vpmaddubsw multiplies the unsigned weight bytes by
// the signed xq and adds pairs into int16, vpmaddwd the pairs of those into int32: vpdpbusd's sums.
// Q4 nibbles are at most 15, so a block's 8 groups of 4 add up in int16 (8 x 2 x 15 x 127 = 30480
// < 2^15) before one vpmaddwd; Q8_0's bytes (w + 128) would overflow the int16 pairs, so each group
// multiplies |w| by xq with w's sign and widens at once (the integer w . xq, no offset term). Exact
// x (linear_qp) runs the three pieces so. The float steps are add_block's (add_block_exact's), lane
// for lane: the same bits as the VNNI loop, any rows beside.

// A block's 8 scales d (and Q4_1's offsets mn) of half h.
template <class P>
inline void half_scales(const uint8_t* blk, int h, __m256& d, __m256& mn) {
  const uint8_t* scales = blk + P::QV * 64 + 16 * h;
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
  if constexpr (P::MIN) mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 2 * TN)));
}

// The weights of group g (inputs 4g .. 4g + 3) of a block for the 8 rows of half h: Q4 vector g / 2's
// low (g even) or high nibbles, Q8_0's vector g.
template <class P>
inline __m256i half_group(const uint8_t* blk, int h, int g) {
  if constexpr (P::NIBBLES) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * (g / 2) + 32 * h));
    return _mm256_and_si256(g % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32 * h));
  }
}

// Bytes 4g .. 4g + 3 of x's block in every 32-bit lane (one group's inputs for 8 weight rows).
inline __m256i x_group(const int8_t* xq, int g) {
  int32_t a;
  std::memcpy(&a, xq + 4 * g, 4);
  return _mm256_set1_epi32(a);
}

// Q8_0's stored bytes (w + 128) as the signed w.
inline __m256i q8_signed(__m256i w) { return _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))); }

// The int32 sums of a Q8_0 group's signed weights q (aq = |q|) times the group's x bytes bx: |q| by
// bx with q's sign, widened at once (the int16 pairs cannot overflow, but 8 groups of them could).
inline __m256i q8_group_sum(__m256i q, __m256i aq, __m256i bx, __m256i ones) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(bx, q)), ones);
}

// half_sum's sums for R rows of x at once (xs[r]: row r's 32 bytes of the block): each group's
// weights unpacked once, then every row's vpmaddubsw. With the 8 groups held in registers for one
// row after another (half_sum), three or four rows spilled sums to the stack; here the R sums stay
// in registers, and the empty asm keeps them there: without it GCC reassociates each row's adds
// into a tree and spills the products instead. Integer sums: the same values in any order. AMD Zen
// 4 built for AVX2, 2 threads, 30 SmolLM2 layers of Q4_1, alternating processes: 64 rows of x 0.84x
// the time of half_sum's way (median of 10 pairs), 16 rows 0.83x, 4 rows 0.92x; the Q8_0 head at
// 64 rows 0.86x.
template <class P, int R>
inline void half_sums(const uint8_t* blk, int h, const int8_t* const* xs, __m256i* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int g = 0; g < 8; ++g) {
    const __m256i w = half_group<P>(blk, h, g);
    if constexpr (P::NIBBLES) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(w, x_group(xs[r], g)));
        asm("" : "+x"(s[r]));
      }
    } else {
      const __m256i q = q8_signed(w), aq = _mm256_sign_epi8(q, q);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        s[r] = _mm256_add_epi32(s[r], q8_group_sum(q, aq, x_group(xs[r], g), ones));
        asm("" : "+x"(s[r]));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) out[r] = P::NIBBLES ? _mm256_madd_epi16(s[r], ones) : s[r];
}

// The 8 rows' integer sums of a block's weights w (half_group's 8 groups) times the 32 bytes at xq:
// the unsigned bytes' for Q4 (as vpdpbusd's), the signed w's for Q8_0.
template <class P>
inline __m256i half_sum(const __m256i* w, const int8_t* xq) {
  auto bx = [&](int g) { return x_group(xq, g); };
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (P::NIBBLES) {
    __m256i s0 = _mm256_maddubs_epi16(w[0], bx(0)), s1 = _mm256_maddubs_epi16(w[1], bx(1));
    for (int g = 2; g < 8; g += 2) {
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[g], bx(g)));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[g + 1], bx(g + 1)));
    }
    return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
  } else {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i q = q8_signed(w[g]);
      const __m256i p = q8_group_sum(q, _mm256_sign_epi8(q, q), bx(g), ones);
      if (g % 2) s1 = _mm256_add_epi32(s1, p); else s0 = _mm256_add_epi32(s0, p);
    }
    return _mm256_add_epi32(s0, s1);
  }
}

// y[m, n0 + c] = acc[m] + bias for rows m in [0, M) and the 8 outputs from n0, where lo <= n0 + c < hi.
inline void store_half(const __m256* acc, int64_t M, const float* bias, float* y, int64_t ys, int64_t n0, int64_t lo,
                       int64_t hi) {
  const __m256i c = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_and_si256(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(static_cast<int>(lo - n0 - 1))),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(hi - n0)), c));
  const __m256 bv = bias ? _mm256_maskload_ps(bias + n0, mask) : _mm256_setzero_ps();
  for (int64_t m = 0; m < M; ++m) _mm256_maskstore_ps(y + m * ys + n0, mask, _mm256_add_ps(acc[m], bv));
}

// y[m, 16 t + 8 h + c] for rows m of x in [0, MR) and halves h in [h0, h0 + HN), written where
// lo <= 16 t + 8 h + c < hi.
template <class P, int MR, int HN, bool EX>
void avx2_half(const XView& x, const uint8_t* pw, int64_t nb, int64_t t, int h0, const float* bias, float* y,
               int64_t ys, int64_t lo, int64_t hi) {
  __m256 acc[HN][MR];
  for (int h = 0; h < HN; ++h)
    for (int m = 0; m < MR; ++m) acc[h][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = pw + (t * nb + b) * P::BB;
    if (h0 == 0)  // a second pass over the other half reads the tile again from L1
      for (int l = 0; l < P::BB; l += 64) __builtin_prefetch(blk + PREFETCH * P::BB + l, 0, 3);
    for (int h = h0; h < h0 + HN; ++h) {
      __m256 d, mn;
      half_scales<P>(blk, h, d, mn);
      // three or four rows: each group's weights taken once for every sum (half_sums), int8 x's
      // rows all at once, exact x's three pieces a row at a time (12 sums would not fit; 16 rows
      // of exact x 0.89x the time of half_sum's way); one or two rows: the 8 groups held for
      // every row (half_sum), both halves in a pass
      if constexpr (MR >= 3 && EX) {
        for (int m = 0; m < MR; ++m) {
          const int8_t* xb = x.xq + m * x.K + b * QK;
          const int8_t* xs[3] = {xb, xb + x.plane, xb + 2 * x.plane};
          __m256i s[3];
          half_sums<P, 3>(blk, h, xs, s);
          acc[h - h0][m] = add_block_exact<P, W8, OFF8<P>>(acc[h - h0][m], s[0], s[1], s[2], d, mn, x,
                                                            m * (x.K / QK) + b);
        }
      } else if constexpr (MR >= 3) {
        const int8_t* xs[MR];
        for (int m = 0; m < MR; ++m) xs[m] = x.xq + m * x.K + b * QK;
        __m256i s[MR];
        half_sums<P, MR>(blk, h, xs, s);
        for (int m = 0; m < MR; ++m)
          acc[h - h0][m] = add_block<P, W8, OFF8<P>>(acc[h - h0][m], s[m], d, mn, x, m * (x.K / QK) + b);
      } else {
        __m256i w[8];
        for (int g = 0; g < 8; ++g) w[g] = half_group<P>(blk, h, g);
        for (int m = 0; m < MR; ++m) {
          const int8_t* xb = x.xq + m * x.K + b * QK;
          __m256& a = acc[h - h0][m];
          if constexpr (EX)
            a = add_block_exact<P, W8, OFF8<P>>(a, half_sum<P>(w, xb), half_sum<P>(w, xb + x.plane),
                                                half_sum<P>(w, xb + 2 * x.plane), d, mn, x, m * (x.K / QK) + b);
          else
            a = add_block<P, W8, OFF8<P>>(a, half_sum<P>(w, xb), d, mn, x, m * (x.K / QK) + b);
        }
      }
    }
  }
  for (int h = 0; h < HN; ++h) store_half(acc[h], MR, bias, y, ys, t * TN + 8 * (h0 + h), lo, hi);
}

// packed_rows_p's work on AVX2 (EX: x in three pieces, else int8): rows of x four at a time (then 3,
// 2 or 1) over the tiles' halves that hold outputs in [n0, n1). (Each tile's rows of x in turn, the tile kept in L1,
// measured no faster: 100 rows 94-118 against 86-90 ms.)
template <class P, bool EX>
void avx2_rows(const XView& x, int64_t M, const uint8_t* pw, int64_t nb, const float* bias, float* y, int64_t N,
               int64_t n0, int64_t n1) {
  row_blocks(M, [&](auto mr, int64_t m) {
    constexpr int MR = decltype(mr)::value;
    // one or two rows of x: both halves in one pass over the tile (2 threads, 30 Q4_1 layers, AMD
    // Zen 4 built for AVX2: one row 3.2 against 3.5 ms); more: a half a pass (four rows 5.0 against
    // 5.7: the halves' accumulators and weights no longer fit 16 registers)
    constexpr int HN = MR <= 2 ? 2 : 1;
    const XView xm = rows_from(x, m);
    for (int64_t t = n0 / TN; t * TN < n1; ++t) {
      const bool h0 = t * TN + 8 > n0, h1 = t * TN + 8 < n1;  // the halves holding outputs in [n0, n1)
      if (HN == 2 && h0 && h1) {
        avx2_half<P, MR, 2, EX>(xm, pw, nb, t, 0, bias, y + m * N, N, n0, n1);
      } else {
        if (h0) avx2_half<P, MR, 1, EX>(xm, pw, nb, t, 0, bias, y + m * N, N, n0, n1);
        if (h1) avx2_half<P, MR, 1, EX>(xm, pw, nb, t, 1, bias, y + m * N, N, n0, n1);
      }
    }
  });
}
#endif  // BATON_Q8P_AVX2

#if defined(BATON_Q8P_INT8)
// Rows [r0, r1) of x [M, K] quantized to int8 into prep (laid out for M rows).
void quantize_rows(const float* x, int64_t K, int64_t r0, int64_t r1, baton_rows::QuantX& prep) {
  const int64_t nb = K / QK;
  baton_rows::quantize_x(x + r0 * K, r1 - r0, K, prep.xq.data() + r0 * K, prep.dx.data() + r0 * nb, nullptr, QK);
  for (int64_t u = r0 * nb; u < r1 * nb; ++u) {
    int32_t s = 0;
    for (int j = 0; j < QK; ++j) s += prep.xq[u * QK + j];
    prep.isum[u] = s;
  }
}

#endif  // BATON_Q8P_INT8

#if defined(BATON_Q8P_INT8)
// The steps between the three pieces: each piece resolves what the one before left in 254 steps,
// so every piece is an int8 in [-127, 127].
constexpr double PIECE = 254.0;

// The next float above f >= 0 (std::nextafter(f, INFINITY) without the call: the library call
// made every caller spill its vector registers).
inline float next_up(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 1;
  std::memcpy(&f, &b, 4);
  return f;
}

// A block's two piece scales for its largest magnitude a: dx1 ~ a / (127 * 254), dx2 ~ dx1 / 254,
// rounded up so that no piece leaves [-127, 127].
inline void piece_scales(double a, float& dx1, float& dx2) {
  dx1 = static_cast<float>(a / (127.0 * PIECE));
  while (static_cast<double>(dx1) * 127.0 * PIECE < a) dx1 = next_up(dx1);
  dx2 = static_cast<float>(dx1 / PIECE);
  while (static_cast<double>(dx2) * PIECE < dx1) dx2 = next_up(dx2);
}

#endif  // BATON_Q8P_INT8

#if defined(BATON_Q8P)
// Rounds half to even, 8 doubles.
inline __m512d round8(__m512d v) { return _mm512_roundscale_pd(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

// Lane j: the eight lanes of v[j] joined by op in _mm512_reduce_add_pd's order, ((l0 . l4) .
// (l2 . l6)) . ((l1 . l5) . (l3 . l7)), for eight vectors at once.
template <class Op>
inline __m512d across8(const __m512d* v, Op op) {
  __m512d s[4], q[2];
  for (int p = 0; p < 4; ++p)
    s[p] = op(_mm512_shuffle_f64x2(v[2 * p], v[2 * p + 1], 0x44), _mm512_shuffle_f64x2(v[2 * p], v[2 * p + 1], 0xEE));
  for (int p = 0; p < 2; ++p)
    q[p] = op(_mm512_shuffle_f64x2(s[2 * p], s[2 * p + 1], 0x88), _mm512_shuffle_f64x2(s[2 * p], s[2 * p + 1], 0xDD));
  const __m512d r = op(_mm512_unpacklo_pd(q[0], q[1]), _mm512_unpackhi_pd(q[0], q[1]));  // v0 v4 v1 v5 v2 v6 v3 v7
  return _mm512_permutexvar_pd(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), r);
}

// x in three int8 pieces per 32 values:
//   x = dx1 * (254 q0 + q1) + dx2 * q2 + e,  |e| <= dx2 / 2 ~ max |x| / 2^23.3,
// dx1 ~ max |x| / (127 * 254) and dx2 ~ dx1 / 254 (float32, rounded up so that no piece leaves
// [-127, 127]). The split runs in double, where each residual is exact; so a block's dot product
// with integer weights is its exact integer sums times two float scales, within a float32
// rounding of x . q. Also each block's sum of x (float32 of the exact sum) for Q4_1's offsets.
// Rows [r0, r1) of x [M, K] into prep, laid out for M rows (three planes of M * K bytes). Eight
// blocks at a time: their maxima, sums and scales on eight lanes (piece_scales' roundings and
// steps up, the sums in _mm512_reduce_add_pd's order, so the same bits as one block at a time,
// 25% faster).
void split_rows(const float* x, int64_t M, int64_t K, int64_t r0, int64_t r1, baton_rows::QuantX& prep) {
  const int64_t units = M * K / QK, plane = M * K, u1 = r1 * (K / QK);
  const __m512d lim = _mm512_set1_pd(127.0), nlim = _mm512_set1_pd(-127.0), zero = _mm512_setzero_pd();
  const __m512d piece = _mm512_set1_pd(PIECE);
  auto max8 = [](__m512d p, __m512d q) { return _mm512_max_pd(p, q); };
  auto add8 = [](__m512d p, __m512d q) { return _mm512_add_pd(p, q); };
  // float32 lanes of f one step up where `low` says (next_up on eight lanes)
  auto step_up = [](__m256 f, __mmask8 low) {
    const __m256i b = _mm256_castps_si256(f);
    return _mm256_castsi256_ps(_mm256_mask_add_epi32(b, low, b, _mm256_set1_epi32(1)));
  };
  for (int64_t g = r0 * (K / QK); g < u1; g += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, u1 - g));
    const __mmask8 live = static_cast<__mmask8>((1u << n) - 1u);
    __m512d amax[8], sum[8];
    for (int j = 0; j < 8; ++j) {
      amax[j] = sum[j] = zero;
      for (int i = 0; i < 4 && j < n; ++i) {
        const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + (g + j) * QK + 8 * i));
        amax[j] = _mm512_max_pd(amax[j], _mm512_abs_pd(v));
        sum[j] = _mm512_add_pd(sum[j], v);
      }
    }
    const __m512d a = across8(amax, max8);
    __m256 dx1 = _mm512_cvtpd_ps(_mm512_div_pd(a, _mm512_set1_pd(127.0 * PIECE)));
    while (const __mmask8 low = _mm512_mask_cmp_pd_mask(
               live, _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtps_pd(dx1), lim), piece), a, _CMP_LT_OQ))
      dx1 = step_up(dx1, low);
    const __m512d d1 = _mm512_cvtps_pd(dx1), d0 = _mm512_mul_pd(d1, piece);
    __m256 dx2 = _mm512_cvtpd_ps(_mm512_div_pd(d1, piece));
    while (const __mmask8 low =
               _mm512_mask_cmp_pd_mask(live, _mm512_mul_pd(_mm512_cvtps_pd(dx2), piece), d1, _CMP_LT_OQ))
      dx2 = step_up(dx2, low);
    _mm256_mask_storeu_ps(prep.dx.data() + g, live, dx1);
    _mm256_mask_storeu_ps(prep.dx.data() + units + g, live, dx2);
    _mm256_mask_storeu_ps(prep.xsum.data() + g, live, _mm512_cvtpd_ps(across8(sum, add8)));
    // a block whose max is 0 (or NaN) takes reciprocals 0, as piece_scales' callers did
    const __mmask8 pos = _mm512_cmp_pd_mask(a, zero, _CMP_GT_OQ);
    const __m512d one = _mm512_set1_pd(1.0);
    alignas(64) double s0[8], s1[8], i0[8], i1[8], i2[8];
    _mm512_store_pd(s0, d0);
    _mm512_store_pd(s1, d1);
    _mm512_store_pd(i0, _mm512_maskz_div_pd(pos, one, d0));
    _mm512_store_pd(i1, _mm512_maskz_div_pd(pos, one, d1));
    _mm512_store_pd(i2, _mm512_maskz_div_pd(pos, one, _mm512_cvtps_pd(dx2)));
    __m512d qsum[3][8];  // each block's pieces summed per lane (integers: exact in any order)
    auto clamp = [&](__m512d q) { return _mm512_max_pd(_mm512_min_pd(q, lim), nlim); };
    for (int j = 0; j < 8; ++j) {
      qsum[0][j] = qsum[1][j] = qsum[2][j] = zero;
      if (j >= n) continue;
      const int64_t u = g + j;
      const __m512d vs0 = _mm512_set1_pd(s0[j]), vs1 = _mm512_set1_pd(s1[j]), vi0 = _mm512_set1_pd(i0[j]),
                    vi1 = _mm512_set1_pd(i1[j]), vi2 = _mm512_set1_pd(i2[j]);
      for (int i = 0; i < 4; ++i) {
        const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + u * QK + 8 * i));
        const __m512d q0 = clamp(round8(_mm512_mul_pd(v, vi0)));
        const __m512d rr1 = _mm512_fnmadd_pd(q0, vs0, v);  // exact: q0 * dx1 * 254 has < 53 bits
        const __m512d q1 = clamp(round8(_mm512_mul_pd(rr1, vi1)));
        const __m512d rr2 = _mm512_fnmadd_pd(q1, vs1, rr1);
        const __m512d q2 = clamp(round8(_mm512_mul_pd(rr2, vi2)));
        const __m512d q[3] = {q0, q1, q2};
        for (int p = 0; p < 3; ++p) {
          _mm_storel_epi64(reinterpret_cast<__m128i*>(prep.xq.data() + p * plane + u * QK + 8 * i),
                           _mm256_cvtsepi32_epi8(_mm512_cvtpd_epi32(q[p])));
          qsum[p][j] = _mm512_add_pd(qsum[p][j], q[p]);
        }
      }
    }
    for (int p = 0; p < 3; ++p)
      _mm256_mask_storeu_epi32(prep.isum.data() + p * units + g, live, _mm512_cvtpd_epi32(across8(qsum[p], add8)));
  }
}

#elif defined(BATON_Q8P_AVX2)
// split_rows on AVX2: the same steps in vectors of 4 doubles (the same values: each step is exact
// or one rounding of the same operands; the block's double sum of x is exact for any order but the
// most extreme ranges, as it is in split_rows).
void split_rows(const float* x, int64_t M, int64_t K, int64_t r0, int64_t r1, baton_rows::QuantX& prep) {
  const int64_t units = M * K / QK, plane = M * K;
  const __m256d sign = _mm256_set1_pd(-0.0), lim = _mm256_set1_pd(127.0), nlim = _mm256_set1_pd(-127.0);
  auto round4 = [](__m256d v) { return _mm256_round_pd(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); };
  auto clamp = [&](__m256d q) { return _mm256_max_pd(_mm256_min_pd(q, lim), nlim); };
  auto bytes = [](__m256d q, int8_t* out) {  // 4 integral doubles in [-127, 127] as int8
    const __m128i i = _mm256_cvtpd_epi32(q);
    const int32_t b = _mm_cvtsi128_si32(_mm_packs_epi16(_mm_packs_epi32(i, i), _mm_setzero_si128()));
    std::memcpy(out, &b, 4);
    return i;
  };
  for (int64_t u = r0 * (K / QK); u < r1 * (K / QK); ++u) {
    const float* xb = x + u * QK;
    __m256d v[8];
    __m256d amax = _mm256_setzero_pd(), sum = _mm256_setzero_pd();
    for (int i = 0; i < 8; ++i) {
      v[i] = _mm256_cvtps_pd(_mm_loadu_ps(xb + 4 * i));
      amax = _mm256_max_pd(amax, _mm256_andnot_pd(sign, v[i]));
      sum = _mm256_add_pd(sum, v[i]);
    }
    alignas(32) double am[4], sm[4];
    _mm256_store_pd(am, amax);
    _mm256_store_pd(sm, sum);
    const double a = std::max(std::max(am[0], am[1]), std::max(am[2], am[3]));
    float dx1, dx2;
    piece_scales(a, dx1, dx2);
    prep.dx[u] = dx1;
    prep.dx[units + u] = dx2;
    prep.xsum[u] = static_cast<float>((sm[0] + sm[1]) + (sm[2] + sm[3]));
    const __m256d s0 = _mm256_set1_pd(static_cast<double>(dx1) * PIECE), s1 = _mm256_set1_pd(dx1);
    const __m256d i0 = _mm256_set1_pd(a > 0 ? 1.0 / (static_cast<double>(dx1) * PIECE) : 0.0),
                  i1 = _mm256_set1_pd(a > 0 ? 1.0 / dx1 : 0.0), i2 = _mm256_set1_pd(a > 0 ? 1.0 / dx2 : 0.0);
    __m128i t0 = _mm_setzero_si128(), t1 = _mm_setzero_si128(), t2 = _mm_setzero_si128();
    for (int i = 0; i < 8; ++i) {
      const __m256d q0 = clamp(round4(_mm256_mul_pd(v[i], i0)));
      const __m256d rr1 = _mm256_fnmadd_pd(q0, s0, v[i]);  // exact: q0 * dx1 * 254 has < 53 bits
      const __m256d q1 = clamp(round4(_mm256_mul_pd(rr1, i1)));
      const __m256d rr2 = _mm256_fnmadd_pd(q1, s1, rr1);
      const __m256d q2 = clamp(round4(_mm256_mul_pd(rr2, i2)));
      const int64_t o = u * QK + 4 * i;
      t0 = _mm_add_epi32(t0, bytes(q0, prep.xq.data() + o));
      t1 = _mm_add_epi32(t1, bytes(q1, prep.xq.data() + plane + o));
      t2 = _mm_add_epi32(t2, bytes(q2, prep.xq.data() + 2 * plane + o));
    }
    auto hadd = [](__m128i t) {
      alignas(16) int32_t e[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(e), t);
      return e[0] + e[1] + e[2] + e[3];
    };
    prep.isum[u] = hadd(t0);
    prep.isum[units + u] = hadd(t1);
    prep.isum[2 * units + u] = hadd(t2);
  }
}
#endif  // BATON_Q8P, BATON_Q8P_AVX2

#if defined(BATON_Q8P_INT8)
// x [M, K] prepared into prep (exact: split_rows' three pieces, else quantize_rows' int8), kept
// while gen says x is the same, as the kernels read it: the steps threads sharing one preparation
// take (packed_prep_size, packed_prep_rows, packed_prep_done), here all rows on one thread.
XView prepared(bool exact, const float* x, int64_t M, int64_t K, uint64_t gen, baton_rows::QuantX& prep) {
  if (prep.gen != gen || prep.key != (exact ? PREP_EXACT : PREP_INT8)) {
    baton_rows::packed_prep_size(exact, M, K, prep);
    baton_rows::packed_prep_rows(exact, x, M, K, 0, M, prep);
    baton_rows::packed_prep_done(exact, gen, prep);
  }
  if (!exact) return XView{prep.xq.data(), prep.dx.data(), prep.isum.data(), K};
  return XView{prep.xq.data(), prep.dx.data(), prep.isum.data(), K, M * K, M * K / QK, prep.xsum.data()};
}

// packed_rows_p (avx2_rows on AVX2) for x as `prepared` gave it.
template <class P>
void packed_rows_x(bool exact, const XView& x, int64_t M, const uint8_t* pw, int64_t nb, const float* bias, float* y,
                   int64_t N, int64_t n0, int64_t n1) {
#if defined(BATON_Q8P)
  if (exact)
    packed_rows_p<P, true>(x, M, pw, nb, bias, y, N, n0, n1);
  else
    packed_rows_p<P, false>(x, M, pw, nb, bias, y, N, n0, n1);
#else
  if (exact)
    avx2_rows<P, true>(x, M, pw, nb, bias, y, N, n0, n1);
  else
    avx2_rows<P, false>(x, M, pw, nb, bias, y, N, n0, n1);
#endif
}

#endif  // BATON_Q8P_INT8

// Rows [r0, r1) (whole tiles of 16) of packed as float32 into out [*, K]: dequantize_q's values
// (q * d, then + m, rounded each: no contraction), so the same bits as on the rows packed.
template <class P>
__attribute__((optimize("fp-contract=off"))) void dequantize_packed(const uint8_t* packed, int64_t nb, int64_t r0,
                                                                    int64_t r1, float* out) {
  const int64_t K = nb * QK;
#if defined(BATON_Q8P)
  // row c's values 4i .. 4i + 3 of a block are bytes 4c .. 4c + 3 of its vector i: per 16-byte
  // lane l, rows 4l .. 4l + 3, four values each
  __m512i spread[4];
  for (int l = 0; l < 4; ++l) {
    alignas(64) int32_t idx[16];
    for (int e = 0; e < 16; ++e) idx[e] = 4 * l + e / 4;
    spread[l] = _mm512_load_si512(idx);
  }
  for (int64_t t = r0 / TN; t < r1 / TN; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = packed + (t * nb + b) * P::BB;
      __m512 d, mn = _mm512_setzero_ps();
      block_scales<P>(blk, d, mn);
      float* o = out + (t * TN - r0) * K + b * QK;
      alignas(64) uint8_t wb[8][64];  // the block's bytes, Q4's nibbles spread to one per byte
      for (int i = 0; i < 8; ++i)
        _mm512_store_si512(wb[i], P::NIBBLES ? nibbles(blk, i) : _mm512_loadu_si512(blk + 64 * i));
      for (int l = 0; l < 4; ++l) {
        const __m512 dl = _mm512_permutexvar_ps(spread[l], d);
        const __m512 ml = _mm512_permutexvar_ps(spread[l], mn);
        for (int i = 0; i < 8; ++i) {
          __m512i q = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(wb[i] + 16 * l)));
          if constexpr (P::Z != 0) q = _mm512_sub_epi32(q, _mm512_set1_epi32(P::Z));
          __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(q), dl);
          if constexpr (P::MIN) y = _mm512_add_ps(y, ml);
          // each 128-bit lane is one row's four values: stored straight from the register (a trip
          // through a stack array and four 16-byte copies left linear_qp_tiles 1% behind
          // linear_q_tiles at 100 rows of x on AMD Zen 4; this way it is 3% ahead)
          float* row = o + 4 * l * K + 4 * i;
          _mm_storeu_ps(row, _mm512_castps512_ps128(y));
          _mm_storeu_ps(row + K, _mm512_extractf32x4_ps(y, 1));
          _mm_storeu_ps(row + 2 * K, _mm512_extractf32x4_ps(y, 2));
          _mm_storeu_ps(row + 3 * K, _mm512_extractf32x4_ps(y, 3));
        }
      }
    }
#elif defined(BATON_Q8P_AVX2)
  // bytes 8p .. 8p + 7 of a group's 32 (one half) are rows 2p and 2p + 1, four values each: widened
  // to 8 int32, then the two rows' scales, as the VNNI code's lanes
  for (int64_t t = r0 / TN; t < r1 / TN; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = packed + (t * nb + b) * P::BB;
      alignas(32) float d[TN], mn[TN] = {};
      for (int h = 0; h < 2; ++h) {
        __m256 dh, mh = _mm256_setzero_ps();
        half_scales<P>(blk, h, dh, mh);
        _mm256_store_ps(d + 8 * h, dh);
        _mm256_store_ps(mn + 8 * h, mh);
      }
      float* o = out + (t * TN - r0) * K + b * QK;
      for (int h = 0; h < 2; ++h) {
        alignas(32) uint8_t wb[8][32];  // the half's groups, Q4's nibbles spread to one per byte
        for (int g = 0; g < 8; ++g) _mm256_store_si256(reinterpret_cast<__m256i*>(wb[g]), half_group<P>(blk, h, g));
        for (int p = 0; p < 4; ++p) {
          const int c = 8 * h + 2 * p;  // rows c and c + 1 of the tile
          const __m256 dl = _mm256_set_m128(_mm_set1_ps(d[c + 1]), _mm_set1_ps(d[c]));
          const __m256 ml = _mm256_set_m128(_mm_set1_ps(mn[c + 1]), _mm_set1_ps(mn[c]));
          for (int g = 0; g < 8; ++g) {
            __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb[g] + 8 * p)));
            if constexpr (P::Z != 0) q = _mm256_sub_epi32(q, _mm256_set1_epi32(P::Z));
            __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(q), dl);
            if constexpr (P::MIN) y = _mm256_add_ps(y, ml);
            _mm_storeu_ps(o + c * K + 4 * g, _mm256_castps256_ps128(y));
            _mm_storeu_ps(o + (c + 1) * K + 4 * g, _mm256_extractf128_ps(y, 1));
          }
        }
      }
    }
#else
  std::vector<uint8_t> rows_raw((r1 - r0) * nb * P::RAW);
  unpack_rows<P>(packed, nb, r0, r1, rows_raw.data());
  baton_rows::dequantize_raw(P::ID, rows_raw.data(), nb * P::RAW, K, out, 0, r1 - r0);
#endif
}

// Many rows of x (prefill) on packed rows: linear_q_tiles' work on the rows pack_q8p was given
// (tiled_gemm), the same dequantized values, so the same bits.
at::Tensor linear_qp_tiles(const at::Tensor& x_in, const at::Tensor& packed, int64_t qtype,
                           const std::optional<at::Tensor>& bias) {
  at::Tensor out;
  dispatch_p(qtype, "linear_qp_tiles", [&]<class P>() {
    check_packed<P>("linear_qp_tiles", packed);
    const int64_t nb = packed.size(1) / P::BB, N = packed.size(0) * TN, K = nb * QK;
    TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == K,
                "linear_qp_tiles: x must be a CPU float32 tensor [M, ", K, "]");
    if (bias)
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N,
                  "linear_qp_tiles: bias must be a float32 tensor [", N, "]");
    const at::Tensor x = x_in.contiguous();
    out = at::empty({x.size(0), N}, x.options());
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    baton_rows::tiled_gemm(x, bias, out, [&](int64_t n0, int64_t rows, float* buf) {
      dequantize_packed<P>(pp, nb, n0, n0 + rows, buf);  // whole tiles of 16: N and the tile size are
    });
  });
  return out;
}

// Whether linear_q8p and linear_qp (int8 / exact x on packed rows) are built: AVX-512 VNNI, or the
// AVX2 loop.
bool q8p_kernel() {
#if defined(BATON_Q8P_INT8)
  return true;
#else
  return false;
#endif
}

// "amx": AMX_MIN_ROWS or more rows of x take the tiles here; "vnni": every row count takes the VNNI loop;
// "avx2": the AVX2 loop; "": linear_q8p is not built.
std::string q8p_path() {
#if defined(BATON_Q8P_AMX)
  if (amx_usable()) return "amx";
#endif
#if defined(BATON_Q8P)
  return "vnni";
#else
  return q8p_kernel() ? "avx2" : "";
#endif
}

// The arguments of an op on packed rows checked (x [M, K] float32, packed uint8, bias [N]): N.
int64_t check_linear_args(const char* op, const at::Tensor& x_in, const at::Tensor& packed,
                          const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 2, op,
              ": x must be a CPU float32 tensor [M, K]");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                  packed.is_contiguous(),
              op, ": packed must be pack_q8p's contiguous uint8 tensor");
  const int64_t N = packed.size(0) * TN;
  if (bias)
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == N && bias->is_contiguous(),
                op, ": bias must be a contiguous CPU float32 tensor [", N, "]");
  return N;
}

// y = x @ w^T (+ bias) for w packed by pack_q8p; exact: x in split_rows' three pieces
// (linear_qp), else quantized as linear_q8a quantizes it (linear_q8p).
at::Tensor packed_linear(const char* op, const at::Tensor& x_in, const at::Tensor& packed, int64_t qtype,
                         const std::optional<at::Tensor>& bias, bool exact) {
  TORCH_CHECK(q8p_kernel(), op, ": this build of the kernels has no AVX-512 VNNI or AVX2 (baton env says why)");
  const int64_t N = check_linear_args(op, x_in, packed, bias);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), N}, x.options());
#if defined(BATON_Q8P_INT8)
  dispatch_p(qtype, op, [&]<class P>() {
    const int64_t K = packed_k<P>(packed), M = x.size(0);
    TORCH_CHECK(x.size(1) == K && packed.size(1) % P::BB == 0, op, ": x has ", x.size(1),
                " inputs, the packed weights ", K);
    if (M == 0 || N == 0) return;
    baton_rows::QuantX prep;  // x prepared once, read by every thread
    const XView xv = prepared(exact, x.data_ptr<float>(), M, K, 0, prep);
    const uint8_t* pw = packed.data_ptr<uint8_t>();
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    float* yp = out.data_ptr<float>();
    // 4 tiles (64 rows) a task at least: a 192-row matrix still goes to both cores at one row of x
    at::parallel_for(0, N / TN, 4, [&](int64_t t0, int64_t t1) {
      packed_rows_x<P>(exact, xv, M, pw, K / QK, bp, yp, N, t0 * TN, t1 * TN);
    });
  });
#endif
  return out;
}

// y = xhat @ w^T (+ bias): xhat as linear_q8a quantizes x, w packed by pack_q8p.
at::Tensor linear_q8p(const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                      const std::optional<at::Tensor>& bias) {
  return packed_linear("linear_q8p", x, packed, qtype, bias, false);
}

// y = x @ dequantize(w)^T (+ bias), w packed by pack_q8p: linear_q's math (float32 x, within a
// float32 rounding per block) on the packed rows, x in three int8 pieces (split_rows).
at::Tensor linear_qp(const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                     const std::optional<at::Tensor>& bias) {
  return packed_linear("linear_qp", x, packed, qtype, bias, true);
}

// Per output row and block of packed (rows [T * 16, K] in format P): the sum of |w| over the
// block's 32 dequantized weights, rounded up to a float32 ([T, K / 32, 16], a tile's blocks in
// order, 16 rows each): what bounds a block's error when x is known only to within some e.
at::Tensor packed_row_bounds(const at::Tensor& packed, int64_t qtype) {
  at::Tensor out;
  dispatch_p(qtype, "packed_row_bounds", [&]<class P>() {
    check_packed<P>("packed_row_bounds", packed);
    const int64_t T = packed.size(0), nb = packed.size(1) / P::BB, K = nb * QK;
    out = at::empty({T, nb, TN}, packed.options().dtype(at::kFloat));
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> w(TN * K);
      for (int64_t t = t0; t < t1; ++t) {
        dequantize_packed<P>(pp, nb, t * TN, (t + 1) * TN, w.data());
        for (int64_t b = 0; b < nb; ++b)
          for (int c = 0; c < TN; ++c) {
            double sum = 0.0;  // 32 terms of at most 2^24 ulps: exact in double
            for (int j = 0; j < QK; ++j) sum += std::abs(static_cast<double>(w[c * K + b * QK + j]));
            float f = static_cast<float>(sum);
            if (static_cast<double>(f) < sum) f = std::nextafter(f, INFINITY);
            op[(t * nb + b) * TN + c] = f;
          }
      }
    });
  });
  return out;
}

#if defined(BATON_Q8P_INT8)
// How far the screening pass's bound is widened: it covers x's first piece exactly in real
// numbers; the float roundings of the screened sums and of linear_qp's own sums are each below
// ~2^-12 of it (|x| . |w| is at most 254 bounds, times 2^-24 per block), so 1/64 is ample.
constexpr float SCREEN_SLACK = 1.0f + 1.0f / 64.0f;

// 16 float lanes (one tile's columns): one zmm on AVX-512, two ymm on AVX2.
typedef float F16 __attribute__((vector_size(64)));

// v's lanes joined by op (a tree of halves).
template <class Op>
inline float across16(F16 v, Op op) {
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
  return v[0];
}

// For rows m of the screened sums y [M, N] and tiles [t0, t1): each tile's largest upper bound
// (hi) and largest lower bound (lo) over its columns, a column's bound sum_b err[m, b] *
// bounds[t, b, c]. A NaN makes both NaN (its row then keeps every tile). Four rows at a time:
// four chains of additions in flight.
void screen_bounds(const float* y, int64_t N, int64_t T, int64_t M, int64_t nb, int64_t t0, int64_t t1,
                   const float* bounds, const float* err, float* hi, float* lo) {
  auto load = [](const float* p) {
    F16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  auto vmax = [](F16 a, F16 b) { return a > b ? a : b; };
  auto finish = [&](int64_t m, int64_t t, F16 acc) {
    const F16 v = load(y + m * N + t * TN), e = acc * SCREEN_SLACK, up = v + e, down = v - e;
    // a NaN lane (or infinite bounds) makes the sum NaN: then the row keeps every tile
    const bool nan = std::isnan(across16(up + down, [](F16 a, F16 b) { return a + b; }));
    hi[m * T + t] = nan ? NAN : across16(up, vmax);
    lo[m * T + t] = nan ? NAN : across16(down, vmax);
  };
  for (int64_t t = t0; t < t1; ++t) {
    const float* bt = bounds + t * nb * TN;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      F16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      const float* e = err + m * nb;
      for (int64_t b = 0; b < nb; ++b) {
        const F16 v = load(bt + b * TN);
        a0 += v * e[b];
        a1 += v * e[nb + b];
        a2 += v * e[2 * nb + b];
        a3 += v * e[3 * nb + b];
      }
      finish(m, t, a0);
      finish(m + 1, t, a1);
      finish(m + 2, t, a2);
      finish(m + 3, t, a3);
    }
    for (; m < M; ++m) {
      F16 acc = {};
      for (int64_t b = 0; b < nb; ++b) acc += load(bt + b * TN) * err[m * nb + b];
      finish(m, t, acc);
    }
  }
}

// y = x @ w^T (+ bias) as linear_qp gives it, on the columns whose value can be their row's
// largest; -inf on every other (the row's argmax, first index on ties, is linear_qp's). x's first
// int8 piece (split_rows: |x - 254 dx1 q0| <= 127 dx1 + 127 dx2 < 128 dx1 per 32 values) screens
// every column through linear_q8p's loop, each column with a bound sum_b 128 dx1_b * bounds_b (its
// |w| per block, packed_row_bounds); a 16-column tile with a column that can reach the row's
// largest lower bound then runs linear_qp. A greedy step on the SmolLM2 head (49152 columns)
// keeps ~3.5 of 3072 tiles on average.
at::Tensor linear_qp_argmax(const at::Tensor& x_in, const at::Tensor& packed, int64_t qtype,
                            const std::optional<at::Tensor>& bias, const at::Tensor& bounds) {
  const char* op = "linear_qp_argmax";
  const int64_t N = check_linear_args(op, x_in, packed, bias);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  dispatch_p(qtype, op, [&]<class P>() {
    check_packed<P>(op, packed);
    const int64_t K = packed_k<P>(packed), M = x.size(0), nb = K / QK, T = N / TN;
    TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " inputs, the packed weights ", K);
    TORCH_CHECK(bounds.scalar_type() == at::kFloat && bounds.is_contiguous() && bounds.dim() == 3 &&
                    bounds.size(0) == T && bounds.size(1) == nb && bounds.size(2) == TN,
                op, ": bounds must be packed_row_bounds' float32 tensor [", T, ", ", nb, ", 16]");
    if (M == 0 || N == 0) return;
    baton_rows::QuantX prep;
    const XView xv = prepared(true, x.data_ptr<float>(), M, K, 0, prep);
    // the first piece alone, as linear_q8p reads int8 x: plane 0, its unit 254 dx1
    std::vector<float> dx0(M * nb), err(M * nb);
    for (int64_t u = 0; u < M * nb; ++u) {
      dx0[u] = static_cast<float>(PIECE) * xv.dx[u];
      err[u] = 128.0f * SCREEN_SLACK * xv.dx[u];
    }
    const XView x0{xv.xq, dx0.data(), xv.isum, K};
    const uint8_t* pw = packed.data_ptr<uint8_t>();
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    const float* bd = bounds.data_ptr<float>();
    float* yp = out.data_ptr<float>();
    // per row and tile: the largest upper bound of its columns (hi) and the largest lower one (lo)
    std::vector<float> hi(M * T), lo(M * T);
    at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t c0 = t0; c0 < t1; c0 += CHUNK_TILES) {  // the bounds while y is in cache
        const int64_t c1 = std::min(t1, c0 + CHUNK_TILES);
        packed_rows_x<P>(false, x0, M, pw, nb, bp, yp, N, c0 * TN, c1 * TN);
        screen_bounds(yp, N, T, M, nb, c0, c1, bd, err.data(), hi.data(), lo.data());
      }
    });
    std::vector<float> floor(M);  // each row's largest lower bound: its largest value is at least that
    for (int64_t m = 0; m < M; ++m) {
      float f = -INFINITY;
      for (int64_t t = 0; t < T; ++t) f = std::isnan(lo[m * T + t]) || std::isnan(f) ? NAN : std::max(f, lo[m * T + t]);
      floor[m] = f;
    }
    at::parallel_for(0, M * T, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t m = i / T, t = i % T;
        float* row = yp + m * N;
        if (!(hi[i] < floor[m]))  // NaN on either side keeps the tile
          packed_rows_x<P>(true, rows_from(xv, m), 1, pw, nb, bp, row, N, t * TN, (t + 1) * TN);
        else
          std::fill(row + t * TN, row + (t + 1) * TN, -INFINITY);
      }
    });
  });
  return out;
}
#endif  // BATON_Q8P_INT8

}  // namespace

bool baton_rows::packed_supported(int64_t qtype) {
  return q8p_kernel() && (qtype == P4_0::ID || qtype == P4_1::ID || qtype == P8_0::ID);
}

void baton_rows::packed_rows(int64_t qtype, bool exact, const float* x, int64_t M, int64_t K, uint64_t gen,
                             QuantX& prep, const uint8_t* packed, const float* bias, float* y, int64_t N, int64_t n0,
                             int64_t n1) {
#if defined(BATON_Q8P_INT8)
  dispatch_p(qtype, "packed_rows", [&]<class P>() {
    packed_rows_x<P>(exact, prepared(exact, x, M, K, gen, prep), M, packed, K / QK, bias, y, N, n0, n1);
  });
#else
  TORCH_CHECK(false, "packed_rows: this build of the kernels has no AVX-512 VNNI or AVX2");
#endif
}

void baton_rows::packed_prep_size(bool exact, int64_t M, int64_t K, QuantX& prep) {
  const int64_t pieces = exact ? 3 : 1, units = M * K / QK;
  prep.xq.resize(pieces * M * K);
  prep.dx.resize((exact ? 2 : 1) * units);
  prep.isum.resize(pieces * units);
  if (exact) prep.xsum.resize(units);
  prep.gen = ~uint64_t{0};
}

void baton_rows::packed_prep_rows(bool exact, const float* x, int64_t M, int64_t K, int64_t r0, int64_t r1,
                                  QuantX& prep) {
#if defined(BATON_Q8P_INT8)
  if (exact)
    split_rows(x, M, K, r0, r1, prep);
  else
    quantize_rows(x, K, r0, r1, prep);
#else
  TORCH_CHECK(false, "packed_prep_rows: this build of the kernels has no AVX-512 VNNI or AVX2");
#endif
}

void baton_rows::packed_prep_done(bool exact, uint64_t gen, QuantX& prep) {
  prep.gen = gen;
  prep.key = exact ? PREP_EXACT : PREP_INT8;
}

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def("pack_q8p(Tensor raw, int qtype) -> Tensor");
  m.def("linear_q8p(Tensor x, Tensor packed, int qtype, Tensor? bias=None) -> Tensor");
  m.def("linear_qp(Tensor x, Tensor packed, int qtype, Tensor? bias=None) -> Tensor");
  m.def("linear_qp_tiles(Tensor x, Tensor packed, int qtype, Tensor? bias=None) -> Tensor");
  m.def("unpack_q8p(Tensor packed, int qtype) -> Tensor");
  m.def("dequantize_q8p_rows(Tensor packed, int qtype, Tensor ids) -> Tensor");
  m.def("packed_row_bounds(Tensor packed, int qtype) -> Tensor");
#if defined(BATON_Q8P_INT8)
  m.def("linear_qp_argmax(Tensor x, Tensor packed, int qtype, Tensor? bias, Tensor bounds) -> Tensor");
#endif
  m.def("q8p_kernel() -> bool", &q8p_kernel);
  m.def("q8p_path() -> str", &q8p_path);
  m.def("packed_stream() -> str", [] { return std::string(stream_into_l2() ? "l2" : "l1"); });
}

TORCH_LIBRARY_IMPL(baton, CPU, m) {
  m.impl("pack_q8p", pack_q8p);
  m.impl("linear_q8p", linear_q8p);
  m.impl("linear_qp", linear_qp);
  m.impl("linear_qp_tiles", linear_qp_tiles);
  m.impl("unpack_q8p", unpack_q8p);
  m.impl("dequantize_q8p_rows", dequantize_q8p_rows);
  m.impl("packed_row_bounds", packed_row_bounds);
#if defined(BATON_Q8P_INT8)
  m.impl("linear_qp_argmax", linear_qp_argmax);
#endif
}
