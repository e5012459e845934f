// The CPU kernels' torch-facing module: quantized linear layers, y[M, N] = x[M, K] . W[N, K]^T
// (+ bias) with W in any GGML block type of a common GGUF file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q4_K, Q5_K, Q6_K), and the decode step around them (RMSNorm, rotary embedding, paged decode
// attention, SiLU), fused over all layers for decode-only steps.
//
// blocks.h owns the packed weight layout, activations.h the 8-bit activation rows, quant_matmul.h
// the dot kernels (AVX-512 VNNI, AVX2, portable); isa.h says which this build compiled.
// Every row takes the same kernel, decode or prefill, so results do not depend on the batch.
//
// The KV cache is float32, bfloat16 (half the memory) or int8 with a scale per token and head;
// the attention widens it on load, or, over bfloat16 on a CPU with AVX-512 BF16, multiplies it as
// stored (attend_segment_bf16).
//
// Threads: at::parallel_for, so torch.set_num_threads governs it.

// Only what the module uses, not <torch/extension.h> (all of torch: 29 of the 58 s a build took).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor to and from torch.Tensor

#include <cstdlib>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <type_traits>
#include <utility>

#include "blocks.h"
#include "experts.h"
#include "isa.h"
#include "quant_matmul.h"

namespace {

using namespace tokios;

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

// KV cache elements: float32, bfloat16 (round to nearest even on write, exact widening on read),
// or int8: symmetric per token and head, the head's float32 scale (absmax / 127) stored right
// after its head_dim values, so a slot of KV heads is KVH * (head_dim + 4) bytes (what
// llama.cpp's q8_0 spends per 64 values) and a block stays one slice of one tensor: the
// prefix cache's copies, spills and loads move scales with their values. The quantization is
// the same float32 arithmetic as model/attention.py's quantize_kv (x / scale, rounded half to
// even), so both paths write the same bytes.
template <typename KV>
constexpr int64_t kScaleElements = 0;
template <>
constexpr int64_t kScaleElements<int8_t> = sizeof(float);
template <typename KV>
constexpr int64_t head_stride(int64_t head_dim) { return head_dim + kScaleElements<KV>; }

inline void store_head(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_head(at::BFloat16* dst, const float* src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = at::BFloat16(src[j]);
}
inline void store_head(int8_t* dst, const float* src, int64_t n) {
  float absmax = 0.f;
  for (int64_t j = 0; j < n; ++j) absmax = std::max(absmax, std::fabs(src[j]));
  const float scale = absmax / 127.f;
  for (int64_t j = 0; j < n; ++j) {
    dst[j] = scale > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(src[j] / scale), -127.f, 127.f)) : 0;
  }
  std::memcpy(dst + n, &scale, sizeof(scale));
}
inline float load_kv(float v) { return v; }
inline float load_kv(at::BFloat16 v) { return static_cast<float>(v); }
inline float load_kv(int8_t v) { return static_cast<float>(v); }
// What a head's loaded values are multiplied by: 1 (folded away) unless the cache is int8.
template <typename KV>
inline float head_scale(const KV*, int64_t) { return 1.f; }
inline float head_scale(const int8_t* head, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, head + head_dim, sizeof(scale));
  return scale;
}
#if TOKIOS_VNNI
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// qkv [T, (H + 2 KVH) * hd]: rotates q and k in place and writes k, v into the caches.
template <typename KV>
void rope_and_write(float* qkv, int64_t num_tokens, const int64_t* positions, const float* cos_table,
                    const float* sin_table, KV* key_cache, KV* value_cache, const int64_t* slot_mapping,
                    const Shape& shape) {
  const int64_t hd = shape.head_dim, q_size = shape.num_heads * hd, kv_size = shape.num_kv_heads * hd;
  const int64_t row = q_size + 2 * kv_size, stride = head_stride<KV>(hd), slot_size = shape.num_kv_heads * stride;
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* token = qkv + t * row;
    const float* cos = cos_table + positions[t] * hd;
    const float* sin = sin_table + positions[t] * hd;
    rotate(token, shape.num_heads, hd, cos, sin);
    rotate(token + q_size, shape.num_kv_heads, hd, cos, sin);
    for (int64_t h = 0; h < shape.num_kv_heads; ++h) {
      store_head(key_cache + slot_mapping[t] * slot_size + h * stride, token + q_size + h * hd, hd);
      store_head(value_cache + slot_mapping[t] * slot_size + h * stride, token + q_size + kv_size + h * hd, hd);
    }
  }
}

#if TOKIOS_AVX2
// exp on 8 lanes for AVX2 machines, the polynomial of exp16 (below): std::exp costs 6% of a
// 1,000-token prefill inside SiLU, and most of the softmax in decode attention.
// 2^n is built in the exponent field: n is within [-127, 128] after the clamp; -127 gives 0 and
// 128 infinity, which silu's sigmoid turns into the right limits.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 scale = _mm256_castsi256_ps(_mm256_max_epi32(exponent, _mm256_setzero_si256()));
  return _mm256_mul_ps(p, scale);
}

inline float horizontal_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#if TOKIOS_VNNI
// exp on 16 lanes (Cephes' single-precision polynomial, about 1 ulp): std::exp one element at a
// time costs 8% of a 128-token prefill and 3% of a 16-row decode step inside SiLU.
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

// Softmax weights in place over scores[0, length): exp(s - max), returns their sum.
inline float exponentiate(float* scores, int64_t length, float maximum) {
  float total = 0.f;
  int64_t l = 0;
#if TOKIOS_VNNI
  // Scalar std::exp here was most of a decode row's attention at long context (0.34 ms of a
  // 4,000-token row, 9 heads, one layer).
  __m512 wide_sums = _mm512_setzero_ps();
  for (; l + 16 <= length; l += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + l), _mm512_set1_ps(maximum)));
    _mm512_storeu_ps(scores + l, e);
    wide_sums = _mm512_add_ps(wide_sums, e);
  }
  total = _mm512_reduce_add_ps(wide_sums);
#elif TOKIOS_AVX2
  __m256 sums = _mm256_setzero_ps();
  for (; l + 8 <= length; l += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + l), _mm256_set1_ps(maximum)));
    _mm256_storeu_ps(scores + l, e);
    sums = _mm256_add_ps(sums, e);
  }
  total = horizontal_add(sums);
#endif
  for (; l < length; ++l) {
    scores[l] = std::exp(scores[l] - maximum);
    total += scores[l];
  }
  return total;
}

// The vector type the attention loops use: 16 lanes on AVX-512, 8 on AVX2 (kLanes 0: the
// portable loops).
#if TOKIOS_VNNI
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const at::BFloat16* p) { return load16(p); }
inline Vec vload(const int8_t* p) { return load16(p); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float vmax(Vec v) { return _mm512_reduce_max_ps(v); }
inline Vec vmax_lanes(Vec a, Vec b) { return _mm512_max_ps(a, b); }
// Lanes at and past `valid` set to -infinity.
inline Vec vmask_tail(Vec v, int64_t valid) {
  const __mmask16 keep = valid >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << valid) - 1);
  return _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), v);
}
// The sums of 16 vectors, lane m = the sum of the vector in slot transposed_slot(m), in the tree
// of _mm512_reduce_add_ps (lanes i + i+8, then i + i+4, i + i+2, 0 + 1), so a score comes out
// as vsum gave it, for a fifth of the instructions.
inline Vec vsum_transposed(const Vec* v) {
  Vec halves[8], quarters[4], eighths[2];
  for (int k = 0; k < 8; ++k) {
    halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xee));
  }
  for (int k = 0; k < 4; ++k) {
    quarters[k] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * k], halves[2 * k + 1], 0xdd));
  }
  for (int k = 0; k < 2; ++k) {
    const __m512d a = _mm512_castps_pd(quarters[2 * k]), b = _mm512_castps_pd(quarters[2 * k + 1]);
    eighths[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88), _mm512_shuffle_ps(eighths[0], eighths[1], 0xdd));
}
#elif TOKIOS_AVX2
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const at::BFloat16* p) { return load8(p); }
inline Vec vload(const int8_t* p) { return load8(p); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline float vsum(Vec v) { return horizontal_add(v); }
inline Vec vmax_lanes(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float vmax(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#else
constexpr int kLanes = 0;
#endif
#if TOKIOS_VNNI
// Where vsum_transposed reads the vector whose sum lands in lane m.
constexpr int transposed_slot(int m) { return m / 4 + (kLanes / 4) * (m % 4); }
#endif
#if TOKIOS_VNNI || TOKIOS_AVX2
// The sums of 4 vectors, lane m that of v[m].
inline __m128 sum4(const Vec* v) {
#if TOKIOS_VNNI
  __m256 halves[4];
  for (int m = 0; m < 4; ++m) {
    halves[m] = _mm256_add_ps(_mm512_castps512_ps256(v[m]),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[m]), 1)));
  }
#else
  const Vec* halves = v;
#endif
  // Per 128-bit half: lanes (0+1, 2+3) of two vectors, then of those; the halves added last.
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(halves[0], halves[1]), _mm256_hadd_ps(halves[2], halves[3]));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// Raw dot products of NQ queries (one KV head's) with 4 keys, each loaded (and widened) once
// for all NQ: scores[q][m] = queries[q] . keys[m]. The 4 * NQ sums stay in registers across
// the head (12 + 1 query + 1 key of AVX2's 16 for SmolLM2's group of 3) and are reduced once;
// each sums its products in the same order whatever else shares the call.
template <typename KV, int VECS, int NQ>
inline void dots_of_4_keys(const float* const* queries, const KV* const* keys, __m128* scores) {
  // The queries are read from L1 as the FMAs' memory operands: held in registers, they pushed
  // the sums out to the stack.
  Vec acc[NQ][4];
  for (int m = 0; m < 4; ++m) {
    const Vec key = vload(keys[m]);
    for (int q = 0; q < NQ; ++q) acc[q][m] = vmul(vload(queries[q]), key);
  }
#pragma GCC unroll 16
  for (int c = 1; c < VECS; ++c) {
    for (int m = 0; m < 4; ++m) {
      const Vec key = vload(keys[m] + kLanes * c);
      for (int q = 0; q < NQ; ++q) acc[q][m] = vfmadd(vload(queries[q] + kLanes * c), key, acc[q][m]);
    }
  }
  for (int q = 0; q < NQ; ++q) scores[q] = sum4(acc[q]);
}

