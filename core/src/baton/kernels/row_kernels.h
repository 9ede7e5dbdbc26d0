// Row-range entry points of baton's kernels, shared between the sources of the one library that
// baton.kernels.loader builds: decode_stack.cpp runs a whole decode step in one parallel region
// and calls these on each thread's share of the work, with no dispatcher, allocation or fork/join
// per linear. Each computes exactly what the matching operator computes for the same rows (the
// same code and summation order), whatever the split.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace baton_rows {

// Rows [n0, n1) of y = x @ w^T: x [M, K], w [N, K], y [M, N], float32 (linear_small's code).
void float_rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t n0, int64_t n1);

// A thread's preparation of x for the quantized rows (group sums, or x quantized to int8 blocks),
// kept while the caller's generation number says x has not changed.
struct QuantX {
  uint64_t gen = ~uint64_t{0};
  int64_t key = -1;
  std::vector<float> xsum, dx;  // packed_rows exact: dx1 then dx2 per 32 values, xsum their sums
  std::vector<int8_t> xq;
  std::vector<int32_t> isum;  // packed_rows: the integer sum of xq per 32 values
};

// x [M, K] as linear_q8a quantizes it: per 32 values xq = round(x / dx), dx = max |x| / 127 (K / 32
// per row); xs (when not null): dx * sum(xq) per G values.
void quantize_x(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs, int64_t G);

// Whether linear_q8p / linear_qp are built (AVX-512 VNNI or AVX2) and read qtype's packed layout
// (Q4_0, Q4_1, Q8_0: packed_q8.cpp).
bool packed_supported(int64_t qtype);

// Rows [n0, n1) of y = xhat @ w^T (+ bias), w packed by pack_q8p: exact, linear_qp's code (x in
// three int8 pieces, float32-accurate), else linear_q8p's (x quantized as linear_q8a quantizes it);
// x [M, K] prepared into prep, kept while `gen` says x is the same.
void packed_rows(int64_t qtype, bool exact, const float* x, int64_t M, int64_t K, uint64_t gen, QuantX& prep,
                 const uint8_t* packed, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1);

// packed_rows' preparation of x shared by threads that split x's rows: prep sized once for M rows
// of up to K inputs (packed_prep_size), each thread preparing its rows [r0, r1) of x [M, K]
// (packed_prep_rows: each row as packed_rows prepares it alone), then, once every row is in, one
// thread marking prep as x's for generation gen (packed_prep_done), which packed_rows then reads
// instead of preparing x itself.
void packed_prep_size(bool exact, int64_t M, int64_t K, QuantX& prep);
void packed_prep_rows(bool exact, const float* x, int64_t M, int64_t K, int64_t r0, int64_t r1, QuantX& prep);
void packed_prep_done(bool exact, uint64_t gen, QuantX& prep);

// out [M, N] = x [M, K] @ w^T (+ bias) for many rows of x (linear_q_tiles, linear_qp_tiles): the
// weight rows in tiles of 64K floats (whole tiles of 16 rows), `fill(n0, rows, buf)` writing rows
// [n0, n0 + rows) of w as float32 into a thread's buffer [rows, K], then torch's GEMM into their
// columns of out. The same tiles and GEMM calls whoever fills them, so the same bits for the same
// values.
void tiled_gemm(const at::Tensor& x, const std::optional<at::Tensor>& bias, at::Tensor& out,
                const std::function<void(int64_t, int64_t, float*)>& fill);

// Rows [r0, r1) of w (ggml's rows in format qtype) as float32 into out [*, K] (dequantize_q's code:
// the same bits as gguf's reference).
void dequantize_raw(int64_t qtype, const uint8_t* w, int64_t row_bytes, int64_t K, float* out, int64_t r0,
                    int64_t r1);

// Whether qtype (a ggml type id) is one of the quantized formats the kernels read.
bool quant_supported(int64_t qtype);

// Rows [n0, n1) of y = x @ dequantize(w)^T (+ bias): linear_q's code, or linear_q8a's when q8a.
// w [N, row_bytes] uint8 in format qtype; `gen` names x's contents for `prep` (a new number
// whenever x changes). invariant: linear_q's batch-invariant sums (linear_q8a's always are).
void quant_rows(int64_t qtype, bool q8a, const float* x, int64_t M, int64_t K, uint64_t gen, QuantX& prep,
                const uint8_t* w, int64_t row_bytes, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1,
                bool invariant = false);

// Cuts items [0, n) into nt consecutive ranges of about equal total work(i) (an integer cost per
// item): thread t takes [cut[t], cut[t + 1]). The attention splits rows so, by the keys each reads:
// a prompt chunk's rows attend over 1..n keys, and equal counts left the first of two threads a
// third of the second's work. An item runs the same code whichever thread takes it.
template <class Work>
std::vector<int64_t> split_by_work(int64_t n, int64_t nt, Work&& work) {
  std::vector<int64_t> cut(nt + 1, n);
  cut[0] = 0;
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += work(i);
  for (int64_t i = 0, done = 0, t = 1; i < n && t < nt; done += work(i++))
    while (t < nt && done * nt >= total * t) cut[t++] = i;
  return cut;
}

// A row's fixed attention work beside its keys (its query, output and softmax), in keys.
constexpr int64_t ATTEND_ROW_COST = 16;

// Element type of a paged KV cache.
enum class CacheType { F32, F16, BF16 };

// Geometry of one layer's paged cache and its query heads.
struct CacheDims {
  int64_t H, KVH, D, BS;
};

// Writes one token's keys and values of kv heads [h0, h1) into `slot` (paged_write's code).
// k, v: [KVH, D] rows of the token; k_cache [blocks, KVH, D, BS], v_cache [blocks, KVH, BS, D].
void write_kv(CacheType t, const float* k, const float* v, void* k_cache, void* v_cache, int64_t slot,
              const CacheDims& dm, int64_t h0, int64_t h1);

// Decode attention of one request's query heads of kv heads [h0, h1) over keys [lo, L) of its
// blocks `row` (paged_decode's code): q [H, D] rows at stride qs1, o likewise at os1.
void decode_heads(CacheType t, const float* q, int64_t qs1, const void* k_cache, const void* v_cache,
                  const int64_t* row, int64_t L, int64_t lo, const CacheDims& dm, float scale, float* o, int64_t os1,
                  int64_t h0, int64_t h1, std::vector<float>& scores, std::vector<float>& qbuf);

}  // namespace baton_rows
