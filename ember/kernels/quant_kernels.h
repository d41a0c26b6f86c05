// y = x @ W^T for a packed weight (quant_layouts.h), with int8 activations.
//
// Part of the quant_matmul.cpp translation unit (included inside its namespace).
//
// Activations are quantized to int8 (d = max|x| / 127, codes round(x / d), half to
// even), as llama.cpp does, at the granularity of the weights' scales:
//
//   per 32 (its Q8_0) for the legacy types, whose scale changes every 32 weights:
//     per block the kernel takes exact integer dots of the weight codes with the
//     activation codes and applies the block's scales in float:
//       symmetric codes (Q4_0, Q5_0, Q8_0): the centre is subtracted exactly in
//         integers, sum (q - z) x_q = sum q x_q - z sum x_q, then scaled by d d_x;
//       codes with an offset (Q4_1, Q5_1): sum (q d + m) x = d sum (q - z) x
//         + (d z + m) sum x, the second term with the exact float block sum, so only
//         the centred codes meet the activation rounding error (half of raw codes').
//   per 256 (its Q8_K) for the K-quants, whose sub-block scales are small integers
//     under one f16 per 256: the sub-blocks' integer dots are multiplied by their
//     integer scales and summed in int32, the minimums' term likewise from the
//     activation code sums per 16, and one float step per 256 applies d d_x (and
//     dmin d_x). A third of the instructions of a float step per 32, which at one
//     activation row decides how many weight bytes a core keeps in flight. The result
//     is exactly sum w x-hat, x-hat the quantized activations.
//
// Each (row, 16 weight rows) is one fixed sequence of operations whatever the number of
// rows, the tile and the thread split, so results are batch-invariant.
//
// Threads: the output rows' groups are split over the threads in contiguous ranges of
// equal bytes (one stream of weights per thread); large batches are walked in chunks
// of rows whose quantized activations stay in cache.

// Quantized activations; the arrays live in a per-thread scratch buffer reused across
// calls (no allocation on the decode path), valid until the next call on that thread.
struct QuantX {
  int8_t* q;      // [M, K] codes
  float* d;       // [M, nb] scales
  float* s;       // [M, nb] exact float block sums
  float* c;       // [M, nb] s - d * sum(q): the block's rounding error
  int32_t* qsum;  // [M, nb] sum(q)
  int32_t* qlo;   // [M, nb] sum of the first 16 of q
};


// One row of K floats.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, float* c,
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
    c[b] = s[b] - d[b] * static_cast<float>(qsum[b]);
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
      quantize_row(xp + m * K, K, r.q + m * K, r.d + m * nb, r.s + m * nb, r.c + m * nb,
                   r.qsum + m * nb, r.qlo + m * nb);
    }
  });
  return r;
}

// Activations quantized per 256 (K-quant weights); scratch as for QuantX.
struct QuantK {
  int8_t* q;       // [M, K] codes
  float* d;        // [M, K / 256] scales
  int32_t* bsum;   // [M, K / 16] sums of 16 codes
};

// 256 floats -> codes, scale, code sums per 16.
void quantize_superblock(const float* x, int8_t* q, float* d, int32_t* bsum) {
  float mx = 0.0f;
  for (int i = 0; i < 256; ++i) mx = std::max(mx, std::fabs(x[i]));
  *d = mx / 127.f;
  const float id = mx != 0.0f ? 127.f / mx : 0.0f;
  for (int k = 0; k < 16; ++k) {
    int32_t total = 0;
#if defined(EMBER_AVX2)
    // round to nearest even (the default MXCSR mode), like nearbyint below
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * k),
                                                        _mm256_set1_ps(id)));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * k + 8),
                                                        _mm256_set1_ps(id)));
    alignas(32) int32_t v[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(v), i0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(v + 8), i1);
    for (int i = 0; i < 16; ++i) {
      q[16 * k + i] = static_cast<int8_t>(v[i]);
      total += v[i];
    }
#else
    for (int i = 0; i < 16; ++i) {
      q[16 * k + i] = static_cast<int8_t>(std::nearbyint(x[16 * k + i] * id));
      total += q[16 * k + i];
    }
#endif
    bsum[k] = total;
  }
}

QuantK quantize_rows_k(const float* xp, int64_t M, int64_t K) {
  const int64_t nsb = K / 256;
  static thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>(M * nsb + 16 * M * nsb + (M * K + 3) / 4);
  if (scratch.size() < need) scratch.resize(need);
  float* base = scratch.data();
  QuantK r{reinterpret_cast<int8_t*>(base + 17 * M * nsb), base,
           reinterpret_cast<int32_t*>(base + M * nsb)};
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < nsb; ++b) {
        quantize_superblock(xp + m * K + 256 * b, r.q + m * K + 256 * b, r.d + m * nsb + b,
                            r.bsum + (m * nsb + b) * 16);
      }
    }
  });
  return r;
}

// The activations a matmul's segments need: per 32 for legacy types, per 256 for
// K-quants (a fused layer may need both).
struct Acts {
  QuantX b32{};
  QuantK b256{};
};

// ---------------------------------------------------------------------- the kernels

// Where a tile writes: W outputs of each activation row, rows n0 .. n0 + W of the output.
struct Out {
  float* y;      // [M, ldy]
  int64_t ldy;   // row stride of y
  int64_t n0;    // first output column of the W lanes
  int64_t valid; // how many of the W lanes are real rows (the rest are padding)
};

inline void store_lanes(Lanes::F v, const Out& o, int64_t m) {
  float* dst = o.y + m * o.ldy + o.n0;
  if (o.valid == Lanes::W) {
    Lanes::store(v, dst);
  } else {
    alignas(64) float tmp[Lanes::W];
    Lanes::store(v, tmp);
    std::memcpy(dst, tmp, sizeof(float) * o.valid);
  }
}

