"""Prometheus metrics, named as vLLM names them with an `rtp:` prefix.

Latencies are histograms observed on the event loop as the engine's updates
arrive (so they include the hop from the engine thread, as a client would see
it). Engine state -- running and waiting requests, KV blocks, preemptions,
prefix-cache counters -- is read at scrape time from the snapshot the engine
thread publishes after every step, so a scrape never touches the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.model_name = model_name

        def histogram(name, doc, buckets):
            return Histogram(f"rtp:{name}", doc, list(labels), buckets=buckets,
                             registry=self.registry).labels(**labels)

        def counter(name, doc):
            return Counter(f"rtp:{name}", doc, list(labels), registry=self.registry).labels(**labels)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.",
                             _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Time from arrival to the start of the engine step that gave the first "
                               "token (long prompts prefilled in chunks count their earlier chunks).",
                               _REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter("rtp:request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._success_by_reason = {reason: self._success.labels(model_name, reason)
                                   for reason in ("stop", "length", "abort", "error")}
        # prefill/decode disaggregation (rtp/server/pd/)
        self._pd_events = Counter("rtp:pd_events", "Disaggregation events: reserved, reserve_full, "
                                  "reserve_refused, peer_unreachable, push_broken, lease_expired, decoding "
                                  "(decode side); decoded, local, failed, aborted (prefill side, per request).",
                                  ["model_name", "event"], registry=self.registry)
        self.kv_bytes_sent = counter("pd_kv_sent_bytes", "KV bytes pushed to decode nodes.")
        self.kv_bytes_received = counter("pd_kv_received_bytes", "KV bytes received from prefill nodes.")
        self.kv_transfer = histogram("pd_kv_transfer_seconds", "One request's KV push, first layer out to the "
                                     "decode node's acknowledgement (prefill side).", _LATENCY_BUCKETS)
        self.kv_transfer_tail = histogram("pd_kv_transfer_tail_seconds", "From the prefill's first token to the "
                                          "decode node's acknowledgement of the KV: the part of the transfer the "
                                          "prefill of later layers did not hide.", _LATENCY_BUCKETS)
        self.read_stats: Callable[[], dict] = dict  # set by whoever owns the engine
        self.read_healthy: Callable[[], bool] = lambda: True  # likewise: False once the engine died
        self.registry.register(_EngineCollector(self))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total and friends

    # -- called by AsyncEngine on the event loop ---------------------------------------------------

    def on_first_token(self, stream, prompt: int, now: float, step_started: float) -> None:
        self.ttft.observe(now - stream.arrival)
        self.queue.observe(max(0.0, step_started - stream.arrival))
        self.prompt_tokens.inc(len(stream.prompts[prompt]))

    def on_token(self, gap: float) -> None:
        self.itl.observe(gap)

    def on_update(self, stream, update, now: float) -> None:
        if update.error is not None:
            self._success_by_reason["error"].inc()
            return
        tokens = 0
        for choice in update.choices:
            tokens += choice.num_tokens
            if choice.finish_reason is not None:
                self._success_by_reason.get(choice.finish_reason, self._success_by_reason["stop"]).inc()
        if tokens:
            self.generation_tokens.inc(tokens)
        if update.finished:
            self.e2e.observe(now - stream.arrival)

    def pd_event(self, event: str) -> None:
        self._pd_events.labels(self.model_name, event).inc()

    def on_kv_sent(self, nbytes: int, seconds: float, tail: float) -> None:
        self.kv_bytes_sent.inc(nbytes)
        self.kv_transfer.observe(seconds)
        self.kv_transfer_tail.observe(max(0.0, tail))

    def on_kv_received(self, nbytes: int) -> None:
        self.kv_bytes_received.inc(nbytes)

    def on_abort(self, stream) -> None:
        self._success_by_reason["abort"].inc(stream.unfinished)


class _EngineCollector:
    """Gauges and counters read from the engine thread's latest stats snapshot."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.read_stats()
        name = [self.metrics.model_name]

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(f"rtp:{metric}", doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(f"rtp:{metric}", doc, labels=["model_name"])
            c.add_metric(name, value)
            return c

        yield gauge("engine_healthy", "1 while the engine can run requests, 0 once it failed (the server "
                    "then exits).", 1.0 if self.metrics.read_healthy() else 0.0)
        yield gauge("num_requests_running", "Sequences in the running batch.", s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.get("num_waiting", 0))
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                    s.get("kv_cache_usage", 0.0))
        if s.get("spec_verifications") is not None:
            # vLLM's spec_decode counters, under rtp's prefix
            yield counter("spec_decode_num_drafts", "Decode steps of a request that verified drafted tokens.",
                          s["spec_verifications"])
            yield counter("spec_decode_num_draft_tokens", "Tokens drafted (speculative decoding).",
                          s["spec_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Drafted tokens the model kept.",
                          s["spec_accepted_tokens"])
            yield counter("spec_decode_num_emitted_tokens", "Tokens emitted by steps that verified drafts (kept "
                          "drafts and the model's own token after them).", s["spec_emitted_tokens"])
        if s.get("speculation"):  # the speculation governor's measured costs (rtp/engine/speculation_governor.py)
            g = GaugeMetricFamily("rtp:spec_decode_seconds_per_token", "Measured seconds a decode step took per "
                                  "token it emitted, with drafts and without, by batch size (the largest of its "
                                  "bucket): drafting happens where it is the cheaper.",
                                  labels=["model_name", "batch_size", "drafts"])
            for batch, costs in s["speculation"].items():
                for drafts, key in (("yes", "draft_ms_per_token"), ("no", "plain_ms_per_token")):
                    if key in costs:
                        g.add_metric([*name, batch, drafts], costs[key] / 1e3)
            yield g
        if "prefill_budget" in s:
            yield gauge("prefill_budget_tokens", "Prompt tokens the latest step could take beside decoding requests "
                        "(sized from measured step costs: --step-time-target).", s["prefill_budget"])
        # free = truly free + evictable (cached by the prefix cache, unreferenced): what can be allocated
        yield gauge("num_free_blocks", "KV blocks free to allocate, evictable cached ones included.",
                    s.get("free_blocks", 0) + s.get("evictable_blocks", 0))
        yield gauge("num_used_blocks", "KV blocks held by requests (running, reserved or handed off).",
                    s.get("used_blocks", 0))
        yield gauge("num_requests_reserved", "Decode node: reservations whose KV has not all arrived.",
                    s.get("num_reserved", 0))
        yield counter("num_preemptions", "Sequences preempted (recomputed) for want of KV blocks.",
                      s.get("num_preemptions", 0))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_query_tokens", 0))
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.get("prefix_cache_hit_tokens", 0))
        # scrapes run on the event loop's thread, so this is the CPU the HTTP side has used
        # (parsing, tokenizing, SSE encoding, metrics): the server's own overhead next to
        # process_cpu_seconds_total, which adds the engine's threads
        yield counter("event_loop_cpu_seconds", "CPU time of the event loop thread.", time.thread_time())
        grammar = s.get("grammar")
        if grammar:  # structured outputs (rtp/engine/grammar/)
            yield from self._grammar(grammar, name, counter)
        eplb = s.get("eplb")
        if eplb:  # --enable-eplb on a MoE model (rtp/engine/expert_balancer.py)
            yield from self._eplb(eplb, name, gauge, counter)
        tiers = s.get("kv_tiers")
        if tiers:  # --kv-host-cache-gb / --kv-disk-cache (rtp/engine/kv_tiers/)
            yield from self._kv_tiers(tiers, name, gauge, counter)

    def _kv_tiers(self, t: dict, name: list[str], gauge, counter):
        def by_tier(metric, doc, kind, values):
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"rtp:{metric}", doc, labels=["model_name", "tier"])
            for tier, value in values.items():
                family.add_metric([*name, tier], value)
            return family

        disk = t.get("disk", {})
        yield by_tier("kv_tier_hit_tokens", "Prompt tokens found in each KV cache tier (the pool: before the tiers "
                      "were looked up) and loaded from it.", "counter",
                      {"pool": t["pool_tokens"], "host": t["host_tokens"], "disk": t["disk_tokens"]})
        yield counter("kv_tier_miss_tokens", "Prompt tokens past every tier's hit (computed).", t["missed_tokens"])
        yield by_tier("kv_tier_loaded_bytes", "Bytes of KV loaded from a tier (disk: read into host memory; host: "
                      "copied into the pool).", "counter", {"host": t["host_bytes_loaded"], "disk": t["disk_bytes_read"]})
        yield by_tier("kv_tier_load_seconds", "Seconds spent loading KV from a tier.", "counter",
                      {"host": t["host_seconds"], "disk": t["disk_seconds"]})
        yield by_tier("kv_tier_stored_bytes", "Bytes of KV each tier holds now.", "gauge",
                      {"host": t["host"]["bytes"], **({"disk": disk["bytes"]} if disk else {})})
        d = CounterMetricFamily("rtp:kv_tier_decisions", "Requests whose tier hit was loaded or recomputed, by which "
                                "measured cheaper.", labels=["model_name", "decision"])
        d.add_metric([*name, "load"], t["decided_load"])
        d.add_metric([*name, "recompute"], t["decided_recompute"])
        yield d
        if disk:
            yield counter("kv_tier_disk_written_bytes", "Bytes of KV block files written.", disk["bytes_written"])
            yield counter("kv_tier_disk_corrupt_files", "Block files skipped as corrupt, truncated or foreign "
                          "(their tokens recomputed).", disk["corrupt_skipped"])
            yield counter("kv_tier_disk_write_errors", "Block file writes that failed (the first turns writing off).",
                          disk["write_errors"])
            yield gauge("kv_tier_disk_writable", "1 while the disk tier stores blocks, 0 once a write failed.",
                        1.0 if disk["writable"] else 0.0)

    def _grammar(self, g: dict, name: list[str], counter):
        from rtp.engine.grammar import COMPILE_BUCKETS

        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, COMPILE_BUCKETS), "+Inf"], g["compile_buckets"]):
            cumulative += count
            buckets.append((bound, cumulative))
        h = HistogramMetricFamily("rtp:grammar_compile_seconds", "Time to build one structured output's grammar "
                                  "(each distinct one once; later requests hit the cache).", labels=["model_name"])
        h.add_metric(name, buckets, g["compile_seconds"])
        yield h
        yield counter("grammar_steps", "Engine steps with rows under a grammar.", g["steps"])
        yield counter("grammar_rows", "Rows sampled under a grammar.", g["rows"])
        yield counter("grammar_bitmask_seconds", "Seconds filling the token bitmask of constrained rows (on a thread of its own, "
                      "beside the forward: not all of it adds to a step).",
                      g["fill_seconds"])
        yield counter("grammar_advance_seconds", "Seconds advancing grammars by the sampled tokens.",
                      g["advance_seconds"])
        refused = CounterMetricFamily("rtp:grammar_refused", "Structured outputs refused with a 400 (limits: past "
                                      "a --grammar-max-* bound, before any compile; invalid: would not build or "
                                      "admits no output; timeout: past --grammar-compile-timeout) or whose compile "
                                      "was dropped because every client waiting for it had gone (cancelled).",
                                      labels=["model_name", "cause"])
        for cause, count in g.get("refused", {}).items():
            refused.add_metric([*name, cause], count)
        yield refused

    def _eplb(self, eplb: dict, name: list[str], gauge, counter):
        ratio = GaugeMetricFamily("rtp:eplb_rank_load_ratio", "Most over least loaded rank's routed tokens, per "
                                  "MoE layer, over the window the last plan was made from, as the placement "
                                  "then in use served it (NaN before the first plan, +Inf if a rank had none).",
                                  labels=["model_name", "layer"])
        planned = GaugeMetricFamily("rtp:eplb_planned_rank_load_ratio", "The same for the plan made from that "
                                    "window, on that window (the placement now in use).",
                                    labels=["model_name", "layer"])
        replicas = GaugeMetricFamily("rtp:eplb_replicas", "Expert replicas (slots holding a second or later "
                                     "copy) per MoE layer.", labels=["model_name", "layer"])
        for layer, (r, p, n) in enumerate(zip(eplb["rank_load_ratio"], eplb["planned_rank_load_ratio"],
                                               eplb["replicas"])):
            ratio.add_metric([*name, str(layer)], r)
            planned.add_metric([*name, str(layer)], p)
            replicas.add_metric([*name, str(layer)], n)
        yield ratio
        yield planned
        yield replicas
        yield gauge("eplb_rank_load_ratio_max", "The worst MoE layer's max/min rank load (as served).",
                    eplb["rank_load_ratio_max"])
        yield gauge("eplb_rank_load_ratio_mean", "Mean over MoE layers of max/min rank load (as served, finite ones).",
                    eplb["rank_load_ratio_mean"])
        yield gauge("eplb_spare_slots", "Slots per MoE layer preallocated for replicas.", eplb["spare_slots"])
        yield counter("eplb_rebalances", "Expert placements applied.", eplb["rebalances"])
        yield counter("eplb_move_seconds", "Seconds spent moving expert weights between slots.",
                      eplb["move_seconds"])
        # the KV pool grown into the memory of dropped replicas (its blocks are in num_free/used_blocks)
        yield gauge("eplb_kv_blocks_lent", "KV blocks the pool holds now in the memory of dropped expert replicas.",
                    eplb["kv_blocks_lent"])
        yield counter("eplb_kv_blocks_gained", "KV blocks lent to the pool when expert replicas were dropped.",
                      eplb["kv_blocks_gained"])
        yield counter("eplb_kv_blocks_returned", "KV blocks handed back by the pool for expert replicas.",
                      eplb["kv_blocks_returned"])
        yield counter("eplb_kv_waits", "Plans with replicas put off because lent KV blocks were still in use.",
                      eplb["kv_waits"])
