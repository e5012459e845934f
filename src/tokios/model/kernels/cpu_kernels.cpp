// Weight-only quantized linear layers for the CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias), and
// the decode step around them (RMSNorm, rotary embedding, paged decode attention, SiLU).
//
// Weights come from GGML's block formats, one row of blocks per output feature:
//   Q4_1 (20 bytes / 32 weights): fp16 scale d, fp16 minimum m, 16 bytes of nibbles;
//        w[j] = d * q[j] + m, element j in the low nibble of byte j, element j+16 in the high.
//   Q8_0 (34 bytes / 32 weights): fp16 scale d, 32 signed bytes; w[j] = d * q[j].
// and are regrouped once at load into an interleaved layout (pack_weight, below) with the same
// bytes per weight. Activations are quantized per row to 8-bit blocks of 32 (one scale per
// block), as llama.cpp does, so a block's dot product is integer arithmetic on VNNI (vpdpbusd:
// u8 x s8 products summed in groups of 4 into int32 lanes). Why: decode reads every weight once
// per step, so bytes per weight set the single-stream speed (4-bit blocks read ~5 bits per
// weight instead of 32); with a batch of decodes, or a prefill chunk, the same weights serve many
// rows and the product becomes compute-bound, which the layout is built for (see GroupLayout).
// Every row takes the same kernel, decode or prefill, so results do not depend on the batch.
//
// The KV cache is float32 or bfloat16 (half the memory; the attention converts on load).
//
// Threads: at::parallel_for, so torch.set_num_threads governs it.
// A portable scalar path (the same integer sums; float rounding may differ in the last bits) is
// compiled when AVX-512 VNNI is not available.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TOKIOS_VNNI 1
#else
#define TOKIOS_VNNI 0
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ8_0Bytes = 34;

#if !TOKIOS_VNNI
// IEEE fp16 -> fp32 without F16C (the scalar path; the VNNI path converts 16 at a time).
inline float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu, bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {
      exponent = 127 - 15 + 1;
      while (!(mantissa & 0x400u)) { mantissa <<= 1; --exponent; }
      bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
#endif

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ---- the interleaved layout ---------------------------------------------------------------------
// At load the file's blocks are regrouped so that 16 output features share one 512-bit vector:
// 32-bit lane j holds 4 consecutive weights of output feature j. One vpdpbusd then multiplies
// 4 activations (broadcast) by 4 weights of each of 16 features, and the 8 instructions of a
// block accumulate in int32, so the float work (conversion, scale, FMA) is paid once per
// block for 16 features instead of once per pair of blocks for one. The profile of the
// row-major kernel had 16 rows costing about 8x one row for exactly that per-row float work.
//
// Per group of 16 features (rows past N are zero) and block b, as one row of the packed tensor:
//   values  [num_blocks][V]: Q4_1 V = 256: vector t (0..3), lane j = bytes 4t..4t+3 of feature
//                            j's nibbles; low nibbles pair with x[4t..], high with x[16+4t..].
//                            Q8_0 V = 512: vector t (0..7), lane j = q[4t..4t+3] + 128 (unsigned,
//                            as vpdpbusd wants; the 128 * sum(x) it adds is subtracted exactly).
//   halves  [num_blocks][S]: 16 fp16 scales d, then (Q4_1) 16 fp16 minimums m.
// The row is padded to 64 bytes. Same bytes per weight as the file (Q4_1 5, Q8_0 8.5 bits).
constexpr int64_t kGroup = 16;

struct GroupLayout {
  int64_t num_blocks, value_bytes, halves_per_block, row_bytes;
  GroupLayout(int64_t format, int64_t in_features)
      : num_blocks(in_features / kBlock), value_bytes(format == 0 ? 256 : 512),
        halves_per_block(format == 0 ? 32 : 16),
        row_bytes((num_blocks * (value_bytes + 2 * halves_per_block) + 63) / 64 * 64) {}
  const uint16_t* halves(const uint8_t* group_row) const {
    return reinterpret_cast<const uint16_t*>(group_row + num_blocks * value_bytes);
  }
};

// GGML blocks [N, num_blocks * block_bytes] -> [ceil(N / 16), row_bytes], the layout above.
void pack_groups(const uint8_t* blocks, int64_t N, int64_t format, const GroupLayout& layout, uint8_t* out) {
  const int64_t block_bytes = format == 0 ? kQ4_1Bytes : kQ8_0Bytes, nb = layout.num_blocks;
  const int64_t num_groups = (N + kGroup - 1) / kGroup;
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      uint8_t* row = out + g * layout.row_bytes;
      std::memset(row, 0, layout.row_bytes);
      uint16_t* halves = reinterpret_cast<uint16_t*>(row + nb * layout.value_bytes);
      for (int64_t j = 0; j < kGroup && g * kGroup + j < N; ++j) {
        const uint8_t* feature = blocks + (g * kGroup + j) * nb * block_bytes;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* block = feature + b * block_bytes;
          uint8_t* values = row + b * layout.value_bytes;
          halves[b * layout.halves_per_block + j] = load_u16(block);
          if (format == 0) {
            halves[b * layout.halves_per_block + kGroup + j] = load_u16(block + 2);
            for (int t = 0; t < 4; ++t) std::memcpy(values + 64 * t + 4 * j, block + 4 + 4 * t, 4);
          } else {
            for (int t = 0; t < 8; ++t) {
              for (int i = 0; i < 4; ++i) values[64 * t + 4 * j + i] = block[2 + 4 * t + i] ^ 0x80;
            }
          }
        }
      }
    }
  });
}

