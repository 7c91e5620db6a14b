/* 4-bit block-quantized linear layers on x86 CPUs with AVX2 (Foveal; built and loaded by
 * foveal/layers/quant.py through foveal/native.py).
 *
 * Weights: blocks of 32 along K, w[n, k] = d[n, b] * q[n, k] + m[n, b] with q in 0..15 (GGUF Q4_1 as
 * stored; Q4_0 has m = -8 d; Q8_0 is two such planes, see quant.py). Packed per panel of 8 output
 * columns, block after block: 128 bytes of nibbles (byte j of the 32-byte row g holds column
 * (j / 4) % 8's k = 4 g + j % 4 in its low nibble and k = 16 + 4 g + j % 4 in its high nibble), then
 * d[8] and m[8] as floats: 192 bytes per block per panel.
 *
 * Activations: each row quantized per block of 32 to int8 a = round(x / s), s = max|x| / 127 (as
 * llama.cpp's Q8_1), with sum[b] = s * sum(a) kept for the m term:
 *     y[n] = sum_b  d[n,b] s[b] (q . a)_b  +  m[n,b] sum[b]
 * (q . a) over one block is exact in int16 (|q a| <= 15 * 127, 8 pairs of products per lane: 30480 <
 * 32767), so a block costs 8 vpmaddubsw, one vpmaddwd and one float FMA per row and 8 columns.
 * Row tiles of 4 x 8 columns; OpenMP over column panels (each panel's weights read once per call).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

#define QK 32
#define PANEL 8
#define BLOCK_BYTES (128 + 64)

/* One row of K values (K % 32 == 0) -> int8 a[K], scale[K/32], sum[K/32]. */
static void quantize_row(const float *x, int64_t K, int8_t *a, float *scale, float *sum) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int total = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(xb[j] * inv);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            a[b * QK + j] = (int8_t)v;
            total += v;
        }
        scale[b] = s;
        sum[b] = s * (float)total;
    }
}

/* Row m of x ([M, K] rows ldx elements apart, f32 or bf16) -> a, scale, sum; reps > 1 repeats the row's
 * quantized K values reps times (a row of length reps * K: the planes of a Q8_0 weight). */
static void quantize_x_row(const void *x, int64_t ldx, int is_bf16, int64_t m, int64_t K, int reps,
                           int8_t *a, float *scale, float *sum) {
    const int64_t KR = K * reps, BR = KR / QK;
    float buf[K > 0 ? K : 1];
    const float *row;
    if (is_bf16) {
        const uint16_t *h = (const uint16_t *)x + m * ldx;
        for (int64_t k = 0; k < K; k++) buf[k] = bf16_to_f32(h[k]);
        row = buf;
    } else {
        row = (const float *)x + m * ldx;
    }
    quantize_row(row, K, a + m * KR, scale + m * BR, sum + m * BR);
    for (int r = 1; r < reps; r++) {
        memcpy(a + m * KR + r * K, a + m * KR, K);
        memcpy(scale + m * BR + r * (K / QK), scale + m * BR, K / QK * sizeof(float));
        memcpy(sum + m * BR + r * (K / QK), sum + m * BR, K / QK * sizeof(float));
    }
}

