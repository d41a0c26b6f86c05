// y = x @ W^T with W kept in GGUF-style block quantization (see ember/kernels).
//
// Packed weight layouts (built once at load by q4_pack / q8_pack from GGUF's codes
// and scales; a pure byte shuffle, values unchanged). Rows are interleaved in
// groups of 8 so that one 32-byte vector holds 4 consecutive codes of each of 8
// rows: a dot-product instruction (vpdpbusd / vpmaddubsw) against 4 activation
// bytes broadcast to every lane then advances 8 output rows at once, and one f16
// load gives the 8 rows' scales. The row count is padded to a multiple of 8 with
// zero rows (outputs for them are never written).
//
//   4-bit:  qs [G, nb, 4, 8, 4] uint8  byte (u, r, p) of block b of group g is GGUF
//                                      byte 4u+p of that block in row 8g+r, i.e.
//                                      element 4u+p in the low nibble and element
//                                      16+4u+p in the high nibble.
//           d, m [G, nb, 8] f16        w = q * d + m  (Q4_1; Q4_0 has m = -8 d)
//           20 bytes per 32 weights = 0.625 B/weight, as GGUF Q4_1.
//   8-bit:  qs [G, nb, 8, 8, 4] int8   byte (t, r, p) is element 4t+p of row 8g+r.
//           d [G, nb, 8] f16           w = q * d;  34 bytes / 32 weights, as Q8_0.
//   k8:     qs as 8-bit                (K-quants, and any block type beside them)
//           s [G, nb, 2, 8] f32        scale of elements 0-15 / 16-31 of the block
//           m [G, nb, 8] f32 or none   w = q * s + m; 44 (40 without m) bytes / 32.
//           The scales of K-quants are products of a 6- or 8-bit integer and an
//           f16, exact in f32 (not in f16), so this holds them without rounding.
//
// Small M (decode, small batches): each activation row is quantized per 32 to int8
// (llama.cpp's Q8 activations: d_x = max|x|/127, round half to even); block dots are
// exact integer dots scaled by d_w d_x in float. For 4-bit weights
//   sum_i (q_i d + m) x_i = d sum_i (q_i - 8) x_i + (m + 8 d) sum_i x_i,
// and the second term uses the exact float block sum of x, so only the centred
// codes meet the activation rounding error (half the error of uncentred codes).
// Computed as  d * (dx * sum_i q_i xq_i + 8 c) + m * s  with s = sum x and
// c = s - dx * sum xq (the block's rounding error), both per activation block.
//
// Large M (prefill): weight row chunks are dequantized to f32 (bit-identical to
// ember.models.quant.dequantize) and multiplied by at::mm, f32-exact.
//
// Threads: at::parallel_for over row groups (follows torch.set_num_threads).
// SIMD: AVX2+FMA+F16C, with AVX512-VNNI/VL dot products when compiled for them
// (and with AVX512-BW, two row groups per 512-bit instruction), and a portable
// scalar fallback, chosen at compile time.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <map>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EMBER_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define EMBER_VNNI 1
#endif
#if defined(EMBER_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define EMBER_VNNI512 1
#endif
#endif

namespace {

constexpr int64_t QK = 32;   // elements per quantization block
constexpr int64_t RG = 8;    // rows per interleaved group
constexpr int64_t B4 = 128;  // bytes per (group, block), 4-bit
constexpr int64_t B8 = 256;  // bytes per (group, block), 8-bit

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

const uint16_t* half_ptr(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

// -------------------------------------------------------- activation quantization

// Quantized activations. The arrays live in a per-thread scratch buffer reused
// across calls (no allocation on the decode path); valid until the next call on
// the same thread.
struct QuantX {
  int8_t* q;       // [M, K] codes
  float* d;        // [M, nb] scales
  float* s;        // [M, nb] exact float block sums
  float* c8;       // [M, nb] 8 * (s - d * sum(q)): 8x the block rounding error
  int32_t* qsum;   // [M, nb] sum(q)
  int32_t* qlo;    // [M, nb] sum of the first 16 of q (k8's half-block scales)
};

// One row of K floats.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, float* c8,
                  int32_t* qsum, int32_t* qlo) {
  const int64_t nb = K / QK;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    int8_t* qb = q + b * QK;
#if defined(EMBER_AVX2)
    const __m256 v0 = _mm256_loadu_ps(xb);
    const __m256 v1 = _mm256_loadu_ps(xb + 8);
    const __m256 v2 = _mm256_loadu_ps(xb + 16);
    const __m256 v3 = _mm256_loadu_ps(xb + 24);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_andnot_ps(sign, v0);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v1));
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v2));
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v3));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float mx = _mm_cvtss_f32(m4);
    d[b] = mx / 127.f;
    const __m256 id = _mm256_set1_ps(mx != 0.0f ? 127.f / mx : 0.0f);
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3));
    __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(sum, 1), _mm256_castps256_ps128(sum));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    s[b] = _mm_cvtss_f32(s4);
    // round to nearest even (the default MXCSR mode), like nearbyint below
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, id));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, id));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, id));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, id));
    const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i is4 = _mm_add_epi32(_mm256_extracti128_si256(isum, 1), _mm256_castsi256_si128(isum));
    is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0x4E));
    is4 = _mm_add_epi32(is4, _mm_shuffle_epi32(is4, 0xB1));
    qsum[b] = _mm_cvtsi128_si32(is4);
    const __m256i lo = _mm256_add_epi32(i0, i1);
    __m128i lo4 = _mm_add_epi32(_mm256_extracti128_si256(lo, 1), _mm256_castsi256_si128(lo));
    lo4 = _mm_add_epi32(lo4, _mm_shuffle_epi32(lo4, 0x4E));
    lo4 = _mm_add_epi32(lo4, _mm_shuffle_epi32(lo4, 0xB1));
    qlo[b] = _mm_cvtsi128_si32(lo4);
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), i0);
#else
    float mx = 0.0f, sum = 0.0f;
    for (int64_t j = 0; j < QK; ++j) {
      mx = std::max(mx, std::fabs(xb[j]));
      sum += xb[j];
    }
    d[b] = mx / 127.f;
    s[b] = sum;
    const float id = mx != 0.0f ? 127.f / mx : 0.0f;
    int32_t total = 0;
    for (int64_t j = 0; j < QK; ++j) {
      qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
      total += qb[j];
      if (j == QK / 2 - 1) qlo[b] = total;
    }
    qsum[b] = total;