// Activation rows quantized for the dot kernel: int8 blocks of 32 with one float scale each,
// and per block the two correction terms: Q4_1's minimum term needs scale * sum(q); Q8_0's
// offset weights need 128 * sum(q) (integer, subtracted exactly).
//
// Two precisions. 8-bit: q = round(x / s), s = max |x| / 127 per block, as llama.cpp does.
// Precise: a second plane carries the rounding residual, lo = round((x / s - q) * 128) in
// [-64, 64], so x = s / 128 * (128 q + lo) to about 15 bits (finer than bfloat16); the kernel
// runs vpdpbusd on both planes and combines the sums exactly in int32. It costs the integer work
// twice. Measured on the default model (KL to float activations over the perplexity text, int4
// weights): 8-bit 2.7e-3, spread evenly over the four products and the output projection.
struct QuantizedActivations {
  int64_t num_blocks = 0, in_features = 0, row_stride = 0;  // row_stride: K (8-bit) or 2K (precise)
  std::vector<int8_t> qs;           // [rows][row_stride]: q, then (precise) lo
  std::vector<float> scales;        // [rows][num_blocks]: s, or s / 128 when precise
  std::vector<float> scaled_sums;   // [rows][num_blocks]: scale * sum of the combined values
  std::vector<int32_t> offsets;     // [rows][num_blocks]: 128 * sum of the combined values
};

template <bool PRECISE>
void quantize_row(const float* x, int64_t num_blocks, int64_t in_features, int8_t* qs, float* scales,
                  float* scaled_sums, int32_t* offsets) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* qb = qs + b * kBlock;
    int8_t* lob = qs + in_features + b * kBlock;  // only written when PRECISE
    int32_t sum = 0;
    float scale;
#if TOKIOS_VNNI
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.f;
    // A scale below FLT_MIN would overflow its inverse: such a block is zero for every purpose.
    const __m512 inverse = _mm512_set1_ps(scale >= FLT_MIN ? 1.f / scale : 0.f);
    __m512i total = _mm512_setzero_si512();
    int h = 0;
    for (const __m512 half : {x0, x1}) {
      const __m512 scaled = _mm512_mul_ps(half, inverse);
      const __m512i q = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16 * h), _mm512_cvtepi32_epi8(q));
      if constexpr (PRECISE) {
        const __m512 residual = _mm512_mul_ps(_mm512_sub_ps(scaled, _mm512_cvtepi32_ps(q)), _mm512_set1_ps(128.f));
        const __m512i lo = _mm512_cvt_roundps_epi32(residual, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lob + 16 * h), _mm512_cvtepi32_epi8(lo));
        total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_slli_epi32(q, 7), lo));
      } else {
        total = _mm512_add_epi32(total, q);
      }
      ++h;
    }
    sum = _mm512_reduce_add_epi32(total);
#else
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    scale = amax / 127.f;
    const float inverse = scale >= FLT_MIN ? 1.f / scale : 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      const float scaled = xb[j] * inverse;
      const int q = static_cast<int>(std::nearbyint(scaled));
      qb[j] = static_cast<int8_t>(q);
      if constexpr (PRECISE) {
        const int lo = static_cast<int>(std::nearbyint((scaled - static_cast<float>(q)) * 128.f));
        lob[j] = static_cast<int8_t>(lo);
        sum += 128 * q + lo;
      } else {
        sum += q;
      }
    }
