/* Fused CPU kernels for the decode step: residual add + RMSNorm, rotary embedding with
 * the KV-cache write, paged attention, SiLU(gate) * up, and a float32 Linear at one row
 * (linear_amx.c, built into the same library, has the bfloat16 Linear on AMX).
 *
 * Each runs over the rows of a step in one call, so a layer is a handful of calls
 * instead of ~45 ATen ops from Python. Every row is computed on its own with a fixed
 * order of operations (reductions in fixed lanes, explicit fmaf, built with
 * -ffp-contract=off), so a row's result does not depend on what else is in the batch,
 * on where in the batch it sits, or on how gcc vectorised a loop. All arithmetic is in
 * float32; bfloat16 values are rounded to nearest even once, on store.
 *
 * Built with -fopenmp where the compiler has it, the loops over rows (and, in attention,
 * over (query, kv head) pairs) are shared by cpu_ops_set_threads() threads with a static
 * schedule once a call has enough work. Each item is still computed whole by one thread
 * in the same order, so the bits don't depend on the thread count either. The library
 * links libgomp.so.1 by its soname, so in a process that imported torch it shares
 * torch's OpenMP runtime and thread pool.
 *
 * The KV pool of one layer is [2][kv_heads][slots][head_dim] (see runner.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define LANES 16
/* A call goes parallel from this many multiply-adds (or elements) on: below it, waking
 * the team costs more than it saves. */
#define PAR_MIN_WORK 16384

static int n_threads = 1;

void cpu_ops_set_threads(int threads) { n_threads = threads > 0 ? threads : 1; }
int cpu_ops_threads(void) { return n_threads; }

/* A parallel loop over a kernel's rows; the function defines `work` first. */
#define PARALLEL_FOR _Pragma("omp parallel for schedule(static) num_threads(n_threads) if(work >= PAR_MIN_WORK)")

typedef uint16_t bf16;

