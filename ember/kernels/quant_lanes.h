// SIMD lane sets for the packed-weight kernels (quant_kernels.h).
//
// Part of the quant_matmul.cpp translation unit (included inside its namespace).
//
// A packed weight interleaves 16 output rows (a "group", quant_layouts.h) so that one
// 64-byte vector holds 4 consecutive codes of each of the 16 rows, 4 bytes per row: a
// dot-product instruction against 4 activation bytes broadcast to every 32-bit lane
// then advances every row of the vector at once, with no horizontal sums. A lane set
// `Lanes` covers Lanes::W of those rows per vector: AVX-512 with VNNI all 16 (one zmm),
// AVX2 and the portable fallback 8, taking a group as Lanes::H = 16 / W halves (the
// half h of a 64-byte vector is its bytes 32h .. 32h + 31).
//
// The kernels are written once over `Lanes`. Every lane does the same operations in the
// same order, so a row's result never depends on which lane, tile or thread computed it
// (the batch invariance of ember/kernels/fused_decoder.h rests on this).
//
//   B  W x 4 bytes of codes        I  W int32 lanes        F  W float lanes
//
// `dot(acc, w, x)` adds to each lane the dot product of its 4 code bytes (unsigned,
// < 128 unless said otherwise) with the 4 signed activation bytes at x. `dot2` does two
// of them (codes of at most 6 bits: AVX2 then sums the pair in int16 before widening,
// 2 * 2 * 63 * 127 < 2^15). Signed 8-bit codes go through `s8_prep` + `dot_s8`; with
// VNNI they are biased to unsigned (w + 128), which the caller takes back as
// kS8Bias * sum(x).

// 4 activation bytes as one int32 (any alignment; read through a may_alias type, so a
// compiler can fold the load into an instruction's broadcast operand)
typedef int32_t ember_i32u __attribute__((aligned(1), may_alias));

inline int32_t load_i32(const int8_t* x) { return *reinterpret_cast<const ember_i32u*>(x); }

