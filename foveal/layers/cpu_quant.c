/* Block-quantized linear layers on x86 CPUs with AVX2 (Foveal; built and loaded by
 * foveal/layers/quant.py through foveal/native.py).
 *
 * 4-bit weights: blocks of 32 along K, w[n, k] = d[n, b] * q[n, k] + m[n, b] with q in 0..15 (GGUF Q4_1
 * as stored; Q4_0 has m = -8 d). Packed per panel of 8 output columns, block after block: 128 bytes of
 * nibbles (byte j of the 32-byte row g holds column (j / 4) % 8's k = 4 g + j % 4 in its low nibble and
 * k = 16 + 4 g + j % 4 in its high nibble), then d[8] and m[8] as fp16 (GGUF's own, exact): 160 bytes
 * per block per panel, 0.625 byte a weight as in the GGUF file (fp32 scales were 20% more bytes, and a
 * single stream reads every weight once a token). int8 weights (Q8_0): w = d q, q in -128..127; per
 * block 256 bytes (byte j of the 32-byte row g holds column j / 4's k = 4 g + j % 4), then d[8] as fp16:
 * 272 bytes.
 *
 * Activations: each row quantized per block of 32 to int8 a = round(x / s), s = max|x| / 127 (as
 * llama.cpp's Q8_1), with sum[b] = s * sum(a) kept for the m term:
 *     y[n] = sum_b  d[n,b] s[b] (q . a)_b  +  m[n,b] sum[b]
 * For 4-bit q, (q . a) over one block is exact in int16 (|q a| <= 15 * 127, 8 pairs of products per
 * lane: 30480 < 32767), so a block costs 8 vpmaddubsw, one vpmaddwd and one float FMA per row and 8
 * columns; int8 q needs a vpsignb and a vpmaddwd per vpmaddubsw (tile8).
 * Row tiles of 4 x 8 columns (4 x 16 with AVX-512); OpenMP over column panels (each panel's weights read
 * once per call).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

#define QK 32
#define PANEL 8

/* Two wider paths where -march=native has them; -DFOVEAL_AVX2_ONLY builds neither (what a plain AVX2
 * CPU runs: the tests compare the builds). Each computes every output column with the same exact integer
 * sums and the same float operations in the same order as the AVX2 tiles, so all builds give
 * bit-identical results.
 * - AVX-512 (F + BW): two panels (16 columns) per zmm, so each broadcast activation and each product
 *   instruction covers twice the columns (Zen 5 EPYC runs zmm at full width).
 * - VNNI (vpdpbusd: u8 x s8 products summed by 4 into int32 lanes, one instruction for vpmaddubsw +
 *   vpmaddwd + vpaddd; AVX512-VNNI with VL: Zen 4 and later, Ice Lake and later; AVX-VNNI: Alder Lake)
 *   for the int8 weights (tile8, tile8x16) only: there it replaces three instructions per product
 *   vector (the Q8_0 LM head at 16 rows 1.11-1.19x on a Zen 5 EPYC, measured with the ymm tiles), while
 *   the 4-bit tile's int16 sums cost one vpaddw per product vector and vpdpbusd there measured 0.93x.
 * (benchmarks/cpu_kernels.py --linears-against avx2 times this CPU's build against the AVX2 one.) */
#if !defined(FOVEAL_AVX2_ONLY) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif !defined(FOVEAL_AVX2_ONLY) && defined(__AVXVNNI__)
#define HAVE_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define HAVE_VNNI 0
#endif
#if !defined(FOVEAL_AVX2_ONLY) && defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* what this build uses: bit 0 VNNI, bit 1 AVX-512 */
int foveal_qlinear_isa(void) { return HAVE_VNNI | HAVE_AVX512 << 1; }
#define Q4_BLOCK (128 + 32) /* nibbles, d[8], m[8] (fp16) */
#define Q8_BLOCK (256 + 16) /* int8 weights, d[8] (fp16) */

