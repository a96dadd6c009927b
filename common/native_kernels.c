/* CPU kernels, built by common/native_kernels.py at first use.
 *
 * RMSNorm and the rotary embeddings do in one pass over memory what torch does in several (a
 * bf16 RMSNorm is eight passes: a float32 copy, square, mean, add, rsqrt, multiply, a bf16 copy,
 * the weight), with the same arithmetic: float32 inside, the same roundings to the tensor's
 * dtype at the same points, so results equal torch's up to the order of a row's sum (RMSNorm;
 * bit for bit for the rotary embeddings, the language model's computed in its dtype as its
 * torch ops are). Decode attention reads the KV pool in place (see its comment). Work is shared
 * among `threads` OpenMP threads (torch's own runtime: the library links the libgomp torch
 * loaded), handed out a few rows (tokens, patches) at a time as threads come free (`row_chunk`):
 * on cores shared with other processes a fixed share per thread makes the call wait for the
 * thread whose core is busy. Built with -ffp-contract=off, so no product and sum fuse into one
 * rounding that torch does in two.
 *
 * Types: `bf16` is uint16_t holding a bfloat16, `f32` is float. Strides count elements.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even, as torch converts float32 to bfloat16; a NaN stays a (quiet) NaN */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* rows a thread takes at a time in a row-parallel pass: about four runs a thread, at most 16, so a
 * decode step's 16 rows spread over the threads instead of making one run for one of them */
static inline int64_t row_chunk(int64_t rows, int threads) {
    const int64_t chunk = rows / (4 * (int64_t)(threads > 0 ? threads : 1));
    return chunk < 1 ? 1 : chunk > 16 ? 16 : chunk;
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }
static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
#define bf16_load bf16_to_f32
#define bf16_store f32_to_bf16

/* exp for float32 in a form the compiler vectorizes: n = round(x / ln 2) (adding and taking away
 * 1.5 * 2^23 rounds to an integer without a library call), the rest r reduced in two steps
 * (Cody-Waite), e^r by Cephes' degree-6 polynomial, 2^n put in the exponent bits. Within 2 ulp
 * of the exact value over [-87.3, 88.7]; inputs beyond are clamped there. */
static inline float exp_f32(float x) {
    x = x < -87.336544f ? -87.336544f : x;
    x = x > 88.72283f ? 88.72283f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

/* out[r] = weight * dtype(x[r] * 1 / sqrt(mean(x[r]^2) + eps)), float32 inside: transformers'
 * Qwen RMSNorm. x rows `x_stride` apart, out contiguous. */
#define DEFINE_RMS_NORM(T)                                                                     \
    void rms_norm_##T(const T##_t* x, int64_t x_stride, const T##_t* weight, T##_t* out,       \
                      int64_t rows, int64_t dim, float eps, int threads) {                     \
        const int64_t chunk = row_chunk(rows, threads);                                        \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic, chunk)")              \
        for (int64_t r = 0; r < rows; ++r) {                                                   \
            const T##_t* xr = x + r * x_stride;                                                \
            T##_t* o = out + r * dim;                                                          \
            float squares = 0.0f;                                                              \
            _Pragma("omp simd reduction(+ : squares)")                                         \
            for (int64_t d = 0; d < dim; ++d) {                                                \
                const float v = T##_load(xr[d]);                                               \
                squares += v * v;                                                              \
            }                                                                                  \
            const float inv = 1.0f / sqrtf(squares / (float)dim + eps);                        \
            _Pragma("omp simd")                                                                \
            for (int64_t d = 0; d < dim; ++d) {                                                \
                const float y = T##_round(T##_load(xr[d]) * inv);                              \
                o[d] = T##_store(T##_load(weight[d]) * y);                                     \
            }                                                                                  \
        }                                                                                      \
    }

/* The vision tower's rotary embedding of queries and keys: qkv [S, 3, heads, dim] contiguous,
 * cos / sin [S, dim] float32; q and k out [S, heads, dim] each: x * cos + rotate_half(x) * sin
 * in float32 (rotate_half(x) = [-x2, x1]), two products and a sum rounded apart as torch does. */
