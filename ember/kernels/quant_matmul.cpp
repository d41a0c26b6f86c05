// Quantized weight matmuls, attention over the paged KV pool and the fused decoder
// stack: ember's native kernels, one translation unit (see ember/kernels/__init__.py).
//
//   quant_lanes.h     SIMD lane sets (AVX-512 VNNI, AVX2, portable)
//   quant_layouts.h   packed weight layouts, packing from GGUF bytes, dequantization
//   quant_kernels.h   int8 activations and the integer matmul kernels
//   paged_attention.h attention over the pool in place
//   fused_decoder.h   a whole decoder stack in one call per step
//
// Threads: at::parallel_for (follows torch.set_num_threads). SIMD: chosen at compile
// time (AVX-512 VNNI, AVX2+FMA+F16C with AVX-VNNI where present, or portable C++).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
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

// --------------------------------------------------------------- the packed linear

// An uninitialized uint8 tensor of n bytes in memory the OS may back with transparent
// huge pages (a 2 MB-aligned anonymous mapping, MADV_HUGEPAGE): streaming weights then
// takes a TLB miss (in a VM, a nested page walk) per 2 MB rather than per 4 KB. Pages
// are only committed when first written. Falls back to at::empty where mmap fails.
at::Tensor huge_empty(int64_t n) {
  TORCH_CHECK(n >= 0, "huge_empty: negative size");
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t len = static_cast<size_t>(n) + kHuge;
  void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return at::empty({n}, at::TensorOptions().dtype(at::kByte));
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~(kHuge - 1);
#if defined(MADV_HUGEPAGE)
  madvise(reinterpret_cast<void*>(aligned), (static_cast<size_t>(n) + kHuge - 1) & ~(kHuge - 1),
          MADV_HUGEPAGE);
#endif
  return torch::from_blob(reinterpret_cast<void*>(aligned), {n},
                          [base, len](void*) { munmap(base, len); },
                          at::TensorOptions().dtype(at::kByte));
}

// Bytes of a packed weight of `rows` rows of K elements of ggml type `type`.
int64_t packed_nbytes(int64_t type, int64_t rows, int64_t K) {
  TORCH_CHECK(rows >= 0, "rows must be >= 0");
  return groups_of(rows) * geom_of(static_cast<int>(type), K).stride;
}

// One layer's weight: one or more packed matrices (segments) of possibly different
// types, row-concatenated (a fused QKV of a Q4_K_M file is Q4_K, Q4_K, Q6_K), all
// multiplied with one quantization of the activations and one split over the threads.
class PackedLinear {
 public:
  using Segment = std::tuple<int64_t, int64_t, at::Tensor>;  // (ggml type, rows, bytes)

  PackedLinear(int64_t in_features, const std::vector<Segment>& segments) : k_(in_features) {
    TORCH_CHECK(!segments.empty(), "PackedLinear: no segments");
    for (const auto& [type, rows, blob] : segments) {
      TORCH_CHECK(packable(static_cast<int>(type)), "PackedLinear: no packed layout for ggml type ",
                  type);
      const Geom g = geom_of(static_cast<int>(type), k_);
      TORCH_CHECK(blob.device().is_cpu() && blob.is_contiguous() &&
                      blob.scalar_type() == at::kByte && rows > 0 &&
                      blob.numel() == groups_of(rows) * g.stride,
                  "PackedLinear: a segment of ", rows, " rows of type ", type, " and K = ", k_,
                  " needs a contiguous uint8 tensor of ", groups_of(rows) * g.stride,
                  " bytes, got ", blob.sizes());
      views_.push_back(SegView{g, rows, n_, blob.data_ptr<uint8_t>()});
      (g.sb == 256 ? kquant_ : legacy_) = true;
      blobs_.push_back(blob);
      types_.push_back(type);
      n_ += rows;
      nbytes_ += blob.numel();
    }
  }

  int64_t in_features() const { return k_; }
  int64_t out_features() const { return n_; }
  int64_t nbytes() const { return nbytes_; }
  std::vector<int64_t> types() const { return types_; }
  std::vector<Segment> segments() const {
    std::vector<Segment> out;
    for (size_t i = 0; i < views_.size(); ++i) {
      out.emplace_back(types_[i], views_[i].rows, blobs_[i]);
    }
    return out;
  }

  // y[M, N] = x[M, K] @ W^T with int8 activations (the decoder stack's path).
  void matmul_into(const float* x, int64_t M, float* y) const {
    Acts a;
    if (legacy_) a.b32 = quantize_rows(x, M, k_);
    if (kquant_) a.b256 = quantize_rows_k(x, M, k_);
    matmul_segments(views_, a, M, k_, y, n_);
  }