/* 8 fp16 scales -> floats (exact) */
static inline __m256 load_ph8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline __m256 load8(const void *x, int is_bf16, int64_t i) {
    if (is_bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

/* One row of K values (f32 or bf16, K % 32 == 0) -> int8 a[K], scale[K/32], sum[K/32]: per block
 * s = max|x| / 127, a = x * (127 / max|x|) rounded to nearest even (the default rounding mode), in
 * -127..127. */
static void quantize_row(const void *x, int is_bf16, int64_t K, int8_t *a, float *scale, float *sum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), floor8 = _mm256_set1_epi8(-127);
    for (int64_t b = 0; b < K / QK; b++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = load8(x, is_bf16, b * QK + 8 * i);
        const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        /* bytes of q0 q1 q2 q3 by 128-bit lane after the packs; the permute puts them in order */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        const __m256i bytes = _mm256_max_epi8(_mm256_permutevar8x32_epi32(packed, order), floor8);
        _mm256_storeu_si256((__m256i *)(a + b * QK), bytes);
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
        scale[b] = amax / 127.f;
        sum[b] = scale[b] * (float)_mm_cvtsi128_si32(t4);
    }
}

/* R (1..4) rows from m0 times one panel of 8 columns of 4-bit weights: out[r * 8 + j] (float). R is a
 * constant in each call site, so the row loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile4(const int R, const int8_t *a, const float *scale,
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
        const uint8_t *wb = wp + b * Q4_BLOCK;
        _mm_prefetch((const char *)(wb + 4 * Q4_BLOCK), _MM_HINT_T0);
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
        const __m256 d = load_ph8(wb + 128);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[r], ones)),
                                   _mm256_mul_ps(d, _mm256_set1_ps(sr[r][b])), f[r]);
    }
    /* the m terms in a second pass, two chains per row (a second FMA per block on the chain above kept
     * the block loop latency-bound) */
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256 m0v = load_ph8(wp + b * Q4_BLOCK + 144);
        const __m256 m1v = load_ph8(wp + (b + 1) * Q4_BLOCK + 144);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            f[r] = _mm256_fmadd_ps(m0v, _mm256_set1_ps(ur[r][b]), f[r]);
            g[r] = _mm256_fmadd_ps(m1v, _mm256_set1_ps(ur[r][b + 1]), g[r]);
        }
    }
    if (b < nb) {
        const __m256 m0v = load_ph8(wp + b * Q4_BLOCK + 144);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) f[r] = _mm256_fmadd_ps(m0v, _mm256_set1_ps(ur[r][b]), f[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * PANEL, _mm256_add_ps(f[r], g[r]));
}

/* R (1..4) rows from m0 times one panel of 8 columns of int8 weights (Q8_0): w a = |w| (sign(w) a), so
 * vpmaddubsw takes |w| <= 128 as unsigned and its pair sums stay below 2 * 128 * 127 < 32768; each is
 * widened to int32 at once (two would overflow). */
static inline __attribute__((always_inline)) void tile8(const int R, const int8_t *a, const float *scale,
                                                        int64_t m0, int64_t K, const uint8_t *wp, __m256 bv,
                                                        float *out) {
    const int64_t nb = K / QK;
#if !HAVE_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    const int8_t *ar[4];
    const float *sr[4];
    __m256 f[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        ar[r] = a + (m0 + r) * K;
        sr[r] = scale + (m0 + r) * nb;
        f[r] = bv;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wp + b * Q8_BLOCK;
        _mm_prefetch((const char *)(wb + 4 * Q8_BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + 4 * Q8_BLOCK + 128), _MM_HINT_T0);
        __m256i s[4], t[4]; /* even and odd q: two chains per row */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) s[r] = t[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int q = 0; q < 8; q += 2) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + 32 * q));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + 32 * q + 32));
            const __m256i aw0 = _mm256_abs_epi8(w0), aw1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i x0 = _mm256_set1_epi32(*(const int32_t *)(ar[r] + b * QK + 4 * q));
                const __m256i x1 = _mm256_set1_epi32(*(const int32_t *)(ar[r] + b * QK + 4 * q + 4));
#if HAVE_VNNI
                s[r] = DPBUSD(s[r], aw0, _mm256_sign_epi8(x0, w0));
                t[r] = DPBUSD(t[r], aw1, _mm256_sign_epi8(x1, w1));
#else
                s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw0, _mm256_sign_epi8(x0, w0)), ones));
                t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw1, _mm256_sign_epi8(x1, w1)), ones));
#endif
            }
        }
        const __m256 d = load_ph8(wb + 256);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s[r], t[r])),
                                   _mm256_mul_ps(d, _mm256_set1_ps(sr[r][b])), f[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * PANEL, f[r]);
}

