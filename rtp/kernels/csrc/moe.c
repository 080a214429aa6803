/* A MoE layer's routed experts in one call: route, dispatch, multiply, combine.
 *
 * rtp/models/expert_blocks.py keeps each expert of a quantized GGUF as its tile-order records (a
 * [gate | up] matrix interleaved for the fused SiLU-and-mul, and a down matrix); a layer's slots are
 * two tables of their addresses, which EPLB rewrites in place. One call here does what FusedMoE's
 * torch path does in a dozen ops and a Python loop over experts, so that a MoE step is a list of
 * kernel calls a CPU graph replays (rtp/kernels/cpu_graph.py) and its work follows the step's own
 * routing, read when the call runs:
 *
 *   route     softmax over the router's logits in fp32, the top k (ties: the lower expert), their
 *             probabilities renormalised to sum to 1 where asked (Mixtral; Qwen's norm_topk_prob)
 *   count     pairs per logical expert, added to expert_load (EPLB's statistics)
 *   place     an expert's pairs, in pair order, dealt round-robin over its replicas' slots
 *   gather    x's rows into slot order (a counting sort: stable, so a slot's rows keep pair order)
 *   multiply  per slot with rows, its [gate | up] records, SiLU-and-mul, then its down records, each
 *             call on all threads, in one of two orders (ExpertBlocks picks one for every layer):
 *             tiles  rtp_linear_tiles, AMX or AVX-512 BF16, the SiLU-and-mul fused (glu tiles), rows
 *                    in bf16
 *             lanes  rtp_linear_lanes (avx512/linear_lanes.c), the avx512 path's (AVX-512 VNNI without
 *                    BF16), where the dense layers take them too: x's rows as 15-bit integer blocks,
 *                    exact integer block sums; the gate and up outputs, SiLU-and-mul and the down
 *                    outputs in fp32
 *   combine   out[t] = sum over k, in k order, of weight[t, k] * y(t, k), in fp32
 *
 * Both kernels treat rows independently, so a row's bits do not depend on how many rows its
 * expert met, nor on which replica served it: a request's output does not depend on its
 * neighbours (docs/determinism.md). The scratch is this thread's and only grows (scratch.h). */
#if defined(__x86_64__) /* x86-64 only: the tile linears it calls are */
#include "cpu_kernels.h"

#include <math.h>
#include <string.h>

#include "avx2/avx2_math.h"
#include "bf16.h"
#include "scratch.h"

enum { RTP_MOE_TILES, RTP_MOE_AMX_TILES, RTP_MOE_LANES }; /* the records' order (cpu_kernels.moe_experts) */

static __thread rtp_scratch route_scratch, rows_scratch, hidden_scratch, out_scratch, glu_scratch;

/* h [n, inter] = silu(g[:, :inter]) * g[:, inter:] for g fp32 [n, 2 inter]: the lanes order's SiLU-and-mul, in
 * AVX2 (the lane kernel runs on the avx512 path too, whose CPUs lack AVX-512 BF16). */
AVX2_TARGET static void silu_mul_rows(const float *g, float *h, int64_t n, int64_t inter) {
    for (int64_t r = 0; r < n; r++) {
        const float *gate = g + r * 2 * inter, *up = gate + inter;
        float *out = h + r * inter;
        int64_t c = 0;
        for (; c + 8 <= inter; c += 8)
            _mm256_storeu_ps(out + c, avx2_silu_mul(_mm256_loadu_ps(gate + c), _mm256_loadu_ps(up + c)));
        for (; c < inter; c++) out[c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
    }
}

/* The top k experts of one token's logits [experts] and their weights. */
static void route_token(const void *logits, int logits_bf16, int64_t experts, int64_t top_k, int renormalize,
                        float *p, int32_t *ids, float *weights) {
    float max = -INFINITY;
    for (int64_t e = 0; e < experts; e++) {
        p[e] = logits_bf16 ? rtp_bf16_to_f32(((const uint16_t *)logits)[e]) : ((const float *)logits)[e];
        if (p[e] > max) max = p[e];
    }
    float sum = 0.f;
    for (int64_t e = 0; e < experts; e++) {
        p[e] = expf(p[e] - max);
        sum += p[e];
    }
    for (int64_t e = 0; e < experts; e++) p[e] /= sum;
    float chosen = 0.f;
    for (int64_t j = 0; j < top_k; j++) { /* top_k <= experts: some expert is always left, NaN logits too */
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++)
            if (p[e] != -1.f && (best < 0 || p[e] > p[best])) best = e;
        ids[j] = (int32_t)best;
        weights[j] = p[best];
        chosen += p[best];
        p[best] = -1.f; /* taken (probabilities are never negative) */
    }
    if (renormalize)
        for (int64_t j = 0; j < top_k; j++) weights[j] /= chosen;
}

/* x bf16 [t, hidden] (row stride ldx); logits [t, experts] (row stride ldl) bf16 or fp32; expert_slots
 * [experts, max_replicas]: the slots holding each logical expert, the first replica_count[e] of row e;
 * expert_load [experts] += pairs routed (NULL: not counted); w13 / w2 [slots]: each slot's [gate | up]
 * records (kind kind13, [2 inter, hidden]: glu tile order, or lane order with the gate rows first) and down
 * records (kind kind2, [hidden, inter]), 0 for an empty slot; order: RTP_MOE_TILES (on AVX-512 BF16),
 * RTP_MOE_AMX_TILES or RTP_MOE_LANES; out fp32 [t, hidden] (row stride ldo). Returns 0 for top_k outside 1..experts,
 * when scratch memory ran out, a pair was placed in an empty slot, or a linear kernel failed. */
