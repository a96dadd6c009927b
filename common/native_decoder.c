/* The decoder layers of a Qwen2-style text model (Qwen2.5-VL's: RMSNorm, GQA attention with a
 * q/k/v bias and rotate-half RoPE, SwiGLU) for one engine step, in bf16, in one call: built with
 * native_kernels.c into one library, on the kernels it holds.
 *
 * A small model's decode step on a CPU is dispatch more than arithmetic: in torch each layer is a
 * dozen operators, each a Python call, a dispatcher walk and an allocation, while the demo
 * checkpoint's layer at 16 rows is ~1 MFLOP. Here one call runs every layer of the step, the
 * interpreter released, with one scratch allocation. Per layer, the same steps as the torch path
 * (services/language/model/layers.py), with the same roundings to bf16 at the same points:
 *   normed = rms_norm(h); qkv = normed · Wqkvᵀ + b; q = rope(q), k = rope(k) and k, v written
 *   into the KV pool at the step's slots; attention (decode rows: `decode_attention_bf16` over
 *   their keys in the pool; each prefill chunk: `prefill_attention_bf16`, its keys in place when
 *   they are one run of slots, else gathered); h += attn · Woᵀ; normed = rms_norm(h);
 *   h += down(silu(gate) * up).
 * The linears run on `linear_bf16` (native_lm_head.c's packed blocks: the weights packed once).
 *
 * Row layout (ForwardBatch's): the `num_decode` decode tokens first, one query each, request i's
 * keys decode_slots[decode_offsets[i] .. decode_offsets[i + 1]); then the prefill chunks, chunk e
 * at rows extend_q_start[e] .. + extend_q_len[e], its keys extend_kv_slots[extend_kv_offsets[e]
 * .. extend_kv_offsets[e + 1]) with its own keys last. h [tokens][hidden] is updated in place.
 * Returns 0, -1 where this build or a shape does not fit a kernel, -2 without memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

/* native_kernels.c, native_prefill_attention.c, native_lm_head.c */
void rms_norm_bf16(const bf16* x, int64_t x_stride, const bf16* weight, bf16* out, int64_t rows,
                   int64_t dim, float eps, int threads);
void rope_store_bf16(const bf16* q, int64_t q_stride, const bf16* k, int64_t k_stride,
                     const bf16* v, int64_t v_stride, const bf16* cos, const bf16* sin,
                     const int64_t* slots, bf16* q_out, bf16* k_cache, bf16* v_cache,
                     int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int threads);
int decode_attention_bf16(const bf16* q, int64_t q_stride, const bf16* k_cache,
                          const bf16* v_cache, const int64_t* slots, const int64_t* offsets,
                          bf16* out, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t max_len, float scale, int threads);
int prefill_attention_bf16(const bf16* q, int64_t q_stride, const bf16* k, int64_t k_stride,
                           const bf16* v, int64_t v_stride, bf16* out, int64_t out_stride,
                           int64_t q_len, int64_t kv_len, int64_t heads, int64_t kv_heads,
                           int64_t dim, float scale, int threads);
int linear_bf16(const bf16* x, int64_t x_stride, int64_t rows, const bf16* packed, int64_t n,
                int64_t dim, const bf16* bias, bf16* out, int64_t out_stride, int threads);
void silu_mul_bf16(const bf16* gate_up, int64_t gu_stride, bf16* out, int64_t rows,
                   int64_t inter, int threads);
void add_bf16(bf16* h, const bf16* x, int64_t rows, int64_t dim, int threads);