#if HAVE_AVX512
/* 32 bytes from each of two panels -> one zmm (the first panel's columns in the low half) */
static inline __m512i load2_si256(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}
/* 8 fp16 scales from each of two panels -> 16 floats */
static inline __m512 load2_ph8(const uint8_t *p0, const uint8_t *p1) {
    const __m128i h0 = _mm_loadu_si128((const __m128i *)p0), h1 = _mm_loadu_si128((const __m128i *)p1);
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1));
}

/* tile4 over two panels (wp0, wp1: 16 columns): out[r * 16 + j] */
static inline __attribute__((always_inline)) void tile4x16(const int R, const int8_t *a, const float *scale,
                                                           const float *sum, int64_t m0, int64_t K,
                                                           const uint8_t *wp0, const uint8_t *wp1, __m512 bv,
                                                           float *out) {
    const int64_t nb = K / QK;
    const __m512i low4 = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi16(1);
    const int8_t *ar[4];
    const float *sr[4], *ur[4];
    __m512 f[4], g[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        ar[r] = a + (m0 + r) * K;
        sr[r] = scale + (m0 + r) * nb;
        ur[r] = sum + (m0 + r) * nb;
        f[r] = bv;
        g[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb0 = wp0 + b * Q4_BLOCK, *wb1 = wp1 + b * Q4_BLOCK;
        _mm_prefetch((const char *)(wb0 + 4 * Q4_BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb1 + 4 * Q4_BLOCK), _MM_HINT_T0);
        __m512i s[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int q = 0; q < 4; q++) {
            const __m512i v = load2_si256(wb0 + 32 * q, wb1 + 32 * q);
            const __m512i lo = _mm512_and_si512(v, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            const int64_t k = b * QK + 4 * q;
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i alo = _mm512_set1_epi32(*(const int32_t *)(ar[r] + k));
                const __m512i ahi = _mm512_set1_epi32(*(const int32_t *)(ar[r] + k + 16));
                s[r] = _mm512_add_epi16(s[r], _mm512_maddubs_epi16(lo, alo));
                s[r] = _mm512_add_epi16(s[r], _mm512_maddubs_epi16(hi, ahi));
            }
        }
        const __m512 d = load2_ph8(wb0 + 128, wb1 + 128);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(s[r], ones)),
                                   _mm512_mul_ps(d, _mm512_set1_ps(sr[r][b])), f[r]);
    }
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m512 m0v = load2_ph8(wp0 + b * Q4_BLOCK + 144, wp1 + b * Q4_BLOCK + 144);
        const __m512 m1v = load2_ph8(wp0 + (b + 1) * Q4_BLOCK + 144, wp1 + (b + 1) * Q4_BLOCK + 144);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            f[r] = _mm512_fmadd_ps(m0v, _mm512_set1_ps(ur[r][b]), f[r]);
            g[r] = _mm512_fmadd_ps(m1v, _mm512_set1_ps(ur[r][b + 1]), g[r]);
        }
    }
    if (b < nb) {
        const __m512 m0v = load2_ph8(wp0 + b * Q4_BLOCK + 144, wp1 + b * Q4_BLOCK + 144);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) f[r] = _mm512_fmadd_ps(m0v, _mm512_set1_ps(ur[r][b]), f[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * 2 * PANEL, _mm512_add_ps(f[r], g[r]));
}