static inline float bf16_load(const bf16 *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void bf16_store(bf16 *p, float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) { /* NaN stays NaN */
        *p = (bf16)((u >> 16) | 0x40u);
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    *p = (bf16)(u >> 16);
}

static inline float f32_load(const float *p) { return *p; }
static inline void f32_store(float *p, float f) { *p = f; }

/* Eight float lanes. v8_fma is eight fmaf()s, so a result is the same bits whichever
 * branch computed it; gcc does not vectorise fmaf reductions on its own. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 v8_fma(v8 a, v8 b, v8 c) {
#if defined(__AVX__) && defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    v8 r;
    for (int l = 0; l < 8; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
#endif
}

static inline v8 f32_load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8 bf16_load8(const bf16 *p) {
    v8 v;
    for (int l = 0; l < 8; l++) v[l] = bf16_load(p + l);
    return v;
}

/* exp(x) to about 2 ulp: 2^n * p(r) with r = x - n ln2, a degree-6 polynomial. Written
 * so that gcc vectorises it (no errno, no table; the clamps are compares, which
 * -fno-trapping-math lets it if-convert, where fminf/fmaxf would need NaN handling),
 * and the same on every call. A NaN stays NaN. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693145751953125f, x);
    r = fmaf(n, -1.428606765330187045e-06f, r);
    float p = 1.0f / 720.0f;
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float lanes_sum(const float *acc) {
    float s8[8], s4[4];
    for (int l = 0; l < 8; l++) s8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* The eight lanes of v summed in a fixed order. */
static inline float v8_sum(v8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

/* A row of d values as float, into dst. */
static inline void bf16_row(const bf16 *src, float *dst, int64_t d) {
    const int64_t d8 = d / 8 * 8;
    for (int64_t e = 0; e < d8; e += 8) {
        const v8 v = bf16_load8(src + e);
        memcpy(dst + e, &v, sizeof v);
    }
    for (int64_t e = d8; e < d; e++) dst[e] = bf16_load(src + e);
}

static inline void f32_row(const float *src, float *dst, int64_t d) { memcpy(dst, src, sizeof(float) * (size_t)d); }

/* Paged attention's blocking: keys scored side by side, query heads of one kv head done
 * together, 8-lane chunks of the head dim summed together, and how many keys ahead the
 * key and value rows are prefetched (a context's blocks lie anywhere in the pool). */
#define ATTN_KEYS 4
#define ATTN_HEADS 4
#define ATTN_SPAN 4
#define ATTN_AHEAD 8
#define ATTN_CASE(SUFFIX, H, D)                                                                   \
    case H * 1000 + D:                                                                            \
        attn_item_##SUFFIX(qh, kbase, vbase, slot, len, H, D ? D : d, scale, qf, scores, dst);    \
        break;
#define ATTN_CASES(SUFFIX, D) \
    ATTN_CASE(SUFFIX, 1, D) ATTN_CASE(SUFFIX, 2, D) ATTN_CASE(SUFFIX, 3, D) ATTN_CASE(SUFFIX, 4, D)
_Static_assert(ATTN_HEADS == 4, "ATTN_CASES must name every head count from 1 to ATTN_HEADS");

/* Every cache line of the `bytes` bytes at p. */
static inline void prefetch_row(const void *p, int64_t bytes) {
    const char *c = (const char *)((uintptr_t)p & ~(uintptr_t)63), *end = (const char *)p + bytes;
    for (; c < end; c += 64) __builtin_prefetch(c);
}

#define DEFINE_KERNELS(SUFFIX, T, LOAD, STORE, LOAD8, ROW)                                        \
                                                                                                  \
/* h += delta (when delta is given, rounded to T), then out = rmsnorm(h) * weight. */             \
void add_rms_norm_##SUFFIX(T *h, const T *delta, T *out, const float *weight, int64_t rows,       \
                           int64_t dim, float eps) {                                              \
    const int64_t work = rows * dim;                                                              \
    PARALLEL_FOR                                                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                          \
        T *x = h + r * dim;                                                                       \
        if (delta) {                                                                              \
            const T *d = delta + r * dim;                                                         \
            for (int64_t i = 0; i < dim; i++) STORE(x + i, LOAD(x + i) + LOAD(d + i));            \
        }                                                                                         \
        if (!out) continue;                                                                       \
        float acc[LANES] = {0};                                                                   \
        int64_t i = 0;                                                                            \
        for (; i + LANES <= dim; i += LANES)                                                      \
            for (int l = 0; l < LANES; l++) {                                                     \
                float v = LOAD(x + i + l);                                                        \
                acc[l] = fmaf(v, v, acc[l]);                                                      \
            }                                                                                     \
        for (int l = 0; i < dim; i++, l++) {                                                      \
            float v = LOAD(x + i);                                                                \
            acc[l] = fmaf(v, v, acc[l]);                                                          \
        }                                                                                         \
        float inv = 1.0f / sqrtf(lanes_sum(acc) / (float)dim + eps);                              \
        T *o = out + r * dim;                                                                     \
        for (int64_t j = 0; j < dim; j++) STORE(o + j, (LOAD(x + j) * inv) * weight[j]);          \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* Rotate q and k of each row of qkv [rows][(heads + 2 kv_heads) * d] at its position;            \
 * q goes to q_out [rows][heads][d], k and v to the cache at the row's slot. cos and              \
 * sin_signed are [positions][d] (sin with its first half negated). */                            \
void rope_store_kv_##SUFFIX(const T *qkv, int64_t rows, const int64_t *positions,                 \
                            const float *cos, const float *sin_signed, int64_t heads,             \
                            int64_t kv_heads, int64_t d, T *q_out, T *cache,                      \
                            const int64_t *slots, int64_t num_slots) {                            \
    const int64_t width = (heads + 2 * kv_heads) * d, half = d / 2;                               \
    const int64_t head_stride = num_slots * d, kv_stride = kv_heads * head_stride;                \
    const int64_t work = rows * width;                                                            \
    PARALLEL_FOR                                                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                          \
        const T *src = qkv + r * width;                                                           \
        const float *c = cos + positions[r] * d, *s = sin_signed + positions[r] * d;              \
        for (int64_t hh = 0; hh < heads + kv_heads; hh++) {                                       \
            const T *x = src + hh * d;                                                            \
            T *dst = hh < heads ? q_out + (r * heads + hh) * d                                    \
                                : cache + (hh - heads) * head_stride + slots[r] * d;              \
            for (int64_t j = 0; j < d; j++) {                                                     \
                float swapped = LOAD(x + (j < half ? j + half : j - half));                       \
                STORE(dst + j, fmaf(LOAD(x + j), c[j], swapped * s[j]));                          \
            }                                                                                     \
        }                                                                                         \
        const T *v = src + (heads + kv_heads) * d;                                                \
        for (int64_t kh = 0; kh < kv_heads; kh++)                                                 \
            memcpy(cache + kv_stride + kh * head_stride + slots[r] * d, v + kh * d,               \
                   (size_t)d * sizeof(T));                                                        \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* Scores of `heads` (at most ATTN_HEADS) float queries qf [heads][d] against the keys at         \
 * `slot` [len], into scores [heads][len]. Keys go ATTN_KEYS at a time, each converted to         \
 * float once for all the heads; each score is its own 8-lane FMA chain over the head dim         \
 * in order, summed by v8_sum, then the dim's last d % 8 in order, so its bits depend only        \
 * on its query and key. Inlined with `heads` (and d, where the caller knows it) constant,        \
 * so the accumulators stay in registers. */                                                      \
static inline __attribute__((always_inline)) void attn_scores_##SUFFIX(                           \
    const float *qf, const T *kbase, const T *vbase, const int64_t *slot, int64_t len,            \
    const int64_t heads, const int64_t d, float scale, float *scores) {                           \
    const int64_t d8 = d / 8 * 8;                                                                 \
    for (int64_t j = 0; j < len; j += ATTN_KEYS) {                                                \
        const int64_t keys = len - j < ATTN_KEYS ? len - j : ATTN_KEYS;                           \
        for (int64_t t = j ? j + ATTN_AHEAD : 0; t < j + ATTN_KEYS + ATTN_AHEAD && t < len; t++) {\
            prefetch_row(kbase + slot[t] * d, d * (int64_t)sizeof(T));                            \
            prefetch_row(vbase + slot[t] * d, d * (int64_t)sizeof(T));                            \
        }                                                                                         \
        const T *k[ATTN_KEYS];                                                                    \
        for (int t = 0; t < ATTN_KEYS; t++) k[t] = kbase + slot[j + (t < keys ? t : 0)] * d;      \
        v8 acc[ATTN_HEADS][ATTN_KEYS] = {{{0}}};                                                  \
        for (int64_t e = 0; e < d8; e += 8)                                                       \
            for (int t = 0; t < ATTN_KEYS; t++) {                                                 \
                const v8 kv = LOAD8(k[t] + e);                                                    \
                for (int64_t g = 0; g < heads; g++)                                               \
                    acc[g][t] = v8_fma(f32_load8(qf + g * d + e), kv, acc[g][t]);                 \
            }                                                                                     \
        for (int64_t g = 0; g < heads; g++)                                                       \
            for (int64_t t = 0; t < keys; t++) {                                                  \
                float s = v8_sum(acc[g][t]);                                                      \
                for (int64_t e = d8; e < d; e++) s = fmaf(qf[g * d + e], LOAD(k[t] + e), s);      \
                scores[g * len + j + t] = s * scale;                                              \
            }                                                                                     \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* dst [heads][d] = the rows at `slot` [len] of vbase weighted by p [heads][len] and scaled       \
 * by inv [heads]: each output element one FMA chain over the keys in order. The head dim         \
 * goes ATTN_SPAN 8-lane chunks at a time, each value chunk converted once for all heads. */      \
static inline __attribute__((always_inline)) void attn_values_##SUFFIX(                           \
    const float *p, const float *inv, const T *vbase, const int64_t *slot, int64_t len,           \
    const int64_t heads, const int64_t d, T *dst) {                                               \
    const int64_t d8 = d / 8 * 8;                                                                 \
    for (int64_t e0 = 0; e0 < d8; e0 += 8 * ATTN_SPAN) {                                          \
        v8 acc[ATTN_HEADS][ATTN_SPAN] = {{{0}}};                                                  \
        for (int64_t j = 0; j < len; j++) {                                                       \
            const T *v = vbase + slot[j] * d + e0;                                                \
            for (int c = 0; c < ATTN_SPAN; c++) {                                                 \
                if (e0 + 8 * c >= d8) break;                                                      \
                const v8 vv = LOAD8(v + 8 * c);                                                   \
                for (int64_t g = 0; g < heads; g++) {                                             \
                    const float w = p[g * len + j];                                               \
                    const v8 wv = {w, w, w, w, w, w, w, w};                                       \
                    acc[g][c] = v8_fma(wv, vv, acc[g][c]);                                        \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t g = 0; g < heads; g++)                                                       \
            for (int c = 0; c < ATTN_SPAN && e0 + 8 * c < d8; c++)                                \
                for (int l = 0; l < 8; l++)                                                       \
                    STORE(dst + g * d + e0 + 8 * c + l, acc[g][c][l] * inv[g]);                   \
    }                                                                                             \
    for (int64_t g = 0; g < heads; g++)                                                           \
        for (int64_t e = d8; e < d; e++) {                                                        \
            float o = 0.0f;                                                                       \
            for (int64_t j = 0; j < len; j++)                                                     \
                o = fmaf(p[g * len + j], LOAD(vbase + slot[j] * d + e), o);                       \
            STORE(dst + g * d + e, o * inv[g]);                                                   \
        }                                                                                         \
}                                                                                                 \
                                                                                                  \
/* One attention item: `heads` query heads at qh (at most ATTN_HEADS) that share the kv           \
 * head at kbase / vbase, over `len` context slots, into dst. */                                  \
static inline __attribute__((always_inline)) void attn_item_##SUFFIX(                             \
    const T *qh, const T *kbase, const T *vbase, const int64_t *slot, int64_t len,                \
    const int64_t heads, const int64_t d, float scale, float *qf, float *scores, T *dst) {        \
    float inv[ATTN_HEADS];                                                                        \
    for (int64_t g = 0; g < heads; g++) ROW(qh + g * d, qf + g * d, d);                           \
    attn_scores_##SUFFIX(qf, kbase, vbase, slot, len, heads, d, scale, scores);                   \
    for (int64_t g = 0; g < heads; g++) {                                                         \
        float *sc = scores + g * len, best = -INFINITY, acc[LANES] = {0};                         \
        for (int64_t j = 0; j < len; j++) best = sc[j] > best ? sc[j] : best;                     \
        for (int64_t j = 0; j < len; j++) sc[j] = exp_f32(sc[j] - best);                          \
        int64_t j = 0;                                                                            \
        for (; j + LANES <= len; j += LANES)                                                      \
            for (int l = 0; l < LANES; l++) acc[l] += sc[j + l];                                  \
        for (int l = 0; j < len; j++, l++) acc[l] += sc[j];                                       \
        inv[g] = 1.0f / lanes_sum(acc);                                                           \
    }                                                                                             \
    attn_values_##SUFFIX(scores, inv, vbase, slot, len, heads, d, dst);                           \
}                                                                                                 \
                                                                                                  \
/* attn_item with `heads` and, for the common head dims, d as constants. */                       \
static void attn_dispatch_##SUFFIX(const T *qh, const T *kbase, const T *vbase,                   \
                                   const int64_t *slot, int64_t len, int64_t heads, int64_t d,    \
                                   float scale, float *qf, float *scores, T *dst) {               \
    switch (heads * 1000 + (d == 64 || d == 128 ? d : 0)) {                                       \
    ATTN_CASES(SUFFIX, 64)                                                                        \
    ATTN_CASES(SUFFIX, 128)                                                                       \
    ATTN_CASES(SUFFIX, 0)                                                                         \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* Attention of query rows over paged contexts. Query i is token row rows[i] of q                 \
 * [*, heads, d]; it attends the first lens[i] slots of row ctx[i] of ctx_slots                   \
 * [*, ctx_width]; its result goes to the same row of out [*, heads, d]. ctx may be NULL          \
 * (query i uses context row i). Work items are (query, kv head) pairs; an item takes             \
 * the query heads of its kv head ATTN_HEADS at a time. Each thread keeps its queries and         \
 * scores in a buffer of its own. */                                                              \
void paged_attention_##SUFFIX(const T *q, const T *cache, T *out, const int64_t *rows,            \
                              const int64_t *ctx, const int64_t *lens, const int64_t *ctx_slots,  \
                              int64_t ctx_width, int64_t n, int64_t heads, int64_t kv_heads,      \
                              int64_t d, int64_t num_slots, float scale) {                        \
    const int64_t group = heads / kv_heads;                                                       \
    const int64_t head_stride = num_slots * d, kv_stride = kv_heads * head_stride;                \
    int64_t max_len = 0, work = 0;                                                                \
    for (int64_t i = 0; i < n; i++) {                                                             \
        max_len = lens[i] > max_len ? lens[i] : max_len;                                          \
        work += lens[i];                                                                          \
    }                                                                                             \
    work *= 2 * heads * d;                                                                        \
    _Pragma("omp parallel num_threads(n_threads) if(work >= PAR_MIN_WORK && n * kv_heads > 1)")   \
    {                                                                                             \
        float *qf = malloc(sizeof(float) * (size_t)(ATTN_HEADS * (d + max_len)));                 \
        if (!qf) abort(); /* no way to report it; better than writing through NULL */             \
        float *scores = qf + ATTN_HEADS * d;                                                      \
        _Pragma("omp for schedule(static)")                                                       \
        for (int64_t item = 0; item < n * kv_heads; item++) {                                     \
            const int64_t i = item / kv_heads, kh = item % kv_heads, row = rows[i];               \
            const int64_t *slot = ctx_slots + (ctx ? ctx[i] : i) * ctx_width;                     \
            const T *kbase = cache + kh * head_stride, *vbase = kbase + kv_stride;                \
            for (int64_t g = 0; g < group; g += ATTN_HEADS) {                                     \
                const int64_t at = (row * heads + kh * group + g) * d;                            \
                const int64_t h = group - g < ATTN_HEADS ? group - g : ATTN_HEADS;                \
                attn_dispatch_##SUFFIX(q + at, kbase, vbase, slot, lens[i], h, d, scale, qf, scores,\
                                       out + at);                                                 \
            }                                                                                     \
        }                                                                                         \
        free(qf);                                                                                 \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* out [rows][inter] = silu(gate) * up, with x [rows][2 * inter] = gate | up. */                  \
void silu_mul_##SUFFIX(const T *x, T *out, int64_t rows, int64_t inter) {                         \
    const int64_t work = rows * inter;                                                            \
    PARALLEL_FOR                                                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                          \
        const T *gate = x + r * 2 * inter, *up = gate + inter;                                    \
        T *o = out + r * inter;                                                                   \
        for (int64_t j = 0; j < inter; j++) {                                                     \
            float g = LOAD(gate + j);                                                             \
            STORE(o + j, (g / (1.0f + exp_f32(-g))) * LOAD(up + j));                              \
        }                                                                                         \
    }                                                                                             \
}

DEFINE_KERNELS(bf16, bf16, bf16_load, bf16_store, bf16_load8, bf16_row)
DEFINE_KERNELS(f32, float, f32_load, f32_store, f32_load8, f32_row)

/* y [n_out] = w [n_out][k] . x [k] (+ bias): a float32 Linear at one row, which streams the
 * weight from memory once. The output rows are split over the threads in contiguous
 * runs, so each thread streams one run of memory; torch's kernels read it at about half the
 * machine's bandwidth at one row (measured on a 2-core AVX2 EPYC: 8-12 against 15-21 GB/s).
 * Each output is one thread's dot product in four 8-lane FMA accumulators summed in a fixed
 * order, so the bits don't depend on the thread count. */
void linear_row_f32(const float *x, const float *w, const float *bias, float *y, int64_t n_out, int64_t k) {
    const int64_t work = n_out * k;
    PARALLEL_FOR
    for (int64_t o = 0; o < n_out; o++) {
        const float *wr = w + o * k;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t i = 0;
        for (; i + 32 <= k; i += 32) {
            a0 = v8_fma(f32_load8(wr + i), f32_load8(x + i), a0);
            a1 = v8_fma(f32_load8(wr + i + 8), f32_load8(x + i + 8), a1);
            a2 = v8_fma(f32_load8(wr + i + 16), f32_load8(x + i + 16), a2);
            a3 = v8_fma(f32_load8(wr + i + 24), f32_load8(x + i + 24), a3);
        }
        for (; i + 8 <= k; i += 8) a0 = v8_fma(f32_load8(wr + i), f32_load8(x + i), a0);
        float acc = v8_sum((a0 + a1) + (a2 + a3));
        for (; i < k; i++) acc = fmaf(wr[i], x[i], acc);
        y[o] = bias ? acc + bias[o] : acc;
    }
}

/* Per row of float32 logits x [rows][vocab]: the first index of its maximum, and
 * log(sum(exp(x))) (max + log of a 16-lane sum of exp(x - max), in a fixed order). What
 * sampling needs of a row, in two passes over it and no [rows][vocab] result; each row's
 * result is its own. The maximum goes by blocks, so only the first block holding it is
 * searched for its index. A NaN is passed over by the maximum and reaches the sum. */
#define ARGMAX_BLOCK 1024
void argmax_logsumexp_f32(const float *x, int64_t rows, int64_t vocab, int64_t *argmax, float *lse) {
    const int64_t work = rows * vocab;
    PARALLEL_FOR
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * vocab;
        float best = -INFINITY;
        int64_t block = 0;
        for (int64_t b0 = 0; b0 < vocab; b0 += ARGMAX_BLOCK) {
            const int64_t n = vocab - b0 < ARGMAX_BLOCK ? vocab - b0 : ARGMAX_BLOCK;
            float m[LANES], bm = -INFINITY;
            for (int l = 0; l < LANES; l++) m[l] = -INFINITY;
            int64_t j = 0;
            for (; j + LANES <= n; j += LANES)
                for (int l = 0; l < LANES; l++) m[l] = row[b0 + j + l] > m[l] ? row[b0 + j + l] : m[l];
            for (int l = 0; l < LANES; l++) bm = m[l] > bm ? m[l] : bm;
            for (; j < n; j++) bm = row[b0 + j] > bm ? row[b0 + j] : bm;
            if (bm > best) {
                best = bm;
                block = b0;
            }
        }
        int64_t arg = block;
        for (int64_t j = block; j < vocab; j++)
            if (row[j] == best) {
                arg = j;
                break;
            }
        float acc[LANES] = {0};
        int64_t j = 0;
        for (; j + LANES <= vocab; j += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += exp_f32(row[j + l] - best);
        for (int l = 0; j < vocab; j++, l++) acc[l] += exp_f32(row[j] - best);
        argmax[r] = arg;
        lse[r] = best + logf(lanes_sum(acc));
    }
}

int cpu_ops_abi_version(void) { return 9; }
