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
#include <float.h>
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

/* the calling thread's number in its OpenMP team (0 without OpenMP): its own slot of partials */
static inline int thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

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

/* ---- the greedy choice screened in int8 (AVX-512 VNNI) ----
 *
 * A row's largest logit is found in two passes that give the full pass's answer exactly. The
 * screen reads an int8 copy of the weight (half the bytes, and VPDPBUSD makes four products a
 * lane where VDPBF16PS makes two). Both sides are quantized in groups of 128 dimensions: column
 * c's weight in group g is w = s_g·q + e (q + 128 as uint8, s_g = max|w_g| / 127, e the
 * rounding), the row's h = t_g·p + f likewise (p int8), so h·w = Σ_g t_g·s_g·(p_g·q_g) + f·sq
 * + h·e (sq: the weight's s_g·q), the last two at most |f|·|sq| + |h|·|e| (Cauchy–Schwarz, |·|
 * the Euclidean norm over all groups). A scale per group follows the local sizes of the weight
 * and of the row: on Qwen2.5-VL-3B's widths (random weights) the blocks a row cannot rule out
 * fall from 370-480 of 9,496 with one scale per row to 95-130. With a margin for the full
 * pass's own float32 sums and bf16 rounding, each column gets an interval sure to hold its logit;
 * a column whose interval lies below another's lower end cannot be the maximum nor tie it. The
 * few left are recomputed by the full pass's own sums, so the value, the column and the tie rule
 * are the full pass's: their blocks in column order, each read from memory once for all the rows
 * that kept it, several (row, block) sums at a time. Where the screen cannot bound a row (a NaN
 * or infinite input, sums that could overflow) or keeps too many columns, the call runs the full
 * pass instead.
 *
 * The screen's weight: q + 128 [blocks][dim / 4][16 columns][4] uint8 (columns past vocab 128),
 * and per block [groups][16] float32 scales s_g, then two [16] float32 bound factors of |h| and
 * |f|. The row's quads (p int8) are the signed operand, broadcast from memory by the instruction;
 * each group's sums start at minus 128·Σp_g, which takes the weights' +128 back out. */
#define SCREEN_SLOTS 2048   /* columns a thread keeps per row before dropping the ones now below */
#define SCREEN_REFRESH 4    /* blocks between refreshes of a row's lower end */
#define SCREEN_GROUP 32     /* quads per quantization group: 128 dimensions */
#define SCREEN_MAX_SUM 1e37 /* |h|·max|w| at most this: no float32 sum can overflow */

/* quantization groups of a row of `quads` quads */
static inline int64_t screen_groups(int64_t quads) {
    return (quads + SCREEN_GROUP - 1) / SCREEN_GROUP;
}

/* floats of a block's scales and bound factors */
static inline int64_t screen_params(int64_t quads) { return (screen_groups(quads) + 2) * COLS; }

/* A column's interval is a ∓ (c1·|a| + |h|·(1 + c1)(|e| + c2·|w| + c3·(|w| + |e|))
 * + |f|·(1 + c1)(|sq| + c3·(|w| + |e|)) + tiny), a = Σ_g t_g·s_g·(p_g·q_g) as the screen sums
 * it. c1 = 2^-8 covers the bf16 rounding of the logit (at most 2^-8 of it), plus 2^-20 for the
 * float32 roundings of the interval's own arithmetic; c2·|h|·|w| the full pass's float32 sums (at
 * most dim·2^-24·Σ|h·w|: c2 = dim·2^-23 leaves a factor 2); c3 the screen's float32 sum over
 * groups (a rounding per product of scales and per group: at most (groups + 1)·2^-24·Σ_g |t_g
 * p_g|·|s_g q_g|, itself at most |tp|·|sq| <= (|h| + |f|)(|w| + |e|)); tiny the subnormals
 * VDPBF16PS flushes (FLT_MIN each, 8·dim of them). */
