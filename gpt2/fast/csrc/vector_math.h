/* Eight-lane float32 helpers shared by the C kernels (AVX2 + FMA):
 * a horizontal sum, e^x, and GPT-2's tanh-approximated GELU. */
#ifndef GPT2_VECTOR_MATH_H
#define GPT2_VECTOR_MATH_H

#include <immintrin.h>

static inline float sum8(__m256 v) { /* the 8 lanes of v, added */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* e^x for 8 lanes, x <= 0 (a softmax after subtracting the row maximum, or
 * e^(-2|u|) in gelu8): e^x = 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2,
 * and e^r by the degree-7 polynomial of the Cephes library (relative error
 * ~1e-7, that of float32). Below -87.3 the result would underflow float32;
 * it is clamped. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln 2 in two parts, */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);     /* for an exact r      */
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f))); /* e^r */
    __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)); /* e^r * 2^n */
}

/* GPT-2's GELU ("gelu_new"), 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3),
 * for 8 lanes. tanh(|u|) = (1 - e) / (1 + e) with e = e^(-2|u|) <= 1, so exp8
 * never overflows; the sign of u is put back after. Absolute error of tanh
 * ~1e-7 (the cancellation in 1 - e for tiny u costs relative, not absolute,
 * accuracy, and GELU multiplies it by 0.5 x). */
static inline __m256 gelu8(__m256 x) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign_bit, u))); /* e^(-2|u|) */
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 tanh_abs = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    __m256 tanh_u = _mm256_or_ps(tanh_abs, _mm256_and_ps(sign_bit, u)); /* the sign of u */
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, tanh_u));
}

#endif
