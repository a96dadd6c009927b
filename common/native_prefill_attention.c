/* Attention in bf16 on AVX-512 BF16, built with native_kernels.c into one library: the language
 * model's causal prefill (`prefill_attention_bf16`) and the vision tower's attention within each
 * image or window (`self_attention_bf16`, pieces cut by `cu_seqlens`, causal or not).
 *
 * A prefill chunk of `q_len` query tokens attends to `kv_len` keys: the `kv_len - q_len` cached
 * ones, then its own. Query token t sees keys 0 .. kv_len - q_len + t (no mask is built or read);
 * without `causal`, every key of its piece. The query heads that share a KV head (the GQA group)
 * are worked on together, so each key and value is read once per KV head, not once per query head.
 *
 * Flash-attention's scheme: each work item takes one KV head and up to ROWS_MAX query rows
 * (token, head of the group) of one sequence and walks its keys in blocks of 32, keeping per row
 * a running maximum, the running sum of exponentials and an unnormalized output in float32. Both
 * products run on VDPBF16PS, two bf16 products summed into a float32 lane per instruction:
 * - scores: the keys of a block laid out as [dim / 2][32 keys] pairs of bf16 (packed once per call),
 *   a query's pair (q[2i], q[2i + 1]) broadcast: 32 scores per two instructions per pair.
 * - values: the block's probabilities rounded to bf16 (as torch's CPU flash kernel rounds them
 *   before its bf16 matrix product), two keys' values interleaved as [16 key pairs][dim] pairs,
 *   a pair of probabilities broadcast: 16 output lanes per instruction.
 * Scores are float32 sums of exact bf16 products, scaled by `scale * log2(e)` and exponentiated as
 * powers of two (a degree-5 polynomial, within 1e-7 relative). A row's running maximum moves only
 * when a score passes it by more than 8 (log2 units: a term is then at most 2^8, far inside
 * float32's and bf16's range), so most blocks take no reduction and no rescale; the running sum,
 * of the weights as rounded to bf16, stays per lane until the end. The output is divided by the
 * sum and rounded to bf16 to nearest even.
 *
 * Layouts (strides count elements): q [tokens] rows `q_stride` apart, each [heads][dim]; k and v
 * [keys] rows `k_stride` / `v_stride` apart, each [kv_heads][dim]; out like q, `out_stride`.
 * Returns 0, -1 where this build or the shape does not fit (no AVX-512 BF16; dim not a multiple
 * of 16 or above 256; heads not a multiple of kv_heads or more than 32 per KV head; fewer keys
 * than queries), -2 without memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define BLOCK 32      /* keys per block */
#define ROWS_MAX 32   /* query rows per work item (a group's heads times its tokens) */
#define ROWS_AT 4     /* rows per pass through a key block */
#define DIM_MAX 256
#define LAZY 8.0f     /* how far (log2) a score may pass the running maximum before it moves */

/* 2^x for x <= LAZY (clamped at -126: the result is then ~1e-38, and masked lanes are zeroed by
 * the caller): 2^round(x) * 2^f, f in [-0.5, 0.5], 2^f by a degree-5 minimax polynomial (relative
 * error under 1e-7) */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3276471291e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6755409613e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507130921e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120237e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694405e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192e+0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* lanes 0 .. 15 of a 16-key half whose visible keys are lanes <= lim */
static inline __mmask16 visible(int64_t lim) {
    if (lim >= 15) return 0xFFFF;
    if (lim < 0) return 0;
    return (__mmask16)((1u << (lim + 1)) - 1u);
}

/* keys [j0, j0 + 32) of KV head h as [dim / 2][32] bf16 pairs; keys past kv_len are zero */
static void pack_keys(const uint16_t* k, int64_t k_stride, int64_t kv_len, int64_t h,
                      int64_t dim, int64_t j0, uint32_t* dst) {
    const int64_t pairs = dim / 2;
    for (int64_t lane = 0; lane < BLOCK; ++lane) {
        const int64_t j = j0 + lane;
        if (j < kv_len) {
            const uint32_t* row = (const uint32_t*)(k + j * k_stride + h * dim);
            for (int64_t i = 0; i < pairs; ++i) dst[i * BLOCK + lane] = row[i];
        } else {
            for (int64_t i = 0; i < pairs; ++i) dst[i * BLOCK + lane] = 0;
        }
    }
}

