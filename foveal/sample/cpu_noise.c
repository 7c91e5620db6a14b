/* The sampler's counter-based noise on the CPU (foveal/sample/noise.py has the contract and the torch
 * version): E[r, j] = -log U, U = ((h >> 9) + 0.5) / 2^23, h = mix(mix(j ^ k0[r]) ^ k1[r]) with mix the
 * "lowbias32" integer finalizer. The same uniforms, bit for bit, as the torch ops and the Triton kernel. */
#include <math.h>
#include <stdint.h>

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* keys: int64 [rows, 2] (low and high 32 bits of each row's key); out: float32 [rows, vocab], the
 * exponentials E (uniform == 0) or the uniforms U themselves (uniform == 1) */
void foveal_noise_fill(const int64_t *keys, int64_t rows, int64_t vocab, int uniform, float *out) {
#pragma omp parallel for schedule(static) if (rows * vocab >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t k0 = (uint32_t)keys[2 * r], k1 = (uint32_t)keys[2 * r + 1];
        float *o = out + r * vocab;
        for (int64_t j = 0; j < vocab; j++) {
            const uint32_t h = mix32(mix32((uint32_t)j ^ k0) ^ k1);
            const float u = ((float)(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
            o[j] = uniform ? u : -logf(u);
        }
    }
}
