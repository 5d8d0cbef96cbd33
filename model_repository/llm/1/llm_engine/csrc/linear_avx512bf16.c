/* A bfloat16 Linear on AVX512-BF16 (VDPBF16PS), batch-invariant by construction, for CPUs
 * that have the instruction but no AMX tiles (AMD Zen 4 and later, Cooper Lake).
 *
 * oneDNN's bfloat16 kernels give a row other bits at one row than among many (see
 * linear.py), and at one row they read the weights well below the memory's bandwidth.
 * Here each output is one accumulator lane's chain of VDPBF16PS over K in pairs, in order,
 * whatever the number of rows, a row's place among them or the thread count: the row and
 * column tiling only decides which lanes share a register, never the order of a sum.
 *
 * The weight is packed once, [N/16][K/2][16 outputs][2]: one 64-byte vector per block of
 * 16 outputs and pair of inputs, each block's K/2 vectors in a row, so a one-row call
 * streams the weight from memory in order. Needs N % 16 == 0 and K % 2 == 0; linear.py
 * keeps other shapes on oneDNN. A thread takes whole panels of PANEL blocks and runs the
 * rows over each in tiles of up to ROWS, so a panel is read from memory once per call and
 * from cache for the other row tiles. Built only where the compiler targets AVX512-BF16
 * (-march=native on such a CPU); elsewhere linear_avx512_bf16_init() returns 0 and
 * the other two functions are not defined.
 */
#include <stdint.h>
#include <string.h>

#include "bf16_linear.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define PANEL 3        /* 16-output blocks per panel: 3 weight vectors per input pair */
#define ROWS 8         /* rows per tile: 8 x 3 accumulators + 3 weights + 1 input of 32 zmm */
#define WORK_MIN 16384 /* multiply-adds from which a call is split over threads */

int linear_avx512_bf16_init(void) { return 1; }

void linear_avx512_bf16_pack(const bf16 *w, bf16 *packed, int64_t n, int64_t k) {
    const int64_t pairs = k / 2;
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t p = 0; p < pairs; p++) {
            bf16 *dst = packed + (nb * pairs + p) * 32;
            for (int j = 0; j < 16; j++) {
                const bf16 *src = w + (nb * 16 + j) * k + 2 * p;
                dst[2 * j] = src[0];
                dst[2 * j + 1] = src[1];
            }
        }
}

/* y[r][c*16 .. +16] for rows < R and blocks < C of one tile; R and C are constants where
 * this is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const bf16 *x, int64_t k, const bf16 *w, int64_t pairs,
                                                       const float *bias, bf16 *y, int64_t n, const int R,
                                                       const int C) {
    __m512 acc[ROWS][PANEL];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[PANEL];
        for (int c = 0; c < C; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + (c * pairs + p) * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh xv = broadcast_pair(x + r * k + 2 * p);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) store_outputs(acc[r][c], bias ? bias + c * 16 : NULL, y + r * n + c * 16);
}

#define TILE_C(R, C) \
    case C: tile(x, k, w, pairs, bias, y, n, R, C); break;
#define TILE_R(R)                                                  \
    case R:                                                        \
        switch (c) { TILE_C(R, 1) TILE_C(R, 2) TILE_C(R, 3) } \
        break;

static void dispatch(const bf16 *x, int64_t k, const bf16 *w, int64_t pairs, const float *bias, bf16 *y,
                     int64_t n, int r, int c) {
    switch (r) { TILE_R(1) TILE_R(2) TILE_R(3) TILE_R(4) TILE_R(5) TILE_R(6) TILE_R(7) TILE_R(8) }
}

struct call {
    const bf16 *x, *packed;
    const float *bias;
    bf16 *y;
    int64_t n, k;
};

static void run_tile(const void *p, int64_t r0, int r, int64_t b0, int c) {
    const struct call *a = p;
    const int64_t pairs = a->k / 2;
    dispatch(a->x + r0 * a->k, a->k, a->packed + b0 * pairs * 32, pairs, a->bias ? a->bias + b0 * 16 : NULL,
             a->y + r0 * a->n + b0 * 16, a->n, r, c);
}

/* y [m][n] = x [m][k] . w^T (+ bias, float32), w packed by linear_avx512_bf16_pack. */
void linear_avx512_bf16(const bf16 *x, const bf16 *packed, const float *bias, bf16 *y, int64_t m, int64_t n,
                        int64_t k) {
    const struct call a = {x, packed, bias, y, n, k};
    split_panels(m, n / 16, PANEL, ROWS, m * n * k >= WORK_MIN, run_tile, &a);
}

#else

int linear_avx512_bf16_init(void) { return 0; }

#endif
