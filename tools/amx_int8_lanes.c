/* A measurement, not a kernel of rtp's (tools/bench_amx_int8.py builds and times it): the lane kernel's
 * numerics (rtp/kernels/csrc/avx512/linear_lanes.c) computed with AMX-INT8 tiles, for Q8_0 records in lane
 * order, to see what docs/determinism.md's plan for AMX CPUs would cost. Per 16 rows of x, 16 outputs and
 * block of 32: TDPBSUD of x's h and l halves (signed) against the record's 8 vectors (the weights plus 128,
 * unsigned: B's VNNI layout as it is), both int32 tiles stored, then the lane kernel's epilogue on each row:
 * (h << 7) + l - 128 qsum, exact, times d_w d_x into one fp32 chain per output in block order. The integer
 * sums and the fp32 operations are the lane kernel's, in its order, so the bits must be its bits: the tool
 * checks that. x's integer blocks come from rtp's own quantizer (the caller passes them). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int amx_int8_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

AMX_TARGET static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) { c.rows[t] = 16; c.colsb[t] = 64; } /* 0, 1: C for h and l, int32 16 x 16 */
    for (int t = 2; t < 4; t++) { c.rows[t] = 16; c.colsb[t] = 32; } /* 2, 3: A, x's h and l, 16 rows x 32 */
    c.rows[4] = 8; c.colsb[4] = 64;                                   /* 4: B, the record's 8 vectors */
    _tile_loadconfig(&c);
}

/* out fp32 [M, N] = the lane kernel's product for x's integer blocks (h, l int8 [M, K]; d [M, K/32]; qsum [M,
 * K/16]) and Q8_0 records in lane order (weights [N/16, K/32, 576]). M a multiple of 16. */
AMX_TARGET void amx_int8_lanes_q8_0(const int8_t *h, const int8_t *l, const float *dx, const int32_t *qsum,
                                    const uint8_t *weights, float *out, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / 32, rb = 576, units = N / 16;
#pragma omp parallel
    {
        configure();
        int32_t ch[256] __attribute__((aligned(64))), cl[256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                __m512 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *rec = weights + (u * nb + b) * rb;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(2, h + m0 * K + 32 * b, K);
                    _tile_loadd(3, l + m0 * K + 32 * b, K);
                    _tile_loadd(4, rec, 64);
                    _tile_dpbsud(0, 2, 4);
                    _tile_dpbsud(1, 3, 4);
                    _tile_stored(0, ch, 64);
                    _tile_stored(1, cl, 64);
                    __m512 d0 = _mm512_load_ps((const float *)(rec + 512));
                    for (int i = 0; i < 16; i++) {
                        const int64_t r = m0 + i;
                        __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(ch + 16 * i), 7),
                                                     _mm512_load_si512(cl + 16 * i));
                        /* the lane kernel takes 128 qsum off each half, then adds the halves: the same integer */
                        s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * qsum[r * 2 * nb + 2 * b]));
                        s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * qsum[r * 2 * nb + 2 * b + 1]));
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d0, _mm512_set1_ps(dx[r * nb + b])),
                                                 acc[i]);
                    }
                }
                for (int i = 0; i < 16; i++)
                    _mm512_storeu_ps(out + (m0 + i) * N + 16 * u, _mm512_add_ps(acc[i], _mm512_setzero_ps()));
            }
        }
        _tile_release();
    }
}