#endif
    c8[b] = 8.0f * (s[b] - d[b] * static_cast<float>(qsum[b]));
  }
}

// M rows of K floats at xp (row-major).
QuantX quantize_rows(const float* xp, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  // layout: 5 float-sized arrays of M*nb, then the M*K codes
  static thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>(5 * M * nb + (M * K + 3) / 4);
  if (scratch.size() < need) scratch.resize(need);
  float* base = scratch.data();
  QuantX r{reinterpret_cast<int8_t*>(base + 5 * M * nb), base, base + M * nb, base + 2 * M * nb,
           reinterpret_cast<int32_t*>(base + 3 * M * nb),
           reinterpret_cast<int32_t*>(base + 4 * M * nb)};
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row(xp + m * K, K, r.q + m * K, r.d + m * nb, r.s + m * nb, r.c8 + m * nb,
                   r.qsum + m * nb, r.qlo + m * nb);
    }
  });
  return r;
}

QuantX quantize_x(const at::Tensor& x) {
  return quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1));
}

// ------------------------------------------------------ small-M integer kernels

struct Weights {
  const uint8_t* qs;  // packed codes
  const uint16_t* d;  // f16 scales [G, nb, 8]
  const uint16_t* m;  // f16 offsets [G, nb, 8] (4-bit only)
  const float* ks = nullptr;  // k8: f32 half-block scales [G, nb, 2, 8]
  const float* km = nullptr;  // k8: f32 offsets [G, nb, 8], or none
};

enum Layout { kQ4 = 4, kQ8 = 8, kK8 = 16 };

struct Acts {
  const int8_t* q;
  const float* d;
  const float* s;
  const float* c8;
  const int32_t* qsum;
  const int32_t* qlo;
};

inline Acts acts_of(const QuantX& xq) { return {xq.q, xq.d, xq.s, xq.c8, xq.qsum, xq.qlo}; }

struct Dims {
  int64_t M, N, K, nb;
};

// Write the 8 outputs of group g for activation row mi (fewer for a padded group).
inline void store_group(float* y, const Dims& n, int64_t mi, int64_t g, const float* v8) {
  const int64_t r0 = g * RG, cnt = std::min<int64_t>(RG, n.N - r0);
  std::memcpy(y + mi * n.N + r0, v8, sizeof(float) * cnt);
}

#if defined(EMBER_AVX2)

inline __m256 load_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The group kernels below are written once over a lane set L: Lanes8 computes one
// group of 8 rows per instruction (__m256); Lanes16 (AVX-512) computes groups g and
// g+1 side by side (__m512), halving the instructions per output. Every lane does the
// same operations in the same order in both, so a row's result does not depend on
// which lane set computed it (batch invariance holds across the pairing).
struct Lanes8 {
  static constexpr int64_t kGroups = 1;
  using I = __m256i;
  using F = __m256;
  // `stride` (the distance to the next group's data) is unused with one group
  static I codes(const uint8_t* p, int64_t) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static F halves(const uint16_t* p, int64_t) { return load_f16x8(p); }
  static F floats(const float* p, int64_t) { return _mm256_loadu_ps(p); }
  static I bcast(const int8_t* p) { return bcast32(p); }
  static I seti(int32_t v) { return _mm256_set1_epi32(v); }
  static I set8(char v) { return _mm256_set1_epi8(v); }
  static F setf(float v) { return _mm256_set1_ps(v); }
  static I zeroi() { return _mm256_setzero_si256(); }
  static F zerof() { return _mm256_setzero_ps(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I shr4(I a) { return _mm256_srli_epi16(a, 4); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
#if defined(EMBER_VNNI)
  static I dot(I acc, I w, I x) { return _mm256_dpbusd_epi32(acc, w, x); }
#endif
  static void store(F v, float* y, const Dims& n, int64_t mi, int64_t g) {
    alignas(32) float out[RG];
    _mm256_store_ps(out, v);
    store_group(y, n, mi, g, out);
  }
};

#if defined(EMBER_VNNI512)
struct Lanes16 {
  static constexpr int64_t kGroups = 2;
  using I = __m512i;
  using F = __m512;
  static I codes(const uint8_t* p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(Lanes8::codes(p, 0)),
                              Lanes8::codes(p + stride, 0), 1);
  }
  static F halves(const uint16_t* p, int64_t stride) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
  }
  static F floats(const float* p, int64_t stride) {
    return _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(p))),
        _mm256_castps_pd(_mm256_loadu_ps(p + stride)), 1));
  }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I seti(int32_t v) { return _mm512_set1_epi32(v); }
  static I set8(char v) { return _mm512_set1_epi8(v); }
  static F setf(float v) { return _mm512_set1_ps(v); }
  static I zeroi() { return _mm512_setzero_si512(); }
  static F zerof() { return _mm512_setzero_ps(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I shr4(I a) { return _mm512_srli_epi16(a, 4); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static void store(F v, float* y, const Dims& n, int64_t mi, int64_t g) {
    alignas(64) float out[2 * RG];
    _mm512_store_ps(out, v);
    store_group(y, n, mi, g, out);
    store_group(y, n, mi, g + 1, out + RG);
  }
};
#endif

// Groups [g, g + L::kGroups) of a 4-bit weight times activation rows [m0, m0 + MT).
template <class L, int MT>
inline void group_q4(const Weights& w, const Acts& a, const Dims& n, int64_t g, int64_t m0,
                     float* y) {
  using I = typename L::I;
  using F = typename L::F;
  const I low = L::set8(0x0F);
  F acc[MT];
  for (int j = 0; j < MT; ++j) acc[j] = L::zerof();
  const int64_t qstride = n.nb * B4, dstride = n.nb * RG;
  const uint8_t* qg = w.qs + g * qstride;
  const uint16_t* dg = w.d + g * dstride;
  const uint16_t* mg = w.m + g * dstride;
  for (int64_t b = 0; b < n.nb; ++b) {
    const uint8_t* qb = qg + b * B4;
    I wv[8];  // wv[u]: elements 4u..4u+3 of 8 rows; wv[4+u]: elements 16+4u..
    for (int u = 0; u < 4; ++u) {
      const I raw = L::codes(qb + 32 * u, qstride);
      wv[u] = L::and_(raw, low);
      wv[4 + u] = L::and_(L::shr4(raw), low);
    }
    const F dv = L::halves(dg + b * RG, dstride);
    const F mv = L::halves(mg + b * RG, dstride);
    for (int j = 0; j < MT; ++j) {
      const int64_t row = m0 + j;
      const int8_t* xb = a.q + row * n.K + b * QK;
#if defined(EMBER_VNNI)
      I s0 = L::dot(L::zeroi(), wv[0], L::bcast(xb));
      I s1 = L::dot(L::zeroi(), wv[4], L::bcast(xb + 16));
      for (int u = 1; u < 4; ++u) {
        s0 = L::dot(s0, wv[u], L::bcast(xb + 4 * u));
        s1 = L::dot(s1, wv[4 + u], L::bcast(xb + 16 + 4 * u));
      }
      const I isum = L::add(s0, s1);
#else
      // u8 (<= 15) x s8 (|.| <= 127) pair sums are <= 3810, so 8 of them fit int16
      __m256i p0 = _mm256_maddubs_epi16(wv[0], bcast32(xb));
      __m256i p1 = _mm256_maddubs_epi16(wv[4], bcast32(xb + 16));
      for (int u = 1; u < 4; ++u) {
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(wv[u], bcast32(xb + 4 * u)));
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(wv[4 + u], bcast32(xb + 16 + 4 * u)));
      }
      const I isum = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
#endif
      const int64_t xi = row * n.nb + b;
      const F t = L::fma(L::cvt(isum), L::setf(a.d[xi]), L::setf(a.c8[xi]));
      acc[j] = L::fma(dv, t, acc[j]);
      acc[j] = L::fma(mv, L::setf(a.s[xi]), acc[j]);
    }
  }
  for (int j = 0; j < MT; ++j) L::store(acc[j], y, n, m0 + j, g);
}

