// Weight-only quantized linear layers for the CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias), and
// the decode step around them (RMSNorm, rotary embedding, paged decode attention, SiLU).
//
// Weights are stored in GGML's block formats, one row of blocks per output feature:
//   Q4_1 (20 bytes / 32 weights): fp16 scale d, fp16 minimum m, 16 bytes of nibbles;
//        w[j] = d * q[j] + m, element j in the low nibble of byte j, element j+16 in the high.
//   Q8_0 (34 bytes / 32 weights): fp16 scale d, 32 signed bytes; w[j] = d * q[j].
// Activations are quantized per row to 8-bit blocks of 32 (one scale per block), as llama.cpp
// does, so a block's dot product is integer arithmetic on VNNI (vpdpbusd: u8 x s8 products
// summed in groups of 4 into int32 lanes). Why: decode reads every weight once per step, so
// bytes per weight set the single-stream speed; 4-bit blocks read ~5 bits per weight instead of
// 32 (float32). With a batch of decodes the same weights serve many rows and the step becomes
// compute-bound: a weight row is unpacked once for a tile of up to 16 activation rows, and the
// Q4_1 kernel works on two blocks per 512-bit instruction with its minimum term as a separate
// dot product over 16 blocks (the profile had a one-block kernel busy with per-block scalar
// work; docs/benchmarks.md). Even so 16 rows cost about 8x one row: per row and pair of blocks
// the kernel still issues vpdpbusd, a conversion, the scale product and an FMA.
//
// The KV cache is float32 or bfloat16 (half the memory; the attention converts on load).
//
// Threads: at::parallel_for, so torch.set_num_threads governs it.
// A portable scalar path (same arithmetic) is compiled when AVX-512 VNNI is not available.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__F16C__)
#include <immintrin.h>
#define TOKIOS_VNNI 1
#else
#define TOKIOS_VNNI 0
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ8_0Bytes = 34;

inline float half_to_float(uint16_t h) {
#if TOKIOS_VNNI
  return _cvtsh_ss(h);
#else
  // IEEE fp16 -> fp32 without F16C.
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
#endif
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Activation rows quantized for the dot kernel: int8 blocks of 32 with one float scale each.
// Rows are padded to whole pairs of blocks (zeros), because the kernel reads two blocks at a time.
// Per pair of blocks the kernel also needs the scales spread over the lanes of its 512-bit
// accumulator (lanes 0-7: first block, 8-15: second). Q4_1's minimum term, m * scale * sum(q)
// per block, is a separate dot product over blocks (16 per instruction), so each row keeps the
// scaled sums, zero-padded to a multiple of 16 blocks.
struct QuantizedActivations {
  int64_t num_blocks = 0, num_pairs = 0, row_stride = 0;  // row_stride = bytes of qs per row
  int64_t sums_stride = 0;       // num_blocks rounded up to 16
  std::vector<int8_t> qs;            // [rows][row_stride]
  std::vector<float> scale_lanes;    // [rows][num_pairs][16]
  std::vector<float> scales;         // [rows][num_blocks] (scalar path)
  std::vector<float> scaled_sums;    // [rows][sums_stride]
};

void quantize_row(const float* x, int64_t num_blocks, int8_t* qs, float* scales, float* scaled_sums) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f;
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inverse));
      qs[b * kBlock + j] = static_cast<int8_t>(v);
      sum += v;
    }
    scales[b] = scale;
    scaled_sums[b] = scale * static_cast<float>(sum);
  }
}