static inline double rel_margin(void) { return 0x1p-8 + 0x1p-20; }
static inline double sum_margin(int64_t dim) { return (double)dim * 0x1p-23; }
static inline double group_margin(int64_t groups) { return (double)(groups + 2) * 0x1p-24; }

/* bf16 bits as a float, a subnormal as zero: VDPBF16PS takes subnormal inputs as zero, so the
 * screen bounds the logits of the values the full pass multiplies */
static inline float bf16_value(uint16_t bits) {
    const uint32_t kept = (bits & 0x7F80u) ? bits : bits & 0x8000u; /* exponent 0: ±0 */
    const uint32_t wide = kept << 16;
    float v;
    memcpy(&v, &wide, sizeof v);
    return v;
}

/* the screen's weight and its scales and bound terms (params: screen_params per block) for `w`
 * [vocab][dim] (bf16); max_norm: the largest column's |w|. Returns 0, -1 for a dim not a
 * multiple of 4, -3 for a non-finite weight. */
int lm_head_screen_pack_bf16(const uint16_t* w, int64_t vocab, int64_t dim, uint8_t* q,
                             float* params, float* max_norm) {
    if (dim % 4 != 0 || dim <= 0) return -1;
    const int64_t blocks = (vocab + COLS - 1) / COLS, quads = dim / 4;
    const int64_t groups = screen_groups(quads), group_dims = SCREEN_GROUP * 4;
    const double c1 = rel_margin(), c2 = sum_margin(dim), c3 = group_margin(groups);
    double widest = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* dst = q + b * quads * COLS * 4;
        float* prm = params + b * screen_params(quads);
        for (int64_t lane = 0; lane < COLS; ++lane) {
            const int64_t c = b * COLS + lane;
            double err2 = 0.0, sq2 = 0.0, w2 = 0.0;
            for (int64_t g = 0; g < groups; ++g) {
                const int64_t d0 = g * group_dims;
                const int64_t d1 = d0 + group_dims < dim ? d0 + group_dims : dim;
                float scale = 0.0f;
                if (c < vocab) {
                    float top = 0.0f;
                    for (int64_t d = d0; d < d1; ++d) {
                        const float v = bf16_value(w[c * dim + d]);
                        if (!isfinite(v)) return -3;
                        top = fabsf(v) > top ? fabsf(v) : top;
                    }
                    scale = top / 127.0f;
                }
                for (int64_t d = d0; d < d1; ++d) {
                    const double v = c < vocab ? (double)bf16_value(w[c * dim + d]) : 0.0;
                    double k = scale > 0.0f ? nearbyint(v / scale) : 0.0;
                    k = k > 127.0 ? 127.0 : k < -127.0 ? -127.0 : k;
                    const double e = v - (double)scale * k; /* exact in double */
                    dst[(d / 4) * COLS * 4 + lane * 4 + d % 4] = (uint8_t)(k + 128.0);
                    err2 += e * e;
                    sq2 += ((double)scale * k) * ((double)scale * k);
                    w2 += v * v;
                }
                prm[g * COLS + lane] = scale;
            }
            const double e = sqrt(err2), sq = sqrt(sq2), wn = sqrt(w2);
            widest = wn > widest ? wn : widest;
            /* |h|'s factor: |e|, the full pass's float32 sums, the screen's own over groups */
            prm[groups * COLS + lane] = (float)((1.0 + c1) * (e + c2 * wn + c3 * (wn + e)));
            /* |f|'s factor: |sq|, the screen's sums over groups */
            prm[(groups + 1) * COLS + lane] = (float)((1.0 + c1) * (sq + c3 * (wn + e)));
        }
    }
    *max_norm = (float)(widest * (1.0 + 0x1p-20));
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

/* PASS(N) for a pass of nr = pass_rows(...) rows: N a constant, so each size compiles apart */
#define FOR_PASS_SIZE(nr)          \
    switch (nr) {                  \
        case 16: PASS(16); break;  \
        case 8: PASS(8); break;    \
        case 4: PASS(4); break;    \
        case 2: PASS(2); break;    \
        default: PASS(1); break;   \
    }

