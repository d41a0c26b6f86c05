// Per-row float operations the decoder stack and the routed experts share: RMSNorm, the
// gated units of the families' FFNs, an f32 dot product. Each computes a row with code
// that does not depend on how many rows there are.
//
// Part of the quant_matmul.cpp translation unit (included inside its namespace, after
// paged_attention.h, whose exp8 / exp_scalar they use).

inline void rms_norm_row(const float* x, const float* w, int64_t K, double eps, float* y) {
  double ss = 0.0;
  for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(x[k]) * x[k];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / K + eps));
  for (int64_t k = 0; k < K; ++k) y[k] = x[k] * scale * w[k];
}

void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t K, double eps,
                   float* y) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * K, w, K, eps, y + r * K);
  });
}

// out[F] = silu(gate) * up = gate / (1 + e^-gate) * up
inline void silu_mul_row(const float* gate, const float* up, int64_t F, float* out) {
  int64_t i = 0;
#if defined(EMBER_AVX2)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= F; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i,
                     _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < F; ++i) out[i] = gate[i] / (1.0f + exp_scalar(-gate[i])) * up[i];
}

// out[F] = gelu_tanh(gate) * up, GELU's tanh approximation (torch's formula), with
// tanh(u) = 1 - 2 / (1 + e^2u) over 8 lanes
inline void gelu_mul_row(const float* gate, const float* up, int64_t F, float* out) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  int64_t i = 0;
#if defined(EMBER_AVX2)
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  const __m256 two = _mm256_set1_ps(2.0f), kv = _mm256_set1_ps(k);
  const __m256 cubic = _mm256_set1_ps(0.044715f);
  for (; i + 8 <= F; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 g3 = _mm256_mul_ps(cubic, _mm256_mul_ps(g, _mm256_mul_ps(g, g)));
    const __m256 u = _mm256_mul_ps(kv, _mm256_add_ps(g, g3));
    const __m256 e = exp8(_mm256_add_ps(u, u));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, e)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(half, g),
                                                          _mm256_add_ps(one, t)),
                                            _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < F; ++i) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + std::tanh(k * (g + 0.044715f * g * g * g))) * up[i];
  }
}

enum class Activation { kSilu, kGeluTanh, kSwigluOai };

Activation activation_named(const std::string& name) {
  if (name == "silu") return Activation::kSilu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  if (name == "swiglu_oai") return Activation::kSwigluOai;
  TORCH_CHECK(false, "unknown activation '", name, "' (silu, gelu_tanh or swiglu_oai)");
  return Activation::kSilu;
}

// out[F] = (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7): OpenAI's
// SwiGLU (gpt-oss), its constants the model's (as in ember/models/layers/mlp.py).
inline void swiglu_oai_row(const float* gate, const float* up, int64_t F, float* out) {
  constexpr float kAlpha = 1.702f, kLimit = 7.0f;
  int64_t i = 0;
#if defined(EMBER_AVX2)
  const __m256 one = _mm256_set1_ps(1.0f), lim = _mm256_set1_ps(kLimit);
  const __m256 nlim = _mm256_set1_ps(-kLimit), malpha = _mm256_set1_ps(-kAlpha);
  for (; i + 8 <= F; i += 8) {
    const __m256 g = _mm256_min_ps(_mm256_loadu_ps(gate + i), lim);
    const __m256 u = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(up + i), nlim), lim);
    const __m256 e = exp8(_mm256_mul_ps(malpha, g));
    const __m256 glu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_add_ps(u, one), glu));
  }
#endif
  for (; i < F; ++i) {
    const float g = std::min(gate[i], kLimit);
    const float u = std::min(std::max(up[i], -kLimit), kLimit);
    out[i] = (u + 1.0f) * (g / (1.0f + exp_scalar(-kAlpha * g)));
  }
}

// Row gate|up [2F] -> out [F] by the family's gated unit.
inline void gated_unit_row(Activation act, const float* gu, int64_t F, float* out) {
  switch (act) {
    case Activation::kSilu: silu_mul_row(gu, gu + F, F, out); break;
    case Activation::kGeluTanh: gelu_mul_row(gu, gu + F, F, out); break;
    case Activation::kSwigluOai: swiglu_oai_row(gu, gu + F, F, out); break;
  }
}

// sum_k a[k] b[k] in one fixed order (four 8-lane partial sums, then the tail): the
// same bits for a row whatever else is computed beside it.
inline float dot_f32(const float* a, const float* b, int64_t K) {
  int64_t k = 0;
  float total = 0.0f;
#if defined(EMBER_AVX2)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), s3);
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  for (float v : lanes) total += v;
#endif
  for (; k < K; ++k) total += a[k] * b[k];
  return total;
}