// Q4_K/Q5_K: a super-block's 16 rows x 12 bytes of six-bit scales and mins (byte b of row
// r at 16 b + r) as bytes sc[16 j + r], mn[16 j + r] of sub-block j. Bytes 0-3 of the
// rows hold scales 0-3 (and the top bits of 4-7), bytes 4-7 mins 0-3 (and top bits),
// bytes 8-11 the low nibbles of scales and mins 4-7; whole vectors of them at a time
// (the 16-bit shifts' bits from the neighbouring byte are masked off).
inline void decode_kscales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  using L = Lanes;
  constexpr int V = static_cast<int>(sizeof(L::B));
  for (int o = 0; o < 64; o += V) {
    const L::B a = L::load(s + o), b = L::load(s + 64 + o), c = L::load(s + 128 + o);
    L::store_b(L::and_(a, L::set8(0x3F)), sc + o);
    L::store_b(L::and_(b, L::set8(0x3F)), mn + o);
    L::store_b(L::or_(L::and_(c, L::set8(0x0F)), L::template shr<2>(a, 0x30)), sc + 64 + o);
    L::store_b(L::or_(L::template shr<4>(c, 0x0F), L::template shr<2>(b, 0x30)), mn + 64 + o);
  }
}

template <int T>
struct Kind {
  static constexpr bool kHi1 = T == kQ5_0 || T == kQ5_1 || T == kQ5_K;
  static constexpr bool kHi2 = T == kQ6_K;
  static constexpr bool kKQuant = T == kQ3_K || T == kQ4_K || T == kQ5_K || T == kQ6_K;
  static constexpr bool kOffset = T == kQ4_1 || T == kQ5_1 || T == kQ4_K || T == kQ5_K;
  static constexpr int kSub = kKQuant ? 8 : 1;  // 32-element blocks per super-block
  // two integer sums per block and row (Q6_K's and Q3_K's signed scales are per 16,
  // their codes centred, no minimums) or one
  static constexpr bool kHalves = T == kQ6_K || T == kQ3_K;
  static constexpr int32_t kKCentre = T == kQ3_K ? 4 : 32;  // (kHalves K-quants)
  // the code a legacy block's codes are measured from (integers: exact; floats: above)
  static constexpr int32_t kCentre = (T == kQ4_0 || T == kQ4_1) ? 8 : 16;
  // where widening costs a multiply (EMBER_SUM16): K-quants with an int16-sum tile per
  // half of a group, and those with one over both halves (kWideTile rows)
  static constexpr bool kSum16 = T == kQ6_K;
  static constexpr bool kWide = T == kQ4_K || T == kQ5_K;
  static constexpr int kWideTile = 4;
  // whether the tiles of a pass read the group's codes unpacked once (unpack_group)
  // instead of unpacking them in every tile: Q5_K's fifth bits cost as much as four
  // rows' dot products. Q4_K's nibbles take two instructions; its codes read from the
  // buffer took 0.97-1.02x the time of Q4_K_M prefills on the Xeon VM's AVX2 build and
  // 1.06x on its AVX-512 VNNI build.
  static constexpr bool kUnpackOnce = T == kQ5_K;
  // activation rows per tile: what fits the registers
  static constexpr int kTile =
      kSum16 ? Lanes::kMaxTileSum16 : kKQuant ? Lanes::kMaxTileK : Lanes::kMaxTile;
};

// The low- and high-nibble code vectors of code vector u of one 32-element block of a
// nibble-coded type (not Q3_K): codes at cj, high bits (Q5_*: masks; Q6_K: 2-bit
// fields) at hj.
template <int T>
inline void unpack_one(const uint8_t* cj, const uint8_t* hj, int u, int h, Lanes::B* lo,
                       Lanes::B* hi) {
  using L = Lanes;
  using KT = Kind<T>;
  const L::B r = L::load(cj + SUBV * u);
  *lo = L::and_(r, L::set8(0x0F));
  *hi = L::high_nibbles(r);
  if constexpr (KT::kHi1) {
    const uint8_t* mb = hj + L::W / 2 * h;
    *lo = L::or_bits(*lo, mb + 8 * (2 * u), 0x10);
    *hi = L::or_bits(*hi, mb + 8 * (2 * u + 1), 0x10);
  }
  if constexpr (KT::kHi2) {  // one vector of 2-bit fields serves code vectors 2i, 2i + 1
    const L::B hv = L::load(hj + SUBV * (u / 2) + 4 * L::W * h);
    if (u % 2 == 0) {
      *lo = L::or_(*lo, L::template shl<4>(hv, 0x30));
      *hi = L::or_(*hi, L::template shl<2>(hv, 0x30));
    } else {
      *lo = L::or_(*lo, L::and_(hv, L::set8(0x30)));
      *hi = L::or_(*hi, L::template shr<2>(hv, 0x30));
    }
  }
}

// The same for code vectors u and u + 1 (u even), and for Q3_K.
template <int T>
inline void unpack_pair(const uint8_t* cj, const uint8_t* hj, int u, int h, Lanes::B* lo0,
                        Lanes::B* hi0, Lanes::B* lo1, Lanes::B* hi1) {
  using L = Lanes;
  if constexpr (T == kQ3_K) {  // bits 0-1 from the hi2-laid codes, bit 2 from masks
    const L::B v = L::load(cj + SUBV * (u / 2));
    const uint8_t* mb = hj + L::W / 2 * h;
    *lo0 = L::or_bits(L::and_(v, L::set8(0x03)), mb + 8 * (2 * u), 0x04);
    *hi0 = L::or_bits(L::template shr<2>(v, 0x03), mb + 8 * (2 * u + 1), 0x04);
    *lo1 = L::or_bits(L::template shr<4>(v, 0x03), mb + 8 * (2 * u + 2), 0x04);
    *hi1 = L::or_bits(L::template shr<6>(v, 0x03), mb + 8 * (2 * u + 3), 0x04);
  } else {
    unpack_one<T>(cj, hj, u, h, lo0, hi0);
    unpack_one<T>(cj, hj, u + 1, h, lo1, hi1);
  }
}