/* values of keys [j0, j0 + 32) of KV head h as [16 key pairs][dim] pairs (key 2p low, 2p + 1
 * high); keys past kv_len are zero */
static void pack_values(const uint16_t* v, int64_t v_stride, int64_t kv_len, int64_t h,
                        int64_t dim, int64_t j0, uint32_t* dst) {
    for (int64_t p = 0; p < BLOCK / 2; ++p) {
        const int64_t j = j0 + 2 * p;
        const uint16_t* lo = j < kv_len ? v + j * v_stride + h * dim : NULL;
        const uint16_t* hi = j + 1 < kv_len ? v + (j + 1) * v_stride + h * dim : NULL;
        for (int64_t d = 0; d < dim; ++d) {
            const uint32_t a = lo ? lo[d] : 0, b = hi ? hi[d] : 0;
            dst[p * dim + d] = a | (b << 16);
        }
    }
}

/* scores[r][0 .. 32) = scaled q_r . k_j for ROWS_AT rows (row pointers may repeat) */
static inline void block_scores(const uint32_t* const* qrows, const uint32_t* kp, int64_t pairs,
                                __m512 scale, float* scores) {
    __m512 acc[ROWS_AT][2];
    for (int r = 0; r < ROWS_AT; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; ++i) {
        const __m512bh k0 = as_bh(_mm512_loadu_si512(kp + i * BLOCK));
        const __m512bh k1 = as_bh(_mm512_loadu_si512(kp + i * BLOCK + 16));
        for (int r = 0; r < ROWS_AT; ++r) {
            const __m512bh qw = as_bh(_mm512_set1_epi32((int)qrows[r][i]));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qw, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qw, k1);
        }
    }
    for (int r = 0; r < ROWS_AT; ++r) {
        _mm512_storeu_ps(scores + r * BLOCK, _mm512_mul_ps(acc[r][0], scale));
        _mm512_storeu_ps(scores + r * BLOCK + 16, _mm512_mul_ps(acc[r][1], scale));
    }
}

/* out[r][c0 .. c0 + NC * 16) = out * alpha[r] + sum over the block's keys of p[r][j] * v[j], for
 * ROWS_AT rows; NC 16-lane chunks of the output at a time */
#define DEFINE_BLOCK_VALUES(NC, ATTR)                                                                   \
    static ATTR void block_values_##NC(float* const* orows, const uint32_t* const* prow,      \
                                         const float* alpha, const uint32_t* vp, int64_t dim,     \
                                         int64_t c0) {                                            \
        __m512 acc[ROWS_AT][NC];                                                                  \
        for (int r = 0; r < ROWS_AT; ++r)                                                         \
            for (int c = 0; c < NC; ++c)                                                          \
                acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(orows[r] + c0 + 16 * c),               \
                                          _mm512_set1_ps(alpha[r]));                              \
        for (int64_t p = 0; p < BLOCK / 2; ++p) {                                                 \
            __m512bh vv[NC];                                                                      \
            for (int c = 0; c < NC; ++c)                                                          \
                vv[c] = as_bh(_mm512_loadu_si512(vp + p * dim + c0 + 16 * c));                    \
            for (int r = 0; r < ROWS_AT; ++r) {                                                   \
                const __m512bh pw = as_bh(_mm512_set1_epi32((int)prow[r][p]));                    \
                for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pw, vv[c]); \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < ROWS_AT; ++r)                                                         \
            for (int c = 0; c < NC; ++c) _mm512_storeu_ps(orows[r] + c0 + 16 * c, acc[r][c]);    \
    }
DEFINE_BLOCK_VALUES(4, inline)
DEFINE_BLOCK_VALUES(2, inline)
/* the last 16 lanes of a head_dim like 80: out of line, so the common widths' loop keeps its
 * registers (inlined, it made a 64-wide head's attention ~8% slower) */
DEFINE_BLOCK_VALUES(1, __attribute__((noinline)))

