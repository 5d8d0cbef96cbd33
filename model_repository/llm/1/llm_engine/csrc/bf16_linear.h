/* What the AVX512-BF16 Linears (linear_avx512bf16.c, linear_q4.c, linear_q8.c) share: the
 * bfloat16 type and its rounding, the broadcast of an input pair, and how a call is split
 * over threads. */
#ifndef BF16_LINEAR_H
#define BF16_LINEAR_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

int cpu_ops_threads(void); /* cpu_ops.c: the thread count cpu_ops_set_threads() set */

/* A finite float rounded to bfloat16, to nearest even, as torch rounds it. */
static inline bf16 bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* Inputs 2p and 2p + 1 of a row in every lane pair: VDPBF16PS's other operand. */
static inline __m512bh broadcast_pair(const bf16 *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
}

/* 16 outputs' float32 sums, plus their float32 bias where there is one, rounded to bfloat16
 * (to nearest even) and stored: how every tile ends. */
static inline void store_outputs(__m512 sums, const float *bias, bf16 *y) {
    if (bias) sums = _mm512_add_ps(sums, _mm512_loadu_ps(bias));
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(sums));
}
#endif

/* The split: a thread takes whole panels of output blocks (16 outputs each), so a panel is
 * read from memory once per call, and runs the rows over it in near-equal tiles of up to
 * max_rows (20 rows as 6, 7, 7), read from cache after the first. It decides which lanes
 * share a register, never the order of a sum, so it changes no bits. */

/* One tile: rows [r0, r0 + r) against output blocks [o0, o0 + c) of the kernel's call. */
typedef void (*panel_tile_fn)(const void *call, int64_t r0, int r, int64_t o0, int c);

static inline void split_panels(int64_t m, int64_t out_blocks, int64_t panel, int64_t max_rows, int parallel,
                                panel_tile_fn tile, const void *call) {
    const int64_t panels = (out_blocks + panel - 1) / panel, tiles = (m + max_rows - 1) / max_rows;
#pragma omp parallel for schedule(static) num_threads(cpu_ops_threads()) if (parallel)
    for (int64_t pn = 0; pn < panels; pn++) {
        const int64_t o0 = pn * panel;
        const int c = (int)(out_blocks - o0 < panel ? out_blocks - o0 : panel);
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int r = (int)((m - r0) / (tiles - t));
            tile(call, r0, r, o0, c);
            r0 += r;
        }
    }
}

#endif
