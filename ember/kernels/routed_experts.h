// A layer's routed experts (mixture of experts) inside the fused decoder stack.
//
// Part of the quant_matmul.cpp translation unit (included inside its namespace, after
// packed_linear.h and paged_attention.h, before fused_decoder.h).
//
// Routing: per token, an f32 dot of its normed hidden state with each of the E router
// rows (+ the router's bias, gpt-oss), the top_k logits kept (ties: the lower id) and
// weighed by the softmax over them. That is Qwen3-MoE's softmax over all E followed by
// renormalising the top k, and gpt-oss's softmax over the chosen logits, in one.
// `top_p` < 1 (--moe-expert-top-p, lossy and labelled so) then keeps only a token's
// first experts up to that cumulative weight and renormalises them.
//
// Grouping: the step's (token, expert) pairs are sorted by expert, then token; each
// active expert's rows go through its gate_up, the gated activation and its down as
// one multiply each, and all active experts' multiplies of one kind are one parallel
// pass (matmul_jobs): threads take contiguous ranges of equal cost (weight bytes times
// rows plus a constant) across all the experts' row groups, so the eight experts of a
// decode step are streamed by every core at once, with no Python per expert.
//
// Exactness: a row's product is the packed kernels' fixed per-row arithmetic whatever
// the rows beside it (quant_kernels.h); activations are quantized per row; a token's
// expert outputs are summed in its own rank order after all of them are computed. So a
// token's output is bitwise independent of the batch, of the grouping, of the chunks
// its experts are computed in, and of whether they were resident or streamed in: the
// slots only say where an expert's bytes are.
//
// Slots: the experts' packed weights by id. A resident model fills every slot at load.
// A streamed one (--moe-stream) sets a provider, called before each chunk of a layer's
// experts is computed with the ids still needed; it fills the slots of a prefix of them
// (at least one) and says how many, so a prefill that routes to every expert of a layer
// never needs them all in memory at once. A pilot, where one is set, is told the experts
// the stack guesses this layer will need (predict: its router on an earlier state of the
// stream, fused_decoder.h says which), to read them while earlier layers compute.

// Quantized activations of rows [M, K] as the segments of `linears` need them (per 32
// and/or per 256), in this thread's scratch (valid until its next quantization).
Acts quantize_for(const float* x, int64_t M, int64_t K, bool legacy, bool kquant) {
  Acts a;
  if (legacy) a.b32 = quantize_rows(x, M, K);
  if (kquant) a.b256 = quantize_rows_k(x, M, K);
  return a;
}

// The same activations from row `r0` on.
Acts rows_from(const Acts& a, int64_t r0, int64_t K) {
  Acts out = a;
  const int64_t nb = K / QK, nsb = K / 256;
  if (a.b32.q != nullptr) {
    out.b32 = QuantX{a.b32.q + r0 * K, a.b32.d + r0 * nb, a.b32.s + r0 * nb,
                     a.b32.c + r0 * nb, a.b32.qsum + r0 * nb, a.b32.qlo + r0 * nb};
  }
  if (a.b256.q != nullptr) {
    out.b256 = QuantK{a.b256.q + r0 * K, a.b256.d + r0 * nsb, a.b256.bsum + r0 * nsb * 16};
  }
  return out;
}

// One expert's packed gate|up [2F, H] and down [H, F].
struct ExpertWeights {
  PackedLinear gate_up, down;
};

// The experts each token of a step goes to: choice[t * k + j] (rank j, -1 past used[t])
// with weight[t * k + j].
struct Routing {
  int64_t k = 0;
  std::vector<int32_t> choice;
  std::vector<float> weight;
  std::vector<int32_t> used;
};

class RoutedExperts {
 public:
  using Provider = std::function<int64_t(const std::vector<int64_t>&)>;
  using Pilot = std::function<void(const std::vector<int64_t>&)>;

