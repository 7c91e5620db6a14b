/* Paged attention for CPUs, one query token a row: decode rows and the rows of prompt chunks alike,
 * keys and values read in place from the paged pool (no gather), fp32 accumulation, online softmax
 * over chunks of keys on a grid of absolute positions. A row's result depends on its query, its keys
 * and their range only (not on the step's other rows), so a prompt computed whole, in chunks or after
 * a prefix hit gives every token the same output. Compiled at first use by
 * foveal/attention/cpu_native.py (gcc/cc -O3 -march=native); the torch backend is the oracle and the
 * fallback.
 *
 * A tile = up to RT consecutive rows of one sequence (a prompt chunk's rows load each key chunk once
 * for all of them; a decode row is a tile of its own). One task = one tile (all its kv heads, so each
 * key block is read front to back), or a range of its kv heads when there are too few tiles to keep
 * every thread busy. The G = H / KVH query heads of a kv head share each key and value row, which is
 * loaded and converted once per task. Tasks are spread over OpenMP threads (the runtime PyTorch
 * already loaded: same libgomp.so.1, same thread pool).
 *
 *   q       [nr, H, D]           rows q_tok apart, heads D apart
 *   k, v    [slots, KVH, D]      slot = table[pos / bs] * bs + pos % bs; rows `slot_stride` apart
 *   tables  [seqs, table_stride] int64 block ids; row r reads tables[row_seq[r]] (row_seq NULL: r)
 *   starts  [nr]                 first visible position (sliding windows; 0 otherwise)
 *   lens    [nr]                 the row sees keys [start, len): its position + 1
 *   out     [nr, H, D]           contiguous
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
 * long one per key), and P V with 32-wide slices of up to four heads' outputs accumulated in registers
 * across keys (axpy stores and reloads them for every key). */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f ld8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

typedef int32_t v8i __attribute__((vector_size(32)));

/* max(m, x[0:n]), NaN entries passed over as `y > m ? y : m` does; eight lanes at a time (a maximum is
 * exact in any order, so the result is the sequential loop's) */
static inline float max_run(const float *restrict x, int n, float m) {
    int j = 0;
    if (n >= 8) {
        v8f mv = {m, m, m, m, m, m, m, m};
        for (; j + 8 <= n; j += 8) {
            const v8f y = ld8(x + j);
            const v8i gt = y > mv;
            mv = (v8f)(((v8i)y & gt) | ((v8i)mv & ~gt));
        }
        for (int l = 0; l < 8; l++) m = mv[l] > m ? mv[l] : m;
    }
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
#if defined(__clang__) || __GNUC__ >= 12
#define SHUF(x, y, a, b, c, d) __builtin_shufflevector(x, y, a, b, c, d)
#else
#define SHUF(x, y, a, b, c, d) __builtin_shuffle(x, y, (v4i){a, b, c, d})
#endif

static inline v4f lo4(v8f v) {
    v4f r;
    memcpy(&r, &v, sizeof(r));
    return r;
}

static inline v4f hi4(v8f v) {
    v4f r;
    memcpy(&r, (const char *)&v + sizeof(r), sizeof(r));
    return r;
}

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
    /* the four horizontal sums at once: halves, then pairs, then pairs of pairs */
    const v4f f0 = lo4(a0) + hi4(a0), f1 = lo4(a1) + hi4(a1), f2 = lo4(a2) + hi4(a2), f3 = lo4(a3) + hi4(a3);
    const v4f h01 = SHUF(f0, f1, 0, 2, 4, 6) + SHUF(f0, f1, 1, 3, 5, 7);
    const v4f h23 = SHUF(f2, f3, 0, 2, 4, 6) + SHUF(f2, f3, 1, 3, 5, 7);
    const v4f sums = SHUF(h01, h23, 0, 2, 4, 6) + SHUF(h01, h23, 1, 3, 5, 7);
    memcpy(out, &sums, sizeof(sums));
}

/* P V of `heads` (<= 4) query heads over the same value rows, a 32-wide slice of each output
 * (acc + h * D, p + h * CH for head h): each value row is loaded once for all of them, and every element
 * sums its keys in order, as axpy does */
static inline void pv32_heads(float *restrict acc, int D, const float *restrict p, int CH,
                              const float *restrict v, int64_t vs, int n, const int heads) {
    v8f a[4][4];
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < 4; i++) a[h][i] = ld8(acc + h * D + 8 * i);
    for (int j = 0; j < n; j++) {
        const float *vr = v + j * vs;
        const v8f x0 = ld8(vr), x1 = ld8(vr + 8), x2 = ld8(vr + 16), x3 = ld8(vr + 24);
        for (int h = 0; h < heads; h++) {
            const float ph = p[h * CH + j];
            a[h][0] += ph * x0, a[h][1] += ph * x1, a[h][2] += ph * x2, a[h][3] += ph * x3;
        }
    }
    for (int h = 0; h < heads; h++) memcpy(acc + h * D, a[h], sizeof(a[h]));
}