/* per-thread scratch of a work item */
typedef struct {
    float scores[ROWS_MAX][BLOCK];
    uint16_t probs[ROWS_MAX][BLOCK];
    float sum[ROWS_MAX][16]; /* the running sum of exponentials, per lane */
    float alpha[ROWS_MAX], max[ROWS_MAX];
    float out[ROWS_MAX][DIM_MAX];
} Scratch;

/* one work item: KV head h, query tokens [t0, t0 + num_tokens) of one sequence, every head of
 * its group; kp / vp: that head's packed blocks of the sequence's kv_len keys. Causal: query t
 * sees keys 0 .. kv_len - q_len + t; otherwise every key. */
static void attend(const uint16_t* q, int64_t q_stride, uint16_t* out, int64_t out_stride,
                   const uint32_t* kp, const uint32_t* vp, int64_t q_len, int64_t kv_len,
                   int causal, int64_t h, int64_t group, int64_t dim, int64_t t0,
                   int64_t num_tokens, float scale_log2, Scratch* s) {
    const int64_t rows = num_tokens * group, pairs = dim / 2;
    const int64_t padded = (rows + ROWS_AT - 1) / ROWS_AT * ROWS_AT;
    const int64_t offset = kv_len - q_len;
    const uint32_t* qrows[ROWS_MAX];
    const uint32_t* prows[ROWS_MAX];
    float* orows[ROWS_MAX];
    int64_t lim[ROWS_MAX]; /* the last key row r sees */
    for (int64_t r = 0; r < padded; ++r) {
        const int64_t real = r < rows ? r : 0; /* padding rows repeat row 0, results unused */
        const int64_t t = t0 + real / group, head = h * group + real % group;
        qrows[r] = (const uint32_t*)(q + t * q_stride + head * dim);
        prows[r] = (const uint32_t*)s->probs[r];
        orows[r] = s->out[r];
        lim[r] = causal ? offset + t : kv_len - 1;
        s->max[r] = -INFINITY;
        _mm512_store_ps(s->sum[r], _mm512_setzero_ps());
        memset(s->out[r], 0, (size_t)dim * sizeof(float));
    }
    const __m512 scale = _mm512_set1_ps(scale_log2);
    const int64_t first_lim = causal ? offset + t0 : kv_len - 1; /* the fewest keys a row sees */
    const int64_t last_key = causal ? offset + t0 + num_tokens - 1 : kv_len - 1;
    for (int64_t b = 0; b <= last_key / BLOCK; ++b) {
        const int64_t j0 = b * BLOCK;
        const uint32_t* kb = kp + b * pairs * BLOCK;
        const uint32_t* vb = vp + b * (BLOCK / 2) * dim;
        const int masked = j0 + BLOCK - 1 > first_lim; /* some row does not see every key */
        for (int64_t r = 0; r < padded; r += ROWS_AT)
            block_scores(qrows + r, kb, pairs, scale, s->scores[r]);
        for (int64_t r = 0; r < padded; ++r) {
            __m512 s0 = _mm512_loadu_ps(s->scores[r]), s1 = _mm512_loadu_ps(s->scores[r] + 16);
            __mmask16 m0 = 0xFFFF, m1 = 0xFFFF;
            if (masked) {
                m0 = visible(lim[r] - j0);
                m1 = visible(lim[r] - j0 - 16);
                const __m512 ninf = _mm512_set1_ps(-INFINITY);
                s0 = _mm512_mask_mov_ps(ninf, m0, s0);
                s1 = _mm512_mask_mov_ps(ninf, m1, s1);
            }
            /* the running maximum moves only when a score passes it by more than LAZY (the terms
             * are then at most 2^LAZY): most blocks neither reduce to a maximum nor rescale */
            const __m512 top = _mm512_set1_ps(s->max[r] + LAZY);
            float alpha = 1.0f;
            if (_mm512_cmp_ps_mask(s0, top, _CMP_GT_OQ) | _mm512_cmp_ps_mask(s1, top, _CMP_GT_OQ)) {
                const float new_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
                /* the old terms' share, 2^(old - new): 0 before the first block (old = -inf) */
                if (s->max[r] != -INFINITY)
                    alpha = _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(s->max[r] - new_max)));
                else
                    alpha = 0.0f;
                s->max[r] = new_max;
            }
            const __m512 mx = _mm512_set1_ps(s->max[r]);
            __m512 p0 = exp2_ps(_mm512_sub_ps(s0, mx));
            __m512 p1 = exp2_ps(_mm512_sub_ps(s1, mx));
            if (masked) {
                p0 = _mm512_maskz_mov_ps(m0, p0);
                p1 = _mm512_maskz_mov_ps(m1, p1);
            }
            s->alpha[r] = alpha;
            /* the sum is of the probabilities as they multiply the values, rounded to bf16: each
             * 32-bit lane holds two, the even one in its low half */
            const __m512i probs = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(probs, 16));
            const __m512 odd = _mm512_castsi512_ps(
                _mm512_and_si512(probs, _mm512_set1_epi32((int)0xFFFF0000u)));
            __m512 sv = _mm512_load_ps(s->sum[r]);
            sv = _mm512_fmadd_ps(sv, _mm512_set1_ps(alpha), _mm512_add_ps(even, odd));
            _mm512_store_ps(s->sum[r], sv);
            _mm512_storeu_si512(s->probs[r], probs);
        }
        for (int64_t r = 0; r < padded; r += ROWS_AT) {
            int64_t c0 = 0;
            for (; c0 + 64 <= dim; c0 += 64)
                block_values_4(orows + r, prows + r, s->alpha + r, vb, dim, c0);
            for (; c0 + 32 <= dim; c0 += 32)
                block_values_2(orows + r, prows + r, s->alpha + r, vb, dim, c0);
            for (; c0 < dim; c0 += 16)
                block_values_1(orows + r, prows + r, s->alpha + r, vb, dim, c0);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r / group, head = h * group + r % group;
        uint16_t* o = out + t * out_stride + head * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(s->sum[r])));
        for (int64_t c = 0; c < dim; c += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s->out[r] + c), inv);
            _mm256_storeu_si256((__m256i*)(o + c), (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
}

/* Sequences i = 0 .. num_seqs - 1: queries [cu_q[i], cu_q[i + 1]) attend to keys [cu_k[i],
 * cu_k[i + 1]) (at least as many). Keys and values are packed per sequence and KV head, then
 * the work items (sequence, KV head, block of query tokens) are shared among the threads. */
static int run(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
               const uint16_t* v, int64_t v_stride, uint16_t* out, int64_t out_stride,
               const int64_t* cu_q, const int64_t* cu_k, int64_t num_seqs, int64_t heads,
               int64_t kv_heads, int64_t dim, float scale, int causal, int threads) {
    if (dim % 16 || dim <= 0 || dim > DIM_MAX || kv_heads <= 0 || heads % kv_heads) return -1;
    const int64_t group = heads / kv_heads;
    if (group > ROWS_MAX) return -1;
    const int64_t tokens_per_item = ROWS_MAX / group;
    /* per sequence: its first key block and first work item (prefix sums) */
    int64_t* first_block = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    int64_t* first_item = malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (!first_block || !first_item) {
        free(first_block);
        free(first_item);
        return -2;
    }
    first_block[0] = first_item[0] = 0;
    for (int64_t i = 0; i < num_seqs; ++i) {
        const int64_t q_len = cu_q[i + 1] - cu_q[i], kv_len = cu_k[i + 1] - cu_k[i];
        if (q_len < 0 || kv_len < q_len) {
            free(first_block);
            free(first_item);
            return -1;
        }
        first_block[i + 1] = first_block[i] + (kv_len + BLOCK - 1) / BLOCK;
        first_item[i + 1] = first_item[i] + (q_len + tokens_per_item - 1) / tokens_per_item;
    }
    const int64_t num_blocks = first_block[num_seqs], num_items = first_item[num_seqs];
    const int64_t block_words = dim / 2 * BLOCK; /* the same for keys and values */
    const size_t packed = (size_t)(kv_heads * num_blocks * block_words) * sizeof(uint32_t);
    uint32_t* kp = aligned_alloc(64, (packed + 63) / 64 * 64 + 64);
    uint32_t* vp = aligned_alloc(64, (packed + 63) / 64 * 64 + 64);
    int failed = !kp || !vp;
    const float scale_log2 = scale * 1.44269504088896341f;
    if (!failed) {
        _Pragma("omp parallel num_threads(threads)") {
            /* pack: (KV head, block) items; a block's sequence found by walking forward */
            _Pragma("omp for schedule(dynamic, 4)")
            for (int64_t item = 0; item < kv_heads * num_blocks; ++item) {
                const int64_t h = item / num_blocks, b = item % num_blocks;
                int64_t i = 0;
                while (first_block[i + 1] <= b) ++i;
                const int64_t kv_len = cu_k[i + 1] - cu_k[i];
                const int64_t j0 = (b - first_block[i]) * BLOCK;
                pack_keys(k + cu_k[i] * k_stride, k_stride, kv_len, h, dim, j0,
                          kp + item * block_words);
                pack_values(v + cu_k[i] * v_stride, v_stride, kv_len, h, dim, j0,
                            vp + item * block_words);
            }
            Scratch* s = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
            if (!s) {
                _Pragma("omp atomic write") failed = 1;
            }
            /* the longest items (a causal sequence's last tokens: the most keys) first */
            _Pragma("omp for schedule(dynamic, 1)")
            for (int64_t item = 0; item < kv_heads * num_items; ++item) {
                if (!s) continue;
                const int64_t w = num_items - 1 - item / kv_heads, h = item % kv_heads;
                int64_t i = 0;
                while (first_item[i + 1] <= w) ++i;
                const int64_t q_len = cu_q[i + 1] - cu_q[i], kv_len = cu_k[i + 1] - cu_k[i];
                const int64_t t0 = (w - first_item[i]) * tokens_per_item;
                const int64_t n = q_len - t0 < tokens_per_item ? q_len - t0 : tokens_per_item;
                const int64_t blocks = h * num_blocks + first_block[i];
                attend(q + cu_q[i] * q_stride, q_stride, out + cu_q[i] * out_stride, out_stride,
                       kp + blocks * block_words, vp + blocks * block_words, q_len, kv_len,
                       causal, h, group, dim, t0, n, scale_log2, s);
            }
            free(s);
        }
    }
    free(kp);
    free(vp);
    free(first_block);
    free(first_item);
    return failed ? -2 : 0;
}

int prefill_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k,
                           int64_t k_stride, const uint16_t* v, int64_t v_stride, uint16_t* out,
                           int64_t out_stride, int64_t q_len, int64_t kv_len, int64_t heads,
                           int64_t kv_heads, int64_t dim, float scale, int threads) {
    const int64_t cu_q[2] = {0, q_len}, cu_k[2] = {0, kv_len};
    return run(q, q_stride, k, k_stride, v, v_stride, out, out_stride, cu_q, cu_k, 1, heads,
               kv_heads, dim, scale, 1, threads);
}