#define DEFINE_ROTATE_QK(T)                                                                    \
    void rotate_qk_##T(const T##_t* qkv, const float* cos, const float* sin, T##_t* q_out,     \
                       T##_t* k_out, int64_t seq, int64_t heads, int64_t dim, int threads) {   \
        const int64_t half = dim / 2;                                                          \
        const int64_t chunk = row_chunk(seq, threads);                                         \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic, chunk)")              \
        for (int64_t s = 0; s < seq; ++s) {                                                    \
            const float* c = cos + s * dim;                                                    \
            const float* sn = sin + s * dim;                                                   \
            for (int64_t which = 0; which < 2; ++which) {                                      \
                T##_t* out = (which ? k_out : q_out) + s * heads * dim;                        \
                for (int64_t h = 0; h < heads; ++h) {                                          \
                    const T##_t* x = qkv + ((s * 3 + which) * heads + h) * dim;                \
                    T##_t* o = out + h * dim;                                                  \
                    _Pragma("omp simd")                                                        \
                    for (int64_t d = 0; d < half; ++d) {                                       \
                        const float a = T##_load(x[d]) * c[d];                                 \
                        const float b = -T##_load(x[d + half]) * sn[d];                        \
                        o[d] = T##_store(a + b);                                               \
                    }                                                                          \
                    _Pragma("omp simd")                                                        \
                    for (int64_t d = half; d < dim; ++d) {                                     \
                        const float a = T##_load(x[d]) * c[d];                                 \
                        const float b = T##_load(x[d - half]) * sn[d];                         \
                        o[d] = T##_store(a + b);                                               \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }


/* One head's rotate-half rotary embedding in the tensors' dtype, as torch's
 * x * cos + rotate_half(x) * sin runs on them: each product and the sum rounded to the dtype
 * apart (bf16 products are exact in float32, so each rounding is torch's). */
#define DEFINE_ROPE_HEAD(T)                                                                    \
    static inline void rope_head_##T(const T##_t* x, const T##_t* c, const T##_t* sn,          \
                                     T##_t* o, int64_t dim) {                                  \
        const int64_t half = dim / 2;                                                          \
        _Pragma("omp simd")                                                                    \
        for (int64_t d = 0; d < half; ++d) {                                                   \
            const float a = T##_round(T##_load(x[d]) * T##_load(c[d]));                        \
            const float b = T##_round(-T##_load(x[d + half]) * T##_load(sn[d]));               \
            o[d] = T##_store(a + b);                                                           \
        }                                                                                      \
        _Pragma("omp simd")                                                                    \
        for (int64_t d = half; d < dim; ++d) {                                                 \
            const float a = T##_round(T##_load(x[d]) * T##_load(c[d]));                        \
            const float b = T##_round(T##_load(x[d - half]) * T##_load(sn[d]));                \
            o[d] = T##_store(a + b);                                                           \
        }                                                                                      \
    }

/* The language model's rotary embedding and KV write for one step's tokens: q [T, heads, dim],
 * k and v [T, kv_heads, dim] (token rows q_stride / k_stride / v_stride apart, each token's
 * heads contiguous), cos / sin [T, dim] in the same dtype. q rotated into q_out [T, heads, dim];
 * k rotated and v copied into the cache rows at slots[t] (caches [num_slots, kv_heads, dim]).
 * One pass instead of torch's eight operators and two index copies. */
#define DEFINE_ROPE_STORE(T)                                                                   \
    void rope_store_##T(const T##_t* q, int64_t q_stride, const T##_t* k, int64_t k_stride,    \
                        const T##_t* v, int64_t v_stride, const T##_t* cos, const T##_t* sin,  \
                        const int64_t* slots, T##_t* q_out, T##_t* k_cache, T##_t* v_cache,    \
                        int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,          \
                        int threads) {                                                         \
        const int64_t chunk = row_chunk(tokens, threads);                                      \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic, chunk)")              \
        for (int64_t t = 0; t < tokens; ++t) {                                                 \
            const T##_t* c = cos + t * dim;                                                    \
            const T##_t* sn = sin + t * dim;                                                   \
            for (int64_t h = 0; h < heads; ++h)                                                \
                rope_head_##T(q + t * q_stride + h * dim, c, sn,                               \
                              q_out + (t * heads + h) * dim, dim);                             \
            const int64_t row = slots[t] * kv_heads * dim;                                     \
            for (int64_t h = 0; h < kv_heads; ++h)                                             \
                rope_head_##T(k + t * k_stride + h * dim, c, sn, k_cache + row + h * dim, dim);  \
            memcpy(v_cache + row, v + t * v_stride, (size_t)(kv_heads * dim) * sizeof(T##_t)); \
        }                                                                                      \
    }


/* 8-bit RGB frames -> the ViT's flat normalized patches by table lookup (see
 * services/encoder/patches.py): frame t starts at pixels + t * frame_stride ([height, width,
 * channels] uint8; a stride of 0 repeats one frame, as an image is); out is [grid_h * grid_w,
 * channels * frames * patch * patch] in the patch order of Qwen's processor (merge blocks row by
 * row, then the patches inside each block, each patch's values channel, frame, row, column),
 * each value table[channel * 256 + byte]: exactly the table's values, in one pass. */