/* the lanes of the block from column col0 that are inside a vocabulary of n columns */
static inline __mmask16 block_lanes(int64_t n, int64_t col0) {
    return n - col0 >= COLS ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - col0)) - 1u);
}

/* every row over blocks [b0, b1): each block read from memory once, then one pass per group of
 * rows over it (xp: each pass's rows as [pairs][rows of the pass], passes one after another) */
static void head_range(const uint32_t* xp, int64_t rows, const uint32_t* packed, int64_t vocab,
                       int64_t pairs, int64_t b0, int64_t b1, const uint16_t* bias,
                       uint16_t* logits, int64_t logits_stride, Best* best) {
    for (int64_t b = b0; b < b1; ++b) {
        const uint32_t* block = packed + b * pairs * COLS;
        const int64_t col0 = b * COLS;
        const __mmask16 live = block_lanes(vocab, col0);
        for (int64_t r = 0; r < rows;) {
            const int nr = pass_rows(rows - r);
            const uint32_t* xr = xp + r * pairs;
            uint16_t* lr = logits ? logits + r * logits_stride : NULL;
            Best* br = best ? best + r : NULL;
#define PASS(N) head_block(xr, block, pairs, col0, live, bias, lr, logits_stride, br, N)
            FOR_PASS_SIZE(nr)
#undef PASS
            r += nr;
        }
    }
}

/* each pass's rows with their 32-bit words interleaved ([words][rows of the pass], passes one
 * after another; rows `row_bytes` apart from x): a step over the words reads one cache line of x
 * for every row of the pass. A bf16 row's words are its pairs, an int8 row's its quads. */
static void pack_rows(const void* x, int64_t row_bytes, int64_t rows, int64_t words,
                      uint32_t* xp) {
    for (int64_t r = 0; r < rows;) {
        const int nr = pass_rows(rows - r);
        for (int64_t k = 0; k < nr; ++k) {
            const uint32_t* row = (const uint32_t*)((const char*)x + (r + k) * row_bytes);
            for (int64_t i = 0; i < words; ++i) xp[r * words + i * nr + k] = row[i];
        }
        r += nr;
    }
}

/* each row's choice (best_value, best_index) from its threads' (partial: [threads][rows]): a
 * thread takes its blocks in rising order, so its own ties keep the earlier column; between
 * threads the lower column wins a tie. NaN where a logit was NaN or +inf; -inf at column 0 where
 * every logit is -inf. Returns whether every row had a finite choice. */
