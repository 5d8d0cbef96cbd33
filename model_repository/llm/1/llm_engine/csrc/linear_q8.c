/* The lm_head on GGUF Q8_0 blocks for a few rows (streams), on AVX512-BF16, giving exactly
 * the bits of the bfloat16 kernel (linear_avx512bf16.c) on the dequantised weight.
 *
 * Q8_0 keeps a weight row in blocks of 32: a float16 scale d and 32 int8 codes q, the weight
 * being d * q; transformers loads it as float32 d * q (exact) rounded to bfloat16, and the
 * loader checks that this is the weight the model holds (gguf_blocks.py). This kernel reads
 * the codes, 1.0625 bytes a weight against bfloat16's 2, and rebuilds each bfloat16 weight
 * on the fly the same way (int8 -> float32, times d, rounded to nearest even), then runs the
 * bfloat16 kernel's chain: per output lane, VDPBF16PS over K in pairs, in order, then the
 * float32 bias, then one rounding to bfloat16. Same operands, same order, same bits: so the
 * runner takes this kernel for a row or two, where a call waits on memory, and the
 * bfloat16 kernel for more, where rebuilding the weights would cost more than the bytes save,
 * and a row's bits do not depend on which served it (linear.py's PackedQ8Linear).
 *
 * Layout (linear_q8_bf16_pack, from the GGUF's 34-byte blocks {half d, 32 int8}): for each
 * block of 16 outputs and each block of 32 inputs, a 544-byte record: 16 chunks of 32 bytes
 * of codes (byte j of chunk t: output j / 2, input 2 t + j % 2: the bfloat16 kernel's
 * operand order), then d of the 16 outputs as the file's float16s (32 bytes: 1.0625 bytes a
 * weight in all, the GGUF's own size).
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU); elsewhere
 * linear_q8_bf16_init() returns 0 and the other functions are not defined.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>

#include "bf16_linear.h"

#define Q8_BLOCK 34   /* GGUF: float16 d, 32 int8 codes */
#define Q8_RECORD 544 /* 512 bytes of codes, 16 half d */
#define Q8_PANEL 3    /* 16-output blocks per panel */
#define Q8_PANEL_ONE 6 /* ... for a single row */
#define Q8_ROWS 4     /* rows per tile */
#define Q8_WORK_MIN 16384

int linear_q8_bf16_init(void) { return 1; }

/* GGUF Q8_0 blocks [n][k / 32] of 34 bytes -> the layout above (n * k * 17 / 16 bytes);
 * n % 16 == 0, k % 32 == 0. */
void linear_q8_bf16_pack(const uint8_t *gguf, uint8_t *packed, int64_t n, int64_t k) {
    const int64_t blocks = k / 32;
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *rec = packed + (nb * blocks + b) * Q8_RECORD;
            uint16_t d[16];
            for (int o = 0; o < 16; o++) {
                const uint8_t *src = gguf + ((nb * 16 + o) * blocks + b) * Q8_BLOCK;
                memcpy(&d[o], src, sizeof d[o]);
                for (int t = 0; t < 16; t++)
                    for (int e = 0; e < 2; e++) rec[t * 32 + o * 2 + e] = src[2 + 2 * t + e];
            }
            memcpy(rec + 512, d, sizeof d);
        }
}

/* The weights of GGUF Q8_0 blocks [n][k / 32] as bfloat16, computed as gguf-py dequantises
 * them (d * q in float32) and rounded to nearest even as torch rounds: the loader checks that
 * they are exactly the weights the model loaded (see gguf_blocks.py). */
void linear_q8_bf16_dequantize(const uint8_t *gguf, bf16 *out, int64_t n, int64_t k) {
    for (int64_t i = 0; i < n * (k / 32); i++) {
        const uint8_t *src = gguf + i * Q8_BLOCK;
        uint16_t half;
        memcpy(&half, src, sizeof half);
        const float d = _cvtsh_ss(half);
        for (int e = 0; e < 32; e++) {
            out[i * 32 + e] = bf16_round(d * (float)(int8_t)src[2 + e]);
        }
    }
}