#endif
    if constexpr (PRECISE) scale /= 128.f;
    scales[b] = scale;
    scaled_sums[b] = scale * static_cast<float>(sum);
    offsets[b] = 128 * sum;
  }
}

void quantize_activations(const float* x, int64_t M, int64_t K, bool precise, QuantizedActivations& a) {
  a.num_blocks = K / kBlock;
  a.in_features = K;
  a.row_stride = precise ? 2 * K : K;
  // The buffers are reused from call to call (only grown): zero-filling or reallocating per call
  // measured 3% of a 16-row decode step.
  const size_t per_block = static_cast<size_t>(M * a.num_blocks);
  a.qs.resize(std::max<size_t>(a.qs.size(), M * a.row_stride));
  for (auto* v : {&a.scales, &a.scaled_sums}) v->resize(std::max(v->size(), per_block));
  a.offsets.resize(std::max(a.offsets.size(), per_block));
  const auto quantize = precise ? &quantize_row<true> : &quantize_row<false>;
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int64_t at = m * a.num_blocks;
      quantize(x + m * K, a.num_blocks, K, a.qs.data() + m * a.row_stride, a.scales.data() + at,
               a.scaled_sums.data() + at, a.offsets.data() + at);
    }
  });
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// out[r][0..16) (row stride out_stride; only the `valid` first features are written) = the dot
// products of one group of 16 features with activation rows r0..r0+R, plus bias. Each row keeps
// its own accumulators and adds its blocks in the same order whatever R is, so a row's result is
// the same alone or in a batch (R = 1 is the single-row case, not a separate kernel).
constexpr int kTileRows = 8;  // measured: 12 was 10% slower, 16 spills registers
constexpr int64_t kPrefetchDistance = 16384;  // bytes; 4 KiB gained less (31 GB/s), 8 KiB 33

template <int FORMAT, bool PRECISE, int R>
void dot_group_rows(const uint8_t* group_row, const GroupLayout& layout, const QuantizedActivations& a, int64_t r0,
                    const float* bias, int valid, float* out, int64_t out_stride) {
  const int64_t nb = layout.num_blocks, K = a.in_features, stride = a.row_stride;
  const uint16_t* halves = layout.halves(group_row);
  const int8_t* x0 = a.qs.data() + r0 * stride;
#if TOKIOS_VNNI
  constexpr int P = PRECISE ? 2 : 1;  // activation planes: q, then the residual
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* values = group_row + b * layout.value_bytes;
    const int8_t* xb = x0 + b * kBlock;
    {
      // The hardware prefetcher alone kept one row's stream of weights at about 23 GB/s on the
      // Q8_0 output projection (the row-major layout: 30-36) and batches short of requests in
      // flight too. Asking for the bytes 16 KiB ahead into L2 brought one row to 33 GB/s, and
      // decode at batch 16 from about 1,075 to 1,310-1,360 tok/s. Past the end of the weight a
      // prefetch is a no-op (the address is formed as an integer, never as an out-of-range pointer).
      const int64_t bytes_per_block = layout.row_bytes / nb;
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(group_row) + kPrefetchDistance + b * bytes_per_block;
      for (int64_t line = 0; line < bytes_per_block + 64; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T1);
      }
    }
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
    if constexpr (FORMAT == 0) {
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
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + b * layout.halves_per_block)));
    const int64_t at = r0 * nb + b;
    if constexpr (FORMAT == 0) {
      const __m512 m = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + b * layout.halves_per_block + kGroup)));
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact[r]), _mm512_mul_ps(d, _mm512_set1_ps(a.scales[at + r * nb])), acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.scaled_sums[at + r * nb]), acc[r]);
      }
    } else {
      for (int r = 0; r < R; ++r) {
        const __m512i centred = _mm512_sub_epi32(exact[r], _mm512_set1_epi32(a.offsets[at + r * nb]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(d, _mm512_set1_ps(a.scales[at + r * nb])), acc[r]);
      }
    }
  }
  const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * out_stride, lanes, _mm512_add_ps(acc[r], b));
