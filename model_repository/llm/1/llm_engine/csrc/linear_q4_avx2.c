/* A float32 Linear at one row that reads GGUF Q4_1 weights, for CPUs with AVX2, FMA and F16C
 * but no AVX512-BF16 (linear_q4.c's kernel): 0.625 bytes a weight where the dense float32
 * weight is 4, and one row (one stream) waits on the bytes. Batches keep the dense kernels.
 *
 * Q4_1 keeps a weight row in blocks of 32: 4-bit codes q, float16 d and m, the weight being
 * d * q + m. So an output is the sum over its blocks of d * (q . x) + m * sum(x): the codes
 * are widened to float32 (exact) and multiplied with x, and d and m scale a block's sums.
 *
 * Layout (linear_q4_f32_pack, from the GGUF's 20-byte blocks {half d, half m, 16 code
 * bytes: element j in the low nibble of byte j, element j + 16 in the high one}): for each
 * group of 8 outputs and each block of 32 inputs, a 160-byte record: d of the 8 outputs
 * (float16), m (float16), then 16 chunks of 8 bytes; byte j of chunk t holds output j's
 * input 2t in its low nibble and input 2t + 1 in its high one. A group's records follow each
 * other along K. One 8-byte load widened to 32-bit lanes gives, after a mask or a shift,
 * the codes of 8 outputs at two inputs: each lane is one output, so no horizontal sums.
 *
 * Each output lane is its own chain: per block, even inputs and odd inputs summed in order
 * (two FMA chains), added, then acc = d * that + acc and acc = m * sum(x of the block) + acc,
 * block after block, then + bias. The bits depend neither on the thread count nor on which
 * outputs share a panel. They are not the dense kernels' bits: the products are grouped by
 * block (a float32 rounding apart, as the dense float32 kernels are from each other).
 *
 * Built only where the compiler targets AVX2, FMA and F16C (-march=native on such a CPU);
 * elsewhere linear_q4_f32_init() returns 0 and the other functions are not defined.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int cpu_ops_threads(void); /* cpu_ops.c: the thread count cpu_ops_set_threads() set */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "gguf_blocks.h"

#define Q4F_RECORD 160   /* bytes per 8 outputs x 32 inputs: 16 of d, 16 of m, 128 of codes */
#define Q4F_PANEL 3      /* 8-output groups a thread runs together (6 FMA chains) */
#define Q4F_WORK_MIN 65536 /* weights from which a call is split over the threads */
_Static_assert(Q4F_PANEL == 3, "linear_q4_f32_row's switch names each panel width");

int linear_q4_f32_init(void) { return 1; }

/* GGUF Q4_1 blocks [n][k / 32] of 20 bytes -> the layout above (n * k * 5 / 8 bytes);
 * n % 8 == 0, k % 32 == 0. */
void linear_q4_f32_pack(const uint8_t *gguf, uint8_t *packed, int64_t n, int64_t k) {
    const int64_t blocks = k / 32;
    for (int64_t g = 0; g < n / 8; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *rec = packed + (g * blocks + b) * Q4F_RECORD;
            for (int o = 0; o < 8; o++) {
                const uint8_t *src = gguf + ((g * 8 + o) * blocks + b) * 20;
                memcpy(rec + 2 * o, src, 2);      /* d */
                memcpy(rec + 16 + 2 * o, src + 2, 2); /* m */
                for (int t = 0; t < 16; t++)
                    rec[32 + t * 8 + o] = (uint8_t)(gguf_code(src, 2 * t) | gguf_code(src, 2 * t + 1) << 4);
            }
        }
}

/* The float32 weights of GGUF Q4_1 blocks [n][k / 32], computed as gguf-py dequantises them
 * (d * q, then + m, each rounded: the build has -ffp-contract=off): the loader checks that
 * they are exactly the weights the model loaded (gguf_blocks.py). */
