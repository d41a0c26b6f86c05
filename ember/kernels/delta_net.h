// Qwen 3.5's Gated DeltaNet (linear attention) layer, inside the decoder stack.
//
// Part of the quant_matmul.cpp translation unit (included inside its namespace, after
// row_ops.h). The PyTorch model (ember/models/qwen35.py) runs the same recipe op by op
// and is the oracle this path is tested against:
//
//   proj = W_in h                    one packed matmul: q|k|v channels, z, b, alpha
//   c = SiLU(causal depthwise conv of the q|k|v channels, `taps` wide, over the row's
//       previous taps - 1 inputs (the conv state) and this token's)
//   q, k = L2-normed key heads (q also / sqrt(k_dim)); value head j reads key head j % n_k
//   per value head: g = exp(a softplus(alpha + dt_bias)), beta = sigmoid(b),
//       S <- g S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
//   y = W_out (RMSNorm(o) * SiLU(z))    per value head
//
// A row's tokens are consecutive in the step and in order; each row has its own state
// slot (conv window and one S per value head, f32). Rows and value heads are computed
// apart, each token with the same code whatever else is in the step, so a row's
// output is bitwise independent of the batch (and of how its prompt was chunked: the
// scan runs token by token, so a chunk boundary changes nothing). A token may also ask
// for a snapshot: its row's state after it, copied to a snapshot slot (the prefix cache
// restores it into another row's slot later, the same bits).

class DeltaNet {
 public:
  static constexpr int64_t kMaxTaps = 16, kMaxHead = 512;  // the scan's stack buffers

