// The kernels' weight layout for every GGML block type they run, and its packing from the
// integer form of model/blocks/codec.py (w = scale * sub_scale * (u - zero) - minimum * sub_minimum).
//
// Formats (ids shared with model/kernels/__init__.py):
//   0 Q4_1  1 Q8_0  2 Q4_0  3 Q5_0  4 Q5_1  5 Q4_K  6 Q5_K  7 Q6_K  8 MXFP4
// MXFP4 (gpt-oss's experts) is laid out as the 4-bit legacy types, but its nibble is a code:
// the weights are E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), not evenly spaced, so
// the kernels look u = kMxfp4Values[code] up (the values doubled to integers, plus the zero
// point 12) and multiply it as any unsigned u. Its block scale is a power of two, 2^(e - 128)
// for the stored exponent byte e (half the E8M0 scale, for the doubling), which fp16 cannot hold
// over its whole range: MXFP4's halves hold bfloat16 bits, exact for every e.
// At load a tensor's rows are regrouped so that 16 output features share one 512-bit vector
// (two 256-bit halves of 8): 32-bit lane j holds 4 consecutive weights of output feature j. One
// integer multiply-add then takes 4 activations (broadcast) against 4 weights of 8 or 16 features,
// and the float work (conversion, scale, FMA) is paid once per block of 32 for 16 features instead
// of once per block for one. The profile of the row-major kernel had 16 rows costing about 8x one
// row for exactly that per-row float work.
//
// Per group of 16 features (rows past N are zero), one row of the packed tensor:
//   values  [num_blocks][V]   the block's integers u:
//       4-bit:  4 vectors of 64 bytes; vector t, lane j = bytes 4t..4t+3 of feature j's nibbles:
//               low nibble of byte i = u[i], high nibble = u[16 + i] (i in 0..15), as GGML's
//               legacy types store them (K-quants are re-nibbled to it).
//       5-bit:  4-bit vectors, then per half of 8 lanes 32 bytes of high bits: byte p (= 4 j' + i)
//               bit 2t = bit 4 of the low-nibble weight of vector t, bit 2t + 1 = of the high one.
//               Chosen so that AVX2 extracts them with one 16-bit shift and a mask per vector.
//       6-bit:  4-bit vectors, then per half 2 x 32 bytes: vector v covers t = 2v + s, and byte p
//               bits 4s..4s+1 = bits 4-5 of the low-nibble weight, 4s+2..4s+3 = of the high one.
//       8-bit:  8 vectors; vector t, lane j = u[4t..4t+3] (u = q + 128: unsigned, as VNNI's
//               vpdpbusd wants; AVX2 flips it back to signed).
//   sub     [num_blocks][32]  K-quants: Q4_K/Q5_K sub-scales of the 16 features, then sub-minimums;
//                             Q6_K the scales of weights 0..15, then of 16..31 (signed).
//   halves  [scale groups][H] fp16 scales of the 16 features (then the minimums where the type has
//                             one): per block for legacy types, per 256-weight super-block for
//                             K-quants. Legacy minimums are stored as GGML adds them (w = d u + m).
// The row is padded to 64 bytes. Bytes per weight stay near the file's: Q4_K 4.63 bits (file 4.5),
// Q5_K 5.63 (5.5), Q6_K 6.56 (6.56); legacy types exactly as the file.
#pragma once

#include <cstdint>
#include <cstring>

#include "isa.h"