#define DEFINE_CUT_PATCHES(T)                                                                  \
    void cut_patches_##T(const uint8_t* pixels, int64_t frame_stride, int64_t frames,          \
                         int64_t height, int64_t width, int64_t channels, int64_t patch,       \
                         int64_t merge, const T##_t* table, T##_t* out, int threads) {         \
        const int64_t grid_h = height / patch, grid_w = width / patch;                         \
        const int64_t blocks_w = grid_w / merge;                                               \
        const int64_t values = channels * frames * patch * patch;                              \
        const int64_t chunk = row_chunk(grid_h * grid_w, threads);                             \
        _Pragma("omp parallel for num_threads(threads) schedule(dynamic, chunk)")              \
        for (int64_t n = 0; n < grid_h * grid_w; ++n) {                                        \
            const int64_t in_block = n % (merge * merge), block = n / (merge * merge);         \
            const int64_t row = (block / blocks_w) * merge + in_block / merge;                 \
            const int64_t col = (block % blocks_w) * merge + in_block % merge;                 \
            T##_t* o = out + n * values;                                                       \
            for (int64_t c = 0; c < channels; ++c) {                                           \
                const T##_t* lut = table + c * 256;                                            \
                for (int64_t t = 0; t < frames; ++t) {                                         \
                    const uint8_t* frame = pixels + t * frame_stride;                          \
                    for (int64_t ph = 0; ph < patch; ++ph) {                                   \
                        const uint8_t* src =                                                   \
                            frame + ((row * patch + ph) * width + col * patch) * channels + c; \
                        for (int64_t pw = 0; pw < patch; ++pw) o[pw] = lut[src[pw * channels]]; \
                        o += patch;                                                            \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

/* Scores of a decode work item on AVX-512 BF16: for each of the `group` query heads at q (bf16
 * [group][dim], unscaled) and each key row at the slots `sl` (KV head g of k_cache), scale * the
 * float32 sum of the bf16 products (VDPBF16PS: the same exact products as the float32 path, summed
 * in another order) into scores[h * len + j]. Keys go 16 at a time: each key's dot product leaves
 * 16 partial sums in a register, and the 16 keys' registers are summed across into one register of
 * 16 scores (unpacks and adds, ~3 instructions a key) instead of 16 horizontal sums. Returns 1
 * where it ran, 0 where this build has no AVX-512 BF16 (the caller then computes them itself). */
typedef uint16_t bf16_t;
typedef float f32_t;

static inline int f32_values(const f32_t* v_cache, const int64_t* sl, int64_t len, int64_t g,
                             int64_t kv_heads, int64_t group, int64_t dim, const float* probs,
                             uint32_t* pairs, float* acc) {
    (void)v_cache; (void)sl; (void)len; (void)g; (void)kv_heads; (void)group; (void)dim;
    (void)probs; (void)pairs; (void)acc;
    return 0;
}

static inline int f32_scores(const f32_t* q, const f32_t* k_cache, const int64_t* sl, int64_t len,
                             int64_t g, int64_t kv_heads, int64_t group, int64_t dim, float scale,
                             float* scores) {
    (void)q; (void)k_cache; (void)sl; (void)len; (void)g; (void)kv_heads; (void)group; (void)dim;
    (void)scale; (void)scores;
    return 0;
}

/* avx512_bf16_available: whether this build has the AVX-512 BF16 kernels (the bf16 attention,
 * LM head and decode scores); without it they answer -1 (decode attention computes its scores in
 * float32) */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int avx512_bf16_available(void) { return 1; }

/* the 16 lanes of each of p[0 .. 15] summed: lane j of the result is the sum of p[j] */
static inline __m512 sum_across16(const __m512* p) {
    __m512 a[8], b[4];
    for (int k = 0; k < 8; ++k) /* per 128-bit lane: [p2k, p2k+1, p2k, p2k+1] partial sums */
        a[k] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * k], p[2 * k + 1]),
                             _mm512_unpackhi_ps(p[2 * k], p[2 * k + 1]));
    for (int k = 0; k < 4; ++k) { /* per 128-bit lane: [p4k, p4k+1, p4k+2, p4k+3] */
        const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
        b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* the four 128-bit lanes: block m of the result from b[m] */
    const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                   _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                   _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x88), _mm512_shuffle_f32x4(c, d, 0xDD));
}

/* one head's scores against 16 keys (rows[16]; a short block repeats a row, its lanes unused):
 * 16 accumulators, one a key, held in registers across the head's 32-dim chunks */
static inline __attribute__((always_inline)) __m512 head_scores16(const bf16_t* qh,
                                                                const bf16_t* const* rows,
                                                                int64_t chunks, __mmask32 tail) {
    __m512 p[16];
    for (int j = 0; j < 16; ++j) p[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
        const __mmask32 m = c == chunks - 1 ? tail : (__mmask32)~0u;
        const __m512bh qc = (__m512bh)_mm512_maskz_loadu_epi16(m, qh + 32 * c);
        for (int j = 0; j < 16; ++j) {
            const __m512bh kc = (__m512bh)_mm512_maskz_loadu_epi16(m, rows[j] + 32 * c);
            p[j] = _mm512_dpbf16_ps(p[j], qc, kc);
        }
    }
    return sum_across16(p);
}