#else
  for (int r = 0; r < R; ++r) {
    float acc[kGroup] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* values = group_row + b * layout.value_bytes;
      const int8_t* xb = x0 + r * stride + b * kBlock;
      const int64_t at = (r0 + r) * nb + b;
      for (int j = 0; j < kGroup; ++j) {
        int32_t dot = 0;
        for (int p = 0; p < (PRECISE ? 2 : 1); ++p) {
          const int8_t* x = xb + p * K;
          int32_t plane = 0;
          for (int t = 0; t < (FORMAT == 0 ? 4 : 8); ++t) {
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = values[64 * t + 4 * j + i];
              if (FORMAT == 0) {
                plane += (byte & 0x0f) * x[4 * t + i] + (byte >> 4) * x[16 + 4 * t + i];
              } else {
                plane += byte * x[4 * t + i];
              }
            }
          }
          dot = PRECISE && p == 0 ? 128 * plane : dot + plane;
        }
        const float d = half_to_float(halves[b * layout.halves_per_block + j]);
        if (FORMAT == 0) {
          const float m = half_to_float(halves[b * layout.halves_per_block + kGroup + j]);
          acc[j] += static_cast<float>(dot) * (d * a.scales[at]) + m * a.scaled_sums[at];
        } else {
          acc[j] += static_cast<float>(dot - a.offsets[at]) * (d * a.scales[at]);
        }
      }
    }
    for (int j = 0; j < valid; ++j) out[r * out_stride + j] = acc[j] + (bias ? bias[j] : 0.f);
  }
#endif
}

using DotGroupFunction = void (*)(const uint8_t*, const GroupLayout&, const QuantizedActivations&, int64_t,
                                  const float*, int, float*, int64_t);
using DotGroupTable = std::array<DotGroupFunction, kTileRows + 1>;  // by tile rows; [0] unused

template <int FORMAT, bool PRECISE, size_t... Rs>
constexpr DotGroupTable dot_group_table(std::index_sequence<Rs...>) {
  return {nullptr, &dot_group_rows<FORMAT, PRECISE, static_cast<int>(Rs) + 1>...};
}
// [format][precise]
constexpr std::array<std::array<DotGroupTable, 2>, 2> kDotGroup = {{
    {dot_group_table<0, false>(std::make_index_sequence<kTileRows>()),
     dot_group_table<0, true>(std::make_index_sequence<kTileRows>())},
    {dot_group_table<1, false>(std::make_index_sequence<kTileRows>()),
     dot_group_table<1, true>(std::make_index_sequence<kTileRows>())},
}};

// y[M, N] = x[M, K] . W^T (+ bias), W packed by pack_groups from Q4_1 (format 0) or Q8_0 (format 1),
// activations 8-bit or precise (see QuantizedActivations). Each output element is one dot product
// computed the same way whatever M is, so a row's result does not depend on what else is in the
// batch, decode or prefill.
void quant_matmul(const float* x, int64_t M, int64_t K, const uint8_t* weight, int64_t N, int64_t format,
                  bool precise, const float* bias, float* out) {
  const GroupLayout layout(format, K);
  // Reused from call to call. A thread_local named inside the lambdas below would be each worker
  // thread's own (empty) copy, so they use this reference to the calling thread's.
  thread_local QuantizedActivations buffer;
  QuantizedActivations& activations = buffer;
  quantize_activations(x, M, K, precise, activations);
  const DotGroupTable& kernels = kDotGroup[format][precise];
  const int64_t num_groups = (N + kGroup - 1) / kGroup;
  // A group's weights (at most a few KiB per 576 inputs) stay in L1 while tiles of rows pass over
  // them; rows are taken 64 at a time so that their activations stay in L2 (long prefill chunks).
  constexpr int64_t kRowChunk = 64;
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int64_t m1 = std::min(M, m0 + kRowChunk);
      for (int64_t g = begin; g < end; ++g) {
        const int valid = static_cast<int>(std::min<int64_t>(kGroup, N - g * kGroup));
        const float* group_bias = bias ? bias + g * kGroup : nullptr;
        for (int64_t r0 = m0; r0 < m1; r0 += kTileRows) {
          const int tile = static_cast<int>(std::min<int64_t>(kTileRows, m1 - r0));
          kernels[tile](weight + g * layout.row_bytes, layout, activations, r0, group_bias, valid,
                        out + r0 * N + g * kGroup, N);
        }
      }
    }
  });
}

// The elementwise steps run on every thread too: serial, they left the other thread spinning at
// the next parallel region's barrier (12% of a 16-row decode step in the profile).
void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * dim;
      float sum_squares = 0.f;
      for (int64_t j = 0; j < dim; ++j) sum_squares += xr[j] * xr[j];
      const float inverse = 1.f / std::sqrt(sum_squares / static_cast<float>(dim) + eps);
      for (int64_t j = 0; j < dim; ++j) out[r * dim + j] = xr[j] * inverse * weight[j];
    }
  });
}