void linear_q4_f32_dequantize(const uint8_t *gguf, float *out, int64_t n, int64_t k) {
    for (int64_t i = 0; i < n * (k / 32); i++) {
        const uint8_t *src = gguf + i * 20;
        uint16_t half[2];
        memcpy(half, src, sizeof half);
        const float d = _cvtsh_ss(half[0]), m = _cvtsh_ss(half[1]);
        for (int e = 0; e < 32; e++) {
            const float scaled = d * (float)gguf_code(src, e);
            out[i * 32 + e] = scaled + m;
        }
    }
}

/* sum(x) of a block of 32, in a fixed order. */
static inline float block_sum(const float *x) {
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* y[c * 8 .. + 8] for the C groups at w (C a constant where this is inlined, so the
 * accumulators stay in registers). */
static inline __attribute__((always_inline)) void panel(const float *x, const float *sums, const uint8_t *w,
                                                        int64_t blocks, const float *bias, float *y, const int C) {
    const __m256i low = _mm256_set1_epi32(15);
    __m256 acc[Q4F_PANEL];
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256 even[Q4F_PANEL], odd[Q4F_PANEL];
        for (int c = 0; c < C; c++) even[c] = odd[c] = _mm256_setzero_ps();
        const float *xb = x + b * 32;
        for (int t = 0; t < 16; t++) {
            const __m256 x0 = _mm256_broadcast_ss(xb + 2 * t), x1 = _mm256_broadcast_ss(xb + 2 * t + 1);
            for (int c = 0; c < C; c++) {
                const uint8_t *codes = w + (c * blocks + b) * Q4F_RECORD + 32 + t * 8;
                const __m256i z = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
                even[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(z, low)), x0, even[c]);
                odd[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(z, 4)), x1, odd[c]);
            }
        }
        const __m256 s = _mm256_set1_ps(sums[b]);
        for (int c = 0; c < C; c++) {
            const uint8_t *rec = w + (c * blocks + b) * Q4F_RECORD;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));
            acc[c] = _mm256_fmadd_ps(d, _mm256_add_ps(even[c], odd[c]), acc[c]);
            acc[c] = _mm256_fmadd_ps(m, s, acc[c]);
        }
    }
    for (int c = 0; c < C; c++) {
        const __m256 out = bias ? _mm256_add_ps(acc[c], _mm256_loadu_ps(bias + c * 8)) : acc[c];
        _mm256_storeu_ps(y + c * 8, out);
    }
}

/* y [n] = w [n][k] . x [k] (+ bias), w packed by linear_q4_f32_pack (n % 8 == 0, k % 32 ==
 * 0). Threads take contiguous runs of panels (Q4F_PANEL groups of 8 outputs), so each
 * streams one run of memory. */
void linear_q4_f32_row(const float *x, const uint8_t *packed, const float *bias, float *y, int64_t n, int64_t k) {
    const int64_t blocks = k / 32, groups = n / 8, panels = (groups + Q4F_PANEL - 1) / Q4F_PANEL;
    float *sums = malloc(sizeof(float) * (size_t)(blocks ? blocks : 1));
    if (!sums) abort(); /* no way to report it; better than writing through NULL */
    for (int64_t b = 0; b < blocks; b++) sums[b] = block_sum(x + b * 32);
#pragma omp parallel for schedule(static) num_threads(cpu_ops_threads()) if (n * k >= Q4F_WORK_MIN)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t g = p * Q4F_PANEL;
        const uint8_t *w = packed + g * blocks * Q4F_RECORD;
        const float *bp = bias ? bias + g * 8 : NULL;
        switch (groups - g < Q4F_PANEL ? groups - g : Q4F_PANEL) {
        case 1: panel(x, sums, w, blocks, bp, y + g * 8, 1); break;
        case 2: panel(x, sums, w, blocks, bp, y + g * 8, 2); break;
        default: panel(x, sums, w, blocks, bp, y + g * 8, 3); break;
        }
    }
    free(sums);
}

#else

int linear_q4_f32_init(void) { return 0; }

#endif
