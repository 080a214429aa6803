/* A gated residual branch added to an fp32 sum: Qwen2-MoE's shared expert, whose output every token
 * takes, scaled by a sigmoid gate of its own, on top of the routed experts' weighted sum.
 *
 * Plain C (the compiler vectorises the row loop), so one function serves every ISA path of both
 * architectures: its work is one multiply-add a hidden feature, next to two linears over the same rows. */
#include "cpu_kernels.h"

#include <math.h>

#include "bf16.h"

/* out fp32 [t, h] (row stride ldo) += sigmoid(gate[i]) * y bf16 [t, h] (row stride ldy), the gate one
 * value a row (row stride ldg), bf16 or fp32; the sigmoid in fp32. */
void rtp_add_sigmoid_gated(float *out, int64_t ldo, const void *gate, int gate_bf16, int64_t ldg, const uint16_t *y,
                           int64_t ldy, int64_t t, int64_t h) {
    for (int64_t i = 0; i < t; i++) {
        float g = gate_bf16 ? rtp_bf16_to_f32(((const uint16_t *)gate)[i * ldg]) : ((const float *)gate)[i * ldg];
        float s = 1.f / (1.f + expf(-g));
        float *o = out + i * ldo;
        const uint16_t *yr = y + i * ldy;
        for (int64_t c = 0; c < h; c++) o[c] += s * rtp_bf16_to_f32(yr[c]);
    }
}
