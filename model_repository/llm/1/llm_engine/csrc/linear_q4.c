/* A Linear that reads GGUF Q4_1 weights, for bfloat16 activations on AVX512-BF16,
 * batch-invariant by construction. It reads 0.625 bytes a weight (the GGUF's own size)
 * where the bfloat16 kernel (linear_avx512bf16.c) reads 2, which is what one row (one
 * stream) waits on; per multiply-add it does a little more work than that kernel, so with
 * many rows it is slower.
 *
 * Q4_1 keeps a weight row in blocks of 32: 4-bit codes q, float16 d and m, the weight
 * being d * q + m. So a row's output is the sum over its blocks of d * (q . x) + m * sum(x).
 * 128 + q is exact in bfloat16 (bits 0x4300 | q), so VDPBF16PS takes the codes after an
 * OR, and the 128 comes back out with the m term: per block
 *     d * ((128 + q) . x) + (m - 128 d) * sum(x).
 *
 * Layout (linear_q4_bf16_pack, from the GGUF's 20-byte blocks {half d, half m, 16 code
 * bytes: element j in the low nibble of byte j, element j + 16 in the high one}): for each
 * block of 16 outputs and each block of 32 inputs, a 320-byte record: 256 bytes of codes,
 * then d and m of the 16 outputs as the file's float16s. The kernel widens them to float32
 * and takes c = m - 128 d with one FMA: 128 d is exact, so that rounds once, as a float32
 * subtraction would (float32 d and c in the record, 384 bytes, gave the same bits and took
 * 15% longer at one row, where the kernel waits on memory). The codes come in 8 chunks of 32
 * bytes; byte j of chunk t holds, for output j / 2, input 4t + j % 2 in its low nibble and
 * input 4t + 2 + j % 2 in its high one. So one 32-byte load widened to 16-bit words gives
 * two vectors of 16 outputs x 2 inputs, the operand layout of VDPBF16PS, after a mask or a
 * shift and an OR each.
 *
 * As in the bfloat16 kernel, each output lane is its own chain: VDPBF16PS over the pairs of
 * a block in order, then acc = d * block + acc and acc = c * sum(x of the block) + acc
 * (FMAs), block after block; the row and output tiling only decides which lanes share a
 * register, never the order of a sum, so a row's bits do not depend on the batch.
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU);
 * elsewhere linear_q4_bf16_init() returns 0 and the other functions are not defined.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>

#include "gguf_blocks.h"

#include "bf16_linear.h"

#define Q4_RECORD 320  /* bytes per 16 outputs x 32 inputs: 256 of codes, 16 half d, 16 half m */
#define Q4_PANEL 3     /* 16-output blocks per panel */
#define Q4_PANEL_ONE 6 /* ... for a single row: more independent chains (2.15x against 1.8x the bf16
                          kernel's speed over SmolLM2's layer matmuls on a 2-core EPYC) */
#define Q4_ROWS 4      /* rows per tile: 2 x 4 x 3 accumulators, 3 code vectors, 1 input */
#define Q4_WORK_MIN 16384

int linear_q4_bf16_init(void) { return 1; }

/* GGUF Q4_1 blocks [n][k / 32] of 20 bytes -> the layout above (n * k * 5 / 8 bytes);
 * n % 16 == 0, k % 32 == 0. */
void linear_q4_bf16_pack(const uint8_t *gguf, uint8_t *packed, int64_t n, int64_t k) {
    const int64_t blocks = k / 32;
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *rec = packed + (nb * blocks + b) * Q4_RECORD;
            uint16_t d[16], m[16];
            for (int o = 0; o < 16; o++) {
                const uint8_t *src = gguf + ((nb * 16 + o) * blocks + b) * 20;
                memcpy(&d[o], src, 2);
                memcpy(&m[o], src + 2, 2);
                for (int t = 0; t < 8; t++)
                    for (int e = 0; e < 2; e++)
                        rec[t * 32 + o * 2 + e] =
                            (uint8_t)(gguf_code(src, 4 * t + e) | gguf_code(src, 4 * t + 2 + e) << 4);
            }
            memcpy(rec + 256, d, sizeof d);
            memcpy(rec + 288, m, sizeof m);
        }
}

/* The weights of GGUF Q4_1 blocks [n][k / 32] as bfloat16, computed as gguf-py dequantises
 * them (d * q, then + m, in float32) and rounded to nearest even as torch rounds: the loader
 * checks that they are exactly the weights the model loaded (see gguf_q4.py). */
void linear_q4_bf16_dequantize(const uint8_t *gguf, bf16 *out, int64_t n, int64_t k) {
    for (int64_t i = 0; i < n * (k / 32); i++) {
        const uint8_t *src = gguf + i * 20;
        uint16_t half[2];
        memcpy(half, src, sizeof half);
        const float d = _cvtsh_ss(half[0]), m = _cvtsh_ss(half[1]);
        for (int e = 0; e < 32; e++) {
            const float scaled = d * (float)gguf_code(src, e);
            out[i * 32 + e] = bf16_round(scaled + m);
        }
    }
}