/* One chunk of 32 codes (16 outputs x 2 inputs) -> their bfloat16 weights: d * q in float32
 * (exact), rounded to nearest even. d_lo / d_hi: d of outputs 0-7 / 8-15, each twice. */
static inline __m512bh weights_of(const uint8_t *codes, __m512 d_lo, __m512 d_hi) {
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes))), d_lo);
    const __m512 hi =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16)))), d_hi);
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* y[r][c*16 .. +16] for rows < R and output blocks < C of one tile; R and C are constants
 * where this is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const bf16 *x, int64_t k, const uint8_t *w, int64_t blocks,
                                                       const float *bias, bf16 *y, int64_t n, const int R,
                                                       const int C) {
    const __m512i lo_lanes = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_lanes = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    __m512 acc[Q8_ROWS][Q8_PANEL_ONE];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 d_lo[Q8_PANEL_ONE], d_hi[Q8_PANEL_ONE];
        for (int c = 0; c < C; c++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + (c * blocks + b) * Q8_RECORD + 512)));
            d_lo[c] = _mm512_permutexvar_ps(lo_lanes, d);
            d_hi[c] = _mm512_permutexvar_ps(hi_lanes, d);
        }
        for (int t = 0; t < 16; t++)
            for (int c = 0; c < C; c++) {
                const __m512bh q = weights_of(w + (c * blocks + b) * Q8_RECORD + t * 32, d_lo[c], d_hi[c]);
                for (int r = 0; r < R; r++)
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], broadcast_pair(x + r * k + b * 32 + 2 * t), q);
            }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) store_outputs(acc[r][c], bias ? bias + c * 16 : NULL, y + r * n + c * 16);
}

#define Q8_TILE_C(R, C) \
    case C: tile(x, k, w, blocks, bias, y, n, R, C); break;
#define Q8_TILE_R(R)                                                 \
    case R:                                                          \
        switch (c) { Q8_TILE_C(R, 1) Q8_TILE_C(R, 2) Q8_TILE_C(R, 3) } \
        break;

static void dispatch(const bf16 *x, int64_t k, const uint8_t *w, int64_t blocks, const float *bias, bf16 *y,
                     int64_t n, int r, int c) {
    if (r == 1 && c > Q8_PANEL) {
        switch (c) { Q8_TILE_C(1, 4) Q8_TILE_C(1, 5) Q8_TILE_C(1, 6) }
        return;
    }
    switch (r) { Q8_TILE_R(1) Q8_TILE_R(2) Q8_TILE_R(3) Q8_TILE_R(4) }
}

struct call {
    const bf16 *x;
    const float *bias;
    const uint8_t *packed;
    bf16 *y;
    int64_t n, k;
};

static void run_tile(const void *p, int64_t r0, int r, int64_t o0, int c) {
    const struct call *a = p;
    const int64_t blocks = a->k / 32;
    dispatch(a->x + r0 * a->k, a->k, a->packed + o0 * blocks * Q8_RECORD, blocks, a->bias ? a->bias + o0 * 16 : NULL,
             a->y + r0 * a->n + o0 * 16, a->n, r, c);
}

/* y [m][n] = x [m][k] . w^T (+ bias, float32), w packed by linear_q8_bf16_pack; bit for bit
 * what linear_avx512_bf16 gives on the dequantised weight. In panels of Q8_PANEL output
 * blocks (Q8_PANEL_ONE for a single row) and tiles of up to Q8_ROWS rows (bf16_linear.h).
 * Declared with bf16 *packed like the other Linears. */
void linear_q8_bf16(const bf16 *x, const bf16 *packed_weight, const float *bias, bf16 *y, int64_t m, int64_t n,
                    int64_t k) {
    if (m <= 0) return;
    const struct call a = {x, bias, (const uint8_t *)packed_weight, y, n, k};
    split_panels(m, n / 16, m == 1 ? Q8_PANEL_ONE : Q8_PANEL, Q8_ROWS, m * n * k >= Q8_WORK_MIN, run_tile, &a);
}

#else

int linear_q8_bf16_init(void) { return 0; }

#endif
