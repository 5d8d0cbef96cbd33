/* Every decoder layer of a bfloat16 step in one call: the layer loop of runner.py's fused
 * forward (norm, qkv Linear, rotary embedding and KV write, paged attention, o Linear,
 * norm, gate/up Linear, SiLU product, down Linear), calling the same kernels in the same
 * order on the same data, so the result has the same bits as that loop. From Python the
 * loop cost ~120 ctypes calls, their tensors and the GIL's hand-overs a step; here it is
 * one call, which releases the GIL for the whole of it.
 *
 * The Linears are one of the packed kernels the library was built with (linear_amx.c or
 * linear_avx512bf16.c on bfloat16 weights, linear_q4.c on GGUF Q4_1 blocks), passed in as
 * a function pointer since a build without the instructions does not define them. Per-layer pointers come in arrays of `layers`; the
 * step's buffers are the caller's (see runner.py).
 */
#include <stddef.h>
#include <stdint.h>

typedef uint16_t bf16;
typedef void (*linear_bf16_fn)(const bf16 *x, const bf16 *packed, const float *bias, bf16 *y, int64_t m,
                               int64_t n, int64_t k);

void add_rms_norm_bf16(bf16 *h, const bf16 *delta, bf16 *out, const float *weight, int64_t rows, int64_t dim,
                       float eps);
void rope_store_kv_bf16(const bf16 *qkv, int64_t rows, const int64_t *positions, const float *cos,
                        const float *sin_signed, int64_t heads, int64_t kv_heads, int64_t d, bf16 *q_out,
                        bf16 *cache, const int64_t *slots, int64_t num_slots);
void paged_attention_bf16(const bf16 *q, const bf16 *cache, bf16 *out, const int64_t *rows, const int64_t *ctx,
                          const int64_t *lens, const int64_t *ctx_slots, int64_t ctx_width, int64_t n,
                          int64_t heads, int64_t kv_heads, int64_t d, int64_t num_slots, float scale);
void silu_mul_bf16(const bf16 *x, bf16 *out, int64_t rows, int64_t inter);

/* The model: shapes, and per layer its norms (float32 weights and eps), packed weights,
 * float32 biases (NULL where none) and KV pool [2][kv_heads][num_slots][d]. */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, num_slots;
    float scale;
    linear_bf16_fn linear;
    const float *const *norm_in, *const *norm_post;
    const float *eps_in, *eps_post;
    const bf16 *const *qkv, *const *o, *const *gate_up, *const *down;
    const float *const *qkv_bias, *const *o_bias, *const *down_bias;
    bf16 *const *kv;
} decoder_model;

/* One step: t token rows, their positions and KV slots, the rotary tables, the queries'
 * attention (decode rows, and short prefill chunks, each as paged_attention takes them;
 * n = 0 for none), and the scratch buffers: x [t][hidden], q and attn [t][heads][d],
 * qkv [t][(heads + 2 kv_heads) d], o and down [t][hidden], gate_up [t][2 inter],
 * act [t][inter]. h [t][hidden] is the residual stream, updated in place. */
typedef struct {
    int64_t t;
    bf16 *h, *x, *q, *attn, *qkv, *o, *gate_up, *act, *down;
    const int64_t *positions, *slots;
    const float *cos, *sin_signed;
    int64_t decode_n, decode_width;
    const int64_t *decode_rows, *decode_lens, *decode_ctx;
    int64_t prefill_n, prefill_width;
    const int64_t *prefill_rows, *prefill_seq, *prefill_lens, *prefill_slots;
} decoder_step;

void decoder_layers_bf16(const decoder_model *m, const decoder_step *s) {
    const int64_t t = s->t, hidden = m->hidden, heads = m->heads, kv = m->kv_heads, d = m->head_dim;
    const int64_t qkv_n = (heads + 2 * kv) * d;
    const bf16 *delta = NULL;
    for (int64_t i = 0; i < m->layers; i++) {
        add_rms_norm_bf16(s->h, delta, s->x, m->norm_in[i], t, hidden, m->eps_in[i]);
        m->linear(s->x, m->qkv[i], m->qkv_bias[i], s->qkv, t, qkv_n, hidden);
        rope_store_kv_bf16(s->qkv, t, s->positions, s->cos, s->sin_signed, heads, kv, d, s->q, m->kv[i], s->slots,
                           m->num_slots);
        if (s->decode_n)
            paged_attention_bf16(s->q, m->kv[i], s->attn, s->decode_rows, NULL, s->decode_lens, s->decode_ctx,
                                 s->decode_width, s->decode_n, heads, kv, d, m->num_slots, m->scale);
        if (s->prefill_n)
            paged_attention_bf16(s->q, m->kv[i], s->attn, s->prefill_rows, s->prefill_seq, s->prefill_lens,
                                 s->prefill_slots, s->prefill_width, s->prefill_n, heads, kv, d, m->num_slots,
                                 m->scale);
        m->linear(s->attn, m->o[i], m->o_bias[i], s->o, t, hidden, heads * d);
        add_rms_norm_bf16(s->h, s->o, s->x, m->norm_post[i], t, hidden, m->eps_post[i]);
        m->linear(s->x, m->gate_up[i], NULL, s->gate_up, t, 2 * m->inter, hidden);
        silu_mul_bf16(s->gate_up, s->act, t, m->inter);
        m->linear(s->act, m->down[i], m->down_bias[i], s->down, t, hidden, m->inter);
        delta = s->down;
    }
    if (m->layers)
        add_rms_norm_bf16(s->h, delta, NULL, m->norm_post[m->layers - 1], t, hidden, m->eps_post[m->layers - 1]);
}
