// Packed weight layouts: GGUF's block quantization at its own bit width, rearranged so
// the integer kernels (quant_kernels.h) can read 16 output rows per instruction.
//
// Part of the quant_matmul.cpp translation unit (included inside its namespace).
//
// Packing moves bits, never values: a packed weight dequantizes to exactly the floats
// ember.models.quant.dequantize (and gguf-py) computes from the GGUF bytes, and it
// holds exactly the GGUF's bytes (the 16 rows of a group are padded to a whole
// multiple of 64 bytes: at most 63 bytes per 16 rows).
//
// Rows are taken 16 at a time (a group; padding rows are zero codes with zero scales).
// A group's data is one contiguous stretch of `stride` bytes, laid out section by
// section: each section holds one kind of field for every super-block of the row
// (32 elements for the legacy types, 256 for K-quants), so a kernel walking a group
// reads a few sequential streams. Sections, per super-block and 16 rows:
//
//   codes4  per 32 elements, 4 vectors u of 64 bytes; byte 4r + p of vector u holds
//           row r's code 4u + p in its low nibble and code 16 + 4u + p in its high
//           nibble (GGUF's own Q4_0 order; K-quants are re-paired into it).
//           The low nibbles of the 4 vectors are elements 0-15, the high 16-31.
//   codes8  per 32 elements, 8 vectors t of 64 bytes; byte 4r + p: row r's int8
//           code 4t + p (Q8_0).
//   hi1     per 32 elements, 8 bit masks of 8 bytes, mask 2u + k: bit 4r + p is bit 4
//           of the code in byte 4r + p's low (k = 0) or high (k = 1) nibble of codes4
//           vector u (Q5_0, Q5_1, Q5_K).
//   hi2     per 32 elements, 2 vectors of 64 bytes; vector k, byte 4r + p: bits 4-5 of
//           the codes of vectors u = 2k (low nibble: bits 0-1, high: 2-3) and 2k + 1
//           (low: 4-5, high: 6-7) in byte 4r + p (Q6_K).
//   Q3_K's three-bit codes have no codes4 section: their bits 0-1 are a section laid
//           out as hi2 (where the codes section sits), bit 2 one laid out as hi1.
//   f16     16 halves, one per row (Q4_0/Q5_0/Q8_0 d, Q4_1/Q5_1 d and m, Q6_K d).
//   e8m0    MXFP4: 16 exponent bytes, one per row.
//   kscale  Q4_K/Q5_K: the 12 bytes of six-bit scales and mins of every row, byte b of
//           row r at 16 b + r (decoded by the kernel per super-block).
//   dmin    Q4_K/Q5_K: 16 halves d, then 16 halves dmin.
//   scale8  Q6_K: 16 int8 scales (one per 16 elements) of every row, scale k of row
//           r at 16 k + r.
//   iscale  IQ4_XS: the GGUF's 6 scale bytes of every row (u16 of the eight scales'
//           top bits, 4 bytes of their low nibbles), byte i of row r at 16 i + r.
//   q3scale Q3_K: the GGUF's 12 bytes of sixteen six-bit scales of every row, byte i of
//           row r at 16 i + r (decoded by the kernel per super-block).
//
// Values (as gguf-py computes them, with f32 arithmetic and one rounding per step):
//   Q4_0 (q - 8) d    Q4_1 q d + m    Q5_0 (q - 16) d    Q5_1 q d + m    Q8_0 q d
//   Q4_K / Q5_K  q (d sc_j) - (dmin mn_j)   (sub-block j of 32)
//   Q6_K  (q - 32) (d sc_k)                 (sub-block k of 16)
//   Q3_K  (q - 4) (d (sc_k - 32))           (sub-block k of 16; q the three-bit code)
//   IQ4_NL  d t[q]    IQ4_XS  (d (ls_j - 32)) t[q] (sub-block j of 32), t the 16-value
//           non-uniform int8 table; the codes4 section holds the 4-bit indices
//   MXFP4   m[q] 2^(e - 128), m twice the E2M1 values (an int8 table as IQ4's)

// ggml type numbers (ember.models.gguf.GGMLType) of the packed layouts.
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
  kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kMXFP4 = 39
};

