// Weight-only quantized linear layers for the CPU: y[M, N] = x[M, K] . W[N, K]^T (+ bias).
//
// Weights are stored in GGML's block formats, one row of blocks per output feature:
//   Q4_1 (20 bytes / 32 weights): fp16 scale d, fp16 minimum m, 16 bytes of nibbles;
//        w[j] = d * q[j] + m, element j in the low nibble of byte j, element j+16 in the high.
//   Q8_0 (34 bytes / 32 weights): fp16 scale d, 32 signed bytes; w[j] = d * q[j].
// Activations are quantized per row to 8-bit blocks of 32 (scale + the sum of the quantized
// values, which the Q4_1 minimum needs), as llama.cpp does, so each block's dot product is a
// single AVX-512 VNNI instruction (vpdpbusd: 32 u8 x s8 products summed into 8 int32 lanes).
// Why: decode reads every weight once per step, so bytes per weight set the speed; 4-bit
// blocks read ~5 bits per weight instead of 32 (float32), and VNNI keeps the arithmetic off
// the critical path even for a batch of decodes (the weight row stays in L1 across the batch).
//
// Threads: at::parallel_for over output features, so torch.set_num_threads governs it.
// A portable scalar path (same arithmetic) is compiled when VNNI is not available.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define TOKIOS_VNNI 1
#else
#define TOKIOS_VNNI 0
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ8_0Bytes = 34;

struct ActivationBlock {
  float scale;
  int32_t sum;  // sum of qs, for the Q4_1 minimum term
  int8_t qs[kBlock];
};

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

void quantize_row(const float* x, ActivationBlock* out, int64_t num_blocks) {
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f;
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inverse));
      out[b].qs[j] = static_cast<int8_t>(v);
      sum += v;
    }
    out[b].scale = scale;
    out[b].sum = sum;
  }
}

#if TOKIOS_VNNI
inline float horizontal_sum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
#endif

// Dot products of one weight row with R activation rows (R <= kMaxRows), written to out[r].
// The weight block is unpacked once and reused for every row; each row keeps its own
// accumulator and adds its blocks in the same order whatever R is, so a row's result is the same
// alone or in a batch (one implementation serves both: R = 1 is the single-row case).
constexpr int kMaxRows = 8;

template <int R>
void dot_q4_1_rows(const uint8_t* row, const ActivationBlock* const* a, int64_t num_blocks, float* out) {
#if TOKIOS_VNNI
  __m256 acc[R];
  float acc_min[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); acc_min[r] = 0.f; }
  const __m128i low_mask = _mm_set1_epi8(0x0f);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = row + b * kQ4_1Bytes;
    const float d = _cvtsh_ss(load_u16(block));
    const float m = _cvtsh_ss(load_u16(block + 2));
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low_mask),
                                       _mm_and_si128(packed, low_mask));
    for (int r = 0; r < R; ++r) {
      const ActivationBlock& x = a[r][b];
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xq);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x.scale), acc[r]);
      acc_min[r] += m * x.scale * static_cast<float>(x.sum);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = horizontal_sum(acc[r]) + acc_min[r];
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = row + b * kQ4_1Bytes;
      const float d = half_to_float(load_u16(block)), m = half_to_float(load_u16(block + 2));
      const ActivationBlock& x = a[r][b];
      int32_t dot = 0;
      for (int j = 0; j < 16; ++j) dot += (block[4 + j] & 0x0f) * x.qs[j] + (block[4 + j] >> 4) * x.qs[j + 16];
      total += d * x.scale * dot + m * x.scale * x.sum;
    }
    out[r] = total;
  }
#endif
}

template <int R>
void dot_q8_0_rows(const uint8_t* row, const ActivationBlock* const* a, int64_t num_blocks, float* out) {
#if TOKIOS_VNNI
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = row + b * kQ8_0Bytes;
    const float d = _cvtsh_ss(load_u16(block));
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    const __m256i w_abs = _mm256_abs_epi8(w);  // vpdpbusd multiplies unsigned by signed:
    for (int r = 0; r < R; ++r) {               // move w's sign onto x.
      const ActivationBlock& x = a[r][b];
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w_abs, _mm256_sign_epi8(xq, w));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * x.scale), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = horizontal_sum(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = row + b * kQ8_0Bytes;
      const int8_t* w = reinterpret_cast<const int8_t*>(block + 2);
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += w[j] * a[r][b].qs[j];
      total += half_to_float(load_u16(block)) * a[r][b].scale * dot;
    }
    out[r] = total;
  }
