/* A float32 Linear at one row that reads GGUF Q8_0 weights (the lm_head of SmolLM2's GGUF,
 * tied to the embedding), for CPUs with AVX2, FMA and F16C but no AVX512-BF16 (linear_q8.c's
 * kernel): 1.0625 bytes a weight where the dense float32 weight is 4, and one row (one
 * stream) waits on the bytes. Batches keep the dense kernels. linear_q4_avx2.c's sibling.
 *
 * Q8_0 keeps a weight row in blocks of 32: a float16 scale d and 32 int8 codes q, the weight
 * being d * q (exact in float32). So an output is the sum over its blocks of d * (q . x):
 * the codes are widened to float32 (exact) and multiplied with x, and d scales a block's sum.
 *
 * Layout (linear_q8_f32_pack, from the GGUF's 34-byte blocks {half d, 32 int8}): for each
 * group of 8 outputs and each block of 32 inputs, a 272-byte record: d of the 8 outputs
 * (float16), then 32 chunks of 8 bytes; byte j of chunk t is output j's code at input t. A
 * group's records follow each other along K. One 8-byte load widened to 32-bit lanes gives
 * the codes of 8 outputs at one input: each lane is one output, so no horizontal sums.
 *
 * Each output lane is its own chain: per block, even inputs and odd inputs summed in order
 * (two FMA chains), added, then acc = d * that + acc, block after block, then + bias. The
 * bits depend neither on the thread count nor on which outputs share a panel. They are not
 * the dense kernels' bits: the products are grouped by block (a float32 rounding apart, as
 * the dense float32 kernels are from each other).
 *
 * Built only where the compiler targets AVX2, FMA and F16C (-march=native on such a CPU);
 * elsewhere linear_q8_f32_init() returns 0 and the other functions are not defined.
 */
#include <stdint.h>
#include <string.h>

int cpu_ops_threads(void); /* cpu_ops.c: the thread count cpu_ops_set_threads() set */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define Q8F_BLOCK 34     /* GGUF: float16 d, 32 int8 codes */
#define Q8F_RECORD 272   /* bytes per 8 outputs x 32 inputs: 16 of d, 256 of codes */
#define Q8F_PANEL 4      /* 8-output groups a thread runs together (8 FMA chains; 3 took 10% longer) */
#define Q8F_WORK_MIN 65536 /* weights from which a call is split over the threads */
_Static_assert(Q8F_PANEL == 4, "linear_q8_f32_row's switch names each panel width");

int linear_q8_f32_init(void) { return 1; }

/* GGUF Q8_0 blocks [n][k / 32] of 34 bytes -> the layout above (n * k * 17 / 16 bytes);
 * n % 8 == 0, k % 32 == 0. */
void linear_q8_f32_pack(const uint8_t *gguf, uint8_t *packed, int64_t n, int64_t k) {
    const int64_t blocks = k / 32;
    for (int64_t g = 0; g < n / 8; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *rec = packed + (g * blocks + b) * Q8F_RECORD;
            for (int o = 0; o < 8; o++) {
                const uint8_t *src = gguf + ((g * 8 + o) * blocks + b) * Q8F_BLOCK;
                memcpy(rec + 2 * o, src, 2); /* d */
                for (int t = 0; t < 32; t++) rec[16 + t * 8 + o] = src[2 + t];
            }
        }
}

/* The float32 weights of GGUF Q8_0 blocks [n][k / 32], computed as gguf-py dequantises them
 * (d * q in float32, exact): the loader checks that they are exactly the weights the model
 * loaded (gguf_blocks.py). */
void linear_q8_f32_dequantize(const uint8_t *gguf, float *out, int64_t n, int64_t k) {
    for (int64_t i = 0; i < n * (k / 32); i++) {
        const uint8_t *src = gguf + i * Q8F_BLOCK;
        uint16_t half;
        memcpy(&half, src, sizeof half);
        const float d = _cvtsh_ss(half);
        for (int e = 0; e < 32; e++) out[i * 32 + e] = d * (float)(int8_t)src[2 + e];
    }
}

static inline __m256 codes_at(const uint8_t *codes) { /* 8 int8 codes -> float32 (exact) */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)codes)));
}

/* y[c * 8 .. + 8] for the C groups at w (C a constant where this is inlined, so the
 * accumulators stay in registers). */
static inline __attribute__((always_inline)) void panel(const float *x, const uint8_t *w, int64_t blocks,
                                                        const float *bias, float *y, const int C) {
    __m256 acc[Q8F_PANEL];
    for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256 even[Q8F_PANEL], odd[Q8F_PANEL];
        for (int c = 0; c < C; c++) even[c] = odd[c] = _mm256_setzero_ps();
        const float *xb = x + b * 32;
        for (int t = 0; t < 32; t += 2) {
            const __m256 x0 = _mm256_broadcast_ss(xb + t), x1 = _mm256_broadcast_ss(xb + t + 1);
            for (int c = 0; c < C; c++) {
                const uint8_t *codes = w + (c * blocks + b) * Q8F_RECORD + 16 + t * 8;
                even[c] = _mm256_fmadd_ps(codes_at(codes), x0, even[c]);
                odd[c] = _mm256_fmadd_ps(codes_at(codes + 8), x1, odd[c]);
            }
        }
        for (int c = 0; c < C; c++) {
            const uint8_t *rec = w + (c * blocks + b) * Q8F_RECORD;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
            acc[c] = _mm256_fmadd_ps(d, _mm256_add_ps(even[c], odd[c]), acc[c]);
        }
    }
    for (int c = 0; c < C; c++) {
        const __m256 out = bias ? _mm256_add_ps(acc[c], _mm256_loadu_ps(bias + c * 8)) : acc[c];
        _mm256_storeu_ps(y + c * 8, out);
    }
}

/* y [n] = w [n][k] . x [k] (+ bias), w packed by linear_q8_f32_pack (n % 8 == 0, k % 32 ==
 * 0). Threads take contiguous runs of panels (Q8F_PANEL groups of 8 outputs), so each
 * streams one run of memory. */
void linear_q8_f32_row(const float *x, const uint8_t *packed, const float *bias, float *y, int64_t n, int64_t k) {
    const int64_t blocks = k / 32, groups = n / 8, panels = (groups + Q8F_PANEL - 1) / Q8F_PANEL;
#pragma omp parallel for schedule(static) num_threads(cpu_ops_threads()) if (n * k >= Q8F_WORK_MIN)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t g = p * Q8F_PANEL;
        const uint8_t *w = packed + g * blocks * Q8F_RECORD;
        const float *bp = bias ? bias + g * 8 : NULL;
        switch (groups - g < Q8F_PANEL ? groups - g : Q8F_PANEL) {
        case 1: panel(x, w, blocks, bp, y + g * 8, 1); break;
        case 2: panel(x, w, blocks, bp, y + g * 8, 2); break;
        case 3: panel(x, w, blocks, bp, y + g * 8, 3); break;
        default: panel(x, w, blocks, bp, y + g * 8, 4); break;
        }
    }
}

#else

int linear_q8_f32_init(void) { return 0; }

#endif