static int bf16_scores(const bf16_t* q, const bf16_t* k_cache, const int64_t* sl, int64_t len,
                       int64_t g, int64_t kv_heads, int64_t group, int64_t dim, float scale,
                       float* scores) {
    const int64_t chunks = (dim + 31) / 32; /* 32 bf16 a register, the last one masked */
    const __mmask32 tail = dim % 32 ? (__mmask32)((1u << (dim % 32)) - 1u) : (__mmask32)~0u;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t keys = len - j0 < 16 ? len - j0 : 16;
        const bf16_t* rows[16];
        for (int64_t j = 0; j < 16; ++j)
            rows[j] = k_cache + (sl[j0 + (j < keys ? j : 0)] * kv_heads + g) * dim;
        for (int64_t h = 0; h < group; ++h) {
            const __m512 s = _mm512_mul_ps(head_scores16(q + h * dim, rows, chunks, tail), vscale);
            _mm512_mask_storeu_ps(scores + h * len + j0, (__mmask16)((1u << keys) - 1u), s);
        }
    }
    return 1;
}

/* acc[h0 .. h0 + HN) for one 32-dim chunk (`base`: key j's chunk at base + sl[j] * row_stride):
 * HN heads' two accumulators in registers (HN a constant where inlined) */
static inline __attribute__((always_inline)) void chunk_values(
    const bf16_t* base, const int64_t* sl, int64_t len, int64_t row_stride, __mmask32 m,
    const uint32_t* pairs, int64_t half, int64_t h0, const int HN, float* acc, int64_t dim) {
    /* lane l of the unpacked halves holds dim (l / 4) * 8 + l % 4 (lo) or + 4 (hi) */
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second =
        _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    __m512 lo[8], hi[8];
    for (int h = 0; h < HN; ++h) lo[h] = hi[h] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 2) {
        const __m512i a = _mm512_maskz_loadu_epi16(m, base + sl[j] * row_stride);
        const __m512i b = j + 1 < len ? _mm512_maskz_loadu_epi16(m, base + sl[j + 1] * row_stride)
                                      : _mm512_setzero_si512();
        const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh vh = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int h = 0; h < HN; ++h) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pairs[(h0 + h) * half + j / 2]);
            lo[h] = _mm512_dpbf16_ps(lo[h], vl, p);
            hi[h] = _mm512_dpbf16_ps(hi[h], vh, p);
        }
    }
    for (int h = 0; h < HN; ++h) {
        float* ah = acc + (h0 + h) * dim;
        _mm512_mask_storeu_ps(ah, (__mmask16)m, _mm512_permutex2var_ps(lo[h], first, hi[h]));
        _mm512_mask_storeu_ps(ah + 16, (__mmask16)(m >> 16),
                              _mm512_permutex2var_ps(lo[h], second, hi[h]));
    }
}

/* acc[h] (float32 [group][dim]) = the sum over the item's keys of probs[h][j] * v[j], the
 * probabilities already bf16 values (decode attention rounds them): two keys a VDPBF16PS, their
 * value rows interleaved in registers (unpacklo/hi of 16-bit lanes, which orders a 32-dim chunk's
 * output lanes [0-3, 8-11, 16-19, 24-27] / [4-7, ...]; undone once per chunk). Heads go 8, 4, 2
 * or 1 at a time, each count its own code, so the accumulators stay in registers. `pairs`:
 * scratch of group * ceil(len / 2) words. */
static int bf16_values(const bf16_t* v_cache, const int64_t* sl, int64_t len, int64_t g,
                       int64_t kv_heads, int64_t group, int64_t dim, const float* probs,
                       uint32_t* pairs, float* acc) {
    const int64_t half = (len + 1) / 2, chunks = (dim + 31) / 32, row_stride = kv_heads * dim;
    for (int64_t h = 0; h < group; ++h) { /* each head's probabilities as bf16 pairs */
        const float* ph = probs + h * len;
        uint16_t* out = (uint16_t*)(pairs + h * half);
        for (int64_t j = 0; j < len; j += 16) {
            const int64_t n = len - j < 16 ? len - j : 16;
            const __m512 x = _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), ph + j);
            _mm256_mask_storeu_epi16(out + j, (__mmask16)((1u << n) - 1u),
                                     (__m256i)_mm512_cvtneps_pbh(x));
        }
        if (len % 2) out[len] = 0; /* the odd key's partner: weight 0 */
    }
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t d0 = 32 * c, left = dim - d0;
        const __mmask32 m = left >= 32 ? (__mmask32)~0u : (__mmask32)((1u << left) - 1u);
        const bf16_t* base = v_cache + g * dim + d0;
        float* a = acc + d0;
        for (int64_t h0 = 0; h0 < group;) {
            const int64_t left_heads = group - h0;
            if (left_heads >= 8) {
                chunk_values(base, sl, len, row_stride, m, pairs, half, h0, 8, a, dim);
                h0 += 8;
            } else if (left_heads >= 4) {
                chunk_values(base, sl, len, row_stride, m, pairs, half, h0, 4, a, dim);
                h0 += 4;
            } else if (left_heads >= 2) {
                chunk_values(base, sl, len, row_stride, m, pairs, half, h0, 2, a, dim);
                h0 += 2;
            } else {
                chunk_values(base, sl, len, row_stride, m, pairs, half, h0, 1, a, dim);
                h0 += 1;
            }
        }
    }
    return 1;
}
#else
int avx512_bf16_available(void) { return 0; }