// Softmax-weighted values for NQ queries (one KV head's) over the keys [from, to): outs[q] (zeroed
// first when `starts`) += weights[q][l] * value(l), each value read (and widened) once for all
// NQ. A query's 4 vectors of sums at a time stay in registers over the keys (12 of AVX2's 16
// for a group of 3), and run over the keys in order whatever else shares the call.
template <typename KV, int VECS, int NQ>
inline void accumulate_values(const float* const* weights, const KV* value_cache, const int64_t* slots,
                              int64_t kv_stride, int64_t kv_offset, int64_t hd, int64_t from, int64_t to,
                              bool starts, float* const* outs) {
  constexpr int kPart = VECS < 4 ? VECS : 4;
  for (int part = 0; part < VECS / kPart; ++part) {
    const int64_t offset = part * kPart * kLanes;
    Vec acc[NQ][kPart];
    for (int q = 0; q < NQ; ++q) {
      for (int c = 0; c < kPart; ++c) acc[q][c] = starts ? vset1(0.f) : vload(outs[q] + offset + kLanes * c);
    }
    for (int64_t l = from; l < to; ++l) {
      const KV* head = value_cache + slots[l] * kv_stride + kv_offset;
      const float value_scale = head_scale(head, hd);
      for (int c = 0; c < kPart; ++c) {
        const Vec value = vload(head + offset + kLanes * c);
        for (int q = 0; q < NQ; ++q) acc[q][c] = vfmadd(vset1(weights[q][l] * value_scale), value, acc[q][c]);
      }
    }
    for (int q = 0; q < NQ; ++q) {
      for (int c = 0; c < kPart; ++c) vstore(outs[q] + offset + kLanes * c, acc[q][c]);
    }
  }
}
#endif

// Keys per segment. A context longer than this is attended one segment at a time, each with its
// own maximum and sum, merged in order afterwards (segment_results). Every segment is a work
// item, so one long decode row keeps both threads busy: split by KV head alone, SmolLM2's 3 heads
// left one of 2 threads two thirds of the work. The engine's step at 4,096 tokens, split by KV
// head against by segment: one stream with a bfloat16 cache 20.0 against 17.8 ms, int8 18.9
// against 14.3 ms; 4 streams 55.5 against 47.6 ms. Boundaries are fixed positions, never a thread count, so a query's result does
// not depend on what else the step holds. 512 keys: 1,024 left a chunk just past 1,024 tokens
// with 3 big items for 2 threads.
constexpr int64_t kSegmentKeys = 512;

// The most queries of one KV head a pass over a context serves (a GQA group's heads times
// consecutive rows of a prompt chunk): SmolLM2's group of 3 for an 8-row chunk, so a step's
// chunk reads its context once, not once per 4 rows.
constexpr int kMaxQueries = 24;

// The most queries one work item serves (the passes of several KV heads: their bytes sit
// together in a slot, so an item reads each slot's run of heads in one go): their scores for a
// segment are kMaxItemQueries * kSegmentKeys floats (144 KiB), within L2.
constexpr int kMaxItemQueries = 72;

// Queries over the keys [begin, end) of one paged context (begin a multiple of 16): each query
// q, with lengths[q] > begin, over its keys [begin, min(end, lengths[q])). Writes maxima[q] (its
// largest score), sums[q] (the sum of exp(score - maximum)) and outs[q] (the sum of
// exp(score - maximum) * value, not yet divided by sums[q]). The queries come grouped by the KV
// head they read: queries [head_starts[k], head_starts[k + 1]) read the head at kv_offsets[k]
// inside a slot (`kv_stride` apart). Each block of keys (then values) is loaded (and widened
// from bfloat16) once per KV head for all its queries: per query, a decode read the context's
// K/V once per head of its GQA group and a prompt chunk once per row, which left attention at
// 8 ms per prompt token at 5,000 tokens of context (SmolLM2, 2 threads). (The vector path
// reads a key or value once per 3 queries of its head, whose sums it holds in registers.)
// scores: kSegmentKeys floats per query; query_scratch: kMaxItemQueries * head_dim floats, which only
// attend_segment_bf16 uses (both are called through one pointer). VECS = head_dim / kLanes (0:
// portable loops). A query's results do not depend on which other queries share its pass (each
// sums in the same order), so a verify row equals the plain decode of the same token bit for bit.
template <typename KV, int VECS>
void attend_segment(const float* const* queries, const int64_t* lengths, int num_queries, const int* head_starts,
                    const int64_t* kv_offsets, int num_kv, int64_t begin, int64_t end, const KV* key_cache,
                    const KV* value_cache, const int64_t* slots, int64_t kv_stride, int64_t hd, float scale,
                    float* scores, float* query_scratch, float* maxima, float* sums, float* const* outs) {
  int64_t stop = begin;
  for (int q = 0; q < num_queries; ++q) stop = std::max(stop, std::min(end, lengths[q]));
  for (int q = 0; q < num_queries; ++q) maxima[q] = -INFINITY;
  auto score_row = [&](int q) { return scores + q * kSegmentKeys - begin; };  // indexed by position
#if TOKIOS_VNNI || TOKIOS_AVX2
  if constexpr (VECS > 0) {
    // Queries in groups of up to 3 of one KV head (their keys and values are read once for the
    // group, dots_of_4_keys and accumulate_values), and slot by slot for all KV heads: a slot
    // holds its heads side by side, so the segment is read in order. Widening blocks of keys
    // into memory once for all queries, then summing each query's 8 dot vectors in registers,
    // spilled on AVX2 (16 registers): a decode row's attention ran at a sixth of the FMA rate.
    struct Group {
      int kv, first, size;
      int64_t stop;  // past the group's longest query's last key in the segment
    };
    Group groups[kMaxItemQueries];
    int num_groups = 0;
    for (int k = 0; k < num_kv; ++k) {
      for (int first = head_starts[k]; first < head_starts[k + 1]; first += 3) {
        Group& group = groups[num_groups++];
        group = {k, first, std::min(3, head_starts[k + 1] - first), begin};
        for (int q = first; q < first + group.size; ++q) group.stop = std::max(group.stop, std::min(end, lengths[q]));
      }
    }
    // Scores, 4 keys at a time. Keys past a group's stop read a zero head; a query's scores past
    // its own length (its group may be longer) are never read.
    alignas(64) static const KV zero_head[VECS * kLanes] = {};
    // Calls fn with the group's size as a compile-time constant (the register blocks' shape).
    auto with_size = [](int size, auto&& fn) {
      if (size == 3) fn(std::integral_constant<int, 3>{});
      if (size == 2) fn(std::integral_constant<int, 2>{});
      if (size == 1) fn(std::integral_constant<int, 1>{});
    };
    for (int64_t l = begin; l < stop; l += 4) {
      for (int g = 0; g < num_groups; ++g) {
        const Group& group = groups[g];
        if (l >= group.stop) continue;
        const KV* keys[4];
        alignas(16) float key_scales[4];
        for (int m = 0; m < 4; ++m) {
          const bool inside = l + m < group.stop;
          keys[m] = inside ? key_cache + slots[l + m] * kv_stride + kv_offsets[group.kv] : zero_head;
          key_scales[m] = inside ? head_scale(keys[m], hd) : 1.f;
        }
        __m128 dots[3];
        with_size(group.size, [&](auto size) { dots_of_4_keys<KV, VECS, size()>(queries + group.first, keys, dots); });
        const __m128 scales = _mm_mul_ps(_mm_set1_ps(scale), _mm_load_ps(key_scales));
        for (int q = 0; q < group.size; ++q) _mm_storeu_ps(score_row(group.first + q) + l, _mm_mul_ps(dots[q], scales));
      }
    }
    for (int q = 0; q < num_queries; ++q) {
      float* row = score_row(q);
      const int64_t last = std::min(end, lengths[q]);
      Vec lane_maxima = vset1(-INFINITY);
      int64_t l = begin;
      for (; l + kLanes <= last; l += kLanes) lane_maxima = vmax_lanes(lane_maxima, vload(row + l));
      maxima[q] = vmax(lane_maxima);
      for (; l < last; ++l) maxima[q] = std::max(maxima[q], row[l]);
      sums[q] = exponentiate(row + begin, last - begin, maxima[q]);
      for (l = last; l < stop; ++l) row[l] = 0.f;  // its group may read on: weight 0
    }
    // Values, 64 keys at a time (for int8 and bfloat16 SmolLM2, within L1 for all 3 KV heads).
    for (int64_t chunk = begin; chunk < stop; chunk += 64) {
      for (int g = 0; g < num_groups; ++g) {
        const Group& group = groups[g];
        if (chunk >= group.stop) continue;
        const float* weights[3];
        for (int q = 0; q < group.size; ++q) weights[q] = score_row(group.first + q);
        with_size(group.size, [&](auto size) {
          accumulate_values<KV, VECS, size()>(weights, value_cache, slots, kv_stride, kv_offsets[group.kv], hd,
                                              chunk, std::min(chunk + 64, group.stop), chunk == begin,
                                              outs + group.first);
        });
      }
    }
    return;
  }
#endif
  for (int64_t l = begin; l < stop; ++l) {
    for (int k = 0; k < num_kv; ++k) {
      const KV* key = key_cache + slots[l] * kv_stride + kv_offsets[k];
      const float key_scale = head_scale(key, hd);
      for (int q = head_starts[k]; q < head_starts[k + 1]; ++q) {
        if (l >= lengths[q]) continue;
        float dot = 0.f;
        for (int64_t j = 0; j < hd; ++j) dot += queries[q][j] * load_kv(key[j]);
        score_row(q)[l] = dot * scale * key_scale;
        maxima[q] = std::max(maxima[q], dot * scale * key_scale);
      }
    }
  }
  for (int q = 0; q < num_queries; ++q) {
    sums[q] = exponentiate(score_row(q) + begin, std::min(end, lengths[q]) - begin, maxima[q]);
    for (int64_t j = 0; j < hd; ++j) outs[q][j] = 0.f;
  }
  for (int64_t l = begin; l < stop; ++l) {
    for (int k = 0; k < num_kv; ++k) {
      const KV* value = value_cache + slots[l] * kv_stride + kv_offsets[k];
      const float value_scale = head_scale(value, hd);
      for (int q = head_starts[k]; q < head_starts[k + 1]; ++q) {
        if (l >= lengths[q]) continue;
        const float p = score_row(q)[l] * value_scale;
        for (int64_t j = 0; j < hd; ++j) outs[q][j] += p * load_kv(value[j]);
      }
    }
  }
}

