// Causal attention over the paged KV pool, read where it lies (no gathered copy).
//
// Part of the quant_matmul.cpp translation unit (included inside its namespace).
//
// Every query token is computed on its own, by one fixed sequence of operations
// that depends only on its position and the K/V it reads: the positions 0..pos are
// visited a pool block at a time, eight at a time inside a block (one dot-product
// tree per position), with an online softmax rescaled once per block. So a token's
// result is bitwise the same whether it is a decode row, one of a draft's verify
// rows or one token of a prefill chunk of any length, and whatever else is in the
// batch: the property the engine's batch-invariance tests assert.
//
// The query heads of one KV head are computed together (up to kScoreHeads for the
// scores, kValueHeads for the values), so a K or V row is loaded and widened once
// for all of them; each head's own arithmetic is unchanged by the grouping.
//
// Pools may hold f32, f16 or bf16, rows widened to f32 (exactly) as they are read, or
// q8_0 (ember/kv/dtypes.py; llama.cpp's block_q8_0): a head's row of D values is D/32
// blocks of 34 bytes, an f16 scale d then 32 int8 codes, read as code * d (exact in
// f32) where they lie. The order of operations is the same for every type.

enum class KVType : int { F32 = 0, F16 = 1, BF16 = 2, Q8_0 = 3 };

constexpr int64_t kQ8Block = 32;       // values per q8_0 block
constexpr int64_t kQ8BlockBytes = 34;  // an f16 scale and 32 int8 codes

// The pool's element type (a q8_0 pool is bytes).
template <KVType KT>
using KVElem = std::conditional_t<KT == KVType::F32, float,
                                  std::conditional_t<KT == KVType::Q8_0, uint8_t, uint16_t>>;

// Elements of the pool's type holding one head's row of D values.
inline int64_t kv_row_width(KVType type, int64_t d) {
  return type == KVType::Q8_0 ? d / kQ8Block * kQ8BlockBytes : d;
}

// One layer's K and V in the pool (blocks, layers, 2, bs, Hkv, row), in elements.
struct PoolLayer {
  const void* k;         // block 0's K of this layer
  const void* v;         // block 0's V of this layer
  int64_t block_stride;  // elements between consecutive blocks
  int64_t bs, hkv, d;
  KVType type;
  int64_t row;  // elements holding one head's row of d values (kv_row_width)
};

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// f32 -> bf16, round to nearest even (NaN stays NaN): torch's conversion.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline uint16_t f32_to_f16(float f) {
#if defined(EMBER_AVX2)
  return static_cast<uint16_t>(
      _mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0));
#else
  return c10::Half(f).x;
#endif
}

// The q8_0 block holding value i of a row, and its scale d as f32.
inline const uint8_t* q8_block(const void* row, int64_t i) {
  return static_cast<const uint8_t*>(row) + i / kQ8Block * kQ8BlockBytes;
}

inline float q8_scale(const uint8_t* block) {
  uint16_t d;
  std::memcpy(&d, block, 2);
  return h2f(d);
}

// Element i of a K/V row in pool type KT, as f32 (exact).
template <KVType KT>
inline float load1(const void* row, int64_t i) {
  if constexpr (KT == KVType::F32) {
    return static_cast<const float*>(row)[i];
  } else if constexpr (KT == KVType::F16) {
    return h2f(static_cast<const uint16_t*>(row)[i]);
  } else if constexpr (KT == KVType::BF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(row)[i]);
  } else {
    const uint8_t* b = q8_block(row, i);
    return static_cast<float>(static_cast<int8_t>(b[2 + i % kQ8Block])) * q8_scale(b);
  }
}