/* tile8 over two panels (16 columns): out[r * 16 + j] */
static inline __attribute__((always_inline)) void tile8x16(const int R, const int8_t *a, const float *scale,
                                                           int64_t m0, int64_t K, const uint8_t *wp0,
                                                           const uint8_t *wp1, __m512 bv, float *out) {
    const int64_t nb = K / QK;
#if !(HAVE_VNNI && defined(__AVX512VNNI__))
    const __m512i ones = _mm512_set1_epi16(1);
#endif
    const int8_t *ar[4];
    const float *sr[4];
    __m512 f[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        ar[r] = a + (m0 + r) * K;
        sr[r] = scale + (m0 + r) * nb;
        f[r] = bv;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb0 = wp0 + b * Q8_BLOCK, *wb1 = wp1 + b * Q8_BLOCK;
        _mm_prefetch((const char *)(wb0 + 4 * Q8_BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb0 + 4 * Q8_BLOCK + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb1 + 4 * Q8_BLOCK), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb1 + 4 * Q8_BLOCK + 128), _MM_HINT_T0);
        __m512i s[4], t[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) s[r] = t[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int q = 0; q < 8; q += 2) {
            const __m512i w0 = load2_si256(wb0 + 32 * q, wb1 + 32 * q);
            const __m512i w1 = load2_si256(wb0 + 32 * q + 32, wb1 + 32 * q + 32);
            const __m512i aw0 = _mm512_abs_epi8(w0), aw1 = _mm512_abs_epi8(w1);
            /* vpsignb has no zmm form: negate the activation bytes where w < 0 (w == 0 gives a
             * zero product through |w| whatever the sign) */
            const __mmask64 n0 = _mm512_movepi8_mask(w0), n1 = _mm512_movepi8_mask(w1);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i x0 = _mm512_set1_epi32(*(const int32_t *)(ar[r] + b * QK + 4 * q));
                const __m512i x1 = _mm512_set1_epi32(*(const int32_t *)(ar[r] + b * QK + 4 * q + 4));
                const __m512i sx0 = _mm512_mask_sub_epi8(x0, n0, _mm512_setzero_si512(), x0);
                const __m512i sx1 = _mm512_mask_sub_epi8(x1, n1, _mm512_setzero_si512(), x1);
#if HAVE_VNNI && defined(__AVX512VNNI__)
                s[r] = _mm512_dpbusd_epi32(s[r], aw0, sx0);
                t[r] = _mm512_dpbusd_epi32(t[r], aw1, sx1);
#else
                s[r] = _mm512_add_epi32(s[r], _mm512_madd_epi16(_mm512_maddubs_epi16(aw0, sx0), ones));
                t[r] = _mm512_add_epi32(t[r], _mm512_madd_epi16(_mm512_maddubs_epi16(aw1, sx1), ones));
#endif
            }
        }
        const __m512 d = load2_ph8(wb0 + 256, wb1 + 256);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[r], t[r])),
                                   _mm512_mul_ps(d, _mm512_set1_ps(sr[r][b])), f[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * 2 * PANEL, f[r]);
}
#endif

static inline void store_bf16x8(uint16_t *o, __m256 v) { /* round to nearest even, as f32_to_bf16 */
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    _mm_storeu_si128((__m128i *)o, _mm256_castsi256_si128(packed));
}

/* Rows m0 .. m0 + rows of a tile's results (out: `stride` floats a row) -> y's columns n0 .. n0 + nv. */
static void store_rows(const float *out, int stride, int rows, int64_t m0, int64_t n0, int64_t nv, void *y,
                       int64_t ldy, int y_bf16) {
    for (int r = 0; r < rows; r++) {
        const float *t = out + r * stride;
        if (y_bf16) {
            uint16_t *o = (uint16_t *)y + (m0 + r) * ldy + n0;
            int64_t j = 0;
            for (; j + PANEL <= nv; j += PANEL) store_bf16x8(o + j, _mm256_loadu_ps(t + j));
            for (; j < nv; j++) o[j] = f32_to_bf16(t[j]);
        } else {
            memcpy((float *)y + (m0 + r) * ldy + n0, t, nv * sizeof(float));
        }
    }
}

/* the bias of columns n0 .. n0 + nv (zero past them and without a bias) */
static void bias_of(const float *bias, int64_t n0, int64_t nv, float *t) {
    for (int64_t j = 0; j < nv; j++) t[j] = bias ? bias[n0 + j] : 0.f;
}

#define TILE(R)                                                                                                \
    (int8 ? tile8(R, a, scale, m0, K, wp, bv, out) : tile4(R, a, scale, sum, m0, K, wp, bv, out))