#if TOKIOS_BF16_DOT
// attend_segment for a bfloat16 cache on a CPU with bfloat16 dot products (vdpbf16ps: 32
// products summed pairwise into 16 float32 lanes, one instruction): the queries and the softmax
// weights are rounded to bfloat16 (as GPU attention kernels take them), the keys and values are
// multiplied as stored, never widened. The float32 path widens every block of keys and values
// into float32 and reads it back, and with the 4 FMAs per pair that costs 28 cycles per
// query-key pair for a decode row. Products are exact in float32 and summed in float32; the weights'
// sum is taken over the rounded weights, so each output is a weighted mean of its values.
// PAIRS = head_dim / 32. Same contract and arguments as attend_segment.
template <int PAIRS>
void attend_segment_bf16(const float* const* queries, const int64_t* lengths, int num_queries, const int* head_starts,
                         const int64_t* kv_offsets, int num_kv, int64_t begin, int64_t end,
                         const at::BFloat16* key_cache, const at::BFloat16* value_cache, const int64_t* slots,
                         int64_t kv_stride, int64_t hd, float scale, float* scores, float* query_scratch, float* maxima,
                         float* sums, float* const* outs) {
  constexpr int64_t head_dim = 32 * PAIRS;
  int64_t stop = begin;
  for (int q = 0; q < num_queries; ++q) stop = std::max(stop, std::min(end, lengths[q]));
  for (int q = 0; q < num_queries; ++q) maxima[q] = -INFINITY;
  auto score_row = [&](int q) { return scores + q * kSegmentKeys - begin; };  // indexed by position
  // The queries in bfloat16, in their natural order (a key's element pairs are its dword lanes).
  auto packed_query = [&](int q, int c) { return query_scratch + (q * PAIRS + c) * kLanes; };
  for (int q = 0; q < num_queries; ++q) {
    for (int c = 0; c < PAIRS; ++c) {
      const __m512bh packed =
          _mm512_cvtne2ps_pbh(_mm512_loadu_ps(queries[q] + 32 * c + 16), _mm512_loadu_ps(queries[q] + 32 * c));
      _mm512_storeu_si512(packed_query(q, c), (__m512i)packed);
    }
  }
  // Keys past every query's length (a block's tail) point at zeros: their lanes are masked.
  alignas(64) static const at::BFloat16 kZeroHead[head_dim] = {};
  const at::BFloat16* heads[kLanes];
  auto gather = [&](const at::BFloat16* cache, int64_t l0, int64_t kv_offset) {
    const int64_t count = std::min<int64_t>(kLanes, stop - l0);
    for (int64_t j = 0; j < kLanes; ++j) {
      heads[j] = j < count ? cache + slots[l0 + j] * kv_stride + kv_offset : kZeroHead;
    }
  };
  for (int64_t l0 = begin; l0 < stop; l0 += kLanes) {
    for (int k = 0; k < num_kv; ++k) {
      gather(key_cache, l0, kv_offsets[k]);
      for (int q = head_starts[k]; q < head_starts[k + 1]; ++q) {
        if (l0 >= lengths[q]) continue;
        __m512bh query[PAIRS];
        for (int c = 0; c < PAIRS; ++c) query[c] = (__m512bh)_mm512_loadu_si512(packed_query(q, c));
        Vec dots[kLanes];
        for (int m = 0; m < kLanes; ++m) {
          __m512 dot = _mm512_setzero_ps();
          for (int c = 0; c < PAIRS; ++c) {
            dot = _mm512_dpbf16_ps(dot, query[c], (__m512bh)_mm512_loadu_si512(heads[m] + 32 * c));
          }
          dots[transposed_slot(m)] = dot;
        }
        const Vec s = vmask_tail(vmul(vsum_transposed(dots), vset1(scale)), lengths[q] - l0);
        vstore(score_row(q) + l0, s);
        maxima[q] = std::max(maxima[q], vmax(s));
      }
    }
  }
  for (int q = 0; q < num_queries; ++q) {
    const int64_t last = std::min(end, lengths[q]);
    float* row = score_row(q);
    exponentiate(row + begin, last - begin, maxima[q]);
    for (int64_t l = last; l % kLanes; ++l) row[l] = 0.f;
    // Rounded to bfloat16 in place (row[l] now a bfloat16 value), and summed as rounded.
    __m512 total = _mm512_setzero_ps();
    for (int64_t l = begin; l < last; l += kLanes) {
      const __m512 rounded = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_loadu_ps(row + l)));
      _mm512_storeu_ps(row + l, rounded);
      total = _mm512_add_ps(total, rounded);
    }
    sums[q] = _mm512_reduce_add_ps(total);
    std::memset(outs[q], 0, hd * sizeof(float));
  }
  // Values of a block's key pairs (2j, 2j+1) interleaved element by element, as vdpbf16ps pairs
  // them with the two keys' weights: per 32 elements, unpacklo gives elements 8L + i (L the
  // 128-bit lane, i < 4) and unpackhi 8L + 4 + i, so outputs accumulate in that order and are
  // put back at the end.
  alignas(64) __m512i value_pairs[kLanes / 2][2 * PAIRS];
  for (int64_t l0 = begin; l0 < stop; l0 += kLanes) {
    for (int k = 0; k < num_kv; ++k) {
      gather(value_cache, l0, kv_offsets[k]);
      for (int j = 0; j < kLanes / 2; ++j) {
        for (int c = 0; c < PAIRS; ++c) {
          const __m512i a = _mm512_loadu_si512(heads[2 * j] + 32 * c);
          const __m512i b = _mm512_loadu_si512(heads[2 * j + 1] + 32 * c);
          value_pairs[j][2 * c] = _mm512_unpacklo_epi16(a, b);
          value_pairs[j][2 * c + 1] = _mm512_unpackhi_epi16(a, b);
        }
      }
      for (int q = head_starts[k]; q < head_starts[k + 1]; ++q) {
        if (l0 >= lengths[q]) continue;
        alignas(32) int32_t weight_pairs[kLanes / 2];
        _mm256_store_si256(reinterpret_cast<__m256i*>(weight_pairs),
                           (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(score_row(q) + l0)));
        Vec acc[2 * PAIRS];
        for (int c = 0; c < 2 * PAIRS; ++c) acc[c] = vload(outs[q] + kLanes * c);
        for (int j = 0; j < kLanes / 2; ++j) {
          const __m512bh weights = (__m512bh)_mm512_set1_epi32(weight_pairs[j]);
          for (int c = 0; c < 2 * PAIRS; ++c) {
            acc[c] = _mm512_dpbf16_ps(acc[c], weights, (__m512bh)value_pairs[j][c]);
          }
        }
        for (int c = 0; c < 2 * PAIRS; ++c) vstore(outs[q] + kLanes * c, acc[c]);
      }
    }
  }
  // Lane e of accumulator 2c (+1) held element 32c + 8 (e / 4) + e % 4 (+ 4).
  for (int q = 0; q < num_queries; ++q) {
    float lanes[head_dim];
    std::memcpy(lanes, outs[q], sizeof(lanes));
    for (int c = 0; c < 2 * PAIRS; ++c) {
      for (int e = 0; e < kLanes; ++e) {
        outs[q][32 * (c / 2) + 8 * (e / 4) + e % 4 + 4 * (c % 2)] = lanes[kLanes * c + e];
      }
    }
  }
}
#endif

// One query's softmax-weighted values from its segments' results (attend_segment), merged in
// segment order: out = sum_k partial_k * exp(m_k - M) / sum_k sum_k * exp(m_k - M), M the
// largest m_k. One segment: out = partial / sum, in place when out is the partial.
// sink: the head's attention sink (gpt-oss), a logit that joins the denominator with no value:
// it adds exp(sink - M) to the sum, and M is the largest of the m_k and the sink; nullptr: none.
inline void segment_results(const float* partials, const float* maxima, const float* sums, int64_t num_segments,
                            int64_t hd, const float* sink, float* out) {
  if (num_segments == 1 && sink == nullptr) {
    const float inverse = 1.f / sums[0];
    for (int64_t j = 0; j < hd; ++j) out[j] = partials[j] * inverse;
    return;
  }
  float maximum = sink == nullptr ? -INFINITY : *sink;
  for (int64_t s = 0; s < num_segments; ++s) maximum = std::max(maximum, maxima[s]);
  float total = sink == nullptr ? 0.f : std::exp(*sink - maximum);
  if (num_segments == 1) {  // with a sink: the partial may be out itself, so scaled in place
    const float weight = std::exp(maxima[0] - maximum);
    const float factor = weight / (sums[0] * weight + total);
    for (int64_t j = 0; j < hd; ++j) out[j] = partials[j] * factor;
    return;
  }
  for (int64_t j = 0; j < hd; ++j) out[j] = 0.f;
  for (int64_t s = 0; s < num_segments; ++s) {
    const float weight = std::exp(maxima[s] - maximum);
    total += sums[s] * weight;
    for (int64_t j = 0; j < hd; ++j) out[j] += partials[s * hd + j] * weight;
  }
  const float inverse = 1.f / total;
  for (int64_t j = 0; j < hd; ++j) out[j] *= inverse;
}