// n values (a multiple of 32) as q8_0 blocks at out, as ember/kv/dtypes.py and
// llama.cpp's x86 path compute them: d = amax / 127, codes x * (127 / amax) rounded
// to nearest even (the default rounding mode), d rounded to f16.
inline void quantize_q8_0(const float* in, int64_t n, uint8_t* out) {
  for (int64_t b = 0; b < n / kQ8Block; ++b, in += kQ8Block, out += kQ8BlockBytes) {
    float amax = 0.0f;
    for (int64_t j = 0; j < kQ8Block; ++j) amax = std::max(amax, std::fabs(in[j]));
    const float d = amax / 127.0f;
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    const uint16_t h = f32_to_f16(d);
    std::memcpy(out, &h, 2);
    int8_t* codes = reinterpret_cast<int8_t*>(out + 2);
    for (int64_t j = 0; j < kQ8Block; ++j) {
      codes[j] = static_cast<int8_t>(std::nearbyint(in[j] * inv));
    }
  }
}

// f32 in -> n values in pool type `type` at dst (element index `at`; q8_0: n a
// multiple of 32, `at` in bytes).
inline void narrow_to(const float* in, int64_t n, KVType type, void* dst, int64_t at) {
  if (type == KVType::F32) {
    std::memcpy(static_cast<float*>(dst) + at, in, sizeof(float) * n);
  } else if (type == KVType::F16) {
    uint16_t* p = static_cast<uint16_t*>(dst) + at;
    for (int64_t i = 0; i < n; ++i) p[i] = f32_to_f16(in[i]);
  } else if (type == KVType::BF16) {
    uint16_t* p = static_cast<uint16_t*>(dst) + at;
    for (int64_t i = 0; i < n; ++i) p[i] = f32_to_bf16(in[i]);
  } else {
    quantize_q8_0(in, n, static_cast<uint8_t*>(dst) + at);
  }
}

#if defined(EMBER_AVX2)

// e^x for 8 lanes (Cephes' single-precision polynomial, within ~2 ulp; inputs
// below -87 give ~1e-38 rather than 0). Used for softmax weights and SiLU.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// Elements i..i+7 of a K/V row in float pool type KT, as f32 (exact). (q8_0 rows are
// read a block at a time: dots8, weighted_values.)
template <KVType KT>
inline __m256 load8(const void* row, int64_t i) {
  static_assert(KT != KVType::Q8_0, "q8_0 rows are read by block");
  if constexpr (KT == KVType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i));
    if constexpr (KT == KVType::F16) {
      return _mm256_cvtph_ps(h);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}

// 8 int8 codes at p as f32.
inline __m256 codes8(const uint8_t* p) {
  const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
}

// The dots of q with 8 rows k[0..7] (D a multiple of 8): per row, 8 lanes summed
// over D in order, then the lanes in a fixed tree — the same for a row whatever
// the other seven are. q8_0 rows: per 32-value block, q times the codes, then times
// the block's scale (one scale per block rather than per 8 values).
template <KVType KT>
inline __m256 dots8(const float* q, const void* const* k, int64_t D) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  if constexpr (KT == KVType::Q8_0) {
    for (int64_t c = 0; c < D; c += kQ8Block) {
      const __m256 q0 = _mm256_loadu_ps(q + c), q1 = _mm256_loadu_ps(q + c + 8);
      const __m256 q2 = _mm256_loadu_ps(q + c + 16), q3 = _mm256_loadu_ps(q + c + 24);
      for (int j = 0; j < 8; ++j) {
        const uint8_t* b = q8_block(k[j], c);
        __m256 t = _mm256_mul_ps(q0, codes8(b + 2));
        t = _mm256_fmadd_ps(q1, codes8(b + 10), t);
        t = _mm256_fmadd_ps(q2, codes8(b + 18), t);
        t = _mm256_fmadd_ps(q3, codes8(b + 26), t);
        a[j] = _mm256_fmadd_ps(t, _mm256_set1_ps(q8_scale(b)), a[j]);
      }
    }
  } else {
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + c);
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8<KT>(k[j], c), a[j]);
    }
  }
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

