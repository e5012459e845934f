// y[M, N] = x[M, K] . W^T (+ bias) for W in any block format of blocks.h, activations quantized
// per row (activations.h). Why integers: decode reads every weight once per step, so bytes per
// weight set the single-stream speed (4-bit blocks read ~5 bits per weight instead of 32); with a
// batch of decodes, or a prefill chunk, the same weights serve many rows and the product becomes
// compute-bound, which the interleaved layout is built for.
//
// Three implementations, one chosen at build (isa.h): AVX-512 VNNI, else AVX2, else portable loops,
// each for every format (on VNNI, Q4_1 and Q8_0 have their own tuned kernel). Each
// output element is one dot product computed the same way whatever M is: every row keeps its own
// accumulators and adds its blocks in the same order, so a row's result is the same alone or in
// a batch, decode or prefill (R = 1 is the single-row case, not a separate kernel). Products built
// with exact sums (EXACT: the ones tensor parallel splits by input features) add the blocks'
// contributions exactly (see kSumGridBits), so their result does not depend on how the blocks are
// grouped either: a shard's sums over its blocks, added over the shards, give the whole's bits.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>

#include "activations.h"
#include "blocks.h"
#include "isa.h"

namespace tokios {

constexpr int kTileRows = 8;  // VNNI, measured: 12 was 10% slower, 16 spills registers
constexpr int64_t kPrefetchDistance = 16384;  // bytes; 4 KiB gained less (31 GB/s), 8 KiB 33

#if TOKIOS_VNNI || TOKIOS_AVX2
// The hardware prefetcher alone kept one row's stream of weights at about 23 GB/s on the Q8_0
// output projection (the row-major layout: 30-36) and batches short of requests in flight too.
// Asking for the bytes 16 KiB ahead into L2 brought one row to 33 GB/s, and decode at batch 16
// from about 1,075 to 1,310-1,360 tok/s. Block b of a group row asks for the lines that start in
// its share of the row 16 KiB ahead, so each line is asked for once.
// Past the end of the weight a prefetch is a no-op (the address is formed as an integer, never as
// an out-of-range pointer).
inline void prefetch_lines(uintptr_t begin, uintptr_t end) {
  for (uintptr_t line = (begin + 63) & ~uintptr_t{63}; line < end; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
  }
}

inline void prefetch_ahead(const uint8_t* group_row, int64_t row_bytes, int64_t num_blocks, int64_t b) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(group_row) + kPrefetchDistance;
  prefetch_lines(ahead + static_cast<uintptr_t>(b * row_bytes / num_blocks),
                 ahead + static_cast<uintptr_t>((b + 1) * row_bytes / num_blocks));
}
#endif

// The first kPrefetchDistance bytes of a thread's share of a weight, which no block asks for
// ahead of time (the loop's prefetches start that far in), asked for before the first block: a
// decode step is about 140 products of 0.3-2 MB, each starting cold on both threads. With the
// once-per-line prefetch above, Qwen3-0.6B's per-layer shapes at one row gained 0-7% (Zen 4).
inline void prefetch_start(const uint8_t* weights, int64_t num_bytes) {
#if TOKIOS_VNNI || TOKIOS_AVX2
  const uintptr_t begin = reinterpret_cast<uintptr_t>(weights);
  prefetch_lines(begin, begin + static_cast<uintptr_t>(std::min(num_bytes, kPrefetchDistance)));
#endif
}

// Why some products sum their blocks exactly: a row-parallel layer of tensor parallel (o_proj,
// down) gives each rank a share of the input features; each rank sums its own blocks and the
// group adds the shares. Float sums depend on that grouping, and on 8-bit activations a last-bit
// difference does not stay small: it moves the next layer's activation rounding (q = round(x / s)
// jumps by a whole step), and on the default model TP 3 gave another greedy text than one process
// (logprob of the first token -0.289 against -0.318). So each block's contribution (a float) is
// rounded to a fixed grid of 2^-36 and the contributions are added in double, where whole
// multiples of the grid add exactly while |sum| < 2^17: the sum is the same whatever order and
// split adds the blocks, and it is rounded to float32 once, at the end (a shard hands its sums on
// unrounded, ProductOut::sums). The grid costs at most 2^-37 per block, under half a float32 ulp
// of any output above 2^-13; past 2^17 the sums stay as accurate, only no longer split-exact.
// It costs a rounding and two double additions per block and 8 features: on AVX2, SmolLM2's
// 576 x 1536 down projection took 16% longer at 1 row (67 -> 78 us) and 22% at 64 rows, so only
// the products that tensor parallel splits by input features (o_proj, down: make_linear's
// exact_sums) pay it; the others add their blocks in float32, in a fixed order.
constexpr int kSumGridBits = 36;
constexpr float kToSumUnits = static_cast<float>(int64_t{1} << kSumGridBits);
constexpr double kSumUnit = 1.0 / static_cast<double>(int64_t{1} << kSumGridBits);

// Where a tile's results go: float32 values (the exact sum plus the bias, rounded once), or the
// unrounded float64 sums (a tensor-parallel shard's share, which its group adds before rounding).
struct ProductOut {
  float* values = nullptr;
  double* sums = nullptr;
  int64_t stride = 0;  // elements from one row to the next

  ProductOut at(int64_t row, int64_t column) const {
    const int64_t offset = row * stride + column;
    return {values ? values + offset : nullptr, sums ? sums + offset : nullptr, stride};
  }
};