static int merge_best(const Best* partial, int64_t rows, int threads, float* best_value,
                      int64_t* best_index) {
    int all = 1;
    for (int64_t r = 0; r < rows; ++r) {
        Best out = partial[r];
        for (int t = 1; t < threads; ++t) {
            const Best* p = &partial[t * rows + r];
            out.bad |= p->bad;
            if (p->index >= 0 && (out.index < 0 || p->value > out.value ||
                                  (p->value == out.value && p->index < out.index))) {
                out.value = p->value;
                out.index = p->index;
            }
        }
        best_value[r] = out.bad ? NAN : out.index < 0 ? -INFINITY : out.value;
        best_index[r] = out.index < 0 ? 0 : out.index;
        all &= !out.bad && out.index >= 0;
    }
    return all;
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
    pack_rows(x, x_stride * 2, rows, pairs, xp);
    for (int64_t k = 0; partial && k < threads * rows; ++k) partial[k] = (Best){-INFINITY, -1, 0};
#pragma omp parallel num_threads(threads)
    {
        const int t = thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t b0 = c * CHUNK_BLOCKS;
            const int64_t b1 = b0 + CHUNK_BLOCKS < blocks ? b0 + CHUNK_BLOCKS : blocks;
            head_range(xp, rows, (const uint32_t*)packed, vocab, pairs, b0, b1, NULL, logits,
                       logits_stride, partial ? partial + t * rows : NULL);
        }
    }
    if (best_value) {
        merge_best(partial, rows, threads, best_value, best_index);
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
        pack_rows(x + p0 * x_stride, x_stride * 2, np, pairs, xp);
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


#if defined(__AVX512VNNI__)

int lm_head_screen_available(void) { return 1; }

typedef struct {
    float hi;
    int32_t col;
} Kept;

typedef struct {
    float lo[COLS]; /* the largest lower end seen, per lane */
    float floor;    /* the largest lower end known, refreshed every SCREEN_REFRESH blocks */
    int kept, overflow;
    Kept slot[SCREEN_SLOTS];
} Screened;

typedef struct {
    float h_norm, f_norm; /* the row's |h|, |f| (rounded up) */
} RowTerms;

/* a row's quantization: per group its scale t_g and minus 128·Σp_g, the weights' +128 in the
 * group's dot products ([rows][groups] each) */
typedef struct {
    const float* scale;
    const int32_t* start;
    int64_t groups;
} RowGroups;

static void refresh_floor(Screened* st) {
    const float lo = _mm512_reduce_max_ps(_mm512_loadu_ps(st->lo));
    st->floor = lo > st->floor ? lo : st->floor;
}

static void keep_columns(Screened* st, __mmask16 above, __m512 hi, int64_t col0) {
    if (st->kept + COLS > SCREEN_SLOTS) { /* drop the kept columns now below the lower end */
        refresh_floor(st);
        int n = 0;
        for (int k = 0; k < st->kept; ++k)
            if (st->slot[k].hi >= st->floor) st->slot[n++] = st->slot[k];
        st->kept = n;
        if (n + COLS > SCREEN_SLOTS) {
            st->overflow = 1;
            return;
        }
    }
    float his[COLS];
    _mm512_storeu_ps(his, hi);
    for (unsigned m = above; m; m &= m - 1) {
        const int lane = __builtin_ctz(m);
        st->slot[st->kept++] = (Kept){his[lane], (int32_t)(col0 + lane)};
    }
}

/* acc + the products of w's uint8 quads with *x's int8 quad broadcast: gcc 12's intrinsic copies
 * the accumulator each time and loads the broadcast apart; the instruction does neither */
static inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const uint32_t* x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* a block's screened logits for `nr` rows (a: [nr][16]) into their lower and upper ends: the
 * rows' lower ends and the columns that may hold their maxima kept in `st`. Out of line:
 * inlined, its per-row constants would be lifted out of the block loop and push the sums out of
 * registers. */
static __attribute__((noinline)) void screen_ends(const __m512* a, const float* factors,
                                                  int64_t dim, int64_t col0, __mmask16 live,
                                                  const RowTerms* terms, Screened* st, int nr) {
    const __m512 h_factor = _mm512_loadu_ps(factors);
    const __m512 f_factor = _mm512_loadu_ps(factors + COLS);
    const __m512 c1 = _mm512_set1_ps((float)rel_margin());
    const __m512 tiny = _mm512_set1_ps(FLT_MIN * 8.0f * (float)dim); /* flushed subnormals */
    for (int r = 0; r < nr; ++r) {
        const __m512 bound =
            _mm512_fmadd_ps(_mm512_set1_ps(terms[r].h_norm), h_factor,
                            _mm512_fmadd_ps(_mm512_set1_ps(terms[r].f_norm), f_factor, tiny));
        const __m512 margin = _mm512_fmadd_ps(c1, _mm512_abs_ps(a[r]), bound);
        const __m512 lo = _mm512_sub_ps(a[r], margin), hi = _mm512_add_ps(a[r], margin);
        Screened* s = &st[r];
        const __m512 seen = _mm512_loadu_ps(s->lo);
        _mm512_storeu_ps(s->lo, _mm512_mask_max_ps(seen, live, seen, lo));
        const __mmask16 above =
            _mm512_mask_cmp_ps_mask(live, hi, _mm512_set1_ps(s->floor), _CMP_GE_OQ);
        if (above && !s->overflow) keep_columns(s, above, hi, col0);
    }
}

/* one block of the screen for `nr` rows, their int8 quads interleaved in xu: [quads][nr]; rg:
 * the pass's first row's groups. A group's integer sums are scaled into the row's float sums
 * as the group ends. */
static inline __attribute__((always_inline)) void screen_block(
    const uint32_t* xu, const uint8_t* block, const float* prm, int64_t quads, int64_t col0,
    __mmask16 live, RowGroups rg, const RowTerms* terms, Screened* st, const int nr) {
    __m512 a[ROWS];
    for (int r = 0; r < nr; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < rg.groups; ++g) {
        const int64_t i1 = (g + 1) * SCREEN_GROUP < quads ? (g + 1) * SCREEN_GROUP : quads;
        __m512i acc[ROWS];
        for (int r = 0; r < nr; ++r) acc[r] = _mm512_set1_epi32(rg.start[r * rg.groups + g]);
        for (int64_t i = g * SCREEN_GROUP; i < i1; ++i) {
            _mm_prefetch((const char*)(block + (i + PREFETCH_PAIRS) * COLS * 4), _MM_HINT_T0);
            const __m512i w = _mm512_loadu_si512(block + i * COLS * 4);
            for (int r = 0; r < nr; ++r) acc[r] = dpbusd_broadcast(acc[r], w, &xu[i * nr + r]);
        }
        const __m512 s = _mm512_loadu_ps(prm + g * COLS);
        for (int r = 0; r < nr; ++r)
            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]),
                                   _mm512_mul_ps(s, _mm512_set1_ps(rg.scale[r * rg.groups + g])),
                                   a[r]);
    }
    __m512 sums[ROWS]; /* a copy: a itself, its address taken, would live in memory */
    for (int r = 0; r < nr; ++r) sums[r] = a[r];
    screen_ends(sums, prm + rg.groups * COLS, quads * 4, col0, live, terms, st, nr);
}