// IQ4_NL / IQ4_XS: the values the 4-bit indices stand for (ggml's kvalues_iq4nl).
alignas(16) constexpr int8_t kIQ4Table[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                              1,    13,   25,  38,  53,  69,  89,  113};
// MXFP4: twice the E2M1 values (ggml's kvalues_mxfp4), so the scale is half of 2^(e-127).
alignas(16) constexpr int8_t kMXFP4Table[16] = {0, 1, 2, 3, 4, 6, 8, 12,
                                               0, -1, -2, -3, -4, -6, -8, -12};

constexpr int64_t RG = 16;   // rows per group
constexpr int64_t QK = 32;   // elements per activation block (and per legacy block)
constexpr int64_t SUBV = 64; // bytes per code vector (4 bytes x 16 rows)

enum Section { kCodes, kHi, kScales, kExtra, kSections };

// Where a type's fields live inside a group.
struct Geom {
  int type = 0;
  int64_t sb = QK;                 // elements per super-block
  int64_t nsb = 0;                 // super-blocks per row
  int64_t gguf_block = 0;          // GGUF bytes per block (per row and super-block)
  int64_t size[kSections] = {};    // bytes per super-block of each section (16 rows)
  int64_t off[kSections] = {};     // section offsets within a group
  int64_t stride = 0;              // bytes per group, a multiple of 64

  // offset of super-block b's field `sec` within a group
  int64_t at(int sec, int64_t b) const { return off[sec] + b * size[sec]; }
};

inline bool packable(int type) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0:
    case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K: case kIQ4_NL: case kIQ4_XS: case kMXFP4:
      return true;
    default: return false;
  }
}

// Whether a type's kernel takes activations quantized per 256 (the K-quants' integer
// sub-block scales) rather than per 32 (every other type, IQ4_XS's float scales too).
inline bool kquant_activations(int type) {
  return type == kQ3_K || type == kQ4_K || type == kQ5_K || type == kQ6_K;
}

inline Geom geom_of(int type, int64_t K) {
  Geom g;
  g.type = type;
  switch (type) {
    case kQ4_0: g.gguf_block = 18; g.size[kCodes] = 256; g.size[kScales] = 32; break;
    case kQ4_1: g.gguf_block = 20; g.size[kCodes] = 256; g.size[kScales] = 64; break;
    case kQ5_0:
      g.gguf_block = 22; g.size[kCodes] = 256; g.size[kHi] = 64; g.size[kScales] = 32; break;
    case kQ5_1:
      g.gguf_block = 24; g.size[kCodes] = 256; g.size[kHi] = 64; g.size[kScales] = 64; break;
    case kQ8_0: g.gguf_block = 34; g.size[kCodes] = 512; g.size[kScales] = 32; break;
    case kIQ4_NL: g.gguf_block = 18; g.size[kCodes] = 256; g.size[kScales] = 32; break;
    case kMXFP4: g.gguf_block = 17; g.size[kCodes] = 256; g.size[kScales] = 16; break;
    case kIQ4_XS:
      g.sb = 256; g.gguf_block = 136;
      g.size[kCodes] = 2048; g.size[kScales] = 32; g.size[kExtra] = 96; break;
    case kQ3_K:
      g.sb = 256; g.gguf_block = 110;
      g.size[kCodes] = 1024; g.size[kHi] = 512; g.size[kScales] = 32; g.size[kExtra] = 192;
      break;
    case kQ4_K:
      g.sb = 256; g.gguf_block = 144;
      g.size[kCodes] = 2048; g.size[kScales] = 64; g.size[kExtra] = 192; break;
    case kQ5_K:
      g.sb = 256; g.gguf_block = 176;
      g.size[kCodes] = 2048; g.size[kHi] = 512; g.size[kScales] = 64; g.size[kExtra] = 192;
      break;
    case kQ6_K:
      g.sb = 256; g.gguf_block = 210;
      g.size[kCodes] = 2048; g.size[kHi] = 1024; g.size[kScales] = 32; g.size[kExtra] = 256;
      break;
    default: TORCH_CHECK(false, "no packed layout for ggml type ", type);
  }
  TORCH_CHECK(K > 0 && K % g.sb == 0, "ggml type ", type, ": row length ", K,
              " is not a multiple of its block size ", g.sb);
  g.nsb = K / g.sb;
  int64_t at = 0;
  for (int s = 0; s < kSections; ++s) {
    g.off[s] = at;
    at += g.nsb * g.size[s];
  }
  g.stride = (at + 63) / 64 * 64;
  return g;
}