#if TOKIOS_VNNI
// One block's contributions to 16 features, in grid units: rounded to whole units (exact
// afterwards) and added to the row's two double accumulators (features 0..7, 8..15).
inline void add_units_vnni(__m512d acc[2], __m512 units) {
  units = _mm512_roundscale_ps(units, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  acc[0] = _mm512_add_pd(acc[0], _mm512_cvtps_pd(_mm512_castps512_ps256(units)));
  acc[1] = _mm512_add_pd(acc[1], _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(units), 1))));
}

// A row's sums (grid units) of features [0, valid) with the bias, stored as out asks at offset.
inline void store_sums_vnni(const __m512d acc[2], const float* bias, int valid, const ProductOut& out, int64_t offset) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes, bias) : _mm512_setzero_ps();
  const __m512d unit = _mm512_set1_pd(kSumUnit);
  const __m512d low = _mm512_add_pd(_mm512_mul_pd(acc[0], unit), _mm512_cvtps_pd(_mm512_castps512_ps256(b)));
  const __m512d high = _mm512_add_pd(_mm512_mul_pd(acc[1], unit),
                                     _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b), 1))));
  const __mmask8 low_lanes = static_cast<__mmask8>(lanes & 0xff), high_lanes = static_cast<__mmask8>(lanes >> 8);
  if (out.sums) {
    _mm512_mask_storeu_pd(out.sums + offset, low_lanes, low);
    _mm512_mask_storeu_pd(out.sums + offset + 8, high_lanes, high);
  } else {
    _mm256_mask_storeu_ps(out.values + offset, low_lanes, _mm512_cvtpd_ps(low));
    _mm256_mask_storeu_ps(out.values + offset + 8, high_lanes, _mm512_cvtpd_ps(high));
  }
}
#endif

#if TOKIOS_AVX2
// store_values_vnni for features [0, lanes) of 8.
inline void store_values_avx2(__m256 acc, const float* bias, int lanes, const ProductOut& out, int64_t offset) {
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 b = bias ? _mm256_maskload_ps(bias, mask) : _mm256_setzero_ps();
  _mm256_maskstore_ps(out.values + offset, mask, _mm256_add_ps(acc, b));
}

// add_units_vnni for 8 features (two double accumulators of 4).
inline void add_units_avx2(__m256d acc[2], __m256 units) {
  units = _mm256_round_ps(units, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(units)));
  acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(units, 1)));
}

// store_sums_vnni for features [0, lanes) of 8.
inline void store_sums_avx2(const __m256d acc[2], const float* bias, int lanes, const ProductOut& out, int64_t offset) {
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 b = bias ? _mm256_maskload_ps(bias, mask) : _mm256_setzero_ps();
  const __m256d unit = _mm256_set1_pd(kSumUnit);
  const __m256d low = _mm256_add_pd(_mm256_mul_pd(acc[0], unit), _mm256_cvtps_pd(_mm256_castps256_ps128(b)));
  const __m256d high = _mm256_add_pd(_mm256_mul_pd(acc[1], unit), _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)));
  if (out.sums) {
    const __m256i quads = _mm256_setr_epi64x(0, 1, 2, 3);
    _mm256_maskstore_pd(out.sums + offset, _mm256_cmpgt_epi64(_mm256_set1_epi64x(lanes), quads), low);
    _mm256_maskstore_pd(out.sums + offset + 4, _mm256_cmpgt_epi64(_mm256_set1_epi64x(lanes - 4), quads), high);
  } else {
    _mm256_maskstore_ps(out.values + offset, mask, _mm256_set_m128(_mm256_cvtpd_ps(high), _mm256_cvtpd_ps(low)));
  }
}
#endif

#if TOKIOS_VNNI
// Float32 sums of features [0, valid) plus the bias, stored at offset (the products without exact sums).
inline void store_values_vnni(__m512 acc, const float* bias, int valid, const ProductOut& out, int64_t offset) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes, bias) : _mm512_setzero_ps();
  _mm512_mask_storeu_ps(out.values + offset, lanes, _mm512_add_ps(acc, b));
}

