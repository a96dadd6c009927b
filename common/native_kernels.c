/* Fused element-wise kernels for the CPU, built by common/native_kernels.py at first use.
 *
 * Each kernel does in one pass over memory what torch does in several (a bf16 RMSNorm is eight
 * passes: a float32 copy, square, mean, add, rsqrt, multiply, a bf16 copy, the weight), with
 * the same arithmetic: float32 inside, the same roundings to the tensor's dtype at the same
 * points, so results equal torch's up to the order of a row's sum (RMSNorm; bit for bit for the
 * rotary embedding). Rows are shared among `threads` OpenMP threads (torch's own runtime: the library
 * links the libgomp torch loaded). Built with -ffp-contract=off, so no product and sum fuse
 * into one rounding that torch does in two.
 *
 * Types: `bf16` is uint16_t holding a bfloat16, `f32` is float. Strides count elements.
 */
#include <math.h>
#include <stdint.h>
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

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }
static inline float f32_round(float x) { return x; }
static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
#define bf16_load bf16_to_f32
#define bf16_store f32_to_bf16

/* out[r] = weight * dtype(x[r] * 1 / sqrt(mean(x[r]^2) + eps)), float32 inside: transformers'
 * Qwen RMSNorm. x rows `x_stride` apart, out contiguous. */
#define DEFINE_RMS_NORM(T)                                                                     \
    void rms_norm_##T(const T##_t* x, int64_t x_stride, const T##_t* weight, T##_t* out,       \
                      int64_t rows, int64_t dim, float eps, int threads) {                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                      \
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
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                      \
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

typedef uint16_t bf16_t;
typedef float f32_t;

DEFINE_RMS_NORM(bf16)
DEFINE_RMS_NORM(f32)
DEFINE_ROTATE_QK(bf16)
DEFINE_ROTATE_QK(f32)
