/* float16 group parameters read as stored (engine format 3): one IEEE half -> float32, exact.
 * x86 paths (avx512, avx2 = x86-64-v3) have F16C; the portable path converts the bits. */
#ifndef TRITIUM_CPU_F16_H
#define TRITIUM_CPU_F16_H
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

#if defined(__F16C__)
INLINE float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
INLINE float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t bits;
    if (e == 0x1F) bits = sign | 0x7F800000u | (m << 13);          /* inf / nan */
    else if (e) bits = sign | ((e + 112u) << 23) | (m << 13);      /* normal: rebias 15 -> 127 */
    else {                                                          /* zero / subnormal: m * 2^-24 */
        const float f = (float)m * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* p[i] as float32, or 0 when p is NULL (the symmetric int4 layout has no zeros). */
INLINE float f16_at(const uint16_t *p, int64_t i) { return p ? f16_to_f32(p[i]) : 0.0f; }
#endif