// The VNNI kernel for Q4_1 (format 0) and Q8_0 (format 1).
template <int FORMAT, bool PRECISE, bool EXACT, int R>
void dot_group_rows_vnni(const uint8_t* group_row, const GroupLayout& layout, const QuantizedActivations& a, int64_t r0,
                    const float* bias, int valid, const ProductOut& out) {
  const int64_t nb = layout.num_blocks, K = a.in_features, stride = a.row_stride;
  const uint16_t* halves = layout.halves(group_row);
  const int8_t* x0 = a.qs.data() + r0 * stride;
  constexpr int P = PRECISE ? 2 : 1;  // activation planes: q, then the residual
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  // EXACT: grid units (kSumGridBits) of features 0..7 and 8..15; else float32 sums of all 16.
  constexpr float kToUnits = EXACT ? kToSumUnits : 1.f;
  __m512d units[R][2];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    units[r][0] = units[r][1] = _mm512_setzero_pd();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* values = group_row + b * layout.value_bytes;
    const int8_t* xb = x0 + b * kBlock;
    prefetch_ahead(group_row, layout.row_bytes, nb, b);
    // With few rows the chain of dependent vpdpbusd (8 per block and plane) would bound the
    // speed, so a row's block is split over C independent integer sums; integer addition is
    // exact, so how many does not change any result (batch invariance holds).
    constexpr int C = R * P == 1 ? 8 : (R * P <= 3 ? 2 : 1);
    __m512i dot[R][P][C];
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) {
        for (int c = 0; c < C; ++c) dot[r][p][c] = _mm512_setzero_si512();
      }
    }
    if constexpr (FORMAT == kQ4_1) {
      for (int t = 0; t < 4; ++t) {
        const __m512i packed = _mm512_loadu_si512(values + 64 * t);
        const __m512i low = _mm512_and_si512(packed, low_nibbles);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
        for (int r = 0; r < R; ++r) {
          for (int p = 0; p < P; ++p) {
            const int8_t* x = xb + r * stride + p * K;
            __m512i& first = dot[r][p][(2 * t) % C];
            __m512i& second = dot[r][p][(2 * t + 1) % C];
            first = _mm512_dpbusd_epi32(first, low, _mm512_set1_epi32(load_i32(x + 4 * t)));
            second = _mm512_dpbusd_epi32(second, high, _mm512_set1_epi32(load_i32(x + 16 + 4 * t)));
          }
        }
      }
    } else {
      for (int t = 0; t < 8; ++t) {
        const __m512i w = _mm512_loadu_si512(values + 64 * t);
        for (int r = 0; r < R; ++r) {
          for (int p = 0; p < P; ++p) {
            __m512i& sum = dot[r][p][t % C];
            sum = _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(load_i32(xb + r * stride + p * K + 4 * t)));
          }
        }
      }
    }
    __m512i exact[R];  // the row's integer dot product with its (combined) activation values
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) {
        for (int c = 1; c < C; ++c) dot[r][p][0] = _mm512_add_epi32(dot[r][p][0], dot[r][p][c]);
      }
      exact[r] = PRECISE ? _mm512_add_epi32(_mm512_slli_epi32(dot[r][0][0], 7), dot[r][P - 1][0]) : dot[r][0][0];
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + b * layout.halves_per_group)));
    const int64_t at = r0 * nb + b;
    if constexpr (FORMAT == kQ4_1) {
      const __m512 m = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + b * layout.halves_per_group + kGroup)));
      for (int r = 0; r < R; ++r) {
        const __m512 row_scale = _mm512_mul_ps(d, _mm512_set1_ps(a.scales[at + r * nb] * kToUnits));
        const __m512 scaled_sum = _mm512_set1_ps(a.scaled_sums[at + r * nb] * kToUnits);
        if constexpr (EXACT) {
          add_units_vnni(units[r], _mm512_fmadd_ps(m, scaled_sum, _mm512_mul_ps(_mm512_cvtepi32_ps(exact[r]), row_scale)));
        } else {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact[r]), row_scale, acc[r]);
          acc[r] = _mm512_fmadd_ps(m, scaled_sum, acc[r]);
        }
      }
    } else {
      for (int r = 0; r < R; ++r) {
        const __m512i centred = _mm512_sub_epi32(exact[r], _mm512_set1_epi32(kTraits[kQ8_0].zero * a.sums[at + r * nb]));
        const __m512 row_scale = _mm512_mul_ps(d, _mm512_set1_ps(a.scales[at + r * nb] * kToUnits));
        if constexpr (EXACT) {
          add_units_vnni(units[r], _mm512_mul_ps(_mm512_cvtepi32_ps(centred), row_scale));
        } else {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), row_scale, acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (EXACT) store_sums_vnni(units[r], bias, valid, out, r * out.stride);
    else store_values_vnni(acc[r], bias, valid, out, r * out.stride);
  }

}
#endif

#if TOKIOS_VNNI
// Bits 4 (and 5) of u from the high-bit bytes of a 5- or 6-bit block, 16 features at once (the
// AVX2 helper below, on 512 bits).
template <int FROM, int TO>
inline __m512i move_bits_512(__m512i bytes, __m512i mask) {
  if constexpr (FROM < TO) return _mm512_and_si512(_mm512_slli_epi16(bytes, TO - FROM), mask);
  else if constexpr (FROM > TO) return _mm512_and_si512(_mm512_srli_epi16(bytes, FROM - TO), mask);
  else return _mm512_and_si512(bytes, mask);
}

