/* Elementwise glue of a decoder layer on CPUs, one call per op instead of 4-10 PyTorch ops (Foveal;
 * built by foveal/native.py, wrapped by foveal/layers/cpu_fused.py). Each function rounds where the
 * PyTorch reference path rounds (layers/norm.py, rotary.py, models/llama.py's MLP), so results match it
 * up to float summation order. T is float (f32) or uint16_t (bf16); rows are `ld*` elements apart. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

static inline float ld_f32(float x) { return x; }
static inline float st_f32(float x) { return x; }
static inline float rnd_f32(float x) { return x; }
static inline float rnd_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* 8-wide forms for the rotary (GCC did not vectorize its scalar loop: ~8 ns per element in bf16) */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline v8f as_f(v8u u) {
    v8f f;
    memcpy(&f, &u, 32);
    return f;
}

static inline v8u as_u(v8f f) {
    v8u u;
    memcpy(&u, &f, 32);
    return u;
}

static inline v8f ld8_f32(const float *p) {
    v8f v;
    memcpy(&v, p, 32);
    return v;
}

static inline void st8_f32(float *p, v8f v) { memcpy(p, &v, 32); }
static inline v8f rnd8_f32(v8f v) { return v; }

static inline v8f ld8_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, 16);
    return as_f(__builtin_convertvector(h, v8u) << 16);
}

static inline v8u bf16_bits8(v8f f) { /* f32_to_bf16, 8 at a time (in the low 16 bits) */
    const v8u u = as_u(f);
    const v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    const v8u nan = (v8u)((u & 0x7fffffffu) > 0x7f800000u);
    return (quiet & nan) | (rounded & ~nan);
}

static inline void st8_bf16(uint16_t *p, v8f v) {
    const v8h h = __builtin_convertvector(bf16_bits8(v), v8h);
    memcpy(p, &h, 16);
}

static inline v8f rnd8_bf16(v8f v) { return as_f(bf16_bits8(v) << 16); }

#define DEFINE_OPS(SUF, T, LD, ST, RND, LD8, ST8, RND8)                                                                \
    /* res_out = x + res (rounded), out = w * norm(res_out) (RMSNorm in fp32, cast, then w); without  \
       res: out = w * norm(x) */                                                                       \
    void foveal_rms_norm_##SUF(const T *x, int64_t ldx, const T *res, int64_t ldr, T *res_out,        \
                               const T *w, T *out, int64_t rows, int64_t n, float eps, int nthreads) { \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)")             \
        for (int64_t r = 0; r < rows; r++) {                                                          \
            const T *xr = x + r * ldx;                                                                \
            T *orow = out + r * n;                                                                    \
            float buf[n];                                                                             \
            float ss = 0.0f;                                                                          \
            if (res) {                                                                                \
                const T *rr = res + r * ldr;                                                          \
                T *ro = res_out + r * n;                                                              \
                for (int64_t i = 0; i < n; i++) {                                                     \
                    const float v = RND(LD(xr[i]) + LD(rr[i]));                                       \
                    ro[i] = ST(v);                                                                    \
                    buf[i] = v;                                                                       \
                }                                                                                     \
            } else {                                                                                  \
                for (int64_t i = 0; i < n; i++) buf[i] = LD(xr[i]);                                  \
            }                                                                                         \
            float part[8] = {0};                                                                      \
            int64_t i8 = 0;                                                                           \
            for (; i8 + 8 <= n; i8 += 8)                                                              \
                for (int j = 0; j < 8; j++) part[j] += buf[i8 + j] * buf[i8 + j];                     \
            for (; i8 < n; i8++) part[0] += buf[i8] * buf[i8];                                        \
            for (int j = 0; j < 8; j++) ss += part[j];                                                \
            const float inv = 1.0f / sqrtf(ss / (float)n + eps);                                      \
            for (int64_t i = 0; i < n; i++) orow[i] = ST(LD(w[i]) * RND(buf[i] * inv));              \
        }                                                                                             \
    }                                                                                                 \
                                                                                                      \
    /* rotate-half rotary on heads of D: out[t, h] = x*cos + rot(x)*sin, each product rounded as the \
       reference's separate ops; x rows ldx apart (a view into the qkv buffer), cos/sin [T, D] */    \
    void foveal_rotary_##SUF(const T *x, int64_t ldx, const T *cos, const T *sin, T *out, int64_t rows, \
                             int64_t heads, int64_t D, int nthreads) {                                \
        const int64_t half = D / 2;                                                                   \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)")             \
        for (int64_t t = 0; t < rows; t++) {                                                          \
            const T *c = cos + t * D, *s = sin + t * D;                                               \
            for (int64_t h = 0; h < heads; h++) {                                                     \
                const T *xh = x + t * ldx + h * D;                                                    \
                T *o = out + (t * heads + h) * D;                                                     \
                int64_t i = 0;                                                                        \
                for (; i + 8 <= half; i += 8) {                                                       \
                    const v8f x1 = LD8(xh + i), x2 = LD8(xh + i + half);                              \
                    ST8(o + i, RND8(x1 * LD8(c + i)) + RND8(-x2 * LD8(s + i)));                       \
                    ST8(o + i + half, RND8(x2 * LD8(c + i + half)) + RND8(x1 * LD8(s + i + half)));   \
                }                                                                                     \
                for (; i < half; i++) {                                                               \
                    const float x1 = LD(xh[i]), x2 = LD(xh[i + half]);                                \
                    o[i] = ST(RND(x1 * LD(c[i])) + RND(-x2 * LD(s[i])));                              \
                    o[i + half] = ST(RND(x2 * LD(c[i + half])) + RND(x1 * LD(s[i + half])));          \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
                                                                                                      \
    /* out[t, i] = silu(x[t, i]) * x[t, n + i], silu rounded before the product (as F.silu(g) * u) */ \
    void foveal_silu_mul_##SUF(const T *x, int64_t ldx, T *out, int64_t rows, int64_t n, int nthreads) { \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)")             \
        for (int64_t t = 0; t < rows; t++) {                                                          \
            const T *g = x + t * ldx, *u = g + n;                                                     \
            T *o = out + t * n;                                                                       \
            for (int64_t i = 0; i < n; i++) {                                                         \
                const float v = LD(g[i]);                                                             \
                const float e = exp_nonpositive(-fabsf(v));                                           \
                const float sig = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);                     \
                o[i] = ST(RND(v * sig) * LD(u[i]));                                                   \
            }                                                                                         \
        }                                                                                             \
    }

DEFINE_OPS(f32, float, ld_f32, st_f32, rnd_f32, ld8_f32, st8_f32, rnd8_f32)
DEFINE_OPS(bf16, uint16_t, bf16_to_f32, f32_to_bf16, rnd_bf16, ld8_bf16, st8_bf16, rnd8_bf16)
