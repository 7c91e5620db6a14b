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

#endif