namespace tokios {

constexpr int64_t kBlock = 32;
constexpr int64_t kSuperBlock = 256;
constexpr int64_t kGroup = 16;
constexpr int kNumFormats = 9;
enum Format { kQ4_1 = 0, kQ8_0 = 1, kQ4_0 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7, kMXFP4 = 8 };

struct FormatTraits {
  int bits;        // of u (of the code, for a lookup format)
  int zero;        // subtracted from u
  bool has_min;    // a minimum term
  int sub;         // 0: legacy (scale per block); 32: K-quant sub-scale per 32; 16: Q6_K, per 16
  bool lookup;     // u = kMxfp4Values[nibble], the scales bfloat16 (MXFP4)
};
constexpr FormatTraits kTraits[kNumFormats] = {
    {4, 0, true, 0, false}, {8, 128, false, 0, false}, {4, 8, false, 0, false}, {5, 16, false, 0, false},
    {5, 0, true, 0, false}, {4, 0, true, 32, false},   {5, 0, true, 32, false}, {6, 32, false, 16, false},
    {4, 12, false, 0, true},
};
// MXFP4 code -> u: E2M1's value doubled, plus 12 (codes 0 and 8 are +0 and -0).
alignas(16) constexpr uint8_t kMxfp4Values[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
// u -> the MXFP4 code that gives it (the packer's inverse; 255: no code gives that u).
constexpr uint8_t kMxfp4Codes[25] = {15, 255, 255, 255, 14, 255, 13, 255, 12, 11, 10, 9, 0,
                                     1,  2,   3,   4,   255, 5, 255, 6, 255, 255, 255, 7};

inline bool valid_format(int64_t format) { return format >= 0 && format < kNumFormats; }

struct GroupLayout {
  int64_t format, num_blocks, value_bytes, sub_bytes, num_scale_groups, halves_per_group, sub_offset,
      halves_offset, row_bytes;
  GroupLayout(int64_t format_, int64_t in_features) : format(format_), num_blocks(in_features / kBlock) {
    const FormatTraits& traits = kTraits[format];
    value_bytes = traits.bits == 8 ? 512 : 256 + (traits.bits - 4) * 64;
    sub_bytes = traits.sub ? 32 : 0;
    num_scale_groups = traits.sub ? in_features / kSuperBlock : num_blocks;
    halves_per_group = traits.has_min ? 2 * kGroup : kGroup;
    sub_offset = num_blocks * value_bytes;
    halves_offset = sub_offset + num_blocks * sub_bytes;
    row_bytes = (halves_offset + num_scale_groups * halves_per_group * 2 + 63) / 64 * 64;
  }
  const uint16_t* halves(const uint8_t* group_row) const {
    return reinterpret_cast<const uint16_t*>(group_row + halves_offset);
  }
  const uint8_t* sub(const uint8_t* group_row) const { return group_row + sub_offset; }
};

// The integer form of one tensor [N, K] (model/blocks/codec.py, BlockInts), as raw pointers.
struct BlockIntsView {
  const uint8_t* values;        // [N, K]
  const uint16_t* scales;       // [N, groups] fp16 bits
  const uint16_t* minimums;     // [N, groups] fp16 bits (subtracted), or null
  const int8_t* sub_scales;     // [N, K / sub] (uint8 for Q4_K/Q5_K, read as unsigned), or null
  const uint8_t* sub_minimums;  // [N, K / 32], or null
};

inline uint16_t negate_half(uint16_t h) { return h ^ 0x8000u; }

// A stored scale or minimum of `format`: fp16 bits, or bfloat16 bits for MXFP4.
inline float stored_scale(int64_t format, uint16_t bits) {
  return kTraits[format].lookup ? bfloat16_to_float(bits) : half_to_float(bits);
}

// u of weight w (0..31) of feature j in block b of a group row; the scalar kernel and
// dequantization read it back.
inline int unpacked_value(const uint8_t* group_row, const GroupLayout& layout, int64_t b, int j, int w) {
  const uint8_t* values = group_row + b * layout.value_bytes;
  const int bits = kTraits[layout.format].bits;
  if (bits == 8) return values[64 * (w / 4) + 4 * j + w % 4];
  const int high = w / 16, t = (w % 16) / 4, i = w % 4;
  const uint8_t byte = values[64 * t + 4 * j + i];
  int u = high ? byte >> 4 : byte & 15;
  if (kTraits[layout.format].lookup) return kMxfp4Values[u];
  const int half = j / 8, p = 4 * (j % 8) + i;
  if (bits == 5) u |= ((values[256 + 32 * half + p] >> (2 * t + high)) & 1) << 4;
  if (bits == 6) u |= ((values[256 + 64 * half + 32 * (t / 2) + p] >> (4 * (t % 2) + 2 * high)) & 3) << 4;
  return u;
}

// One group row from features [g * 16, g * 16 + 16) of `ints` (rows past N stay zero).
inline void pack_group(const BlockIntsView& ints, int64_t N, int64_t K, const GroupLayout& layout, int64_t g,
                       uint8_t* row) {
  const FormatTraits& traits = kTraits[layout.format];
  std::memset(row, 0, layout.row_bytes);
  uint16_t* halves = reinterpret_cast<uint16_t*>(row + layout.halves_offset);
  for (int j = 0; j < kGroup && g * kGroup + j < N; ++j) {
    const int64_t n = g * kGroup + j;
    const uint8_t* u_row = ints.values + n * K;
    uint8_t codes[kBlock];
    for (int64_t s = 0; s < layout.num_scale_groups; ++s) {
      halves[s * layout.halves_per_group + j] = ints.scales[n * layout.num_scale_groups + s];
      if (traits.has_min) {
        const uint16_t minimum = ints.minimums[n * layout.num_scale_groups + s];
        halves[s * layout.halves_per_group + kGroup + j] = traits.sub ? minimum : negate_half(minimum);
      }
    }
    const int half = j / 8;
    for (int64_t b = 0; b < layout.num_blocks; ++b) {
      const uint8_t* u = u_row + b * kBlock;
      if (traits.lookup) {  // pack the codes (the integer form holds u; unpack checked each has one)
        for (int w = 0; w < kBlock; ++w) codes[w] = kMxfp4Codes[u[w]];
        u = codes;
      }
      uint8_t* values = row + b * layout.value_bytes;
      if (traits.bits == 8) {
        for (int w = 0; w < kBlock; ++w) values[64 * (w / 4) + 4 * j + w % 4] = u[w];
      } else {
        for (int t = 0; t < 4; ++t) {
          for (int i = 0; i < 4; ++i) {
            const int low = u[4 * t + i], high = u[16 + 4 * t + i], p = 4 * (j % 8) + i;
            values[64 * t + 4 * j + i] = static_cast<uint8_t>((low & 15) | ((high & 15) << 4));
            if (traits.bits == 5) {
              values[256 + 32 * half + p] |= static_cast<uint8_t>((((low >> 4) & 1) << (2 * t)) |
                                                                  (((high >> 4) & 1) << (2 * t + 1)));
            } else if (traits.bits == 6) {
              values[256 + 64 * half + 32 * (t / 2) + p] |= static_cast<uint8_t>(
                  (((low >> 4) & 3) << (4 * (t % 2))) | (((high >> 4) & 3) << (4 * (t % 2) + 2)));
            }
          }
        }
      }
      if (traits.sub) {
        uint8_t* sub = row + layout.sub_offset + b * layout.sub_bytes;
        if (traits.sub == 32) {
          sub[j] = static_cast<uint8_t>(ints.sub_scales[n * layout.num_blocks + b]);
          sub[kGroup + j] = ints.sub_minimums[n * layout.num_blocks + b];
        } else {
          sub[j] = static_cast<uint8_t>(ints.sub_scales[n * 2 * layout.num_blocks + 2 * b]);
          sub[kGroup + j] = static_cast<uint8_t>(ints.sub_scales[n * 2 * layout.num_blocks + 2 * b + 1]);
        }
      }
    }
  }
}

}  // namespace tokios