// acc[0 .. 8 NV) = acc * r + sum_j w[j] v[j][0 .. 8 NV), positions j in order, with
// the accumulators in registers. q8_0 rows (c0 a multiple of 32): w[j] times the
// block's scale, once per block, times the codes.
template <KVType KT, int NV>
inline void weighted_values(float* acc, float r, const float* w, const void* const* v,
                            int64_t n, int64_t c0) {
  __m256 a[NV];
  const __m256 rv = _mm256_set1_ps(r);
  for (int u = 0; u < NV; ++u) a[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * u), rv);
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (KT == KVType::Q8_0) {
      const uint8_t* base = q8_block(v[j], c0);
      __m256 wd = _mm256_setzero_ps();
      for (int u = 0; u < NV; ++u) {
        const uint8_t* b = base + (u / 4) * kQ8BlockBytes;
        if (u % 4 == 0) wd = _mm256_set1_ps(w[j] * q8_scale(b));
        a[u] = _mm256_fmadd_ps(wd, codes8(b + 2 + (u % 4) * 8), a[u]);
      }
    } else {
      const __m256 wj = _mm256_set1_ps(w[j]);
      for (int u = 0; u < NV; ++u) a[u] = _mm256_fmadd_ps(wj, load8<KT>(v[j], c0 + 8 * u), a[u]);
    }
  }
  for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc + 8 * u, a[u]);
}

// Heads of one KV head read the same K and V rows: up to this many are computed
// together, so each row is loaded (and widened) once for all of them. The scores
// need 4 accumulators a head; AVX-512VL's 32 vector registers hold four heads'.
#if defined(__AVX512VL__)
constexpr int kScoreHeads = 4;
#else
constexpr int kScoreHeads = 2;
#endif
constexpr int kValueHeads = 4;

// s[i][0..4) = scale * q[i] . k[j] for GH heads and 4 keys, each by dots8's
// arithmetic: 8 lanes summed over D in order, then the same tree.
template <KVType KT, int GH>
inline void scores4_heads(const float* const* q, const void* const* k, int64_t D, float scale,
                          float* const* s, int64_t j0) {
  __m256 a[GH][4];
  for (int i = 0; i < GH; ++i)
    for (int j = 0; j < 4; ++j) a[i][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 kv[4];
    for (int j = 0; j < 4; ++j) kv[j] = load8<KT>(k[j], c);
    for (int i = 0; i < GH; ++i) {
      const __m256 qv = _mm256_loadu_ps(q[i] + c);
      for (int j = 0; j < 4; ++j) a[i][j] = _mm256_fmadd_ps(qv, kv[j], a[i][j]);
    }
  }
  for (int i = 0; i < GH; ++i) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]),
                                    _mm256_hadd_ps(a[i][2], a[i][3]));
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    _mm_storeu_ps(s[i] + j0, _mm_mul_ps(r, _mm_set1_ps(scale)));
  }
}

// acc[i][c0 .. c0 + 8 NV) = acc[i] * r[i] + sum_j w[i][j] v[j][...] for GH heads
// sharing the V rows: weighted_values' arithmetic, element by element.
template <KVType KT, int GH, int NV>
inline void weighted_values_heads(float* const* acc, const float* r, const float* const* w,
                                  const void* const* v, int64_t n, int64_t c0) {
  __m256 a[GH][NV];
  for (int i = 0; i < GH; ++i) {
    const __m256 ri = _mm256_set1_ps(r[i]);
    for (int u = 0; u < NV; ++u) a[i][u] = _mm256_mul_ps(_mm256_loadu_ps(acc[i] + c0 + 8 * u), ri);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m256 vv[NV];
    for (int u = 0; u < NV; ++u) vv[u] = load8<KT>(v[j], c0 + 8 * u);
    for (int i = 0; i < GH; ++i) {
      const __m256 wj = _mm256_set1_ps(w[i][j]);
      for (int u = 0; u < NV; ++u) a[i][u] = _mm256_fmadd_ps(wj, vv[u], a[i][u]);
    }
  }
  for (int i = 0; i < GH; ++i)
    for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc[i] + c0 + 8 * u, a[i][u]);
}

