// Which vector instructions this build of the kernels uses, chosen by the compiler's target
// (-march=native at build): AVX-512 VNNI (vpdpbusd; with BF16 also vdpbf16ps), else AVX2 with
// FMA and F16C (vpmaddubsw), else portable scalar loops. Every block type has a kernel on each.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKIOS_VNNI 1
#else
#define TOKIOS_VNNI 0
#endif

// bfloat16 dot products (vdpbf16ps: Zen 4, Sapphire Rapids, Cooper Lake; not Ice Lake or
// Cascade Lake): the attention over a bfloat16 KV cache multiplies bfloat16 pairs directly.
#if TOKIOS_VNNI && defined(__AVX512BF16__)
#define TOKIOS_BF16_DOT 1
#else
#define TOKIOS_BF16_DOT 0
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKIOS_AVX2 1
#else
#define TOKIOS_AVX2 0
#endif

#if TOKIOS_VNNI || TOKIOS_AVX2
#include <immintrin.h>
#endif

namespace tokios {


inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// IEEE fp16 -> fp32 without F16C (the scalar path).
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

inline float bfloat16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

}  // namespace tokios
