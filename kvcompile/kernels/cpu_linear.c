/* A projection of one activation row on the CPU: out[o] = x . w[o] for a row-major weight [O, I], read once at
   the memory's speed.

   A batch-1 decode step is bound by reading the weights, and MKL's product for one row (``linear`` and the
   streamed ``weight @ x^T`` alike) reads them at about a third of this machine's read bandwidth
   (docs/results.md). Here each thread streams its own run of weight rows, eight at a time, with the row of x
   held in registers: eight running sums of 16 lanes, reduced once a row. Built and loaded with the decode
   (``cpu_native.py``); tested against ``torch.nn.functional.linear``. */

#include "cpu_lanes.h"

/* R weight rows from o0: R running sums over the I channels (a multiple of 16). */
INLINE void rows_of(const float *restrict x, const float *restrict w, int I, int o0, const int R,
                    float *restrict out) {
    lanes a[8] = {{0}};
    for (int i = 0; i < I; i += 16) {
        const lanes xv = load(x + i);
        for (int r = 0; r < R; ++r) a[r] += xv * load(w + (int64_t)(o0 + r) * I + i);
    }
    for (int r = 0; r < R; ++r) out[o0 + r] = sum_lanes(a[r]);
}

void row_linear(const float *x, const float *w, int I, int O, int threads, float *out) {
    const int blocks = O / 8;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < blocks; ++b) rows_of(x, w, I, b * 8, 8, out);
    for (int o = blocks * 8; o < O; ++o) rows_of(x, w, I, o, 1, out);
}