/* sum(x) of each block of 32 of a row, in a fixed order. */
static void block_sums(const bf16 *x, int64_t blocks, float *out) {
    for (int64_t b = 0; b < blocks; b++) {
        const __m512i v = _mm512_loadu_si512(x + b * 32);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
        const __m512 hi =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
        const __m512 s = _mm512_add_ps(lo, hi);
        const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        out[b] = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
    }
}

/* y[r][c*16 .. +16] for rows < R and output blocks < C of one tile; R and C are constants
 * where this is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const bf16 *x, const float *sums, int64_t k,
                                                       const uint8_t *w, int64_t blocks, const float *bias,
                                                       bf16 *y, int64_t n, const int R, const int C) {
    const __m512i low = _mm512_set1_epi16(0x0f), exponent = _mm512_set1_epi16(0x4300);
    __m512 acc[Q4_ROWS][Q4_PANEL_ONE];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 part[Q4_ROWS][Q4_PANEL_ONE];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) part[r][c] = _mm512_setzero_ps();
        for (int t = 0; t < 8; t++) {
            __m512i z[Q4_PANEL_ONE];
            for (int c = 0; c < C; c++) {
                z[c] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + (c * blocks + b) * Q4_RECORD + t * 32)));
                const __m512bh q = (__m512bh)_mm512_ternarylogic_epi32(z[c], low, exponent, 0xEA); /* a&b | c */
                for (int r = 0; r < R; r++) part[r][c] = _mm512_dpbf16_ps(part[r][c], broadcast_pair(x + r * k + b * 32 + 4 * t), q);
            }
            for (int c = 0; c < C; c++) {
                const __m512bh q = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(z[c], 4), exponent);
                for (int r = 0; r < R; r++)
                    part[r][c] = _mm512_dpbf16_ps(part[r][c], broadcast_pair(x + r * k + b * 32 + 4 * t + 2), q);
            }
        }
        for (int c = 0; c < C; c++) {
            const uint8_t *scales = w + (c * blocks + b) * Q4_RECORD + 256;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            /* c = m - 128 d: 128 d is exact, so the FMA rounds once, as the float32 sum would */
            const __m512 cm = _mm512_fmadd_ps(_mm512_set1_ps(-128.0f), d,
                                              _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32))));
            for (int r = 0; r < R; r++) {
                acc[r][c] = _mm512_fmadd_ps(d, part[r][c], acc[r][c]);
                acc[r][c] = _mm512_fmadd_ps(cm, _mm512_set1_ps(sums[r * blocks + b]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) store_outputs(acc[r][c], bias ? bias + c * 16 : NULL, y + r * n + c * 16);
}

#define Q4_TILE_C(R, C) \
    case C: tile(x, sums, k, w, blocks, bias, y, n, R, C); break;
#define Q4_TILE_R(R)                                                 \
    case R:                                                          \
        switch (c) { Q4_TILE_C(R, 1) Q4_TILE_C(R, 2) Q4_TILE_C(R, 3) } \
        break;

static void dispatch(const bf16 *x, const float *sums, int64_t k, const uint8_t *w, int64_t blocks,
                     const float *bias, bf16 *y, int64_t n, int r, int c) {
    if (r == 1 && c > Q4_PANEL) {
        switch (c) { Q4_TILE_C(1, 4) Q4_TILE_C(1, 5) Q4_TILE_C(1, 6) }
        return;
    }
    switch (r) { Q4_TILE_R(1) Q4_TILE_R(2) Q4_TILE_R(3) Q4_TILE_R(4) }
}

struct call {
    const bf16 *x;
    const float *sums, *bias;
    const uint8_t *packed;
    bf16 *y;
    int64_t n, k;
};

static void run_tile(const void *p, int64_t r0, int r, int64_t o0, int c) {
    const struct call *a = p;
    const int64_t blocks = a->k / 32;
    dispatch(a->x + r0 * a->k, a->sums + r0 * blocks, a->k, a->packed + o0 * blocks * Q4_RECORD, blocks,
             a->bias ? a->bias + o0 * 16 : NULL, a->y + r0 * a->n + o0 * 16, a->n, r, c);
}

/* y [m][n] = x [m][k] . w^T (+ bias, float32), w packed by linear_q4_bf16_pack, in panels of
 * Q4_PANEL output blocks (Q4_PANEL_ONE for a single row) and tiles of up to Q4_ROWS rows
 * (bf16_linear.h). Declared with bf16 *packed like the other Linears, so that
 * decoder_layers.c can call any of them. */
void linear_q4_bf16(const bf16 *x, const bf16 *packed_weight, const float *bias, bf16 *y, int64_t m, int64_t n,
                    int64_t k) {
    if (m <= 0) return;
    const int64_t blocks = k / 32;
    float *sums = malloc(sizeof(float) * (size_t)(m * blocks));
    if (!sums) abort(); /* no way to report it; better than writing through NULL */
    for (int64_t r = 0; r < m; r++) block_sums(x + r * k, blocks, sums + r * blocks);
    const struct call a = {x, sums, bias, (const uint8_t *)packed_weight, y, n, k};
    split_panels(m, n / 16, m == 1 ? Q4_PANEL_ONE : Q4_PANEL, Q4_ROWS, m * n * k >= Q4_WORK_MIN, run_tile, &a);
    free(sums);
}

#else

int linear_q4_bf16_init(void) { return 0; }

#endif
