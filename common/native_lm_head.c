/* The language model's head in bf16 on AVX-512 BF16, built with native_kernels.c into one library:
 * logits = x · Wᵀ for a decode step's few rows, with each row's greedy choice (its largest logit
 * and the first column holding it) found while the logits are made, so a step whose rows are all
 * greedy never writes the [rows, vocab] logits nor reads them back.
 *
 * The weight [vocab][dim] is packed once (`lm_head_pack_bf16`) into blocks of 16 vocabulary
 * columns: block b is [dim / 2][16 columns][2] bf16, the pair (W[c][2i], W[c][2i + 1]) of column
 * c = 16b + lane at [i][lane]. One VDPBF16PS then adds, for one row, two products to each of 16
 * columns' float32 sums, the row's pair (x[2i], x[2i + 1]) broadcast from memory. A pass takes one
 * block for up to ROWS rows (one accumulator register each), so the block is read from memory once
 * and from the cache for the other rows; threads take runs of 64 blocks as they come free.
 *
 * A logit is its float32 sum rounded to bf16 (to nearest even), as a bf16 matrix product's output
 * is: the maximum is taken over the rounded values, the first column wins ties. A row with a NaN
 * or +inf logit gets NaN as its maximum (the caller fails it). Columns past `vocab` in the last
 * block are never written nor compared.
 *
 * `linear_bf16` runs a decoder layer's linear (`W` [n][dim], an optional bias) on the same packed
 * blocks: the bias is added to the float32 sums before the rounding, and rows are taken 256 at a
 * time so a prefill's packed rows stay in L2 while every block passes over them.
 *
 * Layouts (strides count elements): x [rows] rows `x_stride` apart, each [dim] bf16; logits
 * (optional, NULL: not written) [rows] rows `logits_stride` apart, each [vocab] bf16; best_value
 * float32 [rows] and best_index int64 [rows] (optional, NULL: not computed). Returns 0, -1 where
 * this build or the shape does not fit (no AVX-512 BF16; dim odd), -2 without memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define COLS 16 /* vocabulary columns per block: one float32 register */
#define ROWS 16 /* rows per pass through a block: one accumulator register each */
#define PREFETCH_PAIRS 32 /* how far ahead the weights are prefetched: 2 KB */
#define CHUNK_BLOCKS 64  /* blocks a thread takes at a time (1,024 columns) */
#define PANEL_ROWS 256   /* a linear's rows packed at a time */

/* the packed weight: [ceil(vocab / 16)][dim / 2][16][2] bf16, columns past vocab zero */
int lm_head_pack_bf16(const uint16_t* w, int64_t vocab, int64_t dim, uint16_t* packed) {
    if (dim % 2 != 0) return -1;
    const int64_t blocks = (vocab + COLS - 1) / COLS, pairs = dim / 2;
    for (int64_t b = 0; b < blocks; ++b) {
        uint32_t* dst = (uint32_t*)packed + b * pairs * COLS;
        for (int64_t lane = 0; lane < COLS; ++lane) {
            const int64_t c = b * COLS + lane;
            const uint32_t* row = (const uint32_t*)(w + c * dim);
            for (int64_t i = 0; i < pairs; ++i) dst[i * COLS + lane] = c < vocab ? row[i] : 0;
        }
    }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

typedef struct {
    float value;
    int64_t index;
    int bad; /* a NaN or +inf logit */
} Best;

/* 16 bf16 values as float32 */
static inline __m512 widen_bf16(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* float32 sums rounded to bf16 (nearest even), widened back to float32 */
static inline __m512 round_bf16(__m512 sums, __m256i* as_bf16) {
    *as_bf16 = (__m256i)_mm512_cvtneps_pbh(sums);
    return widen_bf16(*as_bf16);
}

/* `best` updated with the lanes `live` of a block's logits `v` (columns col0 + lane) */
static inline void keep_best(__m512 v, __mmask16 live, int64_t col0, Best* best) {
    const __mmask16 bad = _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);
    if (bad) best->bad = 1;
    const __mmask16 above = _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(best->value),
                                                    _CMP_GT_OQ);
    if (!above) return;
    const float top = _mm512_mask_reduce_max_ps(above, v);
    const __mmask16 at = _mm512_mask_cmp_ps_mask(above, v, _mm512_set1_ps(top), _CMP_EQ_OQ);
    best->value = top;
    best->index = col0 + __builtin_ctz((unsigned)at);
}