int self_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                        const uint16_t* v, int64_t v_stride, uint16_t* out, int64_t out_stride,
                        const int64_t* cu_seqlens, int64_t num_seqs, int64_t heads,
                        int64_t kv_heads, int64_t dim, float scale, int causal, int threads) {
    return run(q, q_stride, k, k_stride, v, v_stride, out, out_stride, cu_seqlens, cu_seqlens,
               num_seqs, heads, kv_heads, dim, scale, causal, threads);
}

#else /* no AVX-512 BF16 in this build: the callers keep SDPA */

int prefill_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k,
                           int64_t k_stride, const uint16_t* v, int64_t v_stride, uint16_t* out,
                           int64_t out_stride, int64_t q_len, int64_t kv_len, int64_t heads,
                           int64_t kv_heads, int64_t dim, float scale, int threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out;
    (void)out_stride, (void)q_len, (void)kv_len, (void)heads, (void)kv_heads, (void)dim;
    (void)scale, (void)threads;
    return -1;
}

int self_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                        const uint16_t* v, int64_t v_stride, uint16_t* out, int64_t out_stride,
                        const int64_t* cu_seqlens, int64_t num_seqs, int64_t heads,
                        int64_t kv_heads, int64_t dim, float scale, int causal, int threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out;
    (void)out_stride, (void)cu_seqlens, (void)num_seqs, (void)heads, (void)kv_heads, (void)dim;
    (void)scale, (void)causal, (void)threads;
    return -1;
}

#endif