void quantize_activations(const float* x, int64_t M, int64_t K, QuantizedActivations& a) {
  a.num_blocks = K / kBlock;
  a.num_pairs = (a.num_blocks + 1) / 2;
  a.row_stride = a.num_pairs * 2 * kBlock;
  a.sums_stride = (a.num_blocks + 15) / 16 * 16;
  // The buffers are reused from call to call (only grown), so every element is written below,
  // padding included: zero-filling whole buffers per call measured 3% of a 16-row decode step.
  a.qs.resize(std::max<size_t>(a.qs.size(), M * a.row_stride));
  a.scales.resize(std::max<size_t>(a.scales.size(), M * a.num_blocks));
  a.scaled_sums.resize(std::max<size_t>(a.scaled_sums.size(), M * a.sums_stride));
  a.scale_lanes.resize(std::max<size_t>(a.scale_lanes.size(), M * a.num_pairs * 16));
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* qs = a.qs.data() + m * a.row_stride;
      float* scales = a.scales.data() + m * a.num_blocks;
      float* scaled_sums = a.scaled_sums.data() + m * a.sums_stride;
      quantize_row(x + m * K, a.num_blocks, qs, scales, scaled_sums);
      std::fill(qs + a.num_blocks * kBlock, qs + a.row_stride, 0);
      std::fill(scaled_sums + a.num_blocks, scaled_sums + a.sums_stride, 0.f);
      float* lanes = a.scale_lanes.data() + m * a.num_pairs * 16;
      for (int64_t b = 0; b < 2 * a.num_pairs; ++b) {
        std::fill(lanes + b * 8, lanes + b * 8 + 8, b < a.num_blocks ? scales[b] : 0.f);
      }
    }
  });
}

#if TOKIOS_VNNI
inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// The weights of blocks 2p and 2p+1 as 64 bytes in the activation's element order, with their
// fp16 scales spread over lanes 0-7 / 8-15. A missing second block is zero.
struct WeightPair {
  __m512i values;
  __m512 scale;
};

// Also stores the two blocks' minimums at minimums[2p], minimums[2p + 1].
inline WeightPair load_q4_1_pair(const uint8_t* row, int64_t p, int64_t num_blocks, float* minimums) {
  const uint8_t* first = row + 2 * p * kQ4_1Bytes;
  const bool has_second = 2 * p + 1 < num_blocks;
  const uint8_t* second = first + kQ4_1Bytes;
  const __m128i nibbles0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(first + 4));
  const __m128i nibbles1 = has_second ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(second + 4))
                                      : _mm_setzero_si128();
  // 128-bit lanes: [first, first, second, second]; the odd lanes take the high nibbles.
  const __m512i packed = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_set_m128i(nibbles0, nibbles0)), _mm256_set_m128i(nibbles1, nibbles1), 1);
  const int four = 0x00040004;  // two 16-bit shift counts
  const __m512i shifts = _mm512_set_epi32(four, four, four, four, 0, 0, 0, 0, four, four, four, four, 0, 0, 0, 0);
  WeightPair pair;
  pair.values = _mm512_and_si512(_mm512_srlv_epi16(packed, shifts), _mm512_set1_epi8(0x0f));
  uint32_t header0, header1 = 0;  // fp16 d, fp16 m
  std::memcpy(&header0, first, 4);
  if (has_second) std::memcpy(&header1, second, 4);
  const __m128 halves = _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(header1), static_cast<int>(header0)));
  const __m512 wide = _mm512_castps128_ps512(halves);  // d0 m0 d1 m1
  pair.scale = _mm512_permutexvar_ps(_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0), wide);
  alignas(16) float unpacked[4];
  _mm_store_ps(unpacked, halves);
  minimums[2 * p] = unpacked[1];
  minimums[2 * p + 1] = unpacked[3];
  return pair;
}

#endif

// Dot products of one weight row with R activation rows starting at row r0, written to out[r].
// The weight pair is unpacked once and reused for every row; each row keeps its own accumulator
// and adds its pairs in the same order whatever R is, so a row's result is the same alone or in
// a batch (one implementation serves both: R = 1 is the single-row case).
constexpr int kMaxRows = 16;
constexpr int64_t kMaxSumsStride = 4096;  // blocks per row: in_features up to 131072