/* R (1..4) rows from m0 times one panel of 8 columns: out[r * 8 + j] (float). R is a constant in each
 * call site, so the row loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const int R, const int8_t *a, const float *scale,
                                                       const float *sum, int64_t m0, int64_t K,
                                                       const uint8_t *wp, __m256 bv, float *out) {
    const int64_t nb = K / QK;
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int8_t *ar[4];
    const float *sr[4], *ur[4];
    __m256 f[4], g[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        ar[r] = a + (m0 + r) * K;
        sr[r] = scale + (m0 + r) * nb;
        ur[r] = sum + (m0 + r) * nb;
        f[r] = bv;
        g[r] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wp + b * BLOCK_BYTES;
        _mm_prefetch((const char *)(wb + 4 * BLOCK_BYTES), _MM_HINT_T0);
        __m256i s[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int q = 0; q < 4; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 32 * q));
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            const int64_t k = b * QK + 4 * q;
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i alo = _mm256_set1_epi32(*(const int32_t *)(ar[r] + k));
                const __m256i ahi = _mm256_set1_epi32(*(const int32_t *)(ar[r] + k + 16));
                s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, alo));
                s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, ahi));
            }
        }
        const __m256 d = _mm256_loadu_ps((const float *)(wb + 128));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[r], ones)),
                                   _mm256_mul_ps(d, _mm256_set1_ps(sr[r][b])), f[r]);
    }
    /* the m terms in a second pass, two chains per row (a second FMA per block on the chain above kept
     * the block loop latency-bound) */
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256 m0v = _mm256_loadu_ps((const float *)(wp + b * BLOCK_BYTES + 160));
        const __m256 m1v = _mm256_loadu_ps((const float *)(wp + (b + 1) * BLOCK_BYTES + 160));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            f[r] = _mm256_fmadd_ps(m0v, _mm256_set1_ps(ur[r][b]), f[r]);
            g[r] = _mm256_fmadd_ps(m1v, _mm256_set1_ps(ur[r][b + 1]), g[r]);
        }
    }
    if (b < nb) {
        const __m256 m0v = _mm256_loadu_ps((const float *)(wp + b * BLOCK_BYTES + 160));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) f[r] = _mm256_fmadd_ps(m0v, _mm256_set1_ps(ur[r][b]), f[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * PANEL, _mm256_add_ps(f[r], g[r]));
}

static inline void store_bf16x8(uint16_t *o, __m256 v) { /* round to nearest even, as f32_to_bf16 */
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    _mm_storeu_si128((__m128i *)o, _mm256_castsi256_si128(packed));
}

/* Output columns [8 p, 8 p + 8) of y for all M rows. */
static void panel(int64_t p, const int8_t *a, const float *scale, const float *sum, int64_t M, int64_t K,
                  const uint8_t *w, int64_t N, const float *bias, void *y, int64_t ldy, int y_bf16) {
    const int64_t nb = K / QK;
    const uint8_t *wp = w + p * nb * BLOCK_BYTES;
    const int64_t n0 = p * PANEL, nv = N - n0 < PANEL ? N - n0 : PANEL;
    __m256 bv = _mm256_setzero_ps();
    if (bias) {
        float t[PANEL] = {0};
        memcpy(t, bias + n0, nv * sizeof(float));
        bv = _mm256_loadu_ps(t);
    }
    /* the next panel's weights (the model's weights stream from DRAM: 20% of a 16-row GEMM's time went
     * to waiting for them with only the in-panel prefetch below) */
    const char *next = (const char *)(wp + nb * BLOCK_BYTES);
    if (p + 1 < (N + PANEL - 1) / PANEL)
        for (int64_t o = 0; o < nb * BLOCK_BYTES; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
    float out[4 * PANEL];
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int rows = M - m0 < 4 ? (int)(M - m0) : 4;
        switch (rows) {
        case 4: tile(4, a, scale, sum, m0, K, wp, bv, out); break;
        case 3: tile(3, a, scale, sum, m0, K, wp, bv, out); break;
        case 2: tile(2, a, scale, sum, m0, K, wp, bv, out); break;
        default: tile(1, a, scale, sum, m0, K, wp, bv, out); break;
        }
        for (int r = 0; r < rows; r++) {
            const float *t = out + r * PANEL;
            if (y_bf16) {
                uint16_t *o = (uint16_t *)y + (m0 + r) * ldy + n0;
                if (nv == PANEL) store_bf16x8(o, _mm256_loadu_ps(t));
                else for (int j = 0; j < nv; j++) o[j] = f32_to_bf16(t[j]);
            } else {
                memcpy((float *)y + (m0 + r) * ldy + n0, t, nv * sizeof(float));
            }
        }
    }
}

/* y[M, N] (rows ldy apart, f32 or bf16 as x) = dequant(W) q8(x)^T (+ bias[N], f32), K % 32 == 0, with
 * scratch a [M, reps K], scale and sum [M, reps K / 32]. One parallel region: rows are quantized, then
 * (after the barrier) each thread computes its share of the column panels. */
void foveal_qlinear(const void *x, int64_t ldx, int is_bf16, int64_t M, int64_t K, int reps, int8_t *a,
                    float *scale, float *sum, const uint8_t *w, int64_t N, const float *bias, void *y,
                    int64_t ldy, int nthreads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_x_row(x, ldx, is_bf16, m, K, reps, a, scale, sum);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++)
            panel(p, a, scale, sum, M, K * reps, w, N, bias, y, ldy, is_bf16);
    }
}