/* one block (columns col0 .. col0 + 15, the lanes `live` inside the vocabulary) for `nr`
 * (<= ROWS) rows, their pairs interleaved in xp: [pairs][nr] */
static inline __attribute__((always_inline)) void head_block(
    const uint32_t* xp, const uint32_t* block, int64_t pairs, int64_t col0, __mmask16 live,
    const uint16_t* bias, uint16_t* logits, int64_t logits_stride, Best* best, const int nr) {
    __m512 acc[ROWS];
    for (int r = 0; r < nr; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; ++i) {
        _mm_prefetch((const char*)(block + (i + PREFETCH_PAIRS) * COLS), _MM_HINT_T0);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(block + i * COLS);
        for (int r = 0; r < nr; ++r) {
            const __m512i pair = _mm512_set1_epi32((int)xp[i * nr + r]);
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)pair, w);
        }
    }
    if (bias) {
        const __m512 b = widen_bf16(_mm256_maskz_loadu_epi16(live, bias + col0));
        for (int r = 0; r < nr; ++r) acc[r] = _mm512_add_ps(acc[r], b);
    }
    for (int r = 0; r < nr; ++r) {
        __m256i as_bf16;
        const __m512 v = round_bf16(acc[r], &as_bf16);
        if (logits) _mm256_mask_storeu_epi16(logits + r * logits_stride + col0, live, as_bf16);
        if (best) keep_best(v, live, col0, &best[r]);
    }
}

/* rows per pass from `left` rows on: a fixed count, so a pass's accumulators stay in registers */
static inline int pass_rows(int64_t left) {
    return left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
}

/* every row over blocks [b0, b1): each block read from memory once, then one pass per group of
 * rows over it (xp: each pass's rows as [pairs][rows of the pass], passes one after another) */
static void head_range(const uint32_t* xp, int64_t rows, const uint32_t* packed, int64_t vocab,
                       int64_t pairs, int64_t b0, int64_t b1, const uint16_t* bias,
                       uint16_t* logits, int64_t logits_stride, Best* best) {
    for (int64_t b = b0; b < b1; ++b) {
        const uint32_t* block = packed + b * pairs * COLS;
        const int64_t col0 = b * COLS;
        const __mmask16 live =
            vocab - col0 >= COLS ? (__mmask16)0xFFFF : (__mmask16)((1u << (vocab - col0)) - 1u);
        for (int64_t r = 0; r < rows;) {
            const int nr = pass_rows(rows - r);
            const uint32_t* xr = xp + r * pairs;
            uint16_t* lr = logits ? logits + r * logits_stride : NULL;
            Best* br = best ? best + r : NULL;
#define PASS(N) head_block(xr, block, pairs, col0, live, bias, lr, logits_stride, br, N)
            switch (nr) {
                case 16: PASS(16); break;
                case 8: PASS(8); break;
                case 4: PASS(4); break;
                case 2: PASS(2); break;
                default: PASS(1); break;
            }
#undef PASS
            r += nr;
        }
    }
}

/* each pass's rows with their pairs interleaved ([pairs][rows of the pass], passes one after
 * another): a step over the pairs reads one cache line of x for every row of the pass */
static void pack_rows(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t pairs,
                      uint32_t* xp) {
    for (int64_t r = 0; r < rows;) {
        const int nr = pass_rows(rows - r);
        for (int64_t k = 0; k < nr; ++k) {
            const uint32_t* row = (const uint32_t*)(x + (r + k) * x_stride);
            for (int64_t i = 0; i < pairs; ++i) xp[r * pairs + i * nr + k] = row[i];
        }
        r += nr;
    }
}