/* one layer's weights (linears packed by lm_head_pack_bf16) and its KV pool pages */
typedef struct {
    const bf16* input_norm;  /* [hidden] */
    const bf16* qkv;         /* hidden -> heads * dim + 2 * kv_heads * dim */
    const bf16* qkv_bias;    /* [heads * dim + 2 * kv_heads * dim], or NULL */
    const bf16* o;           /* heads * dim -> hidden */
    const bf16* post_norm;   /* [hidden] */
    const bf16* gate_up;     /* hidden -> 2 * intermediate (the gate's rows, then the up's) */
    const bf16* down;        /* intermediate -> hidden */
    bf16* k_cache;           /* [slots][kv_heads][dim] */
    bf16* v_cache;
} DecoderLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    int64_t tokens;
    const bf16* cos; /* [tokens][head_dim] */
    const bf16* sin;
    const int64_t* out_slots; /* [tokens]: where each token's K/V is written */
    int64_t num_decode, decode_max_len;
    const int64_t* decode_slots;
    const int64_t* decode_offsets; /* [num_decode + 1] */
    int64_t num_extends;
    const int64_t* extend_q_start; /* [num_extends] */
    const int64_t* extend_q_len;
    const int64_t* extend_kv_offsets; /* [num_extends + 1] */
    const int64_t* extend_kv_slots;
    int threads;
} DecoderStep;

/* Threads per kernel, chosen for each one: waking a sleeping OpenMP thread (the serving
 * processes set OMP_WAIT_POLICY=PASSIVE) costs more than a small kernel's work. Below
 * PARALLEL_MIN_VALUES values an element-wise pass runs on the calling thread (native_kernels.py's
 * figure), below LINEAR_MIN_FLOPS a linear (a [16, 256] x [256, 512] bf16 product: 27 us on one
 * thread, ~100 on two passive ones), below ATTENTION_MIN_FLOPS decode attention (its scores and
 * weighted values: 4 FLOPs per cached key, query head and head dimension; 4,096 keys of the demo
 * checkpoint's 4 heads of 64, ~80 us on one thread; 16 rows of 140 keys at Qwen2.5-VL-3B's 16 heads
 * of 128 are 18 MFLOP, 0.4 ms on one thread, 0.2 on two). */
#define PARALLEL_MIN_VALUES (1 << 15)
#define LINEAR_MIN_FLOPS 50e6
#define ATTENTION_MIN_FLOPS 4e6

static inline int linear_threads(int64_t rows, int64_t n, int64_t dim, int threads) {
    return 2.0 * (double)rows * (double)n * (double)dim < LINEAR_MIN_FLOPS ? 1 : threads;
}

/* whether `len` slots are first, first + 1, ...: their rows are then a slice of the pool */
static int is_run(const int64_t* slots, int64_t len) {
    for (int64_t j = 1; j < len; ++j)
        if (slots[j] != slots[0] + j) return 0;
    return len > 0;
}

/* the prefill chunks' attention of one layer: q and out rows `qs` apart */
static int extends_attention(const DecoderStep* s, const DecoderLayer* l, const bf16* q,
                             bf16* out, int64_t qs, const char* runs, bf16* kbuf, bf16* vbuf) {
    const int64_t kv = s->kv_heads * s->head_dim;
    for (int64_t e = 0; e < s->num_extends; ++e) {
        const int64_t* slots = s->extend_kv_slots + s->extend_kv_offsets[e];
        const int64_t len = s->extend_kv_offsets[e + 1] - s->extend_kv_offsets[e];
        const int64_t first = len ? slots[0] : 0;
        const bf16 *k = l->k_cache + first * kv, *v = l->v_cache + first * kv;
        if (!runs[e]) {
            for (int64_t j = 0; j < len; ++j) {
                memcpy(kbuf + j * kv, l->k_cache + slots[j] * kv, sizeof(bf16) * (size_t)kv);
                memcpy(vbuf + j * kv, l->v_cache + slots[j] * kv, sizeof(bf16) * (size_t)kv);
            }
            k = kbuf;
            v = vbuf;
        }
        const int64_t q0 = s->extend_q_start[e];
        const int rc = prefill_attention_bf16(q + q0 * qs, qs, k, kv, v, kv, out + q0 * qs, qs,
                                              s->extend_q_len[e], len, s->heads, s->kv_heads,
                                              s->head_dim, s->scale, s->threads);
        if (rc) return rc;
    }
    return 0;
}