static inline int bf16_values(const bf16_t* v_cache, const int64_t* sl, int64_t len, int64_t g,
                              int64_t kv_heads, int64_t group, int64_t dim, const float* probs,
                              uint32_t* pairs, float* acc) {
    (void)v_cache; (void)sl; (void)len; (void)g; (void)kv_heads; (void)group; (void)dim;
    (void)probs; (void)pairs; (void)acc;
    return 0;
}

static inline int bf16_scores(const bf16_t* q, const bf16_t* k_cache, const int64_t* sl,
                              int64_t len, int64_t g, int64_t kv_heads, int64_t group, int64_t dim,
                              float scale, float* scores) {
    (void)q; (void)k_cache; (void)sl; (void)len; (void)g; (void)kv_heads; (void)group; (void)dim;
    (void)scale; (void)scores;
    return 0;
}
#endif

/* Decode attention over the KV pool, read in place: request i's one query token (q row i,
 * `q_stride` apart: [heads, dim] each) attends to the keys at slots[offsets[i] .. offsets[i+1])
 * of k_cache / v_cache ([slots, kv_heads, dim] contiguous); out [n, heads, dim] contiguous. One
 * work item per (request, KV head): each key row is read once for the `heads / kv_heads` query
 * heads that share it (GQA), scores kept whole per item (bf16 on AVX-512 BF16: `bf16_scores`;
 * softmax in float32 with exp_f32; the weights rounded to the dtype before they multiply V, as
 * SDPA's CPU kernel does, their sum taken before), the weighted values summed in float32 (bf16
 * on AVX-512 BF16: `bf16_values`, two keys a VDPBF16PS) and rounded once. `max_len`: the longest
 * request's keys (sizes each thread's buffers).
 * Requires heads / kv_heads <= MAX_GROUP, dim <= MAX_DIM. */