int rtp_moe_experts(const uint16_t *x, int64_t ldx, const void *logits, int64_t ldl, int logits_bf16, int64_t t,
                    int64_t hidden, int64_t inter, int64_t experts, int64_t top_k, int renormalize,
                    const int64_t *expert_slots, int64_t max_replicas, const int64_t *replica_count,
                    int64_t *expert_load, int64_t slots, const int64_t *w13, const int64_t *w2, int kind13, int kind2,
                    int order, float *out, int64_t ldo) {
    if (top_k <= 0 || top_k > experts || slots <= 0 || order < RTP_MOE_TILES || order > RTP_MOE_LANES) return 0;
    const int amx = order == RTP_MOE_AMX_TILES, lanes = order == RTP_MOE_LANES;
    if (t <= 0) return 1;
    int64_t pairs = t * top_k;
    /* route: ids, weights [pairs]; p [experts]; counts and cursors [experts + slots + 1]; pair -> row */
    size_t route_bytes = (size_t)pairs * (4 + 4 + 8 + 8) + (size_t)experts * 4 + (size_t)(experts + 2 * slots + 1) * 8;
    char *r = rtp_scratch_get(&route_scratch, route_bytes);
    size_t value = lanes ? 4 : 2; /* h and y: fp32 in lane order, bf16 in tile order */
    uint16_t *xs = rtp_scratch_get(&rows_scratch, (size_t)pairs * hidden * 2);
    void *h = rtp_scratch_get(&hidden_scratch, (size_t)pairs * inter * value);
    void *y = rtp_scratch_get(&out_scratch, (size_t)pairs * hidden * value);
    float *g = lanes ? rtp_scratch_get(&glu_scratch, (size_t)pairs * 2 * inter * 4) : NULL;
    if (!r || !xs || !h || !y || (lanes && !g)) return 0;
    int32_t *ids = (int32_t *)r;
    float *weights = (float *)(ids + pairs);
    int64_t *slot_of = (int64_t *)(weights + pairs); /* a pair's slot, then its row in slot order */
    int64_t *row_of = slot_of + pairs;
    int64_t *per_expert = row_of + pairs;
    int64_t *slot_start = per_expert + experts; /* [slots + 1] */
    int64_t *cursor = slot_start + slots + 1;    /* [slots] */
    float *p = (float *)(cursor + slots);

    for (int64_t i = 0; i < t; i++)
        route_token((const char *)logits + i * ldl * (logits_bf16 ? 2 : 4), logits_bf16, experts, top_k, renormalize,
                    p, ids + i * top_k, weights + i * top_k);

    memset(per_expert, 0, (size_t)experts * 8);
    memset(slot_start, 0, (size_t)(slots + 1) * 8);
    for (int64_t q = 0; q < pairs; q++) { /* place: the pair's rank within its expert picks the replica */
        int64_t e = ids[q], rank = per_expert[e]++;
        int64_t copies = replica_count[e] > 0 ? replica_count[e] : 1;
        int64_t s = expert_slots[e * max_replicas + rank % copies];
        if (s < 0 || s >= slots || !w13[s] || !w2[s]) return 0;
        slot_of[q] = s;
        slot_start[s + 1]++;
    }
    if (expert_load)
        for (int64_t e = 0; e < experts; e++) expert_load[e] += per_expert[e];
    for (int64_t s = 0; s < slots; s++) slot_start[s + 1] += slot_start[s];
    memcpy(cursor, slot_start, (size_t)slots * 8);
    for (int64_t q = 0; q < pairs; q++) { /* gather, stable */
        int64_t row = cursor[slot_of[q]]++;
        row_of[q] = row;
        memcpy(xs + row * hidden, x + (q / top_k) * ldx, (size_t)hidden * 2);
    }

    for (int64_t s = 0; s < slots; s++) {
        int64_t first = slot_start[s], n = slot_start[s + 1] - first;
        if (!n) continue;
        const uint8_t *up = (const uint8_t *)(intptr_t)w13[s], *down = (const uint8_t *)(intptr_t)w2[s];
        if (lanes) {
            float *hs = (float *)h + first * inter;
            if (!rtp_linear_lanes(xs + first * hidden, hidden, 0, kind13, up, NULL, g, 2 * inter, 0, n, 2 * inter,
                                  hidden))
                return 0;
            silu_mul_rows(g, hs, n, inter);
            if (!rtp_linear_lanes(hs, inter, 1, kind2, down, NULL, (float *)y + first * hidden, hidden, 0, n, hidden,
                                  inter))
                return 0;
            continue;
        }
        uint16_t *hs = (uint16_t *)h + first * inter;
        if (!rtp_linear_tiles(xs + first * hidden, hidden, 0, kind13, up, NULL, hs, inter, 1, n, 2 * inter, hidden, 1,
                              amx, 0))
            return 0;
        if (!rtp_linear_tiles(hs, inter, 0, kind2, down, NULL, (uint16_t *)y + first * hidden, hidden, 1, n, hidden,
                              inter, 0, amx, 0))
            return 0;
    }

    for (int64_t i = 0; i < t; i++) { /* combine, in k order */
        float *o = out + i * ldo;
        for (int64_t c = 0; c < hidden; c++) o[c] = 0.f;
        for (int64_t j = 0; j < top_k; j++) {
            float w = weights[i * top_k + j];
            int64_t row = row_of[i * top_k + j];
            if (lanes) {
                const float *yr = (const float *)y + row * hidden;
                for (int64_t c = 0; c < hidden; c++) o[c] += w * yr[c];
            } else {
                const uint16_t *yr = (const uint16_t *)y + row * hidden;
                for (int64_t c = 0; c < hidden; c++) o[c] += w * rtp_bf16_to_f32(yr[c]);
            }
        }
    }
    return 1;
}
#endif
