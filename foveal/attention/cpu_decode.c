/* Paged decode attention for CPUs: one query token per sequence, keys and values read in place from
 * the paged pool (no gather), fp32 accumulation, online softmax over chunks of keys. Compiled at first
 * use by foveal/attention/cpu_native.py (gcc/cc -O3 -march=native); the torch backend is the oracle
 * and the fallback.
 *
 * One task = one sequence (all its kv heads, so each key block is read front to back), or a range of
 * its kv heads when there are too few sequences to keep every thread busy. The G = H / KVH query heads
 * of a kv head share each key and value row, which is loaded and converted once per task. Tasks are
 * spread over OpenMP threads (the runtime PyTorch already loaded: same libgomp.so.1, same thread pool).
 *
 *   q      [nd, H, D]           rows q_tok apart, heads D apart
 *   k, v   [slots, KVH, D]      slot = table[pos / bs] * bs + pos % bs; rows `slot_stride` apart
 *   tables [nd, table_stride]   int64 block ids
 *   starts [nd]                 first visible position (sliding windows; 0 otherwise)
 *   lens   [nd]                 keys of each sequence (its context + this token)
 *   out    [nd, H, D]           contiguous
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }
static inline float f16_load(_Float16 x) { return (float)x; }
static inline _Float16 f16_store(float x) { return (_Float16)x; }

static inline float dot(const float *restrict a, const float *restrict b, int D) {
    float s = 0.0f;
    for (int d = 0; d < D; d++) s += a[d] * b[d]; /* vectorized: built with -fassociative-math */
    return s;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int D) {
    for (int d = 0; d < D; d++) y[d] += a * x[d];
}

static inline void scale_row(float *restrict y, float a, int D) {
    for (int d = 0; d < D; d++) y[d] *= a;
}

/* Register-blocked forms of the two products (GCC/Clang vector extensions; plain loops where D does
 * not fit them): four keys' dot products at once (four independent accumulator chains instead of one
 * long one per key), and P V with a 64-wide slice of the output accumulated in registers across keys
 * (axpy stores and reloads it for every key). */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f ld8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* out[i] = q . k[i * ks], i < 4; D % 8 == 0 */
static inline void dot4(const float *restrict q, const float *restrict k, int64_t ks, int D,
                        float *restrict out) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int d = 0; d < D; d += 8) {
        const v8f qv = ld8(q + d);
        a0 += qv * ld8(k + d);
        a1 += qv * ld8(k + ks + d);
        a2 += qv * ld8(k + 2 * ks + d);
        a3 += qv * ld8(k + 3 * ks + d);
    }
    out[0] = hsum8(a0), out[1] = hsum8(a1), out[2] = hsum8(a2), out[3] = hsum8(a3);
}

/* acc[0:64] += sum_j p[j] v[j * vs : j * vs + 64] */
static inline void pv64(float *restrict acc, const float *restrict p, const float *restrict v, int64_t vs,
                        int n) {
    v8f a[8];
    for (int i = 0; i < 8; i++) a[i] = ld8(acc + 8 * i);
    for (int j = 0; j < n; j++) {
        const float *vr = v + j * vs;
        for (int i = 0; i < 8; i++) a[i] += p[j] * ld8(vr + 8 * i);
    }
    memcpy(acc, a, sizeof(a));
}

#define DEFINE_LOAD_ROW(NAME, T, LOAD)                                                                \
    static inline void NAME(float *restrict dst, const T *restrict src, int D) {                     \
        for (int d = 0; d < D; d++) dst[d] = LOAD(src[d]);                                            \
    }
DEFINE_LOAD_ROW(row_f32, float, f32_load)
DEFINE_LOAD_ROW(row_bf16, uint16_t, bf16_to_f32)
DEFINE_LOAD_ROW(row_f16, _Float16, f16_load)

/* Asks for the rows of positions [p0, p1) of one pool ahead of their use: the blocks of a sequence sit
 * anywhere in the pool, so the hardware prefetcher cannot guess the next one. */
static inline void prefetch_rows(const char *base, const int64_t *table, int64_t p0, int64_t p1, int bs,
                                 int64_t slot_bytes, int64_t head_off, int64_t row_bytes) {
    for (int64_t pos = p0; pos < p1; pos++) {
        const char *row = base + (table[pos / bs] * bs + pos % bs) * slot_bytes + head_off;
        for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(row + o);
    }
}

/* Positions per chunk: the chunk's rows (all heads of the task, fp32) stay within ~64 KB (L2). */
static inline int chunk_for(int heads, int D) {
    int c = 16384 / (heads * D);
    return c < 8 ? 8 : (c > 64 ? 64 : c);
}

