/* What the GGUF Q4_1 kernels (linear_q4.c, linear_q4_avx2.c) read of a block: 20 bytes,
 * half d, half m, then 16 bytes of 4-bit codes, element j in the low nibble of byte j and
 * element j + 16 in the high one. */
#ifndef GGUF_BLOCKS_H
#define GGUF_BLOCKS_H
#include <stdint.h>

static inline unsigned gguf_code(const uint8_t *block, int e) { /* element e of a GGUF Q4_1 block */
    const uint8_t byte = block[4 + (e & 15)];
    return e < 16 ? byte & 15u : byte >> 4;
}

#endif
