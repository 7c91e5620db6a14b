/* Helpers shared by Foveal's native CPU kernels (built by foveal/native.py, which puts this folder on
 * the include path and this file in every build's cache key). */
#ifndef FOVEAL_NATIVE_H
#define FOVEAL_NATIVE_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, as torch does; NaN stays NaN (quieted); branch-free so loops vectorize */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

/* e^x for x <= 0 (softmax scores minus their max, SiLU's e^-|x|), branch-free so loops vectorize:
 * e^x = 2^i e^f with i = rint(x log2 e) and f = x - i ln 2 in two steps (Cody-Waite: ln 2 split so
 * i ln2_hi is exact; a build with reassociation may merge them, costing a few ulps at |x| ~ 20),
 * |f| <= ln(2) / 2, e^f by its Taylor series to degree 7 (relative error < 1e-8). 0 below -87 (where
 * torch's silu(x) = x / (1 + e^-x) is -0 too); NaN stays NaN (a NaN score poisons its row, as in SDPA). */
static inline float exp_nonpositive(float x0) {
    const float x = x0 < -87.0f ? -87.0f : x0;
    const float i = __builtin_rintf(x * 1.4426950408889634f);
    const float f = (x - i * 0.693145751953125f) - i * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)(i == i ? i : 0.0f) + 127) << 23;
    float pow2;
    memcpy(&pow2, &bits, 4);
    return x0 < -87.0f ? 0.0f : p * pow2;
}

#endif