#define MAX_GROUP 16
#define MAX_DIM 256
#define DEFINE_DECODE_ATTENTION(T)                                                             \
    int decode_attention_##T(const T##_t* q, int64_t q_stride, const T##_t* k_cache,           \
                             const T##_t* v_cache, const int64_t* slots, const int64_t* offsets, \
                             T##_t* out, int64_t n, int64_t heads, int64_t kv_heads,            \
                             int64_t dim, int64_t max_len, float scale, int threads) {          \
        const int64_t group = heads / kv_heads;                                                \
        if (group > MAX_GROUP || dim > MAX_DIM || group * kv_heads != heads) return -1;        \
        int failed = 0;                                                                        \
        _Pragma("omp parallel num_threads(threads) reduction(| : failed)")                     \
        {                                                                                      \
            float* scores = malloc(sizeof(float) * (size_t)(group * (max_len > 0 ? max_len : 1))); \
            uint32_t* pairs = malloc(sizeof(uint32_t) * (size_t)(group * (max_len / 2 + 1)));   \
            float qf[MAX_GROUP * MAX_DIM], acc[MAX_GROUP * MAX_DIM], row[MAX_DIM];              \
            float inv_sum[MAX_GROUP];                                                          \
            failed = scores == NULL || pairs == NULL;                                          \
            _Pragma("omp for schedule(dynamic, 1)")                                            \
            for (int64_t item = 0; item < n * kv_heads; ++item) {                              \
                if (failed) continue;                                                          \
                const int64_t i = item / kv_heads, g = item % kv_heads;                        \
                const int64_t* sl = slots + offsets[i];                                        \
                const int64_t len = offsets[i + 1] - offsets[i];                               \
                const T##_t* qi = q + i * q_stride + g * group * dim;                          \
                if (T##_scores(qi, k_cache, sl, len, g, kv_heads, group, dim, scale, scores)) {    \
                    /* done: AVX-512 BF16 */                                                   \
                } else {                                                                       \
                for (int64_t h = 0; h < group; ++h) {                                          \
                    const T##_t* qh = qi + h * dim;                                            \
                    _Pragma("omp simd")                                                        \
                    for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] = T##_load(qh[d]) * scale; \
                }                                                                              \
                for (int64_t j = 0; j < len; ++j) {                                            \
                    const T##_t* k = k_cache + (sl[j] * kv_heads + g) * dim;                   \
                    _Pragma("omp simd")                                                        \
                    for (int64_t d = 0; d < dim; ++d) row[d] = T##_load(k[d]);                 \
                    for (int64_t h = 0; h < group; ++h) {                                      \
                        const float* qh = qf + h * dim;                                        \
                        float dot = 0.0f;                                                      \
                        _Pragma("omp simd reduction(+ : dot)")                                 \
                        for (int64_t d = 0; d < dim; ++d) dot += qh[d] * row[d];               \
                        scores[h * len + j] = dot;                                             \
                    }                                                                          \
                }                                                                              \
                }                                                                              \
                for (int64_t h = 0; h < group; ++h) {                                          \
                    float* sh = scores + h * len;                                              \
                    float top = -INFINITY, sum = 0.0f;                                         \
                    _Pragma("omp simd reduction(max : top)")                                   \
                    for (int64_t j = 0; j < len; ++j) top = sh[j] > top ? sh[j] : top;         \
                    _Pragma("omp simd reduction(+ : sum)")                                     \
                    for (int64_t j = 0; j < len; ++j) {                                        \
                        const float e = exp_f32(sh[j] - top);                                  \
                        sum += e;                                                              \
                        sh[j] = T##_round(e); /* as SDPA's kernel multiplies V: in the dtype */ \
                    }                                                                          \
                    inv_sum[h] = 1.0f / sum;                                                   \
                }                                                                              \
                if (!T##_values(v_cache, sl, len, g, kv_heads, group, dim, scores, pairs, acc)) { \
                memset(acc, 0, sizeof(float) * (size_t)(group * dim));                         \
                for (int64_t j = 0; j < len; ++j) {                                            \
                    const T##_t* v = v_cache + (sl[j] * kv_heads + g) * dim;                   \
                    _Pragma("omp simd")                                                        \
                    for (int64_t d = 0; d < dim; ++d) row[d] = T##_load(v[d]);                 \
                    for (int64_t h = 0; h < group; ++h) {                                      \
                        const float p = scores[h * len + j];                                   \
                        float* ah = acc + h * dim;                                             \
                        _Pragma("omp simd")                                                    \
                        for (int64_t d = 0; d < dim; ++d) ah[d] += p * row[d];                 \
                    }                                                                          \
                }                                                                              \
                }                                                                              \
                for (int64_t h = 0; h < group; ++h) {                                          \
                    T##_t* o = out + (i * heads + g * group + h) * dim;                        \
                    _Pragma("omp simd")                                                        \
                    for (int64_t d = 0; d < dim; ++d) o[d] = T##_store(acc[h * dim + d] * inv_sum[h]); \
                }                                                                              \
            }                                                                                  \
            free(scores);                                                                      \
            free(pairs);                                                                       \
        }                                                                                      \
        return failed ? -2 : 0;                                                                \
    }

/* SwiGLU's activation in bf16, as torch's `silu(gate) * up` runs on bf16 tensors: silu in
 * float32 (x / (1 + e^-x)) rounded to bf16, the product rounded again. gate_up rows [gate | up]
 * (2 * inter) `gu_stride` apart; out [rows][inter] contiguous. */
void silu_mul_bf16(const bf16_t* gate_up, int64_t gu_stride, bf16_t* out, int64_t rows,
                   int64_t inter, int threads) {
    const int64_t chunk = row_chunk(rows, threads);
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, chunk)")
    for (int64_t r = 0; r < rows; ++r) {
        const bf16_t* g = gate_up + r * gu_stride;
        const bf16_t* u = g + inter;
        bf16_t* o = out + r * inter;
        _Pragma("omp simd")
        for (int64_t d = 0; d < inter; ++d) {
            const float x = bf16_load(g[d]);
            const float silu = bf16_round(x / (1.0f + exp_f32(-x)));
            o[d] = bf16_store(silu * bf16_load(u[d]));
        }
    }
}

/* h += x in bf16 (each sum in float32 rounded once, as torch's bf16 add), rows `dim` long */
void add_bf16(bf16_t* h, const bf16_t* x, int64_t rows, int64_t dim, int threads) {
    const int64_t chunk = row_chunk(rows, threads);
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, chunk)")
    for (int64_t r = 0; r < rows; ++r) {
        bf16_t* hr = h + r * dim;
        const bf16_t* xr = x + r * dim;
        _Pragma("omp simd")
        for (int64_t d = 0; d < dim; ++d) hr[d] = bf16_store(bf16_load(hr[d]) + bf16_load(xr[d]));
    }
}