/* Output columns [8 p, 8 p + 8) of y for all M rows; int8: Q8_BLOCK blocks, else Q4_BLOCK. */
static void panel(int64_t p, const int8_t *a, const float *scale, const float *sum, int64_t M, int64_t K,
                  const uint8_t *w, int int8, int64_t N, const float *bias, void *y, int64_t ldy, int y_bf16) {
    const int64_t nb = K / QK, panel_bytes = nb * (int8 ? Q8_BLOCK : Q4_BLOCK);
    const uint8_t *wp = w + p * panel_bytes;
    const int64_t n0 = p * PANEL, nv = N - n0 < PANEL ? N - n0 : PANEL;
    float t[PANEL] = {0};
    bias_of(bias, n0, nv, t);
    const __m256 bv = _mm256_loadu_ps(t);
    /* the next panel's weights (the model's weights stream from DRAM: 20% of a 16-row GEMM's time went
     * to waiting for them with only the in-panel prefetch below). Not below 8 rows where a panel is over
     * 6 KiB (K over ~1,200 at 4 bits): there the burst of prefetches slowed one row's streaming of the
     * panels, 1.4-1.6x at K 2,048-4,096 (benchmarks/cpu_kernels.py --gemv, RESULTS.md session 47) */
    const char *next = (const char *)(wp + panel_bytes);
    if ((M >= 8 || panel_bytes <= 6144) && p + 1 < (N + PANEL - 1) / PANEL)
        for (int64_t o = 0; o < panel_bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
    float out[4 * PANEL];
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int rows = M - m0 < 4 ? (int)(M - m0) : 4;
        switch (rows) {
        case 4: TILE(4); break;
        case 3: TILE(3); break;
        case 2: TILE(2); break;
        default: TILE(1); break;
        }
        store_rows(out, PANEL, rows, m0, n0, nv, y, ldy, y_bf16);
    }
}

#if HAVE_AVX512
#define TILE16(R)                                                                                              \
    (int8 ? tile8x16(R, a, scale, m0, K, wp, wp + panel_bytes, bv, out)                                       \
          : tile4x16(R, a, scale, sum, m0, K, wp, wp + panel_bytes, bv, out))

/* Output columns [8 p, 8 p + 16) of y (panels p and p + 1) for all M rows. */
static void panel16(int64_t p, const int8_t *a, const float *scale, const float *sum, int64_t M, int64_t K,
                    const uint8_t *w, int int8, int64_t N, const float *bias, void *y, int64_t ldy,
                    int y_bf16) {
    const int64_t nb = K / QK, panel_bytes = nb * (int8 ? Q8_BLOCK : Q4_BLOCK);
    const uint8_t *wp = w + p * panel_bytes;
    const int64_t n0 = p * PANEL, nv = N - n0 < 2 * PANEL ? N - n0 : 2 * PANEL;
    float t[2 * PANEL] = {0};
    bias_of(bias, n0, nv, t);
    const __m512 bv = _mm512_loadu_ps(t);
    const char *next = (const char *)(wp + 2 * panel_bytes); /* the next two panels */
    const int64_t ahead = ((N + PANEL - 1) / PANEL - (p + 2)) * panel_bytes;
    for (int64_t o = 0; o < (ahead < 2 * panel_bytes ? ahead : 2 * panel_bytes); o += 64)
        _mm_prefetch(next + o, _MM_HINT_T1);
    float out[4 * 2 * PANEL];
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int rows = M - m0 < 4 ? (int)(M - m0) : 4;
        switch (rows) {
        case 4: TILE16(4); break;
        case 3: TILE16(3); break;
        case 2: TILE16(2); break;
        default: TILE16(1); break;
        }
        store_rows(out, 2 * PANEL, rows, m0, n0, nv, y, ldy, y_bf16);
    }
}
#endif

/* y[M, N] (rows ldy apart, f32 or bf16 as x) = dequant(W) q8(x)^T (+ bias[N], f32), K % 32 == 0, W
 * packed as 4-bit (int8 = 0) or int8 weights, with scratch a [M, K], scale and sum [M, K / 32]. One
 * parallel region: rows are quantized, then (after the barrier) each thread computes its share of the
 * column panels. */