  // x [M, K] float32 -> [M, N]: int8 activations below gemm_min_m rows, else f32 GEMM
  // over dequantized row chunks (f32-exact up to summation order).
  at::Tensor matmul(const at::Tensor& x_in, int64_t gemm_min_m) const {
    const at::Tensor x = x_in.contiguous();
    TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
                    x.size(1) == k_,
                "PackedLinear: x must be CPU float32 [M, ", k_, "], got ", x.sizes());
    const int64_t M = x.size(0);
    at::Tensor y = at::empty({M, n_}, x.options());
    if (M == 0) return y;
    if (M >= gemm_min_m) {
      matmul_dequant(x, y);
    } else {
      matmul_into(x.data_ptr<float>(), M, y.data_ptr<float>());
    }
    return y;
  }

  // The weight as f32 [N, K], equal to gguf-py's dequantization of the source bytes.
  at::Tensor dequantize() const {
    at::Tensor out = at::empty({n_, k_}, at::TensorOptions().dtype(at::kFloat));
    for (const SegView& s : views_) {
      float* base = out.data_ptr<float>() + s.col0 * k_;
      at::parallel_for(0, s.rows, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          dequant_group_row(s.g, s.data + (r / RG) * s.g.stride, static_cast<int>(r % RG),
                            base + r * k_);
        }
      });
    }
    return out;
  }

  // Rows `ids` of the weight as f32 [len(ids), K] (an embedding lookup from a tied head).
  at::Tensor dequantize_rows(const at::Tensor& ids_in) const {
    const at::Tensor ids = ids_in.contiguous().to(at::kLong);
    const int64_t T = ids.numel();
    at::Tensor out = at::empty({T, k_}, at::TensorOptions().dtype(at::kFloat));
    const int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ip[t] >= 0 && ip[t] < n_, "row ", ip[t], " out of range for ", n_, " rows");
    }
    at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const SegView& s = segment_of(ip[t]);
        const int64_t r = ip[t] - s.col0;
        dequant_group_row(s.g, s.data + (r / RG) * s.g.stride, static_cast<int>(r % RG),
                          out.data_ptr<float>() + t * k_);
      }
    });
    return out;
  }

 private:
  const SegView& segment_of(int64_t row) const {
    for (const SegView& s : views_) {
      if (row < s.col0 + s.rows) return s;
    }
    return views_.back();
  }

  // y[:, segment rows] = x @ W_seg^T, one chunk of ~2 MB of dequantized rows at a time.
  void matmul_dequant(const at::Tensor& x, at::Tensor& y) const {
    const int64_t chunk = std::max<int64_t>(RG, (int64_t{1} << 19) / k_ / RG * RG);
    // reused per calling thread (a fresh multi-MB buffer per call costs page faults);
    // the workers write through this pointer, not through their own thread_locals
    static thread_local std::vector<float> storage;
    storage.resize(std::max<size_t>(storage.size(), static_cast<size_t>(chunk * k_)));
    float* bp = storage.data();
    at::Tensor buf = at::from_blob(bp, {chunk, k_}, x.options());
    for (const SegView& s : views_) {
      for (int64_t r0 = 0; r0 < s.rows; r0 += chunk) {
        const int64_t rows = std::min(chunk, s.rows - r0);
        at::parallel_for(r0, r0 + rows, 4, [&](int64_t a, int64_t b) {
          for (int64_t r = a; r < b; ++r) {
            dequant_group_row(s.g, s.data + (r / RG) * s.g.stride, static_cast<int>(r % RG),
                              bp + (r - r0) * k_);
          }
        });
        y.narrow(1, s.col0 + r0, rows).copy_(at::mm(x, buf.narrow(0, 0, rows).t()));
      }
    }
  }

  int64_t k_ = 0, n_ = 0, nbytes_ = 0;
  bool legacy_ = false, kquant_ = false;  // which activation quantizations it needs
  std::vector<at::Tensor> blobs_;
  std::vector<SegView> views_;
  std::vector<int64_t> types_;
};

// Pack GGUF rows [row0, row0 + nrows) of a `type` matrix with K columns (raw: their
// bytes, e.g. a view of the file mapping) into blob (packed_nbytes(type, rows, K) bytes;
// row0 a multiple of 16). Rows past the matrix's end inside the last group stay zero.
void pack_rows(at::Tensor& blob, const pybind11::buffer& raw, int64_t type, int64_t row0,
               int64_t nrows, int64_t K) {
  const pybind11::buffer_info info = raw.request();
  TORCH_CHECK(info.itemsize == 1 && info.ndim >= 1, "pack_rows: raw must be a byte buffer");
  int64_t size = 1;
  for (auto d : info.shape) size *= d;
  const Geom g = geom_of(static_cast<int>(type), K);
  const int64_t row_bytes = g.nsb * g.gguf_block;
  TORCH_CHECK(size == nrows * row_bytes, "pack_rows: ", nrows, " rows of ", K,
              " elements of type ", type, " are ", nrows * row_bytes, " bytes, got ", size);
  bool contiguous = true;
  for (int64_t i = info.ndim - 1, expect = 1; i >= 0; --i) {
    if (info.shape[i] != 1 && info.strides[i] != expect) contiguous = false;
    expect *= info.shape[i];
  }
  TORCH_CHECK(contiguous, "pack_rows: raw must be contiguous");
  TORCH_CHECK(blob.is_contiguous() && blob.scalar_type() == at::kByte && row0 >= 0 &&
                  row0 % RG == 0 && nrows >= 0 && groups_of(row0 + nrows) * g.stride <= blob.numel(),
              "pack_rows: blob too small for rows up to ", row0 + nrows, " or row0 ", row0,
              " not a multiple of ", RG);
  const uint8_t* src = static_cast<const uint8_t*>(info.ptr);
  uint8_t* dst = blob.data_ptr<uint8_t>();
  pybind11::gil_scoped_release release;
  const int64_t g0 = row0 / RG, g1 = groups_of(row0 + nrows);
  at::parallel_for(g0, g1, 4, [&](int64_t a, int64_t b) {
    for (int64_t gi = a; gi < b; ++gi) {
      const uint8_t* rows[RG];
      for (int64_t r = 0; r < RG; ++r) {
        const int64_t local = gi * RG + r - row0;
        rows[r] = local < nrows ? src + local * row_bytes : nullptr;
      }
      uint8_t* grp = dst + gi * g.stride;
      std::memset(grp, 0, g.stride);
      pack_group(g, rows, grp);
    }
  });
}

