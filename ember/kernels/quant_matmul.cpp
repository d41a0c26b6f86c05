// ember's native kernels, one translation unit (see ember/kernels/__init__.py): this
// file holds the Python bindings and the argument checks of the entry points; the
// kernels are in the headers it includes, each for one concern:
//
//   quant_lanes.h     SIMD lane sets (AVX-512 VNNI, AVX2, portable)
//   quant_layouts.h   packed weight layouts, packing from GGUF bytes, dequantization
//   quant_kernels.h   int8 activations and the integer matmul kernels
//   packed_linear.h   a layer's packed weight (huge pages, packing, PackedLinear)
//   activations.h     the activations' quantization as tensors (for the tests)
//   paged_attention.h attention over the pool in place
//   row_ops.h         per-row float operations: RMSNorm, gated units, f32 dots
//   lora_delta.h      low-rank adapter deltas per token, inside the stack
//   routed_experts.h  a mixture-of-experts layer: routing, experts grouped in one pass
//   delta_net.h       Qwen 3.5's Gated DeltaNet (linear attention) layer
//   fused_decoder.h   a whole decoder stack in one call per step
//
// Threads: at::parallel_for (follows torch.set_num_threads). SIMD: chosen at compile
// time (AVX-512 VNNI, AVX2+FMA+F16C with AVX-VNNI where present, or portable C++).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EMBER_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512F__) && \
    defined(__AVX512BW__)
#define EMBER_VNNI512 1
#endif
#endif

namespace {

// ------------------------------------------------------------------ f16 helpers

inline float h2f(uint16_t h) {
#if defined(EMBER_AVX2)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while ((man & 0x400) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3FF;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

#include "quant_lanes.h"
#include "quant_layouts.h"
#include "quant_kernels.h"

#include "packed_linear.h"
#include "activations.h"

std::string simd() {
#if defined(EMBER_VNNI512)
  return "avx512vnni";
#elif defined(EMBER_AVX2) && defined(__AVXVNNI__)
  return "avx2vnni";  // 256-bit VNNI: not the int16-sum tiles of plain AVX2
#elif defined(EMBER_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

#include "paged_attention.h"
#include "row_ops.h"
#include "lora_delta.h"
#include "routed_experts.h"
#include "delta_net.h"
#include "fused_decoder.h"

}  // namespace

// y [T, N] += the low-rank deltas of one fused projection (``proj``) of ``layer`` for
// each token's adapter (token_lora [T], -1: none), from x [T, K]: the stack's own
// code, bound alone for the tests.
at::Tensor lora_delta(const std::vector<LoRAWeights*>& loras, const at::Tensor& token_lora,
                      int64_t layer, int64_t proj, const at::Tensor& x, at::Tensor y) {
  TORCH_CHECK(!loras.empty(), "lora_delta: no adapters");
  TORCH_CHECK(proj >= 0 && proj < kFusedProjections, "lora_delta: no fused projection ", proj);
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.is_contiguous() &&
                  y.is_contiguous() && x.scalar_type() == at::kFloat &&
                  y.scalar_type() == at::kFloat,
              "lora_delta: x [T, K] and y [T, N] must be contiguous float32");
  for (const LoRAWeights* w : loras) {
    TORCH_CHECK(layer >= 0 && layer < w->layers(), "lora_delta: no layer ", layer);
    TORCH_CHECK(w->input(proj) == x.size(1) && w->output(proj) == y.size(1),
                "lora_delta: x or y does not fit the projection");
  }
  const LoRAStep step(loras, token_lora, x.size(0));
  step.apply(layer, static_cast<int>(proj), x.data_ptr<float>(), x.size(1), y.data_ptr<float>(),
             y.size(1));
  return y;
}

// RMSNorm over the last dim, y = x / sqrt(mean(x^2) + eps) * w, in one pass per row.
// torch's CPU rms_norm is ~6 small ops (~18 us for one 576-wide row); this is one
// call. Sums in double; equal to torch's to float rounding.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "rms_norm: float32 tensors only");
  const int64_t K = x.size(-1);
  TORCH_CHECK(w.numel() == K, "rms_norm: weight has ", w.numel(), " elements, rows have ", K);
  auto y = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), K ? x.numel() / K : 0, K, eps,
                y.data_ptr<float>());
  return y;
}