void foveal_qlinear(const void *x, int64_t ldx, int is_bf16, int64_t M, int64_t K, int8_t *a, float *scale,
                    float *sum, const uint8_t *w, int int8, int64_t N, const float *bias, void *y, int64_t ldy,
                    int nthreads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, nb = K / QK;
    /* zmm tiles from 8 rows on: below that a model's linears are bound by reading the weights (106 MiB,
     * more than the L3), and the ymm tiles' one stream of panels read them faster (in the model, a Zen 5
     * EPYC, benchmarks/decode_breakdown.py: all linears of a step 3.34-3.53 ms ymm against 3.65-3.70 zmm
     * at 1 row, 5.24 vs 5.92 at 4, even at 8, 12.27 vs 9.69 at 16, and 1.6x at 128 in cpu_kernels.py) */
    const int wide = HAVE_AVX512 && M >= 8;
    const int64_t units = wide ? (panels + 1) / 2 : panels; /* what the threads share */
    const int64_t chunk = units / (8 * (int64_t)nthreads) > 2 ? units / (8 * (int64_t)nthreads) : 2;
    const size_t esize = is_bf16 ? 2 : 4;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row((const char *)x + m * ldx * esize, is_bf16, K, a + m * K, scale + m * nb, sum + m * nb);
        /* dynamic: a thread the OS preempts (the HTTP server, a client on the same cores) leaves its
         * remaining panels to the others instead of stalling the whole call at the barrier */
        if (wide) { /* units of two panels (the last one alone where their number is odd) */
#pragma omp for schedule(dynamic, chunk)
            for (int64_t u = 0; u < (panels + 1) / 2; u++) {
#if HAVE_AVX512
                if (2 * u + 1 < panels) {
                    panel16(2 * u, a, scale, sum, M, K, w, int8, N, bias, y, ldy, is_bf16);
                    continue;
                }
#endif
                panel(2 * u, a, scale, sum, M, K, w, int8, N, bias, y, ldy, is_bf16);
            }
        } else {
#pragma omp for schedule(dynamic, chunk)
            for (int64_t p = 0; p < panels; p++) panel(p, a, scale, sum, M, K, w, int8, N, bias, y, ldy, is_bf16);
        }
    }
}

/* SiLU of one float (exp_nonpositive: native.h), as x / (1 + e^-x) */
static inline float silu1(float g) {
    const float e = exp_nonpositive(-fabsf(g));
    return g >= 0.f ? g / (1.f + e) : g * e / (1.f + e);
}

/* The weight units (one panel, or two with the zmm tiles) of expert e's run of n rows: the same choice
 * as foveal_qlinear's for an n-row call */
static inline int64_t expert_units(int64_t n, int64_t panels) {
    if (n == 0) return 0;
    return HAVE_AVX512 && n >= 8 ? (panels + 1) / 2 : panels;
}

/* Units [ustart[e], ustart[e + 1]) of one weight over the experts' row runs: rows start[e] .. start[e+1]
 * of a (int8 activations, K wide) times expert e's packed weight -> out rows (float, N wide). */