template <KVType KT, int GH>
inline void accumulate_values_heads(float* const* acc, const float* r, const float* const* w,
                                    const void* const* v, int64_t n, int64_t D) {
  int64_t c = 0;
  for (; c + 16 <= D; c += 16) weighted_values_heads<KT, GH, 2>(acc, r, w, v, n, c);
  if (c < D) weighted_values_heads<KT, GH, 1>(acc, r, w, v, n, c);
}

#endif

inline float exp_scalar(float x) { return std::exp(x); }

// softmax weights e^(s - mx) of 8 scores (only the first n are used)
inline void exp_shifted8(const float* s, float mx, float* w) {
#if defined(EMBER_AVX2)
  _mm256_storeu_ps(w, exp8(_mm256_sub_ps(_mm256_loadu_ps(s), _mm256_set1_ps(mx))));
#else
  for (int j = 0; j < 8; ++j) w[j] = exp_scalar(s[j] - mx);
#endif
}

template <KVType KT>
inline void scores8(const float* q, const void* const* k, int64_t D, float scale, float* out) {
#if defined(EMBER_AVX2)
  _mm256_storeu_ps(out, _mm256_mul_ps(dots8<KT>(q, k, D), _mm256_set1_ps(scale)));
#else
  for (int j = 0; j < 8; ++j) {
    float s = 0.0f;
    for (int64_t c = 0; c < D; ++c) s += q[c] * load1<KT>(k[j], c);
    out[j] = s * scale;
  }
#endif
}

// acc[D] = acc * r + sum_j w[j] v[j], positions j in order.
template <KVType KT>
inline void accumulate_values(float* acc, float r, const float* w, const void* const* v,
                              int64_t n, int64_t D) {
#if defined(EMBER_AVX2)
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) weighted_values<KT, 8>(acc + c, r, w, v, n, c);
  switch ((D - c) / 8) {
    case 7: weighted_values<KT, 7>(acc + c, r, w, v, n, c); break;
    case 6: weighted_values<KT, 6>(acc + c, r, w, v, n, c); break;
    case 5: weighted_values<KT, 5>(acc + c, r, w, v, n, c); break;
    case 4: weighted_values<KT, 4>(acc + c, r, w, v, n, c); break;
    case 3: weighted_values<KT, 3>(acc + c, r, w, v, n, c); break;
    case 2: weighted_values<KT, 2>(acc + c, r, w, v, n, c); break;
    case 1: weighted_values<KT, 1>(acc + c, r, w, v, n, c); break;
    default: break;
  }
#else
  for (int64_t c = 0; c < D; ++c) {
    float a = acc[c] * r;
    for (int64_t j = 0; j < n; ++j) a += w[j] * load1<KT>(v[j], c);
    acc[c] = a;
  }
#endif
}

// Ask for elements [c0, c1) of n rows (stride row_stride) at offset `at` of K and V.
template <typename Elem>
inline void prefetch_rows(const Elem* k, const Elem* v, int64_t at, int64_t n,
                          int64_t row_stride, int64_t c0, int64_t c1) {
  constexpr int64_t line = 64 / sizeof(Elem);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = at + j * row_stride;
    for (int64_t c = c0; c < c1; c += line) {
      __builtin_prefetch(k + row + c);
      __builtin_prefetch(v + row + c);
    }
  }
}