// The VNNI kernel for the other 4-, 5- and 6-bit formats (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
// the AVX2 kernel's integer sums and float steps on all 16 features at once, with vpdpbusd in
// place of vpmaddubsw + vpmaddwd (no int16 stage, so nothing to widen or guard against
// saturation). The float steps are the AVX2 kernel's, lane for lane, so both give the same bits.
// The high-bit bytes of a 5-bit block are already in lane order (half 0's 32 bytes, then half
// 1's); a 6-bit block's two 32-byte runs per half are joined into one vector per pair of t.
template <int FORMAT, bool PRECISE, bool EXACT, int R>
void dot_group_rows_vnni_blocks(const uint8_t* group_row, const GroupLayout& layout, const QuantizedActivations& a,
                                int64_t r0, const float* bias, int valid, const ProductOut& out) {
  constexpr FormatTraits F = kTraits[FORMAT];
  static_assert(F.bits >= 4 && F.bits <= 6, "Q8_0 has its own VNNI kernel");
  constexpr int P = PRECISE ? 2 : 1;
  constexpr bool kSplit = F.sub == 16;  // Q6_K: separate sums for weights 0..15 and 16..31
  // Independent integer chains per row and half (see dot_group_rows_vnni): with one row the
  // chain of dependent vpdpbusd would set the speed.
  constexpr int C = R * P == 1 ? 4 : (R * P <= 3 ? 2 : 1);
  const int64_t nb = layout.num_blocks, K = a.in_features, stride = a.row_stride;
  const uint16_t* halves = layout.halves(group_row);
  const int8_t* x0 = a.qs.data() + r0 * stride;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10), bits45 = _mm512_set1_epi8(0x30);
  const __m512i codebook = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
  // EXACT: grid units (kSumGridBits) of features 0..7 and 8..15; else float32 sums of all 16.
  constexpr float kToUnits = EXACT ? kToSumUnits : 1.f;
  __m512d units[R][2];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    units[r][0] = units[r][1] = _mm512_setzero_pd();
  }
  __m512 super_scale = _mm512_setzero_ps(), super_min = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* values = group_row + b * layout.value_bytes;
    prefetch_ahead(group_row, layout.row_bytes, nb, b);
    const int8_t* xb = x0 + b * kBlock;
    // dot[r][p][s * C + c]: s = 0 for weights 0..15 (low nibbles), 1 for 16..31 where split.
    constexpr int S = kSplit ? 2 : 1;
    __m512i dot[R][P][S * C];
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) {
        for (int c = 0; c < S * C; ++c) dot[r][p][c] = _mm512_setzero_si512();
      }
    }
    __m512i high_bits[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    if constexpr (F.bits == 5) {
      high_bits[0] = _mm512_loadu_si512(values + 256);
    } else if constexpr (F.bits == 6) {
      for (int v = 0; v < 2; ++v) {
        const __m256i half0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 256 + 32 * v));
        const __m256i half1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 256 + 64 + 32 * v));
        high_bits[v] = _mm512_inserti64x4(_mm512_castsi256_si512(half0), half1, 1);
      }
    }
    auto step = [&](auto t_constant) {
      constexpr int t = decltype(t_constant)::value;
      const __m512i packed = _mm512_loadu_si512(values + 64 * t);
      __m512i low = _mm512_and_si512(packed, low_nibbles);
      __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
      if constexpr (F.lookup) {
        low = _mm512_shuffle_epi8(codebook, low);
        high = _mm512_shuffle_epi8(codebook, high);
      } else if constexpr (F.bits == 5) {
        low = _mm512_or_si512(low, move_bits_512<2 * t, 4>(high_bits[0], bit4));
        high = _mm512_or_si512(high, move_bits_512<2 * t + 1, 4>(high_bits[0], bit4));
      } else if constexpr (F.bits == 6) {
        low = _mm512_or_si512(low, move_bits_512<4 * (t % 2), 4>(high_bits[t / 2], bits45));
        high = _mm512_or_si512(high, move_bits_512<4 * (t % 2) + 2, 4>(high_bits[t / 2], bits45));
      }
      for (int r = 0; r < R; ++r) {
        for (int p = 0; p < P; ++p) {
          const int8_t* x = xb + r * stride + p * K;
          __m512i& first = kSplit ? dot[r][p][t % C] : dot[r][p][(2 * t) % C];
          __m512i& second = kSplit ? dot[r][p][C + t % C] : dot[r][p][(2 * t + 1) % C];
          first = _mm512_dpbusd_epi32(first, low, _mm512_set1_epi32(load_i32(x + 4 * t)));
          second = _mm512_dpbusd_epi32(second, high, _mm512_set1_epi32(load_i32(x + 16 + 4 * t)));
        }
      }
    };
    step(std::integral_constant<int, 0>());
    step(std::integral_constant<int, 1>());
    step(std::integral_constant<int, 2>());
    step(std::integral_constant<int, 3>());
    // The block's scales for the 16 features, as in the AVX2 kernel.
    __m512 scale, minimum = _mm512_setzero_ps();
    __m512i sub_first = _mm512_setzero_si512(), sub_second = _mm512_setzero_si512();
    if constexpr (F.lookup) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + b * layout.halves_per_group));
      scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    } else if constexpr (F.sub == 0) {
      const uint16_t* d = halves + b * layout.halves_per_group;
      scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
      if constexpr (F.has_min) minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + kGroup)));
    } else {
      if (b % (kSuperBlock / kBlock) == 0) {
        const uint16_t* d = halves + b / (kSuperBlock / kBlock) * layout.halves_per_group;
        super_scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
        if constexpr (F.has_min) super_min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + kGroup)));
      }
      const uint8_t* sub = layout.sub(group_row) + b * layout.sub_bytes;
      const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub));
      const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + kGroup));
      if constexpr (F.sub == 32) {
        scale = _mm512_mul_ps(super_scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)));
        minimum = _mm512_mul_ps(super_min, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)));
      } else {
        scale = super_scale;
        sub_first = _mm512_cvtepi8_epi32(first);
        sub_second = _mm512_cvtepi8_epi32(second);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * nb + b;
      __m512i exact[S];
      for (int s = 0; s < S; ++s) {
        __m512i sum[P];
        for (int p = 0; p < P; ++p) {
          sum[p] = dot[r][p][s * C];
          for (int c = 1; c < C; ++c) sum[p] = _mm512_add_epi32(sum[p], dot[r][p][s * C + c]);
        }
        exact[s] = PRECISE ? _mm512_add_epi32(_mm512_slli_epi32(sum[0], 7), sum[P - 1]) : sum[0];
      }
      const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(a.scales[at] * kToUnits));
      __m512i total;
      if constexpr (kSplit) {
        const int32_t first_sum = a.half_sums[at], second_sum = a.sums[at] - first_sum;
        const __m512i first = _mm512_sub_epi32(exact[0], _mm512_set1_epi32(F.zero * first_sum));
        const __m512i second = _mm512_sub_epi32(exact[S - 1], _mm512_set1_epi32(F.zero * second_sum));
        total = _mm512_add_epi32(_mm512_mullo_epi32(first, sub_first), _mm512_mullo_epi32(second, sub_second));
      } else if constexpr (F.zero != 0) {
        total = _mm512_sub_epi32(exact[0], _mm512_set1_epi32(F.zero * a.sums[at]));
      } else {
        total = exact[0];
      }
      // The block's contribution (EXACT: rounded to the grid and added exactly), else added to
      // the float32 sums with the same two roundings it always had.
      __m512 sum = EXACT ? _mm512_mul_ps(_mm512_cvtepi32_ps(total), row_scale)
                         : _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), row_scale, acc[r]);
      if constexpr (F.has_min) {
        const __m512 scaled_sum = _mm512_set1_ps(a.scaled_sums[at] * kToUnits);
        sum = F.sub ? _mm512_fnmadd_ps(minimum, scaled_sum, sum) : _mm512_fmadd_ps(minimum, scaled_sum, sum);
      }
      if constexpr (EXACT) add_units_vnni(units[r], sum);
      else acc[r] = sum;
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (EXACT) store_sums_vnni(units[r], bias, valid, out, r * out.stride);
    else store_values_vnni(acc[r], bias, valid, out, r * out.stride);
  }
}
#endif

