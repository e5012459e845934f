// Activation rows quantized for the dot kernels: int8 blocks of 32 with one float scale each,
// and per block the sums that the weight formats' zero points and minimums need.
//
// Two precisions. 8-bit: q = round(x / s), s = max |x| / 127 per block, as llama.cpp does for its
// legacy types (and finer than its 256-wide blocks for K-quants). Precise: a second plane carries
// the rounding residual, lo = round((x / s - q) * 128) in [-64, 64], so x = s / 128 * (128 q + lo)
// to about 15 bits (finer than bfloat16); the kernel multiplies both planes and combines the sums
// exactly in int32. It costs the integer work twice. Measured on the default model (KL to float
// activations over the perplexity text, int4 weights): 8-bit 2.7e-3, spread evenly over the four
// products and the output projection.
//
// Every ISA path rounds the same way (to nearest even), so the integers do not depend on it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "blocks.h"
#include "isa.h"

namespace tokios {

struct QuantizedActivations {
  int64_t num_blocks = 0, in_features = 0, row_stride = 0;  // row_stride: K (8-bit) or 2K (precise)
  std::vector<int8_t> qs;           // [rows][row_stride]: q, then (precise) lo
  std::vector<float> scales;        // [rows][num_blocks]: s, or s / 128 when precise
  std::vector<float> scaled_sums;   // [rows][num_blocks]: scale * sum of the combined values
  std::vector<int32_t> sums;        // [rows][num_blocks]: sum of the combined values
  std::vector<int32_t> half_sums;   // [rows][num_blocks]: the same over the first 16 (Q6_K's scales)
};

#if TOKIOS_AVX2
inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t horizontal_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// 8 int32 -> 8 int8 stored at out (values already in int8 range).
inline void store_int8x8(int8_t* out, __m256i q) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(words, words));
}
#endif

template <bool PRECISE>
void quantize_row(const float* x, int64_t num_blocks, int64_t in_features, int8_t* qs, float* scales,
                  float* scaled_sums, int32_t* sums, int32_t* half_sums) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* qb = qs + b * kBlock;
    int8_t* lob = qs + in_features + b * kBlock;  // only written when PRECISE
    int32_t sum = 0, first_half = 0;
    float scale;
#if TOKIOS_VNNI
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.f;
    // A scale below FLT_MIN would overflow its inverse: such a block is zero for every purpose.
    const __m512 inverse = _mm512_set1_ps(scale >= FLT_MIN ? 1.f / scale : 0.f);
    int h = 0;
    for (const __m512 half : {x0, x1}) {
      const __m512 scaled = _mm512_mul_ps(half, inverse);
      const __m512i q = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16 * h), _mm512_cvtepi32_epi8(q));
      __m512i combined = q;
      if constexpr (PRECISE) {
        const __m512 residual = _mm512_mul_ps(_mm512_sub_ps(scaled, _mm512_cvtepi32_ps(q)), _mm512_set1_ps(128.f));
        const __m512i lo = _mm512_cvt_roundps_epi32(residual, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lob + 16 * h), _mm512_cvtepi32_epi8(lo));
        combined = _mm512_add_epi32(_mm512_slli_epi32(q, 7), lo);
      }
      const int32_t part = _mm512_reduce_add_epi32(combined);
      if (h == 0) first_half = part;
      sum += part;
      ++h;
    }
#elif TOKIOS_AVX2
    __m256 chunks[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign_bit = _mm256_set1_ps(-0.f);
    for (int c = 0; c < 4; ++c) {
      chunks[c] = _mm256_loadu_ps(xb + 8 * c);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, chunks[c]));
    }
    scale = horizontal_max(amax) / 127.f;
    const __m256 inverse = _mm256_set1_ps(scale >= FLT_MIN ? 1.f / scale : 0.f);
    for (int c = 0; c < 4; ++c) {
      const __m256 scaled = _mm256_mul_ps(chunks[c], inverse);
      const __m256i q = _mm256_cvtps_epi32(scaled);  // round to nearest even (the default mode)
      store_int8x8(qb + 8 * c, q);
      __m256i combined = q;
      if constexpr (PRECISE) {
        const __m256 residual = _mm256_mul_ps(_mm256_sub_ps(scaled, _mm256_cvtepi32_ps(q)), _mm256_set1_ps(128.f));
        const __m256i lo = _mm256_cvtps_epi32(residual);
        store_int8x8(lob + 8 * c, lo);
        combined = _mm256_add_epi32(_mm256_slli_epi32(q, 7), lo);
      }
      const int32_t part = horizontal_sum(combined);
      if (c < 2) first_half += part;
      sum += part;
    }
#else
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    scale = amax / 127.f;
    const float inverse = scale >= FLT_MIN ? 1.f / scale : 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      const float scaled = xb[j] * inverse;
      const int q = static_cast<int>(std::nearbyint(scaled));
      qb[j] = static_cast<int8_t>(q);
      int combined = q;
      if constexpr (PRECISE) {
        const int lo = static_cast<int>(std::nearbyint((scaled - static_cast<float>(q)) * 128.f));
        lob[j] = static_cast<int8_t>(lo);
        combined = 128 * q + lo;
      }
      if (j < 16) first_half += combined;
      sum += combined;
    }
#endif
    if constexpr (PRECISE) scale /= 128.f;
    scales[b] = scale;
    scaled_sums[b] = scale * static_cast<float>(sum);
    sums[b] = sum;
    half_sums[b] = first_half;
  }
}

inline void quantize_activations(const float* x, int64_t M, int64_t K, bool precise, QuantizedActivations& a) {
  a.num_blocks = K / kBlock;
  a.in_features = K;
  a.row_stride = precise ? 2 * K : K;
  // The buffers are reused from call to call (only grown): zero-filling or reallocating per call
  // measured 3% of a 16-row decode step.
  const size_t per_block = static_cast<size_t>(M * a.num_blocks);
  a.qs.resize(std::max<size_t>(a.qs.size(), M * a.row_stride));
  for (auto* v : {&a.scales, &a.scaled_sums}) v->resize(std::max(v->size(), per_block));
  for (auto* v : {&a.sums, &a.half_sums}) v->resize(std::max(v->size(), per_block));
  const auto quantize = precise ? &quantize_row<true> : &quantize_row<false>;
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t at = m * a.num_blocks;
      quantize(x + m * K, a.num_blocks, K, a.qs.data() + m * a.row_stride, a.scales.data() + at,
               a.scaled_sums.data() + at, a.sums.data() + at, a.half_sums.data() + at);
    }
  });
}

}  // namespace tokios