/* The sampler's draw for a step's sampled rows, each row on one thread: per row, as
 * services/language/engine/sampling.py's torch path does (vLLM's order), without sorting:
 *   z = logit / temperature; w = e^(z - max z), the row's unnormalised probabilities (exactly 1
 *   at the maximum; 0 for a -inf logit and for those below float32's normal range);
 *   min_p: w < min_p dropped (a probability below min_p times the largest one);
 *   top_k: the k largest w kept, ties at the k-th all kept;
 *   top_p: the largest w kept until their mass reaches top_p of the kept mass, ties at the last
 *   one all kept;
 *   the token: the first index where the running sum of the kept w (in index order) passes
 *   u * their total, u in [0, 1) the row's uniform draw: blocks of SAMPLE_BLOCK values summed
 *   in float32 (vectorised), the blocks' sums added in float64, the winning block walked.
 * The thresholds are found by radix selection on the bits of w (non-negative floats order as
 * their bits): a histogram of the top 12 bits (count or mass), then of the next 12 bits of the
 * values in the bucket where the target is crossed, then of the last 8: three short passes
 * instead of a sort of the whole row. logits [rows] rows `stride` apart, each [vocab]; a row
 * with a NaN or +inf logit, or only -inf ones (or a logit / temperature past float32), gets the
 * token -1. top_k 0: off; top_p 1: off; min_p 0: off. Returns 0, -2 without memory. */
#define SAMPLE_BLOCK 1024
#define SELECT_BUCKETS 4096
#define SELECT_WAYS 4 /* histograms filled in turn: adds to one bucket do not wait on each other */

/* the smallest bits t of a value in w (as bits) such that the values >= t add up to at least
 * `target` (their count, or with `by_mass` their sum); 0 when all of them fall short. cand:
 * room for n bits, hist: SELECT_WAYS * SELECT_BUCKETS doubles. */
static uint32_t select_bits(const uint32_t* w, int64_t n, double target, int by_mass,
                            uint32_t* cand, double* hist) {
    static const int shift[3] = {20, 8, 0}, width[3] = {12, 12, 8};
    const uint32_t* in = w;
    int64_t m = n;
    uint32_t prefix = 0;
    double above = 0.0; /* what the values above the current bucket add up to */
    for (int level = 0; level < 3; ++level) {
        const uint32_t mask = (1u << width[level]) - 1u;
        memset(hist, 0, sizeof(double) * SELECT_WAYS * SELECT_BUCKETS);
        for (int64_t i = 0; i < m; ++i) {
            float v;
            memcpy(&v, &in[i], sizeof v);
            hist[(i % SELECT_WAYS) * SELECT_BUCKETS + ((in[i] >> shift[level]) & mask)] +=
                by_mass ? (double)v : 1.0;
        }
        int64_t b = mask;
        for (; b >= 0; --b) {
            double here = 0.0;
            for (int k = 0; k < SELECT_WAYS; ++k) here += hist[k * SELECT_BUCKETS + b];
            if (above + here >= target) break;
            above += here;
        }
        if (b < 0) return 0; /* short of the target: everything is kept */
        prefix |= (uint32_t)b << shift[level];
        if (level == 2) break;
        /* the values in bucket b go on to the next level */
        int64_t k = 0;
        for (int64_t i = 0; i < m; ++i)
            if (((in[i] >> shift[level]) & mask) == (uint32_t)b) cand[k++] = in[i];
        in = cand;
        m = k;
    }
    return prefix;
}

/* the values of w below the bits t set to 0 (w >= 0: their bits order as they do); returns the
 * total of the rest, each block's sum in sums */
static double keep_from(float* w, int64_t n, uint32_t t, double* sums) {
    uint32_t* bits = (uint32_t*)w;
    double total = 0.0;
    for (int64_t b0 = 0; b0 < n; b0 += SAMPLE_BLOCK) {
        const int64_t b1 = b0 + SAMPLE_BLOCK < n ? b0 + SAMPLE_BLOCK : n;
        float sum = 0.0f;
        _Pragma("omp simd reduction(+ : sum)")
        for (int64_t i = b0; i < b1; ++i) {
            bits[i] = bits[i] >= t ? bits[i] : 0u;
            sum += w[i];
        }
        sums[b0 / SAMPLE_BLOCK] = sum;
        total += sum;
    }
    return total;
}