  DeltaNet(const PackedLinear& in, const PackedLinear& out, const at::Tensor& conv,
           const at::Tensor& dt_bias, const at::Tensor& a, const at::Tensor& norm,
           int64_t n_k, int64_t k_dim, int64_t n_v, int64_t v_dim, double eps)
      : in_(in), out_(out), n_k_(n_k), k_dim_(k_dim), n_v_(n_v), v_dim_(v_dim), eps_(eps) {
    TORCH_CHECK(n_k > 0 && k_dim > 0 && n_v > 0 && v_dim > 0 && n_v % n_k == 0,
                "DeltaNet: value heads must be a multiple of the key heads");
    channels_ = 2 * n_k * k_dim + n_v * v_dim;
    TORCH_CHECK(conv.dim() == 2 && conv.size(0) == channels_ && conv.size(1) >= 1,
                "DeltaNet: conv must be [", channels_, ", taps]");
    taps_ = conv.size(1);
    TORCH_CHECK(taps_ <= kMaxTaps && k_dim <= kMaxHead && v_dim <= kMaxHead,
                "DeltaNet: at most ", kMaxTaps, " convolution taps and heads of at most ",
                kMaxHead);
    for (const at::Tensor* t : {&conv, &dt_bias, &a, &norm}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                  "DeltaNet: conv, dt_bias, a and norm must be CPU float32");
    }
    TORCH_CHECK(dt_bias.numel() == n_v && a.numel() == n_v && norm.numel() == v_dim,
                "DeltaNet: dt_bias and a need one value per value head, norm v_dim");
    TORCH_CHECK(in.out_features() == width(), "DeltaNet: the input projection has ",
                in.out_features(), " outputs, expected ", width(),
                " (q|k|v channels, z, b, alpha)");
    TORCH_CHECK(out.in_features() == n_v * v_dim, "DeltaNet: the output projection reads ",
                out.in_features(), " features, expected ", n_v * v_dim);
    conv_ = conv.contiguous();
    dt_bias_ = dt_bias.contiguous();
    a_ = a.contiguous();
    norm_ = norm.contiguous();
  }

  int64_t hidden() const { return in_.in_features(); }
  int64_t out_features() const { return out_.out_features(); }
  int64_t channels() const { return channels_; }
  int64_t taps() const { return taps_; }
  int64_t n_v() const { return n_v_; }
  int64_t k_dim() const { return k_dim_; }
  int64_t v_dim() const { return v_dim_; }
  // the input projection's outputs: q|k|v channels, z (n_v v_dim), b and alpha (n_v each)
  int64_t width() const { return channels_ + n_v_ * v_dim_ + 2 * n_v_; }

  // y [T, hidden] = the layer's mixer of normed h [T, hidden]. slots [T]: each token's
  // state slot; conv_state [S, taps - 1, channels] and ssm [S, n_v, k_dim, v_dim]: this
  // layer's states, updated in place. Scratch: proj [T, width()], mixed [T, channels],
  // core [T, n_v v_dim]. snaps [T] (null: none): the snapshot slot of the state after
  // each token (-1: none) in snap_conv / snap_ssm, laid out as conv_state / ssm.
  void forward(const float* h, int64_t T, const int64_t* slots, float* conv_state,
               float* ssm, float* proj, float* mixed, float* core, float* y,
               const int64_t* snaps = nullptr, float* snap_conv = nullptr,
               float* snap_ssm = nullptr) const {
    in_.matmul_into(h, T, proj);
    // runs of consecutive tokens of one row (its slot)
    std::vector<int64_t> starts;
    for (int64_t t = 0; t < T; ++t) {
      if (t == 0 || slots[t] != slots[t - 1]) starts.push_back(t);
    }
    const int64_t runs = static_cast<int64_t>(starts.size());
    starts.push_back(T);
    const int64_t P = width();
    // the convolution, per row and channel block, in token order
    const int64_t block = 256, blocks = (channels_ + block - 1) / block;
    at::parallel_for(0, runs * blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t rb = b0; rb < b1; ++rb) {
        const int64_t r = rb / blocks, c0 = (rb % blocks) * block;
        convolve(proj, P, starts[r], starts[r + 1], c0, std::min(channels_, c0 + block),
                 conv_state + slots[starts[r]] * (taps_ - 1) * channels_, mixed, snaps,
                 snap_conv);
      }
    });
    // the scan, per row and value head
    at::parallel_for(0, runs * n_v_, 1, [&](int64_t j0, int64_t j1) {
      for (int64_t rj = j0; rj < j1; ++rj) {
        const int64_t r = rj / n_v_, head = rj % n_v_;
        float* S = ssm + (slots[starts[r]] * n_v_ + head) * k_dim_ * v_dim_;
        const int64_t KV = k_dim_ * v_dim_;
        for (int64_t t = starts[r]; t < starts[r + 1]; ++t) {
          scan_token(proj + t * P, mixed + t * channels_, head, S,
                     core + t * n_v_ * v_dim_ + head * v_dim_);
          if (snaps != nullptr && snaps[t] >= 0) {
            std::memcpy(snap_ssm + (snaps[t] * n_v_ + head) * KV, S, KV * sizeof(float));
          }
        }
      }
    });
    out_.matmul_into(core, T, y);
  }

 private:
  // Channels [c0, c1) of the tokens [t0, t1) of one row: mixed = SiLU(conv), the
  // state's window moved along. proj rows: P wide, q|k|v channels first.
  void convolve(const float* proj, int64_t P, int64_t t0, int64_t t1, int64_t c0, int64_t c1,
                float* state, float* mixed, const int64_t* snaps, float* snap_conv) const {
    const int64_t K = taps_;
    const float* w = conv_.data_ptr<float>();
    for (int64_t c = c0; c < c1; ++c) {
      float window[kMaxTaps];
      for (int64_t j = 0; j + 1 < K; ++j) window[j] = state[j * channels_ + c];
      const float* wc = w + c * K;
      for (int64_t t = t0; t < t1; ++t) {
        window[K - 1] = proj[t * P + c];
        float acc = 0.0f;
        for (int64_t j = 0; j < K; ++j) acc += window[j] * wc[j];
        mixed[t * channels_ + c] = acc / (1.0f + exp_scalar(-acc));
        for (int64_t j = 0; j + 1 < K; ++j) window[j] = window[j + 1];
        if (snaps != nullptr && snaps[t] >= 0) {
          float* snap = snap_conv + snaps[t] * (K - 1) * channels_;
          for (int64_t j = 0; j + 1 < K; ++j) snap[j * channels_ + c] = window[j];
        }
      }
      for (int64_t j = 0; j + 1 < K; ++j) state[j * channels_ + c] = window[j];
    }
  }

  // One token of one value head: S (k_dim x v_dim) decayed and corrected, the head's
  // output o [v_dim] normed and gated. p: the token's projection row, m: its conv row.
  void scan_token(const float* p, const float* m, int64_t head, float* S, float* o) const {
    const int64_t K = k_dim_, V = v_dim_, key = head % n_k_;
    float q[kMaxHead], k[kMaxHead], kv[kMaxHead];
    l2_normed(m + key * K, K, 1.0f / std::sqrt(static_cast<float>(K)), q);
    l2_normed(m + n_k_ * K + key * K, K, 1.0f, k);
    const float* v = m + 2 * n_k_ * K + head * V;
    const float* z = p + channels_ + head * V;
    const float b = p[channels_ + n_v_ * V + head];
    const float alpha = p[channels_ + n_v_ * V + n_v_ + head] + dt_bias_.data_ptr<float>()[head];
    const float softplus = alpha > 20.0f ? alpha : std::log1p(std::exp(alpha));
    const float g = std::exp(a_.data_ptr<float>()[head] * softplus);
    const float beta = 1.0f / (1.0f + std::exp(-b));
    // S <- g S, kv = S^T k
    for (int64_t j = 0; j < V; ++j) kv[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {
      float* row = S + i * V;
      const float ki = k[i];
      for (int64_t j = 0; j < V; ++j) {
        row[j] *= g;
        kv[j] += ki * row[j];
      }
    }
    // delta = beta (v - kv); S += k delta^T; o = S^T q
    for (int64_t j = 0; j < V; ++j) kv[j] = beta * (v[j] - kv[j]);
    for (int64_t j = 0; j < V; ++j) o[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {
      float* row = S + i * V;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < V; ++j) {
        row[j] += ki * kv[j];
        o[j] += qi * row[j];
      }
    }
    // RMSNorm of the head's output, gated by SiLU(z)
    rms_norm_row(o, norm_.data_ptr<float>(), V, eps_, o);
    for (int64_t j = 0; j < V; ++j) o[j] *= z[j] / (1.0f + exp_scalar(-z[j]));
  }

  // y = x / sqrt(sum x^2 + eps) * scale (the oracle's rsqrt(sum + eps))
  void l2_normed(const float* x, int64_t K, float scale, float* y) const {
    float ss = 0.0f;
    for (int64_t i = 0; i < K; ++i) ss += x[i] * x[i];
    const float f = scale / std::sqrt(ss + static_cast<float>(eps_));
    for (int64_t i = 0; i < K; ++i) y[i] = x[i] * f;
  }

  PackedLinear in_, out_;
  at::Tensor conv_, dt_bias_, a_, norm_;
  int64_t n_k_, k_dim_, n_v_, v_dim_, channels_ = 0, taps_ = 0;
  double eps_;
};