// Eight 32-byte code vectors of 8-bit block b: wv[t] holds elements 4t..4t+3 of 8 rows.
// With VNNI they are biased to unsigned (xor of the sign bit: sum (w + 128) x =
// sum w x + 128 sum x); without, wabs gets |w| for maddubs's u8 x s8.
template <class L>
inline void load_codes8(const uint8_t* qb, int64_t stride, typename L::I* wv,
                        typename L::I* wabs) {
#if defined(EMBER_VNNI)
  (void)wabs;
  const typename L::I flip = L::set8(static_cast<char>(0x80));
  for (int t = 0; t < 8; ++t) wv[t] = L::xor_(L::codes(qb + 32 * t, stride), flip);
#else
  for (int t = 0; t < 8; ++t) {
    wv[t] = L::codes(qb + 32 * t, stride);
    wabs[t] = _mm256_sign_epi8(wv[t], wv[t]);
  }
#endif
}

#if !defined(EMBER_VNNI)
// |w| x s8 pair sums reach 2 * 128 * 127, so each goes to int32 on its own
inline __m256i dot8_avx2(__m256i wabs, __m256i wv, const int8_t* x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(bcast32(x), wv)),
                           _mm256_set1_epi16(1));
}
#endif

// Groups [g, g + L::kGroups) of an 8-bit weight times activation rows [m0, m0 + MT).
template <class L, int MT>
inline void group_q8(const Weights& w, const Acts& a, const Dims& n, int64_t g, int64_t m0,
                     float* y) {
  using I = typename L::I;
  using F = typename L::F;
  F acc[MT];
  for (int j = 0; j < MT; ++j) acc[j] = L::zerof();
  const int64_t qstride = n.nb * B8, dstride = n.nb * RG;
  const uint8_t* qg = w.qs + g * qstride;
  const uint16_t* dg = w.d + g * dstride;
  for (int64_t b = 0; b < n.nb; ++b) {
    I wv[8], wabs[8];
    load_codes8<L>(qg + b * B8, qstride, wv, wabs);
    const F dv = L::halves(dg + b * RG, dstride);
    for (int j = 0; j < MT; ++j) {
      const int64_t row = m0 + j;
      const int8_t* xb = a.q + row * n.K + b * QK;
      const int64_t xi = row * n.nb + b;
#if defined(EMBER_VNNI)
      I s0 = L::dot(L::zeroi(), wv[0], L::bcast(xb));
      I s1 = L::dot(L::zeroi(), wv[1], L::bcast(xb + 4));
      for (int t = 2; t < 8; t += 2) {
        s0 = L::dot(s0, wv[t], L::bcast(xb + 4 * t));
        s1 = L::dot(s1, wv[t + 1], L::bcast(xb + 4 * t + 4));
      }
      const I isum = L::sub(L::add(s0, s1), L::seti(128 * a.qsum[xi]));
#else
      I s0 = dot8_avx2(wabs[0], wv[0], xb), s1 = dot8_avx2(wabs[1], wv[1], xb + 4);
      for (int t = 2; t < 8; t += 2) {
        s0 = L::add(s0, dot8_avx2(wabs[t], wv[t], xb + 4 * t));
        s1 = L::add(s1, dot8_avx2(wabs[t + 1], wv[t + 1], xb + 4 * t + 4));
      }
      const I isum = L::add(s0, s1);
#endif
      const F t = L::mul(L::cvt(isum), L::setf(a.d[xi]));
      acc[j] = L::fma(dv, t, acc[j]);
    }
  }
  for (int j = 0; j < MT; ++j) L::store(acc[j], y, n, m0 + j, g);
}