// The codes of a whole group (its 16 rows x K), unpacked once per pass over the group's
// activation rows into a per-thread buffer, one byte a code: each code vector is what
// unpack_one gives, at code_vector() (16 x K bytes: 128 KiB at K = 8192). For Q5_K,
// unpacking a code vector (its nibbles, and fifth bits spread from mask bytes) costs
// about as many instructions as four activation rows' dot products with it; a tile
// unpacking its own codes paid that once per tile, a pass of 16-80 rows pays it once.
// Which types read their codes from here: Kind::kUnpackOnce.
constexpr int64_t kUnpackRows = 32;  // without EMBER_SUM16: see run_groups

inline int64_t code_vector(int64_t sb, int j, int u, int h, int hi) {
  return ((((sb * 8 + j) * 4 + u) * Lanes::H + h) * 2 + hi) *
         static_cast<int64_t>(sizeof(Lanes::B));
}

template <int T>
inline const uint8_t* unpack_group(const Geom& g, const uint8_t* grp) {
  using L = Lanes;
  thread_local std::vector<uint8_t> buf;
  buf.resize(static_cast<size_t>(g.nsb) * 4096);
  uint8_t* out = buf.data();
  for (int64_t sb = 0; sb < g.nsb; ++sb) {
    const uint8_t* hb = grp + g.at(kHi, sb);
    for (int j = 0; j < 8; ++j) {
      for (int h = 0; h < L::H; ++h) {
        const uint8_t* cj = grp + g.at(kCodes, sb) + 4 * L::W * h + 256 * j;
        for (int u = 0; u < 4; ++u) {
          L::B lo, hi;
          unpack_one<T>(cj, hb + 64 * j, u, h, &lo, &hi);
          L::store_b(lo, out + code_vector(sb, j, u, h, 0));
          L::store_b(hi, out + code_vector(sb, j, u, h, 1));
        }
      }
    }
  }
  return out;
}

// Exact integer dots of one 32-element block of codes (cj, hj) with activation rows
// m0 .. m0 + MT (codes at q + row * K + x0): lo[m] over elements 0-15 and hi[m] over
// 16-31 (kHalves), else all 32 in lo[m]. Dot call c (u = 0 low, u = 0 high, u = 2 low,
// u = 2 high nibbles) adds into partial c % P; with few rows several partials keep the
// dot-product chains short, so the core overlaps more blocks (and keeps more weight
// bytes in flight from memory). kHalves keeps even and odd calls apart.
template <int T, int MT, bool kUnpacked = false>
inline void block_dots(const uint8_t* cj, const uint8_t* hj, int h, const int8_t* q, int64_t K,
                       int64_t m0, int64_t x0, Lanes::I* lo, Lanes::I* hi,
                       const uint8_t* unpacked = nullptr) {
  using L = Lanes;
  constexpr bool kHalves = Kind<T>::kHalves;
  constexpr int P = kHalves ? (MT == 1 ? 4 : 2) : (MT == 1 ? 4 : MT == 2 ? 2 : 1);
  L::I part[MT][P];
  for (int m = 0; m < MT; ++m) {
    for (int p = 0; p < P; ++p) part[m][p] = L::zero();
  }
  for (int u = 0; u < 4; u += 2) {
    L::B lo0, hi0, lo1, hi1;
    if constexpr (kUnpacked) {  // the block's vectors from unpack_group: code_vector's
      // offsets, written out (calling it read 1.06x and 1.17x the time of a Q5_K_M prefill
      // in two A/Bs on the Xeon VM)
      constexpr int64_t V = sizeof(L::B);
      lo0 = L::load(unpacked + ((u * L::H + h) * 2) * V);
      hi0 = L::load(unpacked + ((u * L::H + h) * 2 + 1) * V);
      lo1 = L::load(unpacked + (((u + 1) * L::H + h) * 2) * V);
      hi1 = L::load(unpacked + (((u + 1) * L::H + h) * 2 + 1) * V);
    } else {
      unpack_pair<T>(cj, hj, u, h, &lo0, &hi0, &lo1, &hi1);
    }
    for (int m = 0; m < MT; ++m) {
      const int8_t* x = q + (m0 + m) * K + x0 + 4 * u;
      part[m][u % P] = L::dot2(part[m][u % P], lo0, x, lo1, x + 4);
      part[m][(u + 1) % P] = L::dot2(part[m][(u + 1) % P], hi0, x + 16, hi1, x + 20);
    }
  }
  for (int m = 0; m < MT; ++m) {
    lo[m] = part[m][0];
    if constexpr (kHalves) {
      hi[m] = part[m][1];
      if constexpr (P == 4) {
        lo[m] = L::add(lo[m], part[m][2]);
        hi[m] = L::add(hi[m], part[m][3]);
      }
    } else {
      if constexpr (P >= 2) lo[m] = L::add(lo[m], part[m][1]);
      if constexpr (P == 4) lo[m] = L::add(lo[m], L::add(part[m][2], part[m][3]));
    }
  }
}