// One query token per row over its paged context. q rows are read from qkv (stride q_stride);
// out [D, H * hd]. Consecutive rows that are one causal prompt chunk (each sees one more
// position than the row before, over the same slots: found by comparing the slot tables, so
// rows of different requests are never merged) form a tile; each pass serves, per KV head, up
// to kMaxQueries queries: the heads of its GQA group, for as many rows of the tile as fit.
// Work items: (pass, KV heads, head part, segment). An item takes the KV heads of a pass whose
// queries fit kMaxItemQueries when there are items enough to keep the threads busy, else one.
// sinks [H]: each head's attention sink (segment_results), or nullptr.
template <typename KV>
void decode_attention_rows(const float* q, int64_t q_stride, const KV* key_cache, const KV* value_cache,
                           const int64_t* slot_table, int64_t max_context, const int64_t* context_lens,
                           int64_t num_rows, const Shape& shape, float scale, float* out,
                           const float* sinks = nullptr) {
  const int64_t H = shape.num_heads, KVH = shape.num_kv_heads, hd = shape.head_dim;
  const int64_t group = H / KVH;
  auto attend = &attend_segment<KV, 0>;
  if constexpr (kLanes > 0) {
    if (hd == kLanes) attend = &attend_segment<KV, 1>;
    if (hd == 2 * kLanes) attend = &attend_segment<KV, 2>;
    if (hd == 4 * kLanes) attend = &attend_segment<KV, 4>;
    if (hd == 8 * kLanes) attend = &attend_segment<KV, 8>;
    // Gemma 3's 256 (32 vectors of AVX2's 8 lanes too: the sums are held 4 vectors at a time).
    if (hd == 16 * kLanes) attend = &attend_segment<KV, 16>;
    if (kLanes == 8 && hd == 32 * kLanes) attend = &attend_segment<KV, 32>;
  }
#if TOKIOS_BF16_DOT
  if constexpr (std::is_same_v<KV, at::BFloat16>) {
    if (hd == 64) attend = &attend_segment_bf16<2>;
    if (hd == 128) attend = &attend_segment_bf16<4>;
    if (hd == 256) attend = &attend_segment_bf16<8>;
  }
#endif
  auto num_segments = [](int64_t length) { return (length + kSegmentKeys - 1) / kSegmentKeys; };
  // Per (row, head, segment) of a row: the segment's maximum and sum; rows of several segments
  // also keep each segment's unnormalized output here (one segment's goes straight to out).
  std::vector<int64_t> first_result(num_rows + 1, 0);
  bool any_segmented = false;
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(context_lens[r] >= 1, "an attention row needs at least one key; row ", r, " has ", context_lens[r]);
    first_result[r + 1] = first_result[r] + H * num_segments(context_lens[r]);
    any_segmented |= num_segments(context_lens[r]) > 1;
  }
  const int64_t num_results = first_result[num_rows];
  std::vector<float> result_maxima(num_results), result_sums(num_results);
  // Kept across calls (a prompt chunk of long rows fills megabytes); every partial read is
  // written. Reached through `partials` only: inside the workers the name would be theirs.
  thread_local std::vector<float> kept_partials;
  if (any_segmented && static_cast<int64_t>(kept_partials.size()) < num_results * hd) {
    kept_partials.resize(num_results * hd);
  }
  float* const partials = kept_partials.data();
  auto result_index = [&](int64_t r, int64_t h, int64_t segment) {
    return first_result[r] + h * num_segments(context_lens[r]) + segment;
  };
  auto result_out = [&](int64_t r, int64_t h, int64_t segment) {
    return num_segments(context_lens[r]) == 1 ? out + r * H * hd + h * hd
                                              : partials + result_index(r, h, segment) * hd;
  };

  // Passes: (first row, rows), all rows of a pass in one tile; the last row's slots serve all.
  // A GQA group larger than kMaxQueries is split into parts of heads.
  const int64_t heads_per_part = std::min<int64_t>(group, kMaxQueries);
  const int64_t num_head_parts = (group + heads_per_part - 1) / heads_per_part;
  const int64_t rows_per_pass = kMaxQueries / heads_per_part;
  std::vector<std::pair<int64_t, int64_t>> passes;
  for (int64_t first = 0; first < num_rows;) {
    int64_t end = first + 1;
    while (end < num_rows && end - first < rows_per_pass && context_lens[end] == context_lens[end - 1] + 1 &&
           std::memcmp(slot_table + end * max_context, slot_table + (end - 1) * max_context,
                       context_lens[end - 1] * sizeof(int64_t)) == 0) {
      ++end;
    }
    passes.emplace_back(first, end - first);
    first = end;
  }
  const int64_t num_threads = at::get_num_threads();
  int64_t num_pass_segments = 0;
  for (const auto& [first, rows] : passes) num_pass_segments += num_segments(context_lens[first + rows - 1]);
  // Two items a thread at least, for the costliest-first order below to even the threads out.
  const int64_t kv_per_item =
      num_pass_segments * num_head_parts >= 2 * num_threads
          ? std::clamp<int64_t>(kMaxItemQueries / (rows_per_pass * heads_per_part), 1, KVH)
          : 1;
  const int64_t num_kv_parts = (KVH + kv_per_item - 1) / kv_per_item;
  struct Item {
    int64_t pass, kv_part, head_part, segment, cost;
  };
  std::vector<Item> items;
  items.reserve(num_pass_segments * num_kv_parts * num_head_parts);
  for (int64_t p = 0; p < static_cast<int64_t>(passes.size()); ++p) {
    const auto [first, rows] = passes[p];
    const int64_t length = context_lens[first + rows - 1];
    for (int64_t segment = 0; segment < num_segments(length); ++segment) {
      const int64_t keys = std::min(length, (segment + 1) * kSegmentKeys) - segment * kSegmentKeys;
      for (int64_t kv_part = 0; kv_part < num_kv_parts; ++kv_part) {
        const int64_t kv_heads = std::min(KVH, (kv_part + 1) * kv_per_item) - kv_part * kv_per_item;
        for (int64_t head_part = 0; head_part < num_head_parts; ++head_part) {
          items.push_back({p, kv_part, head_part, segment, rows * kv_heads * keys});
        }
      }
    }
  }
  // Items differ in cost by 10x and more (in a mixed step, a prompt chunk's pass over 5,000 keys
  // beside decode rows over 500), and at::parallel_for gives each thread an equal run of
  // indices, which left one thread with the whole chunk. So the threads take items from a
  // shared counter, costliest first. Which thread computes an item changes no bit.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next_item{0};
  const int64_t num_workers = std::min<int64_t>(num_threads, num_items);
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    // Kept per thread across calls: a fresh allocation of this size faulted its pages in every
    // call. Not zeroed: every score a pass reads it has written.
    thread_local std::vector<float> scores, query_scratch;
    scores.resize(kMaxItemQueries * kSegmentKeys);
    query_scratch.resize(kMaxItemQueries * hd);
    const float* queries[kMaxItemQueries];
    float* outs[kMaxItemQueries];
    int64_t lengths[kMaxItemQueries], kv_offsets[kMaxItemQueries], results[kMaxItemQueries];
    float maxima[kMaxItemQueries], sums[kMaxItemQueries];
    int head_starts[kMaxItemQueries + 1];
    for (int64_t taken; (taken = next_item.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const Item& item = items[taken];
      const auto [first, rows] = passes[item.pass];
      const int64_t begin = item.segment * kSegmentKeys;
      const int64_t first_kv = item.kv_part * kv_per_item, last_kv = std::min(KVH, first_kv + kv_per_item);
      const int64_t first_head = item.head_part * heads_per_part;
      const int64_t last_head = std::min(group, first_head + heads_per_part);
      int num_queries = 0, num_kv = 0;
      for (int64_t kv_head = first_kv; kv_head < last_kv; ++kv_head, ++num_kv) {
        head_starts[num_kv] = num_queries;
        kv_offsets[num_kv] = kv_head * head_stride<KV>(hd);
        for (int64_t r = first; r < first + rows; ++r) {
          if (context_lens[r] <= begin) continue;  // an early row of a chunk ends before this segment
          for (int64_t g = first_head; g < last_head; ++g) {
            const int64_t h = kv_head * group + g;
            queries[num_queries] = q + r * q_stride + h * hd;
            outs[num_queries] = result_out(r, h, item.segment);
            lengths[num_queries] = context_lens[r];
            results[num_queries] = result_index(r, h, item.segment);
            ++num_queries;
          }
        }
      }
      head_starts[num_kv] = num_queries;
      attend(queries, lengths, num_queries, head_starts, kv_offsets, num_kv, begin, begin + kSegmentKeys, key_cache,
             value_cache, slot_table + (first + rows - 1) * max_context, KVH * head_stride<KV>(hd), hd, scale,
             scores.data(), query_scratch.data(), maxima, sums, outs);
      for (int i = 0; i < num_queries; ++i) {
        result_maxima[results[i]] = maxima[i];
        result_sums[results[i]] = sums[i];
      }
    }
  });
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t segments = num_segments(context_lens[r]);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t at = result_index(r, h, 0);
      float* row_out = out + r * H * hd + h * hd;
      segment_results(segments == 1 ? row_out : partials + at * hd, result_maxima.data() + at,
                      result_sums.data() + at, segments, hd, sinks == nullptr ? nullptr : sinks + h, row_out);
    }
  }
}

// Gated feed-forward activations: out = act(gate) * up, act = SiLU (Llama) or tanh-GELU (Gemma).
// Both are g * sigmoid(z): z = g for SiLU; for GELU 0.5 g (1 + tanh(u)) = g * sigmoid(2u), with
// u = sqrt(2/pi) (g + 0.044715 g^3), so one exp serves both.
enum class Activation { kSilu, kGeluTanh };

template <Activation ACT>
void glu_rows(const float* gate_up, int64_t rows, int64_t intermediate, float* out) {
  constexpr float kGeluScale = 2.f * 0.7978845608028654f;  // 2 sqrt(2/pi)
  constexpr float kGeluCubic = 0.044715f;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * intermediate;
      const float* up = gate + intermediate;
      float* o = out + r * intermediate;
      int64_t j = 0;
#if TOKIOS_VNNI
      for (; j + 16 <= intermediate; j += 16) {
        const __m512 g = _mm512_loadu_ps(gate + j);
        __m512 z = g;
        if constexpr (ACT == Activation::kGeluTanh) {
          const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(g, g), g), _mm512_set1_ps(kGeluCubic), g);
          z = _mm512_mul_ps(inner, _mm512_set1_ps(kGeluScale));
        }
        const __m512 sigmoid_denominator = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), z)));
        _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_div_ps(g, sigmoid_denominator), _mm512_loadu_ps(up + j)));
      }
#elif TOKIOS_AVX2
      for (; j + 8 <= intermediate; j += 8) {
        const __m256 g = _mm256_loadu_ps(gate + j);
        __m256 z = g;
        if constexpr (ACT == Activation::kGeluTanh) {
          const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(g, g), g), _mm256_set1_ps(kGeluCubic), g);
          z = _mm256_mul_ps(inner, _mm256_set1_ps(kGeluScale));
        }
        const __m256 sigmoid_denominator = _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(g, sigmoid_denominator), _mm256_loadu_ps(up + j)));
      }
#endif
      for (; j < intermediate; ++j) {
        const float g = gate[j];
        const float z = ACT == Activation::kSilu ? g : (std::fma(g * g * g, kGeluCubic, g)) * kGeluScale;
        o[j] = g / (1.f + std::exp(-z)) * up[j];
      }
    }
  });
}