// MXFP4's scale from its E8M0 byte, halved (as ggml and gguf-py): 2^(e - 128), the
// subnormals 2^-128 and 2^-127 for e < 2.
inline float e8m0_half_f32(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(EMBER_VNNI512)

struct Lanes {
  // activation rows per tile: legacy types, and K-quants (three sums per row)
  static constexpr int W = 16, H = 1, kMaxTile = 8, kMaxTileK = 4, kMaxTileSum16 = 4;
  static constexpr int32_t kS8Bias = 128;
  // whether run_groups asks for the next row group while computing one (quant_kernels.h)
  static constexpr bool kPrefetchGroups = true;
  using B = __m512i;
  using I = __m512i;
  using F = __m512;

  static B load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void store_b(B v, uint8_t* p) { _mm512_storeu_si512(p, v); }
  static B set8(uint8_t v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static B and_(B a, B b) { return _mm512_and_si512(a, b); }
  static B or_(B a, B b) { return _mm512_or_si512(a, b); }
  // per byte: (v >> N) & mask and (v << N) & mask (16-bit shifts; the mask drops the
  // bits that crossed from the neighbouring byte)
  template <int N> static B shr(B v, uint8_t mask) {
    return and_(_mm512_srli_epi16(v, N), set8(mask));
  }
  // the high nibble of every byte: one GF(2) affine instruction (bit i of the result is
  // bit i + 4 of the byte) where the CPU has GFNI, else a shift and a mask
  static B high_nibbles(B v) {
#if defined(__GFNI__)
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
    return shr<4>(v, 0x0F);
#endif
  }
  template <int N> static B shl(B v, uint8_t mask) {
    return and_(_mm512_slli_epi16(v, N), set8(mask));
  }
  // byte i |= value where bit i of the W * 4 bits at `bits` is set
  static B or_bits(B v, const uint8_t* bits, uint8_t value) {
    uint64_t m;
    std::memcpy(&m, bits, 8);
    return or_(v, _mm512_maskz_mov_epi8(_cvtu64_mask64(m), set8(value)));
  }
  static I bcast(const int8_t* x) { return _mm512_set1_epi32(load_i32(x)); }
  static I zero() { return _mm512_setzero_si512(); }
  // the 4 activation bytes as the instruction's broadcast memory operand: one
  // instruction, not a broadcast load and a dot (compilers do not fold set1 into it),
  // so the core's window holds more weight bytes in flight
  static I dot(I acc, B w, const int8_t* x) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const ember_i32u*>(x)));
    return acc;
  }
  static I dot2(I acc, B w0, const int8_t* x0, B w1, const int8_t* x1) {
    return dot(dot(acc, w0, x0), w1, x1);
  }
  static B s8_prep(B w) { return _mm512_xor_si512(w, set8(0x80)); }
  // every byte (< 16) replaced by table[byte]
  static B lut16(B v, const int8_t* table) {
    return _mm512_shuffle_epi8(
        _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table))), v);
  }
  static I dot_s8(I acc, B w, const int8_t* x) { return dot(acc, w, x); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I seti(int32_t v) { return _mm512_set1_epi32(v); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I u8i(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I i8i(const int8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }   // a b + c
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
  static F halves(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F u8f(const uint8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F i8f(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(F v, float* p) { _mm512_storeu_ps(p, v); }
  // MXFP4's halved E8M0 scales 2^(e - 128) of W bytes, exact (subnormals included)
  static F e8m0_half(const uint8_t* p) {
    return _mm512_scalef_ps(_mm512_set1_ps(1.0f),
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(u8i(p), seti(128))));
  }
};

#elif defined(EMBER_AVX2)

#if !defined(__AVXVNNI__)
#define EMBER_SUM16 1  // Lanes has the int16 block sums of tile_kmin_wide / tile_q6k_sum16
#endif

struct Lanes {
  // kMaxTileK: with AVX-VNNI a dot is one instruction and tile_kquant takes four rows
  // (the Xeon VM's avx2vnni build: 0.86-0.92x the time of two-row tiles in 1B Q4_K_M /
  // Q5_K_M / Q6_K prefills, some accumulators on the stack); plain AVX2 takes 4+ rows
  // in its int16-sum tiles instead
#if defined(__AVXVNNI__)
  static constexpr int W = 8, H = 2, kMaxTile = 4, kMaxTileK = 4;
#else
  static constexpr int W = 8, H = 2, kMaxTile = 4, kMaxTileK = 2;
#endif
#if defined(EMBER_SUM16)
  // rows of Q6_K's int16-sum tile: with one accumulator per row in its code loop, six
  // took 0.90x the time of four in a 1B Q6_K prefill (the Xeon VM's AVX2 build); eight
  // spilled more (0.96x)
  static constexpr int kMaxTileSum16 = 6;
#else
  static constexpr int kMaxTileSum16 = kMaxTileK;
#endif
  // Not here: on a Zen 3 (AVX2 only, 32 KiB L1) the fused layers of the 1B synth files
  // took 0.90x (Q4_K_M) and 0.88x (Q4_0) the time at one row without it, the hardware
  // prefetchers alone (scripts/kernel_ab.py, 9 alternations); the Xeon VM's avx2vnni
  // build took 1.05x the time with it at one row (1B Q4_K_M).
  static constexpr bool kPrefetchGroups = false;
#if defined(__AVXVNNI__)
  static constexpr int32_t kS8Bias = 128;
#else
  static constexpr int32_t kS8Bias = 0;
#endif
  using B = __m256i;
  using I = __m256i;
  using F = __m256;

  static B load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const B*>(p)); }
  static void store_b(B v, uint8_t* p) { _mm256_storeu_si256(reinterpret_cast<B*>(p), v); }
  static B set8(uint8_t v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static B and_(B a, B b) { return _mm256_and_si256(a, b); }
  static B or_(B a, B b) { return _mm256_or_si256(a, b); }
  template <int N> static B shr(B v, uint8_t mask) {
    return and_(_mm256_srli_epi16(v, N), set8(mask));
  }
  static B high_nibbles(B v) { return shr<4>(v, 0x0F); }
  static B lut16(B v, const int8_t* table) {
    return _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(table))), v);
  }
  template <int N> static B shl(B v, uint8_t mask) {
    return and_(_mm256_slli_epi16(v, N), set8(mask));
  }
  static B or_bits(B v, const uint8_t* bits, uint8_t value) {
    int32_t m;
    std::memcpy(&m, bits, 4);
    // byte i takes mask byte i / 8 (the broadcast word sits in both 128-bit lanes),
    // then keeps bit i % 8
    const B spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(m), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                               2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const B bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    const B set = _mm256_cmpeq_epi8(and_(spread, bit), bit);
    return or_(v, and_(set, set8(value)));
  }
  static I bcast(const int8_t* x) { return _mm256_set1_epi32(load_i32(x)); }
  static I zero() { return _mm256_setzero_si256(); }
#if defined(__AVXVNNI__)
  static I dot(I acc, B w, const int8_t* x) { return _mm256_dpbusd_avx_epi32(acc, w, bcast(x)); }
  static I dot2(I acc, B w0, const int8_t* x0, B w1, const int8_t* x1) {
    return dot(dot(acc, w0, x0), w1, x1);
  }
  static B s8_prep(B w) { return _mm256_xor_si256(w, set8(0x80)); }
  static I dot_s8(I acc, B w, const int8_t* x) { return dot(acc, w, x); }
#else
  static I widen(B pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
  static I dot(I acc, B w, const int8_t* x) {
    return _mm256_add_epi32(acc, widen(_mm256_maddubs_epi16(w, bcast(x))));
  }
  static I dot2(I acc, B w0, const int8_t* x0, B w1, const int8_t* x1) {
    const B p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast(x0)),
                                 _mm256_maddubs_epi16(w1, bcast(x1)));
    return _mm256_add_epi32(acc, widen(p));
  }
  static B s8_prep(B w) { return w; }
  // Without VNNI a widening to int32 is a vpmaddwd either way, so it may as well
  // multiply by a scale (tile_q6k_sum16 in quant_kernels.h).
  // int16 lanes: the pair sums of w0 . x0 plus those of w1 . x1 (codes < 64)
  static B pairs16(B w0, const int8_t* x0, B w1, const int8_t* x1) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast(x0)),
                            _mm256_maddubs_epi16(w1, bcast(x1)));
  }
  static B add16(B a, B b) { return _mm256_add_epi16(a, b); }
  // v as it is, opaque to the compiler (an empty asm that may change it)
  static B opaque(B v) {
    __asm__("" : "+x"(v));
    return v;
  }
  // each lane's two int16 sums times its int16 factor pair, added: int32 lanes
  static I widen_by(B sums, B factors) { return _mm256_madd_epi16(sums, factors); }
  // the W signed bytes at p, each as both int16 halves of its lane
  static B i8_twice16(const int8_t* p) {
    const I v = i8i(p);
    return _mm256_or_si256(_mm256_and_si256(v, seti(0xFFFF)), _mm256_slli_epi32(v, 16));
  }
  // lane r: signed bytes p0[r] and p1[r] as its two int16 halves
  static B i8_pairs16(const int8_t* p0, const int8_t* p1) {
    return _mm256_cvtepi8_epi16(
        _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)),
                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1))));
  }
  // every lane: v0 and v1 (|v| < 2^15) as its two int16 halves
  static B set_pair16(int32_t v0, int32_t v1) {
    return _mm256_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(v1) << 16) |
                                                  (static_cast<uint32_t>(v0) & 0xFFFF)));
  }
  // |w| x (x with w's sign): a u8 x s8 product that maddubs takes; pairs reach
  // 2 * 128 * 127 < 2^15, so each is widened on its own
  static I dot_s8(I acc, B w, const int8_t* x) {
    const B p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(bcast(x), w));
    return _mm256_add_epi32(acc, widen(p));
  }
