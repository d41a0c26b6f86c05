// A layer's weight as the kernels hold it: huge-page memory, packing GGUF rows into the
// layouts of quant_layouts.h, and PackedLinear, one or more packed matrices multiplied
// with one quantization of the activations. Part of quant_matmul.cpp's translation unit
// (inside its anonymous namespace, after quant_kernels.h).

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
      (kquant_activations(g.type) ? kquant_ : legacy_) = true;
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
  const std::vector<SegView>& views() const { return views_; }
  // which quantizations of the activations its segments read (per 32, per 256)
  bool needs_legacy_activations() const { return legacy_; }
  bool needs_kquant_activations() const { return kquant_; }
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