// `minimums`: scratch of a.sums_stride floats, zero past 2 * a.num_pairs (the caller zeroes it once).
template <int R>
void dot_q4_1_rows(const uint8_t* row, const QuantizedActivations& a, int64_t r0, float* minimums, float* out) {
#if TOKIOS_VNNI
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < a.num_pairs; ++p) {
    const WeightPair w = load_q4_1_pair(row, p, a.num_blocks, minimums);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(a.qs.data() + (r0 + r) * a.row_stride + p * 2 * kBlock);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.values, x);
      const __m512 scale =
          _mm512_mul_ps(w.scale, _mm512_loadu_ps(a.scale_lanes.data() + ((r0 + r) * a.num_pairs + p) * 16));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    }
  }
  for (int64_t b = 0; b < a.sums_stride; b += 16) {  // the minimum term, 16 blocks at a time
    const __m512 m = _mm512_load_ps(minimums + b);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(m, _mm512_loadu_ps(a.scaled_sums.data() + (r0 + r) * a.sums_stride + b), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    const int8_t* qs = a.qs.data() + (r0 + r) * a.row_stride;
    float total = 0.f;
    for (int64_t b = 0; b < a.num_blocks; ++b) {
      const uint8_t* block = row + b * kQ4_1Bytes;
      const float d = half_to_float(load_u16(block)), m = half_to_float(load_u16(block + 2));
      const int8_t* x = qs + b * kBlock;
      int32_t dot = 0;
      for (int j = 0; j < 16; ++j) dot += (block[4 + j] & 0x0f) * x[j] + (block[4 + j] >> 4) * x[j + 16];
      total += d * a.scales[(r0 + r) * a.num_blocks + b] * dot + m * a.scaled_sums[(r0 + r) * a.sums_stride + b];
    }
    out[r] = total;
  }
#endif
}

// Q8_0 (the LM head of int4, every layer of int8) one block per 256-bit step: measured faster here
// than the two-block form above (its weights are signed, so the pair form needs an offset and a
// correction; this form moves the weights' sign onto the activations instead).
template <int R>
void dot_q8_0_rows(const uint8_t* row, const QuantizedActivations& a, int64_t r0, float*, float* out) {
#if TOKIOS_VNNI
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.num_blocks; ++b) {
    const uint8_t* block = row + b * kQ8_0Bytes;
    const float d = _cvtsh_ss(load_u16(block));
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    const __m256i w_abs = _mm256_abs_epi8(w);  // vpdpbusd multiplies unsigned by signed
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs.data() + (r0 + r) * a.row_stride + b * kBlock));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_abs, _mm256_sign_epi8(x, w));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * a.scales[(r0 + r) * a.num_blocks + b]),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = horizontal_sum(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.qs.data() + (r0 + r) * a.row_stride;
    float total = 0.f;
    for (int64_t b = 0; b < a.num_blocks; ++b) {
      const uint8_t* block = row + b * kQ8_0Bytes;
      const int8_t* w = reinterpret_cast<const int8_t*>(block + 2);
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += w[j] * x[b * kBlock + j];
      total += half_to_float(load_u16(block)) * a.scales[(r0 + r) * a.num_blocks + b] * dot;
    }
    out[r] = total;
  }
#endif
}

template <int R>
void dot_rows(int64_t format, const uint8_t* row, const QuantizedActivations& a, int64_t r0, float* scratch,
              float* out) {
  if (format == 0) {
    dot_q4_1_rows<R>(row, a, r0, scratch, out);
  } else {
    dot_q8_0_rows<R>(row, a, r0, scratch, out);
  }
}

using DotRowsFunction = void (*)(int64_t, const uint8_t*, const QuantizedActivations&, int64_t, float*, float*);

template <size_t... Rs>
constexpr std::array<DotRowsFunction, sizeof...(Rs) + 1> dot_rows_table(std::index_sequence<Rs...>) {
  return {nullptr, &dot_rows<static_cast<int>(Rs) + 1>...};
}
constexpr auto kDotRows = dot_rows_table(std::make_index_sequence<kMaxRows>());