// Groups [g, g + L::kGroups) of a k8 weight times activation rows [m0, m0 + MT): the
// q8 integer dots split into the block's two halves, each scaled by its own f32 scale.
template <class L, int MT>
inline void group_k8(const Weights& w, const Acts& a, const Dims& n, int64_t g, int64_t m0,
                     float* y) {
  using I = typename L::I;
  using F = typename L::F;
  F acc[MT];
  for (int j = 0; j < MT; ++j) acc[j] = L::zerof();
  const int64_t qstride = n.nb * B8, sstride = n.nb * 2 * RG, mstride = n.nb * RG;
  const uint8_t* qg = w.qs + g * qstride;
  const float* sg = w.ks + g * sstride;
  const float* mg = w.km != nullptr ? w.km + g * mstride : nullptr;
  for (int64_t b = 0; b < n.nb; ++b) {
    I wv[8], wabs[8];
    load_codes8<L>(qg + b * B8, qstride, wv, wabs);
    const F s_lo = L::floats(sg + b * 2 * RG, sstride);
    const F s_hi = L::floats(sg + b * 2 * RG + RG, sstride);
    const F mv = mg != nullptr ? L::floats(mg + b * RG, mstride) : L::zerof();
    for (int j = 0; j < MT; ++j) {
      const int64_t row = m0 + j;
      const int8_t* xb = a.q + row * n.K + b * QK;
      const int64_t xi = row * n.nb + b;
#if defined(EMBER_VNNI)
      I lo = L::dot(L::zeroi(), wv[0], L::bcast(xb));
      I hi = L::dot(L::zeroi(), wv[4], L::bcast(xb + 16));
      for (int t = 1; t < 4; ++t) {
        lo = L::dot(lo, wv[t], L::bcast(xb + 4 * t));
        hi = L::dot(hi, wv[4 + t], L::bcast(xb + 16 + 4 * t));
      }
      lo = L::sub(lo, L::seti(128 * a.qlo[xi]));
      hi = L::sub(hi, L::seti(128 * (a.qsum[xi] - a.qlo[xi])));
#else
      I lo = L::zeroi(), hi = L::zeroi();
      for (int t = 0; t < 4; ++t) {
        lo = L::add(lo, dot8_avx2(wabs[t], wv[t], xb + 4 * t));
        hi = L::add(hi, dot8_avx2(wabs[4 + t], wv[4 + t], xb + 16 + 4 * t));
      }
#endif
      F t = L::mul(L::cvt(lo), s_lo);
      t = L::fma(L::cvt(hi), s_hi, t);
      acc[j] = L::fma(t, L::setf(a.d[xi]), acc[j]);
      if (mg != nullptr) acc[j] = L::fma(mv, L::setf(a.s[xi]), acc[j]);
    }
  }
  for (int j = 0; j < MT; ++j) L::store(acc[j], y, n, m0 + j, g);
}

#else  // scalar fallback: same arithmetic, one row at a time

struct Lanes8 {
  static constexpr int64_t kGroups = 1;
};

template <class L, int MT>
inline void group_q4(const Weights& w, const Acts& a, const Dims& n, int64_t g, int64_t m0,
                     float* y) {
  for (int j = 0; j < MT; ++j) {
    const int64_t row = m0 + j;
    float out[RG] = {};
    for (int64_t b = 0; b < n.nb; ++b) {
      const uint8_t* qb = w.qs + (g * n.nb + b) * B4;
      const int8_t* xb = a.q + row * n.K + b * QK;
      const int64_t xi = row * n.nb + b;
      for (int r = 0; r < RG; ++r) {
        int32_t dot = 0;
        for (int u = 0; u < 4; ++u) {
          for (int p = 0; p < 4; ++p) {
            const uint8_t byte = qb[u * 32 + r * 4 + p];
            dot += static_cast<int32_t>(byte & 0x0F) * xb[4 * u + p];
            dot += static_cast<int32_t>(byte >> 4) * xb[16 + 4 * u + p];
          }
        }
        const float t = static_cast<float>(dot) * a.d[xi] + a.c8[xi];
        out[r] += h2f(w.d[(g * n.nb + b) * RG + r]) * t;
        out[r] += h2f(w.m[(g * n.nb + b) * RG + r]) * a.s[xi];
      }
    }
    store_group(y, n, row, g, out);
  }
}

template <class L, int MT>
inline void group_q8(const Weights& w, const Acts& a, const Dims& n, int64_t g, int64_t m0,
                     float* y) {
  for (int j = 0; j < MT; ++j) {
    const int64_t row = m0 + j;
    float out[RG] = {};
    for (int64_t b = 0; b < n.nb; ++b) {
      const int8_t* qb = reinterpret_cast<const int8_t*>(w.qs + (g * n.nb + b) * B8);
      const int8_t* xb = a.q + row * n.K + b * QK;
      const int64_t xi = row * n.nb + b;
      for (int r = 0; r < RG; ++r) {
        int32_t dot = 0;
        for (int t = 0; t < 8; ++t) {
          for (int p = 0; p < 4; ++p) {
            dot += static_cast<int32_t>(qb[t * 32 + r * 4 + p]) * xb[4 * t + p];
          }
        }
        out[r] += h2f(w.d[(g * n.nb + b) * RG + r]) * (static_cast<float>(dot) * a.d[xi]);
      }
    }
    store_group(y, n, row, g, out);
  }
}

