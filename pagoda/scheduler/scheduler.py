"""`Scheduler`: continuous batching with chunked prefill over a paged, prefix-cached KV pool.

Each step, running requests go first (oldest first: a decode needs one token, a prefill
the rest of its prompt within the token budget), then waiting requests in FCFS order.
When a running request cannot get blocks, the most recently admitted running request is
preempted by recompute: its blocks are freed and it goes back to the front of the waiting
queue, to be re-prefilled with its whole history (mostly from the prefix cache).

`schedule()` never waits on a step's output: `num_computed_tokens` advances when a step is
scheduled, and a request whose sampled token is still in flight (`num_pending_tokens`) is
scheduled for the position of that token, which the runner fills in on the device. So the
engine can schedule step N+1 before step N's output is back; a stop seen one step late
drops the extra token.

Under pipeline parallelism several batches are in flight at once, one per stage. A request
whose sampled token is still in flight is then left out (the first stage would wait for
it, stalling the pipeline), so consecutive batches hold different requests; each scheduled
request carries the tokens sampled since it last ran, for the stages that do not sample.

Speculative decoding: a decoding request may carry up to k draft tokens (from the n-gram
proposer here, or from a draft model in the runner, which returns them with a step's output),
verified in the same step. Their KV slots are reserved and counted in the token
budget, and `num_computed_tokens` advances over them; when the output shows how many were
accepted, the rejected ones are taken back (their KV is never registered in the prefix
cache: only blocks below the corrected count are). Drafts never take a request past
max_tokens or max_model_len. Under async scheduling an n-gram request whose verify step is in
flight is scheduled again at once, so its steps overlap: the token that step emits last and
new drafts, laid out as if it accepted every draft, with slots (and budget) for that worst
case, and listed in `behind_verify`. Where those tokens really go depends on the accepted
count, which only the device knows yet: the runner moves them back by the rejected count there
(pagoda/worker/behind_verify.py), and `num_computed_tokens` is corrected one step late, when
that step's output comes. Its drafts are proposed past the step in flight (see `_propose`). A
request waits for its verify step instead when its sampling reads its output so far on the
host (a grammar, penalties, bad words, min_tokens not reached: `samples_without_history`)
or when no draft fits behind it; every request does under pipeline parallelism, with a KV
connector and where a group is not full attention (see `overlaps_verify`). With a draft
model a request whose sampling step is in flight waits too (its drafts come back with that
step), and a step that samples gets k lookahead slots past its tokens for the drafts' own KV
(see pagoda/spec_decode/draft_model.py).

Pooling requests (embeddings) are scheduled like prefills within the token budget and finish
with their vector in the step that completes their prompt. With `whole_prompt_pooling` (mean
or CLS pooling, encoders: see pagoda/pooling) a prompt runs whole in one step and reads no
prefix cache; last-token pooling chunks and hits the cache like any prompt.

A KV connector (CPU offload: `kv_offload_gib`; disaggregated prefill: `kv_role`) may supply tokens past the prefix-cache hits: the
request then waits for their load outside the queues (see `RemoteKV`), and each step carries
the connector's jobs in `kv_connector_metadata`. Loads take no token budget, so they are
started for the requests next in line even once a step is full. With
`kv_offload_prompts_first`, prompts that do not fit swap out decoding requests, which resume
from the host (`_make_room_for_prompts`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from pagoda.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagoda.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from pagoda.kv_transfer.factory import make_scheduler_connector
from pagoda.multimodal.scheduling import EncoderScheduler
from pagoda.outputs import EngineCoreOutput, FinishReason, ModelRunnerOutput, RequestStatus, SchedulerStats
from pagoda.scheduler.kv_cache_manager import KVCacheManager
from pagoda.scheduler.output import BlockIds, CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.scheduler.remote_kv import RemoteKV
from pagoda.scheduler.request import Request
from pagoda.spec_decode.ngram import NgramProposer
from pagoda.spec_decode.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        pipeline_parallel: bool = False,
        speculative_config: SpeculativeConfig | None = None,
        whole_prompt_pooling: bool = False,
        max_loras: int | None = None,
    ) -> None:
        """`max_loras`: distinct LoRA adapters the running requests may use at once (the runner's
        device slots); None: LoRA is off."""
        budget = scheduler_config.max_num_batched_tokens
        if budget is None:
            raise ValueError("scheduler_config.max_num_batched_tokens must be set before building the Scheduler")
        if scheduler_config.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {scheduler_config.max_model_len}")
        if not scheduler_config.enable_chunked_prefill and budget < scheduler_config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_model_len ({scheduler_config.max_model_len}) "
                f"when chunked prefill is off, got {budget}"
            )
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = budget
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.pipeline_parallel = pipeline_parallel
        self.whole_prompt_pooling = whole_prompt_pooling
        self.max_loras = max_loras
        self.kv_cache_manager = KVCacheManager(kv_cache_config, cache_config.enable_prefix_caching)
        connector = make_scheduler_connector(cache_config, self.kv_cache_manager)
        self.remote_kv = (
            RemoteKV(connector, self.kv_cache_manager, cache_config.kv_load_timeout_s, budget)
            if connector is not None
            else None
        )
        self.prompts_first = cache_config.kv_offload_prompts_first
        # Images' encoder runs: scheduled with the chunk that first needs them, within a budget.
        self.encoder_scheduler = EncoderScheduler(scheduler_config.max_num_encoder_input_tokens or budget)

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # In admission order: the tail is the lowest priority, preempted first.
        self.running: list[Request] = []
        # Ended since the last schedule(): reported in the next SchedulerOutput.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_speculative_tokens = 0
        self.proposer: NgramProposer | None = None
        # True when the runner's draft model proposes (each output carries the next step's drafts).
        self.drafts_from_runner = False
        self.spec_stats: SpecDecodingStats | None = None
        if speculative_config is not None:
            self.num_speculative_tokens = speculative_config.num_speculative_tokens
            self.spec_stats = SpecDecodingStats()
            self.drafts_from_runner = speculative_config.method != "ngram"
        # n-gram speculation schedules a request's next step behind its verify step in flight
        # (see `_schedule_behind_verify`), whose counts run ahead of what is computed until its
        # output comes: so only where every group is full attention (a sliding window or a
        # state frees by that count) and no KV connector moves blocks by it, and not under
        # pipeline parallelism.
        self.overlaps_verify = (
            speculative_config is not None
            and not self.drafts_from_runner
            and not pipeline_parallel
            and self.remote_kv is None
            and all(isinstance(group.kv_cache_spec, FullAttentionSpec) for group in kv_cache_config.kv_cache_groups)
        )
        if speculative_config is not None and not self.drafts_from_runner:
            self.proposer = NgramProposer(
                self.max_num_seqs,
                self.max_model_len,
                speculative_config.prompt_lookup_min,
                speculative_config.prompt_lookup_max,
                fill_drafts=speculative_config.forced_acceptance is not None,
            )

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; refuse (ValueError) one that could never run."""
        if request.request_id in self.requests or (self.remote_kv and request.request_id in self.remote_kv.held):
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if request.pooling_params is not None:
            self._check_pooling_fits(request)
        elif request.num_prompt_tokens > self.max_model_len - 1:
            raise ValueError(
                f"prompt_token_ids has {request.num_prompt_tokens} tokens; at most max_model_len - 1 = "
                f"{self.max_model_len - 1} fit, leaving a position for the first generated token"
            )
        request.length_cap = max_len = min(request.length_cap, self.max_model_len)
        # The last sampled token is never computed, so at most max_len - 1 tokens hold KV (a
        # pooling request's prompt, which may fill max_model_len, holds KV for all of it).
        num_kv_tokens = request.num_prompt_tokens if request.pooling_params is not None else max_len - 1
        num_blocks = self.kv_cache_manager.max_blocks_per_request(num_kv_tokens, self.max_num_batched_tokens)
        usable = self.kv_cache_manager.block_pool.num_usable_blocks
        if num_blocks > usable:
            raise ValueError(
                f"request {request.request_id!r} may need {num_blocks} KV cache blocks "
                f"(prompt + max_tokens up to {max_len} tokens), the pool has {usable}"
            )
        if request.mm_features:
            self.encoder_scheduler.check_fits(request.request_id, request.mm_features)
        self.kv_cache_manager.update_block_hashes(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests in any state (e.g. a stop string found by the detokenizer).

        Unknown or already finished ids are logged and dropped: an abort may race with a finish.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                logger.debug("finish (%s) of unknown or finished request %r dropped", status.name, req_id)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert self.remote_kv is not None
                self.remote_kv.abandon(request)
            else:
                self.waiting.remove(request)
            self._release(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """True while ended requests still have to be reported to the runner by a schedule(), or
        the KV connector has transfers to report (blocks held, saves in flight)."""
        return bool(self._finished_req_ids) or bool(self.remote_kv and self.remote_kv.busy)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        kv = self.kv_cache_manager
        num_scheduled: dict[str, int] = {}
        # (request, tokens scheduled for it), in scheduling order.
        scheduled: list[tuple[Request, int]] = []
        new_reqs: list[NewRequestData] = []
        preempted_req_ids: set[str] = set()
        encoder = self.encoder_scheduler
        encoder.begin_step()
        encoder_inputs: dict[str, list[int]] = {}

        spec_tokens: dict[str, list[int]] = {}
        behind_verify: set[str] = set()
        proposals = self._propose() if self.num_speculative_tokens else {}
        if self.remote_kv is not None:
            self.waiting.extendleft(reversed(self.remote_kv.expire()))
        swapped = self._make_room_for_prompts() if self.prompts_first else set()

        # The running requests' entries (never resumed ones), gathered in local lists: this loop
        # runs for every decoding request every step.
        running_ids: list[str] = []
        running_block_ids: list[BlockIds | None] = []
        running_computed: list[int] = []
        running_new_token_ids: list[list[int]] = []  # pipeline parallelism only
        drafts_from_runner = self.drafts_from_runner
        pipeline_parallel = self.pipeline_parallel
        checkpoints = kv.has_checkpoints
        running = self.running
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            index += 1
            if request.num_inflight_drafts:
                chained = self._schedule_behind_verify(request, proposals.get(request.request_id), budget)
                if chained is not None:
                    drafts, new_block_ids = chained
                    req_id = request.request_id
                    spec_tokens[req_id] = drafts
                    behind_verify.add(req_id)
                    running_ids.append(req_id)
                    running_block_ids.append(new_block_ids if any(new_block_ids) else None)
                    running_computed.append(request.num_computed_tokens)
                    num_scheduled[req_id] = 1 + len(drafts)
                    scheduled.append((request, 1 + len(drafts)))
                    budget -= 1 + len(drafts)
                continue
            if drafts_from_runner and request.num_pending_tokens:
                continue  # its drafts come back with its output: wait for it
            num_computed = request.num_computed_tokens
            num_new = min(self._num_tokens_to_compute(request), budget)
            if checkpoints:
                num_new = kv.cap_at_checkpoint(num_computed, num_new)
            images: list[int] = []
            if request.mm_features:
                num_new, images = encoder.inputs_for_chunk(
                    request.request_id, request.mm_features, num_computed, num_new
                )
            if num_new == 0 or (pipeline_parallel and request.num_pending_tokens):
                continue
            req_id = request.request_id
            proposal = proposals.get(req_id) if proposals else None
            if request.spec_token_ids:
                request.spec_token_ids = []
            drafts = self._capped_drafts(request, proposal, budget - num_new) if proposal else []
            lookahead = (
                self._draft_lookahead(request, num_computed + num_new + len(drafts)) if drafts_from_runner else 0
            )
            if drafts or lookahead:
                new_block_ids = kv.allocate_slots(request, num_new + len(drafts) + lookahead)
            elif kv.holds_tokens(request, num_computed + num_new):
                new_block_ids = ()  # the common decode step: its current block has room
            else:
                new_block_ids = None
            if new_block_ids is None:
                drafts = []  # no room for the drafts: schedule the plain step (which may preempt)
                new_block_ids = self._allocate_or_preempt(request, num_new, preempted_req_ids)
            if new_block_ids is None:
                break
            if drafts:
                spec_tokens[req_id] = drafts
                request.inflight_drafts.append(drafts)
                request.inflight_drafts_follow = True
                num_new += len(drafts)
            running_ids.append(req_id)
            running_block_ids.append(new_block_ids if any(new_block_ids) else None)
            running_computed.append(num_computed)
            if pipeline_parallel:
                first_new = max(num_computed, request.num_prompt_tokens)
                running_new_token_ids.append(request.all_token_ids[first_new:])
            num_scheduled[req_id] = num_new
            scheduled.append((request, num_new))
            budget -= num_new
            if images:
                encoder.commit(req_id, request.mm_features, images)
                encoder_inputs[req_id] = images
        cached_reqs = CachedRequestData(
            req_ids=running_ids,
            resumed_from_preemption=[False] * len(running_ids),
            resumed_token_ids=[None] * len(running_ids),
            new_block_ids=running_block_ids,
            num_computed_tokens=running_computed,
            new_token_ids=running_new_token_ids,
        )

        # After a preemption the pool is full: admitting more would only thrash. Requests whose
        # grammar still compiles are passed over (they keep their place), the others go in order.
        # So is a request whose next prompt block another request admitted now computes (a shared
        # system prompt): next step it hits that block instead of computing a copy, so the
        # requests share their prefix blocks and their decode attention reads them once (cascade).
        position = 0
        filling: set[bytes] = set()
        # Adapters of the running requests: a waiting request with another one waits (keeping its
        # place) while they fill the runner's slots, so every step has at most max_loras adapters.
        running_loras = self._running_lora_ids()
        while (
            not preempted_req_ids
            and position < len(self.waiting)
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[position]
            if request.waits_for_grammar or not self._lora_fits(request, running_loras):
                position += 1
                continue
            if request.num_pending_tokens:
                break  # preempted while its last sampled token was in flight: wait for it
            # Prompt logprobs need every prompt position computed, so such a prompt reads no cache.
            needs_whole_prompt = request.sampling_params.prompt_logprobs is not None and not request.num_output_tokens
            one_pass = self.whole_prompt_pooling and request.pooling_params is not None
            # A request back from a connector's load holds its blocks and computed tokens already.
            loaded = request.num_computed_tokens > 0
            if loaded:
                hit_blocks, num_hit_tokens = None, request.num_computed_tokens
            elif needs_whole_prompt or one_pass:
                hit_blocks, num_hit_tokens = ([], 0)
            else:
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
                if self.remote_kv is not None:
                    started = self.remote_kv.start_load(request, hit_blocks, num_hit_tokens)
                    if started is False:
                        self._unblock_waiting()
                        break
                    if started:
                        del self.waiting[position]
                        continue
            num_new = kv.cap_at_checkpoint(num_hit_tokens, request.num_tokens - num_hit_tokens)
            first_block = num_hit_tokens // kv.hash_block_size
            hashes = request.block_hashes
            if not needs_whole_prompt and first_block < len(hashes) and hashes[first_block] in filling:
                position += 1
                continue
            if num_new > budget:
                if not self.enable_chunked_prefill or one_pass:
                    break
                num_new = budget
            images = []
            if request.mm_features:
                num_new, images = encoder.inputs_for_chunk(
                    request.request_id, request.mm_features, num_hit_tokens, num_new
                )
                if num_new == 0:
                    break  # its next image waits for the next step's encoder budget
            lookahead = self._draft_lookahead(request, num_hit_tokens + num_new)
            if kv.allocate_slots(request, num_new + lookahead, hit_blocks) is None and (
                not lookahead or kv.allocate_slots(request, num_new, hit_blocks) is None
            ):
                self._unblock_waiting()
                break
            del self.waiting[position]
            self.running.append(request)
            request.num_computed_tokens = num_hit_tokens
            block_ids = kv.get_block_ids(request)
            if request.status == RequestStatus.PREEMPTED:
                _append_cached(cached_reqs, request, True, list(request.all_token_ids), block_ids, num_hit_tokens)
                if self.pipeline_parallel:
                    cached_reqs.new_token_ids.append([])
            else:
                new_reqs.append(
                    NewRequestData(
                        req_id=request.request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        sampling_params=request.sampling_params,
                        block_ids=block_ids,
                        num_computed_tokens=num_hit_tokens,
                        pooling_params=request.pooling_params,
                        lora_request=request.lora_request,
                        mm_features=request.mm_features,
                    )
                )
            request.status = RequestStatus.RUNNING
            if request.lora_request is not None:
                running_loras.add(request.lora_request.lora_int_id)
            num_scheduled[request.request_id] = num_new
            scheduled.append((request, num_new))
            budget -= num_new
            if images:
                encoder.commit(request.request_id, request.mm_features, images)
                encoder_inputs[request.request_id] = images
            filling.update(hashes[first_block : (num_hit_tokens + num_new) // kv.hash_block_size])

        if self.remote_kv is not None and not preempted_req_ids:
            self._start_loads_ahead()
        preempted_req_ids |= swapped

        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens >= len(request.all_token_ids):
                request.num_pending_tokens += 1  # the step reaches the last known token: it samples

        finished_req_ids, self._finished_req_ids = self._finished_req_ids, set()
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            scheduled_spec_decode_tokens=spec_tokens,
            behind_verify=behind_verify,
            finished_req_ids=finished_req_ids,
            freed_block_ids=kv.take_freed_block_ids(),
            preempted_req_ids=preempted_req_ids,
            scheduled_encoder_inputs=encoder_inputs,
        )
        if self.remote_kv is not None:
            output.kv_connector_metadata = self.remote_kv.connector.build_connector_meta(output)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stops, cache computed blocks, free finished requests."""
        kv = self.kv_cache_manager
        if self.remote_kv is not None and model_runner_output.kv_connector_output is not None:
            self.waiting.extendleft(reversed(self.remote_kv.update(model_runner_output.kv_connector_output)))
        computed_before = _num_computed_before(scheduler_output)
        outputs: list[EngineCoreOutput] = []
        stopped: list[tuple[Request, RequestStatus]] = []
        # Looked up per request only when the step produced any (most steps have none).
        pooler_output = model_runner_output.pooler_output
        prompt_logprobs = model_runner_output.prompt_logprobs
        draft_token_ids = model_runner_output.draft_token_ids
        verified = bool(scheduler_output.scheduled_spec_decode_tokens)
        caching = kv.enable_caching
        hash_block_size = kv.hash_block_size
        requests = self.requests
        req_id_to_index = model_runner_output.req_id_to_index
        sampled_token_ids = model_runner_output.sampled_token_ids
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue  # ended while the step ran: its late token is dropped
            index = req_id_to_index.get(req_id)
            sampled = sampled_token_ids[index] if index is not None else []
            num_rejected = self._take_back_rejected(request, scheduler_output, sampled) if verified else 0
            if caching:
                # Capped by the current count: a request preempted and resumed since then holds
                # fresh blocks, of which only those already scheduled may be cached. A step run
                # behind a verify step began where that step's accepted count put it: every
                # token but the last of the history it completes has its KV.
                if req_id in scheduler_output.behind_verify:
                    num_valid = request.num_tokens + len(sampled) - 1
                else:
                    num_valid = computed_before[req_id] + num_scheduled - num_rejected
                kv.cache_blocks(request, min(num_valid, request.num_computed_tokens))
            pooled = pooler_output.get(req_id) if pooler_output else None
            if pooled is not None:
                request.num_pending_tokens -= 1
                stopped.append((request, RequestStatus.FINISHED_STOPPED))
                outputs.append(EngineCoreOutput(req_id, [], FinishReason.STOP, pooling_output=pooled))
                continue
            if not sampled:
                continue  # a partial prefill chunk samples nothing
            request.num_pending_tokens -= 1
            status = None
            num_new = 0
            for token_id in sampled:
                request.append_output_token(token_id)
                num_new += 1
                status = self._check_stop(request, token_id)
                if status is not None:
                    break
            new_token_ids = sampled if num_new == len(sampled) else sampled[:num_new]
            if status is None:
                if caching and len(request.all_token_ids) // hash_block_size > len(request.block_hashes):
                    kv.update_block_hashes(request)
                if draft_token_ids is not None and request.status == RequestStatus.RUNNING:
                    request.spec_token_ids = draft_token_ids[index]
            else:
                stopped.append((request, status))
            num_logprobs = request.sampling_params.logprobs
            outputs.append(
                EngineCoreOutput(
                    req_id=req_id,
                    new_token_ids=new_token_ids,
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=request.stop_reason,
                    new_logprobs=model_runner_output.token_logprobs(index, num_new, num_logprobs)
                    if num_logprobs is not None
                    else None,
                    new_prompt_logprobs=prompt_logprobs.get(req_id) if prompt_logprobs else None,
                )
            )
        by_id = {output.req_id: output for output in outputs} if stopped else {}
        for request, final_status in stopped:
            if request.status != RequestStatus.RUNNING:
                self.waiting.remove(request)  # preempted while its last token was in flight
            by_id[request.request_id].kv_transfer_params = self._release(request, final_status)
        if stopped:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    # ---- state and statistics ------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decoding=self.spec_stats.copy() if self.spec_stats is not None else None,
            kv_transfer=self.remote_kv.connector.stats.copy() if self.remote_kv is not None else None,
        )

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()
        if self.remote_kv is not None:
            self.remote_kv.connector.reset()

    def check_idle(self) -> None:
        """Raise AssertionError unless no request state is left and the KV pool is whole.

        Finished ids not yet sent to the runner count as state: the engine runs one more
        schedule() to report them before it is idle.
        """
        leftovers = {
            "requests": list(self.requests),
            "running": [r.request_id for r in self.running],
            "waiting": [r.request_id for r in self.waiting],
            "finished ids not yet reported": sorted(self._finished_req_ids),
            "n-gram proposer slots": self.proposer.req_ids if self.proposer is not None else [],
            "encoder inputs": self.encoder_scheduler.req_ids,
        }
        left = {name: ids[:16] for name, ids in leftovers.items() if ids}
        if left:
            raise AssertionError(f"scheduler not idle: {left}")
        if self.remote_kv is not None:
            self.remote_kv.check_idle()
        self.kv_cache_manager.check_idle()

    # ---- helpers ----------------------------------------------------------------------------

    def _check_pooling_fits(self, request: Request) -> None:
        """A pooling prompt may fill max_model_len (nothing is generated after it); one that must
        run whole in one step must fit the step's token budget."""
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids has {request.num_prompt_tokens} tokens; at most max_model_len = "
                f"{self.max_model_len} fit (or set truncate_prompt_tokens)"
            )
        if self.whole_prompt_pooling and request.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt_token_ids has {request.num_prompt_tokens} tokens; this model pools over the whole prompt "
                f"in one step, so at most max_num_batched_tokens = {self.max_num_batched_tokens} fit"
            )

    def _running_lora_ids(self) -> set[int]:
        if self.max_loras is None:
            return set()
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _lora_fits(self, request: Request, running_loras: set[int]) -> bool:
        """Whether the request's adapter is running already or one more fits max_loras."""
        lora = request.lora_request
        if lora is None or lora.lora_int_id in running_loras:
            return True
        assert self.max_loras is not None, "a LoRA request reached a scheduler without LoRA"
        return len(running_loras) < self.max_loras

    def _propose(self) -> dict[str, list[int]]:
        """Drafts for the running requests about to decode: the draft model's from their last
        output, or n-gram drafts proposed here in one batch.

        A request with a plain step in flight is proposed for from its known history (one token
        stale): k + 1 tokens are drafted and the first, the guess of the token in flight, dropped.
        One with a verify step in flight (see `_schedule_behind_verify`) likewise, past the
        accepted count guessed for that step: all its drafts where they were proposed from the
        history they extend, none where they came from a guess that proved wrong (then that
        step most likely accepts nothing). A wrong guess costs acceptance, never correctness:
        verification keeps only the model's own samples, wherever the drafts came from.
        """
        proposer = self.proposer
        candidates = []
        unverified: list[list[int]] = []
        for request in self.running:
            if request.num_inflight_drafts:
                if not self._may_run_behind_verify(request):
                    continue
                guess = request.inflight_drafts[-1] if request.inflight_drafts_follow else []
                request.assumed_accepted = len(guess)
                unverified.append(guess)
            elif request.num_pending_tokens <= 1 and self._num_tokens_to_compute(request) == 1:
                unverified.append([])
            else:
                continue
            candidates.append(request)
        if self.drafts_from_runner:
            return {r.request_id: r.spec_token_ids for r in candidates if r.spec_token_ids and not r.num_pending_tokens}
        if not candidates:
            return {}
        assert proposer is not None
        slots = [proposer.sync(request.request_id, request.all_token_ids) for request in candidates]
        k = self.num_speculative_tokens
        drafts, counts = proposer.propose(slots, k + 1, unverified)
        proposals = {}
        for row, request in enumerate(candidates):
            skip = request.num_pending_tokens
            if counts[row] > skip:
                proposals[request.request_id] = drafts[row, skip : min(counts[row], skip + k)].tolist()
        return proposals

    def _may_run_behind_verify(self, request: Request) -> bool:
        """Whether the request's next step may be scheduled while its verify step is in flight."""
        return (
            self.overlaps_verify
            and len(request.inflight_drafts) == 1
            and request.num_pending_tokens == 1
            and request.samples_without_history
        )

    def _schedule_behind_verify(
        self, request: Request, proposal: list[int] | None, budget: int
    ) -> tuple[list[int], BlockIds] | None:
        """Schedule a request whose verify step is in flight, so its steps overlap: the token that
        step emits last and new drafts after it, as (drafts, new block ids); None: it waits.

        The host does not know how many drafts the step in flight accepts, so the step is laid
        out as if it accepted all (`num_computed_tokens` already counts them) with slots for
        that worst case; the runner moves its tokens back by the rejected count on the device,
        from that step's output (see `GPUModelRunner`), and the host takes them back one step
        late, when that output comes (`_take_back_rejected`). A step with no drafts to verify
        gains nothing over waiting, and one that does not fit waits too (it never preempts).
        """
        if not proposal or not self._may_run_behind_verify(request):
            return None
        drafts = self._capped_drafts(request, proposal, budget - 1, request.num_inflight_drafts + 1)
        if not drafts:
            return None
        new_block_ids = self.kv_cache_manager.allocate_slots(request, 1 + len(drafts))
        if new_block_ids is None:
            return None
        request.inflight_drafts.append(drafts)
        return drafts, new_block_ids

    def _capped_drafts(
        self, request: Request, drafts: list[int], budget: int, in_flight: int | None = None
    ) -> list[int]:
        """The drafts that fit the token budget left and keep every token the step may emit (the
        drafts and one more) within max_tokens and max_model_len, past the `in_flight` tokens
        (at most) still to come from the steps in flight (default: one per pending sample)."""
        if in_flight is None:
            in_flight = request.num_pending_tokens
        room = self.max_model_len - request.num_tokens - in_flight - 1
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - in_flight - 1)
        return drafts[: max(0, min(room, budget))]

    def _draft_lookahead(self, request: Request, end: int) -> int:
        """Slots past a step's tokens (which end at `end`) for the KV of the drafts a draft model
        proposes after it (k, within max_model_len), when the step samples; 0 otherwise."""
        if not self.drafts_from_runner or end < request.num_tokens:
            return 0
        return max(0, min(self.num_speculative_tokens, self.max_model_len - end))

    def _take_back_rejected(self, request: Request, scheduler_output: SchedulerOutput, sampled: list[int]) -> int:
        """After a verify step: count its acceptance and un-compute its rejected drafts (their slots
        are rewritten by the next tokens); the number rejected."""
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = len(spec_tokens.get(request.request_id, ())) if spec_tokens else 0
        if not num_drafts:
            return 0
        request.inflight_drafts.popleft()
        if not sampled:
            return 0
        num_rejected = num_drafts + 1 - len(sampled)
        if request.inflight_drafts:  # its successor's drafts assumed an accepted count for it
            request.inflight_drafts_follow = request.assumed_accepted == num_drafts - num_rejected
        assert self.spec_stats is not None
        self.spec_stats.observe(num_drafts, num_drafts - num_rejected)
        if request.status == RequestStatus.RUNNING:  # a preempted one restarts from 0 anyway
            request.num_computed_tokens -= num_rejected
        return num_rejected

    def _num_tokens_to_compute(self, request: Request) -> int:
        """Tokens a running request still needs; 0 once its in-flight tokens reach a length cap
        (a pooling request needs the rest of its prompt, which may fill max_model_len)."""
        if request.pooling_params is not None:
            return request.num_prompt_tokens - request.num_computed_tokens
        num_tokens = len(request.all_token_ids) + request.num_pending_tokens
        if num_tokens >= request.length_cap:
            return 0
        return num_tokens - request.num_computed_tokens

    def _start_loads_ahead(self) -> None:
        """Loads take no step budget: once the step is full, start those of the waiting
        requests next in line (FCFS, up to the first that cannot load), so their KV crosses
        PCIe while this step computes and they are ready when budget frees up."""
        assert self.remote_kv is not None
        kv = self.kv_cache_manager
        position = 0
        while position < len(self.waiting) and len(self.running) + len(self.remote_kv.loading) < self.max_num_seqs:
            request = self.waiting[position]
            if request.num_computed_tokens:
                position += 1  # back from its load
                continue
            if (
                request.waits_for_grammar
                or request.num_pending_tokens
                or (request.sampling_params.prompt_logprobs is not None and not request.num_output_tokens)
                or (self.whole_prompt_pooling and request.pooling_params is not None)
            ):
                return
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            if not self.remote_kv.start_load(request, hit_blocks, num_hit_tokens):
                return
            del self.waiting[position]

    def _unblock_waiting(self) -> None:
        """A waiting request did not fit. With nothing running, nothing would ever free blocks
        but the waiting requests back from a KV load, which hold theirs: they let them go (the
        blocks stay in the prefix cache) and look them up again when their turn comes."""
        if self.running or self.remote_kv is None:
            return
        for request in self.waiting:
            if request.num_computed_tokens:
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted_req_ids: set[str]) -> BlockIds | None:
        """Allocate for a running request, preempting from the tail of `running` until it fits.

        Returns the new block ids, or None when the request had to preempt itself.
        """
        while (new_block_ids := self.kv_cache_manager.allocate_slots(request, num_new)) is None:
            victim = self.running.pop()
            self._preempt(victim)
            self.waiting.appendleft(victim)
            preempted_req_ids.add(victim.request_id)
            if victim is request:
                return None
        return new_block_ids

    def _preempt(self, victim: Request) -> None:
        """Free a running request's blocks; it restarts from its prefix-cache hits (and, with a
        KV connector, the tokens the connector supplies)."""
        self.kv_cache_manager.free(victim)
        self.encoder_scheduler.free(victim.request_id)
        if self.proposer is not None:
            self.proposer.remove(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.spec_token_ids = []
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1

    def _make_room_for_prompts(self) -> set[str]:
        """kv_offload_prompts_first: the blocks the prompts at the head of the queue take this
        step (as `allocate_slots` counts them: their host hits and first chunks within the step
        budget, and their device hits that sit free), freed by swapping out decoding requests
        that were never preempted, newest first. The swapped requests go to the back of the
        queue; their blocks stay cached and go to the host as they are evicted. Returns their ids."""
        assert self.remote_kv is not None
        kv = self.kv_cache_manager
        need, budget = 0, self.max_num_batched_tokens
        for request in self.waiting:
            if request.num_output_tokens or request.waits_for_grammar or budget <= 0:
                break
            if request.num_computed_tokens:  # back from its load: its first chunk's blocks are held
                budget -= request.num_tokens - request.num_computed_tokens
                continue
            hit_blocks, num_hits = kv.get_computed_blocks(request)
            external = self.remote_kv.connector.get_num_new_matched_tokens(request, num_hits)
            chunk = min(request.num_tokens - num_hits - external, budget)
            budget -= chunk
            need += sum(
                manager.num_blocks_to_allocate(request.request_id, num_hits + external + chunk, blocks)
                for manager, blocks in zip(kv.managers, hit_blocks, strict=True)
            )
        swapped: set[str] = set()
        while need > kv.block_pool.num_free_blocks:
            victim = next((r for r in reversed(self.running) if r.num_output_tokens and not r.num_preemptions), None)
            if victim is None:
                break
            self.running.remove(victim)
            self._preempt(victim)
            self.waiting.append(victim)
            swapped.add(victim.request_id)
        return swapped

    @staticmethod
    def _check_stop(request: Request, token_id: int) -> RequestStatus | None:
        """After `token_id` joined the request: a stop token past min_tokens (its stop reason when
        one of stop_token_ids), else the length cap (max_tokens or max_model_len), else None."""
        if token_id in request.ending_token_ids and len(request.output_token_ids) >= request.sampling_params.min_tokens:
            if token_id in request.sampling_params.stop_token_ids:
                request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if len(request.all_token_ids) >= request.length_cap:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _release(self, request: Request, status: RequestStatus) -> dict[str, Any] | None:
        """Finish a request already taken out of its queue: free its blocks, report its id;
        returns the KV connector's `kv_transfer_params` for its response."""
        request.status = status
        kv_transfer_params = None
        if self.remote_kv is not None:
            kv_transfer_params = self.remote_kv.release(request)
        else:
            self.kv_cache_manager.free(request)
        self.encoder_scheduler.free(request.request_id)
        if self.proposer is not None:
            self.proposer.remove(request.request_id)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
        return kv_transfer_params


def _append_cached(
    data: CachedRequestData,
    request: Request,
    resumed: bool,
    resumed_token_ids: list[int] | None,
    new_block_ids: BlockIds | None,
    num_computed_tokens: int,
) -> None:
    data.req_ids.append(request.request_id)
    data.resumed_from_preemption.append(resumed)
    data.resumed_token_ids.append(resumed_token_ids)
    data.new_block_ids.append(new_block_ids)
    data.num_computed_tokens.append(num_computed_tokens)


def _num_computed_before(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's computed-token count before the step ran."""
    cached = scheduler_output.scheduled_cached_reqs
    computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    computed.update((new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs)
    return computed