// y[M, N] = x[M, K] . W^T (+ bias), W in Q4_1 (format 0) or Q8_0 (format 1) blocks.
// Each output element is one dot product computed the same way whatever M is, so a row's
// result does not depend on what else is in the batch.
void quant_matmul(const float* x, int64_t M, int64_t K, const uint8_t* weight, int64_t N, int64_t format,
                  const float* bias, float* out) {
  const int64_t block_bytes = format == 0 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(K <= kMaxSumsStride * kBlock, "in_features ", K, " exceeds the kernel's limit of ", kMaxSumsStride * kBlock);
  // Reused from call to call. A thread_local named inside the lambdas below would be each worker
  // thread's own (empty) copy, so they use this reference to the calling thread's.
  thread_local QuantizedActivations buffer;
  QuantizedActivations& activations = buffer;
  quantize_activations(x, M, K, activations);
  const int64_t row_bytes = activations.num_blocks * block_bytes;
  // Each weight row is read once per tile of up to kMaxRows activation rows (L1-resident).
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    float results[kMaxRows];
    alignas(64) float minimums[kMaxSumsStride];
    std::fill(minimums, minimums + activations.sums_stride, 0.f);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int tile = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
      for (int64_t n = begin; n < end; ++n) {
        kDotRows[tile](format, weight + n * row_bytes, activations, m0, minimums, results);
        const float b = bias ? bias[n] : 0.f;
        for (int r = 0; r < tile; ++r) out[(m0 + r) * N + n] = results[r] + b;
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

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t format,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be a 2-D float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8, "weight must be 2-D uint8 blocks");
  TORCH_CHECK(format == 0 || format == 1, "format must be 0 (Q4_1) or 1 (Q8_0)");
  const int64_t block_bytes = format == 0 ? kQ4_1Bytes : kQ8_0Bytes;
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % kBlock == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(weight.size(1) == K / kBlock * block_bytes, "weight row size does not match in_features");
  const torch::Tensor input = x.contiguous();
  const torch::Tensor blocks = weight.contiguous();
  torch::Tensor out = torch::empty({M, N}, x.options());
  quant_matmul(input.data_ptr<float>(), M, K, blocks.data_ptr<uint8_t>(), N, format,
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
               std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down, int64_t format,
               std::vector<torch::Tensor> key_caches, std::vector<torch::Tensor> value_caches, torch::Tensor cos,
               torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
               int64_t intermediate_size, double eps)
      : input_norms_(std::move(input_norms)), post_norms_(std::move(post_norms)), qkv_(std::move(qkv)),
        qkv_bias_(std::move(qkv_bias)), o_proj_(std::move(o_proj)), gate_up_(std::move(gate_up)),
        down_(std::move(down)), format_(format), key_caches_(std::move(key_caches)),
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
      quant_matmul(normed.data(), D, H, qkv_[layer].data_ptr<uint8_t>(), qkv_size, format_, bias, qkv.data());
      with_kv_cache(key_caches_[layer], value_caches_[layer], [&](auto* keys, auto* values) {
        rope_and_write(qkv.data(), D, positions.data_ptr<int64_t>(), cos_.data_ptr<float>(), sin_.data_ptr<float>(),
                       keys, values, slot_mapping.data_ptr<int64_t>(), shape_);
        decode_attention_rows(qkv.data(), qkv_size, keys, values, slot_table.data_ptr<int64_t>(), slot_table.size(1),
                              context_lens.data_ptr<int64_t>(), D, shape_, scale, attended.data());
      });
      quant_matmul(attended.data(), D, q_size, o_proj_[layer].data_ptr<uint8_t>(), H, format_, nullptr, projected.data());
      for (int64_t i = 0; i < D * H; ++i) h[i] += projected[i];
      rms_norm_rows(h, post_norms_[layer].data_ptr<float>(), normed.data(), D, H, eps_);
      quant_matmul(normed.data(), D, H, gate_up_[layer].data_ptr<uint8_t>(), 2 * intermediate_size_, format_, nullptr,
                   gate_up.data());
      silu_mul_rows(gate_up.data(), D, intermediate_size_, activated.data());
      quant_matmul(activated.data(), D, intermediate_size_, down_[layer].data_ptr<uint8_t>(), H, format_, nullptr,
                   projected.data());
      for (int64_t i = 0; i < D * H; ++i) h[i] += projected[i];
    }
    return hidden;
  }

 private:
  std::vector<torch::Tensor> input_norms_, post_norms_, qkv_, qkv_bias_, o_proj_, gate_up_, down_;
  int64_t format_;
  std::vector<torch::Tensor> key_caches_, value_caches_;
  torch::Tensor cos_, sin_;
  Shape shape_;
  int64_t hidden_size_, intermediate_size_;
  float eps_;
  std::vector<float> normed_, qkv_out_, attended_, projected_, gate_up_out_, activated_;
};