/* blocks [b0, b1) for every row; 1 when a row kept more columns than it has slots for */
static int screen_range(const uint32_t* xu, int64_t rows, const uint8_t* q, const float* params,
                        int64_t vocab, int64_t quads, int64_t b0, int64_t b1, RowGroups rg,
                        const RowTerms* terms, Screened* st) {
    for (int64_t b = b0; b < b1; ++b) {
        const uint8_t* block = q + b * quads * COLS * 4;
        const float* prm = params + b * screen_params(quads);
        const int64_t col0 = b * COLS;
        const __mmask16 live = block_lanes(vocab, col0);
        for (int64_t r = 0; r < rows;) {
            const int nr = pass_rows(rows - r);
            const uint32_t* xr = xu + r * quads;
            const RowGroups rr = {rg.scale + r * rg.groups, rg.start + r * rg.groups, rg.groups};
#define PASS(N) screen_block(xr, block, prm, quads, col0, live, rr, terms + r, st + r, N)
            FOR_PASS_SIZE(nr)
#undef PASS
            r += nr;
        }
        if ((b - b0) % SCREEN_REFRESH == SCREEN_REFRESH - 1)
            for (int64_t r = 0; r < rows; ++r) {
                if (st[r].overflow) return 1;
                refresh_floor(&st[r]);
            }
    }
    for (int64_t r = 0; r < rows; ++r)
        if (st[r].overflow) return 1;
    return 0;
}

/* the row's terms, its int8 quads (p) and per group its scale and its sums' start (scale,
 * start: [groups]); 0 where the screen cannot bound it */