#if TOKIOS_AVX2
// Bits 4 (and 5) of u from the high-bit bytes of a 5- or 6-bit block (layout in blocks.h): byte
// bit `from` moved to bit `to`. 16-bit shifts are exact here: the mask drops what crossed a byte.
template <int FROM, int TO>
inline __m256i move_bits(__m256i bytes, __m256i mask) {
  if constexpr (FROM < TO) return _mm256_and_si256(_mm256_slli_epi16(bytes, TO - FROM), mask);
  else if constexpr (FROM > TO) return _mm256_and_si256(_mm256_srli_epi16(bytes, FROM - TO), mask);
  else return _mm256_and_si256(bytes, mask);
}

// The AVX2 kernel, for every format: the same layout read as two halves of 8 features, with
// vpmaddubsw (u8 x s8 pairs summed to int16) then vpmaddwd by ones (pairs of pairs to int32),
// which is vpdpbusd's sum of 4 products. The int16 pair sums cannot saturate: 2 x 63 x 127 at
// most for 6-bit weights, and a few are added in int16 before widening only where the bound
// allows (4-bit: 4 vectors, 30,480 at most; 5-bit and 6-bit: 2). Q8_0 is flipped back to signed
// and multiplied as |w| x sign(x, w) (at most 2 x 128 x 127 per pair), so its zero point is 0.
template <int FORMAT, bool PRECISE, bool EXACT, int R>
void dot_group_rows_avx2(const uint8_t* group_row, const GroupLayout& layout, const QuantizedActivations& a,
                         int64_t r0, const float* bias, int valid, const ProductOut& out) {
  constexpr FormatTraits F = kTraits[FORMAT];
  constexpr int P = PRECISE ? 2 : 1;
  constexpr bool kSplit = F.sub == 16;  // Q6_K: separate sums for weights 0..15 and 16..31
  // int16 additions before widening (see above); MXFP4's looked-up u reach 24, so 2, as 5-bit.
  constexpr int kAdds = F.bits == 4 && !F.lookup ? 4 : 2;
  const int64_t nb = layout.num_blocks, K = a.in_features, stride = a.row_stride;
  const uint16_t* halves = layout.halves(group_row);
  const int8_t* x0 = a.qs.data() + r0 * stride;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const __m256i bit4 = _mm256_set1_epi8(0x10), bits45 = _mm256_set1_epi8(0x30), flip = _mm256_set1_epi8(-128);
  const __m256i codebook = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
  for (int h = 0; h < 2 && 8 * h < valid; ++h) {
    // EXACT: grid units (kSumGridBits) of features 8h..8h+3 and 8h+4..8h+7; else float32 sums.
    constexpr float kToUnits = EXACT ? kToSumUnits : 1.f;
    __m256d units[R][2];
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      units[r][0] = units[r][1] = _mm256_setzero_pd();
    }
    __m256 super_scale = _mm256_setzero_ps(), super_min = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* values = group_row + b * layout.value_bytes;
      if (h == 0) prefetch_ahead(group_row, layout.row_bytes, nb, b);
      const int8_t* xb = x0 + b * kBlock;
      __m256i dot[R][P][2];
      for (int r = 0; r < R; ++r) {
        for (int p = 0; p < P; ++p) dot[r][p][0] = dot[r][p][1] = _mm256_setzero_si256();
      }
      if constexpr (F.bits == 8) {
        for (int t = 0; t < 8; ++t) {
          const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 64 * t + 32 * h)), flip);
          const __m256i magnitude = _mm256_sign_epi8(w, w);  // |w|; -128 reads as 128 unsigned
          for (int r = 0; r < R; ++r) {
            for (int p = 0; p < P; ++p) {
              const __m256i x = _mm256_set1_epi32(load_i32(xb + r * stride + p * K + 4 * t));
              const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w));
              dot[r][p][0] = _mm256_add_epi32(dot[r][p][0], _mm256_madd_epi16(pairs, ones));
            }
          }
        }
      } else {
        __m256i pending[R][P][2];  // int16 sums not yet widened
        for (int r = 0; r < R; ++r) {
          for (int p = 0; p < P; ++p) pending[r][p][0] = pending[r][p][1] = _mm256_setzero_si256();
        }
        __m256i high_bits[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if constexpr (F.bits == 5) {
          high_bits[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 256 + 32 * h));
        } else if constexpr (F.bits == 6) {
          high_bits[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 256 + 64 * h));
          high_bits[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 256 + 64 * h + 32));
        }
        auto step = [&](auto t_constant) {
          constexpr int t = decltype(t_constant)::value;
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + 64 * t + 32 * h));
          __m256i low = _mm256_and_si256(packed, low_nibbles);
          __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
          if constexpr (F.lookup) {
            low = _mm256_shuffle_epi8(codebook, low);
            high = _mm256_shuffle_epi8(codebook, high);
          } else if constexpr (F.bits == 5) {
            low = _mm256_or_si256(low, move_bits<2 * t, 4>(high_bits[0], bit4));
            high = _mm256_or_si256(high, move_bits<2 * t + 1, 4>(high_bits[0], bit4));
          } else if constexpr (F.bits == 6) {
            low = _mm256_or_si256(low, move_bits<4 * (t % 2), 4>(high_bits[t / 2], bits45));
            high = _mm256_or_si256(high, move_bits<4 * (t % 2) + 2, 4>(high_bits[t / 2], bits45));
          }
          for (int r = 0; r < R; ++r) {
            for (int p = 0; p < P; ++p) {
              const int8_t* x = xb + r * stride + p * K;
              const __m256i first = _mm256_maddubs_epi16(low, _mm256_set1_epi32(load_i32(x + 4 * t)));
              const __m256i second = _mm256_maddubs_epi16(high, _mm256_set1_epi32(load_i32(x + 16 + 4 * t)));
              if constexpr (kSplit) {
                pending[r][p][0] = _mm256_add_epi16(pending[r][p][0], first);
                pending[r][p][1] = _mm256_add_epi16(pending[r][p][1], second);
              } else {
                pending[r][p][0] = _mm256_add_epi16(pending[r][p][0], _mm256_add_epi16(first, second));
              }
              if constexpr ((t + 1) % kAdds == 0) {
                for (int s = 0; s < (kSplit ? 2 : 1); ++s) {
                  dot[r][p][s] = _mm256_add_epi32(dot[r][p][s], _mm256_madd_epi16(pending[r][p][s], ones));
                  pending[r][p][s] = _mm256_setzero_si256();
                }
              }
            }
          }
        };
        step(std::integral_constant<int, 0>());
        step(std::integral_constant<int, 1>());
        step(std::integral_constant<int, 2>());
        step(std::integral_constant<int, 3>());
      }
      // The block's scales for these 8 features.
      __m256 scale, minimum = _mm256_setzero_ps();
      __m256i sub_first = _mm256_setzero_si256(), sub_second = _mm256_setzero_si256();
      if constexpr (F.lookup) {
        const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + b * layout.halves_per_group + 8 * h));
        scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      } else if constexpr (F.sub == 0) {
        const uint16_t* d = halves + b * layout.halves_per_group + 8 * h;
        scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
        if constexpr (F.has_min) minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + kGroup)));
      } else {
        if (b % (kSuperBlock / kBlock) == 0) {
          const uint16_t* d = halves + b / (kSuperBlock / kBlock) * layout.halves_per_group + 8 * h;
          super_scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
          if constexpr (F.has_min) super_min = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + kGroup)));
        }
        const uint8_t* sub = layout.sub(group_row) + b * layout.sub_bytes + 8 * h;
        const __m128i first = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub));
        const __m128i second = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + kGroup));
        if constexpr (F.sub == 32) {
          // Exact products: an fp16 scale (11 bits) times a 6-bit integer.
          scale = _mm256_mul_ps(super_scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first)));
          minimum = _mm256_mul_ps(super_min, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second)));
        } else {
          scale = super_scale;
          sub_first = _mm256_cvtepi8_epi32(first);
          sub_second = _mm256_cvtepi8_epi32(second);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * nb + b;
        __m256i exact[2];
        for (int s = 0; s < 2; ++s) {
          exact[s] = PRECISE ? _mm256_add_epi32(_mm256_slli_epi32(dot[r][0][s], 7), dot[r][P - 1][s]) : dot[r][0][s];
        }
        const __m256 row_scale = _mm256_mul_ps(scale, _mm256_set1_ps(a.scales[at] * kToUnits));
        __m256i total;
        if constexpr (kSplit) {
          // Q6_K: each half against its own integer scale, then one float step.
          const int32_t first_sum = a.half_sums[at], second_sum = a.sums[at] - first_sum;
          const __m256i first = _mm256_sub_epi32(exact[0], _mm256_set1_epi32(F.zero * first_sum));
          const __m256i second = _mm256_sub_epi32(exact[1], _mm256_set1_epi32(F.zero * second_sum));
          total = _mm256_add_epi32(_mm256_mullo_epi32(first, sub_first), _mm256_mullo_epi32(second, sub_second));
        } else if constexpr (F.zero != 0 && F.bits != 8) {
          total = _mm256_sub_epi32(exact[0], _mm256_set1_epi32(F.zero * a.sums[at]));
        } else {
          total = exact[0];
        }
        // As in the VNNI kernel: EXACT rounds the block's contribution to the grid and adds it
        // exactly; otherwise it goes into the float32 sums.
        __m256 sum = EXACT ? _mm256_mul_ps(_mm256_cvtepi32_ps(total), row_scale)
                           : _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), row_scale, acc[r]);
        if constexpr (F.has_min) {
          const __m256 scaled_sum = _mm256_set1_ps(a.scaled_sums[at] * kToUnits);
          sum = F.sub ? _mm256_fnmadd_ps(minimum, scaled_sum, sum) : _mm256_fmadd_ps(minimum, scaled_sum, sum);
        }
        if constexpr (EXACT) add_units_avx2(units[r], sum);
        else acc[r] = sum;
      }
    }
    const int lanes = std::min(8, valid - 8 * h);
    for (int r = 0; r < R; ++r) {
      const float* half_bias = bias ? bias + 8 * h : nullptr;
      if constexpr (EXACT) store_sums_avx2(units[r], half_bias, lanes, out, r * out.stride + 8 * h);
      else store_values_avx2(acc[r], half_bias, lanes, out, r * out.stride + 8 * h);
    }
  }
}
#endif