// In place on heads [num_heads, head_dim] of one token (Hugging Face "rotate half" layout).
void rotate(float* heads, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x = heads + h * head_dim;
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = x[j], x2 = x[j + half];
      x[j] = x1 * cos[j] - x2 * sin[j];
      x[j + half] = x2 * cos[j + half] + x1 * sin[j + half];
    }
  }
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim;
};

// KV cache elements: float32, or bfloat16 (round to nearest even on write, exact widening on read).
inline void store_kv(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_kv(at::BFloat16* dst, const float* src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = at::BFloat16(src[j]);
}
inline float load_kv(float v) { return v; }
inline float load_kv(at::BFloat16 v) { return static_cast<float>(v); }
#if TOKIOS_VNNI
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// qkv [T, (H + 2 KVH) * hd]: rotates q and k in place and writes k, v into the caches.
template <typename KV>
void rope_and_write(float* qkv, int64_t num_tokens, const int64_t* positions, const float* cos_table,
                    const float* sin_table, KV* key_cache, KV* value_cache, const int64_t* slot_mapping,
                    const Shape& shape) {
  const int64_t hd = shape.head_dim, q_size = shape.num_heads * hd, kv_size = shape.num_kv_heads * hd;
  const int64_t row = q_size + 2 * kv_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* token = qkv + t * row;
    const float* cos = cos_table + positions[t] * hd;
    const float* sin = sin_table + positions[t] * hd;
    rotate(token, shape.num_heads, hd, cos, sin);
    rotate(token + q_size, shape.num_kv_heads, hd, cos, sin);
    store_kv(key_cache + slot_mapping[t] * kv_size, token + q_size, kv_size);
    store_kv(value_cache + slot_mapping[t] * kv_size, token + q_size + kv_size, kv_size);
  }
}

// Softmax weights in place over scores[0, length): exp(s - max), returns their sum.
inline float exponentiate(float* scores, int64_t length, float maximum) {
  float total = 0.f;
  for (int64_t l = 0; l < length; ++l) {
    scores[l] = std::exp(scores[l] - maximum);
    total += scores[l];
  }
  return total;
}

// One query head over its context: out = softmax(q . K^T * scale) V. `kv_stride` is the
// distance between slots and `kv_offset` the head's place inside a slot. CHUNKS = head_dim / 16
// selects the AVX-512 path (0: portable loops). The profile at 16 decode rows x 256 tokens of
// context had the portable loops at 1.0 ms per layer, as much as all four matrix products.
template <typename KV, int CHUNKS>
void attend_head(const float* query, const KV* key_cache, const KV* value_cache, const int64_t* slots,
                 int64_t length, int64_t kv_stride, int64_t kv_offset, int64_t hd, float scale, float* scores,
                 float* out) {
#if TOKIOS_VNNI
  if constexpr (CHUNKS > 0) {
    __m512 q[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) q[c] = _mm512_loadu_ps(query + 16 * c);
    float maximum = -INFINITY;
    for (int64_t l = 0; l < length; ++l) {
      const KV* key = key_cache + slots[l] * kv_stride + kv_offset;
      __m512 dot = _mm512_mul_ps(q[0], load16(key));
      for (int c = 1; c < CHUNKS; ++c) dot = _mm512_fmadd_ps(q[c], load16(key + 16 * c), dot);
      scores[l] = _mm512_reduce_add_ps(dot) * scale;
      maximum = std::max(maximum, scores[l]);
    }
    const float inverse = 1.f / exponentiate(scores, length, maximum);
    __m512 acc[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < length; ++l) {
      const KV* value = value_cache + slots[l] * kv_stride + kv_offset;
      const __m512 p = _mm512_set1_ps(scores[l]);
      for (int c = 0; c < CHUNKS; ++c) acc[c] = _mm512_fmadd_ps(p, load16(value + 16 * c), acc[c]);
    }
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inverse)));
    return;
  }
#endif
  float maximum = -INFINITY;
  for (int64_t l = 0; l < length; ++l) {
    const KV* key = key_cache + slots[l] * kv_stride + kv_offset;
    float dot = 0.f;
    for (int64_t j = 0; j < hd; ++j) dot += query[j] * load_kv(key[j]);
    scores[l] = dot * scale;
    maximum = std::max(maximum, scores[l]);
  }
  const float inverse = 1.f / exponentiate(scores, length, maximum);
  for (int64_t j = 0; j < hd; ++j) out[j] = 0.f;
  for (int64_t l = 0; l < length; ++l) {
    const KV* value = value_cache + slots[l] * kv_stride + kv_offset;
    for (int64_t j = 0; j < hd; ++j) out[j] += scores[l] * load_kv(value[j]);
  }
  for (int64_t j = 0; j < hd; ++j) out[j] *= inverse;
}

