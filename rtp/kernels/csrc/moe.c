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
 *   multiply  per slot with rows, its [gate | up] tiles with SiLU-and-mul fused, then its down
 *             tiles (rtp_linear_tiles: AMX or AVX-512 BF16, each call on all threads), rows in bf16
 *   combine   out[t] = sum over k, in k order, of weight[t, k] * y(t, k), in fp32
 *
 * Every tile kernel treats rows independently, so a row's bits do not depend on how many rows its
 * expert met, nor on which replica served it: a request's output does not depend on its
 * neighbours (docs/determinism.md). The scratch is this thread's and only grows (scratch.h). */
#if defined(__x86_64__) /* x86-64 only: the tile linears it calls are */
#include "cpu_kernels.h"

#include <math.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"

static __thread rtp_scratch route_scratch, rows_scratch, hidden_scratch, out_scratch;

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
 * records (glu tile order, kind kind13, [2 inter, hidden]) and down records (kind kind2, [hidden, inter]),
 * 0 for an empty slot; out fp32 [t, hidden] (row stride ldo). Returns 0 for top_k outside 1..experts, when
 * scratch memory ran out, a pair was placed in an empty slot, or a tile kernel failed. */
int rtp_moe_experts(const uint16_t *x, int64_t ldx, const void *logits, int64_t ldl, int logits_bf16, int64_t t,
                    int64_t hidden, int64_t inter, int64_t experts, int64_t top_k, int renormalize,
                    const int64_t *expert_slots, int64_t max_replicas, const int64_t *replica_count,
                    int64_t *expert_load, int64_t slots, const int64_t *w13, const int64_t *w2, int kind13, int kind2,
                    int amx, float *out, int64_t ldo) {
    if (top_k <= 0 || top_k > experts || slots <= 0) return 0;
    if (t <= 0) return 1;
    int64_t pairs = t * top_k;
    /* route: ids, weights [pairs]; p [experts]; counts and cursors [experts + slots + 1]; pair -> row */
    size_t route_bytes = (size_t)pairs * (4 + 4 + 8 + 8) + (size_t)experts * 4 + (size_t)(experts + 2 * slots + 1) * 8;
    char *r = rtp_scratch_get(&route_scratch, route_bytes);
    uint16_t *xs = rtp_scratch_get(&rows_scratch, (size_t)pairs * hidden * 2);
    uint16_t *h = rtp_scratch_get(&hidden_scratch, (size_t)pairs * inter * 2);
    uint16_t *y = rtp_scratch_get(&out_scratch, (size_t)pairs * hidden * 2);
    if (!r || !xs || !h || !y) return 0;
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
        if (!rtp_linear_tiles(xs + first * hidden, hidden, 0, kind13, (const uint8_t *)(intptr_t)w13[s], NULL,
                              h + first * inter, inter, 1, n, 2 * inter, hidden, 1, amx, 0))
            return 0;
        if (!rtp_linear_tiles(h + first * inter, inter, 0, kind2, (const uint8_t *)(intptr_t)w2[s], NULL,
                              y + first * hidden, hidden, 1, n, hidden, inter, 0, amx, 0))
            return 0;
    }

    for (int64_t i = 0; i < t; i++) { /* combine, in k order */
        float *o = out + i * ldo;
        for (int64_t c = 0; c < hidden; c++) o[c] = 0.f;
        for (int64_t j = 0; j < top_k; j++) {
            float w = weights[i * top_k + j];
            const uint16_t *yr = y + row_of[i * top_k + j] * hidden;
            for (int64_t c = 0; c < hidden; c++) o[c] += w * rtp_bf16_to_f32(yr[c]);
        }
    }
    return 1;
}
#endif
