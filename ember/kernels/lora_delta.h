// Low-rank adapter deltas inside the fused decoder stack: y[t] += B (A x[t]) for each
// token t on the output columns its adapter targets, tokens of several adapters (and
// tokens of none) in one step. The base projection runs once for the whole batch
// (packed_linear.h); this adds each token's delta on top.
//
// Batch invariance: every number a token gets is summed in one fixed order from that
// token's input and its adapter's weights only (each of u = A x by ``dots``; each
// column of B u over the rank in order): the same bits whatever else is in the batch
// and however the threads split the work. Work is split two ways so one stream also
// uses every thread: first u = A x (one item per adapter, part and four rows of A: the
// rows are read once for every token of the adapter), then y += B u (one item per
// adapter, part and block of columns, B held transposed so that a block's columns are
// contiguous).

// Adapter weights are float32 or bfloat16 (uint16_t: the high half of a float32, so
// widening is exact and the arithmetic is the same as on the widened f32 values).
inline float widen(float w) { return w; }
inline float widen(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
#if defined(EMBER_AVX2)
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// Dot products of RB rows of A with TB tokens' inputs, out[i * TB + j] = a[i] . x[j]
// over K. Each is summed in one order whatever the block: 8 lanes over k in steps of
// 8, the lanes added pairwise (i + 4, then i + 2, then i + 1), the tail (K % 8) last;
// so a dot has the same bits computed alone or in any block (the block shares loads).
template <typename W, int RB, int TB>
inline void dots(const W* const* a, const float* const* x, int64_t K, float* out) {
  int64_t k = 0;
  float total[RB][TB];
#if defined(EMBER_AVX2)
  __m256 acc[RB][TB];
  for (int i = 0; i < RB; ++i) {
    for (int j = 0; j < TB; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  for (; k + 8 <= K; k += 8) {
    __m256 xv[TB];
    for (int j = 0; j < TB; ++j) xv[j] = _mm256_loadu_ps(x[j] + k);
    for (int i = 0; i < RB; ++i) {
      const __m256 av = load8(a[i] + k);
      for (int j = 0; j < TB; ++j) acc[i][j] = _mm256_fmadd_ps(av, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int j = 0; j < TB; ++j) {
      const __m256 s = acc[i][j];
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
      total[i][j] = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
    }
  }
#else
  float acc[RB][TB][8] = {};
  for (; k + 8 <= K; k += 8) {
    for (int i = 0; i < RB; ++i) {
      for (int j = 0; j < TB; ++j) {
        for (int l = 0; l < 8; ++l) acc[i][j][l] += widen(a[i][k + l]) * x[j][k + l];
      }
    }
  }
  for (int i = 0; i < RB; ++i) {
    for (int j = 0; j < TB; ++j) {
      const float* l = acc[i][j];
      total[i][j] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    }
  }
#endif
  for (int i = 0; i < RB; ++i) {
    for (int j = 0; j < TB; ++j) {
      for (int64_t t = k; t < K; ++t) total[i][j] += widen(a[i][t]) * x[j][t];
      out[i * TB + j] = total[i][j];
    }
  }
}

// dots for any block of at most 4 rows and 3 tokens.
template <typename W>
inline void dots_block(int rows, int tokens, const W* const* a, const float* const* x,
                       int64_t K, float* out) {
  using Kernel = void (*)(const W* const*, const float* const*, int64_t, float*);
  static constexpr Kernel kernels[4][3] = {
      {dots<W, 1, 1>, dots<W, 1, 2>, dots<W, 1, 3>},
      {dots<W, 2, 1>, dots<W, 2, 2>, dots<W, 2, 3>},
      {dots<W, 3, 1>, dots<W, 3, 2>, dots<W, 3, 3>},
      {dots<W, 4, 1>, dots<W, 4, 2>, dots<W, 4, 3>}};
  kernels[rows - 1][tokens - 1](a, x, K, out);
}

// For each of TB tokens j: out[j][c] += sum over r < rank, in order, of bt[r * stride +
// c] * u[j][r], for c < width (at most 64). A column's sum is the same whatever the
// block of tokens (they share the loads of bt); 32-column groups in FMA lanes.
template <typename W, int TB>
inline void add_columns(const W* bt, int64_t stride, const float* const* u, int64_t rank,
                        int64_t width, float* const* out) {
  int64_t c0 = 0;
#if defined(EMBER_AVX2)
  for (; c0 + 32 <= width; c0 += 32) {
    __m256 acc[TB][4];
    for (int j = 0; j < TB; ++j) {
      for (int q = 0; q < 4; ++q) acc[j][q] = _mm256_setzero_ps();
    }
    for (int64_t r = 0; r < rank; ++r) {
      const W* row = bt + r * stride + c0;
      __m256 b[4];
      for (int q = 0; q < 4; ++q) b[q] = load8(row + 8 * q);
      for (int j = 0; j < TB; ++j) {
        const __m256 ur = _mm256_broadcast_ss(u[j] + r);
        for (int q = 0; q < 4; ++q) acc[j][q] = _mm256_fmadd_ps(b[q], ur, acc[j][q]);
      }
    }
    for (int j = 0; j < TB; ++j) {
      for (int q = 0; q < 4; ++q) {
        float* o = out[j] + c0 + 8 * q;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[j][q]));
      }
    }
  }
#endif
  if (c0 == width) return;
  for (int j = 0; j < TB; ++j) {
    float acc[64] = {};
    for (int64_t r = 0; r < rank; ++r) {
      const W* row = bt + r * stride;
      const float ur = u[j][r];
      for (int64_t c = c0; c < width; ++c) acc[c] += widen(row[c]) * ur;
    }
    for (int64_t c = c0; c < width; ++c) out[j][c] += acc[c];
  }
}

// The decoder stack's four fused projections, in the order adapters address them.
enum FusedProjection { kQKV, kOutput, kGateUp, kDown, kFusedProjections };

// One adapter's deltas on one fused projection of one layer: output columns
// [lo, lo + bt.size(1)); a [rank, in]; bt [rank, columns]: B transposed, with the
// adapter's scale in it; both float32 or both bfloat16.
struct LoRAPart {
  int64_t lo, rank;
  at::Tensor a, bt;
  int64_t columns() const { return bt.size(1); }
  bool bf16() const { return a.scalar_type() == at::kBFloat16; }
  template <typename W>
  const W* weights(const at::Tensor& t) const {
    return static_cast<const W*>(t.data_ptr());
  }
};

// One adapter's weights for a decoder stack (made by DecoderStack::new_lora, which
// knows the projections' shapes): the tensors are shared with Python, not copied.
class LoRAWeights {
 public:
  LoRAWeights(int64_t layers, std::array<int64_t, kFusedProjections> in,
              std::array<int64_t, kFusedProjections> out)
      : parts_(layers), in_(in), out_(out) {}

  // Add the delta of one target: bt.T [columns, rank] @ a [rank, in] onto output
  // columns [lo, lo + columns) of fused projection ``proj`` in ``layer``.
  void set(int64_t layer, int64_t proj, int64_t lo, const at::Tensor& a, const at::Tensor& bt) {
    TORCH_CHECK(layer >= 0 && layer < layers() && proj >= 0 && proj < kFusedProjections,
                "LoRAWeights: no projection ", proj, " in layer ", layer);
    for (const at::Tensor* t : {&a, &bt}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == a.scalar_type() &&
                      (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
                      t->dim() == 2 && t->is_contiguous(),
                  "LoRAWeights: A and B must be contiguous CPU matrices, both float32 or both "
                  "bfloat16");
    }
    const int64_t rank = a.size(0), cols = bt.size(1);
    TORCH_CHECK(rank > 0 && a.size(1) == in_[proj] && bt.size(0) == rank,
                "LoRAWeights: A [", a.size(0), ", ", a.size(1), "] and B transposed [",
                bt.size(0), ", ", bt.size(1), "] do not fit a projection of ", in_[proj],
                " inputs");
    TORCH_CHECK(lo >= 0 && lo + cols <= out_[proj],
                "LoRAWeights: columns past the projection's ", out_[proj]);
    std::vector<LoRAPart>& parts = parts_[layer][proj];
    for (const LoRAPart& p : parts) {
      TORCH_CHECK(lo + cols <= p.lo || p.lo + p.columns() <= lo,
                  "LoRAWeights: two deltas on the same output columns");
    }
    parts.push_back({lo, rank, a, bt});
  }

  int64_t layers() const { return static_cast<int64_t>(parts_.size()); }
  int64_t input(int64_t proj) const { return in_[proj]; }
  int64_t output(int64_t proj) const { return out_[proj]; }
  const std::vector<LoRAPart>& parts(int64_t layer, int proj) const {
    return parts_[layer][proj];
  }
  // The rank summed over one projection's parts (room for u per token).
  int64_t total_rank(int64_t layer, int proj) const {
    int64_t r = 0;
    for (const LoRAPart& p : parts_[layer][proj]) r += p.rank;
    return r;
  }
  bool fits(int64_t layers, const std::array<int64_t, kFusedProjections>& in,
            const std::array<int64_t, kFusedProjections>& out) const {
    return layers == this->layers() && in == in_ && out == out_;
  }

 private:
  std::vector<std::array<std::vector<LoRAPart>, kFusedProjections>> parts_;
  std::array<int64_t, kFusedProjections> in_, out_;
};

// One step's adapters: which one each token uses (-1: none) and the tokens of each.
class LoRAStep {
 public:
  LoRAStep(const std::vector<LoRAWeights*>& adapters, const at::Tensor& token_adapter,
           int64_t T)
      : adapters_(adapters), tokens_(adapters.size()), T_(T) {
    if (adapters.empty()) return;
    TORCH_CHECK(token_adapter.device().is_cpu() && token_adapter.scalar_type() == at::kLong &&
                    token_adapter.is_contiguous() && token_adapter.numel() == T,
                "DecoderStack: the tokens' adapters must be contiguous int64 [T]");
    const int64_t* ids = token_adapter.data_ptr<int64_t>();
    const int64_t G = static_cast<int64_t>(adapters.size());
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ids[t] >= -1 && ids[t] < G, "DecoderStack: a token's adapter is out of range");
      if (ids[t] >= 0) tokens_[ids[t]].push_back(t);
    }
  }

  bool empty() const { return adapters_.empty(); }

  // y [T, N] += each token's delta of projection ``proj`` of ``layer`` from x [T, K].
  void apply(int64_t layer, int proj, const float* x, int64_t K, float* y, int64_t N) const {
    struct Item { int64_t g, part, at; };  // at: A's first row, or B's first column
    const int64_t G = static_cast<int64_t>(adapters_.size());
    int64_t U = 0;  // u's row width: the largest total rank of a group
    for (int64_t g = 0; g < G; ++g) {
      if (!tokens_[g].empty()) U = std::max(U, adapters_[g]->total_rank(layer, proj));
    }
    if (U == 0) return;
    std::vector<float> u(static_cast<size_t>(T_ * U));
    std::vector<Item> first, second;
    for (int64_t g = 0; g < G; ++g) {
      if (tokens_[g].empty()) continue;
      const std::vector<LoRAPart>& parts = adapters_[g]->parts(layer, proj);
      for (int64_t p = 0; p < static_cast<int64_t>(parts.size()); ++p) {
        for (int64_t r = 0; r < parts[p].rank; r += kRows) first.push_back({g, p, r});
        for (int64_t c = 0; c < parts[p].columns(); c += kColumns) second.push_back({g, p, c});
      }
    }
    // u[t, off + r] = A[r] . x[t] (off: the part's place in u)
    at::parallel_for(0, static_cast<int64_t>(first.size()), 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const Item& it = first[i];
        const std::vector<LoRAPart>& parts = adapters_[it.g]->parts(layer, proj);
        const LoRAPart& p = parts[it.part];
        float* ut = u.data() + offset(parts, it.part);
        if (p.bf16()) {
          rows_of_a<uint16_t>(p, it.at, tokens_[it.g], x, K, ut, U);
        } else {
          rows_of_a<float>(p, it.at, tokens_[it.g], x, K, ut, U);
        }
      }
    });
    // y[t, lo + c] += sum over r in order of bt[r, c] u[t, off + r]
    at::parallel_for(0, static_cast<int64_t>(second.size()), 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const Item& it = second[i];
        const std::vector<LoRAPart>& parts = adapters_[it.g]->parts(layer, proj);
        const LoRAPart& p = parts[it.part];
        const float* ut = u.data() + offset(parts, it.part);
        if (p.bf16()) {
          columns_of_b<uint16_t>(p, it.at, tokens_[it.g], ut, U, y, N);
        } else {
          columns_of_b<float>(p, it.at, tokens_[it.g], ut, U, y, N);
        }
      }
    });
  }

 private:
  static constexpr int64_t kRows = 4, kColumns = 64;

  // u[t, r] for rows r0 .. r0 + kRows of the part's A, for the tokens ts: kRows rows
  // by three tokens at a time
  template <typename W>
  static void rows_of_a(const LoRAPart& p, int64_t r0, const std::vector<int64_t>& ts,
                        const float* x, int64_t K, float* u, int64_t U) {
    const int rows = static_cast<int>(std::min(kRows, p.rank - r0));
    const W* a[kRows];
    for (int r = 0; r < rows; ++r) a[r] = p.weights<W>(p.a) + (r0 + r) * K;
    for (size_t j = 0; j < ts.size(); j += 3) {
      const int n = static_cast<int>(std::min<size_t>(3, ts.size() - j));
      const float* xs[3];
      float out[kRows * 3];
      for (int m = 0; m < n; ++m) xs[m] = x + ts[j + m] * K;
      dots_block<W>(rows, n, a, xs, K, out);
      for (int r = 0; r < rows; ++r) {
        for (int m = 0; m < n; ++m) u[ts[j + m] * U + r0 + r] = out[r * n + m];
      }
    }
  }

  // y[t, lo + c] += (B u[t])[c] for columns c0 .. c0 + kColumns of the part, for the
  // tokens ts, two at a time
  template <typename W>
  static void columns_of_b(const LoRAPart& p, int64_t c0, const std::vector<int64_t>& ts,
                           const float* u, int64_t U, float* y, int64_t N) {
    const int64_t cols = p.columns(), width = std::min(kColumns, cols - c0);
    const W* bt = p.weights<W>(p.bt) + c0;
    size_t j = 0;
    for (; j + 2 <= ts.size(); j += 2) {
      const float* us[2] = {u + ts[j] * U, u + ts[j + 1] * U};
      float* outs[2] = {y + ts[j] * N + p.lo + c0, y + ts[j + 1] * N + p.lo + c0};
      add_columns<W, 2>(bt, cols, us, p.rank, width, outs);
    }
    if (j < ts.size()) {
      const float* us[1] = {u + ts[j] * U};
      float* outs[1] = {y + ts[j] * N + p.lo + c0};
      add_columns<W, 1>(bt, cols, us, p.rank, width, outs);
    }
  }

  static int64_t offset(const std::vector<LoRAPart>& parts, int64_t part) {
    int64_t off = 0;
    for (int64_t p = 0; p < part; ++p) off += parts[p].rank;
    return off;
  }
  const std::vector<LoRAWeights*>& adapters_;
  std::vector<std::vector<int64_t>> tokens_;
  int64_t T_;  // the step's tokens (u holds a row for each)
};