// One query token per request over its paged context. q rows are read from qkv (stride
// q_stride); out [D, H * hd]. Parallel over (request, head); a head's result does not depend on
// the batch.
template <typename KV>
void decode_attention_rows(const float* q, int64_t q_stride, const KV* key_cache, const KV* value_cache,
                           const int64_t* slot_table, int64_t max_context, const int64_t* context_lens,
                           int64_t num_requests, const Shape& shape, float scale, float* out) {
  const int64_t H = shape.num_heads, KVH = shape.num_kv_heads, hd = shape.head_dim;
  const int64_t group = H / KVH;
  auto attend = &attend_head<KV, 0>;
  if (hd == 16) attend = &attend_head<KV, 1>;
  if (hd == 32) attend = &attend_head<KV, 2>;
  if (hd == 64) attend = &attend_head<KV, 4>;
  if (hd == 128) attend = &attend_head<KV, 8>;
  at::parallel_for(0, num_requests * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(max_context);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t d = index / H, h = index % H;
      attend(q + d * q_stride + h * hd, key_cache, value_cache, slot_table + d * max_context, context_lens[d],
             KVH * hd, (h / group) * hd, hd, scale, scores.data(), out + d * H * hd + h * hd);
    }
  });
}

#if TOKIOS_VNNI
// exp on 16 lanes (Cephes' single-precision polynomial, about 1 ulp): std::exp one element at a
// time was 8% of a 128-token prefill and 3% of a 16-row decode step inside SiLU.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

void silu_mul_rows(const float* gate_up, int64_t rows, int64_t intermediate, float* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * intermediate;
      const float* up = gate + intermediate;
      float* o = out + r * intermediate;
      int64_t j = 0;
#if TOKIOS_VNNI
      for (; j + 16 <= intermediate; j += 16) {
        const __m512 g = _mm512_loadu_ps(gate + j);
        const __m512 sigmoid_denominator = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
        _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_div_ps(g, sigmoid_denominator), _mm512_loadu_ps(up + j)));
      }
#endif
      for (; j < intermediate; ++j) o[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
    }
  });
}

// ---- torch-facing ops (the model's per-op path uses these, so its results equal the fused path) --
void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name, " must be contiguous float32");
}

// GGML blocks [N, num_blocks * block_bytes] -> the kernel's packed groups [ceil(N / 16), row_bytes].
torch::Tensor pack_weight(const torch::Tensor& blocks, int64_t format, int64_t in_features) {
  TORCH_CHECK(format == 0 || format == 1, "format must be 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(in_features % kBlock == 0, "in_features must be a multiple of 32");
  const int64_t block_bytes = format == 0 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(blocks.device().is_cpu(), "blocks must be on the CPU");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.size(1) == in_features / kBlock * block_bytes,
              "blocks must be 2-D uint8 with in_features / 32 blocks per row");
  const torch::Tensor source = blocks.contiguous();
  const GroupLayout layout(format, in_features);
  const int64_t N = source.size(0);
  torch::Tensor out = torch::empty({(N + kGroup - 1) / kGroup, layout.row_bytes}, source.options());
  pack_groups(source.data_ptr<uint8_t>(), N, format, layout, out.data_ptr<uint8_t>());
  return out;
}

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t format, int64_t out_features,
                           bool precise, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "x and weight must be on the CPU");
  TORCH_CHECK(format == 0 || format == 1, "format must be 0 (Q4_1) or 1 (Q8_0)");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % kBlock == 0, "in_features must be a multiple of 32");
  const GroupLayout layout(format, K);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8 && weight.is_contiguous() &&
                  weight.size(0) == (N + kGroup - 1) / kGroup && weight.size(1) == layout.row_bytes,
              "weight must be packed by pack_weight for these in_features and out_features");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == N && bias->scalar_type() == torch::kFloat32 && bias->is_contiguous()),
              "bias must be contiguous float32 with out_features elements");
  const torch::Tensor input = x.contiguous();
  torch::Tensor out = torch::empty({M, N}, x.options());
  quant_matmul(input.data_ptr<float>(), M, K, weight.data_ptr<uint8_t>(), N, format, precise,
               bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const torch::Tensor input = x.contiguous();
  check_f32(input, "x");
  check_f32(weight, "weight");
  torch::Tensor out = torch::empty_like(input);
  const int64_t dim = input.size(-1);
  rms_norm_rows(input.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), input.numel() / dim, dim,
                static_cast<float>(eps));
  return out;
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  const torch::Tensor input = gate_up.contiguous();
  check_f32(input, "gate_up");
  const int64_t intermediate = input.size(-1) / 2, rows = input.numel() / input.size(-1);
  torch::Tensor out = torch::empty({rows, intermediate}, input.options());
  silu_mul_rows(input.data_ptr<float>(), rows, intermediate, out.data_ptr<float>());
  return out;
}