  // router [E, hidden] f32; top_k experts per token; each expert's FFN is `ffn` wide.
  RoutedExperts(const at::Tensor& router, int64_t top_k, int64_t ffn, const std::string& act)
      : router_(router.contiguous()), top_k_(top_k), ffn_(ffn), act_(activation_named(act)) {
    TORCH_CHECK(router_.device().is_cpu() && router_.scalar_type() == at::kFloat &&
                    router_.dim() == 2 && router_.size(0) > 0 && router_.size(1) > 0,
                "RoutedExperts: the router must be CPU float32 [experts, hidden]");
    TORCH_CHECK(top_k > 0 && top_k <= router_.size(0) && ffn > 0,
                "RoutedExperts: top_k must be in 1..experts and ffn positive");
    experts_ = router_.size(0);
    hidden_ = router_.size(1);
    slots_.resize(experts_);
    tokens_.assign(experts_, 0);
    lookups_.assign(experts_, 0);
  }

  int64_t num_experts() const { return experts_; }
  int64_t hidden() const { return hidden_; }
  int64_t top_k() const { return top_k_; }

  // gpt-oss: the router's bias [E], each expert's gate|up bias [E, 2F] (gate then up)
  // and down bias [E, hidden].
  void set_biases(const at::Tensor& router, const at::Tensor& gate_up, const at::Tensor& down) {
    router_bias_ = f32_of(router, {experts_}, "router bias");
    gate_up_bias_ = f32_of(gate_up, {experts_, 2 * ffn_}, "gate_up bias");
    down_bias_ = f32_of(down, {experts_, hidden_}, "down bias");
  }

  // An expert every token takes beside the routed ones (Qwen 3.5 MoE): its output is
  // scaled per token by sigmoid(gate . h).
  void set_shared(const PackedLinear& gate_up, const PackedLinear& down, const at::Tensor& gate) {
    TORCH_CHECK(gate_up.in_features() == hidden_ && gate_up.out_features() % 2 == 0 &&
                    down.out_features() == hidden_ &&
                    down.in_features() == gate_up.out_features() / 2,
                "RoutedExperts: the shared expert's shapes do not fit the layer");
    shared_.emplace(ExpertWeights{gate_up, down});
    shared_gate_ = f32_of(gate, {hidden_}, "shared expert gate");
  }

  // Keep a token's first experts up to cumulative weight p (1: all top_k, exact).
  void set_top_p(double p) {
    TORCH_CHECK(p > 0 && p <= 1, "RoutedExperts: top_p must be in (0, 1], got ", p);
    top_p_ = static_cast<float>(p);
  }

  void set_expert(int64_t e, const PackedLinear& gate_up, const PackedLinear& down) {
    check_id(e);
    TORCH_CHECK(gate_up.in_features() == hidden_ && gate_up.out_features() == 2 * ffn_ &&
                    down.in_features() == ffn_ && down.out_features() == hidden_,
                "RoutedExperts: expert ", e, " is gate_up [", gate_up.out_features(), ", ",
                gate_up.in_features(), "], down [", down.out_features(), ", ",
                down.in_features(), "]; the layer needs [", 2 * ffn_, ", ", hidden_, "], [",
                hidden_, ", ", ffn_, "]");
    slots_[e].emplace(ExpertWeights{gate_up, down});
  }

  void drop_expert(int64_t e) {
    check_id(e);
    slots_[e].reset();
  }

  bool has_expert(int64_t e) const {
    check_id(e);
    return slots_[e].has_value();
  }

  void set_provider(std::optional<Provider> provider) { provider_ = std::move(provider); }
  void set_pilot(std::optional<Pilot> pilot) { pilot_ = std::move(pilot); }
  bool piloted() const { return pilot_.has_value(); }

  // Tell the pilot (if any) that these experts will likely be needed.
  void hint(const std::vector<int64_t>& ids) const {
    if (pilot_.has_value() && !ids.empty()) (*pilot_)(ids);
  }