// The portable kernel, for every format: the same integer sums and float steps, one lane at a time.
template <int FORMAT, bool PRECISE, bool EXACT, int R>
void dot_group_rows_scalar(const uint8_t* group_row, const GroupLayout& layout, const QuantizedActivations& a,
                           int64_t r0, const float* bias, int valid, const ProductOut& out) {
  constexpr FormatTraits F = kTraits[FORMAT];
  const int64_t nb = layout.num_blocks, K = a.in_features, stride = a.row_stride;
  const uint16_t* halves = layout.halves(group_row);
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < valid; ++j) {
      constexpr float kToUnits = EXACT ? kToSumUnits : 1.f;
      double units = 0.0;  // EXACT: grid units (kSumGridBits)
      float acc = 0.f;     // otherwise
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* x = a.qs.data() + (r0 + r) * stride + b * kBlock;
        const int64_t at = (r0 + r) * nb + b;
        int32_t dot[2] = {0, 0};
        for (int w = 0; w < kBlock; ++w) {
          const int u = unpacked_value(group_row, layout, b, j, w);
          const int32_t value = PRECISE ? 128 * x[w] + x[K + w] : x[w];
          dot[w / 16] += u * value;
        }
        const int64_t group = F.sub ? b / (kSuperBlock / kBlock) : b;
        float scale = stored_scale(FORMAT, halves[group * layout.halves_per_group + j]);
        float minimum = F.has_min ? half_to_float(halves[group * layout.halves_per_group + kGroup + j]) : 0.f;
        const uint8_t* sub = layout.sub(group_row) + b * layout.sub_bytes;
        int32_t total;
        if constexpr (F.sub == 16) {
          const int32_t first_sum = a.half_sums[at], second_sum = a.sums[at] - first_sum;
          total = static_cast<int8_t>(sub[j]) * (dot[0] - F.zero * first_sum) +
                  static_cast<int8_t>(sub[kGroup + j]) * (dot[1] - F.zero * second_sum);
        } else {
          total = dot[0] + dot[1] - F.zero * a.sums[at];
          if constexpr (F.sub == 32) {
            scale *= static_cast<float>(sub[j]);
            minimum *= static_cast<float>(sub[kGroup + j]);
          }
        }
        const float row_scale = scale * (a.scales[at] * kToUnits);
        float sum = EXACT ? static_cast<float>(total) * row_scale : std::fma(static_cast<float>(total), row_scale, acc);
        if constexpr (F.has_min) sum = std::fma(F.sub ? -minimum : minimum, a.scaled_sums[at] * kToUnits, sum);
        if constexpr (EXACT) units += static_cast<double>(std::nearbyint(sum));
        else acc = sum;
      }
      if constexpr (EXACT) {
        const double sum = units * kSumUnit + (bias ? static_cast<double>(bias[j]) : 0.0);
        if (out.sums) out.sums[r * out.stride + j] = sum;
        else out.values[r * out.stride + j] = static_cast<float>(sum);
      } else {
        out.values[r * out.stride + j] = acc + (bias ? bias[j] : 0.f);
      }
    }
  }
}