// Calls fn(key, value) with the caches' data as float* or at::BFloat16*.
template <typename Fn>
void with_kv_cache(const torch::Tensor& key_cache, const torch::Tensor& value_cache, Fn&& fn) {
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && value_cache.scalar_type() == dtype &&
                  key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the KV cache must be contiguous float32 or bfloat16, the same for keys and values; got ",
              key_cache.scalar_type(), " and ", value_cache.scalar_type());
  if (dtype == torch::kBFloat16) {
    fn(key_cache.data_ptr<at::BFloat16>(), value_cache.data_ptr<at::BFloat16>());
  } else {
    fn(key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
  }
}

// qkv [T, (H + 2 KVH) hd] float32, rotated in place; k and v written to the caches.
void rope_write_kv(torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                   const torch::Tensor& sin, torch::Tensor& key_cache, torch::Tensor& value_cache,
                   const torch::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_f32(qkv, "qkv");
  with_kv_cache(key_cache, value_cache, [&](auto* keys, auto* values) {
    rope_and_write(qkv.data_ptr<float>(), qkv.size(0), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                   sin.data_ptr<float>(), keys, values, slot_mapping.data_ptr<int64_t>(),
                   Shape{num_heads, num_kv_heads, head_dim});
  });
}

// q rows: the first num_heads*head_dim columns of qkv [D, ...]; returns [D, num_heads*head_dim].
torch::Tensor decode_attention(const torch::Tensor& qkv, const torch::Tensor& key_cache,
                               const torch::Tensor& value_cache, const torch::Tensor& slot_table,
                               const torch::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, double scale) {
  check_f32(qkv, "qkv");
  const int64_t D = slot_table.size(0);
  torch::Tensor out = torch::empty({D, num_heads * head_dim}, qkv.options());
  with_kv_cache(key_cache, value_cache, [&](auto* keys, auto* values) {
    decode_attention_rows(qkv.data_ptr<float>(), qkv.size(1), keys, values, slot_table.data_ptr<int64_t>(),
                          slot_table.size(1), context_lens.data_ptr<int64_t>(), D,
                          Shape{num_heads, num_kv_heads, head_dim}, static_cast<float>(scale), out.data_ptr<float>());
  });
  return out;
}

// All layers of a decode-only step in one call: no Python between operations. Uses exactly
// the functions above, in the model's order, so its rows equal the per-op path's.
class FusedDecoder {
 public:
  FusedDecoder(std::vector<torch::Tensor> input_norms, std::vector<torch::Tensor> post_norms,
               std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> qkv_bias, std::vector<torch::Tensor> o_proj,
               std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down, int64_t format, bool precise,
               std::vector<torch::Tensor> key_caches, std::vector<torch::Tensor> value_caches, torch::Tensor cos,
               torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
               int64_t intermediate_size, double eps)
      : input_norms_(std::move(input_norms)), post_norms_(std::move(post_norms)), qkv_(std::move(qkv)),
        qkv_bias_(std::move(qkv_bias)), o_proj_(std::move(o_proj)), gate_up_(std::move(gate_up)),
        down_(std::move(down)), format_(format), precise_(precise), key_caches_(std::move(key_caches)),
        value_caches_(std::move(value_caches)), cos_(std::move(cos)), sin_(std::move(sin)),
        shape_{num_heads, num_kv_heads, head_dim}, hidden_size_(hidden_size),
        intermediate_size_(intermediate_size), eps_(static_cast<float>(eps)) {}

