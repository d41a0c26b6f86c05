// A whole llama-style decoder stack in one native call per step.
//
// Part of the quant_matmul.cpp translation unit (included inside its namespace).
//
// Per layer: RMSNorm -> QKV (packed weights, quant_kernels.h) [+ Q/K/V biases] [-> per-head
// RMSNorm of q and k] -> RoPE on q and k (adjacent pairs, or NEOX's half-a-head-apart
// pairs) -> K/V into the paged pool -> attention over the pool in place
// (paged_attention.h) -> output projection -> residual -> RMSNorm -> gate/up ->
// SiLU(gate) * up -> down -> residual, for every token of the step: the llama block
// and Qwen 2/3's. Where a layer's FFN is routed experts (Qwen3-MoE, gpt-oss), the
// gate/up/down part is routed_experts.h's instead; gpt-oss's attention adds an output
// bias and per-head sinks. Qwen 3.5's hybrid stack: its recurrent layers are
// delta_net.h's Gated DeltaNet in place of attention (their states in a slot per row,
// given to forward), and its attention layers gate their output by sigmoid of a second
// half of each q head. The PyTorch models (ember/models/decoder.py, qwen35.py) run the
// same recipes op by op with f32 weights and are the oracle this path is tested against.
//
// Every stage computes each token on its own, with code that does not depend on how
// many tokens there are or where they come from: RMSNorm and the activation
// quantization are per row, the integer matmul tiles rows but gives each the same
// arithmetic, RoPE, the pool write and SiLU are elementwise, and attention is per
// token (see paged_attention.h). So a token's output is bitwise independent of the
// batch, of prefill chunking and of whether its prefix came from the cache.

enum Stage {
  kNorms, kProjections, kRopeStore, kAttention, kActivation, kExperts, kRecurrent, kStages
};

// Adds the time since the previous lap to a stage's total (does nothing without totals).
class Clock {
 public:
  explicit Clock(std::array<int64_t, kStages>* totals)
      : totals_(totals), last_(std::chrono::steady_clock::now()) {}
  void lap(Stage s) {
    if (totals_ == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    (*totals_)[s] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count();
    last_ = now;
  }

 private:
  std::array<int64_t, kStages>* totals_;
  std::chrono::steady_clock::time_point last_;
};

struct LayerWeights {
  at::Tensor attn_norm, ffn_norm;
  std::optional<PackedLinear> qkv, o;  // none: a recurrent layer (delta)
  std::shared_ptr<DeltaNet> delta;  // a Gated DeltaNet in place of attention (Qwen 3.5)
  int64_t kv_layer = -1;  // an attention layer's index in the KV pool
  int64_t state_layer = -1;  // a recurrent layer's index in the recurrent states
  std::optional<PackedLinear> gate_up, down;  // the dense FFN (none: routed experts)
  std::shared_ptr<RoutedExperts> experts;  // the routed FFN (null: dense)
  at::Tensor qkv_bias, q_norm, k_norm;  // undefined where the family has none
  at::Tensor o_bias, sinks;  // gpt-oss's attention output bias [hidden], sinks [heads]
  at::Tensor post_attn_norm, post_ffn_norm;  // Gemma's norms of each sublayer's output
  int64_t window = 0;  // sliding-window span; 0: attends to everything
  int64_t rope = 0;  // which of forward's RoPE tables (Gemma: local or global base)
};

class DecoderStack {
 public:
  DecoderStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
               int64_t rope_dim, int64_t ffn, double eps, bool neox = false,
               const std::string& activation = "silu", double attn_scale = 0.0)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        rope_dim_(rope_dim), ffn_(ffn), eps_(eps), neox_(neox),
        act_(activation_named(activation)),
        scale_(attn_scale > 0 ? static_cast<float>(attn_scale)
                              : 1.0f / std::sqrt(static_cast<float>(head_dim))) {
    TORCH_CHECK(hidden > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && ffn > 0 &&
                    heads % kv_heads == 0 && rope_dim >= 0 && rope_dim % 2 == 0 &&
                    rope_dim <= head_dim,
                "DecoderStack: bad head geometry");
#if defined(EMBER_AVX2)
    TORCH_CHECK(head_dim % 8 == 0, "DecoderStack: head_dim must be a multiple of 8");
#endif
  }

  // What some families change in every block (set before forward): pre_norms false:
  // sublayers read the residual stream itself, add_layer takes empty norm weights
  // (OLMo 2); qk_norm_full: q and k are normed across all their heads at once (OLMo 2);
  // residual_scale: sublayer outputs are multiplied by it before the add (Granite);
  // attn_softcap > 0: scores soft-capped before the softmax (Gemma 2).
  void set_block_options(bool pre_norms, bool qk_norm_full, double residual_scale,
                         double attn_softcap) {
    TORCH_CHECK(attn_softcap >= 0, "DecoderStack: negative attention softcap");
    pre_norms_ = pre_norms;
    qk_norm_full_ = qk_norm_full;
    residual_scale_ = static_cast<float>(residual_scale);
    softcap_ = static_cast<float>(attn_softcap);
  }