static int row_terms(const uint16_t* x, int64_t dim, float max_norm, int8_t* u, RowTerms* out,
                     float* scale, int32_t* start) {
    const int64_t groups = screen_groups(dim / 4), group_dims = SCREEN_GROUP * 4;
    double h2 = 0.0, f2 = 0.0;
    for (int64_t d = 0; d < dim; ++d) {
        const float v = bf16_value(x[d]);
        if (!isfinite(v)) return 0;
        h2 += (double)v * v;
    }
    const double h_norm = sqrt(h2);
    if (!(h_norm * max_norm <= SCREEN_MAX_SUM) || h_norm == 0.0) return 0;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t d0 = g * group_dims, d1 = d0 + group_dims < dim ? d0 + group_dims : dim;
        float top = 0.0f;
        for (int64_t d = d0; d < d1; ++d)
            top = fabsf(bf16_value(x[d])) > top ? fabsf(bf16_value(x[d])) : top;
        const float t = top / 127.0f;
        int32_t sum = 0;
        for (int64_t d = d0; d < d1; ++d) {
            const double v = (double)bf16_value(x[d]);
            double k = t > 0.0f ? nearbyint(v / t) : 0.0;
            k = k > 127.0 ? 127.0 : k < -127.0 ? -127.0 : k;
            const double f = v - (double)t * k;
            f2 += f * f;
            u[d] = (int8_t)k;
            sum += (int32_t)k;
        }
        scale[g] = t;
        start[g] = -128 * sum;
    }
    out->h_norm = (float)(h_norm * (1.0 + 0x1p-20));
    out->f_norm = (float)(sqrt(f2) * (1.0 + 0x1p-20));
    return 1;
}

#define RECHECK_RUN 64  /* (row, block) pairs a thread rechecks at a time */
#define RECHECK_GROUP 8 /* pairs summed together: as many sums in flight */

typedef struct {
    int32_t block, row;
} Recheck;

/* `g` (row, block) pairs, each block's sums for its row made in the order head_block makes
 * them, so a column's logit is the full pass's bit for bit. One pair's sums each depend on the
 * one before: several pairs at once keep the unit busy. */
static inline __attribute__((always_inline)) void recheck_group(
    const uint16_t* x, int64_t x_stride, const uint32_t* packed, int64_t pairs,
    const Recheck* work, int64_t vocab, Best* best, const int g) {
    __m512 acc[RECHECK_GROUP];
    const uint32_t *block[RECHECK_GROUP], *xr[RECHECK_GROUP];
    for (int k = 0; k < g; ++k) {
        acc[k] = _mm512_setzero_ps();
        block[k] = packed + (int64_t)work[k].block * pairs * COLS;
        xr[k] = (const uint32_t*)(x + (int64_t)work[k].row * x_stride);
    }
    for (int64_t i = 0; i < pairs; ++i)
        for (int k = 0; k < g; ++k) {
            _mm_prefetch((const char*)(block[k] + (i + PREFETCH_PAIRS) * COLS), _MM_HINT_T0);
            const __m512bh w = (__m512bh)_mm512_loadu_si512(block[k] + i * COLS);
            acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)_mm512_set1_epi32((int)xr[k][i]), w);
        }
    for (int k = 0; k < g; ++k) {
        __m256i as_bf16;
        const int64_t col0 = (int64_t)work[k].block * COLS;
        keep_best(round_bf16(acc[k], &as_bf16), block_lanes(vocab, col0), col0,
                  &best[work[k].row]);
    }
}

static int by_pair(const void* a, const void* b) {
    const int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
    return (x > y) - (x < y);
}

/* Each row's choice among the columns its threads kept above the row's final lower end (st:
 * [threads][rows]): the (row, block) pairs in block order, threads taking RECHECK_RUN at a time,
 * so each row meets its blocks in rising order and a block several rows kept is read from memory
 * once. partial: [threads][rows], for merge_best. Returns the pairs run, -1 without memory. */