/* a row's token from its weights w (block sums in sums, their total): top_k, top_p, the draw */
static int64_t sample_weights(float* w, int64_t n, double* sums, double total, int64_t top_k,
                              float top_p, double u, uint32_t* cand, double* hist) {
    if (top_k > 0 && top_k < n)
        total = keep_from(w, n, select_bits((uint32_t*)w, n, (double)top_k, 0, cand, hist), sums);
    if (top_p < 1.0f)
        total = keep_from(w, n, select_bits((uint32_t*)w, n, top_p * total, 1, cand, hist), sums);
    const double goal = u * total;
    const int64_t blocks = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double run = 0.0;
    int64_t b = 0, last = -1; /* the last block with mass, should rounding end the sum short */
    for (; b < blocks; ++b) {
        if (sums[b] > 0.0) last = b;
        if (sums[b] > 0.0 && run + sums[b] > goal) break;
        run += sums[b];
    }
    if (b == blocks) b = last;
    const int64_t b0 = b * SAMPLE_BLOCK, b1 = b0 + SAMPLE_BLOCK < n ? b0 + SAMPLE_BLOCK : n;
    int64_t pick = -1;
    for (int64_t i = b0; i < b1; ++i) {
        if (w[i] == 0.0f) continue;
        pick = i; /* the block's last token with mass, should rounding end its sum short */
        run += (double)w[i];
        if (run > goal) break;
    }
    return pick;
}

#define DEFINE_SAMPLE_ROWS(T)                                                                  \
    int sample_rows_##T(const T##_t* logits, int64_t stride, int64_t rows, int64_t vocab,      \
                        const float* temperature, const int64_t* top_k, const float* top_p,    \
                        const float* min_p, const double* u, int64_t* tokens, int threads) {   \
        const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;                      \
        int failed = 0;                                                                        \
        _Pragma("omp parallel num_threads(threads) reduction(| : failed)")                     \
        {                                                                                      \
            float* w = malloc(sizeof(float) * (size_t)vocab);                                  \
            uint32_t* cand = malloc(sizeof(uint32_t) * (size_t)vocab);                         \
            double* hist = malloc(sizeof(double) * SELECT_WAYS * SELECT_BUCKETS);              \
            double* sums = malloc(sizeof(double) * (size_t)blocks);                            \
            failed = !w || !cand || !hist || !sums;                                            \
            _Pragma("omp for schedule(dynamic, 1)")                                            \
            for (int64_t r = 0; r < rows; ++r) {                                               \
                if (failed) continue;                                                          \
                const T##_t* x = logits + r * stride;                                          \
                const float t = temperature[r], low = min_p[r] > 0.0f ? min_p[r] : 0.0f;       \
                float top = -INFINITY;                                                         \
                int bad = 0; /* NaN or +inf logits */                                          \
                _Pragma("omp simd reduction(max : top) reduction(+ : bad)")                    \
                for (int64_t i = 0; i < vocab; ++i) {                                          \
                    const float z = T##_load(x[i]) / t;                                        \
                    top = z > top ? z : top;                                                   \
                    bad += !(T##_load(x[i]) < INFINITY);                                       \
                }                                                                              \
                if (bad || !(top > -INFINITY && top < INFINITY)) { /* or overflowed by t */    \
                    tokens[r] = -1;                                                            \
                    continue;                                                                  \
                }                                                                              \
                double total = 0.0;                                                            \
                for (int64_t b0 = 0; b0 < vocab; b0 += SAMPLE_BLOCK) {                         \
                    const int64_t b1 = b0 + SAMPLE_BLOCK < vocab ? b0 + SAMPLE_BLOCK : vocab;  \
                    float sum = 0.0f;                                                          \
                    _Pragma("omp simd reduction(+ : sum)")                                     \
                    for (int64_t i = b0; i < b1; ++i) {                                        \
                        const float d = T##_load(x[i]) / t - top; /* -inf: a -inf logit */     \
                        const float e = d < -87.336544f ? 0.0f : exp_f32(d);                   \
                        w[i] = e >= low ? e : 0.0f;                                            \
                        sum += w[i];                                                           \
                    }                                                                          \
                    sums[b0 / SAMPLE_BLOCK] = sum;                                             \
                    total += sum;                                                              \
                }                                                                              \
                tokens[r] = sample_weights(w, vocab, sums, total, top_k[r], top_p[r], u[r],    \
                                           cand, hist);                                        \
            }                                                                                  \
            free(w);                                                                           \
            free(cand);                                                                        \
            free(hist);                                                                        \
            free(sums);                                                                        \
        }                                                                                      \
        return failed ? -2 : 0;                                                                \
    }

DEFINE_RMS_NORM(bf16)
DEFINE_RMS_NORM(f32)
DEFINE_ROTATE_QK(bf16)
DEFINE_ROTATE_QK(f32)
DEFINE_ROPE_HEAD(bf16)
DEFINE_ROPE_HEAD(f32)
DEFINE_ROPE_STORE(bf16)
DEFINE_ROPE_STORE(f32)
DEFINE_DECODE_ATTENTION(bf16)
DEFINE_DECODE_ATTENTION(f32)
DEFINE_CUT_PATCHES(bf16)
DEFINE_CUT_PATCHES(f32)
DEFINE_SAMPLE_ROWS(bf16)
DEFINE_SAMPLE_ROWS(f32)