  // Every attention layer's q projection yields, per head, the query and then a gate of
  // head_dim: the attention output is multiplied by sigmoid(gate) (Qwen 3.5; set
  // before adding layers).
  void set_attn_output_gate(bool on) {
    TORCH_CHECK(layers_.empty(), "DecoderStack: set the output gate before adding layers");
    gated_ = on;
  }

  // Llama 4's attention temperature (Mistral 3): every query is multiplied by
  // 1 + scale ln(1 + floor(position / floor)) after RoPE; scale 0: none.
  void set_attn_temperature(double scale, int64_t floor) {
    TORCH_CHECK(scale == 0 || floor > 0, "DecoderStack: attention temperature needs a floor");
    temp_scale_ = scale;
    temp_floor_ = floor;
  }

  // A layer; gate_up and down absent: its FFN is routed experts (set_experts next).
  void add_layer(const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
                 const PackedLinear& qkv, const PackedLinear& o,
                 const std::optional<PackedLinear>& gate_up,
                 const std::optional<PackedLinear>& down) {
    const int64_t q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
    TORCH_CHECK(pre_norms_ ? attn_norm.numel() == hidden_ && ffn_norm.numel() == hidden_
                           : attn_norm.numel() == 0 && ffn_norm.numel() == 0,
                "DecoderStack: pre-norm weights must have hidden elements (none without "
                "pre-norms)");
    LayerWeights L{norm_weight(attn_norm), norm_weight(ffn_norm),
                   linear(qkv, hidden_, (gated_ ? 2 : 1) * q_dim + 2 * kv_dim),
                   linear(o, q_dim, hidden_)};
    L.kv_layer = attention_layers_++;
    add_ffn(L, gate_up, down);
  }

  // A recurrent layer: a Gated DeltaNet in place of attention (pre-norms only), then
  // the FFN as add_layer's (gate_up and down absent: routed experts, set_experts next).
  void add_delta_net_layer(const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
                           const std::shared_ptr<DeltaNet>& delta,
                           const std::optional<PackedLinear>& gate_up,
                           const std::optional<PackedLinear>& down) {
    TORCH_CHECK(delta && delta->hidden() == hidden_ && delta->out_features() == hidden_,
                "DecoderStack: a DeltaNet of the stack's hidden size");
    TORCH_CHECK(pre_norms_ && attn_norm.numel() == hidden_ && ffn_norm.numel() == hidden_,
                "DecoderStack: a recurrent layer needs pre-norm weights of hidden elements");
    TORCH_CHECK(layers_.empty() || recurrent_layers_ == 0 ||
                    delta->channels() == recurrent_.channels &&
                        delta->taps() == recurrent_.taps && delta->n_v() == recurrent_.n_v &&
                        delta->k_dim() == recurrent_.k_dim && delta->v_dim() == recurrent_.v_dim,
                "DecoderStack: every recurrent layer has the same shape");
    recurrent_ = {delta->channels(), delta->taps(), delta->n_v(), delta->k_dim(),
                  delta->v_dim(), delta->width()};
    LayerWeights L{norm_weight(attn_norm), norm_weight(ffn_norm)};
    L.delta = delta;
    L.state_layer = recurrent_layers_++;
    add_ffn(L, gate_up, down);
  }

