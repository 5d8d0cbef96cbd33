/* A bfloat16 Linear on Intel AMX (TDPBF16PS), batch-invariant by construction.
 *
 * oneDNN's bfloat16 kernels give a row other bits at one row than among many (see
 * linear.py), so the engine had to run them with the reduction split into K-chunks,
 * which doubled the calls. Here every output tile of 16 rows x 16 outputs is one
 * thread's chain of TDPBF16PS over K in blocks of 32, each row of a tile on its own, so
 * a row's result is the same whatever the number of rows, its place among them, or the
 * thread count (the load-time probe in linear.py checks that on the machine it runs on).
 * Measured on a 2-core Sapphire Rapids VM over SmolLM2-135M's 121 matmuls: 2.1-2.7x
 * faster than oneDNN's batch-invariant form from 1 to 512 rows.
 *
 * The weight is packed once, [N/16][K/32][16 pairs][16 outputs][2]: each 1 KiB block is a
 * B tile. Needs N % 16 == 0 and K % 32 == 0; linear.py keeps other shapes on oneDNN.
 * Built only where the compiler targets AMX-BF16 (-march=native on such a CPU); the
 * process must also be granted the tile state (arch_prctl), which linear_amx_bf16_init()
 * asks for once. Without either, linear_amx_bf16_init() returns 0 (and a build without
 * AMX defines neither of the other two functions).
 */
#include <stdint.h>
#include <string.h>

#if defined(__linux__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_WORK_MIN 16384 /* multiply-adds from which a call is split over threads */

typedef uint16_t bf16;
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int cpu_ops_threads(void); /* cpu_ops.c: the thread count cpu_ops_set_threads() set */

int linear_amx_bf16_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

void linear_amx_bf16_pack(const bf16 *w, bf16 *packed, int64_t n, int64_t k) {
    const int64_t kblocks = k / 32;
    for (int64_t nt = 0; nt < n / 16; nt++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            bf16 *dst = packed + (nt * kblocks + kb) * 512;
            for (int q = 0; q < 16; q++)
                for (int j = 0; j < 16; j++) {
                    const bf16 *src = w + (nt * 16 + j) * k + kb * 32 + 2 * q;
                    dst[q * 32 + j * 2] = src[0];
                    dst[q * 32 + j * 2 + 1] = src[1];
                }
        }
}

/* Tiles: 0 and 1 accumulate (rows x 16 float), 4 holds x (rows x 32 bf16), 6 and 7 weights. */
static void configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)rows;
    _tile_loadconfig(&c);
}

static inline void store_row(const float *acc, const float *bias, bf16 *y) {
    __m512 v = _mm512_loadu_ps(acc);
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(v)); /* round to nearest even */
}

/* y [m][n] = x [m][k] . w^T (+ bias, float32), w packed by linear_amx_bf16_pack. */
void linear_amx_bf16(const bf16 *x, const bf16 *packed, const float *bias, bf16 *y, int64_t m, int64_t n,
                     int64_t k) {
    const int64_t tiles = n / 16, kblocks = k / 32, pairs = (tiles + 1) / 2;
#pragma omp parallel num_threads(cpu_ops_threads()) if (m * n * k >= TILE_WORK_MIN)
    {
        int configured_rows = 0;
        float acc[2][16][16];
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < pairs; pair++) {
            const int64_t nt = pair * 2;
            const int two = nt + 1 < tiles;
            const bf16 *w0 = packed + nt * kblocks * 512, *w1 = w0 + kblocks * 512;
            for (int64_t r0 = 0; r0 < m; r0 += 16) {
                const int rows = (int)(m - r0 < 16 ? m - r0 : 16);
                if (rows != configured_rows) {
                    configure(rows);
                    configured_rows = rows;
                }
                const bf16 *a = x + r0 * k;
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t kb = 0; kb < kblocks; kb++) {
                    _tile_loadd(4, a + kb * 32, k * 2);
                    _tile_loadd(6, w0 + kb * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, w1 + kb * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                }
                _tile_stored(0, acc[0], 64);
                if (two) _tile_stored(1, acc[1], 64);
                for (int r = 0; r < rows; r++) {
                    bf16 *out = y + (r0 + r) * n + nt * 16;
                    store_row(acc[0][r], bias ? bias + nt * 16 : NULL, out);
                    if (two) store_row(acc[1][r], bias ? bias + nt * 16 + 16 : NULL, out + 16);
                }
            }
        }
        if (configured_rows) _tile_release();
    }
}

#else

int linear_amx_bf16_init(void) { return 0; }

#endif