std::vector<at::Tensor> quantize_activations(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % QK == 0,
              "x must be float32 [M, K] with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  const QuantX r = quantize_rows(x.data_ptr<float>(), M, K);
  const auto f32 = x.options();
  auto copy = [](const void* src, at::Tensor t) {
    std::memcpy(t.data_ptr(), src, t.nbytes());
    return t;
  };
  return {copy(r.q, at::empty({M, K}, f32.dtype(at::kChar))), copy(r.d, at::empty({M, nb}, f32)),
          copy(r.s, at::empty({M, nb}, f32)), copy(r.c, at::empty({M, nb}, f32)),
          copy(r.qsum, at::empty({M, nb}, f32.dtype(at::kInt))),
          copy(r.qlo, at::empty({M, nb}, f32.dtype(at::kInt)))};
}

std::vector<at::Tensor> quantize_activations_k(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 256 == 0,
              "x must be float32 [M, K] with K a multiple of 256");
  const int64_t M = x.size(0), K = x.size(1);
  const QuantK r = quantize_rows_k(x.data_ptr<float>(), M, K);
  const auto f32 = x.options();
  at::Tensor q = at::empty({M, K}, f32.dtype(at::kChar)), d = at::empty({M, K / 256}, f32);
  at::Tensor bsum = at::empty({M, K / 16}, f32.dtype(at::kInt));
  std::memcpy(q.data_ptr(), r.q, q.nbytes());
  std::memcpy(d.data_ptr(), r.d, d.nbytes());
  std::memcpy(bsum.data_ptr(), r.bsum, bsum.nbytes());
  return {q, d, bsum};
}

std::string simd() {
#if defined(EMBER_VNNI512)
  return "avx512vnni";
#elif defined(EMBER_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

#include "paged_attention.h"
#include "fused_decoder.h"

}  // namespace

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
  mod.def("simd", &simd, "which SIMD path this build uses");
  mod.def("rms_norm", &rms_norm, "RMSNorm over the last dim (x, weight, eps)", release());
  mod.def("paged_attention", &paged_attention,
          "causal attention over the paged pool in place (q, pool, layer, tables, rows, "
          "positions, scale, window: 0 for none)",
          pybind11::arg("q"), pybind11::arg("pool"), pybind11::arg("layer"),
          pybind11::arg("tables"), pybind11::arg("rows"), pybind11::arg("positions"),
          pybind11::arg("scale"), pybind11::arg("window") = 0, release());
  pybind11::class_<DecoderStack>(mod, "DecoderStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, bool,
                          bool, double>(),
           "hidden, heads, kv_heads, head_dim, rope_dim, ffn, eps, neox, gelu, attn_scale",
           pybind11::arg("hidden"), pybind11::arg("heads"), pybind11::arg("kv_heads"),
           pybind11::arg("head_dim"), pybind11::arg("rope_dim"), pybind11::arg("ffn"),
           pybind11::arg("eps"), pybind11::arg("neox") = false, pybind11::arg("gelu") = false,
           pybind11::arg("attn_scale") = 0.0)
      .def("set_post_norms", &DecoderStack::set_post_norms,
           "the last layer's norms of the attention and MLP outputs")
      .def("set_attention", &DecoderStack::set_attention,
           "the last layer's sliding window (0: none) and RoPE table index")
      .def("add_layer", &DecoderStack::add_layer,
           "attn_norm, ffn_norm, then the qkv, o, gate_up and down PackedLinears")
      .def("set_qkv_bias", &DecoderStack::set_qkv_bias, "the last layer's Q/K/V biases")
      .def("set_qk_norm", &DecoderStack::set_qk_norm,
           "the last layer's per-head q and k RMSNorm weights")
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def("set_profiling", &DecoderStack::set_profiling,
           "time each stage of forward (resets the totals)")
      .def("stage_seconds", &DecoderStack::stage_seconds,
           "seconds per stage summed over forward calls since set_profiling(True)")
      .def("forward", &DecoderStack::forward,
           "x (in place), pool, ropes (one table per base), slots, tables, rows, positions",
           release());
}