static int64_t recheck_rows(const uint16_t* x, int64_t x_stride, int64_t rows,
                            const uint16_t* packed, int64_t vocab, int64_t pairs, Screened* st,
                            int threads, Best* partial) {
    int64_t slots = 0;
    for (int64_t k = 0; k < threads * rows; ++k) slots += st[k].kept;
    int64_t* keys = malloc(sizeof(int64_t) * (size_t)(slots > 0 ? slots : 1));
    Recheck* work = malloc(sizeof(Recheck) * (size_t)(slots > 0 ? slots : 1));
    if (!keys || !work) {
        free(keys);
        free(work);
        return -1;
    }
    int64_t n = 0; /* block · rows + row of each kept column above its row's lower end */
    for (int64_t r = 0; r < rows; ++r) {
        float floor = -INFINITY;
        for (int t = 0; t < threads; ++t) {
            refresh_floor(&st[t * rows + r]);
            floor = st[t * rows + r].floor > floor ? st[t * rows + r].floor : floor;
        }
        for (int t = 0; t < threads; ++t) {
            const Screened* s = &st[t * rows + r];
            for (int k = 0; k < s->kept; ++k)
                if (s->slot[k].hi >= floor) keys[n++] = (s->slot[k].col / COLS) * rows + r;
        }
    }
    qsort(keys, (size_t)n, sizeof(int64_t), by_pair);
    int64_t run = 0;
    for (int64_t k = 0; k < n; ++k)
        if (k == 0 || keys[k] != keys[k - 1])
            work[run++] = (Recheck){(int32_t)(keys[k] / rows), (int32_t)(keys[k] % rows)};
    free(keys);
    const int64_t chunks = (run + RECHECK_RUN - 1) / RECHECK_RUN;
    for (int64_t k = 0; k < threads * rows; ++k) partial[k] = (Best){-INFINITY, -1, 0};
#pragma omp parallel num_threads(threads)
    {
        const int t = thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t k1 = (c + 1) * RECHECK_RUN < run ? (c + 1) * RECHECK_RUN : run;
            for (int64_t k = c * RECHECK_RUN; k < k1;) {
                const int g = k1 - k < RECHECK_GROUP ? (int)(k1 - k) : RECHECK_GROUP;
                switch (g) {
#define GROUP(G)                                                                           \
    case G:                                                                                \
        recheck_group(x, x_stride, (const uint32_t*)packed, pairs, work + k, vocab,        \
                      partial + t * rows, G);                                              \
        break;
                    GROUP(8) GROUP(7) GROUP(6) GROUP(5) GROUP(4) GROUP(3) GROUP(2)
                    default: GROUP(1)
#undef GROUP
                }
                k += g;
            }
        }
    }
    free(work);
    return run;
}

/* The greedy choice of each row as lm_head_bf16 gives it (best_value, best_index; packed: its
 * weight), screened in int8 first (q, params, max_norm: lm_head_screen_pack_bf16's); rechecked:
 * the blocks of 16 columns the rows ran through the full pass's routine, all rows together.
 * Returns 0 when screened, 1 when it ran the full pass instead, lm_head_bf16's codes on
 * failure. */