using DotGroupFunction = void (*)(const uint8_t*, const GroupLayout&, const QuantizedActivations&, int64_t,
                                  const float*, int, const ProductOut&);
struct DotKernel {
  std::array<DotGroupFunction, kTileRows + 1> by_rows{};  // [R], R = 1..max_rows; [0] unused
  int max_rows = 0;
};

// Rows per tile of the AVX2 kernel: 16 ymm registers hold 4 rows' accumulators and sums; 8 spilled.
constexpr int kTileRowsAvx2 = 4;

template <int FORMAT, bool PRECISE, bool EXACT, size_t... Rs>
DotKernel make_kernel(std::index_sequence<Rs...>) {
  DotKernel kernel;
#if TOKIOS_VNNI
  if constexpr (FORMAT == kQ4_1 || FORMAT == kQ8_0) {
    kernel.by_rows = {nullptr, &dot_group_rows_vnni<FORMAT, PRECISE, EXACT, static_cast<int>(Rs) + 1>...};
  } else {
    kernel.by_rows = {nullptr, &dot_group_rows_vnni_blocks<FORMAT, PRECISE, EXACT, static_cast<int>(Rs) + 1>...};
  }
  kernel.max_rows = kTileRows;
  return kernel;
#endif
#if TOKIOS_AVX2
  ((kernel.by_rows[Rs + 1] = Rs < kTileRowsAvx2 ? &dot_group_rows_avx2<FORMAT, PRECISE, EXACT, std::min<int>(Rs + 1, kTileRowsAvx2)> : nullptr), ...);
  kernel.max_rows = kTileRowsAvx2;
#else
  ((kernel.by_rows[Rs + 1] = &dot_group_rows_scalar<FORMAT, PRECISE, EXACT, static_cast<int>(Rs) + 1>), ...);
  kernel.max_rows = kTileRows;
#endif
  return kernel;
}