template <class L, int MT>
inline void group_k8(const Weights& w, const Acts& a, const Dims& n, int64_t g, int64_t m0,
                     float* y) {
  for (int j = 0; j < MT; ++j) {
    const int64_t row = m0 + j;
    float out[RG] = {};
    for (int64_t b = 0; b < n.nb; ++b) {
      const int8_t* qb = reinterpret_cast<const int8_t*>(w.qs + (g * n.nb + b) * B8);
      const float* sb = w.ks + (g * n.nb + b) * 2 * RG;
      const int8_t* xb = a.q + row * n.K + b * QK;
      const int64_t xi = row * n.nb + b;
      for (int r = 0; r < RG; ++r) {
        int32_t lo = 0, hi = 0;
        for (int t = 0; t < 8; ++t) {
          for (int p = 0; p < 4; ++p) {
            const int32_t v = static_cast<int32_t>(qb[t * 32 + r * 4 + p]) * xb[4 * t + p];
            (t < 4 ? lo : hi) += v;
          }
        }
        const float t = static_cast<float>(lo) * sb[r] + static_cast<float>(hi) * sb[RG + r];
        out[r] += t * a.d[xi];
        if (w.km != nullptr) out[r] += w.km[(g * n.nb + b) * RG + r] * a.s[xi];
      }
    }
    store_group(y, n, row, g, out);
  }
}

#endif

template <int LAYOUT, class L, int MT>
inline void group_tile(const Weights& w, const Acts& a, const Dims& n, int64_t g, int64_t m0,
                       float* y) {
  if constexpr (LAYOUT == kQ4) {
    group_q4<L, MT>(w, a, n, g, m0, y);
  } else if constexpr (LAYOUT == kQ8) {
    group_q8<L, MT>(w, a, n, g, m0, y);
  } else {
    group_k8<L, MT>(w, a, n, g, m0, y);
  }
}

// Groups [g, g + L::kGroups) times every activation row, 4 rows at a time.
template <int LAYOUT, class L>
inline void groups_all_rows(const Weights& w, const Acts& a, const Dims& n, int64_t g,
                            float* y) {
  int64_t mi = 0;
  for (; mi + 4 <= n.M; mi += 4) group_tile<LAYOUT, L, 4>(w, a, n, g, mi, y);
  switch (n.M - mi) {
    case 3: group_tile<LAYOUT, L, 3>(w, a, n, g, mi, y); break;
    case 2: group_tile<LAYOUT, L, 2>(w, a, n, g, mi, y); break;
    case 1: group_tile<LAYOUT, L, 1>(w, a, n, g, mi, y); break;
    default: break;
  }
}

template <int LAYOUT>
void matmul_int(const Weights& w, const Acts& a, const Dims& n, float* y) {
  const int64_t groups = (n.N + RG - 1) / RG;
  // ~32k multiply-adds per task at least, so thread hand-off cost stays small.
  const int64_t work = std::max<int64_t>(1, RG * n.K * n.M);  // multiply-adds per group
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / work);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    int64_t g = g0;
#if defined(EMBER_VNNI512)
    constexpr int64_t pair = Lanes16::kGroups;
    for (; g + pair <= g1; g += pair) groups_all_rows<LAYOUT, Lanes16>(w, a, n, g, y);
#endif
    for (; g < g1; g += Lanes8::kGroups) groups_all_rows<LAYOUT, Lanes8>(w, a, n, g, y);
  });
}

// ----------------------------------------------------------------- dequantization

#if defined(EMBER_AVX2)

// 32 code bytes (8 rows x 4 consecutive elements) -> f32 q * d (+ m), written as
// 4 floats into each of the 8 output rows at column col. Piece k of the vector is
// rows 2k and 2k+1; dk/mk hold those rows' scale/offset in lanes 0-3 / 4-7.
template <bool SIGNED, bool OFFSET>
inline void dequant_vec(__m256i v, const __m256* dk, const __m256* mk, float* out, int64_t K,
                        int64_t col) {
  const __m128i halves[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
  for (int k = 0; k < 4; ++k) {
    const __m128i bytes = (k & 1) ? _mm_srli_si128(halves[k >> 1], 8) : halves[k >> 1];
    const __m256i ints = SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(ints), dk[k]);
    if constexpr (OFFSET) f = _mm256_add_ps(f, mk[k]);
    _mm_storeu_ps(out + (2 * k) * K + col, _mm256_castps256_ps128(f));
    _mm_storeu_ps(out + (2 * k + 1) * K + col, _mm256_extractf128_ps(f, 1));
  }
}

inline void pair_lanes(__m256 v, __m256* out) {
  for (int k = 0; k < 4; ++k) {
    const __m256i idx = _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1,
                                          2 * k + 1, 2 * k + 1);
    out[k] = _mm256_permutevar8x32_ps(v, idx);
  }
}

#endif

// Rows of groups [g0, g1) into out (row 8 * g0 first, rows of K floats); padded rows
// past n_rows are skipped. w = q * d + m with two roundings (no FMA: built with
// -ffp-contract=off), bit-identical to ember.models.quant.dequantize.
void dequant_q4_groups(const Weights& w, int64_t K, int64_t n_rows, int64_t g0, int64_t g1,
                       float* out) {
  const int64_t nb = K / QK;
  for (int64_t g = g0; g < g1; ++g) {
    float* og = out + (g - g0) * RG * K;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = w.qs + (g * nb + b) * B4;
      const uint16_t* db = w.d + (g * nb + b) * RG;
      const uint16_t* mb = w.m + (g * nb + b) * RG;
#if defined(EMBER_AVX2)
      if (g * RG + RG <= n_rows) {
        __m256 dk[4], mk[4];
        pair_lanes(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(db))), dk);
        pair_lanes(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mb))), mk);
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int u = 0; u < 4; ++u) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * u));
          dequant_vec<false, true>(_mm256_and_si256(raw, low), dk, mk, og, K, b * QK + 4 * u);
          dequant_vec<false, true>(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), dk, mk, og, K,
                                   b * QK + 16 + 4 * u);
        }
        continue;
      }
#endif
      for (int64_t r = 0; r < RG && g * RG + r < n_rows; ++r) {
        const float d = h2f(db[r]);
        const float m = h2f(mb[r]);
        float* o = og + r * K + b * QK;
        for (int u = 0; u < 4; ++u) {
          for (int p = 0; p < 4; ++p) {
            const uint8_t byte = qb[u * 32 + r * 4 + p];
            o[4 * u + p] = static_cast<float>(byte & 0x0F) * d + m;
            o[16 + 4 * u + p] = static_cast<float>(byte >> 4) * d + m;
          }
        }
      }
    }
  }
}

