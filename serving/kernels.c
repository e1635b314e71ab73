/* Float32 CPU kernels (AVX2 and FMA) for the engine's few-row steps; serving/kernels.py builds and calls them.
 *
 * gemm_panels: y[m, n] = x[m, k] @ W[k, n] (+ bias). W is stored as panels of NR columns, [ceil(n / NR)][k][NR], so each thread streams whole panels once and
 * reuses one from its L2 cache for every group of MR rows. Each output is a single running sum over k in
 * order, whatever m is: a row's result does not depend on the other rows of the batch, so a verify step
 * computes bit for bit what decode steps would. */
#include <immintrin.h>
#include <math.h>

#define NR 24
#define MR 4

static inline __attribute__((always_inline)) void tile(int mr, const float *x, long ldx, const float *w, long k,
                                                       const float *bias, float *y, long ldy, int cols) {
    __m256 acc[MR][3];
    _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++)
        _Pragma("GCC unroll 3") for (int j = 0; j < 3; j++) acc[i][j] = _mm256_setzero_ps();
    for (long p = 0; p < k; p++) {
        __m256 w0 = _mm256_loadu_ps(w + p * NR), w1 = _mm256_loadu_ps(w + p * NR + 8), w2 = _mm256_loadu_ps(w + p * NR + 16);
        _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++) {
            __m256 xi = _mm256_broadcast_ss(x + i * ldx + p);
            acc[i][0] = _mm256_fmadd_ps(xi, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xi, w1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(xi, w2, acc[i][2]);
        }
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < mr; i++) {
        float out[NR];
        _mm256_storeu_ps(out, acc[i][0]);
        _mm256_storeu_ps(out + 8, acc[i][1]);
        _mm256_storeu_ps(out + 16, acc[i][2]);
        for (int j = 0; j < cols; j++) y[i * ldy + j] = bias ? out[j] + bias[j] : out[j];
    }
}

void gemm_panels(const float *x, long m, long ldx, const float *w, long k, long n, const float *bias,
                 float *y, long ldy) {
    long panels = (n + NR - 1) / NR;
    #pragma omp parallel for schedule(static)
    for (long q = 0; q < panels; q++) {
        const float *wq = w + q * k * NR, *bq = bias ? bias + q * NR : 0;
        int cols = n - q * NR < NR ? (int)(n - q * NR) : NR;
        float *yq = y + q * NR;
        long i = 0;
        for (; i + MR <= m; i += MR) tile(MR, x + i * ldx, ldx, wq, k, bq, yq + i * ldy, ldy, cols);
        switch (m - i) {
            case 3: tile(3, x + i * ldx, ldx, wq, k, bq, yq + i * ldy, ldy, cols); break;
            case 2: tile(2, x + i * ldx, ldx, wq, k, bq, yq + i * ldy, ldy, cols); break;
            case 1: tile(1, x + i * ldx, ldx, wq, k, bq, yq + i * ldy, ldy, cols); break;
        }
    }
}

/* y = x / sqrt(mean(x^2) + eps) * w over rows of n, as float32 reference implementations do. */
void rms_norm(const float *x, long rows, long ldx, const float *w, float eps, float *y, long ldy, long n) {
    #pragma omp parallel for schedule(static) if (rows >= 64)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        __m256 sq = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            sq = _mm256_fmadd_ps(v, v, sq);
        }
        float lanes[8], sum = 0.0f;
        _mm256_storeu_ps(lanes, sq);
        for (int j = 0; j < 8; j++) sum += lanes[j];
        for (; i < n; i++) sum += xr[i] * xr[i];
        float scale = 1.0f / sqrtf(sum / n + eps);
        for (i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * scale);
    }
}