int decoder_layers_bf16(bf16* h, const DecoderLayer* layers, int64_t num_layers,
                        const DecoderStep* s) {
    const int64_t t = s->tokens, hid = s->hidden, dim = s->head_dim, inter = s->intermediate;
    const int64_t qn = s->heads * dim, kvn = s->kv_heads * dim, qkvn = qn + 2 * kvn;
    const int th = s->threads, el = t * hid < PARALLEL_MIN_VALUES ? 1 : s->threads;
    if (t <= 0) return 0;
    int64_t gather = 0; /* the longest chunk whose keys are not one run */
    char* runs = malloc((size_t)(s->num_extends > 0 ? s->num_extends : 1));
    if (!runs) return -2;
    for (int64_t e = 0; e < s->num_extends; ++e) {
        const int64_t len = s->extend_kv_offsets[e + 1] - s->extend_kv_offsets[e];
        runs[e] = (char)is_run(s->extend_kv_slots + s->extend_kv_offsets[e], len);
        if (!runs[e] && len > gather) gather = len;
    }
    const int64_t widest = qkvn > 2 * inter ? qkvn : 2 * inter; /* qkv, then gate_up */
    const size_t values = (size_t)(t * (hid + widest + 2 * qn + inter) + 2 * gather * kvn);
    bf16* scratch = malloc(sizeof(bf16) * values);
    if (!scratch) {
        free(runs);
        return -2;
    }
    bf16 *normed = scratch, *wide = normed + t * hid, *q = wide + t * widest, *attn = q + t * qn;
    bf16 *act = attn + t * qn, *kbuf = act + t * inter, *vbuf = kbuf + gather * kvn;
    bf16* out = normed; /* a linear's output back to hidden: normed is free by then */
    const int lin_qkv = linear_threads(t, qkvn, hid, th), lin_o = linear_threads(t, hid, qn, th);
    const int lin_gu = linear_threads(t, 2 * inter, hid, th);
    const int lin_down = linear_threads(t, hid, inter, th);
    const int64_t decode_keys = s->num_decode ? s->decode_offsets[s->num_decode] : 0;
    const double att_flops = 4.0 * (double)decode_keys * (double)(s->heads * dim);
    const int att = att_flops < ATTENTION_MIN_FLOPS ? 1 : th;
    int rc = 0;
    for (int64_t i = 0; i < num_layers && !rc; ++i) {
        const DecoderLayer* l = &layers[i];
        rms_norm_bf16(h, hid, l->input_norm, normed, t, hid, s->eps, el);
        rc = linear_bf16(normed, hid, t, l->qkv, qkvn, hid, l->qkv_bias, wide, qkvn, lin_qkv);
        if (rc) break;
        rope_store_bf16(wide, qkvn, wide + qn, qkvn, wide + qn + kvn, qkvn, s->cos, s->sin,
                        s->out_slots, q, l->k_cache, l->v_cache, t, s->heads, s->kv_heads, dim,
                        t * qkvn < PARALLEL_MIN_VALUES ? 1 : th);
        if (s->num_decode) {
            rc = decode_attention_bf16(q, qn, l->k_cache, l->v_cache, s->decode_slots,
                                       s->decode_offsets, attn, s->num_decode, s->heads,
                                       s->kv_heads, dim, s->decode_max_len, s->scale, att);
            if (rc) break;
        }
        rc = extends_attention(s, l, q, attn, qn, runs, kbuf, vbuf);
        if (rc) break;
        rc = linear_bf16(attn, qn, t, l->o, hid, qn, NULL, out, hid, lin_o);
        if (rc) break;
        add_bf16(h, out, t, hid, el);
        rms_norm_bf16(h, hid, l->post_norm, normed, t, hid, s->eps, el);
        rc = linear_bf16(normed, hid, t, l->gate_up, 2 * inter, hid, NULL, wide, 2 * inter, lin_gu);
        if (rc) break;
        silu_mul_bf16(wide, 2 * inter, act, t, inter, t * inter < PARALLEL_MIN_VALUES ? 1 : th);
        rc = linear_bf16(act, inter, t, l->down, hid, inter, NULL, out, hid, lin_down);
        if (rc) break;
        add_bf16(h, out, t, hid, el);
    }
    free(scratch);
    free(runs);
    return rc;
}