inline int64_t groups_of(int64_t rows) { return (rows + RG - 1) / RG; }

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ------------------------------------------------------------------ GGUF blocks -> codes

// The codes of one GGUF block as stored (unsigned: 4, 5 or 6 bits; Q8_0's int8 bits),
// in element order, and where the block's f16 fields sit.
inline void gguf_codes(int type, const uint8_t* blk, uint8_t* codes) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kIQ4_NL: case kMXFP4: {
      const uint8_t* qs = blk + (type == kQ4_1 ? 4 : type == kMXFP4 ? 1 : 2);
      for (int j = 0; j < 16; ++j) {
        codes[j] = qs[j] & 0x0F;
        codes[j + 16] = qs[j] >> 4;
      }
      break;
    }
    case kIQ4_XS:  // 8 sub-blocks of 16 bytes, each in Q4_0's nibble order
      for (int j = 0; j < 8; ++j) {
        const uint8_t* qs = blk + 8 + 16 * j;
        for (int i = 0; i < 16; ++i) {
          codes[32 * j + i] = qs[i] & 0x0F;
          codes[32 * j + 16 + i] = qs[i] >> 4;
        }
      }
      break;
    case kQ5_0: case kQ5_1: {
      const int at = type == kQ5_0 ? 2 : 4;
      const uint32_t qh = rd32(blk + at);
      const uint8_t* qs = blk + at + 4;
      for (int j = 0; j < 16; ++j) {
        codes[j] = static_cast<uint8_t>((qs[j] & 0x0F) | (((qh >> j) & 1) << 4));
        codes[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
      }
      break;
    }
    case kQ8_0: std::memcpy(codes, blk + 2, 32); break;
    case kQ4_K: case kQ5_K: {
      // 4 chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles 2c + 1
      const uint8_t* qs = blk + (type == kQ4_K ? 16 : 48);
      const uint8_t* qh = blk + 16;
      for (int c = 0; c < 4; ++c) {
        for (int l = 0; l < 32; ++l) {
          uint8_t lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
          if (type == kQ5_K) {
            lo |= static_cast<uint8_t>(((qh[l] >> (2 * c)) & 1) << 4);
            hi |= static_cast<uint8_t>(((qh[l] >> (2 * c + 1)) & 1) << 4);
          }
          codes[64 * c + l] = lo;
          codes[64 * c + 32 + l] = hi;
        }
      }
      break;
    }
    case kQ3_K: {
      // two halves of 128 elements: bits 0-1 of element 32 j + l of half n are bit pair
      // j of qs[32 n + l]; bit 2 is bit 4 n + j of hmask[l] (the GGUF stores it
      // inverted: set means the code is not lowered by 4, i.e. q = low + 4)
      const uint8_t* hm = blk;
      const uint8_t* qs = blk + 32;
      for (int n = 0; n < 2; ++n) {
        for (int j = 0; j < 4; ++j) {
          for (int l = 0; l < 32; ++l) {
            codes[128 * n + 32 * j + l] = static_cast<uint8_t>(
                ((qs[32 * n + l] >> (2 * j)) & 3) | (((hm[l] >> (4 * n + j)) & 1) << 2));
          }
        }
      }
      break;
    }
    case kQ6_K: {
      // two halves of 128: ql low nibbles are elements 0-63 of the half, high nibbles
      // 64-127; qh[l] holds bits 4-5 of elements l, l + 32, l + 64, l + 96
      for (int n = 0; n < 2; ++n) {
        const uint8_t* ql = blk + 64 * n;
        const uint8_t* qh = blk + 128 + 32 * n;
        uint8_t* c = codes + 128 * n;
        for (int l = 0; l < 32; ++l) {
          c[l] = static_cast<uint8_t>((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
          c[l + 32] = static_cast<uint8_t>((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
          c[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
          c[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
        }
      }
      break;
    }
    default: TORCH_CHECK(false, "no packed layout for ggml type ", type);
  }
}

// IQ4_XS: the 8 sub-block scales ls - 32 of 16 rows, out[16 j + r], from their six
// packed bytes per row (byte i of row r at 16 i + r; bytes 0-1: the u16 of the top two
// bits, pair j at bit 2j; bytes 2-5: the low nibbles, sub-block j in byte 2 + j / 2).
// The row loop is 16 independent bytes: compilers vectorize it.
inline void decode_iq4xs_scales(const uint8_t* xb, int8_t* out) {
  for (int j = 0; j < 8; ++j) {
    for (int r = 0; r < 16; ++r) {
      const int lo = (xb[16 * (2 + j / 2) + r] >> (4 * (j % 2))) & 0x0F;
      const int hi = (xb[16 * (j / 4) + r] >> (2 * (j % 4))) & 3;
      out[16 * j + r] = static_cast<int8_t>((lo | (hi << 4)) - 32);
    }
  }
}

// Q3_K: the 16 six-bit sub-block scales sc (unsigned; the value's scale is sc - 32) of
// 16 rows, out[16 k + r], from their 12 packed bytes per row (byte i of row r at
// 16 i + r): scale k's low nibble is nibble k / 8 of byte k % 8, its top two bits pair
// k / 4 of byte 8 + k % 4. Whole vectors at a time: bytes 0-3 of the 16 rows (a) hold
// the low nibbles of scales 0-3 and 8-11, bytes 4-7 (b) of 4-7 and 12-15, bytes 8-11
// (c) the top bits of all (the 16-bit shifts' bits from the neighbouring byte are
// masked off).
inline void decode_q3k_scales(const uint8_t* s, uint8_t* out) {
  using L = Lanes;
  constexpr int V = static_cast<int>(sizeof(L::B));
  for (int o = 0; o < 64; o += V) {
    const L::B a = L::load(s + o), b = L::load(s + 64 + o), c = L::load(s + 128 + o);
    const L::B low = L::set8(0x0F), top = L::set8(0x30);
    L::store_b(L::or_(L::and_(a, low), L::template shl<4>(c, 0x30)), out + o);
    L::store_b(L::or_(L::and_(b, low), L::template shl<2>(c, 0x30)), out + 64 + o);
    L::store_b(L::or_(L::template shr<4>(a, 0x0F), L::and_(c, top)), out + 128 + o);
    L::store_b(L::or_(L::template shr<4>(b, 0x0F), L::template shr<2>(c, 0x30)), out + 192 + o);
  }
}

// ------------------------------------------------------------------------- packing

// Row r (0..15) of a group: the 32 codes of one block into the code (and high-bit)
// sections at cb (and hb).
inline void put_codes4(const uint8_t* c, int r, uint8_t* cb) {
  for (int u = 0; u < 4; ++u) {
    for (int p = 0; p < 4; ++p) {
      cb[SUBV * u + 4 * r + p] = static_cast<uint8_t>((c[4 * u + p] & 0x0F) |
                                                      ((c[16 + 4 * u + p] & 0x0F) << 4));
    }
  }
}

inline void put_hi1(const uint8_t* c, int r, uint8_t* hb) {
  for (int u = 0; u < 4; ++u) {
    for (int k = 0; k < 2; ++k) {
      for (int p = 0; p < 4; ++p) {
        const int bit = 4 * r + p;
        if ((c[16 * k + 4 * u + p] >> 4) & 1) hb[8 * (2 * u + k) + bit / 8] |= 1 << (bit % 8);
      }
    }
  }
}

inline void put_hi2(const uint8_t* c, int r, uint8_t* hb) {
  for (int k = 0; k < 2; ++k) {
    for (int p = 0; p < 4; ++p) {
      const int u0 = 2 * k, u1 = 2 * k + 1;
      hb[SUBV * k + 4 * r + p] = static_cast<uint8_t>(
          (c[4 * u0 + p] >> 4) | ((c[16 + 4 * u0 + p] >> 4) << 2) |
          ((c[4 * u1 + p] >> 4) << 4) | ((c[16 + 4 * u1 + p] >> 4) << 6));
    }
  }
}

inline void put_codes8(const uint8_t* c, int r, uint8_t* cb) {
  for (int t = 0; t < 8; ++t) std::memcpy(cb + SUBV * t + 4 * r, c + 4 * t, 4);
}

// Q4_K's 128 code bytes (qs) as put_codes4 lays out each sub-block, straight from the
// nibbles: sub-block 2c + h is nibble h of bytes 32 c .. 32 c + 31, and a packed byte
// pairs elements k and k + 16 of its sub-block. What gguf_codes + put_codes4 give, at a
// fraction of their byte-by-byte work: streamed experts are packed as they arrive.
inline void put_q4k_codes(const uint8_t* qs, int r, uint8_t* cb) {
  for (int c = 0; c < 4; ++c) {
    const uint8_t* a = qs + 32 * c;
    uint8_t lo[16], hi[16];
    for (int k = 0; k < 16; ++k) {
      lo[k] = static_cast<uint8_t>((a[k] & 0x0F) | (a[16 + k] << 4));
      hi[k] = static_cast<uint8_t>((a[k] >> 4) | (a[16 + k] & 0xF0));
    }
    for (int u = 0; u < 4; ++u) {
      std::memcpy(cb + 256 * (2 * c) + SUBV * u + 4 * r, lo + 4 * u, 4);
      std::memcpy(cb + 256 * (2 * c + 1) + SUBV * u + 4 * r, hi + 4 * u, 4);
    }
  }
}

// One group from the GGUF rows at src[r] (nullptr: a padding row, left zero). The
// group's bytes at dst must be zeroed.
void pack_group(const Geom& g, const uint8_t* const* src, uint8_t* dst) {
  uint8_t codes[256];
  const int64_t nsub = g.sb / QK;
  for (int64_t b = 0; b < g.nsb; ++b) {
    uint8_t* cb = dst + g.at(kCodes, b);
    uint8_t* hb = dst + g.at(kHi, b);
    uint8_t* sb = dst + g.at(kScales, b);
    uint8_t* xb = dst + g.at(kExtra, b);
    for (int r = 0; r < RG; ++r) {
      if (src[r] == nullptr) continue;
      const uint8_t* blk = src[r] + b * g.gguf_block;
      // Q4_K (most of a Q4_K_M file) straight from its nibbles, 5-7x faster; the rest
      // through every code's byte (a Q6_K path written like Q4_K's took 2x the time)
      const bool direct = g.type == kQ4_K;
      if (direct) {
        put_q4k_codes(blk + 16, r, cb);
      } else {
        gguf_codes(g.type, blk, codes);
      }
      for (int64_t j = 0; j < nsub && !direct; ++j) {
        const uint8_t* c = codes + QK * j;
        if (g.type == kQ8_0) {
          put_codes8(c, r, cb);
          continue;
        }
        if (g.type == kQ3_K) {  // bits 0-1 as a hi2 section, bit 2 as a hi1 section
          uint8_t low[32], top[32];
          for (int i = 0; i < 32; ++i) {
            low[i] = static_cast<uint8_t>((c[i] & 3) << 4);
            top[i] = static_cast<uint8_t>(((c[i] >> 2) & 1) << 4);
          }
          put_hi2(low, r, cb + 128 * j);
          put_hi1(top, r, hb + 64 * j);
          continue;
        }
        put_codes4(c, r, cb + 256 * j);
        if (g.type == kQ5_0 || g.type == kQ5_1 || g.type == kQ5_K) put_hi1(c, r, hb + 64 * j);
        if (g.type == kQ6_K) put_hi2(c, r, hb + 128 * j);
      }
      uint16_t* halves = reinterpret_cast<uint16_t*>(sb);
      switch (g.type) {
        case kQ4_0: case kQ5_0: case kQ8_0: halves[r] = rd16(blk); break;
        case kQ4_1: case kQ5_1: halves[r] = rd16(blk); halves[16 + r] = rd16(blk + 2); break;
        case kQ4_K: case kQ5_K:
          halves[r] = rd16(blk);
          halves[16 + r] = rd16(blk + 2);
          for (int i = 0; i < 12; ++i) xb[16 * i + r] = blk[4 + i];
          break;
        case kQ6_K:
          halves[r] = rd16(blk + 208);
          for (int i = 0; i < 16; ++i) xb[16 * i + r] = blk[192 + i];
          break;
        case kQ3_K:
          halves[r] = rd16(blk + 108);
          for (int i = 0; i < 12; ++i) xb[16 * i + r] = blk[96 + i];
          break;
        case kIQ4_NL: halves[r] = rd16(blk); break;
        case kMXFP4: sb[r] = blk[0]; break;
        case kIQ4_XS:
          halves[r] = rd16(blk);
          for (int i = 0; i < 6; ++i) xb[16 * i + r] = blk[2 + i];
          break;
        default: break;
      }
    }
  }
}

// ------------------------------------------------------------------ dequantization

// Q4_K/Q5_K six-bit scale and min j (0..7) from a row's 12 GGUF scale bytes s.
inline void kscale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Row r (0..15) of a packed group back to K floats, bit-identical to gguf-py's values.
void dequant_group_row(const Geom& g, const uint8_t* grp, int r, float* out) {
  const int64_t nsub = g.sb / QK;
  for (int64_t b = 0; b < g.nsb; ++b) {
    const uint8_t* cb = grp + g.at(kCodes, b);
    const uint8_t* hb = grp + g.at(kHi, b);
    const uint16_t* halves =
        reinterpret_cast<const uint16_t*>(grp + g.at(kScales, b));
    const uint8_t* xb = grp + g.at(kExtra, b);
    uint8_t s12[12];
    for (int i = 0; i < 12 && g.size[kExtra] == 192; ++i) s12[i] = xb[16 * i + r];
    int8_t iscales[128];
    if (g.type == kIQ4_XS) decode_iq4xs_scales(xb, iscales);
    uint8_t q3scales[256];
    if (g.type == kQ3_K) decode_q3k_scales(xb, q3scales);
    for (int64_t j = 0; j < nsub; ++j) {
      float* o = out + b * g.sb + QK * j;
      for (int e = 0; e < QK; ++e) {
        int q;
        if (g.type == kQ8_0) {
          q = static_cast<int8_t>(cb[SUBV * (e / 4) + 4 * r + e % 4]);
        } else if (g.type == kQ3_K) {
          const int u = (e % 16) / 4, p = e % 4, k = e / 16, bit = 4 * r + p;
          q = (cb[128 * j + SUBV * (u / 2) + 4 * r + p] >> (4 * (u % 2) + 2 * k)) & 3;
          q |= ((hb[64 * j + 8 * (2 * u + k) + bit / 8] >> (bit % 8)) & 1) << 2;
        } else {
          const int u = (e % 16) / 4, p = e % 4, k = e / 16;
          const uint8_t byte = cb[256 * j + SUBV * u + 4 * r + p];
          q = k ? byte >> 4 : byte & 0x0F;
          if (g.type == kQ5_0 || g.type == kQ5_1 || g.type == kQ5_K) {
            const int bit = 4 * r + p;
            q |= ((hb[64 * j + 8 * (2 * u + k) + bit / 8] >> (bit % 8)) & 1) << 4;
          } else if (g.type == kQ6_K) {
            const uint8_t h = hb[128 * j + SUBV * (u / 2) + 4 * r + p];
            q |= ((h >> (4 * (u % 2) + 2 * k)) & 3) << 4;
          }
        }
        float v;
        switch (g.type) {
          case kQ4_0: v = static_cast<float>(q - 8) * h2f(halves[r]); break;
          case kIQ4_NL: v = h2f(halves[r]) * static_cast<float>(kIQ4Table[q]); break;
          case kMXFP4: {
            const uint8_t e = grp[g.at(kScales, b) + r];
            v = static_cast<float>(kMXFP4Table[q]) * e8m0_half_f32(e);
            break;
          }
          case kIQ4_XS: {
            const float scale = h2f(halves[r]) * static_cast<float>(iscales[16 * j + r]);
            v = scale * static_cast<float>(kIQ4Table[q]);
            break;
          }
          case kQ5_0: v = static_cast<float>(q - 16) * h2f(halves[r]); break;
          case kQ8_0: v = static_cast<float>(q) * h2f(halves[r]); break;
          case kQ4_1: case kQ5_1:
            v = static_cast<float>(q) * h2f(halves[r]) + h2f(halves[16 + r]);
            break;
          case kQ4_K: case kQ5_K: {
            int sc, mn;
            kscale_min(s12, static_cast<int>(j), &sc, &mn);
            const float scale = h2f(halves[r]) * static_cast<float>(sc);
            const float minimum = h2f(halves[16 + r]) * static_cast<float>(mn);
            v = static_cast<float>(q) * scale - minimum;
            break;
          }
          case kQ3_K: {
            const int sc = q3scales[16 * (2 * j + e / 16) + r] - 32;
            v = static_cast<float>(q - 4) * (h2f(halves[r]) * static_cast<float>(sc));
            break;
          }
          default: {  // Q6_K
            const int8_t sc = static_cast<int8_t>(xb[16 * (2 * j + e / 16) + r]);
            v = static_cast<float>(q - 32) * (h2f(halves[r]) * static_cast<float>(sc));
            break;
          }
        }
        o[e] = v;
      }
    }
  }
}