// Scores (times scale) of `heads` query heads against the `padded` keys of one KV
// head, into s[i][0 .. padded); each head's arithmetic is scores8's, however many
// are computed together.
template <KVType KT>
inline void head_scores(const float* const* q, const void* const* k, int64_t heads,
                        int64_t padded, int64_t D, float scale, float* const* s) {
#if defined(EMBER_AVX2)
  if constexpr (KT != KVType::Q8_0) {
    for (int64_t i = 0; i < heads; i += kScoreHeads) {
      const int64_t gh = std::min<int64_t>(kScoreHeads, heads - i);
      for (int64_t j = 0; j < padded; j += 4) {
        switch (gh) {
          case 1: scores4_heads<KT, 1>(q + i, k + j, D, scale, s + i, j); break;
          case 2: scores4_heads<KT, 2>(q + i, k + j, D, scale, s + i, j); break;
          case 3: scores4_heads<KT, 3>(q + i, k + j, D, scale, s + i, j); break;
          default: scores4_heads<KT, 4>(q + i, k + j, D, scale, s + i, j); break;
        }
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < heads; ++i)
    for (int64_t j = 0; j < padded; j += 8) scores8<KT>(q[i], k + j, D, scale, s[i] + j);
}

// acc[i] = acc[i] * r[i] + sum_j w[i][j] v[j] for `heads` heads sharing the V rows;
// each head's arithmetic is accumulate_values'.
template <KVType KT>
inline void head_values(float* const* acc, const float* r, const float* const* w,
                        const void* const* v, int64_t heads, int64_t n, int64_t D) {
#if defined(EMBER_AVX2)
  if constexpr (KT != KVType::Q8_0) {
    for (int64_t i = 0; i < heads; i += kValueHeads) {
      switch (std::min<int64_t>(kValueHeads, heads - i)) {
        case 1: accumulate_values_heads<KT, 1>(acc + i, r + i, w + i, v, n, D); break;
        case 2: accumulate_values_heads<KT, 2>(acc + i, r + i, w + i, v, n, D); break;
        case 3: accumulate_values_heads<KT, 3>(acc + i, r + i, w + i, v, n, D); break;
        default: accumulate_values_heads<KT, 4>(acc + i, r + i, w + i, v, n, D); break;
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < heads; ++i) accumulate_values<KT>(acc[i], r[i], w[i], v, n, D);
}

// Attention of T query tokens. q: token t's H heads of D at q + t * q_stride;
// out: [T, H, D] f32. Token t belongs to row rows[t] (its block ids: tables[rows[t] *
// NB ...]) and sits at position pos[t]: it attends to positions 0..pos[t] of its
// row, whose K/V must already be in the pool.
//
// Each query head runs the same sequence of operations however the work is split,
// so the split may follow the batch: one task per token (all its heads, so each
// block's K/V rows are read together, in order) when there are tokens enough to
// keep the threads busy, else one per (token, KV head), else one per (token, head).
// window > 0: a sliding-window layer, token t attends to positions
// max(0, pos[t] - window + 1) .. pos[t] only (blocks before that are not read; the
// first block read is entered at the window's start).
// softcap > 0: each score s becomes softcap * tanh(s / softcap) before the softmax
// (Gemma 2's soft-capped attention).
// sinks (null: none): per head a logit that joins the softmax's denominator and weighs
// no value (gpt-oss).
template <KVType KT>
void attend_typed(const float* q, int64_t q_stride, float* out, int64_t T, int64_t H,
                  const PoolLayer& kv, const int64_t* tables, int64_t NB, const int64_t* rows,
                  const int64_t* pos, float scale, int64_t window, float softcap,
                  const float* sinks) {
  using Elem = KVElem<KT>;
  const int64_t D = kv.d, W = kv.row, bs = kv.bs, G = H / kv.hkv, row_stride = kv.hkv * W;
  const int64_t padded = (bs + 7) / 8 * 8;
  const Elem* kbase = static_cast<const Elem*>(kv.k);
  const Elem* vbase = static_cast<const Elem*>(kv.v);
  // A task: one token's heads, all of them when there are tokens enough to keep the
  // threads busy, else those of one KV head (they share its rows), else one head.
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_task = T >= 2 * threads ? H : T * kv.hkv >= 2 * threads ? G : 1;
  const int64_t tasks = T * (H / heads_per_task);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    // per task: an accumulator, running max and sum per head; per block and head: the
    // rows' addresses, scores and softmax weights
    std::vector<float> acc(heads_per_task * D), mx(heads_per_task), sum(heads_per_task);
    std::vector<float> scores(heads_per_task * padded), weights(heads_per_task * padded);
    std::vector<Elem> zero(W, Elem{});  // reads as D zeros in every type
    std::vector<const void*> krow(padded), vrow(bs);
    std::vector<const float*> qh(heads_per_task);
    std::vector<float*> sh(heads_per_task), wh(heads_per_task), ah(heads_per_task);
    std::vector<float> rescale(heads_per_task);
    for (int64_t i = t0; i < t1; ++i) {
      // Tasks are taken from both ends in turn (0, N-1, 1, N-2, ...): a causal prompt's
      // late tokens attend to more positions than its early ones, and parallel_for hands
      // each thread one contiguous range, which would leave one thread most of the work.
      const int64_t task = i % 2 == 0 ? i / 2 : tasks - 1 - i / 2;
      const int64_t t = task / (H / heads_per_task);
      const int64_t h0 = task % (H / heads_per_task) * heads_per_task;
      const int64_t len = pos[t] + 1;
      const int64_t* table = tables + rows[t] * NB;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(mx.begin(), mx.end(), -INFINITY);
      std::fill(sum.begin(), sum.end(), 0.0f);
      const int64_t hk_lo = h0 / G, hk_hi = (h0 + heads_per_task - 1) / G;
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t start = first / bs * bs; start < len; start += bs) {
        const int64_t skip = std::max<int64_t>(0, first - start);  // before the window
        const int64_t n = std::min(bs, len - start) - skip;
        const int64_t block = table[start / bs] * kv.block_stride + skip * row_stride;
        if (start + bs < len) {
          // Blocks lie far apart in the pool (every layer's K/V sit between two
          // consecutive blocks of one layer), so the hardware prefetcher, which stops
          // at page boundaries, does not see the next one coming: ask for it.
          const int64_t next = table[start / bs + 1] * kv.block_stride;
          prefetch_rows(kbase, vbase, next, std::min(bs, len - start - bs), row_stride,
                        hk_lo * W, (hk_hi + 1) * W);
        }
        for (int64_t i = 0; i < heads_per_task;) {
          const int64_t hk = (h0 + i) / G;
          const int64_t end = std::min(heads_per_task, (hk + 1) * G - h0);  // hk's heads
          const int64_t base = block + hk * W;
          for (int64_t j = 0; j < n; ++j) {
            krow[j] = kbase + base + j * row_stride;
            vrow[j] = vbase + base + j * row_stride;
          }
          for (int64_t j = n; j < padded; ++j) krow[j] = zero.data();
          for (int64_t g = i; g < end; ++g) {
            qh[g] = q + t * q_stride + (h0 + g) * D;
            sh[g] = scores.data() + g * padded;
            wh[g] = weights.data() + g * padded;
            ah[g] = acc.data() + g * D;
          }
          head_scores<KT>(qh.data() + i, krow.data(), end - i, padded, D, scale, sh.data() + i);
          if (softcap > 0.0f) {
            for (int64_t g = i; g < end; ++g) {
              for (int64_t j = 0; j < n; ++j) sh[g][j] = softcap * std::tanh(sh[g][j] / softcap);
            }
          }
          for (int64_t g = i; g < end; ++g) {
            float bmax = -INFINITY;
            for (int64_t j = 0; j < n; ++j) bmax = std::max(bmax, sh[g][j]);
            const float new_mx = std::max(mx[g], bmax);
            rescale[g] = exp_scalar(mx[g] - new_mx);  // 0 for the first block
            for (int64_t j = 0; j < padded; j += 8) exp_shifted8(sh[g] + j, new_mx, wh[g] + j);
            float s = sum[g] * rescale[g];
            for (int64_t j = 0; j < n; ++j) s += wh[g][j];
            sum[g] = s;
            mx[g] = new_mx;
          }
          head_values<KT>(ah.data() + i, rescale.data() + i, wh.data() + i, vrow.data(),
                          end - i, n, D);
          i = end;
        }
      }
      for (int64_t i = 0; i < heads_per_task; ++i) {
        float* o = out + (t * H + h0 + i) * D;
        // a sink joins the softmax's denominator only (gpt-oss): the head may attend to
        // nothing
        const float sink = sinks != nullptr ? exp_scalar(sinks[h0 + i] - mx[i]) : 0.0f;
        const float inv = 1.0f / (sum[i] + sink);
        for (int64_t c = 0; c < D; ++c) o[c] = acc[i * D + c] * inv;
      }
    }
  });
}

void attend(const float* q, int64_t q_stride, float* out, int64_t T, int64_t H,
            const PoolLayer& kv, const int64_t* tables, int64_t NB, const int64_t* rows,
            const int64_t* pos, float scale, int64_t window = 0, float softcap = 0.0f,
            const float* sinks = nullptr) {
  switch (kv.type) {
    case KVType::F32:
      attend_typed<KVType::F32>(q, q_stride, out, T, H, kv, tables, NB, rows, pos, scale,
                                window, softcap, sinks);
      break;
    case KVType::F16:
      attend_typed<KVType::F16>(q, q_stride, out, T, H, kv, tables, NB, rows, pos, scale,
                                window, softcap, sinks);
      break;
    case KVType::BF16:
      attend_typed<KVType::BF16>(q, q_stride, out, T, H, kv, tables, NB, rows, pos, scale,
                                 window, softcap, sinks);
      break;
    case KVType::Q8_0:
      attend_typed<KVType::Q8_0>(q, q_stride, out, T, H, kv, tables, NB, rows, pos, scale,
                                 window, softcap, sinks);
      break;
  }
}

KVType kv_type_of(const at::Tensor& pool) {
  switch (pool.scalar_type()) {
    case at::kFloat: return KVType::F32;
    case at::kHalf: return KVType::F16;
    case at::kBFloat16: return KVType::BF16;
    case at::kByte: return KVType::Q8_0;
    default: TORCH_CHECK(false, "KV pool must be float32, float16, bfloat16 or uint8 (q8_0), "
                         "got ", pool.scalar_type());
  }
  return KVType::F32;
}

// The values per head row of a pool (blocks, layers, 2, bs, Hkv, row): row, or for
// q8_0 (bytes) row / 34 * 32, refusing a row that is not whole blocks.
int64_t pool_head_dim(const at::Tensor& pool) {
  const int64_t row = pool.size(5);
  if (kv_type_of(pool) != KVType::Q8_0) return row;
  TORCH_CHECK(row % kQ8BlockBytes == 0, "q8_0 KV pool rows must be whole 34-byte blocks, got ",
              row, " bytes");
  return row / kQ8BlockBytes * kQ8Block;
}

// Layer `layer` of a contiguous pool (blocks, layers, 2, bs, Hkv, row).
PoolLayer pool_layer(const at::Tensor& pool, int64_t layer) {
  TORCH_CHECK(pool.device().is_cpu() && pool.dim() == 6 && pool.is_contiguous() &&
                  pool.size(2) == 2 && pool.size(4) > 0 && pool.size(5) > 0,
              "KV pool must be a contiguous CPU (blocks, layers, 2, bs, kv_heads, head_dim) "
              "tensor");
  TORCH_CHECK(layer >= 0 && layer < pool.size(1), "KV pool has no layer ", layer);
  const int64_t per_kv = pool.size(3) * pool.size(4) * pool.size(5);
  const KVType type = kv_type_of(pool);
  const int64_t esize = pool.element_size();
  const char* base = static_cast<const char*>(pool.data_ptr()) + layer * 2 * per_kv * esize;
  return {base, base + per_kv * esize, pool.stride(0), pool.size(3), pool.size(4),
          pool_head_dim(pool), type, pool.size(5)};
}