  // Tokens routed to each expert and the steps that looked it up, since the last call
  // (then reset): [2, E] int64.
  at::Tensor take_usage() {
    at::Tensor out = at::empty({2, experts_}, at::TensorOptions().dtype(at::kLong));
    std::copy(tokens_.begin(), tokens_.end(), out.data_ptr<int64_t>());
    std::copy(lookups_.begin(), lookups_.end(), out.data_ptr<int64_t>() + experts_);
    std::fill(tokens_.begin(), tokens_.end(), 0);
    std::fill(lookups_.begin(), lookups_.end(), 0);
    return out;
  }

  // The experts of each of T tokens h [T, hidden] (already normed).
  Routing route(const float* h, int64_t T) const {
    const int64_t E = experts_, k = top_k_;
    std::vector<float> logits(T * E);
    const float* w = router_.data_ptr<float>();
    const float* bias = router_bias_.defined() ? router_bias_.data_ptr<float>() : nullptr;
    at::parallel_for(0, T * E, std::max<int64_t>(1, 16384 / hidden_), [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const int64_t t = i / E, e = i % E;
        logits[i] = dot_f32(h + t * hidden_, w + e * hidden_, hidden_) +
                    (bias != nullptr ? bias[e] : 0.0f);
      }
    });
    Routing r;
    r.k = k;
    r.choice.assign(T * k, -1);
    r.weight.assign(T * k, 0.0f);
    r.used.assign(T, 0);
    for (int64_t t = 0; t < T; ++t) {
      const float* l = logits.data() + t * E;
      int32_t* c = r.choice.data() + t * k;
      float* wt = r.weight.data() + t * k;
      std::vector<bool> taken(E, false);
      for (int64_t j = 0; j < k; ++j) {  // the k largest, in descending order
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
          if (!taken[e] && (best < 0 || l[e] > l[best])) best = e;
        }
        taken[best] = true;
        c[j] = static_cast<int32_t>(best);
      }
      float total = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        wt[j] = exp_scalar(l[c[j]] - l[c[0]]);
        total += wt[j];
      }
      int64_t used = k;
      if (top_p_ < 1.0f) {  // lossy: the first experts up to cumulative weight top_p
        float cum = 0.0f;
        used = 0;
        while (used < k && cum < top_p_ * total) cum += wt[used++];
        total = cum;
        for (int64_t j = used; j < k; ++j) {
          c[j] = -1;
          wt[j] = 0.0f;
        }
      }
      for (int64_t j = 0; j < used; ++j) wt[j] /= total;
      r.used[t] = static_cast<int32_t>(used);
    }
    return r;
  }

  // The experts this layer's router picks for h [T, hidden] (x normed by `norm`, this
  // layer's own pre-norm weights), most-picked first: the pilot's guess.
  std::vector<int64_t> predict(const float* x, int64_t T, const float* norm, double eps) const {
    std::vector<float> h(T * hidden_);
    for (int64_t t = 0; t < T; ++t) {
      if (norm != nullptr) {
        rms_norm_row(x + t * hidden_, norm, hidden_, eps, h.data() + t * hidden_);
      } else {
        std::copy(x + t * hidden_, x + (t + 1) * hidden_, h.data() + t * hidden_);
      }
    }
    const Routing r = route(h.data(), T);
    std::vector<int64_t> votes(experts_, 0);
    for (int64_t i = 0; i < T * r.k; ++i) {
      if (r.choice[i] >= 0) ++votes[r.choice[i]];
    }
    std::vector<int64_t> ids;
    for (int64_t e = 0; e < experts_; ++e) {
      if (votes[e] > 0) ids.push_back(e);
    }
    std::stable_sort(ids.begin(), ids.end(),
                     [&](int64_t a, int64_t b) { return votes[a] > votes[b]; });
    return ids;
  }

  // y [T, hidden] = the layer's routed (and shared) experts of h [T, hidden] (normed).
  void forward(const float* h, int64_t T, float* y) {
    const Routing r = route(h, T);
    // (token, rank) pairs sorted by expert then token: pos[t * k + j] is the pair's row
    std::vector<int64_t> count(experts_, 0);
    for (int64_t i = 0; i < T * r.k; ++i) {
      if (r.choice[i] >= 0) ++count[r.choice[i]];
    }
    std::vector<int64_t> start(experts_ + 1, 0), active;
    for (int64_t e = 0; e < experts_; ++e) {
      start[e + 1] = start[e] + count[e];
      if (count[e] > 0) active.push_back(e);
    }
    const int64_t P = start[experts_];
    std::vector<int64_t> pos(T * r.k, -1), token_of(P);
    {
      std::vector<int64_t> next(start.begin(), start.end() - 1);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < r.k; ++j) {
          const int32_t e = r.choice[t * r.k + j];
          if (e < 0) continue;
          pos[t * r.k + j] = next[e];
          token_of[next[e]++] = t;
        }
      }
    }
    Scratch& s = scratch();
    s.out.resize(static_cast<size_t>(P * hidden_));
    for (size_t a = 0; a < active.size();) {
      size_t b = active.size();
      if (provider_.has_value()) {
        const std::vector<int64_t> need(active.begin() + a, active.end());
        const int64_t n = (*provider_)(need);
        TORCH_CHECK(n >= 1 && n <= static_cast<int64_t>(need.size()),
                    "RoutedExperts: the provider made ", n, " of ", need.size(),
                    " experts available");
        b = a + n;
      }
      for (size_t i = a; i < b; ++i) {
        TORCH_CHECK(slots_[active[i]].has_value(), "RoutedExperts: expert ", active[i],
                    " has no weights (", provider_.has_value() ? "the provider left it empty"
                                                               : "and no provider fills it", ")");
      }
      compute(h, std::vector<int64_t>(active.begin() + a, active.begin() + b), start, token_of,
              s.out.data());
      a = b;
    }
    for (int64_t e : active) {  // a step that got this far was served: count it
      tokens_[e] += count[e];
      ++lookups_[e];
    }
    // each token's experts summed in its rank order
    at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* yt = y + t * hidden_;
        std::fill(yt, yt + hidden_, 0.0f);
        for (int64_t j = 0; j < r.used[t]; ++j) {
          const float w = r.weight[t * r.k + j];
          const float* o = s.out.data() + pos[t * r.k + j] * hidden_;
          for (int64_t c = 0; c < hidden_; ++c) yt[c] += w * o[c];
        }
      }
    });
    if (shared_.has_value()) add_shared(h, T, y);
  }

 private:
  // Per calling thread, reused across layers and steps (fresh multi-MB buffers per
  // call cost page faults).
  struct Scratch {
    std::vector<float> x, gu, act, out, shared_gu, shared_act, shared_out;
  };
  static Scratch& scratch() {
    static thread_local Scratch s;
    return s;
  }

  // Experts `ids` (ascending, all in their slots): rows start[e] .. start[e + 1] of out.
  void compute(const float* h, const std::vector<int64_t>& ids, const std::vector<int64_t>& start,
               const std::vector<int64_t>& token_of, float* out) {
    const int64_t p0 = start[ids.front()], p1 = start[ids.back() + 1], rows = p1 - p0;
    const int64_t F = ffn_, H = hidden_;
    Scratch& s = scratch();
    s.x.resize(static_cast<size_t>(rows * H));
    s.gu.resize(static_cast<size_t>(rows * 2 * F));
    s.act.resize(static_cast<size_t>(rows * F));
    at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / H), [&](int64_t a, int64_t b) {
      for (int64_t p = a; p < b; ++p) {
        std::memcpy(s.x.data() + p * H, h + token_of[p0 + p] * H, sizeof(float) * H);
      }
    });
    bool legacy = false, kquant = false;
    for (int64_t e : ids) needs(slots_[e]->gate_up, &legacy, &kquant);
    const Acts xa = quantize_for(s.x.data(), rows, H, legacy, kquant);
    std::vector<MatmulJob> jobs;
    for (int64_t e : ids) {
      const int64_t r0 = start[e] - p0;
      jobs.push_back(MatmulJob{&slots_[e]->gate_up.views(), rows_from(xa, r0, H),
                               start[e + 1] - start[e], s.gu.data() + r0 * 2 * F, 2 * F});
    }
    matmul_jobs(jobs, H);
    const float* gub = gate_up_bias_.defined() ? gate_up_bias_.data_ptr<float>() : nullptr;
    for (int64_t e : ids) {
      const int64_t r0 = start[e] - p0, n = start[e + 1] - start[e];
      at::parallel_for(0, n, 8, [&](int64_t a, int64_t b) {
        for (int64_t p = r0 + a; p < r0 + b; ++p) {
          float* gu = s.gu.data() + p * 2 * F;
          if (gub != nullptr) {
            for (int64_t c = 0; c < 2 * F; ++c) gu[c] += gub[e * 2 * F + c];
          }
          gated_unit_row(act_, gu, F, s.act.data() + p * F);
        }
      });
    }
    legacy = kquant = false;
    for (int64_t e : ids) needs(slots_[e]->down, &legacy, &kquant);
    const Acts aa = quantize_for(s.act.data(), rows, F, legacy, kquant);
    jobs.clear();
    for (int64_t e : ids) {
      const int64_t r0 = start[e] - p0;
      jobs.push_back(MatmulJob{&slots_[e]->down.views(), rows_from(aa, r0, F),
                               start[e + 1] - start[e], out + start[e] * H, H});
    }
    matmul_jobs(jobs, F);
    if (down_bias_.defined()) {
      const float* db = down_bias_.data_ptr<float>();
      for (int64_t e : ids) {
        for (int64_t p = start[e]; p < start[e + 1]; ++p) {
          for (int64_t c = 0; c < H; ++c) out[p * H + c] += db[e * H + c];
        }
      }
    }
  }

  void add_shared(const float* h, int64_t T, float* y) {
    const ExpertWeights& w = *shared_;
    const int64_t F = w.down.in_features(), H = hidden_;
    Scratch& s = scratch();
    s.shared_gu.resize(static_cast<size_t>(T * 2 * F));
    s.shared_act.resize(static_cast<size_t>(T * F));
    s.shared_out.resize(static_cast<size_t>(T * H));
    w.gate_up.matmul_into(h, T, s.shared_gu.data());
    for (int64_t t = 0; t < T; ++t) {
      gated_unit_row(act_, s.shared_gu.data() + t * 2 * F, F,
                     s.shared_act.data() + t * F);
    }
    w.down.matmul_into(s.shared_act.data(), T, s.shared_out.data());
    const float* g = shared_gate_.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      const float scale = 1.0f / (1.0f + exp_scalar(-dot_f32(g, h + t * H, H)));
      for (int64_t c = 0; c < H; ++c) y[t * H + c] += scale * s.shared_out[t * H + c];
    }
  }

  static void needs(const PackedLinear& p, bool* legacy, bool* kquant) {
    *legacy = *legacy || p.needs_legacy_activations();
    *kquant = *kquant || p.needs_kquant_activations();
  }

  void check_id(int64_t e) const {
    TORCH_CHECK(e >= 0 && e < experts_, "RoutedExperts: no expert ", e, " (the layer has ",
                experts_, ")");
  }

  static at::Tensor f32_of(const at::Tensor& t, std::vector<int64_t> shape, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat &&
                    t.sizes() == at::IntArrayRef(shape),
                "RoutedExperts: the ", what, " must be CPU float32 ", at::IntArrayRef(shape),
                ", got ", t.sizes());
    return t.contiguous();
  }

  at::Tensor router_, router_bias_, gate_up_bias_, down_bias_, shared_gate_;
  int64_t experts_ = 0, hidden_ = 0, top_k_ = 0, ffn_ = 0;
  Activation act_;
  float top_p_ = 1.0f;
  std::vector<std::optional<ExpertWeights>> slots_;
  std::optional<ExpertWeights> shared_;
  std::optional<Provider> provider_;
  std::optional<Pilot> pilot_;
  std::vector<int64_t> tokens_, lookups_;
};