  // hidden [D, hidden] float32 -> hidden after every layer (before the final norm).
  torch::Tensor forward(const torch::Tensor& hidden_in, const torch::Tensor& positions,
                        const torch::Tensor& slot_mapping, const torch::Tensor& slot_table,
                        const torch::Tensor& context_lens) {
    torch::Tensor hidden = hidden_in.contiguous().clone();
    check_f32(hidden, "hidden");
    const int64_t D = hidden.size(0), H = hidden_size_;
    const int64_t q_size = shape_.num_heads * shape_.head_dim, kv_size = shape_.num_kv_heads * shape_.head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    // Scratch kept across steps: allocating it per step faulted in fresh pages every time.
    for (auto [buffer, size] : {std::pair{&normed_, D * H}, {&qkv_out_, D * qkv_size}, {&attended_, D * q_size},
                                {&projected_, D * H}, {&gate_up_out_, D * 2 * intermediate_size_},
                                {&activated_, D * intermediate_size_}}) {
      if (static_cast<int64_t>(buffer->size()) < size) buffer->resize(size);
    }
    std::vector<float>&normed = normed_, &qkv = qkv_out_, &attended = attended_, &projected = projected_,
                      &gate_up = gate_up_out_, &activated = activated_;
    float* h = hidden.data_ptr<float>();
    const float scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));
    for (size_t layer = 0; layer < qkv_.size(); ++layer) {
      rms_norm_rows(h, input_norms_[layer].data_ptr<float>(), normed.data(), D, H, eps_);
      const float* bias = qkv_bias_.empty() ? nullptr : qkv_bias_[layer].data_ptr<float>();
      quant_matmul(normed.data(), D, H, qkv_[layer].data_ptr<uint8_t>(), qkv_size, format_, precise_, bias, qkv.data());
      with_kv_cache(key_caches_[layer], value_caches_[layer], [&](auto* keys, auto* values) {
        rope_and_write(qkv.data(), D, positions.data_ptr<int64_t>(), cos_.data_ptr<float>(), sin_.data_ptr<float>(),
                       keys, values, slot_mapping.data_ptr<int64_t>(), shape_);
        decode_attention_rows(qkv.data(), qkv_size, keys, values, slot_table.data_ptr<int64_t>(), slot_table.size(1),
                              context_lens.data_ptr<int64_t>(), D, shape_, scale, attended.data());
      });
      quant_matmul(attended.data(), D, q_size, o_proj_[layer].data_ptr<uint8_t>(), H, format_, precise_, nullptr, projected.data());
      for (int64_t i = 0; i < D * H; ++i) h[i] += projected[i];
      rms_norm_rows(h, post_norms_[layer].data_ptr<float>(), normed.data(), D, H, eps_);
      quant_matmul(normed.data(), D, H, gate_up_[layer].data_ptr<uint8_t>(), 2 * intermediate_size_, format_, precise_, nullptr,
                   gate_up.data());
      silu_mul_rows(gate_up.data(), D, intermediate_size_, activated.data());
      quant_matmul(activated.data(), D, intermediate_size_, down_[layer].data_ptr<uint8_t>(), H, format_, precise_, nullptr,
                   projected.data());
      for (int64_t i = 0; i < D * H; ++i) h[i] += projected[i];
    }
    return hidden;
  }

 private:
  std::vector<torch::Tensor> input_norms_, post_norms_, qkv_, qkv_bias_, o_proj_, gate_up_, down_;
  int64_t format_;
  bool precise_;
  std::vector<torch::Tensor> key_caches_, value_caches_;
  torch::Tensor cos_, sin_;
  Shape shape_;
  int64_t hidden_size_, intermediate_size_;
  float eps_;
  std::vector<float> normed_, qkv_out_, attended_, projected_, gate_up_out_, activated_;
};

bool has_vnni() { return TOKIOS_VNNI; }

}  // namespace

// Every op releases the GIL: the engine steps in a background thread, and a kernel holding the
// GIL would make the server's event loop wait out Python's 5 ms switch interval on every token
// (measured: AsyncEngine TPOT 11.4 ms vs 6.6 ms for the same step run offline).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  module.def("pack_weight", &pack_weight, "Q4_1 / Q8_0 blocks -> the kernel's interleaved groups of 16 features",
             release_gil());
  module.def("quant_linear", &quant_linear, "y = x W^T (+ bias) with W packed by pack_weight", release_gil());
  module.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32)", release_gil());
  module.def("silu_mul", &silu_mul, "silu(gate) * up from a fused [rows, 2 * intermediate] tensor", release_gil());
  module.def("rope_write_kv", &rope_write_kv, "rotate q and k of a fused qkv tensor in place; write k, v to the cache",
             release_gil());
  module.def("decode_attention", &decode_attention, "one query token per request over its paged KV context",
             release_gil());
  module.def("has_vnni", &has_vnni, "whether the AVX-512 VNNI path was compiled");
  pybind11::class_<FusedDecoder>(module, "FusedDecoder")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, int64_t, bool, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("forward", &FusedDecoder::forward, release_gil());
}
