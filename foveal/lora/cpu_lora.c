/* Batched LoRA for CPUs (foveal/lora/stacks.py): y[r] += B_s (A_s x[r]) for the rows r of every adapter
 * slot s < num_slots, in one call per linear (the grouped-GEMM path takes four PyTorch ops).
 *
 * Rows are grouped by slot as in LoRABatch: perm lists row indices slot by slot, offs holds each group's
 * end. A is [S1, K, in] (K = n slices x R); Bt is B^T, [S1, K, out], block-diagonal: outputs of slice j
 * read only rank rows j*R .. j*R + R - 1 (the other blocks are zeros, never read), so the bytes read are
 * those of the adapter itself. Two parallel loops: h = A_s x for every (slot, k), then every (slot, 64
 * outputs) adds h's slice block times Bt into the group's rows of y. fp32; h is not rounded (PEFT's
 * lora_A output in fp32 is fp32). Sums are reassociated (vectorized), as the GEMMs they stand beside. */
#include <stdint.h>
#include <stdlib.h>

void foveal_lora_f32(const float *x, int64_t xs, float *y, int64_t ys, const float *A, const float *Bt,
                     const int64_t *perm, const int32_t *offs, int64_t num_slots, int64_t T, int64_t in,
                     int64_t out, int64_t K, int64_t R, const int64_t *bounds, int64_t n, int nthreads) {
    if (T <= 0 || num_slots <= 0) return;
    float *h = (float *)malloc(sizeof(float) * (size_t)T * (size_t)K); /* row i: perm[i]'s h */
    if (!h) return;
    const int64_t work = num_slots * K + num_slots * out;
#pragma omp parallel num_threads(nthreads) if (work * T > 65536)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_slots * K; t++) { /* slots interleaved: threads share a group */
            const int64_t s = t % num_slots, k = t / num_slots;
            const int64_t lo = s ? offs[s - 1] : 0, hi = offs[s];
            const float *a = A + (s * K + k) * in;
            for (int64_t i = lo; i < hi; i++) {
                const float *xr = x + perm[i] * xs;
                float acc = 0.0f;
                for (int64_t c = 0; c < in; c++) acc += a[c] * xr[c];
                h[i * K + k] = acc;
            }
        }
        /* y: every (slot, 64 outputs), vectorized along the outputs: B^T's rows are contiguous there */
        const int64_t CH = 64, chunks = (out + CH - 1) / CH;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_slots * chunks; t++) {
            const int64_t s = t % num_slots, o0 = (t / num_slots) * CH, o1 = o0 + CH < out ? o0 + CH : out;
            const int64_t lo = s ? offs[s - 1] : 0, hi = offs[s];
            for (int64_t j = 0; j < n && lo < hi; j++) {
                const int64_t a = o0 > bounds[j] ? o0 : bounds[j], b = o1 < bounds[j + 1] ? o1 : bounds[j + 1];
                if (a >= b) continue;
                const float *bt = Bt + (s * K + j * R) * out; /* rank row r of slice j: bt + r * out */
                for (int64_t i = lo; i < hi; i++) {
                    float acc[64] = {0};
                    const float *hr = h + i * K + j * R;
                    for (int64_t r = 0; r < R; r++) {
                        const float hv = hr[r], *brow = bt + r * out + a;
                        for (int64_t o = 0; o < b - a; o++) acc[o] += hv * brow[o];
                    }
                    float *yr = y + perm[i] * ys + a;
                    for (int64_t o = 0; o < b - a; o++) yr[o] += acc[o];
                }
            }
        }
    }
    free(h);
}