#endif
}

template <int R>
void dot_rows(int64_t format, const uint8_t* row, const ActivationBlock* const* a, int64_t num_blocks, float* out) {
  if (format == 0) {
    dot_q4_1_rows<R>(row, a, num_blocks, out);
  } else {
    dot_q8_0_rows<R>(row, a, num_blocks, out);
  }
}

using DotRowsFunction = void (*)(int64_t, const uint8_t*, const ActivationBlock* const*, int64_t, float*);
constexpr DotRowsFunction kDotRows[kMaxRows + 1] = {nullptr, dot_rows<1>, dot_rows<2>, dot_rows<3>, dot_rows<4>,
                                                    dot_rows<5>, dot_rows<6>, dot_rows<7>, dot_rows<8>};

// y[M, N] = x[M, K] . W^T (+ bias), W in Q4_1 (format 0) or Q8_0 (format 1) blocks.
// Each output element is one dot product computed the same way whatever M is, so a row's
// result does not depend on what else is in the batch.
void quant_matmul(const float* x, int64_t M, int64_t K, const uint8_t* weight, int64_t N, int64_t format,
                  const float* bias, float* out) {
  const int64_t block_bytes = format == 0 ? kQ4_1Bytes : kQ8_0Bytes;
  const int64_t num_blocks = K / kBlock;
  std::vector<ActivationBlock> activations(M * num_blocks);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(x + m * K, activations.data() + m * num_blocks, num_blocks);
  });
  const ActivationBlock* a_data = activations.data();
  const int64_t row_bytes = num_blocks * block_bytes;
  // Each weight row is read once per tile of up to kMaxRows activation rows (L1-resident).
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    const ActivationBlock* rows[kMaxRows];
    float results[kMaxRows];
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int tile = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
      for (int r = 0; r < tile; ++r) rows[r] = a_data + (m0 + r) * num_blocks;
      for (int64_t n = begin; n < end; ++n) {
        kDotRows[tile](format, weight + n * row_bytes, rows, num_blocks, results);
        const float b = bias ? bias[n] : 0.f;
        for (int r = 0; r < tile; ++r) out[(m0 + r) * N + n] = results[r] + b;
      }
    }
  });
}

void rms_norm_rows(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float sum_squares = 0.f;
    for (int64_t j = 0; j < dim; ++j) sum_squares += xr[j] * xr[j];
    const float inverse = 1.f / std::sqrt(sum_squares / static_cast<float>(dim) + eps);
    for (int64_t j = 0; j < dim; ++j) out[r * dim + j] = xr[j] * inverse * weight[j];
  }
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

// qkv [T, (H + 2 KVH) * hd]: rotates q and k in place and writes k, v into the caches.
void rope_and_write(float* qkv, int64_t num_tokens, const int64_t* positions, const float* cos_table,
                    const float* sin_table, float* key_cache, float* value_cache, const int64_t* slot_mapping,
                    const Shape& shape) {
  const int64_t hd = shape.head_dim, q_size = shape.num_heads * hd, kv_size = shape.num_kv_heads * hd;
  const int64_t row = q_size + 2 * kv_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* token = qkv + t * row;
    const float* cos = cos_table + positions[t] * hd;
    const float* sin = sin_table + positions[t] * hd;
    rotate(token, shape.num_heads, hd, cos, sin);
    rotate(token + q_size, shape.num_kv_heads, hd, cos, sin);
    std::memcpy(key_cache + slot_mapping[t] * kv_size, token + q_size, kv_size * sizeof(float));
    std::memcpy(value_cache + slot_mapping[t] * kv_size, token + q_size + kv_size, kv_size * sizeof(float));
  }
}