  // The last added layer's routed experts (it was added without a dense FFN).
  void set_experts(const std::shared_ptr<RoutedExperts>& experts) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: add a layer first");
    TORCH_CHECK(experts && !layers_.back().gate_up.has_value() &&
                    experts->hidden() == hidden_,
                "DecoderStack: routed experts go to a layer without a dense FFN, with the "
                "stack's hidden size");
    layers_.back().experts = experts;
  }

  // The last added layer's attention output bias [hidden] and sinks [heads] (gpt-oss;
  // empty tensors: none).
  void set_attention_extras(const at::Tensor& o_bias, const at::Tensor& sinks) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: add a layer first");
    const at::Tensor b = norm_weight(o_bias), k = norm_weight(sinks);
    TORCH_CHECK((!b.defined() || b.numel() == hidden_) && (!k.defined() || k.numel() == heads_),
                "DecoderStack: the output bias needs hidden elements, the sinks one per head");
    layers_.back().o_bias = b;
    layers_.back().sinks = k;
  }

  // The last added layer's Q/K/V biases [q_dim + 2 kv_dim] (Qwen 2).
  void set_qkv_bias(const at::Tensor& bias) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: add a layer first");
    const at::Tensor b = norm_weight(bias);
    TORCH_CHECK(b.numel() == (heads_ + 2 * kv_heads_) * head_dim_,
                "DecoderStack: qkv bias has ", b.numel(), " elements");
    layers_.back().qkv_bias = b;
  }

  // The last added layer's norms of the attention and MLP outputs [hidden] (Gemma).
  void set_post_norms(const at::Tensor& post_attn, const at::Tensor& post_ffn) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: add a layer first");
    const at::Tensor a = norm_weight(post_attn), f = norm_weight(post_ffn);
    TORCH_CHECK(a.numel() == hidden_ && f.numel() == hidden_,
                "DecoderStack: post-norm weights must have hidden elements");
    layers_.back().post_attn_norm = a;
    layers_.back().post_ffn_norm = f;
  }

  // The last added layer's attention kind: its sliding window (0: none) and which
  // RoPE table of forward's list it rotates by.
  void set_attention(int64_t window, int64_t rope) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: add a layer first");
    TORCH_CHECK(window >= 0 && rope >= 0, "DecoderStack: bad window or RoPE index");
    layers_.back().window = window;
    layers_.back().rope = rope;
  }

  // The last added layer's RMSNorm weights of q and k: per head [head_dim] (Qwen 3),
  // or across all heads [heads * head_dim], [kv_heads * head_dim] (qk_norm_full).
  void set_qk_norm(const at::Tensor& q_norm, const at::Tensor& k_norm) {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: add a layer first");
    const at::Tensor q = norm_weight(q_norm), k = norm_weight(k_norm);
    const int64_t qn = qk_norm_full_ ? heads_ * head_dim_ : head_dim_;
    const int64_t kn = qk_norm_full_ ? kv_heads_ * head_dim_ : head_dim_;
    TORCH_CHECK(q.numel() == qn && k.numel() == kn,
                "DecoderStack: q/k norm weights must have ", qn, " and ", kn, " elements");
    layers_.back().q_norm = q;
    layers_.back().k_norm = k;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // An empty adapter for this stack's shapes (its deltas added with LoRAWeights::set).
  LoRAWeights new_lora() const {
    return LoRAWeights(num_layers(), lora_inputs(), lora_outputs());
  }

  // Run every layer over x [T, hidden] in place. pool: the KV pool (blocks, layers,
  // 2, bs, Hkv, D); ropes: RoPE tables [T, rope_dim/2, 2] (cos, sin) of each token's
  // position, one per base the layers use (set_attention picks);
  // slots [T]: where each token's K/V go; tables [R, NB]: each row's block ids;
  // rows [T]: each token's row; positions [T]: each token's position in its row;
  // loras: the step's adapters (made by new_lora) and token_lora [T] the one each
  // token uses (-1: none; an empty tensor without adapters).
  void forward(at::Tensor& x, at::Tensor& pool, const std::vector<at::Tensor>& ropes,
               const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& rows,
               const at::Tensor& positions, const std::vector<LoRAWeights*>& loras,
               const std::optional<at::Tensor>& token_lora,
               const std::optional<at::Tensor>& conv_state = std::nullopt,
               const std::optional<at::Tensor>& ssm_state = std::nullopt,
               const std::optional<at::Tensor>& token_state = std::nullopt,
               const std::optional<at::Tensor>& snap_conv = std::nullopt,
               const std::optional<at::Tensor>& snap_ssm = std::nullopt,
               const std::optional<at::Tensor>& token_snap = std::nullopt) const {
    const int64_t T = x.size(0);
    TORCH_CHECK(loras.empty() || (!gated_ && recurrent_layers_ == 0),
                "DecoderStack: adapters are not applied to a hybrid stack");
    for (const LoRAWeights* w : loras) {
      TORCH_CHECK(w != nullptr && w->fits(num_layers(), lora_inputs(), lora_outputs()),
                  "DecoderStack: an adapter made for another stack");
    }
    const LoRAStep lora(loras, token_lora.value_or(at::Tensor()), T);
    for (const LayerWeights& L : layers_) {
      check_ffn(L);
      TORCH_CHECK(L.rope < static_cast<int64_t>(ropes.size()),
                  "DecoderStack: a layer uses RoPE table ", L.rope, " of ", ropes.size());
    }
    for (const at::Tensor& rope : ropes) check_step(x, pool, rope, slots, tables, rows, positions);
    RecurrentStep states = check_states(T, conv_state, ssm_state, token_state);
    check_snapshots(T, states, snap_conv, snap_ssm, token_snap);
    if (T == 0) return;
    const int64_t q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
    const int64_t qkv_n = q_dim + 2 * kv_dim;
    const auto f32 = x.options();
    at::Tensor h = at::empty({T, std::max(hidden_, ffn_)}, f32);
    at::Tensor qkv = at::empty({T, qkv_n}, f32);
    at::Tensor att = at::empty({T, q_dim}, f32);
    at::Tensor gu = at::empty({T, 2 * ffn_}, f32);
    at::Tensor y = at::empty({T, hidden_}, f32);
    // the gated attention's raw q|gate heads, k, v; the recurrent layers' projections,
    // convolution outputs and gated head outputs
    at::Tensor gated = at::empty({gated_ ? T : 0, qkv_n + q_dim}, f32);
    at::Tensor rec = at::empty(
        {recurrent_layers_ ? T : 0, recurrent_.width + recurrent_.channels +
                                        recurrent_.n_v * recurrent_.v_dim}, f32);
    float* xp = x.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* attp = att.data_ptr<float>();
    float* gup = gu.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    Clock clock(profiling_ ? &stage_ns_ : nullptr);
    for (int64_t i = 0; i < num_layers(); ++i) {
      const LayerWeights& L = layers_[i];
      const float* attn_in = xp;
      if (pre_norms_) {
        rms_norm_rows(xp, L.attn_norm.data_ptr<float>(), T, hidden_, eps_, hp);
        attn_in = hp;
      }
      clock.lap(kNorms);
      if (L.delta) {
        float* r = rec.data_ptr<float>();
        const int64_t P = recurrent_.width, C = recurrent_.channels;
        const int64_t s = L.state_layer;
        L.delta->forward(attn_in, T, states.slots, states.conv_layer(s), states.ssm_layer(s),
                         r, r + T * P, r + T * (P + C), yp, states.snaps,
                         states.snaps ? states.snap_conv + s * states.snap_conv_stride : nullptr,
                         states.snaps ? states.snap_ssm + s * states.snap_ssm_stride : nullptr);
        clock.lap(kRecurrent);
      } else {
        attention(L, i, attn_in, T, ropes, slots, tables, rows, positions, pool, lora, qkvp,
                  gated_ ? gated.data_ptr<float>() : nullptr, attp, yp, clock);
      }
      if (L.post_attn_norm.defined()) {
        rms_norm_rows(yp, L.post_attn_norm.data_ptr<float>(), T, hidden_, eps_, yp);
      }
      add_scaled_rows(xp, yp, T * hidden_);
      const float* ffn_in = xp;
      if (pre_norms_) {
        rms_norm_rows(xp, L.ffn_norm.data_ptr<float>(), T, hidden_, eps_, hp);
        ffn_in = hp;
      }
      clock.lap(kNorms);
      if (L.experts) {
        hint_next(i, xp, T);
        L.experts->forward(ffn_in, T, yp);
        clock.lap(kExperts);
      } else {
        dense_ffn(L, i, ffn_in, T, gup, hp, yp, lora, clock);
      }
      if (L.post_ffn_norm.defined()) {
        rms_norm_rows(yp, L.post_ffn_norm.data_ptr<float>(), T, hidden_, eps_, yp);
      }
      add_scaled_rows(xp, yp, T * hidden_);
      if (L.experts) hint_next(i, xp, T);
      clock.lap(kNorms);
    }
    if (profiling_) ++stage_calls_;
  }

  // Where layer i + 1 has a pilot (--moe-stream): guess its experts from x [T, hidden],
  // (forward asks after routed layers only: every family here routes all its layers)
  // a state of the stream before it (its router and pre-norm on x) and tell the pilot.
  // forward guesses twice per routed layer i: from the stream after i's attention (the
  // state i's own router reads: the reads then overlap i's experts and i + 1's
  // attention) and after i's experts (the state i + 1's attention reads: closer, with
  // only that attention to overlap). Measured on ember's trained MoE (6 layers, 2 of 16
  // experts), the guesses alone recall 74% and 88% of what the next layer needs.
  void hint_next(int64_t i, const float* x, int64_t T) const {
    if (i + 1 >= num_layers()) return;
    const LayerWeights& next = layers_[i + 1];
    if (!next.experts || !next.experts->piloted()) return;
    next.experts->hint(next.experts->predict(
        x, T, pre_norms_ ? next.ffn_norm.data_ptr<float>() : nullptr, eps_));
  }

  // Per-stage wall time summed over forward calls while profiling is on (a timer
  // read between stages; off by default): where a step goes, measured inside it.
  void set_profiling(bool on) {
    profiling_ = on;
    stage_ns_.fill(0);
    stage_calls_ = 0;
  }

  std::map<std::string, double> stage_seconds() const {
    static const char* names[] = {"norms_and_residuals", "projections", "rope_and_kv_write",
                                  "attention", "activation", "routed_experts",
                                  "recurrent"};
    std::map<std::string, double> out;
    for (int s = 0; s < kStages; ++s) out[names[s]] = stage_ns_[s] * 1e-9;
    out["calls"] = static_cast<double>(stage_calls_);
    return out;
  }

 private:
  static at::Tensor norm_weight(const at::Tensor& w) {
    if (w.numel() == 0) return at::Tensor();  // none: a family without pre-norms
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1,
                "norm weights must be CPU float32 [K]");
    return w.contiguous();
  }

  // The fused projections' inputs and outputs, in FusedProjection order.
  std::array<int64_t, kFusedProjections> lora_inputs() const {
    return {hidden_, heads_ * head_dim_, hidden_, ffn_};
  }
  std::array<int64_t, kFusedProjections> lora_outputs() const {
    return {(heads_ + 2 * kv_heads_) * head_dim_, hidden_, 2 * ffn_, hidden_};
  }

  static const PackedLinear& linear(const PackedLinear& p, int64_t k, int64_t n) {
    TORCH_CHECK(p.in_features() == k && p.out_features() == n, "DecoderStack: a linear is [",
                p.out_features(), ", ", p.in_features(), "], expected [", n, ", ", k, "]");
    return p;
  }

  void check_step(const at::Tensor& x, const at::Tensor& pool, const at::Tensor& rope,
                  const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& rows,
                  const at::Tensor& positions) const {
    const int64_t T = x.size(0);
    for (const at::Tensor* t : {&x, &pool, &rope, &slots, &tables, &rows, &positions}) {
      TORCH_CHECK(t->device().is_cpu(), "DecoderStack: CPU tensors only");
    }
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.is_contiguous() &&
                    x.scalar_type() == at::kFloat,
                "DecoderStack: x must be contiguous float32 [T, ", hidden_, "]");
    TORCH_CHECK(pool.dim() == 6 && pool.size(1) == attention_layers_ && pool.size(2) == 2 &&
                    pool.size(4) == kv_heads_ && pool_head_dim(pool) == head_dim_ &&
                    pool.size(5) == kv_row_width(kv_type_of(pool), head_dim_),
                "DecoderStack: KV pool shape does not match the model");
    TORCH_CHECK(rope.is_contiguous() && rope.scalar_type() == at::kFloat &&
                    rope.numel() == T * rope_dim_,
                "DecoderStack: rope must be contiguous float32 [T, rope_dim/2, 2]");
    for (const at::Tensor* t : {&slots, &rows, &positions}) {
      TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong && t->numel() == T,
                  "DecoderStack: slots, rows and positions must be contiguous int64 [T]");
    }
    TORCH_CHECK(tables.dim() == 2 && tables.is_contiguous() && tables.scalar_type() == at::kLong,
                "DecoderStack: tables must be contiguous int64 [rows, blocks]");
    const int64_t R = tables.size(0), NB = tables.size(1), bs = pool.size(3);
    const int64_t capacity = pool.size(0) * bs;
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t* rp = rows.data_ptr<int64_t>();
    const int64_t* pp = positions.data_ptr<int64_t>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "DecoderStack: slot out of range");
      TORCH_CHECK(rp[t] >= 0 && rp[t] < R, "DecoderStack: row out of range");
      TORCH_CHECK(pp[t] >= 0 && pp[t] < NB * bs, "DecoderStack: position past the row's blocks");
      for (int64_t b = 0; b <= pp[t] / bs; ++b) {
        const int64_t blk = tp[rp[t] * NB + b];
        TORCH_CHECK(blk >= 0 && blk < pool.size(0), "DecoderStack: block id out of range");
      }
      // attention reads a token's own K/V where its row's table says: it must be
      // written exactly there
      TORCH_CHECK(sp[t] == tp[rp[t] * NB + pp[t] / bs] * bs + pp[t] % bs,
                  "DecoderStack: slot does not match the row's table at the position");
    }
  }

  // Per token: add the Q/K/V biases, norm each q and k head, rotate them by the
  // token's position (adjacent pairs, or NEOX pairs i, i + rope_dim/2), scale q by the
  // attention temperature where there is one, then store its k and v at its slot in
  // the pool (rounded or quantized to the pool's type).
  void rope_and_store(const LayerWeights& L, float* qkv, int64_t T, const float* rope,
                      const int64_t* slots, const int64_t* positions,
                      const PoolLayer& kv) const {
    const int64_t q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
    const int64_t half = rope_dim_ / 2, width = q_dim + 2 * kv_dim;
    void* kbase = const_cast<void*>(kv.k);
    void* vbase = const_cast<void*>(kv.v);
    const float* bias = L.qkv_bias.defined() ? L.qkv_bias.data_ptr<float>() : nullptr;
    const float* qn = L.q_norm.defined() ? L.q_norm.data_ptr<float>() : nullptr;
    const float* kn = L.k_norm.defined() ? L.k_norm.data_ptr<float>() : nullptr;
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        float* row = qkv + t * width;
        const float* cs = rope + t * rope_dim_;
        if (bias != nullptr) add_rows(row, bias, width);
        if (qk_norm_full_ && qn != nullptr && kn != nullptr) {
          rms_norm_row(row, qn, q_dim, eps_, row);
          rms_norm_row(row + q_dim, kn, kv_dim, eps_, row + q_dim);
        }
        for (int64_t hd = 0; hd < heads_ + kv_heads_; ++hd) {
          float* x = row + hd * head_dim_;
          const float* norm = hd < heads_ ? qn : kn;
          if (norm != nullptr && !qk_norm_full_) rms_norm_row(x, norm, head_dim_, eps_, x);
          const int64_t step = neox_ ? 1 : 2, other = neox_ ? half : 1;
          for (int64_t i = 0; i < half; ++i) {
            float* a = x + i * step;
            const float x0 = a[0], x1 = a[other], c = cs[2 * i], s = cs[2 * i + 1];
            a[0] = x0 * c - x1 * s;
            a[other] = x0 * s + x1 * c;
          }
        }
        if (temp_scale_ != 0) {
          const float f = static_cast<float>(
              1.0 + temp_scale_ * std::log1p(std::floor(static_cast<double>(positions[t]) /
                                                        static_cast<double>(temp_floor_))));
          for (int64_t i = 0; i < q_dim && f != 1.0f; ++i) row[i] *= f;
        }
        const int64_t slot = slots[t];
        const int64_t at = (slot / kv.bs) * kv.block_stride + (slot % kv.bs) * kv.hkv * kv.row;
        narrow_to(row + q_dim, kv_dim, kv.type, kbase, at);
        narrow_to(row + q_dim + kv_dim, kv_dim, kv.type, vbase, at);
      }
    });
  }

  // yp [T, hidden] = layer i's attention of attn_in: QKV, RoPE and the pool write,
  // attention, [the output gate,] the output projection. gated: scratch [T, q|gate + k
  // + v] where the stack has the output gate (null: none).
  void attention(const LayerWeights& L, int64_t i, const float* attn_in, int64_t T,
                 const std::vector<at::Tensor>& ropes, const at::Tensor& slots,
                 const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& positions,
                 at::Tensor& pool, const LoRAStep& lora, float* qkvp, float* gated,
                 float* attp, float* yp, Clock& clock) const {
    const int64_t q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
    const int64_t qkv_n = q_dim + 2 * kv_dim;
    const PoolLayer kv = pool_layer(pool, L.kv_layer);
    if (gated != nullptr) {
      L.qkv->matmul_into(attn_in, T, gated);
      split_gate(gated, T, qkvp);
    } else {
      L.qkv->matmul_into(attn_in, T, qkvp);
    }
    if (!lora.empty()) lora.apply(i, kQKV, attn_in, hidden_, qkvp, qkv_n);
    clock.lap(kProjections);
    rope_and_store(L, qkvp, T, ropes[L.rope].data_ptr<float>(), slots.data_ptr<int64_t>(),
                   positions.data_ptr<int64_t>(), kv);
    clock.lap(kRopeStore);
    attend(qkvp, qkv_n, attp, T, heads_, kv, tables.data_ptr<int64_t>(), tables.size(1),
           rows.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), scale_, L.window,
           softcap_, L.sinks.defined() ? L.sinks.data_ptr<float>() : nullptr);
    if (gated != nullptr) gate_output(gated, T, attp);
    clock.lap(kAttention);
    L.o->matmul_into(attp, T, yp);
    if (!lora.empty()) lora.apply(i, kOutput, attp, q_dim, yp, hidden_);
    if (L.o_bias.defined()) {
      const float* b = L.o_bias.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) add_rows(yp + t * hidden_, b, hidden_);
    }
    clock.lap(kProjections);
  }

  // The gated q projection's rows [q_0 gate_0 q_1 gate_1 ... | k | v] -> qkv [q | k | v];
  // the gates stay where they are, read by gate_output.
  void split_gate(const float* gated, int64_t T, float* qkv) const {
    const int64_t q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
    const int64_t in = 2 * q_dim + 2 * kv_dim, out = q_dim + 2 * kv_dim;
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* g = gated + t * in;
        float* row = qkv + t * out;
        for (int64_t hd = 0; hd < heads_; ++hd) {
          std::memcpy(row + hd * head_dim_, g + 2 * hd * head_dim_, head_dim_ * sizeof(float));
        }
        std::memcpy(row + q_dim, g + 2 * q_dim, 2 * kv_dim * sizeof(float));
      }
    });
  }

  // att [T, q_dim] *= sigmoid(each head's gate), the gates in the raw gated rows
  void gate_output(const float* gated, int64_t T, float* att) const {
    const int64_t q_dim = heads_ * head_dim_, in = 2 * q_dim + 2 * kv_heads_ * head_dim_;
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t hd = 0; hd < heads_; ++hd) {
          const float* g = gated + t * in + (2 * hd + 1) * head_dim_;
          float* a = att + t * q_dim + hd * head_dim_;
          for (int64_t d = 0; d < head_dim_; ++d) a[d] *= 1.0f / (1.0f + exp_scalar(-g[d]));
        }
      }
    });
  }

  // The recurrent layers' states of a step: conv [Lr, S, taps - 1, channels], ssm
  // [Lr, S, n_v, k_dim, v_dim] (f32, updated in place) and each token's slot.
  struct RecurrentStep {
    float* conv = nullptr;
    float* ssm = nullptr;
    const int64_t* slots = nullptr;
    int64_t conv_stride = 0, ssm_stride = 0;  // floats per layer
    // snapshots of states after tokens (token_snap [T], -1: none): [Lr, N, ...] alike
    const int64_t* snaps = nullptr;
    float* snap_conv = nullptr;
    float* snap_ssm = nullptr;
    int64_t snap_conv_stride = 0, snap_ssm_stride = 0;
    float* conv_layer(int64_t r) const { return conv + r * conv_stride; }
    float* ssm_layer(int64_t r) const { return ssm + r * ssm_stride; }
  };

  void check_snapshots(int64_t T, RecurrentStep& step, const std::optional<at::Tensor>& conv,
                       const std::optional<at::Tensor>& ssm,
                       const std::optional<at::Tensor>& token_snap) const {
    if (!token_snap.has_value()) return;
    TORCH_CHECK(recurrent_layers_ > 0 && conv.has_value() && ssm.has_value(),
                "DecoderStack: token_snap needs recurrent layers, snap_conv and snap_ssm");
    const Recurrent& R = recurrent_;
    const int64_t N = conv->dim() == 4 ? conv->size(1) : -1;
    TORCH_CHECK(conv->device().is_cpu() && conv->scalar_type() == at::kFloat &&
                    conv->is_contiguous() && N >= 0 && conv->size(0) == recurrent_layers_ &&
                    conv->size(2) == R.taps - 1 && conv->size(3) == R.channels &&
                    ssm->device().is_cpu() && ssm->scalar_type() == at::kFloat &&
                    ssm->is_contiguous() && ssm->dim() == 5 &&
                    ssm->size(0) == recurrent_layers_ && ssm->size(1) == N &&
                    ssm->size(2) == R.n_v && ssm->size(3) == R.k_dim && ssm->size(4) == R.v_dim,
                "DecoderStack: snap_conv and snap_ssm must be laid out as the states, with "
                "one slot per snapshot");
    TORCH_CHECK(token_snap->device().is_cpu() && token_snap->is_contiguous() &&
                    token_snap->scalar_type() == at::kLong && token_snap->numel() == T,
                "DecoderStack: token_snap must be contiguous int64 [T]");
    const int64_t* ts = token_snap->data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ts[t] >= -1 && ts[t] < N, "DecoderStack: snapshot slot out of range");
    }
    step.snaps = ts;
    step.snap_conv = conv->data_ptr<float>();
    step.snap_ssm = ssm->data_ptr<float>();
    step.snap_conv_stride = N * (R.taps - 1) * R.channels;
    step.snap_ssm_stride = N * R.n_v * R.k_dim * R.v_dim;
  }

  RecurrentStep check_states(int64_t T, const std::optional<at::Tensor>& conv,
                             const std::optional<at::Tensor>& ssm,
                             const std::optional<at::Tensor>& token_state) const {
    RecurrentStep step;
    if (recurrent_layers_ == 0) return step;
    TORCH_CHECK(conv.has_value() && ssm.has_value() && token_state.has_value(),
                "DecoderStack: a stack with recurrent layers needs conv_state, ssm_state "
                "and token_state");
    const Recurrent& R = recurrent_;
    TORCH_CHECK(conv->device().is_cpu() && conv->scalar_type() == at::kFloat &&
                    conv->is_contiguous() && conv->dim() == 4 &&
                    conv->size(0) == recurrent_layers_ && conv->size(2) == R.taps - 1 &&
                    conv->size(3) == R.channels,
                "DecoderStack: conv_state must be contiguous float32 [", recurrent_layers_,
                ", slots, ", R.taps - 1, ", ", R.channels, "]");
    const int64_t S = conv->size(1);
    TORCH_CHECK(ssm->device().is_cpu() && ssm->scalar_type() == at::kFloat &&
                    ssm->is_contiguous() && ssm->dim() == 5 &&
                    ssm->size(0) == recurrent_layers_ && ssm->size(1) == S &&
                    ssm->size(2) == R.n_v && ssm->size(3) == R.k_dim && ssm->size(4) == R.v_dim,
                "DecoderStack: ssm_state must be contiguous float32 [", recurrent_layers_,
                ", ", S, ", ", R.n_v, ", ", R.k_dim, ", ", R.v_dim, "]");
    TORCH_CHECK(token_state->device().is_cpu() && token_state->is_contiguous() &&
                    token_state->scalar_type() == at::kLong && token_state->numel() == T,
                "DecoderStack: token_state must be contiguous int64 [T]");
    const int64_t* ts = token_state->data_ptr<int64_t>();
    std::vector<bool> seen(S, false);
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ts[t] >= 0 && ts[t] < S, "DecoderStack: token state slot out of range");
      if (t > 0 && ts[t] == ts[t - 1]) continue;
      // a row's tokens are consecutive (its scan runs them in order): one run per slot
      TORCH_CHECK(!seen[ts[t]], "DecoderStack: a state slot's tokens are not consecutive");
      seen[ts[t]] = true;
    }
    step.conv = conv->data_ptr<float>();
    step.ssm = ssm->data_ptr<float>();
    step.slots = ts;
    step.conv_stride = S * (R.taps - 1) * R.channels;
    step.ssm_stride = S * R.n_v * R.k_dim * R.v_dim;
    return step;
  }

  // y [T, hidden] = the dense FFN of ffn_in (gu, act: scratch [T, 2 ffn], [T, ffn]).
  void dense_ffn(const LayerWeights& L, int64_t i, const float* ffn_in, int64_t T, float* gu,
                 float* act, float* y, const LoRAStep& lora, Clock& clock) const {
    L.gate_up->matmul_into(ffn_in, T, gu);
    if (!lora.empty()) lora.apply(i, kGateUp, ffn_in, hidden_, gu, 2 * ffn_);
    clock.lap(kProjections);
    at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        gated_unit_row(act_, gu + t * 2 * ffn_, ffn_, act + t * ffn_);
      }
    });
    clock.lap(kActivation);
    L.down->matmul_into(act, T, y);
    if (!lora.empty()) lora.apply(i, kDown, act, ffn_, y, hidden_);
    clock.lap(kProjections);
  }

  // L's FFN (gate_up and down absent: routed experts, given by set_experts next), and
  // L onto the stack
  void add_ffn(LayerWeights& L, const std::optional<PackedLinear>& gate_up,
               const std::optional<PackedLinear>& down) {
    TORCH_CHECK(gate_up.has_value() == down.has_value(),
                "DecoderStack: a dense FFN needs both gate_up and down");
    if (!layers_.empty()) check_ffn(layers_.back());
    if (gate_up.has_value()) {
      L.gate_up = linear(*gate_up, hidden_, 2 * ffn_);
      L.down = linear(*down, ffn_, hidden_);
    }
    layers_.push_back(std::move(L));
  }

  // a layer added without a dense FFN must have been given experts before the next
  static void check_ffn(const LayerWeights& L) {
    TORCH_CHECK(L.gate_up.has_value() || L.experts, "DecoderStack: a layer has neither a "
                "dense FFN nor routed experts");
  }

  static void add_rows(float* x, const float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] += y[i];
  }

  // x += residual_scale * y: the residual add (the multiply only where a family has
  // one, so every other family adds exactly as before)
  void add_scaled_rows(float* x, const float* y, int64_t n) const {
    if (residual_scale_ == 1.0f) return add_rows(x, y, n);
    for (int64_t i = 0; i < n; ++i) x[i] += residual_scale_ * y[i];
  }

  struct Recurrent {  // every recurrent layer's shape (they share one)
    int64_t channels = 0, taps = 0, n_v = 0, k_dim = 0, v_dim = 0, width = 0;
  };

  int64_t hidden_, heads_, kv_heads_, head_dim_, rope_dim_, ffn_;
  bool gated_ = false;
  int64_t attention_layers_ = 0, recurrent_layers_ = 0;
  Recurrent recurrent_;
  double eps_;
  bool neox_;
  Activation act_;
  float scale_;
  bool pre_norms_ = true, qk_norm_full_ = false;
  float residual_scale_ = 1.0f, softcap_ = 0.0f;
  double temp_scale_ = 0.0;
  int64_t temp_floor_ = 0;
  std::vector<LayerWeights> layers_;
  bool profiling_ = false;
  mutable std::array<int64_t, kStages> stage_ns_{};
  mutable int64_t stage_calls_ = 0;
};