void glu_rows(const float* gate_up, int64_t rows, int64_t intermediate, float* out, bool gelu) {
  if (gelu) {
    glu_rows<Activation::kGeluTanh>(gate_up, rows, intermediate, out);
  } else {
    glu_rows<Activation::kSilu>(gate_up, rows, intermediate, out);
  }
}

// RMSNorm in place over each head of q and k (Gemma 3), in every row of a fused qkv buffer.
void normalize_heads_rows(float* qkv, int64_t rows, int64_t qkv_size, const Shape& shape, const float* q_norm,
                          const float* k_norm, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = qkv + r * qkv_size;
    rms_norm_rows(row, q_norm, row, shape.num_heads, shape.head_dim, eps);
    float* keys = row + shape.num_heads * shape.head_dim;
    rms_norm_rows(keys, k_norm, keys, shape.num_kv_heads, shape.head_dim, eps);
  }
}

// ---- torch-facing ops (the model's per-op path uses these, so its results equal the fused path) --
void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), name, " must be contiguous float32");
}

// The integer form of a tensor (model/blocks/codec.py) -> the kernel's packed groups
// [ceil(N / 16), row_bytes] for `format`.
// A uint8 tensor for packed weights. On Linux, one of 2 MiB or more is 2 MiB-aligned and asked
// to be backed by transparent huge pages before it is first written (this host's THP mode is
// "madvise": nothing is huge unless asked). A decode step streams every weight once; on 4 KiB
// pages the hardware prefetcher stops at every page boundary and each page costs a TLB walk.
// Gemma 3's 178 MB Q8_0 output head streams in 10.0-10.5 ms on 4 KiB pages, 8.6-9.4 ms on 2 MiB
// ones. Carving the smaller
// per-layer weights out of shared huge-page chunks showed no gain above this machine's noise.
at::Tensor weight_buffer(int64_t rows, int64_t row_bytes) {
  const size_t bytes = static_cast<size_t>(rows * row_bytes);
  constexpr size_t kHugePage = size_t{2} << 20;
#if defined(__linux__)
  if (bytes >= kHugePage) {
    void* data = nullptr;
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    if (posix_memalign(&data, kHugePage, rounded) == 0) {
      madvise(data, rounded, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
      return at::from_blob(data, {rows, row_bytes}, [](void* p) { std::free(p); },
                           at::TensorOptions().dtype(at::kByte));
    }
  }
#endif
  return at::empty({rows, row_bytes}, at::kByte);
}

at::Tensor pack_ints(const at::Tensor& values, const at::Tensor& scales, const c10::optional<at::Tensor>& minimums,
                     const c10::optional<at::Tensor>& sub_scales, const c10::optional<at::Tensor>& sub_minimums,
                     int64_t format) {
  TORCH_CHECK(valid_format(format), "unknown kernel format ", format);
  const FormatTraits& traits = kTraits[format];
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kByte && values.is_contiguous() && values.device().is_cpu(),
              "values must be a contiguous 2-D uint8 CPU tensor");
  const int64_t N = values.size(0), K = values.size(1);
  TORCH_CHECK(K % (traits.sub ? kSuperBlock : kBlock) == 0, "in_features ", K, " is not a whole number of blocks");
  const GroupLayout layout(format, K);
  auto check = [&](const at::Tensor& t, int64_t columns, int64_t element_bytes, const char* name) {
    TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == columns && t.is_contiguous() && t.device().is_cpu() &&
                    t.element_size() == element_bytes,
                name, " must be [", N, ", ", columns, "] with ", element_bytes, "-byte elements for this format");
  };
  check(scales, layout.num_scale_groups, 2, "scales");
  TORCH_CHECK(minimums.has_value() == traits.has_min, "minimums must be given exactly for formats with a minimum");
  if (traits.has_min) check(*minimums, layout.num_scale_groups, 2, "minimums");
  TORCH_CHECK(sub_scales.has_value() == (traits.sub != 0), "sub_scales must be given exactly for K-quants");
  if (traits.sub) check(*sub_scales, K / traits.sub, 1, "sub_scales");
  TORCH_CHECK(sub_minimums.has_value() == (traits.sub == 32), "sub_minimums must be given exactly for Q4_K and Q5_K");
  if (traits.sub == 32) check(*sub_minimums, K / kBlock, 1, "sub_minimums");
  const BlockIntsView view{values.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                           minimums ? reinterpret_cast<const uint16_t*>(minimums->data_ptr()) : nullptr,
                           sub_scales ? reinterpret_cast<const int8_t*>(sub_scales->data_ptr()) : nullptr,
                           sub_minimums ? reinterpret_cast<const uint8_t*>(sub_minimums->data_ptr()) : nullptr};
  const int64_t num_groups = (N + kGroup - 1) / kGroup;
  at::Tensor out = weight_buffer(num_groups, layout.row_bytes);
  uint8_t* rows = out.data_ptr<uint8_t>();
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) pack_group(view, N, K, layout, g, rows + g * layout.row_bytes);
  });
  return out;
}

// The integer form of one projection of every expert, [num_experts * out_features, K] (the
// experts' rows one after another, as a GGUF 3-D tensor holds them) -> the kernel's groups,
// expert after expert: [num_experts * ceil(out_features / 16), row_bytes] (experts.h).
at::Tensor pack_expert_ints(const at::Tensor& values, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& minimums, const c10::optional<at::Tensor>& sub_scales,
                            const c10::optional<at::Tensor>& sub_minimums, int64_t format, int64_t num_experts) {
  TORCH_CHECK(num_experts >= 1 && values.dim() == 2 && values.size(0) % num_experts == 0,
              "values must hold num_experts experts' rows, got ", values.sizes(), " for ", num_experts, " experts");
  std::vector<at::Tensor> experts;
  auto slice = [&](const c10::optional<at::Tensor>& t, int64_t e) -> c10::optional<at::Tensor> {
    if (!t) return c10::nullopt;
    const int64_t rows = t->size(0) / num_experts;
    return t->narrow(0, e * rows, rows);
  };
  const int64_t out_features = values.size(0) / num_experts;
  for (int64_t e = 0; e < num_experts; ++e) {
    experts.push_back(pack_ints(values.narrow(0, e * out_features, out_features),
                                scales.narrow(0, e * out_features, out_features), slice(minimums, e),
                                slice(sub_scales, e), slice(sub_minimums, e), format));
  }
  const int64_t groups = experts[0].size(0), row_bytes = experts[0].size(1);
  at::Tensor out = weight_buffer(num_experts * groups, row_bytes);
  for (int64_t e = 0; e < num_experts; ++e) {
    std::memcpy(out.data_ptr<uint8_t>() + e * groups * row_bytes, experts[e].data_ptr<uint8_t>(), groups * row_bytes);
  }
  return out;
}

// Packed groups -> [N, K] float32, the weights the kernel multiplies by (tests; the bf16 product
// that a build without AVX2 uses for long chunks).
at::Tensor dequantize_packed(const at::Tensor& packed, int64_t format, int64_t out_features, int64_t in_features) {
  TORCH_CHECK(valid_format(format), "unknown kernel format ", format);
  const GroupLayout layout(format, in_features);
  const FormatTraits& traits = kTraits[format];
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == (out_features + kGroup - 1) / kGroup && packed.size(1) == layout.row_bytes,
              "packed does not match this format and shape");
  at::Tensor out = at::empty({out_features, in_features}, at::kFloat);
  float* w = out.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = packed.data_ptr<uint8_t>() + (n / kGroup) * layout.row_bytes;
      const int j = static_cast<int>(n % kGroup);
      const uint16_t* halves = layout.halves(row);
      for (int64_t b = 0; b < layout.num_blocks; ++b) {
        const int64_t group = traits.sub ? b / (kSuperBlock / kBlock) : b;
        const float d = stored_scale(format, halves[group * layout.halves_per_group + j]);
        const float m = traits.has_min ? half_to_float(halves[group * layout.halves_per_group + kGroup + j]) : 0.f;
        const uint8_t* sub = layout.sub(row) + b * layout.sub_bytes;
        for (int i = 0; i < kBlock; ++i) {
          const float u = static_cast<float>(unpacked_value(row, layout, b, j, i) - traits.zero);
          float value;
          if (traits.sub == 32) {
            value = (d * static_cast<float>(sub[j])) * u - m * static_cast<float>(sub[kGroup + j]);
          } else if (traits.sub == 16) {
            value = (d * static_cast<float>(static_cast<int8_t>(sub[i < 16 ? j : kGroup + j]))) * u;
          } else {
            value = d * u + m;
          }
          w[n * in_features + b * kBlock + i] = value;
        }
      }
    }
  });
  return out;
}

// One linear layer: its output features in segments, each packed in its own format (a file may
// store q, k and v, or gate and up, in different types), multiplied from one quantization of
// the activations. exact_sums: its sum over input blocks is exact (quant_matmul.h, kSumGridBits),
// so shards of its input features add up to it bit for bit (tensor parallel's o_proj and down).
class PackedLinear {
 public:
  PackedLinear(std::vector<at::Tensor> packed, std::vector<int64_t> formats, std::vector<int64_t> out_features,
               int64_t in_features, bool precise, c10::optional<at::Tensor> bias, bool exact_sums)
      : packed_(std::move(packed)), formats_(std::move(formats)), out_features_(std::move(out_features)),
        in_features_(in_features), precise_(precise), exact_sums_(exact_sums) {
    TORCH_CHECK(!packed_.empty() && packed_.size() == formats_.size() && packed_.size() == out_features_.size(),
                "one format and one out_features per packed segment");
    total_out_ = 0;
    for (size_t s = 0; s < packed_.size(); ++s) {
      TORCH_CHECK(valid_format(formats_[s]), "unknown kernel format ", formats_[s]);
      TORCH_CHECK(!precise_ || formats_[s] == kQ4_1 || formats_[s] == kQ8_0,
                  "precise activations are offered for Q4_1 and Q8_0 weights only");
      TORCH_CHECK(in_features_ % (kTraits[formats_[s]].sub ? kSuperBlock : kBlock) == 0,
                  "in_features ", in_features_, " is not a whole number of blocks of format ", formats_[s]);
      const GroupLayout layout(formats_[s], in_features_);
      const at::Tensor& p = packed_[s];
      TORCH_CHECK(p.dim() == 2 && p.scalar_type() == at::kByte && p.is_contiguous() && p.device().is_cpu() &&
                      p.size(0) == (out_features_[s] + kGroup - 1) / kGroup && p.size(1) == layout.row_bytes,
                  "weight must be packed by pack_ints for these in_features and out_features");
      total_out_ += out_features_[s];
      num_bytes_ += p.numel();
    }
    if (bias.has_value()) {
      TORCH_CHECK(bias->numel() == total_out_ && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                  "bias must be contiguous float32 with out_features elements");
      bias_ = *bias;
    }
  }