void dequant_q8_groups(const Weights& w, int64_t K, int64_t n_rows, int64_t g0, int64_t g1,
                       float* out) {
  const int64_t nb = K / QK;
  for (int64_t g = g0; g < g1; ++g) {
    float* og = out + (g - g0) * RG * K;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = w.qs + (g * nb + b) * B8;
      const uint16_t* db = w.d + (g * nb + b) * RG;
#if defined(EMBER_AVX2)
      if (g * RG + RG <= n_rows) {
        __m256 dk[4];
        pair_lanes(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(db))), dk);
        for (int t = 0; t < 8; ++t) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * t));
          dequant_vec<true, false>(raw, dk, nullptr, og, K, b * QK + 4 * t);
        }
        continue;
      }
#endif
      const int8_t* qsb = reinterpret_cast<const int8_t*>(qb);
      for (int64_t r = 0; r < RG && g * RG + r < n_rows; ++r) {
        const float d = h2f(db[r]);
        float* o = og + r * K + b * QK;
        for (int t = 0; t < 8; ++t) {
          for (int p = 0; p < 4; ++p) {
            o[4 * t + p] = static_cast<float>(qsb[t * 32 + r * 4 + p]) * d;
          }
        }
      }
    }
  }
}

// k8 rows of groups [g0, g1): w = q * s (+ m), two roundings like the reference.
void dequant_k8_groups(const Weights& w, int64_t K, int64_t n_rows, int64_t g0, int64_t g1,
                       float* out) {
  const int64_t nb = K / QK;
  for (int64_t g = g0; g < g1; ++g) {
    float* og = out + (g - g0) * RG * K;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* qb = reinterpret_cast<const int8_t*>(w.qs + (g * nb + b) * B8);
      const float* sb = w.ks + (g * nb + b) * 2 * RG;
      const float* mb = w.km != nullptr ? w.km + (g * nb + b) * RG : nullptr;
      for (int64_t r = 0; r < RG && g * RG + r < n_rows; ++r) {
        float* o = og + r * K + b * QK;
        for (int t = 0; t < 8; ++t) {
          for (int p = 0; p < 4; ++p) {
            float v = static_cast<float>(qb[t * 32 + r * 4 + p]) * sb[(t < 4 ? 0 : RG) + r];
            if (mb != nullptr) v = v + mb[r];
            o[4 * t + p] = v;
          }
        }
      }
    }
  }
}

// --------------------------------------------------------------- entry points

struct Checked {
  Weights w;
  Dims n;
};

// Validate a packed weight (codes [G, nb * bpb], scales [G, nb * 8]) against x [M, K].
// What every packed layout checks: CPU tensors, x float32 [M, K] with K a multiple
// of 32, and the codes' byte count (bpb bytes per group and block). Returns the dims.
Dims check_codes(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                 int64_t n_rows, int64_t bpb) {
  TORCH_CHECK(x.device().is_cpu() && qs.device().is_cpu() && d.device().is_cpu(),
              "quant_matmul: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  const int64_t K = x.size(1), nb = K / QK, G = (n_rows + RG - 1) / RG;
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(qs.is_contiguous() && qs.numel() == G * nb * bpb && qs.element_size() == 1,
              "packed codes must be a contiguous byte tensor of ", G * nb * bpb, " elements for ",
              n_rows, " rows and K = ", K, ", got ", qs.sizes());
  return Dims{x.size(0), n_rows, K, nb};
}

Checked check(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
              const at::Tensor* m, int64_t n_rows, int64_t bpb) {
  const Dims n = check_codes(x, qs, d, n_rows, bpb);
  const int64_t nb = n.nb, G = (n_rows + RG - 1) / RG;
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.numel() == G * nb * RG,
              "packed scales must be contiguous float16 with ", G * nb * RG, " elements");
  Weights w{reinterpret_cast<const uint8_t*>(qs.data_ptr()), half_ptr(d), nullptr};
  if (m != nullptr) {
    TORCH_CHECK(m->device().is_cpu() && m->is_contiguous() && m->scalar_type() == at::kHalf &&
                    m->numel() == d.numel(),
                "packed offsets must be contiguous float16 like the scales");
    w.m = half_ptr(*m);
  }
  return {w, n};
}

int64_t chunk_groups(int64_t K) {
  // ~2 MB of dequantized f32 per chunk: stays in cache between dequant and GEMM.
  return std::max<int64_t>(8, (int64_t{1} << 19) / std::max<int64_t>(K, 1) / RG);
}

// y[:, chunk] = x @ W[chunk]^T over row chunks dequantized to f32.
template <typename Dequant>
at::Tensor matmul_dequant(const at::Tensor& x, const Dims& n, Dequant dequant) {
  at::Tensor y = at::empty({n.M, n.N}, x.options());
  const int64_t G = (n.N + RG - 1) / RG;
  const int64_t cg = std::min(G, chunk_groups(n.K));
  // Reused per calling thread: a fresh multi-MB allocation per call costs page faults.
  static thread_local std::vector<float> storage;
  storage.resize(std::max<size_t>(storage.size(), static_cast<size_t>(cg * RG * n.K)));
  float* bp = storage.data();
  at::Tensor buf = at::from_blob(bp, {cg * RG, n.K}, x.options());
  for (int64_t g0 = 0; g0 < G; g0 += cg) {
    const int64_t g1 = std::min(G, g0 + cg);
    at::parallel_for(g0, g1, 2, [&](int64_t a, int64_t b) {
      dequant(a, b, bp + (a - g0) * RG * n.K);
    });
    const int64_t rows = std::min(n.N, g1 * RG) - g0 * RG;
    y.narrow(1, g0 * RG, rows).copy_(at::mm(x, buf.narrow(0, 0, rows).t()));
  }
  return y;
}

