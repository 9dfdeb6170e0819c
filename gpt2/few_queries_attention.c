/* Causal attention of a few new queries (1 to ~16) over a KV cache, the
 * attention of a decode step (1 query) and of a verification pass (gamma + 1
 * queries), on x86-64 with AVX2+FMA.
 *
 * Legend: B = batch, nh = heads, T = new queries, K = keys (the cache's
 * positions [0, K), the T new ones included), hs = head size.
 *
 * Why it exists (measurements in gpt2/attention.py): attention reads every
 * cached key and value once, so at a long context it should cost what reading
 * the cache costs. PyTorch's CPU scaled_dot_product_attention took about 2x
 * that for one query and 4x for five queries with a mask (gpt2-large, 600
 * positions, 36 layers read cold: 10.8 and 21.8 ms against ~5 ms). This loop
 * reads each key and value once from memory for all T queries.
 *
 * Query t sits at position K - T + t and sees keys 0 .. K - T + t (the causal
 * rule of the model: the T new tokens are the last T positions).
 *
 * Per (b, h), after copying the T new keys and values into the cache (when
 * given separately, as the block loop of few_rows_blocks.c gives them),
 * in three passes:
 *   1. scores s[t][j] = scale * q_t . k_j, keys in blocks of 8 (one block
 *      stays in L1 while every query is scored against it);
 *   2. softmax of each query's row over the keys it may see: p[t][j] =
 *      exp(s[t][j] - max_t) (keys it may not see get p = 0), and 1 / sum;
 *   3. y_t = (sum_j p[t][j] v_j) / sum, written straight into y's (B, T, C)
 *      layout, the input of the projection that follows.
 * Heads are split across threads (OpenMP).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

/* The lane sums of a[0..7], as one vector: lane i = sum8(a[i]). */
static inline __m256 sum8x8(const __m256 a[8]) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123 = [a0 a1 a2 a3 (low halves) | a0 a1 a2 a3 (high halves)], same for s4567 */
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
    __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

static inline float dot(const float *a, const float *b, int64_t hs) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < hs; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
    return sum8(acc);
}

/* q: (B, nh, T, hs) with strides q_b, q_h, q_t (elements; hs contiguous);
 * k, v: (B, nh, K, hs) with strides kv_b, kv_h, hs (the cache's layout);
 * k_new, v_new: the T new keys and values, laid out like q (strides q_b, q_h,
 * q_t), copied into positions [K - T, K) of k and v first; or NULL where they
 * are already there. y: (B, T, nh, hs) contiguous.
 * hs must be a multiple of 8; 1 <= T <= K. */
void few_queries_attention(const float *q, const float *k_new, const float *v_new, float *k, float *v, float *y,
                           int64_t B, int64_t nh, int64_t T, int64_t K, int64_t hs,
                           int64_t q_b, int64_t q_h, int64_t q_t, int64_t kv_b, int64_t kv_h, float scale) {
#pragma omp parallel
    {
        float *ph = malloc((size_t)(T * K) * sizeof(float)); /* this thread's scores, then
                                                                 probabilities: row t at ph + t * K */
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * nh; bh++) {
            const int64_t b = bh / nh, h = bh % nh;
            const float *qh = q + b * q_b + h * q_h;   /* query t at qh + t * q_t */
            float *kh = k + b * kv_b + h * kv_h;       /* key j at kh + j * hs */
            float *vh = v + b * kv_b + h * kv_h;

            /* 0. the new keys and values into the cache, at the last T positions */
            for (int64_t t = 0; k_new && t < T; t++) {
                memcpy(kh + (K - T + t) * hs, k_new + b * q_b + h * q_h + t * q_t, (size_t)hs * sizeof(float));
                memcpy(vh + (K - T + t) * hs, v_new + b * q_b + h * q_h + t * q_t, (size_t)hs * sizeof(float));
            }

            /* 1. scores, 8 keys at a time */
            int64_t j = 0;
            for (; j + 8 <= K; j += 8) {
                for (int64_t t = 0; t < T; t++) {
                    __m256 acc[8];
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                    for (int64_t c = 0; c < hs; c += 8) {
                        __m256 qc = _mm256_loadu_ps(qh + t * q_t + c);
                        for (int i = 0; i < 8; i++)
                            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kh + (j + i) * hs + c), qc, acc[i]);
                    }
                    _mm256_storeu_ps(ph + t * K + j, _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale)));
                }
            }
            for (; j < K; j++) /* the last K % 8 keys */
                for (int64_t t = 0; t < T; t++) ph[t * K + j] = scale * dot(qh + t * q_t, kh + j * hs, hs);

            /* 2. softmax of row t over the keys it sees, [0, seen); the rest get 0 */
            float inv_sum[T];
            for (int64_t t = 0; t < T; t++) {
                float *row = ph + t * K;
                const int64_t seen = K - T + t + 1;
                float max = row[0];
                for (int64_t i = 1; i < seen; i++) max = row[i] > max ? row[i] : max;
                __m256 vmax = _mm256_set1_ps(max), vsum = _mm256_setzero_ps();
                int64_t i = 0;
                for (; i + 8 <= seen; i += 8) {
                    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmax));
                    _mm256_storeu_ps(row + i, e);
                    vsum = _mm256_add_ps(vsum, e);
                }
                float sum = sum8(vsum);
                if (i < seen) { /* the last seen % 8 keys, through a padded register */
                    float tail[8];
                    for (int l = 0; l < 8; l++) tail[l] = i + l < seen ? row[i + l] - max : -100.0f;
                    _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
                    for (int64_t l = 0; i + l < seen; l++) {
                        row[i + l] = tail[l];
                        sum += tail[l];
                    }
                }
                for (int64_t l = seen; l < K; l++) row[l] = 0.0f;
                inv_sum[t] = 1.0f / sum;
            }

            /* 3. y_t = sum_j p[t][j] v_j / sum, 8 lanes of hs at a time in registers */
            for (int64_t t = 0; t < T; t++) {
                const float *row = ph + t * K;
                const int64_t seen = K - T + t + 1;
                float *yt = y + ((b * T + t) * nh + h) * hs;
                for (int64_t c0 = 0; c0 < hs; c0 += 64) { /* 64 lanes = 8 registers */
                    const int64_t width = hs - c0 < 64 ? hs - c0 : 64;
                    __m256 acc[8];
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                    for (int64_t jj = 0; jj < seen; jj++) {
                        __m256 pj = _mm256_set1_ps(row[jj]);
                        const float *vj = vh + jj * hs + c0;
                        for (int i = 0; i < width / 8; i++)
                            acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), acc[i]);
                    }
                    __m256 s = _mm256_set1_ps(inv_sum[t]);
                    for (int i = 0; i < width / 8; i++) _mm256_storeu_ps(yt + c0 + 8 * i, _mm256_mul_ps(acc[i], s));
                }
            }
        }
        free(ph);
    }
}