  // x [M, in_features] -> out [M, total_out] (row stride total_out).
  void forward(const float* x, int64_t M, float* out) const { forward(x, M, ProductOut{out, nullptr, total_out_}); }

  // x [M, in_features] -> float32 values or float64 unrounded sums (quant_matmul.h's ProductOut).
  void forward(const float* x, int64_t M, const ProductOut& out) const {
    // Reused from call to call. A thread_local named inside quant_matmul's lambdas would be each
    // worker thread's own (empty) copy, so it receives this reference to the calling thread's.
    thread_local QuantizedActivations buffer;
    QuantizedActivations& activations = buffer;
    quantize_activations(x, M, in_features_, precise_, activations);
    const float* bias = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
    bytes_read_->fetch_add(num_bytes_, std::memory_order_relaxed);
    int64_t column = 0;
    for (size_t s = 0; s < packed_.size(); ++s) {
      quant_matmul(activations, M, packed_[s].data_ptr<uint8_t>(), out_features_[s], formats_[s], precise_,
                   exact_sums_, bias ? bias + column : nullptr, out.at(0, column));
      column += out_features_[s];
    }
  }

  at::Tensor call(const at::Tensor& x) const {
    check_input(x);
    const at::Tensor input = x.contiguous();
    at::Tensor out = at::empty({x.size(0), total_out_}, x.options());
    forward(input.data_ptr<float>(), x.size(0), out.data_ptr<float>());
    return out;
  }

  // x -> [M, total_out] float64: the sums before their one rounding to float32. A row-parallel
  // shard's share (tensor parallel): the shares' sum rounded to float32 is the whole product's
  // call(), bit for bit, when the split falls on block boundaries.
  at::Tensor partial_sums(const at::Tensor& x) const {
    TORCH_CHECK(exact_sums_, "partial_sums needs a PackedLinear built with exact_sums=True");
    check_input(x);
    const at::Tensor input = x.contiguous();
    at::Tensor out = at::empty({x.size(0), total_out_}, x.options().dtype(at::kDouble));
    forward(input.data_ptr<float>(), x.size(0), ProductOut{nullptr, out.data_ptr<double>(), total_out_});
    return out;
  }

  void check_input(const at::Tensor& x) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a 2-D float32 CPU tensor");
    TORCH_CHECK(x.size(1) == in_features_, "x has ", x.size(1), " features, the weight ", in_features_);
  }

  int64_t out_features() const { return total_out_; }
  int64_t in_features() const { return in_features_; }
  int64_t num_bytes() const { return num_bytes_; }
  // The weight bytes every call so far has read, this layer's copies included (the fused step
  // holds copies): a step's is the difference across it.
  int64_t weight_bytes_read() const { return bytes_read_->load(std::memory_order_relaxed); }

 private:
  std::vector<at::Tensor> packed_;
  std::vector<int64_t> formats_, out_features_;
  int64_t in_features_, total_out_ = 0, num_bytes_ = 0;
  bool precise_, exact_sums_;
  at::Tensor bias_;
  std::shared_ptr<std::atomic<int64_t>> bytes_read_ = std::make_shared<std::atomic<int64_t>>(0);
};

// gpt-oss's clamped SwiGLU (model/moe.py ExpertActivation "swiglu_oai"): gate clamped above at
// limit, up to [-limit, limit], out = gate * sigmoid(alpha * gate) * (up + 1).
void swiglu_oai_rows(const float* gate_up, int64_t rows, int64_t intermediate, float alpha, float limit, float* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * intermediate;
      const float* up = gate + intermediate;
      for (int64_t j = 0; j < intermediate; ++j) {
        const float g = std::min(gate[j], limit), u = std::clamp(up[j], -limit, limit);
        out[r * intermediate + j] = g / (1.f + std::exp(-alpha * g)) * (u + 1.f);
      }
    }
  });
}

// x . y over n floats, summed in a fixed order (a row's router logits never depend on the batch).
inline float dot_f32(const float* x, const float* y, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if TOKIOS_VNNI || TOKIOS_AVX2
  Vec sum = vset1(0.f);
  for (; i + kLanes <= n; i += kLanes) sum = vfmadd(vload(x + i), vload(y + i), sum);
  total = vsum(sum);
#endif
  for (; i < n; ++i) total += x[i] * y[i];
  return total;
}