// Rows of groups [g0, g1) of a checked weight of LAYOUT, dequantized to f32.
template <int LAYOUT>
void dequant_groups(const Weights& w, int64_t K, int64_t n_rows, int64_t g0, int64_t g1,
                    float* out) {
  if constexpr (LAYOUT == kQ4) {
    dequant_q4_groups(w, K, n_rows, g0, g1, out);
  } else if constexpr (LAYOUT == kQ8) {
    dequant_q8_groups(w, K, n_rows, g0, g1, out);
  } else {
    dequant_k8_groups(w, K, n_rows, g0, g1, out);
  }
}

// y = x @ W^T for a checked weight of LAYOUT: int8 activations below gemm_min_m rows,
// else f32 GEMM over dequantized row chunks.
template <int LAYOUT>
at::Tensor matmul_checked(const at::Tensor& x, const Checked& c, int64_t gemm_min_m) {
  if (c.n.M == 0 || c.n.N == 0) return at::zeros({c.n.M, c.n.N}, x.options());
  if (c.n.M >= gemm_min_m) {
    return matmul_dequant(x, c.n, [&](int64_t g0, int64_t g1, float* out) {
      dequant_groups<LAYOUT>(c.w, c.n.K, c.n.N, g0, g1, out);
    });
  }
  const QuantX xq = quantize_x(x);
  at::Tensor y = at::empty({c.n.M, c.n.N}, x.options());
  matmul_int<LAYOUT>(c.w, acts_of(xq), c.n, y.data_ptr<float>());
  return y;
}

// A checked weight of LAYOUT as f32 [rows, K].
template <int LAYOUT>
at::Tensor dequantize_checked(const Checked& c) {
  at::Tensor out = at::empty({c.n.N, c.n.K}, at::TensorOptions().dtype(at::kFloat));
  dequant_groups<LAYOUT>(c.w, c.n.K, c.n.N, 0, (c.n.N + RG - 1) / RG, out.data_ptr<float>());
  return out;
}

at::Tensor probe(const at::Tensor& like, int64_t K) {
  return at::empty({0, K}, like.options().dtype(at::kFloat));
}

at::Tensor q4_matmul(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& m, int64_t n_rows, int64_t gemm_min_m) {
  const at::Tensor x = x_in.contiguous();
  return matmul_checked<kQ4>(x, check(x, qs, d, &m, n_rows, B4), gemm_min_m);
}

at::Tensor q8_matmul(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                     int64_t n_rows, int64_t gemm_min_m) {
  const at::Tensor x = x_in.contiguous();
  return matmul_checked<kQ8>(x, check(x, qs, d, nullptr, n_rows, B8), gemm_min_m);
}

at::Tensor q4_dequantize(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                         int64_t n_rows, int64_t K) {
  return dequantize_checked<kQ4>(check(probe(qs, K), qs, d, &m, n_rows, B4));
}

at::Tensor q8_dequantize(const at::Tensor& qs, const at::Tensor& d, int64_t n_rows, int64_t K) {
  return dequantize_checked<kQ8>(check(probe(qs, K), qs, d, nullptr, n_rows, B8));
}

// Validate a packed k8 weight: codes [G, nb * 256], scales f32 [G, nb * 16], offsets
// f32 [G, nb * 8] or empty.
Checked check_k8(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& s,
                 const at::Tensor& m, int64_t n_rows) {
  const Dims n = check_codes(x, qs, s, n_rows, B8);
  const int64_t nb = n.nb, G = (n_rows + RG - 1) / RG;
  TORCH_CHECK(m.device().is_cpu(), "quant_matmul: CPU tensors only");
  TORCH_CHECK(s.is_contiguous() && s.scalar_type() == at::kFloat && s.numel() == G * nb * 2 * RG,
              "k8 scales must be contiguous float32 with ", G * nb * 2 * RG, " elements");
  TORCH_CHECK(m.numel() == 0 || (m.is_contiguous() && m.scalar_type() == at::kFloat &&
                                 m.numel() == G * nb * RG),
              "k8 offsets must be empty or contiguous float32 with ", G * nb * RG, " elements");
  Weights w{reinterpret_cast<const uint8_t*>(qs.data_ptr()), nullptr, nullptr,
            s.data_ptr<float>(), m.numel() ? m.data_ptr<float>() : nullptr};
  return {w, n};
}

at::Tensor k8_matmul(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& s,
                     const at::Tensor& m, int64_t n_rows, int64_t gemm_min_m) {
  const at::Tensor x = x_in.contiguous();
  return matmul_checked<kK8>(x, check_k8(x, qs, s, m, n_rows), gemm_min_m);
}

at::Tensor k8_dequantize(const at::Tensor& qs, const at::Tensor& s, const at::Tensor& m,
                         int64_t n_rows, int64_t K) {
  return dequantize_checked<kK8>(check_k8(probe(qs, K), qs, s, m, n_rows));
}

// ------------------------------------------------------------------- repacking

// Per-row f16 [N, nb] -> grouped [G, nb, 8], zero-padded.
at::Tensor pack_scales(const at::Tensor& s, int64_t G) {
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kHalf, "scales must be float16 [N, K/32]");
  const int64_t N = s.size(0), nb = s.size(1);
  at::Tensor padded = at::zeros({G * RG, nb}, s.options());
  padded.narrow(0, 0, N).copy_(s);
  return padded.view({G, RG, nb}).transpose(1, 2).contiguous().view({G, nb * RG});
}