// [format][precise][exact]; precise activations are offered for the two conversion formats only
// (--dtype int8 and int4), so the others have no such kernel. exact: the sum over blocks is exact
// (kSumGridBits), for the products that tensor parallel splits by input features.
template <int FORMAT, size_t... Rs>
std::array<std::array<DotKernel, 2>, 2> make_kernels(std::index_sequence<Rs...> rows) {
  std::array<std::array<DotKernel, 2>, 2> kernels{};
  kernels[0] = {make_kernel<FORMAT, false, false>(rows), make_kernel<FORMAT, false, true>(rows)};
  if constexpr (FORMAT == kQ4_1 || FORMAT == kQ8_0) {
    kernels[1] = {make_kernel<FORMAT, true, false>(rows), make_kernel<FORMAT, true, true>(rows)};
  }
  return kernels;
}

inline const DotKernel& dot_kernel(int64_t format, bool precise, bool exact) {
  static const std::array<std::array<std::array<DotKernel, 2>, 2>, kNumFormats> table = [] {
    std::array<std::array<std::array<DotKernel, 2>, 2>, kNumFormats> t{};
    const auto rows = std::make_index_sequence<kTileRows>();
    t[kQ4_1] = make_kernels<kQ4_1>(rows);
    t[kQ8_0] = make_kernels<kQ8_0>(rows);
    t[kQ4_0] = make_kernels<kQ4_0>(rows);
    t[kQ5_0] = make_kernels<kQ5_0>(rows);
    t[kQ5_1] = make_kernels<kQ5_1>(rows);
    t[kQ4_K] = make_kernels<kQ4_K>(rows);
    t[kQ5_K] = make_kernels<kQ5_K>(rows);
    t[kQ6_K] = make_kernels<kQ6_K>(rows);
    t[kMXFP4] = make_kernels<kMXFP4>(rows);
    return t;
  }();
  return table[format][precise][exact];
}

// Groups [group_begin, group_end) of one packed weight times activation rows [row_begin, row_end):
// out's rows r get features [g * 16, g * 16 + 16) of each group g, N features
// in all. The body every product runs (quant_matmul, grouped_expert_matmul in experts.h), so a
// row's result depends on neither which rows share the call nor how the groups are split.
inline void matmul_groups(const QuantizedActivations& activations, int64_t row_begin, int64_t row_end,
                          const uint8_t* weight, const GroupLayout& layout, const DotKernel& kernel, int64_t N,
                          int64_t group_begin, int64_t group_end, const float* bias, const ProductOut& out) {
  // A group's weights (at most a few KiB per 576 inputs) stay in L1 while tiles of rows pass over
  // them; rows are taken 64 at a time so that their activations stay in L2 (long prefill chunks).
  constexpr int64_t kRowChunk = 64;
  prefetch_start(weight + group_begin * layout.row_bytes, (group_end - group_begin) * layout.row_bytes);
  for (int64_t m0 = row_begin; m0 < row_end; m0 += kRowChunk) {
    const int64_t m1 = std::min(row_end, m0 + kRowChunk);
    for (int64_t g = group_begin; g < group_end; ++g) {
      const int valid = static_cast<int>(std::min<int64_t>(kGroup, N - g * kGroup));
      const float* group_bias = bias ? bias + g * kGroup : nullptr;
      for (int64_t r0 = m0; r0 < m1; r0 += kernel.max_rows) {
        const int tile = static_cast<int>(std::min<int64_t>(kernel.max_rows, m1 - r0));
        kernel.by_rows[tile](weight + g * layout.row_bytes, layout, activations, r0, group_bias, valid,
                             out.at(r0, g * kGroup));
      }
    }
  }
}

// out's [:, 0:N) = activations . W^T (+ bias) for one packed weight; exact: the sum over blocks
// is exact (the only way to get out.sums).
inline void quant_matmul(const QuantizedActivations& activations, int64_t M, const uint8_t* weight, int64_t N,
                         int64_t format, bool precise, bool exact, const float* bias, const ProductOut& out) {
  const GroupLayout layout(format, activations.in_features);
  const DotKernel& kernel = dot_kernel(format, precise, exact);
  const int64_t num_groups = (N + kGroup - 1) / kGroup;
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    matmul_groups(activations, 0, M, weight, layout, kernel, N, begin, end, bias, out);
  });
}

}  // namespace tokios