// A layer's sparse mixture of experts on packed blocks: the packed counterpart of model/moe.py's
// SparseMoE, called by the per-op path and by the fused decode step alike. hidden [M, H] ->
// router logits (float32 router) -> route_row -> the (row, slot) pairs laid out expert by expert
// -> the chosen experts' gate and up (one grouped product), the activation, their down (a second)
// -> each row's k outputs summed in slot order with their weights, plus the shared expert.
class SparseExperts {
 public:
  // router_weight [E, H] float32; gate, up: packed by pack_expert_ints for [E * I, H], down for
  // [E * H, I]; biases [E, I] / [E, H]; scoring: Scoring; activation: 0 SiLU, 1 tanh-GELU,
  // 2 gpt-oss's clamped SwiGLU (alpha, limit); shared: none, or the shared expert's fused
  // gate-and-up and its down; shared_output_gate [H] (its sigmoid gate), when given.
  SparseExperts(at::Tensor router_weight, c10::optional<at::Tensor> router_bias,
                c10::optional<at::Tensor> selection_bias, int64_t num_experts_per_token, int64_t scoring,
                bool normalize, double scale, at::Tensor gate, int64_t gate_format, at::Tensor up, int64_t up_format,
                at::Tensor down, int64_t down_format, int64_t intermediate, c10::optional<at::Tensor> gate_bias,
                c10::optional<at::Tensor> up_bias, c10::optional<at::Tensor> down_bias, int64_t activation,
                double alpha, double limit, bool precise, std::vector<PackedLinear> shared,
                c10::optional<at::Tensor> shared_output_gate, c10::optional<at::Tensor> expert_scale)
      : router_weight_(router_weight), num_experts_(router_weight.size(0)), hidden_(router_weight.size(1)),
        k_(num_experts_per_token), intermediate_(intermediate), scoring_(static_cast<Scoring>(scoring)),
        normalize_(normalize), scale_(static_cast<float>(scale)), gate_(gate), up_(up), down_(down),
        activation_(activation), alpha_(static_cast<float>(alpha)), limit_(static_cast<float>(limit)),
        precise_(precise), shared_(std::move(shared)) {
    check_f32(router_weight_, "router_weight");
    TORCH_CHECK(router_weight_.dim() == 2, "router_weight must be [num_experts, hidden]");
    TORCH_CHECK(k_ >= 1 && k_ <= num_experts_, "num_experts_per_token must be in [1, ", num_experts_, "]");
    TORCH_CHECK(scoring >= 0 && scoring <= 2 && activation >= 0 && activation <= 2, "unknown scoring or activation");
    TORCH_CHECK(shared_.empty() || shared_.size() == 2, "shared: none, or gate_up and down");
    auto vector = [&](const c10::optional<at::Tensor>& t, int64_t numel, const char* name) -> at::Tensor {
      if (!t) return at::Tensor();
      check_f32(*t, name);
      TORCH_CHECK(t->numel() == numel, name, " must have ", numel, " elements, got ", t->numel());
      return *t;
    };
    router_bias_ = vector(router_bias, num_experts_, "router_bias");
    selection_bias_ = vector(selection_bias, num_experts_, "selection_bias");
    shared_output_gate_ = vector(shared_output_gate, hidden_, "shared_output_gate");
    expert_scale_ = vector(expert_scale, num_experts_, "expert_scale");
    auto projection = [&](const at::Tensor& packed, int64_t format, int64_t out_features, int64_t in_features,
                          const at::Tensor& bias, int64_t column, const char* name) {
      TORCH_CHECK(valid_format(format), "unknown kernel format ", format, " for ", name);
      TORCH_CHECK(!precise_ || format == kQ4_1 || format == kQ8_0,
                  "precise activations are offered for Q4_1 and Q8_0 weights only");
      TORCH_CHECK(in_features % (kTraits[format].sub ? kSuperBlock : kBlock) == 0, name, ": in_features ",
                  in_features, " is not a whole number of blocks of format ", format);
      const GroupLayout layout(format, in_features);
      const int64_t groups = (out_features + kGroup - 1) / kGroup;
      TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                      packed.size(0) == num_experts_ * groups && packed.size(1) == layout.row_bytes,
                  name, " must be packed by pack_expert_ints for ", num_experts_, " experts of [", out_features, ", ",
                  in_features, "]");
      return ExpertProjection{packed.data_ptr<uint8_t>(), format, out_features,
                              bias.defined() ? bias.data_ptr<float>() : nullptr, column};
    };
    gate_bias_ = vector(gate_bias, num_experts_ * intermediate_, "gate_bias");
    up_bias_ = vector(up_bias, num_experts_ * intermediate_, "up_bias");
    down_bias_ = vector(down_bias, num_experts_ * hidden_, "down_bias");
    gate_up_projections_ = {projection(gate_, gate_format, intermediate_, hidden_, gate_bias_, 0, "gate"),
                            projection(up_, up_format, intermediate_, hidden_, up_bias_, intermediate_, "up")};
    down_projections_ = {projection(down_, down_format, hidden_, intermediate_, down_bias_, 0, "down")};
  }

  // x [M, H] -> out [M, H]. router_x [M, H]: what the router reads, where it is not x (Gemma 4);
  // null: x.
  void forward(const float* x, int64_t M, float* out, const float* router_x = nullptr) {
    if (router_x == nullptr) router_x = x;
    const int64_t H = hidden_, E = num_experts_, I = intermediate_, P = M * k_;
    grow(logits_, M * E);
    grow(weights_, P);
    expert_ids_.resize(std::max<size_t>(expert_ids_.size(), P));
    grow(scores_, M * E);
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        float* logits = logits_.data() + m * E;
        for (int64_t e = 0; e < E; ++e) {
          logits[e] = dot_f32(router_x + m * H, router_weight_.data_ptr<float>() + e * H, H) +
                      (router_bias_.defined() ? router_bias_.data_ptr<float>()[e] : 0.f);
        }
        route_row(logits, E, k_, scoring_, normalize_, scale_,
                  selection_bias_.defined() ? selection_bias_.data_ptr<float>() : nullptr, scores_.data() + m * E,
                  expert_ids_.data() + m * k_, weights_.data() + m * k_);
        if (expert_scale_.defined()) {  // Gemma 4's per-expert output scale
          for (int64_t slot = 0; slot < k_; ++slot) {
            weights_[m * k_ + slot] *= expert_scale_.data_ptr<float>()[expert_ids_[m * k_ + slot]];
          }
        }
      }
    });
    // Pairs p = m * k + slot laid out expert by expert (rows ascending within an expert).
    rows_.expert_ids.clear();
    rows_.row_starts.assign(1, 0);
    std::vector<int64_t> starts(E + 1, 0);
    for (int64_t p = 0; p < P; ++p) ++starts[expert_ids_[p] + 1];
    for (int64_t e = 0; e < E; ++e) {
      if (starts[e + 1]) {
        rows_.expert_ids.push_back(e);
        rows_.row_starts.push_back(starts[e] + starts[e + 1]);
      }
      starts[e + 1] += starts[e];
    }
    pair_positions_.resize(std::max<size_t>(pair_positions_.size(), P));
    for (int64_t p = 0; p < P; ++p) pair_positions_[p] = starts[expert_ids_[p]]++;
    grow(grouped_, P * H);
    at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        std::memcpy(grouped_.data() + pair_positions_[p] * H, x + (p / k_) * H, H * sizeof(float));
      }
    });
    quantize_activations(grouped_.data(), P, H, precise_, activations_);
    grow(gate_up_, P * 2 * I);
    grow(activated_, P * I);
    int64_t num_bytes = grouped_expert_matmul(activations_, rows_, gate_up_projections_, precise_, gate_up_.data(), 2 * I);
    if (activation_ == 2) {
      swiglu_oai_rows(gate_up_.data(), P, I, alpha_, limit_, activated_.data());
    } else {
      glu_rows(gate_up_.data(), P, I, activated_.data(), activation_ == 1);
    }
    quantize_activations(activated_.data(), P, I, precise_, activations_);
    grow(pair_out_, P * H);
    num_bytes += grouped_expert_matmul(activations_, rows_, down_projections_, precise_, pair_out_.data(), H);
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        float* o = out + m * H;
        std::fill(o, o + H, 0.f);
        for (int64_t slot = 0; slot < k_; ++slot) {
          const float w = weights_[m * k_ + slot];
          const float* expert_out = pair_out_.data() + pair_positions_[m * k_ + slot] * H;
          for (int64_t h = 0; h < H; ++h) o[h] += w * expert_out[h];
        }
      }
    });
    if (!shared_.empty()) {
      const int64_t S = shared_[1].in_features();
      grow(shared_gate_up_, M * 2 * S);
      grow(shared_activated_, M * S);
      grow(shared_out_, M * H);
      shared_[0].forward(x, M, shared_gate_up_.data());
      glu_rows(shared_gate_up_.data(), M, S, shared_activated_.data(), activation_ == 1);
      shared_[1].forward(shared_activated_.data(), M, shared_out_.data());
      for (int64_t m = 0; m < M; ++m) {
        const float g = shared_output_gate_.defined()
                            ? 1.f / (1.f + std::exp(-dot_f32(x + m * H, shared_output_gate_.data_ptr<float>(), H)))
                            : 1.f;
        for (int64_t h = 0; h < H; ++h) out[m * H + h] += g * shared_out_[m * H + h];
      }
      num_bytes += shared_output_gate_.defined() ? H * 4 : 0;  // the shared products count their own
    }
    bytes_read_->fetch_add(num_bytes + router_weight_.numel() * 4, std::memory_order_relaxed);
  }

  at::Tensor call(const at::Tensor& x, const c10::optional<at::Tensor>& router_x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(1) == hidden_,
                "x must be a [rows, ", hidden_, "] float32 CPU tensor");
    const at::Tensor input = x.contiguous();
    at::Tensor router_input;
    if (router_x.has_value()) {
      router_input = router_x->contiguous();
      check_f32(router_input, "router_x");
      TORCH_CHECK(router_input.sizes() == x.sizes(), "router_x must be shaped as x");
    }
    at::Tensor out = at::empty({x.size(0), hidden_}, x.options());
    forward(input.data_ptr<float>(), x.size(0), out.data_ptr<float>(),
            router_input.defined() ? router_input.data_ptr<float>() : nullptr);
    return out;
  }

  // The weight bytes every call so far has read, its copies' included: the chosen experts', the
  // router's and the shared expert's gate (a step's is the difference across it; the shared
  // expert's products count theirs).
  int64_t weight_bytes_read() const {
    int64_t total = bytes_read_->load(std::memory_order_relaxed);
    for (const PackedLinear& linear : shared_) total += linear.weight_bytes_read();
    return total;
  }
  int64_t num_bytes() const {
    int64_t total = router_weight_.numel() * 4 + gate_.numel() + up_.numel() + down_.numel();
    for (const PackedLinear& linear : shared_) total += linear.num_bytes();
    return total;
  }

 private:
  static void grow(std::vector<float>& buffer, int64_t size) {
    if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  }

  at::Tensor router_weight_, router_bias_, selection_bias_;
  int64_t num_experts_, hidden_, k_, intermediate_;
  Scoring scoring_;
  bool normalize_;
  float scale_;
  at::Tensor gate_, up_, down_, gate_bias_, up_bias_, down_bias_;
  int64_t activation_;
  float alpha_, limit_;
  bool precise_;
  std::vector<PackedLinear> shared_;
  at::Tensor shared_output_gate_, expert_scale_;
  std::vector<ExpertProjection> gate_up_projections_, down_projections_;
  std::shared_ptr<std::atomic<int64_t>> bytes_read_ = std::make_shared<std::atomic<int64_t>>(0);
  // Scratch kept across calls (only grown).
  std::vector<float> logits_, scores_, weights_, grouped_, gate_up_, activated_, pair_out_, shared_gate_up_,
      shared_activated_, shared_out_;
  std::vector<int64_t> expert_ids_, pair_positions_;
  ExpertRows rows_;
  QuantizedActivations activations_;
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor input = x.contiguous();
  check_f32(input, "x");
  check_f32(weight, "weight");
  at::Tensor out = at::empty_like(input);
  const int64_t dim = input.size(-1);
  rms_norm_rows(input.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), input.numel() / dim, dim,
                static_cast<float>(eps));
  return out;
}

// act(gate) * up from a fused [rows, 2 * intermediate] tensor; act: SiLU, or tanh-GELU if gelu.
at::Tensor glu_mul(const at::Tensor& gate_up, bool gelu) {
  const at::Tensor input = gate_up.contiguous();
  check_f32(input, "gate_up");
  const int64_t intermediate = input.size(-1) / 2, rows = input.numel() / input.size(-1);
  at::Tensor out = at::empty({rows, intermediate}, input.options());
  glu_rows(input.data_ptr<float>(), rows, intermediate, out.data_ptr<float>(), gelu);
  return out;
}

// Calls fn(key, value) with the caches' data as float*, at::BFloat16* or int8_t*, after checking
// that a slot is num_kv_heads heads of head_dim values (plus the scale of an int8 head).
template <typename Fn>
void with_kv_cache(const at::Tensor& key_cache, const at::Tensor& value_cache, const Shape& shape, Fn&& fn) {
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar) &&
                  value_cache.scalar_type() == dtype && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "the KV cache must be contiguous float32, bfloat16 or int8, the same for keys and values; got ",
              key_cache.scalar_type(), " and ", value_cache.scalar_type());
  const int64_t width = dtype == at::kChar ? head_stride<int8_t>(shape.head_dim) : shape.head_dim;
  for (const auto* cache : {&key_cache, &value_cache}) {
    TORCH_CHECK(cache->dim() == 3 && cache->size(1) == shape.num_kv_heads && cache->size(2) == width,
                "a KV cache of ", dtype, " for ", shape.num_kv_heads, " heads of ", shape.head_dim,
                " must be [slots, ", shape.num_kv_heads, ", ", width, "]; got ", cache->sizes());
  }
  if (dtype == at::kBFloat16) {
    fn(key_cache.data_ptr<at::BFloat16>(), value_cache.data_ptr<at::BFloat16>());
  } else if (dtype == at::kChar) {
    fn(key_cache.data_ptr<int8_t>(), value_cache.data_ptr<int8_t>());
  } else {
    fn(key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
  }
}

// qkv [T, (H + 2 KVH) hd] float32, rotated in place; k and v written to the caches.
void rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& key_cache, at::Tensor& value_cache,
                   const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_f32(qkv, "qkv");
  with_kv_cache(key_cache, value_cache, Shape{num_heads, num_kv_heads, head_dim}, [&](auto* keys, auto* values) {
    rope_and_write(qkv.data_ptr<float>(), qkv.size(0), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                   sin.data_ptr<float>(), keys, values, slot_mapping.data_ptr<int64_t>(),
                   Shape{num_heads, num_kv_heads, head_dim});
  });
}

// q rows: the first num_heads*head_dim columns of qkv [D, ...]; returns [D, num_heads*head_dim].
// sinks: [num_heads] float32 attention sinks, or None.
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& slot_table,
                            const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, double scale, const c10::optional<at::Tensor>& sinks) {
  check_f32(qkv, "qkv");
  if (sinks.has_value()) {
    check_f32(*sinks, "sinks");
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads, "sinks must be [num_heads=", num_heads,
                "], got ", sinks->sizes());
  }
  const int64_t D = slot_table.size(0);
  at::Tensor out = at::empty({D, num_heads * head_dim}, qkv.options());
  with_kv_cache(key_cache, value_cache, Shape{num_heads, num_kv_heads, head_dim}, [&](auto* keys, auto* values) {
    decode_attention_rows(qkv.data_ptr<float>(), qkv.size(1), keys, values, slot_table.data_ptr<int64_t>(),
                          slot_table.size(1), context_lens.data_ptr<int64_t>(), D,
                          Shape{num_heads, num_kv_heads, head_dim}, static_cast<float>(scale), out.data_ptr<float>(),
                          sinks.has_value() ? sinks->data_ptr<float>() : nullptr);
  });
  return out;
}