// Causal attention of q [T, H, D] (f32) over layer `layer` of the KV pool (blocks,
// layers, 2, bs, Hkv, D; f32/f16/bf16, or q8_0 rows of D / 32 * 34 bytes), read in place: token t of row rows[t] at
// position positions[t] attends to its row's positions 0..positions[t] (block ids in
// tables[rows[t]]). The K/V of every attended position must already be in the pool.
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& pool, int64_t layer,
                           const at::Tensor& tables_in, const at::Tensor& rows_in,
                           const at::Tensor& positions_in, double scale, int64_t window) {
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = tables_in.contiguous().to(at::kLong);
  const at::Tensor rows = rows_in.contiguous().to(at::kLong);
  const at::Tensor positions = positions_in.contiguous().to(at::kLong);
  const PoolLayer kv = pool_layer(pool, layer);
  TORCH_CHECK(q.device().is_cpu() && tables.device().is_cpu() && rows.device().is_cpu() &&
                  positions.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.size(2) == kv.d &&
                  q.size(1) > 0 && q.size(1) % kv.hkv == 0,
              "paged_attention: q must be float32 [T, heads, head_dim] matching the pool");
#if defined(EMBER_AVX2)
  TORCH_CHECK(kv.d % 8 == 0, "paged_attention: head_dim must be a multiple of 8");
#endif
  const int64_t T = q.size(0), NB = tables.size(1);
  TORCH_CHECK(tables.dim() == 2 && rows.numel() == T && positions.numel() == T,
              "paged_attention: tables [R, NB], rows [T], positions [T]");
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = rows.data_ptr<int64_t>()[t], p = positions.data_ptr<int64_t>()[t];
    TORCH_CHECK(r >= 0 && r < tables.size(0) && p >= 0 && p < NB * kv.bs,
                "paged_attention: row or position out of range");
    for (int64_t b = 0; b <= p / kv.bs; ++b) {
      const int64_t blk = tables.data_ptr<int64_t>()[r * NB + b];
      TORCH_CHECK(blk >= 0 && blk < pool.size(0), "paged_attention: block id out of range");
    }
  }
  auto out = at::empty_like(q);
  attend(q.data_ptr<float>(), q.size(1) * q.size(2), out.data_ptr<float>(), T, q.size(1), kv,
         tables.data_ptr<int64_t>(), NB, rows.data_ptr<int64_t>(),
         positions.data_ptr<int64_t>(), static_cast<float>(scale), window);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  mod.def("packed_nbytes", &packed_nbytes,
          "bytes of a packed weight (ggml type, rows, K)");
  mod.def("pack_rows", &pack_rows,
          "pack GGUF rows into a packed weight (blob, raw bytes, ggml type, row0, rows, K)");
  pybind11::class_<PackedLinear>(mod, "PackedLinear")
      .def(pybind11::init<int64_t, const std::vector<PackedLinear::Segment>&>(),
           "in_features, [(ggml type, rows, packed bytes), ...]")
      .def_property_readonly("in_features", &PackedLinear::in_features)
      .def_property_readonly("out_features", &PackedLinear::out_features)
      .def_property_readonly("nbytes", &PackedLinear::nbytes)
      .def_property_readonly("types", &PackedLinear::types)
      .def_property_readonly("segments", &PackedLinear::segments,
                             "[(ggml type, rows, packed bytes), ...] (shares the bytes)")
      .def("matmul", &PackedLinear::matmul, "x [M, K] @ W^T (x, gemm_min_m)", release())
      .def("dequantize", &PackedLinear::dequantize, "W as float32 [N, K]", release())
      .def("dequantize_rows", &PackedLinear::dequantize_rows, "rows of W as float32",
           release());
  mod.def("huge_empty", &huge_empty, "an uninitialized uint8 tensor in huge-page memory");
  mod.def("quantize_activations_k", &quantize_activations_k,
          "x -> (int8 codes, scales per 256, code sums per 16): K-quants' activations",
          release());
  mod.def("quantize_activations", &quantize_activations,
          "x -> (int8 codes, scales, float block sums, rounding errors, code sums, "
          "sums of the first 16 codes)", release());
  mod.def("lora_delta", &lora_delta,
          "y += each token's low-rank delta (loras, token_lora, layer, proj, x, y)", release());
  mod.def("simd", &simd, "which SIMD path this build uses");
  mod.def("rms_norm", &rms_norm, "RMSNorm over the last dim (x, weight, eps)", release());
  mod.def("paged_attention", &paged_attention,
          "causal attention over the paged pool in place (q, pool, layer, tables, rows, "
          "positions, scale, window: 0 for none)",
          pybind11::arg("q"), pybind11::arg("pool"), pybind11::arg("layer"),
          pybind11::arg("tables"), pybind11::arg("rows"), pybind11::arg("positions"),
          pybind11::arg("scale"), pybind11::arg("window") = 0, release());
  pybind11::class_<LoRAWeights>(mod, "LoRAWeights")
      .def("set", &LoRAWeights::set,
           "(layer, fused projection 0-3: qkv, o, gate_up, down, first column, A [r, in], "
           "B transposed [r, columns], scaled)")
      .def_property_readonly("num_layers", &LoRAWeights::layers);
  pybind11::class_<RoutedExperts, std::shared_ptr<RoutedExperts>>(mod, "RoutedExperts")
      .def(pybind11::init<const at::Tensor&, int64_t, int64_t, const std::string&>(),
           "router [experts, hidden] float32, top_k, expert ffn size, activation",
           pybind11::arg("router"), pybind11::arg("top_k"), pybind11::arg("ffn"),
           pybind11::arg("activation") = "silu")
      .def_property_readonly("num_experts", &RoutedExperts::num_experts)
      .def_property_readonly("top_k", &RoutedExperts::top_k)
      .def("set_biases", &RoutedExperts::set_biases,
           "router [E], gate_up [E, 2 ffn] and down [E, hidden] biases (gpt-oss)")
      .def("set_shared", &RoutedExperts::set_shared,
           "a shared expert: gate_up, down PackedLinears and its sigmoid gate [hidden]")
      .def("set_top_p", &RoutedExperts::set_top_p,
           "keep a token's experts up to this cumulative router weight (lossy below 1)")
      .def("set_expert", &RoutedExperts::set_expert, "(id, gate_up, down PackedLinears)")
      .def("drop_expert", &RoutedExperts::drop_expert, "empty an expert's slot")
      .def("has_expert", &RoutedExperts::has_expert)
      .def("set_provider", &RoutedExperts::set_provider,
           "provider(needed ids) -> how many of them (a prefix) it put in their slots; "
           "None: every expert is resident")
      .def("set_pilot", &RoutedExperts::set_pilot,
           "pilot(ids): experts the stack guesses this layer will need (None: no guesses)")
      .def("take_usage", &RoutedExperts::take_usage,
           "[2, E] int64: tokens routed to and lookups of each expert since the last call")
      .def("route", [](const RoutedExperts& r, const at::Tensor& h_in) {
             const at::Tensor h = h_in.contiguous();
             TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 &&
                             h.size(1) == r.hidden(), "route: h must be float32 [T, hidden]");
             const Routing out = r.route(h.data_ptr<float>(), h.size(0));
             const auto opts = at::TensorOptions();
             at::Tensor ids = at::empty({h.size(0), out.k}, opts.dtype(at::kInt));
             at::Tensor w = at::empty({h.size(0), out.k}, opts.dtype(at::kFloat));
             std::copy(out.choice.begin(), out.choice.end(), ids.data_ptr<int32_t>());
             std::copy(out.weight.begin(), out.weight.end(), w.data_ptr<float>());
             return std::make_tuple(ids, w);
           }, "each token's experts (rank order, -1: dropped by top_p) and weights, of h [T, "
              "hidden]")
      .def("forward", [](RoutedExperts& r, const at::Tensor& h_in) {
             const at::Tensor h = h_in.contiguous();
             TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 &&
                             h.size(1) == r.hidden(), "forward: h must be float32 [T, hidden]");
             at::Tensor y = at::empty_like(h);
             r.forward(h.data_ptr<float>(), h.size(0), y.data_ptr<float>());
             return y;
           }, "the layer's experts of normed h [T, hidden]", release());
  pybind11::class_<DeltaNet, std::shared_ptr<DeltaNet>>(mod, "DeltaNet")
      .def(pybind11::init<const PackedLinear&, const PackedLinear&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                          int64_t, int64_t, int64_t, double>(),
           "in (q|k|v channels, z, b, alpha), out, conv [channels, taps], dt_bias, a, norm, "
           "n_k_heads, k_dim, n_v_heads, v_dim, eps")
      .def_property_readonly("width", &DeltaNet::width);
  pybind11::class_<DecoderStack>(mod, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, bool,
                          const std::string&, double>(),
           "hidden, heads, kv_heads, head_dim, rope_dim, ffn, eps, neox, activation (silu, "
           "gelu_tanh or swiglu_oai), attn_scale",
           pybind11::arg("hidden"), pybind11::arg("heads"), pybind11::arg("kv_heads"),
           pybind11::arg("head_dim"), pybind11::arg("rope_dim"), pybind11::arg("ffn"),
           pybind11::arg("eps"), pybind11::arg("neox") = false,
           pybind11::arg("activation") = "silu", pybind11::arg("attn_scale") = 0.0)
      .def("set_block_options", &DecoderStack::set_block_options,
           "(pre_norms, qk_norm_full, residual_scale, attn_softcap) for every block")
      .def("set_attn_temperature", &DecoderStack::set_attn_temperature,
           "(scale, floor): queries times 1 + scale ln(1 + floor(pos / floor))")
      .def("set_post_norms", &DecoderStack::set_post_norms,
           "the last layer's norms of the attention and MLP outputs")
      .def("set_attention", &DecoderStack::set_attention,
           "the last layer's sliding window (0: none) and RoPE table index")
      .def("add_layer", &DecoderStack::add_layer,
           "attn_norm, ffn_norm, then the qkv, o, gate_up and down PackedLinears (gate_up and "
           "down None: routed experts, given by set_experts)")
      .def("add_delta_net_layer", &DecoderStack::add_delta_net_layer,
           "attn_norm, ffn_norm, the DeltaNet, then gate_up and down PackedLinears (None: "
           "routed experts)")
      .def("set_attn_output_gate", &DecoderStack::set_attn_output_gate,
           "q heads carry a sigmoid output gate (before adding layers)")
      .def("set_experts", &DecoderStack::set_experts, "the last layer's RoutedExperts")
      .def("set_attention_extras", &DecoderStack::set_attention_extras,
           "the last layer's attention output bias [hidden] and sinks [heads] (empty: none)")
      .def("set_qkv_bias", &DecoderStack::set_qkv_bias, "the last layer's Q/K/V biases")
      .def("set_qk_norm", &DecoderStack::set_qk_norm,
           "the last layer's per-head q and k RMSNorm weights")
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def("set_profiling", &DecoderStack::set_profiling,
           "time each stage of forward (resets the totals)")
      .def("stage_seconds", &DecoderStack::stage_seconds,
           "seconds per stage summed over forward calls since set_profiling(True)")
      .def("new_lora", &DecoderStack::new_lora, "an empty LoRAWeights for this stack")
      .def("forward", &DecoderStack::forward,
           "x (in place), pool, ropes (one table per base), slots, tables, rows, positions, "
           "loras ([LoRAWeights]), token_lora (int64 [T], -1: none), and for recurrent "
           "layers conv_state, ssm_state (updated in place) and token_state (int64 [T]), and "
           "snap_conv, snap_ssm, token_snap (int64 [T], -1: none): states after tokens",
           pybind11::arg("x"), pybind11::arg("pool"), pybind11::arg("ropes"),
           pybind11::arg("slots"), pybind11::arg("tables"), pybind11::arg("rows"),
           pybind11::arg("positions"), pybind11::arg("loras") = std::vector<LoRAWeights*>(),
           pybind11::arg("token_lora") = pybind11::none(),
           pybind11::arg("conv_state") = pybind11::none(),
           pybind11::arg("ssm_state") = pybind11::none(),
           pybind11::arg("token_state") = pybind11::none(),
           pybind11::arg("snap_conv") = pybind11::none(),
           pybind11::arg("snap_ssm") = pybind11::none(),
           pybind11::arg("token_snap") = pybind11::none(), release());
}