int lm_head_screened_bf16(const uint16_t* x, int64_t x_stride, int64_t rows,
                          const uint16_t* packed, const uint8_t* q, const float* params,
                          float max_norm, int64_t vocab, int64_t dim, float* best_value,
                          int64_t* best_index, int threads, int64_t* rechecked) {
    *rechecked = 0;
    if (dim % 4 != 0 || rows < 0 || vocab <= 0) return -1;
    if (rows == 0) return 0;
    const int64_t blocks = (vocab + COLS - 1) / COLS, quads = dim / 4, pairs = dim / 2;
    const int64_t chunks = (blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
    if (threads < 1) threads = 1;
    if (threads > chunks) threads = (int)chunks;
    int8_t* u = malloc((size_t)(rows * dim));
    uint32_t* xu = malloc(sizeof(uint32_t) * (size_t)(rows * quads));
    const int64_t groups = screen_groups(quads);
    RowTerms* terms = malloc(sizeof(RowTerms) * (size_t)rows);
    float* group_scale = malloc(sizeof(float) * (size_t)(rows * groups));
    int32_t* group_start = malloc(sizeof(int32_t) * (size_t)(rows * groups));
    Screened* st = malloc(sizeof(Screened) * (size_t)(threads * rows));
    Best* partial = malloc(sizeof(Best) * (size_t)(threads * rows));
    int code = 0;
    if (!u || !xu || !terms || !group_scale || !group_start || !st || !partial) {
        code = -2;
        goto done;
    }
    for (int64_t r = 0; r < rows && code == 0; ++r)
        if (!row_terms(x + r * x_stride, dim, max_norm, u + r * dim, &terms[r],
                       group_scale + r * groups, group_start + r * groups))
            code = 1;
    if (code) goto done;
    pack_rows(u, dim, rows, quads, xu);
    const RowGroups rg = {group_scale, group_start, groups};
    for (int64_t k = 0; k < threads * rows; ++k) {
        for (int l = 0; l < COLS; ++l) st[k].lo[l] = -INFINITY;
        st[k].floor = -INFINITY;
        st[k].kept = st[k].overflow = 0;
    }
    int give_up = 0; /* a row kept too many columns: the other chunks are skipped */
#pragma omp parallel num_threads(threads)
    {
        const int t = thread_num();
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) {
            if (__atomic_load_n(&give_up, __ATOMIC_RELAXED)) continue;
            const int64_t b0 = c * CHUNK_BLOCKS;
            const int64_t b1 = b0 + CHUNK_BLOCKS < blocks ? b0 + CHUNK_BLOCKS : blocks;
            if (screen_range(xu, rows, q, params, vocab, quads, b0, b1, rg, terms, st + t * rows))
                __atomic_store_n(&give_up, 1, __ATOMIC_RELAXED);
        }
    }
    if (give_up) {
        code = 1;
        goto done;
    }
    const int64_t run = recheck_rows(x, x_stride, rows, packed, vocab, pairs, st, threads, partial);
    if (run < 0) {
        code = -2;
        goto done;
    }
    *rechecked = run;
    if (!merge_best(partial, rows, threads, best_value, best_index))
        code = 1; /* cannot happen with the bounds: be safe */
done:
    free(u);
    free(xu);
    free(terms);
    free(group_scale);
    free(group_start);
    free(st);
    free(partial);
    if (code == 1) {
        const int full = lm_head_bf16(x, x_stride, rows, packed, vocab, dim, NULL, 0, best_value,
                                      best_index, threads);
        return full ? full : 1;
    }
    return code;
}

#else /* AVX-512 BF16 without VNNI */

int lm_head_screen_available(void) { return 0; }

int lm_head_screened_bf16(const uint16_t* x, int64_t x_stride, int64_t rows,
                          const uint16_t* packed, const uint8_t* q, const float* params,
                          float max_norm, int64_t vocab, int64_t dim, float* best_value,
                          int64_t* best_index, int threads, int64_t* rechecked) {
    (void)q; (void)params; (void)max_norm;
    *rechecked = 0;
    const int full = lm_head_bf16(x, x_stride, rows, packed, vocab, dim, NULL, 0, best_value,
                                  best_index, threads);
    return full ? full : 1;
}

#endif

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

int lm_head_screen_available(void) { return 0; }

int lm_head_screened_bf16(const uint16_t* x, int64_t x_stride, int64_t rows,
                          const uint16_t* packed, const uint8_t* q, const float* params,
                          float max_norm, int64_t vocab, int64_t dim, float* best_value,
                          int64_t* best_index, int threads, int64_t* rechecked) {
    (void)x; (void)x_stride; (void)rechecked; (void)rows; (void)packed; (void)q; (void)params; (void)max_norm;
    (void)vocab; (void)dim; (void)best_value; (void)best_index; (void)threads;
    return -1;
}

#endif