#define DEFINE_DECODE(NAME, T, LOAD_ROW, STORE)                                                         \
    void NAME(const T *q, int64_t q_tok, const T *k, const T *v, int64_t slot_stride,                \
              const int64_t *tables, int64_t table_stride, const int64_t *starts, const int64_t *lens, \
              T *out, int nd, int H, int KVH, int D, int bs, float scale, float softcap,             \
              const float *sinks, int nthreads) {                                                     \
        const int G = H / KVH;                                                                        \
        /* a task = one sequence and a range of its kv heads: whole sequences when there are enough \
           of them (every key block is then read front to back), else split by heads */              \
        int parts = 1;                                                                                \
        while (parts < KVH && nd * parts < 4 * nthreads) parts++;                                     \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                       \
        for (int task = 0; task < nd * parts; task++) {                                               \
            const int b = task / parts, part = task % parts;                                          \
            const int h0 = part * KVH / parts, h1 = (part + 1) * KVH / parts, nh = h1 - h0;           \
            const int CH = chunk_for(nh, D);                                                          \
            float qf[nh * G * D], acc[nh * G * D], m[nh * G], l[nh * G], s[nh * G * CH];              \
            float rows[CH * nh * D];                                                                  \
            for (int r = 0; r < nh * G; r++) {                                                        \
                LOAD_ROW(qf + r * D, q + b * q_tok + (int64_t)(h0 * G + r) * D, D);                   \
                scale_row(qf + r * D, scale, D);                                                      \
                /* an attention sink: one more logit of value zero, so it starts the running sum */   \
                m[r] = sinks ? sinks[h0 * G + r] : -INFINITY;                                         \
                l[r] = sinks ? 1.0f : 0.0f;                                                           \
            }                                                                                         \
            memset(acc, 0, sizeof(acc));                                                              \
            const int64_t *table = tables + b * table_stride;                                         \
            const int64_t end = lens[b];                                                              \
            for (int64_t p0 = starts[b]; p0 < end; p0 += CH) {                                        \
                const int n = (int)(end - p0 < CH ? end - p0 : CH);                                   \
                for (int j = 0; j < n; j++) {                                                         \
                    const int64_t pos = p0 + j, slot = table[pos / bs] * bs + pos % bs;               \
                    LOAD_ROW(rows + j * nh * D, k + slot * slot_stride + (int64_t)h0 * D, nh * D);    \
                }                                                                                     \
                prefetch_rows((const char *)v, table, p0, p0 + n, bs, slot_stride * sizeof(T),        \
                              h0 * D * sizeof(T), nh * D * sizeof(T));                                \
                for (int r = 0; r < nh * G; r++) {                                                    \
                    const float *kh = rows + (r / G) * D;                                             \
                    float *sr = s + r * CH, mx = m[r];                                                \
                    int j = 0;                                                                        \
                    if (D % 8 == 0)                                                                   \
                        for (; j + 4 <= n; j += 4) dot4(qf + r * D, kh + j * nh * D, nh * D, D, sr + j); \
                    for (; j < n; j++) sr[j] = dot(qf + r * D, kh + j * nh * D, D);                   \
                    for (j = 0; j < n; j++) {                                                         \
                        float x = sr[j];                                                              \
                        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);                         \
                        sr[j] = x;                                                                    \
                        mx = x > mx ? x : mx;                                                         \
                    }                                                                                 \
                    const float corr = expf(m[r] - mx);                                               \
                    m[r] = mx;                                                                        \
                    l[r] *= corr;                                                                     \
                    scale_row(acc + r * D, corr, D);                                                  \
                    for (int j = 0; j < n; j++) {                                                     \
                        sr[j] = exp_nonpositive(sr[j] - mx);                                          \
                        l[r] += sr[j];                                                                \
                    }                                                                                 \
                }                                                                                     \
                for (int j = 0; j < n; j++) {                                                         \
                    const int64_t pos = p0 + j, slot = table[pos / bs] * bs + pos % bs;               \
                    LOAD_ROW(rows + j * nh * D, v + slot * slot_stride + (int64_t)h0 * D, nh * D);    \
                }                                                                                     \
                prefetch_rows((const char *)k, table, p0 + n, p0 + n + CH < end ? p0 + n + CH : end, bs, \
                              slot_stride * sizeof(T), h0 * D * sizeof(T), nh * D * sizeof(T));       \
                for (int r = 0; r < nh * G; r++) {                                                    \
                    const float *vh = rows + (r / G) * D;                                             \
                    if (D % 64 == 0)                                                                  \
                        for (int d0 = 0; d0 < D; d0 += 64)                                            \
                            pv64(acc + r * D + d0, s + r * CH, vh + d0, nh * D, n);                   \
                    else                                                                              \
                        for (int j = 0; j < n; j++) axpy(acc + r * D, s[r * CH + j], vh + j * nh * D, D); \
                }                                                                                     \
            }                                                                                         \
            for (int r = 0; r < nh * G; r++) {                                                        \
                T *o = out + ((int64_t)b * H + h0 * G + r) * D;                                       \
                const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;                                   \
                for (int d = 0; d < D; d++) o[d] = STORE(acc[r * D + d] * inv);                       \
            }                                                                                         \
        }                                                                                             \
    }

DEFINE_DECODE(foveal_decode_f32, float, row_f32, f32_store)
DEFINE_DECODE(foveal_decode_bf16, uint16_t, row_bf16, f32_to_bf16)
DEFINE_DECODE(foveal_decode_f16, _Float16, row_f16, f16_store)

/* This step's K and V rows (T tokens, row_bytes each: all kv heads of a token) into pool rows slots[t]
 * of k_pool / v_pool; a slot outside [0, num_slots) is skipped (the scheduler never sends one). No
 * threads: a decode step writes one row per sequence per layer. */
void foveal_kv_store(char *k_pool, char *v_pool, int64_t row_bytes, const char *k, const char *v,
                     int64_t k_stride, int64_t v_stride, const int64_t *slots, int64_t T, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0 || s >= num_slots) continue;
        memcpy(k_pool + s * row_bytes, k + t * k_stride, (size_t)row_bytes);
        memcpy(v_pool + s * row_bytes, v + t * v_stride, (size_t)row_bytes);
    }
}