/* pv32_heads with the head count a constant, so its loops unroll into registers */
static inline void pv32_group(float *acc, int D, const float *p, int CH, const float *v, int64_t vs, int n,
                              int heads) {
    switch (heads) {
    case 1: pv32_heads(acc, D, p, CH, v, vs, n, 1); break;
    case 2: pv32_heads(acc, D, p, CH, v, vs, n, 2); break;
    case 3: pv32_heads(acc, D, p, CH, v, vs, n, 3); break;
    default: pv32_heads(acc, D, p, CH, v, vs, n, 4); break;
    }
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

/* Positions per chunk, on a grid of absolute positions (multiples of CH, set by D alone): a row's
 * arithmetic depends on its own query, keys and range only, never on the other rows of its step or
 * how its task was split. The chunk's K or V rows (fp32, all heads of the task) stay within ~128 KB. */
static inline int chunk_for(int D) {
    int c = 4096 / D;
    return c < 8 ? 8 : (c > 64 ? 64 : c);
}

#define DEFINE_ATTEND(NAME, T, LOAD_ROW, STORE)                                                         \
    void NAME(const T *q, int64_t q_tok, const T *k, const T *v, int64_t slot_stride,                \
              const int64_t *tables, int64_t table_stride, const int64_t *row_seq,                    \
              const int64_t *starts, const int64_t *lens, T *out, int nr, int H, int KVH, int D,      \
              int bs, float scale, float softcap, const float *sinks, int nthreads) {                 \
        const int G = H / KVH, CH = chunk_for(D);                                                     \
        int RT = 16384 / (H * D);                                                                     \
        RT = RT < 1 ? 1 : (RT > 8 ? 8 : RT);                                                          \
        /* tiles: runs of up to RT consecutive rows of one sequence (a prompt chunk's rows share each \
           key chunk they load; a decode row is a tile of its own) */                                 \
        int tile0[nr + 1], ntiles = 0;                                                                \
        for (int r = 0; r < nr;) {                                                                    \
            const int64_t sq = row_seq ? row_seq[r] : r;                                              \
            int e = r + 1;                                                                            \
            while (e < nr && e - r < RT && row_seq && row_seq[e] == sq) e++;                          \
            tile0[ntiles++] = r;                                                                      \
            r = e;                                                                                    \
        }                                                                                             \
        tile0[ntiles] = nr;                                                                           \
        /* a task = one tile and a range of its kv heads: all heads when there are enough tiles      \
           (every key block is then read front to back), else split by heads */                      \
        int parts = 1;                                                                                \
        while (parts < KVH && ntiles * parts < 4 * nthreads) parts++;                                 \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                       \
        for (int task = 0; task < ntiles * parts; task++) {                                           \
            const int t = task / parts, part = task % parts, r0 = tile0[t], R = tile0[t + 1] - r0;    \
            const int h0 = part * KVH / parts, h1 = (part + 1) * KVH / parts, nh = h1 - h0;           \
            const int NQ = nh * G;                                                                    \
            float qf[R * NQ * D], acc[R * NQ * D], m[R * NQ], l[R * NQ], s[R * NQ * CH];              \
            float rows[CH * nh * D];                                                                  \
            int64_t lo = INT64_MAX, hi = 0; /* the keys some row of the tile sees */                  \
            for (int i = 0; i < R; i++) {                                                             \
                if (starts[r0 + i] < lens[r0 + i]) {                                                  \
                    lo = starts[r0 + i] < lo ? starts[r0 + i] : lo;                                   \
                    hi = lens[r0 + i] > hi ? lens[r0 + i] : hi;                                       \
                }                                                                                     \
                for (int g = 0; g < NQ; g++) {                                                        \
                    const int x = i * NQ + g;                                                         \
                    LOAD_ROW(qf + x * D, q + (int64_t)(r0 + i) * q_tok + (int64_t)(h0 * G + g) * D, D); \
                    scale_row(qf + x * D, scale, D);                                                  \
                    /* an attention sink: one more logit of value zero, so it starts the running sum */ \
                    m[x] = sinks ? sinks[h0 * G + g] : -INFINITY;                                     \
                    l[x] = sinks ? 1.0f : 0.0f;                                                       \
                }                                                                                     \
            }                                                                                         \
            memset(acc, 0, sizeof(acc));                                                              \
            const int64_t *table = tables + (row_seq ? row_seq[r0] : r0) * table_stride;              \
            for (int64_t c0 = lo < hi ? lo / CH * CH : hi; c0 < hi; c0 += CH) {                       \
                const int64_t a = c0 > lo ? c0 : lo, b = c0 + CH < hi ? c0 + CH : hi;                  \
                for (int64_t pos = a; pos < b; pos++) {                                               \
                    const int64_t slot = table[pos / bs] * bs + pos % bs;                             \
                    LOAD_ROW(rows + (pos - c0) * nh * D, k + slot * slot_stride + (int64_t)h0 * D, nh * D); \
                }                                                                                     \
                prefetch_rows((const char *)v, table, a, b, bs, slot_stride * sizeof(T),              \
                              h0 * D * sizeof(T), nh * D * sizeof(T));                                \
                int jas[R], jbs[R]; /* each row's keys in this chunk: [c0 + ja, c0 + jb) */            \
                for (int i = 0; i < R; i++) {                                                         \
                    const int64_t st = starts[r0 + i], en = lens[r0 + i];                             \
                    jas[i] = (int)((st > c0 ? st : c0) - c0);                                         \
                    jbs[i] = (int)((en < c0 + CH ? en : c0 + CH) - c0);                               \
                }                                                                                     \
                for (int i = 0; i < R; i++) {                                                         \
                    const int ja = jas[i], jb = jbs[i];                                               \
                    for (int g = 0; g < NQ && ja < jb; g++) {                                         \
                        const int x = i * NQ + g;                                                     \
                        const float *kh = rows + (g / G) * D;                                         \
                        float *sr = s + x * CH, mx = m[x];                                            \
                        int j = ja;                                                                   \
                        if (D % 8 == 0)                                                               \
                            for (; j + 4 <= jb; j += 4) dot4(qf + x * D, kh + j * nh * D, nh * D, D, sr + j); \
                        for (; j < jb; j++) sr[j] = dot(qf + x * D, kh + j * nh * D, D);              \
                        if (softcap > 0.0f)                                                           \
                            for (j = ja; j < jb; j++) sr[j] = softcap * tanhf(sr[j] / softcap);       \
                        mx = max_run(sr + ja, jb - ja, mx);                                           \
                        const float corr = expf(m[x] - mx);                                           \
                        m[x] = mx;                                                                    \
                        l[x] *= corr;                                                                 \
                        scale_row(acc + x * D, corr, D);                                              \
                        for (j = ja; j < jb; j++) {                                                   \
                            sr[j] = exp_nonpositive(sr[j] - mx);                                      \
                            l[x] += sr[j];                                                            \
                        }                                                                             \
                    }                                                                                 \
                }                                                                                     \
                for (int64_t pos = a; pos < b; pos++) {                                               \
                    const int64_t slot = table[pos / bs] * bs + pos % bs;                             \
                    LOAD_ROW(rows + (pos - c0) * nh * D, v + slot * slot_stride + (int64_t)h0 * D, nh * D); \
                }                                                                                     \
                prefetch_rows((const char *)k, table, b, b + CH < hi ? b + CH : hi, bs,               \
                              slot_stride * sizeof(T), h0 * D * sizeof(T), nh * D * sizeof(T));       \
                for (int i = 0; i < R; i++) {                                                         \
                    const int ja = jas[i], jb = jbs[i];                                               \
                    for (int g = 0; g < NQ && ja < jb; g++) {                                         \
                        const int x = i * NQ + g;                                                     \
                        const float *vh = rows + (g / G) * D + ja * nh * D;                           \
                        const float *p = s + x * CH + ja;                                             \
                        if (D % 32 == 0) { /* up to 4 heads of this kv head at once */                \
                            const int left = G - g % G, heads = left < 4 ? left : 4;                  \
                            for (int d0 = 0; d0 < D; d0 += 32)                                        \
                                pv32_group(acc + x * D + d0, D, p, CH, vh + d0, nh * D, jb - ja, heads); \
                            g += heads - 1;                                                           \
                        } else                                                                        \
                            for (int j = 0; j < jb - ja; j++) axpy(acc + x * D, p[j], vh + j * nh * D, D); \
                    }                                                                                 \
                }                                                                                     \
            }                                                                                         \
            for (int i = 0; i < R; i++)                                                               \
                for (int g = 0; g < NQ; g++) {                                                        \
                    const int x = i * NQ + g;                                                         \
                    T *o = out + ((int64_t)(r0 + i) * H + h0 * G + g) * D;                            \
                    const float inv = l[x] > 0.0f ? 1.0f / l[x] : 0.0f;                               \
                    for (int d = 0; d < D; d++) o[d] = STORE(acc[x * D + d] * inv);                   \
                }                                                                                     \
        }                                                                                             \
    }

DEFINE_ATTEND(foveal_attend_f32, float, row_f32, f32_store)
DEFINE_ATTEND(foveal_attend_bf16, uint16_t, row_bf16, f32_to_bf16)
DEFINE_ATTEND(foveal_attend_f16, _Float16, row_f16, f16_store)

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