// Blocks -> dense bfloat16 [N, K], for prefill chunks: a bf16 matrix product (oneDNN) beats the
// 8-bit dot kernel once many rows share each weight, and the dequantization is paid once per
// step, not per row.
torch::Tensor dequantize_bf16(const torch::Tensor& weight, int64_t format, int64_t in_features) {
  TORCH_CHECK(weight.scalar_type() == torch::kUInt8 && weight.is_contiguous(), "weight must be contiguous uint8");
  const int64_t N = weight.size(0), num_blocks = in_features / kBlock;
  const int64_t block_bytes = format == 0 ? kQ4_1Bytes : kQ8_0Bytes;
  torch::Tensor out = torch::empty({N, in_features}, weight.options().dtype(torch::kBFloat16));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* block = w + (n * num_blocks + b) * block_bytes;
        at::BFloat16* dst = o + n * in_features + b * kBlock;
#if TOKIOS_VNNI
        {  // 32 weights per block in two 16-lane halves; d * q + m as a separate product and sum
        // (not fused), rounded to nearest even: the values torch's dequantize-then-cast gives.
        // Profile: the scalar loop took 41 ms per prefill step (every weight, every step).
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(block)));
        __m512 halves[2];
        if (format == 0) {
          const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_u16(block + 2)));
          const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
          const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0f));
          const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f));
          halves[0] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), d), m);
          halves[1] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), d), m);
        } else {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
          halves[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), d);
          halves[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), d);
        }
        for (int h = 0; h < 2; ++h) {
          // Round to nearest even by hand (AVX-512 F only): add 0x7fff plus the kept lowest bit.
          const __m512i bits = _mm512_castps_si512(halves[h]);
          const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
          const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * h), _mm512_cvtepi32_epi16(rounded));
        }
        continue;
        }
#endif
        const float d = half_to_float(load_u16(block));
        if (format == 0) {
          const float m = half_to_float(load_u16(block + 2));
          for (int j = 0; j < 16; ++j) {
            dst[j] = at::BFloat16(d * (block[4 + j] & 0x0f) + m);
            dst[j + 16] = at::BFloat16(d * (block[4 + j] >> 4) + m);
          }
        } else {
          const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
          for (int j = 0; j < kBlock; ++j) dst[j] = at::BFloat16(d * q[j]);
        }
      }
    }
  });
  return out;
}

bool has_vnni() { return TOKIOS_VNNI; }

}  // namespace

// Every op releases the GIL: the engine steps in a background thread, and a kernel holding the
// GIL would make the server's event loop wait out Python's 5 ms switch interval on every token
// (measured: AsyncEngine TPOT 11.4 ms vs 6.6 ms for the same step run offline).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  module.def("quant_linear", &quant_linear, "y = x W^T (+ bias) with W in Q4_1 or Q8_0 blocks", release_gil());
  module.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32)", release_gil());
  module.def("silu_mul", &silu_mul, "silu(gate) * up from a fused [rows, 2 * intermediate] tensor", release_gil());
  module.def("rope_write_kv", &rope_write_kv, "rotate q and k of a fused qkv tensor in place; write k, v to the cache",
             release_gil());
  module.def("decode_attention", &decode_attention, "one query token per request over its paged KV context",
             release_gil());
  module.def("dequantize_bf16", &dequantize_bf16, "Q4_1 / Q8_0 blocks -> dense bfloat16", release_gil());
  module.def("has_vnni", &has_vnni, "whether the AVX-512 VNNI path was compiled");
  pybind11::class_<FusedDecoder>(module, "FusedDecoder")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, int64_t, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("forward", &FusedDecoder::forward, release_gil());
}