// GGUF Q4 codes [N, K/2] (per 32-block: byte j = element j | element j+16 << 4), d, m
// [N, K/32] f16 -> (qs [G, nb * 128], d [G, nb * 8], m [G, nb * 8]).
std::vector<at::Tensor> q4_pack(const at::Tensor& codes, const at::Tensor& d,
                                const at::Tensor& m) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte,
              "codes must be uint8 [N, K/2]");
  const int64_t N = codes.size(0), nb = codes.size(1) / 16, G = (N + RG - 1) / RG;
  TORCH_CHECK(codes.size(1) % 16 == 0 && d.size(0) == N && d.size(1) == nb &&
                  m.sizes() == d.sizes(),
              "codes / scales shapes do not match");
  at::Tensor padded = codes.contiguous();  // no copy when the rows fill whole groups
  if (N % RG) {
    padded = at::zeros({G * RG, nb * 16}, codes.options());
    padded.narrow(0, 0, N).copy_(codes);
  }
  // [G, 8 r, nb, 4 u, 4 p] -> [G, nb, 4 u, 8 r, 4 p], moving the 4 p bytes as one int32
  // (a 4x shorter permuted copy than byte by byte)
  at::Tensor qs = padded.view(at::kInt).view({G, RG, nb, 4}).permute({0, 2, 3, 1})
                      .contiguous().view(at::kByte).view({G, nb * B4});
  return {qs, pack_scales(d, G), pack_scales(m, G)};
}

// Q8_0 codes int8 [N, K], d [N, K/32] f16 -> (qs [G, nb * 256], d [G, nb * 8]).
std::vector<at::Tensor> q8_pack(const at::Tensor& codes, const at::Tensor& d) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "codes must be int8 [N, K]");
  const int64_t N = codes.size(0), nb = codes.size(1) / QK, G = (N + RG - 1) / RG;
  TORCH_CHECK(codes.size(1) % QK == 0 && d.size(0) == N && d.size(1) == nb,
              "codes / scales shapes do not match");
  at::Tensor padded = codes.contiguous();  // no copy when the rows fill whole groups
  if (N % RG) {
    padded = at::zeros({G * RG, nb * QK}, codes.options());
    padded.narrow(0, 0, N).copy_(codes);
  }
  // [G, 8 r, nb, 8 t, 4 p] -> [G, nb, 8 t, 8 r, 4 p], the 4 p bytes moved as one int32
  at::Tensor qs = padded.view(at::kInt).view({G, RG, nb, 8}).permute({0, 2, 3, 1})
                      .contiguous().view(at::kChar).view({G, nb * B8});
  return {qs, pack_scales(d, G)};
}

// Per-row f32 [N, C] -> grouped [G, C, 8] (C columns: half-blocks or blocks), zero-padded.
at::Tensor pack_rows_f32(const at::Tensor& s, int64_t G) {
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat, "k8 scales must be float32 [N, C]");
  const int64_t N = s.size(0), C = s.size(1);
  at::Tensor padded = at::zeros({G * RG, C}, s.options());
  padded.narrow(0, 0, N).copy_(s);
  return padded.view({G, RG, C}).transpose(1, 2).contiguous().view({G, C * RG});
}

// k8 from int8 codes [N, K], f32 scales per 16 [N, K/16] and f32 offsets per 32
// [N, K/32] (or an empty tensor) -> (qs [G, nb * 256], s [G, nb * 16], m [G, nb * 8]).
std::vector<at::Tensor> k8_pack(const at::Tensor& codes, const at::Tensor& s,
                                const at::Tensor& m) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "codes must be int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), nb = K / QK, G = (N + RG - 1) / RG;
  TORCH_CHECK(K % QK == 0 && s.dim() == 2 && s.size(0) == N && s.size(1) == 2 * nb,
              "k8 codes / scales shapes do not match");
  TORCH_CHECK(m.numel() == 0 || (m.dim() == 2 && m.size(0) == N && m.size(1) == nb),
              "k8 offsets must be empty or [N, K/32]");
  at::Tensor qs = q8_pack(codes, at::zeros({N, nb}, codes.options().dtype(at::kHalf)))[0];
  return {qs, pack_rows_f32(s.contiguous(), G),
          m.numel() ? pack_rows_f32(m.contiguous(), G) : at::empty({0}, s.options())};
}

std::vector<at::Tensor> quantize_activations(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % QK == 0,
              "x must be float32 [M, K] with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  const QuantX r = quantize_x(x);
  const auto f32 = x.options();
  auto copy = [](const void* src, at::Tensor t) {
    std::memcpy(t.data_ptr(), src, t.nbytes());
    return t;
  };
  return {copy(r.q, at::empty({M, K}, f32.dtype(at::kChar))), copy(r.d, at::empty({M, nb}, f32)),
          copy(r.s, at::empty({M, nb}, f32)), copy(r.c8, at::empty({M, nb}, f32)),
          copy(r.qsum, at::empty({M, nb}, f32.dtype(at::kInt)))};
}

std::string simd() {
#if defined(EMBER_VNNI)
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
  mod.def("q4_matmul", &q4_matmul, "x @ W^T for a packed 4-bit W (qs, d, m, rows, gemm_min_m)",
          release());
  mod.def("q8_matmul", &q8_matmul, "x @ W^T for a packed 8-bit W (qs, d, rows, gemm_min_m)",
          release());
  mod.def("q4_dequantize", &q4_dequantize, "packed 4-bit W -> f32 [rows, K]", release());
  mod.def("q8_dequantize", &q8_dequantize, "packed 8-bit W -> f32 [rows, K]", release());
  mod.def("q4_pack", &q4_pack, "GGUF Q4 codes, d, m -> packed (qs, d, m)", release());
  mod.def("k8_pack", &k8_pack, "int8 codes, f32 scales per 16, f32 offsets per 32 or empty "
          "-> packed (qs, s, m)", release());
  mod.def("k8_matmul", &k8_matmul, "x @ W^T for a packed k8 weight (x, qs, s, m, rows, "
          "gemm_min_m)", release());
  mod.def("k8_dequantize", &k8_dequantize, "a packed k8 weight as f32 [rows, K]", release());
  mod.def("q8_pack", &q8_pack, "GGUF Q8_0 codes, d -> packed (qs, d)", release());
  mod.def("quantize_activations", &quantize_activations,
          "x -> (int8 codes, scales, float block sums, 8 x rounding error, code sums)", release());
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
           "attn_norm, ffn_norm, then qkv, o, gate_up, down as (bits, rows, tensors)")
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