// Activation rows [m0, m0 + MT) times half h (rows W h .. W h + W) of one group of a
// legacy nibble-coded weight (Q4_0, Q4_1, Q5_0, Q5_1): per-32 activations.
template <int T, int MT>
inline void tile_legacy(const Geom& g, const uint8_t* grp, int h, const QuantX& a,
                        int64_t K, int64_t m0, const Out& out) {
  using L = Lanes;
  using F = L::F;
  using KT = Kind<T>;
  const int64_t nb = K / QK;
  F acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = L::zerof();
  for (int64_t b = 0; b < g.nsb; ++b) {
    const uint8_t* cb = grp + g.at(kCodes, b) + 4 * L::W * h;
    const uint8_t* hb = grp + g.at(kHi, b);
    const uint16_t* hv =
        reinterpret_cast<const uint16_t*>(grp + g.at(kScales, b)) +
        L::W * h;
    const F dv = L::halves(hv);
    L::I isum[MT], unused[MT];
    block_dots<T, MT>(cb, hb, h, a.q, K, m0, b * QK, isum, unused);
    for (int m = 0; m < MT; ++m) {
      const int64_t xi = (m0 + m) * nb + b;
      const F dx = L::set1(a.d[xi]);
      if constexpr (KT::kOffset) {
        const F mv = L::halves(hv + RG);
        const F t = L::fma(L::cvt(isum[m]), dx,
                           L::set1(static_cast<float>(KT::kCentre) * a.c[xi]));
        acc[m] = L::fma(dv, t, acc[m]);
        acc[m] = L::fma(mv, L::set1(a.s[xi]), acc[m]);  // plus m sum(x)
      } else {
        const L::I centred = L::sub(isum[m], L::seti(KT::kCentre * a.qsum[xi]));
        acc[m] = L::fma(dv, L::mul(L::cvt(centred), dx), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) store_lanes(acc[m], out, m0 + m);
}

// Signed 8-bit code blocks (Q8_0, IQ4_*) sum their dots in this many partials per
// activation row: short dependency chains when the rows are few (as in block_dots).
constexpr int s8_partials(int MT) { return MT == 1 ? 4 : MT == 2 ? 2 : 1; }

// One block of signed 8-bit codes into a row's accumulator: its P partial dots summed
// in a fixed order, the codes' bias taken back (kS8Bias sum x_q), then scaled by the
// weights' dv and the activations' d_x: acc + dv d_x sum(w_q x_q).
template <int P>
inline Lanes::F add_s8_block(const Lanes::I* part, Lanes::F dv, const QuantX& a, int64_t xi,
                             Lanes::F acc) {
  using L = Lanes;
  L::I sum = part[0];
  if constexpr (P >= 2) sum = L::add(sum, part[1]);
  if constexpr (P == 4) sum = L::add(sum, L::add(part[2], part[3]));
  const L::I isum = L::sub(sum, L::seti(L::kS8Bias * a.qsum[xi]));
  return L::fma(dv, L::mul(L::cvt(isum), L::set1(a.d[xi])), acc);
}

// The same for Q8_0's int8 codes.
template <int MT>
inline void tile_q8(const Geom& g, const uint8_t* grp, int h, const QuantX& a, int64_t K,
                    int64_t m0, const Out& out) {
  using L = Lanes;
  using I = L::I;
  using F = L::F;
  const int64_t nb = K / QK;
  F acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = L::zerof();
  for (int64_t b = 0; b < g.nsb; ++b) {
    const uint8_t* cb = grp + g.at(kCodes, b) + 4 * L::W * h;
    const F dv = L::halves(
        reinterpret_cast<const uint16_t*>(grp + g.at(kScales, b)) + L::W * h);
    constexpr int P = s8_partials(MT);
    I part[MT][P];
    for (int m = 0; m < MT; ++m) {
      for (int p = 0; p < P; ++p) part[m][p] = L::zero();
    }
    for (int t = 0; t < 8; ++t) {
      const L::B w = L::s8_prep(L::load(cb + SUBV * t));
      for (int m = 0; m < MT; ++m) {
        part[m][t % P] = L::dot_s8(part[m][t % P], w, a.q + (m0 + m) * K + b * QK + 4 * t);
      }
    }
    for (int m = 0; m < MT; ++m) {
      acc[m] = add_s8_block<P>(part[m], dv, a, (m0 + m) * nb + b, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) store_lanes(acc[m], out, m0 + m);
}

// The same for IQ4_NL / IQ4_XS / MXFP4: each 4-bit index becomes its table value (one
// byte shuffle), a signed 8-bit code met by the activation codes as Q8_0's are; one
// float step per 32 elements with the block's scale (IQ4_XS: d times the sub-block's
// six-bit ls - 32, decoded per super-block for the group's 16 rows; MXFP4: its E8M0
// byte's power of two; exact in f32). Per 32: sum w x-hat = scale d_x sum(t[q] x_q).
template <int T, int MT>
inline void tile_iq4(const Geom& g, const uint8_t* grp, int h, const QuantX& a, int64_t K,
                     int64_t m0, const Out& out) {
  using L = Lanes;
  using I = L::I;
  using F = L::F;
  constexpr int64_t kSubs = T == kIQ4_XS ? 8 : 1;  // 32-element blocks per super-block
  const int8_t* table = T == kMXFP4 ? kMXFP4Table : kIQ4Table;
  const int64_t nb = K / QK;
  F acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = L::zerof();
  alignas(64) int8_t scales[128];
  for (int64_t b = 0; b < g.nsb; ++b) {
    F d;
    if constexpr (T == kMXFP4) {
      d = L::e8m0_half(grp + g.at(kScales, b) + L::W * h);
    } else {
      d = L::halves(reinterpret_cast<const uint16_t*>(grp + g.at(kScales, b)) + L::W * h);
    }
    if constexpr (T == kIQ4_XS) decode_iq4xs_scales(grp + g.at(kExtra, b), scales);
    for (int64_t j = 0; j < kSubs; ++j) {
      const uint8_t* cb = grp + g.at(kCodes, b) + 256 * j + 4 * L::W * h;
      F dv = d;
      if constexpr (T == kIQ4_XS) dv = L::mul(d, L::i8f(scales + 16 * j + L::W * h));
      constexpr int P = s8_partials(MT);
      I part[MT][P];
      for (int m = 0; m < MT; ++m) {
        for (int p = 0; p < P; ++p) part[m][p] = L::zero();
      }
      for (int u = 0; u < 4; ++u) {
        const L::B r = L::load(cb + SUBV * u);
        const L::B lo = L::s8_prep(L::lut16(L::and_(r, L::set8(0x0F)), table));
        const L::B hi = L::s8_prep(L::lut16(L::high_nibbles(r), table));
        for (int m = 0; m < MT; ++m) {
          const int8_t* x = a.q + (m0 + m) * K + (b * kSubs + j) * QK + 4 * u;
          part[m][(2 * u) % P] = L::dot_s8(part[m][(2 * u) % P], lo, x);
          part[m][(2 * u + 1) % P] = L::dot_s8(part[m][(2 * u + 1) % P], hi, x + 16);
        }
      }
      for (int m = 0; m < MT; ++m) {
        acc[m] = add_s8_block<P>(part[m], dv, a, (m0 + m) * nb + b * kSubs + j, acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) store_lanes(acc[m], out, m0 + m);
}

// The same for K-quants (Q3_K, Q4_K, Q5_K, Q6_K), with per-256 activations: sub-block
// dots times their integer scales summed in int32, one float step per super-block.
//   Q4_K/Q5_K: sum w x-hat = d d_x sum_j sc_j (q . x_q)_j - dmin d_x sum_j mn_j (sum x_q)_j
//   Q6_K:      sum w x-hat = d d_x sum_k sc_k ((q . x_q)_k - 32 (sum x_q)_k), k per 16
//   Q3_K:      the same with centre 4 and sc_k the decoded six-bit scale - 32
// Bounds: |q . x_q| <= 32 * 31 * 127 per sub-block, times 63, times 8 (Q5_K: < 2^26);
// Q6_K 16 * 32 * 127 * 128 * 16 < 2^28: int32 never overflows.
template <int T, int MT, bool kUnpacked = false>
inline void tile_kquant(const Geom& g, const uint8_t* grp, int h, const QuantK& a, int64_t K,
                        int64_t m0, const Out& out, const uint8_t* codes = nullptr) {
  using L = Lanes;
  using I = L::I;
  using F = L::F;
  using KT = Kind<T>;
  const int64_t nsb = K / 256;
  F acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = L::zerof();
  alignas(64) uint8_t scb[128], mnb[128];
  alignas(64) uint8_t q3sc[256];
  for (int64_t sb = 0; sb < g.nsb; ++sb) {
    const uint8_t* cb = grp + g.at(kCodes, sb) + 4 * L::W * h;
    const uint8_t* hb = grp + g.at(kHi, sb);
    const uint16_t* hv =
        reinterpret_cast<const uint16_t*>(grp + g.at(kScales, sb)) +
        L::W * h;
    const uint8_t* xb = grp + g.at(kExtra, sb);
    if constexpr (!KT::kHalves) decode_kscales(xb, scb, mnb);
    if constexpr (T == kQ3_K) decode_q3k_scales(xb, q3sc);
    I isc[MT], imn[MT];  // this super-block's scaled dots and scaled minimum sums
    for (int m = 0; m < MT; ++m) isc[m] = imn[m] = L::zero();
    for (int j = 0; j < 8; ++j) {
      const uint8_t* hj = hb + (T == kQ6_K ? 128 : 64) * j;
      I lo[MT], hi[MT];
      block_dots<T, MT, kUnpacked>(cb + (T == kQ3_K ? 128 : 256) * j, hj, h, a.q, K, m0,
                                   sb * 256 + QK * j, lo, hi,
                                   kUnpacked ? codes + code_vector(sb, j, 0, 0, 0) : nullptr);
      if constexpr (KT::kHalves) {
        I slo, shi;  // the two sub-blocks' signed scales
        if constexpr (T == kQ3_K) {
          slo = L::sub(L::u8i(q3sc + 16 * (2 * j) + L::W * h), L::seti(32));
          shi = L::sub(L::u8i(q3sc + 16 * (2 * j + 1) + L::W * h), L::seti(32));
        } else {
          const int8_t* sc6 = reinterpret_cast<const int8_t*>(xb);
          slo = L::i8i(sc6 + 16 * (2 * j) + L::W * h);
          shi = L::i8i(sc6 + 16 * (2 * j + 1) + L::W * h);
        }
        for (int m = 0; m < MT; ++m) {
          const int32_t* bs = a.bsum + ((m0 + m) * nsb + sb) * 16 + 2 * j;
          const I l = L::sub(lo[m], L::seti(KT::kKCentre * bs[0]));
          const I u = L::sub(hi[m], L::seti(KT::kKCentre * bs[1]));
          isc[m] = L::add(isc[m], L::add(L::mullo(l, slo), L::mullo(u, shi)));
        }
      } else {
        const I sv = L::u8i(scb + 16 * j + L::W * h);
        const I mv = L::u8i(mnb + 16 * j + L::W * h);
        for (int m = 0; m < MT; ++m) {
          const int32_t* bs = a.bsum + ((m0 + m) * nsb + sb) * 16 + 2 * j;
          isc[m] = L::add(isc[m], L::mullo(lo[m], sv));
          imn[m] = L::add(imn[m], L::mullo(mv, L::seti(bs[0] + bs[1])));
        }
      }
    }
    const F dv = L::halves(hv);
    for (int m = 0; m < MT; ++m) {
      const F dx = L::set1(a.d[(m0 + m) * nsb + sb]);
      acc[m] = L::fma(L::mul(dv, dx), L::cvt(isc[m]), acc[m]);
      if constexpr (!KT::kHalves) {
        acc[m] = L::fnma(L::mul(L::halves(hv + RG), dx), L::cvt(imn[m]), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) store_lanes(acc[m], out, m0 + m);
}

#if defined(EMBER_SUM16)
// Q6_K where widening to int32 costs a multiply (AVX2 without VNNI): each pair of
// vpmaddubsw results is summed in int16 (2 * 2 * 63 * 127 < 2^15) and widened by
// vpmaddwd with its sub-block's signed scale instead of by ones, which leaves no
// vpmulld per sub-block; the centre's 32 sum_k sc_k (sum x_q)_k pairs two sub-blocks
// of 16 per vpmaddwd (|sc| <= 128, code sums per 16 <= 16 * 127), in a loop after the
// codes'. Exactly tile_kquant's integers, with one accumulator per activation row while
// the codes are read, so a tile takes six rows (tile_kquant takes two): each unpacked
// code vector serves six rows, though GCC keeps some of their accumulators on the stack.
// Measured on a Zen 3 and the Xeon VM's AVX2 build: see docs/performance.md.
template <int MT>
inline void tile_q6k_sum16(const Geom& g, const uint8_t* grp, int h, const QuantK& a, int64_t K,
                           int64_t m0, const Out& out) {
  using L = Lanes;
  using B = L::B;
  using I = L::I;
  using F = L::F;
  const int64_t nsb = K / 256;
  F acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = L::zerof();
  for (int64_t sb = 0; sb < g.nsb; ++sb) {
    const uint8_t* cb = grp + g.at(kCodes, sb) + 4 * L::W * h;
    const uint8_t* hb = grp + g.at(kHi, sb);
    const int8_t* sc6 = reinterpret_cast<const int8_t*>(grp + g.at(kExtra, sb)) + L::W * h;
    I isc[MT], icentre[MT];
    for (int m = 0; m < MT; ++m) isc[m] = icentre[m] = L::zero();
    for (int j = 0; j < 8; ++j) {
      const B slo = L::i8_twice16(sc6 + 16 * (2 * j)), shi = L::i8_twice16(sc6 + 16 * (2 * j + 1));
      for (int u = 0; u < 4; u += 2) {
        B lo0, hi0, lo1, hi1;
        unpack_pair<kQ6_K>(cb + 256 * j, hb + 128 * j, u, h, &lo0, &hi0, &lo1, &hi1);
        for (int m = 0; m < MT; ++m) {
          const int8_t* x = a.q + (m0 + m) * K + sb * 256 + QK * j + 4 * u;
          isc[m] = L::add(isc[m], L::add(L::widen_by(L::pairs16(lo0, x, lo1, x + 4), slo),
                                         L::widen_by(L::pairs16(hi0, x + 16, hi1, x + 20), shi)));
        }
      }
    }
    // the centre's sum apart: inside the code loop its accumulators competed with the
    // code vectors for registers
    for (int j = 0; j < 8; ++j) {
      const B spair = L::i8_pairs16(sc6 + 16 * (2 * j), sc6 + 16 * (2 * j + 1));
      for (int m = 0; m < MT; ++m) {
        const int32_t* bs = a.bsum + ((m0 + m) * nsb + sb) * 16 + 2 * j;
        icentre[m] = L::add(icentre[m], L::widen_by(spair, L::set_pair16(bs[0], bs[1])));
      }
    }
    const F dv = L::halves(reinterpret_cast<const uint16_t*>(grp + g.at(kScales, sb)) + L::W * h);
    for (int m = 0; m < MT; ++m) {
      const I total = L::sub(isc[m], L::mullo(icentre[m], L::seti(32)));
      acc[m] = L::fma(L::mul(dv, L::set1(a.d[(m0 + m) * nsb + sb])), L::cvt(total), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) store_lanes(acc[m], out, m0 + m);
}

// Q4_K and Q5_K (codes from a minimum) over both halves of a group (its 16 rows) at
// once, for MT activation rows: each activation broadcast meets both halves' code
// vectors, half the broadcasts of a tile per half (on a Zen 3 they cost about as much
// as the multiplies). The vpmaddubsw results add up in int16 for as long as they stay
// exact (a lane of one is at most 2 * 15 * 127 for Q4_K, 2 * 31 * 127 for Q5_K, and an
// int16 holds 32767): a whole sub-block's eight for Q4_K (kSpan 4 code vectors, two
// results each), four for Q5_K (kSpan 2). Each
// such sum is widened to int32 by its sub-block's 6-bit scale in one vpmaddwd. The
// minimums' sum_j mn_j (sum x_q)_j pairs two sub-blocks per vpmaddwd at the end of the
// super-block. Exactly tile_kquant's integers and float steps, so any row gives the
// same bits here as in a tile of one. Q5_K reads its codes from unpack_group's buffer
// (`codes`; Kind::kUnpackOnce), Q4_K unpacks its own. Measured: docs/performance.md.
template <int T, int MT>
inline void tile_kmin_wide(const Geom& g, const uint8_t* grp, const uint8_t* codes,
                           const QuantK& a, int64_t K, int64_t m0, const Out (&out)[2]) {
  using L = Lanes;
  using B = L::B;
  using I = L::I;
  using F = L::F;
  static_assert(L::H == 2, "both halves of a group");
  constexpr int kSpan = T == kQ4_K ? 4 : 2;  // code vectors per int16 sum
  const int64_t nsb = K / 256;
  F acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = L::zerof();
  alignas(64) uint8_t scb[128], mnb[128];
  for (int64_t sb = 0; sb < g.nsb; ++sb) {
    const uint8_t* cb = grp + g.at(kCodes, sb);
    const uint8_t* hb = grp + g.at(kHi, sb);
    decode_kscales(grp + g.at(kExtra, sb), scb, mnb);
    const int8_t* sc = reinterpret_cast<const int8_t*>(scb);  // 0 .. 63
    const int8_t* mn = reinterpret_cast<const int8_t*>(mnb);
    I isc[MT][2];
    for (int m = 0; m < MT; ++m) isc[m][0] = isc[m][1] = L::zero();
    for (int j = 0; j < 8; ++j) {
      const B s[2] = {L::i8_twice16(sc + 16 * j), L::i8_twice16(sc + 16 * j + L::W)};
      B sums[MT][2];
#pragma GCC unroll 4  // the sums stay in registers only when every index is a constant
      for (int u = 0; u < 4; ++u) {
        B lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          if constexpr (Kind<T>::kUnpackOnce) {
            lo[h] = L::load(codes + code_vector(sb, j, u, h, 0));
            hi[h] = L::load(codes + code_vector(sb, j, u, h, 1));
          } else {
            unpack_one<T>(cb + 256 * j + 4 * L::W * h, hb + 64 * j, u, h, &lo[h], &hi[h]);
          }
        }
        for (int m = 0; m < MT; ++m) {
          const int8_t* x = a.q + (m0 + m) * K + sb * 256 + QK * j + 4 * u;
          for (int h = 0; h < 2; ++h) {
            const B p = L::pairs16(lo[h], x, hi[h], x + 16);
            // opaque: GCC would otherwise reassociate the int16 adds and compute every
            // product first, spilling them
            sums[m][h] = L::opaque(u % kSpan == 0 ? p : L::add16(sums[m][h], p));
            if (u % kSpan == kSpan - 1) {
              isc[m][h] = L::add(isc[m][h], L::widen_by(sums[m][h], s[h]));
            }
          }
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const uint16_t* hv = reinterpret_cast<const uint16_t*>(grp + g.at(kScales, sb)) + L::W * h;
      const F dv = L::halves(hv), mv = L::halves(hv + RG);
      for (int m = 0; m < MT; ++m) {
        const int32_t* bs = a.bsum + ((m0 + m) * nsb + sb) * 16;
        I imn = L::zero();
        for (int j = 0; j < 8; j += 2) {
          imn = L::add(imn, L::widen_by(L::i8_pairs16(mn + 16 * j + L::W * h,
                                                      mn + 16 * (j + 1) + L::W * h),
                                        L::set_pair16(bs[2 * j] + bs[2 * j + 1],
                                                      bs[2 * j + 2] + bs[2 * j + 3])));
        }
        const F dx = L::set1(a.d[(m0 + m) * nsb + sb]);
        acc[m][h] = L::fma(L::mul(dv, dx), L::cvt(isc[m][h]), acc[m][h]);
        acc[m][h] = L::fnma(L::mul(mv, dx), L::cvt(imn), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int h = 0; h < 2; ++h) {
      if (out[h].valid > 0) store_lanes(acc[m][h], out[h], m0 + m);
    }
  }
}
#endif

template <int T, int MT>
inline void tile(const Geom& g, const uint8_t* grp, int h, const Acts& a, int64_t K,
                 int64_t m0, const Out& out) {
  if constexpr (T == kQ8_0) {
    tile_q8<MT>(g, grp, h, a.b32, K, m0, out);
  } else if constexpr (T == kIQ4_NL || T == kIQ4_XS || T == kMXFP4) {
    tile_iq4<T, MT>(g, grp, h, a.b32, K, m0, out);
#if defined(EMBER_SUM16)
  } else if constexpr (T == kQ6_K && MT >= 4) {  // 1-2 rows: more partials in flight
    tile_q6k_sum16<MT>(g, grp, h, a.b256, K, m0, out);
#endif
  } else if constexpr (Kind<T>::kKQuant) {
    tile_kquant<T, MT>(g, grp, h, a.b256, K, m0, out);
  } else {
    tile_legacy<T, MT>(g, grp, h, a.b32, K, m0, out);
  }
}

// A packed matrix as the kernels see it: its rows are output columns col0 .. col0 + rows.
struct SegView {
  Geom g;
  int64_t rows = 0, col0 = 0;
  const uint8_t* data = nullptr;
};

// The largest group (bytes) whose successor is prefetched whole into L1 while it is
// computed: two thirds of L1, so the next group fits beside the current one. A core
// left to its hardware prefetchers kept too few lines in flight to stream more than
// ~20 GB/s here; asking for the whole next group at once keeps many. Measured on a
// Zen 5 (48 KiB L1) with the Llama 3.2 1B shape, the layers took 7% less time at one
// row and 14% less at sixteen; prefetching groups larger than L1 (8192-wide rows)
// cost up to 15% at one row, and spreading the prefetches through the group's
// blocks gained nothing. The AVX2 lanes walk a group twice (one half of every line
// per pass), and there the prefetch costs instead (Lanes::kPrefetchGroups).
inline int64_t prefetch_limit() {
  static const int64_t limit = [] {
    const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return (l1 > 0 ? static_cast<int64_t>(l1) : int64_t{32} << 10) * 2 / 3;
  }();
  return limit;
}

// Groups [g0, g1) of segment s times activation rows [m0, m1).
template <int T>
void run_groups(const SegView& s, const Acts& a, int64_t K, int64_t g0, int64_t g1,
                int64_t m0, int64_t m1, float* y, int64_t ldy) {
  constexpr int MT = Kind<T>::kTile;
  const bool ahead = Lanes::kPrefetchGroups && s.g.stride <= prefetch_limit();
  for (int64_t gi = g0; gi < g1; ++gi) {
    const uint8_t* grp = s.data + gi * s.g.stride;
    if (ahead && gi + 1 < g1) {
      for (int64_t o = 0; o < s.g.stride; o += 64) __builtin_prefetch(grp + s.g.stride + o, 0, 3);
    }
    int64_t m_half = m0;  // the first row of the tiles per half
#if defined(EMBER_SUM16)
    if constexpr (Kind<T>::kWide) {
      constexpr int WT = Kind<T>::kWideTile;
      Out both[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t r0 = gi * RG + h * Lanes::W;
        both[h] = Out{y, ldy, s.col0 + r0, std::clamp<int64_t>(s.rows - r0, 0, Lanes::W)};
      }
      // Q5_K's codes unpacked once for every tile of this pass (kUnpackOnce)
      const uint8_t* codes =
          Kind<T>::kUnpackOnce && m1 - m_half >= WT ? unpack_group<T>(s.g, grp) : nullptr;
      for (; m_half + WT <= m1; m_half += WT) {
        tile_kmin_wide<T, WT>(s.g, grp, codes, a.b256, K, m_half, both);
      }
    }
#else
    // The codes of kUnpackOnce types unpacked once for all full tiles of a pass of
    // kUnpackRows rows or more. At 16 rows (AVX-512 VNNI, the Xeon VM, 1B Q5_K_M) the
    // buffer took 1.11x the time: a step that streams its weights from memory, with the
    // next group prefetched into L1, loses more to the buffer's traffic than it saves.
    const uint8_t* codes = nullptr;
    if constexpr (Kind<T>::kUnpackOnce) {
      if (m1 - m0 >= kUnpackRows) codes = unpack_group<T>(s.g, grp);
    }
#endif
    for (int h = 0; h < Lanes::H; ++h) {
      const int64_t r0 = gi * RG + h * Lanes::W;
      if (r0 >= s.rows) break;
      const Out out{y, ldy, s.col0 + r0, std::min<int64_t>(Lanes::W, s.rows - r0)};
      int64_t m = m_half;
#if !defined(EMBER_SUM16)
      if constexpr (Kind<T>::kUnpackOnce) {
        for (; codes != nullptr && m + MT <= m1; m += MT) {
          tile_kquant<T, MT, true>(s.g, grp, h, a.b256, K, m, out, codes);
        }
      }
#endif
      for (; m + MT <= m1; m += MT) tile<T, MT>(s.g, grp, h, a, K, m, out);
      // the rest in tiles of 4, 2, 1 rows (a row's arithmetic is the same in any tile)
      if constexpr (MT > 4) {
        if (m + 4 <= m1) {
          tile<T, 4>(s.g, grp, h, a, K, m, out);
          m += 4;
        }
      }
      if constexpr (MT > 2) {
        if (m + 2 <= m1) {
          tile<T, 2>(s.g, grp, h, a, K, m, out);
          m += 2;
        }
      }
      for (; m < m1; ++m) tile<T, 1>(s.g, grp, h, a, K, m, out);
    }
  }
}

void run_segment_groups(const SegView& s, const Acts& a, int64_t K, int64_t g0, int64_t g1,
                        int64_t m0, int64_t m1, float* y, int64_t ldy) {
  switch (s.g.type) {
    case kQ4_0: run_groups<kQ4_0>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kQ4_1: run_groups<kQ4_1>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kQ5_0: run_groups<kQ5_0>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kQ5_1: run_groups<kQ5_1>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kQ8_0: run_groups<kQ8_0>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kQ3_K: run_groups<kQ3_K>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kQ4_K: run_groups<kQ4_K>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kQ5_K: run_groups<kQ5_K>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kQ6_K: run_groups<kQ6_K>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kIQ4_NL: run_groups<kIQ4_NL>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kIQ4_XS: run_groups<kIQ4_XS>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    case kMXFP4: run_groups<kMXFP4>(s, a, K, g0, g1, m0, m1, y, ldy); break;
    default: TORCH_CHECK(false, "no packed layout for ggml type ", s.g.type);
  }
}

// Activation rows per pass over the weights: enough that the weights are re-read from
// memory rarely, few enough that their int8 codes stay in the core's L2 (~256 KB).
inline int64_t rows_per_pass(int64_t K) {
  return std::max<int64_t>(8, (int64_t{1} << 18) / std::max<int64_t>(K, 1) / 8 * 8);
}

// One kind of product for several matrices at once, each over its own activation rows:
// jobs[j] is y_j[M_j, N_j] = x_j @ W_j^T, x_j already quantized (a.b32 / a.b256 point
// at its first row). All jobs share K. (One job: a layer's matmul; several: the routed
// experts of a step, routed_experts.h.)
struct MatmulJob {
  const std::vector<SegView>* segs;
  Acts a;
  int64_t M;
  float* y;
  int64_t ldy;
};

// Rows of cost a group of weights is worth: below this many activation rows a group's
// time is mostly its bytes streaming in, above it mostly the rows' arithmetic. A guess,
// not tuned: the split decides only how evenly the threads finish, never a result.
constexpr int64_t kRowsPerGroupRead = 4;

// Every job's every row group, split over the threads in contiguous ranges of equal
// cost (weight bytes x (rows + kRowsPerGroupRead)). A row's result does not depend on
// the split (see the top of this file), only the time does.
void matmul_jobs(const std::vector<MatmulJob>& jobs, int64_t K) {
  struct Span { size_t job, seg; int64_t first, groups, cost; };  // one segment of a job
  std::vector<Span> spans;
  int64_t total_groups = 0, total_cost = 0, work = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    if (jobs[j].M == 0) continue;
    for (size_t s = 0; s < jobs[j].segs->size(); ++s) {
      const SegView& v = (*jobs[j].segs)[s];
      const int64_t groups = groups_of(v.rows);
      const int64_t cost = v.g.stride * (jobs[j].M + kRowsPerGroupRead);
      spans.push_back(Span{j, s, total_groups, groups, cost});
      total_groups += groups;
      total_cost += groups * cost;
      work += groups * RG * K * jobs[j].M;
    }
  }
  if (total_groups == 0) return;
  const int64_t nthreads = std::max<int64_t>(
      1, std::min<int64_t>({at::get_num_threads(), total_groups, work / (int64_t{1} << 15) + 1}));
  // bounds[t] .. bounds[t + 1]: thread t's groups (global index over all spans)
  std::vector<int64_t> bounds(nthreads + 1, total_groups);
  bounds[0] = 0;
  {
    int64_t t = 1, acc = 0;
    for (const Span& sp : spans) {
      for (int64_t g = 0; g < sp.groups && t < nthreads; ++g) {
        acc += sp.cost;
        while (t < nthreads && acc * nthreads >= total_cost * t) bounds[t++] = sp.first + g + 1;
      }
    }
  }
  const int64_t pass = rows_per_pass(K);
  at::parallel_for(0, nthreads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (const Span& sp : spans) {
        const int64_t g0 = std::max(bounds[t], sp.first) - sp.first;
        const int64_t g1 = std::min(bounds[t + 1], sp.first + sp.groups) - sp.first;
        if (g0 >= g1) continue;
        const MatmulJob& job = jobs[sp.job];
        for (int64_t m0 = 0; m0 < job.M; m0 += pass) {
          run_segment_groups((*job.segs)[sp.seg], job.a, K, g0, g1, m0,
                             std::min(job.M, m0 + pass), job.y, job.ldy);
        }
      }
    }
  });
}


// y[M, ldy] (columns of each segment) = x @ W^T with quantized activations a: one job,
// so threads take contiguous ranges of groups (across segments) holding equal bytes.
void matmul_segments(const std::vector<SegView>& segs, const Acts& a, int64_t M, int64_t K,
                     float* y, int64_t ldy) {
  matmul_jobs({MatmulJob{&segs, a, M, y, ldy}}, K);
}