int lm_head_bf16(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* packed,
                 int64_t vocab, int64_t dim, uint16_t* logits, int64_t logits_stride,
                 float* best_value, int64_t* best_index, int threads) {
    if (dim % 2 != 0 || rows < 0 || vocab <= 0) return -1;
    if (rows == 0) return 0;
    const int64_t blocks = (vocab + COLS - 1) / COLS, pairs = dim / 2;
    /* blocks handed out CHUNK_BLOCKS at a time: a thread whose core is busy with another
     * process takes fewer, instead of the step waiting for its fixed half */
    const int64_t chunks = (blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
    if (threads < 1) threads = 1;
    if (threads > chunks) threads = (int)chunks; /* a thread without a chunk would idle */
    uint32_t* xp = malloc(sizeof(uint32_t) * (size_t)(rows * pairs));
    Best* partial = best_value ? malloc(sizeof(Best) * (size_t)(threads * rows)) : NULL;
    if (!xp || (best_value && !partial)) {
        free(xp);
        free(partial);
        return -2;
    }
    pack_rows(x, x_stride, rows, pairs, xp);
    for (int64_t k = 0; partial && k < threads * rows; ++k) partial[k] = (Best){-INFINITY, -1, 0};
#pragma omp parallel num_threads(threads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t b0 = c * CHUNK_BLOCKS;
            const int64_t b1 = b0 + CHUNK_BLOCKS < blocks ? b0 + CHUNK_BLOCKS : blocks;
            head_range(xp, rows, (const uint32_t*)packed, vocab, pairs, b0, b1, NULL, logits,
                       logits_stride, partial ? partial + t * rows : NULL);
        }
    }
    if (best_value) {
        for (int64_t r = 0; r < rows; ++r) {
            /* a thread takes its chunks in rising order, so its own ties keep the earlier
             * column; between threads the lower column wins a tie */
            Best out = partial[r];
            for (int t = 1; t < threads; ++t) {
                const Best* p = &partial[t * rows + r];
                out.bad |= p->bad;
                if (p->index >= 0 &&
                    (out.index < 0 || p->value > out.value ||
                     (p->value == out.value && p->index < out.index))) {
                    out.value = p->value;
                    out.index = p->index;
                }
            }
            /* every logit -inf: the maximum is -inf at the first column */
            best_value[r] = out.bad ? NAN : out.index < 0 ? -INFINITY : out.value;
            best_index[r] = out.index < 0 ? 0 : out.index;
        }
        free(partial);
    }
    free(xp);
    return 0;
}

/* out = x · Wᵀ (+ bias) for a decoder layer's linear, W packed as the head's: bf16 rounding of
 * the float32 sums (bias added first, as oneDNN's bf16 linear does). Rows go PANEL_ROWS at a
 * time, so the packed panel stays in L2 while every column block passes over it. */
int linear_bf16(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* packed,
                int64_t n, int64_t dim, const uint16_t* bias, uint16_t* out, int64_t out_stride,
                int threads) {
    if (dim % 2 != 0 || rows < 0 || n <= 0) return -1;
    if (rows == 0) return 0;
    const int64_t blocks = (n + COLS - 1) / COLS, pairs = dim / 2;
    if (threads < 1) threads = 1;
    /* about eight runs of blocks per thread, to even out cores shared with other processes */
    int64_t run = blocks / (8 * (int64_t)threads);
    run = run < 1 ? 1 : run > CHUNK_BLOCKS ? CHUNK_BLOCKS : run;
    const int64_t chunks = (blocks + run - 1) / run;
    if (threads > chunks) threads = (int)chunks;
    const int64_t panel = rows < PANEL_ROWS ? rows : PANEL_ROWS;
    uint32_t* xp = malloc(sizeof(uint32_t) * (size_t)(panel * pairs));
    if (!xp) return -2;
    for (int64_t p0 = 0; p0 < rows; p0 += panel) {
        const int64_t np = rows - p0 < panel ? rows - p0 : panel;
        pack_rows(x + p0 * x_stride, x_stride, np, pairs, xp);
        uint16_t* o = out + p0 * out_stride;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t b0 = c * run, b1 = b0 + run < blocks ? b0 + run : blocks;
            head_range(xp, np, (const uint32_t*)packed, n, pairs, b0, b1, bias, o, out_stride,
                       NULL);
        }
    }
    free(xp);
    return 0;
}

#else

int linear_bf16(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* packed,
                int64_t n, int64_t dim, const uint16_t* bias, uint16_t* out, int64_t out_stride,
                int threads) {
    (void)x; (void)x_stride; (void)rows; (void)packed; (void)n; (void)dim; (void)bias; (void)out;
    (void)out_stride; (void)threads;
    return -1;
}

int lm_head_bf16(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* packed,
                 int64_t vocab, int64_t dim, uint16_t* logits, int64_t logits_stride,
                 float* best_value, int64_t* best_index, int threads) {
    (void)x; (void)x_stride; (void)rows; (void)packed; (void)vocab; (void)dim; (void)logits;
    (void)logits_stride; (void)best_value; (void)best_index; (void)threads;
    return -1;
}

#endif