// One query token per request over its paged context. q rows are read from qkv (stride
// q_stride); out [D, H * hd]. Parallel over (request, head).
void decode_attention_rows(const float* q, int64_t q_stride, const float* key_cache, const float* value_cache,
                           const int64_t* slot_table, int64_t max_context, const int64_t* context_lens,
                           int64_t num_requests, const Shape& shape, float scale, float* out) {
  const int64_t H = shape.num_heads, KVH = shape.num_kv_heads, hd = shape.head_dim;
  const int64_t group = H / KVH;
  at::parallel_for(0, num_requests * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(max_context);
    std::vector<float> accumulator(hd);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t d = index / H, h = index % H, g = h / group;
      const float* query = q + d * q_stride + h * hd;
      const int64_t length = context_lens[d];
      const int64_t* slots = slot_table + d * max_context;
      float maximum = -INFINITY;
      for (int64_t l = 0; l < length; ++l) {
        const float* key = key_cache + (slots[l] * KVH + g) * hd;
        float dot = 0.f;
        for (int64_t j = 0; j < hd; ++j) dot += query[j] * key[j];
        scores[l] = dot * scale;
        maximum = std::max(maximum, scores[l]);
      }
      float total = 0.f;
      for (int64_t l = 0; l < length; ++l) {
        scores[l] = std::exp(scores[l] - maximum);
        total += scores[l];
      }
      std::fill(accumulator.begin(), accumulator.end(), 0.f);
      for (int64_t l = 0; l < length; ++l) {
        const float* value = value_cache + (slots[l] * KVH + g) * hd;
        const float p = scores[l];
        for (int64_t j = 0; j < hd; ++j) accumulator[j] += p * value[j];
      }
      float* o = out + d * H * hd + h * hd;
      const float inverse = 1.f / total;
      for (int64_t j = 0; j < hd; ++j) o[j] = accumulator[j] * inverse;
    }
  });
}

void silu_mul_rows(const float* gate_up, int64_t rows, int64_t intermediate, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * intermediate;
    const float* up = gate + intermediate;
    for (int64_t j = 0; j < intermediate; ++j) {
      out[r * intermediate + j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
    }
  }
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

// qkv [T, (H + 2 KVH) hd] float32, rotated in place; k and v written to the caches.
void rope_write_kv(torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                   const torch::Tensor& sin, torch::Tensor& key_cache, torch::Tensor& value_cache,
                   const torch::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_f32(qkv, "qkv");
  check_f32(key_cache, "key_cache");
  check_f32(value_cache, "value_cache");
  rope_and_write(qkv.data_ptr<float>(), qkv.size(0), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                 sin.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                 slot_mapping.data_ptr<int64_t>(), Shape{num_heads, num_kv_heads, head_dim});
}

// q rows: the first num_heads*head_dim columns of qkv [D, ...]; returns [D, num_heads*head_dim].
torch::Tensor decode_attention(const torch::Tensor& qkv, const torch::Tensor& key_cache,
                               const torch::Tensor& value_cache, const torch::Tensor& slot_table,
                               const torch::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, double scale) {
  check_f32(qkv, "qkv");
  const int64_t D = slot_table.size(0);
  torch::Tensor out = torch::empty({D, num_heads * head_dim}, qkv.options());
  decode_attention_rows(qkv.data_ptr<float>(), qkv.size(1), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                        slot_table.data_ptr<int64_t>(), slot_table.size(1), context_lens.data_ptr<int64_t>(), D,
                        Shape{num_heads, num_kv_heads, head_dim}, static_cast<float>(scale), out.data_ptr<float>());
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
    std::vector<float> normed(D * H), qkv(D * qkv_size), attended(D * q_size), projected(D * H),
        gate_up(D * 2 * intermediate_size_), activated(D * intermediate_size_);
    float* h = hidden.data_ptr<float>();
    const float scale = 1.f / std::sqrt(static_cast<float>(shape_.head_dim));
    for (size_t layer = 0; layer < qkv_.size(); ++layer) {
      rms_norm_rows(h, input_norms_[layer].data_ptr<float>(), normed.data(), D, H, eps_);
      const float* bias = qkv_bias_.empty() ? nullptr : qkv_bias_[layer].data_ptr<float>();
      quant_matmul(normed.data(), D, H, qkv_[layer].data_ptr<uint8_t>(), qkv_size, format_, bias, qkv.data());
      rope_and_write(qkv.data(), D, positions.data_ptr<int64_t>(), cos_.data_ptr<float>(), sin_.data_ptr<float>(),
                     key_caches_[layer].data_ptr<float>(), value_caches_[layer].data_ptr<float>(),
                     slot_mapping.data_ptr<int64_t>(), shape_);
      decode_attention_rows(qkv.data(), qkv_size, key_caches_[layer].data_ptr<float>(),
                            value_caches_[layer].data_ptr<float>(), slot_table.data_ptr<int64_t>(), slot_table.size(1),
                            context_lens.data_ptr<int64_t>(), D, shape_, scale, attended.data());
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