static void expert_unit(int64_t u, const int64_t *ustart, const int64_t *start, int64_t E, const int8_t *a,
                        const float *scale, const float *sum, int64_t K, const uint64_t *w, const int32_t *int8,
                        int64_t N, float *out) {
    int64_t lo = 0, hi = E; /* the expert whose units hold u: ustart[e] <= u < ustart[e + 1] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (ustart[mid] <= u) lo = mid; else hi = mid;
    }
    const int64_t e = lo, n = start[e + 1] - start[e], panels = (N + PANEL - 1) / PANEL, nb = K / QK;
    const int64_t v = u - ustart[e], r0 = start[e];
    const uint8_t *we = (const uint8_t *)(uintptr_t)w[e];
    const int8_t *ae = a + r0 * K;
    const float *se = scale + r0 * nb, *ue = sum + r0 * nb;
    float *oe = out + r0 * N;
#if HAVE_AVX512
    if (n >= 8) {
        if (2 * v + 1 < panels) panel16(2 * v, ae, se, ue, n, K, we, int8[e], N, NULL, oe, N, 0);
        else panel(2 * v, ae, se, ue, n, K, we, int8[e], N, NULL, oe, N, 0);
        return;
    }
#endif
    panel(v, ae, se, ue, n, K, we, int8[e], N, NULL, oe, N, 0);
}

/* A mixture of experts' layer on packed weights (SiLU-gated experts, no biases): y[T, H] (x's type) =
 * sum over token t's k pairs j, in their order, of wts[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e =
 * ids[t, j]; w13[e] / w2[e]: expert e's packed gate/up [2I, H] (gate rows, then up rows) and down [H, I]
 * (data pointers), int8_13 / int8_2 their formats. Every GEMM is foveal_qlinear's arithmetic on the
 * expert's run of rows (each row's result does not depend on the others), so a token's output is the
 * same bits alone and in any batch. One parallel region: the pairs' activations quantized, gate/up over
 * every expert's panels, SiLU x up quantized, down, then each token's sum. Scratch: a [T k, max(H, I)]
 * int8, scale and sum [T k, max(H, I) / 32], order and where [T k], start [E + 1], ustart [E + 1], h [T k,
 * 2 I] and d [T k, H] floats. */
void foveal_qmoe(const void *x, int is_bf16, int64_t T, int64_t H, int64_t I, int64_t k, const int64_t *ids,
                 const float *wts, int64_t E, const uint64_t *w13, const int32_t *int8_13, const uint64_t *w2,
                 const int32_t *int8_2, int8_t *a, float *scale, float *sum, int64_t *order, int64_t *where,
                 int64_t *start, int64_t *ustart, float *h, float *d, void *y, int nthreads) {
    const int64_t pairs = T * k;
    const size_t esize = is_bf16 ? 2 : 4;
    /* the pairs sorted by expert, in their order within each (a counting sort) */
    for (int64_t e = 0; e <= E; e++) start[e] = 0;
    for (int64_t p = 0; p < pairs; p++) start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t at = start[ids[p]]++;
        order[at] = p;
        where[p] = at;
    }
    for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    const int64_t p13 = (2 * I + PANEL - 1) / PANEL, p2 = (H + PANEL - 1) / PANEL;
    ustart[0] = 0;
    for (int64_t e = 0; e < E; e++) ustart[e + 1] = ustart[e] + expert_units(start[e + 1] - start[e], p13);
    const int64_t units13 = ustart[E];
    /* runs of units a thread takes at a time, as foveal_qlinear's: long enough that each thread streams
     * its weights (chunks of 2 panels, the threads taking turns, read 13 GB/s where a call per expert read
     * 17) */
    const int64_t chunk13 = units13 / (8 * (int64_t)nthreads) > 2 ? units13 / (8 * (int64_t)nthreads) : 2;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < pairs; r++) /* each pair its token's row (rows H apart, as panel() reads) */
            quantize_row((const char *)x + (order[r] / k) * H * esize, is_bf16, H, a + r * H, scale + r * (H / QK),
                         sum + r * (H / QK));
#pragma omp for schedule(dynamic, chunk13)
        for (int64_t u = 0; u < units13; u++)
            expert_unit(u, ustart, start, E, a, scale, sum, H, w13, int8_13, 2 * I, h);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < pairs; r++) { /* a's rows now I apart: gate/up no longer reads them */
            float *g = h + r * 2 * I; /* silu(gate) * up in place of gate, then quantized */
            for (int64_t i = 0; i < I; i++) g[i] = silu1(g[i]) * g[I + i];
            quantize_row(g, 0, I, a + r * I, scale + r * (I / QK), sum + r * (I / QK));
        }
#pragma omp single
        {
            ustart[0] = 0;
            for (int64_t e = 0; e < E; e++) ustart[e + 1] = ustart[e] + expert_units(start[e + 1] - start[e], p2);
        }
        const int64_t chunk2 = ustart[E] / (8 * (int64_t)nthreads) > 2 ? ustart[E] / (8 * (int64_t)nthreads) : 2;
#pragma omp for schedule(dynamic, chunk2)
        for (int64_t u = 0; u < ustart[E]; u++)
            expert_unit(u, ustart, start, E, a, scale, sum, I, w2, int8_2, H, d);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float acc[16];
            for (int64_t c0 = 0; c0 < H; c0 += 16) {
                const int64_t n = H - c0 < 16 ? H - c0 : 16;
                for (int64_t c = 0; c < n; c++) acc[c] = 0.f;
                for (int64_t j = 0; j < k; j++) {
                    const float w = wts[t * k + j], *dr = d + where[t * k + j] * H + c0;
                    for (int64_t c = 0; c < n; c++) acc[c] += w * dr[c];
                }
                if (is_bf16)
                    for (int64_t c = 0; c < n; c++) ((uint16_t *)y)[t * H + c0 + c] = f32_to_bf16(acc[c]);
                else
                    memcpy((float *)y + t * H + c0, acc, n * sizeof(float));
            }
        }
    }
}