#endif
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I seti(int32_t v) { return _mm256_set1_epi32(v); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I u8i(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I i8i(const int8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }

  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F halves(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F u8f(const uint8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F i8f(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(F v, float* p) { _mm256_storeu_ps(p, v); }
  // MXFP4's halved E8M0 scales: exponent field e - 1, or 0x00200000 << e below e = 2
  static F e8m0_half(const uint8_t* p) {
    const I e = u8i(p);
    const I normal = _mm256_slli_epi32(_mm256_sub_epi32(e, seti(1)), 23);
    const I tiny = _mm256_sllv_epi32(seti(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(seti(2), e)));
  }
};

#else  // portable: the same arithmetic on plain arrays (the compiler vectorizes what it can)

struct Lanes {
  static constexpr int W = 8, H = 2, kMaxTile = 4, kMaxTileK = 4, kMaxTileSum16 = 4;
  static constexpr int32_t kS8Bias = 0;
  static constexpr bool kPrefetchGroups = true;
  struct B { uint8_t v[32]; };
  struct I { int32_t v[8]; };
  struct F { float v[8]; };

  static B load(const uint8_t* p) {
    B r;
    std::memcpy(r.v, p, 32);
    return r;
  }
  static void store_b(B v, uint8_t* p) { std::memcpy(p, v.v, 32); }
  static B set8(uint8_t x) {
    B r;
    std::memset(r.v, x, 32);
    return r;
  }
  static B and_(B a, B b) {
    for (int i = 0; i < 32; ++i) a.v[i] &= b.v[i];
    return a;
  }
  static B or_(B a, B b) {
    for (int i = 0; i < 32; ++i) a.v[i] |= b.v[i];
    return a;
  }
  template <int N> static B shr(B a, uint8_t mask) {
    for (int i = 0; i < 32; ++i) a.v[i] = static_cast<uint8_t>(a.v[i] >> N) & mask;
    return a;
  }
  template <int N> static B shl(B a, uint8_t mask) {
    for (int i = 0; i < 32; ++i) a.v[i] = static_cast<uint8_t>(a.v[i] << N) & mask;
    return a;
  }
  static B high_nibbles(B v) { return shr<4>(v, 0x0F); }
  static B lut16(B v, const int8_t* table) {
    for (int i = 0; i < 32; ++i) v.v[i] = static_cast<uint8_t>(table[v.v[i]]);
    return v;
  }
  static B or_bits(B a, const uint8_t* bits, uint8_t value) {
    for (int i = 0; i < 32; ++i) {
      if ((bits[i / 8] >> (i % 8)) & 1) a.v[i] |= value;
    }
    return a;
  }
  static I zero() { return I{}; }
  static I dot(I acc, B w, const int8_t* x) {
    for (int l = 0; l < 8; ++l) {
      for (int p = 0; p < 4; ++p) acc.v[l] += static_cast<int32_t>(w.v[4 * l + p]) * x[p];
    }
    return acc;
  }
  static I dot2(I acc, B w0, const int8_t* x0, B w1, const int8_t* x1) {
    return dot(dot(acc, w0, x0), w1, x1);
  }
  static B s8_prep(B w) { return w; }
  static I dot_s8(I acc, B w, const int8_t* x) {
    for (int l = 0; l < 8; ++l) {
      for (int p = 0; p < 4; ++p) {
        acc.v[l] += static_cast<int32_t>(static_cast<int8_t>(w.v[4 * l + p])) * x[p];
      }
    }
    return acc;
  }
  static I add(I a, I b) {
    for (int l = 0; l < 8; ++l) a.v[l] += b.v[l];
    return a;
  }
  static I sub(I a, I b) {
    for (int l = 0; l < 8; ++l) a.v[l] -= b.v[l];
    return a;
  }
  static I seti(int32_t x) {
    I r;
    for (int l = 0; l < 8; ++l) r.v[l] = x;
    return r;
  }
  static I mullo(I a, I b) {
    for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l];
    return a;
  }
  static I u8i(const uint8_t* p) {
    I r;
    for (int l = 0; l < 8; ++l) r.v[l] = p[l];
    return r;
  }
  static I i8i(const int8_t* p) {
    I r;
    for (int l = 0; l < 8; ++l) r.v[l] = p[l];
    return r;
  }

  static F cvt(I a) {
    F r;
    for (int l = 0; l < 8; ++l) r.v[l] = static_cast<float>(a.v[l]);
    return r;
  }
  static F set1(float x) {
    F r;
    for (int l = 0; l < 8; ++l) r.v[l] = x;
    return r;
  }
  static F zerof() { return F{}; }
  static F mul(F a, F b) {
    for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l];
    return a;
  }
  static F fma(F a, F b, F c) {
    for (int l = 0; l < 8; ++l) c.v[l] += a.v[l] * b.v[l];
    return c;
  }
  static F fnma(F a, F b, F c) {
    for (int l = 0; l < 8; ++l) c.v[l] -= a.v[l] * b.v[l];
    return c;
  }
  static F halves(const uint16_t* p) {
    F r;
    for (int l = 0; l < 8; ++l) r.v[l] = h2f(p[l]);
    return r;
  }
  static F u8f(const uint8_t* p) {
    F r;
    for (int l = 0; l < 8; ++l) r.v[l] = static_cast<float>(p[l]);
    return r;
  }
  static F i8f(const int8_t* p) {
    F r;
    for (int l = 0; l < 8; ++l) r.v[l] = static_cast<float>(p[l]);
    return r;
  }
  static void store(F a, float* p) { std::memcpy(p, a.v, sizeof a.v); }
  static F e8m0_half(const uint8_t* p) {
    F r;
    for (int l = 0; l < 8; ++l) r.v[l] = e8m0_half_f32(p[l]);
    return r;
  }
};

#endif
