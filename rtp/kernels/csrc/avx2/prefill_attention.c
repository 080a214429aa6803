/* Prefill attention on the avx2 path: causal, grouped-query, varlen attention of a step plan's prompt
 * chunks over the paged KV cache (rtp_prefill_attention_bf16's contract: attention/prefill_attention.c;
 * `amx` means nothing here).
 *
 * Row r of the plan (first_row <= r < first_row + nseq) brings query tokens [qsl[r], qsl[r + 1]) of q and
 * out (bf16 [T, H, D]) at positions seq_lens[r] - n .. seq_lens[r] - 1 of its sequence, whose keys (the
 * chunk's own included) are already in the cache behind tables[r * ldt ...]. Token i sees keys up to its
 * own position (its last `window` of them with window > 0). Tokens outside every row are left alone.
 *
 * Threading: one task per (row, tile of up to ATTN_ROWS / G consecutive tokens, kv head), so that a task
 * attends up to 16 (token, query head) rows and each K and V row it widens serves all of them; tasks go to
 * threads dynamically, a row's last tiles (the most keys) first.
 *
 * Determinism: each query runs paged_attention.h's per-query math over its own keys, in steps aligned to
 * absolute key positions; the tile it shares changes only which loads it shares. So a query's bits do not
 * depend on the other rows, the thread count, where its chunk or tile starts, or whether decode
 * (decode_attention.c) or prefill attends it. */
#if defined(__x86_64__) /* x86-64 only (AArch64: csrc/arm/) */
#include <omp.h>

#include "paged_attention.h"

AVX2_TARGET int rtp_prefill_attention_bf16_avx2(const uint16_t *q, const void *k_cache, const void *v_cache,
                                                int64_t tok_stride, const int32_t *qsl, const int32_t *seq_lens,
                                                const int32_t *tables, int64_t ldt, int64_t first_row, int64_t nseq,
                                                uint16_t *out, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                                                float scale, int64_t window, int amx, const float *k_scales,
                                                const float *v_scales, float softcap) {
    (void)amx;
    if (nseq <= 0) return 1;
    int64_t G = H / Hkv, tile = ATTN_ROWS / G, esize = k_scales ? 1 : 2;
    const paged_kv kv = {(const char *)k_cache, (const char *)v_cache, tok_stride * esize, D * esize,
                         k_scales, v_scales, Hkv, block_size, D, scale, softcap, window};
    int64_t ntasks = 0;
    for (int64_t i = 0; i < nseq; i++) {
        int64_t r = first_row + i, n = qsl[r + 1] - qsl[r];
        if (n > 0 && seq_lens[r] >= n) ntasks += (n + tile - 1) / tile * Hkv;
    }
#pragma omp parallel
    {
        unsigned csr = rtp_flush_denormals();
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < ntasks; u++) {
            /* the row holding task u: rows are few, a walk costs nothing beside a task's attention */
            int64_t i = 0, rest = u, r = first_row, n = 0, tiles = 0;
            for (;; i++) {
                r = first_row + i;
                n = qsl[r + 1] - qsl[r];
                tiles = n > 0 && seq_lens[r] >= n ? (n + tile - 1) / tile : 0;
                if (rest < tiles * Hkv) break;
                rest -= tiles * Hkv;
            }
            int64_t h = rest % Hkv, t0 = (tiles - 1 - rest / Hkv) * tile; /* last tiles first */
            int64_t tokens = n - t0 < tile ? n - t0 : tile, token = qsl[r] + t0;
            const query_run run = {q + (token * H + h * G) * D, out + (token * H + h * G) * D, H * D,
                                   seq_lens[r] - n + t0, tokens, G};
            attend_query_run(&kv, tables + r * ldt, h, &run);
        }
        rtp_restore_denormals(csr);
    }
    return 1;
}
#endif
