// baton's decode layer stack (float32, CPU), compiled on first use by baton.kernels.loader.
//
// decode_layers runs every decoder layer of a Llama-block model (RMSNorm, q/k/v projections,
// rotary, paged K/V write, paged decode attention, o_proj + residual, RMSNorm, gate/up, SiLU * up,
// down + residual) and the final norm for a decode-only step (one query token per request), in
// ONE call: a decode step through the model's Python modules costs ~0.4 ms of op dispatch per
// layer, which at batch 1 is more than the layer's matmuls. The linears and the attention are
// the other baton ops (linear_small, linear_q, linear_q8a, linear_q_tiles, paged_write,
// paged_decode), called through the dispatcher on this thread: each parallelises itself.
// Boxed calls, so that only the ops' schemas (not their C++ signatures) are relied upon.
//
// Elementwise steps are compiled without FMA contraction, so that they round as transformers'
// separate torch ops do (rotary: q * cos + rotate_half(q) * sin is bit-identical).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// Linears per layer, in this order, in the weights / biases / qtypes / q8a lists.
enum Linear : int64_t { Q, K, V, O, GATE, UP, DOWN, PER_LAYER };

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
  std::optional<c10::OperatorHandle> linear_q8a;
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

__attribute__((optimize("fp-contract=off"))) void add_bias(float* y, const float* b, int64_t M, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] += b[n];
}

struct LinearArgs {
  int64_t quant_max_rows, float_max_rows;
};

// y = x @ W.T + b as the layer's module computes it for x's row count (QuantLinear.forward or
// SmallBatchLinear.forward): the same op, so the same summation order. `buf`: the float path's
// output, reused by the same linear of every layer (each is consumed before the next layer).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t qtype, bool q8a,
                  const LinearArgs& la, at::Tensor& buf) {
  const int64_t M = x.size(0);
  const bool has_bias = b.defined() && b.numel() > 0;
  if (qtype < 0) {  // float32 weights [N, K]
    if (M > la.float_max_rows) return at::linear(x, w, has_bias ? std::optional<at::Tensor>(b) : std::nullopt);
    if (!buf.defined() || buf.size(1) != w.size(0)) buf = at::empty({M, w.size(0)}, x.options());
    at::Tensor& y = buf;
    std::vector<c10::IValue> stack{x, w, y};
    ops().linear_small.callBoxed(&stack);
    if (has_bias) add_bias(y.data_ptr<float>(), b.data_ptr<float>(), M, w.size(0));
    return y;
  }
  const c10::OperatorHandle& op =
      M > la.quant_max_rows ? ops().linear_q_tiles : (q8a ? q8a_op() : ops().linear_q);
  std::vector<c10::IValue> stack{x, w, qtype, has_bias ? c10::IValue(b) : c10::IValue()};
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

// gate <- silu(gate) * up; silu(x) = x / (1 + exp(-x)) as torch computes it.
__attribute__((optimize("fp-contract=off"))) void silu_mul(float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) g[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
}

__attribute__((optimize("fp-contract=off"))) void add_into(float* h, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = h[i] + y[i];
}

at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList norms, at::TensorList weights, at::TensorList biases,
                         at::IntArrayRef qtypes, at::IntArrayRef q8a, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& ctx_lens,
                         int64_t num_heads, int64_t num_kv_heads, double eps, double scale, int64_t quant_max_rows,
                         int64_t float_max_rows) {
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
  const int64_t M = hidden.size(0), Hd = hidden.size(1);
  const int64_t D = v_caches[0].size(3), H = num_heads, KVH = num_kv_heads;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == M * D && sin.numel() == M * D,
              "decode_layers: cos and sin must be contiguous float32 [tokens, head_dim=", D, "]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == M && ctx_lens.numel() == M && slots.numel() == M,
              "decode_layers: one query token per request: block_table [", M, ", blocks], ctx_lens and slots [", M,
              "]");
  const LinearArgs la{quant_max_rows, float_max_rows};
  const float feps = static_cast<float>(eps);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();

  at::Tensor h = hidden.contiguous().clone();  // the residual stream
  at::Tensor x = at::empty_like(h);            // normed input of the attention / MLP
  at::Tensor attn = at::empty({M, H, D}, h.options());
  at::Tensor attn2 = attn.view({M, H * D});
  float* hp = h.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  at::Tensor bufs[PER_LAYER];

  for (int64_t l = 0; l < L; ++l) {
    const int64_t w0 = l * PER_LAYER;
    auto lin = [&](const at::Tensor& in, Linear i) {
      return linear(in, weights[w0 + i], biases[w0 + i], qtypes[w0 + i], q8a[w0 + i] != 0, la, bufs[i]);
    };
    // attention block
    rms_norm(hp, norms[2 * l].data_ptr<float>(), xp, M, Hd, feps);
    at::Tensor q = lin(x, Q), k = lin(x, K), v = lin(x, V);
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
    rms_norm(hp, norms[2 * l + 1].data_ptr<float>(), xp, M, Hd, feps);
    at::Tensor g = lin(x, GATE), u = lin(x, UP);
    TORCH_CHECK(g.sizes() == u.sizes(), "decode_layers: layer ", l, ": gate and up widths differ");
    silu_mul(g.data_ptr<float>(), u.data_ptr<float>(), g.numel());
    at::Tensor d = lin(g, DOWN);
    add_into(hp, d.data_ptr<float>(), M * Hd);
  }
  at::Tensor out = at::empty_like(h);
  rms_norm(hp, norms[2 * L].data_ptr<float>(), out.data_ptr<float>(), M, Hd, feps);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(baton, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] weights, Tensor[] biases, "
      "int[] qtypes, int[] q8a, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor block_table, Tensor ctx_lens, "
      "int num_heads, int num_kv_heads, float eps, float scale, int quant_max_rows, int float_max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(baton, CPU, m) { m.impl("decode_layers", decode_layers); }