// All layers of a decode-only step in one call: no Python between operations. Uses exactly
// the functions above, in the model's order, so its rows equal the per-op path's. Serves Llama
// (two norms per layer, SiLU, one RoPE table, one KV group) and Gemma 3 (norms after attention
// and after the feed-forward, per-head q/k norms, tanh-GELU, a RoPE table per layer kind, and
// one slot table per KV group: the sliding groups' tables cover only their window). An empty
// vector of optional norms means the model has none.
class FusedDecoder {
 public:
  FusedDecoder(std::vector<at::Tensor> input_norms, std::vector<at::Tensor> post_norms,
               std::vector<PackedLinear> qkv, std::vector<PackedLinear> o_proj, std::vector<PackedLinear> gate_up,
               std::vector<PackedLinear> down, std::vector<at::Tensor> key_caches,
               std::vector<at::Tensor> value_caches, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden_size,
               int64_t intermediate_size, double eps, double scale, bool gelu,
               std::vector<at::Tensor> post_attention_norms, std::vector<at::Tensor> post_feedforward_norms,
               std::vector<at::Tensor> q_norms, std::vector<at::Tensor> k_norms, std::vector<int64_t> layer_groups,
               std::vector<SparseExperts> experts, std::vector<at::Tensor> sinks)
      : input_norms_(std::move(input_norms)), post_norms_(std::move(post_norms)), qkv_(std::move(qkv)),
        o_proj_(std::move(o_proj)), gate_up_(std::move(gate_up)), down_(std::move(down)),
        key_caches_(std::move(key_caches)), value_caches_(std::move(value_caches)), cos_(std::move(cos)),
        sin_(std::move(sin)), shape_{num_heads, num_kv_heads, head_dim}, hidden_size_(hidden_size),
        intermediate_size_(intermediate_size), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)),
        gelu_(gelu), post_attention_norms_(std::move(post_attention_norms)),
        post_feedforward_norms_(std::move(post_feedforward_norms)), q_norms_(std::move(q_norms)),
        k_norms_(std::move(k_norms)), layer_groups_(std::move(layer_groups)), experts_(std::move(experts)),
        sinks_(std::move(sinks)) {
    const size_t L = qkv_.size();
    TORCH_CHECK(cos_.size() == L && sin_.size() == L && layer_groups_.size() == L, "one RoPE table and group per layer");
    TORCH_CHECK(experts_.empty() ? gate_up_.size() == L && down_.size() == L : experts_.size() == L && gate_up_.empty(),
                "every layer's feed-forward: gate_up and down, or sparse experts");

    for (auto* optional : {&post_attention_norms_, &post_feedforward_norms_, &q_norms_, &k_norms_, &sinks_}) {
      TORCH_CHECK(optional->empty() || optional->size() == L, "optional norms and sinks: none or one per layer");
    }
    for (const at::Tensor& sink : sinks_) {
      check_f32(sink, "sinks");
      TORCH_CHECK(sink.numel() == num_heads, "sinks must be [num_heads=", num_heads, "]");
    }
  }

  // hidden [D, hidden] float32 -> hidden after every layer (before the final norm). Per KV
  // group: the slots this step writes, each row's context slots and their counts.
  at::Tensor forward(const at::Tensor& hidden_in, const at::Tensor& positions,
                     const std::vector<at::Tensor>& slot_mappings, const std::vector<at::Tensor>& slot_tables,
                     const std::vector<at::Tensor>& context_lens) {
    at::Tensor hidden = hidden_in.contiguous().clone();
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
    for (size_t layer = 0; layer < qkv_.size(); ++layer) {
      const int64_t group = layer_groups_[layer];
      const at::Tensor &slot_table = slot_tables[group];
      rms_norm_rows(h, input_norms_[layer].data_ptr<float>(), normed.data(), D, H, eps_);
      qkv_[layer].forward(normed.data(), D, qkv.data());
      if (!q_norms_.empty()) {
        normalize_heads_rows(qkv.data(), D, qkv_size, shape_, q_norms_[layer].data_ptr<float>(),
                             k_norms_[layer].data_ptr<float>(), eps_);
      }
      with_kv_cache(key_caches_[layer], value_caches_[layer], shape_, [&](auto* keys, auto* values) {
        rope_and_write(qkv.data(), D, positions.data_ptr<int64_t>(), cos_[layer].data_ptr<float>(),
                       sin_[layer].data_ptr<float>(), keys, values, slot_mappings[group].data_ptr<int64_t>(), shape_);
        decode_attention_rows(qkv.data(), qkv_size, keys, values, slot_table.data_ptr<int64_t>(), slot_table.size(1),
                              context_lens[group].data_ptr<int64_t>(), D, shape_, scale_, attended.data(),
                              sinks_.empty() ? nullptr : sinks_[layer].data_ptr<float>());
      });
      o_proj_[layer].forward(attended.data(), D, projected.data());
      if (!post_attention_norms_.empty()) {
        rms_norm_rows(projected.data(), post_attention_norms_[layer].data_ptr<float>(), projected.data(), D, H, eps_);
      }
      for (int64_t i = 0; i < D * H; ++i) h[i] += projected[i];
      rms_norm_rows(h, post_norms_[layer].data_ptr<float>(), normed.data(), D, H, eps_);
      if (experts_.empty()) {
        gate_up_[layer].forward(normed.data(), D, gate_up.data());
        glu_rows(gate_up.data(), D, intermediate_size_, activated.data(), gelu_);
        down_[layer].forward(activated.data(), D, projected.data());
      } else {
        experts_[layer].forward(normed.data(), D, projected.data());
      }
      if (!post_feedforward_norms_.empty()) {
        rms_norm_rows(projected.data(), post_feedforward_norms_[layer].data_ptr<float>(), projected.data(), D, H, eps_);
      }
      for (int64_t i = 0; i < D * H; ++i) h[i] += projected[i];
    }
    return hidden;
  }

 private:
  std::vector<at::Tensor> input_norms_, post_norms_;
  std::vector<PackedLinear> qkv_, o_proj_, gate_up_, down_;
  std::vector<at::Tensor> key_caches_, value_caches_;
  std::vector<at::Tensor> cos_, sin_;
  Shape shape_;
  int64_t hidden_size_, intermediate_size_;
  float eps_, scale_;
  bool gelu_;
  std::vector<at::Tensor> post_attention_norms_, post_feedforward_norms_, q_norms_, k_norms_;
  std::vector<int64_t> layer_groups_;
  std::vector<SparseExperts> experts_;
  std::vector<at::Tensor> sinks_;
  std::vector<float> normed_, qkv_out_, attended_, projected_, gate_up_out_, activated_;
};

bool has_vnni() { return TOKIOS_VNNI; }
bool has_avx2() { return TOKIOS_AVX2; }
bool has_bf16_dot() { return TOKIOS_BF16_DOT; }

}  // namespace

// Every op releases the GIL: the engine steps in a background thread, and a kernel holding the
// GIL would make the server's event loop wait out Python's 5 ms switch interval on every token
// (measured: AsyncEngine TPOT 11.4 ms vs 6.6 ms for the same step run offline).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  module.def("pack_ints", &pack_ints, "a tensor's block integers -> the kernel's interleaved groups of 16 features",
             release_gil());
  module.def("pack_expert_ints", &pack_expert_ints,
             "every expert's block integers -> the kernel's groups, expert after expert", release_gil());
  module.def("dequantize_packed", &dequantize_packed, "packed groups -> [N, K] float32", release_gil());
  pybind11::class_<PackedLinear>(module, "PackedLinear")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, int64_t, bool,
                          c10::optional<at::Tensor>, bool>(),
           pybind11::arg("packed"), pybind11::arg("formats"), pybind11::arg("out_features"),
           pybind11::arg("in_features"), pybind11::arg("precise"), pybind11::arg("bias"),
           pybind11::arg("exact_sums") = false)
      .def("__call__", &PackedLinear::call, release_gil())
      .def("partial_sums", &PackedLinear::partial_sums, release_gil())
      .def_property_readonly("out_features", &PackedLinear::out_features)
      .def_property_readonly("in_features", &PackedLinear::in_features)
      .def_property_readonly("num_bytes", &PackedLinear::num_bytes)
      .def_property_readonly("weight_bytes_read", &PackedLinear::weight_bytes_read);
  pybind11::class_<SparseExperts>(module, "SparseExperts")
      .def(pybind11::init<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t, int64_t, bool,
                          double, at::Tensor, int64_t, at::Tensor, int64_t, at::Tensor, int64_t, int64_t,
                          c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t,
                          double, double, bool, std::vector<PackedLinear>, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>>())
      .def("__call__", &SparseExperts::call, pybind11::arg("x"), pybind11::arg("router_x") = pybind11::none(),
           release_gil())
      .def_property_readonly("weight_bytes_read", &SparseExperts::weight_bytes_read)
      .def_property_readonly("num_bytes", &SparseExperts::num_bytes);
  module.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32)", release_gil());
  module.def("glu_mul", &glu_mul, "act(gate) * up from a fused [rows, 2 * intermediate] tensor (SiLU, or tanh-GELU)",
             release_gil());
  module.def("rope_write_kv", &rope_write_kv, "rotate q and k of a fused qkv tensor in place; write k, v to the cache",
             release_gil());
  module.def("decode_attention", &decode_attention, "one query token per request over its paged KV context",
             pybind11::arg("qkv"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
             pybind11::arg("slot_table"), pybind11::arg("context_lens"), pybind11::arg("num_heads"),
             pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"),
             pybind11::arg("sinks") = pybind11::none(), release_gil());
  module.def("has_vnni", &has_vnni, "whether the AVX-512 VNNI path was compiled");
  module.def("has_avx2", &has_avx2, "whether the AVX2 path was compiled");
  module.def("has_bf16_dot", &has_bf16_dot,
             "whether attention over a bfloat16 cache uses bfloat16 dot products (queries and weights rounded)");
  pybind11::class_<FusedDecoder>(module, "FusedDecoder")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<PackedLinear>,
                          std::vector<PackedLinear>, std::vector<PackedLinear>, std::vector<PackedLinear>,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, bool,
                          std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<int64_t>, std::vector<SparseExperts>,
                          std::vector<at::Tensor>>())
      .def("forward", &FusedDecoder::forward, release_gil());
}
