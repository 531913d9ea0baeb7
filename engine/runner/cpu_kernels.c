// CPU matrix products with 16-bit weights for the NumPy runner's fast path.
//
// y[m, n] = sum_k x[m, k] * w[n, k]: x float32 (M, K), w fp16 or bf16 bits (N, K)
// row-major, y float32 (M, N). Decode is bound by reading the weights, so halving
// their bytes (vs float32) nearly doubles tokens/s; the arithmetic stays float32.
// Compiled on first use by engine/runner/cpu_native.py (cc -O3 -march=native -fopenmp).

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

enum { W_F16 = 0, W_BF16 = 1 };

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: renormalise
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float w_to_float(uint16_t v, int kind) {
    return kind == W_BF16 ? bf16_to_float(v) : half_to_float(v);
}

#ifdef HAVE_AVX2
static inline __m256 load8(const uint16_t *p, int kind) {
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    if (kind == W_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    return _mm256_cvtph_ps(raw);
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}
#endif

#define ROWS 4  // x rows per pass over a weight row (the weight row stays in L1)

// One weight row against `rows` (1..ROWS) rows of x: y[r * ldy] = dot(x[r], wrow).
// Every row is summed in the same order (two interleaved chains of 8 lanes, then
// the scalar tail) whatever `rows` is, so a row's result does not depend on the
// batch around it (batch invariance).
static void dot_rows(const float *x, const uint16_t *wrow, float *y, int64_t rows, int64_t K, int64_t ldy,
                     int kind) {
    int64_t k = 0;
    float acc[ROWS] = {0};
#ifdef HAVE_AVX2
    __m256 a[ROWS][2];
    for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = load8(wrow + k, kind), w1 = load8(wrow + k + 8, kind);
        for (int r = 0; r < ROWS; r++) {
            if (r < rows) {
                a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), a[r][1]);
            }
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 w0 = load8(wrow + k, kind);
        for (int r = 0; r < ROWS; r++)
            if (r < rows) a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), a[r][0]);
    }
    for (int r = 0; r < rows; r++) acc[r] = hsum(_mm256_add_ps(a[r][0], a[r][1]));
#endif
    for (; k < K; k++) {
        float w = w_to_float(wrow[k], kind);
        for (int64_t r = 0; r < rows; r++) acc[r] += w * x[r * K + k];
    }
    for (int64_t r = 0; r < rows; r++) y[r * ldy] = acc[r];
}

void matmul_w16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int kind) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wrow = w + n * K;
        for (int64_t m = 0; m < M; m += ROWS) {
            int64_t rows = M - m < ROWS ? M - m : ROWS;
            dot_rows(x + m * K, wrow, y + m * N + n, rows, K, N, kind);
        }
    }
}

// 16-bit weights -> float32 (embedding rows; tests)
void widen_w16(const uint16_t *w, float *out, int64_t count, int kind) {
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; i += 4096) {
        int64_t end = i + 4096 < count ? i + 4096 : count;
        int64_t j = i;
#ifdef HAVE_AVX2
        for (; j + 8 <= end; j += 8) _mm256_storeu_ps(out + j, load8(w + j, kind));
#endif
        for (; j < end; j++) out[j] = w_to_float(w[j], kind);
    }
}
