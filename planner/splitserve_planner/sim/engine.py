"""One pod's engine, step by step, scheduled as the runtime's scheduler does it
(:mod:`splitserve_runtime.engine.scheduler`): decodes first, then continuing prefill chunks,
then FCFS admission within the token budget and ``max_num_seqs``, with a prefix-cache lookup
at admission. A step's duration is the :class:`~splitserve_planner.perf_model.StepCost` of its
exact mix of prefill chunks and decodes.

Decoding sequences are aggregates (count and ``Σ(context_at_join − step_at_join)``) plus a
heap of finish steps, so a decode step is O(1); runs of identical-batch decode steps are one
event (a *macro step*), cut short at the next step boundary when new work arrives.

Speculative decoding (:mod:`..speculation`) is modelled in expectation: a simulated step still
advances every decoding sequence one token, and where the pod speculates (decodes only, at most
the rule's ``max_num_seqs`` of them) it costs a verification forward over the expected tokens
per forward ``E``. Its ITL samples are what the runtime records: per forward, one gap of the
whole forward and ``E − 1`` gaps of zero. A step that carries prefill chunks is priced without
speculation (its chunks progress once per forward, its decodes would progress ``E`` times), which
understates the gain of aggregated pods a little; decode pods never mix.
"""

from __future__ import annotations

import heapq
import math

from ..perf_model import prefill_attention_pairs
from ..speculation import verify_step_seconds
from .state import MAX_MACRO_STEPS, NO_CHUNKS, STEP_END, TRANSFER_DONE, Job, Pod, SimState


def _decode_token_seconds(pod: Pod, num_seqs: int, context_tokens: int) -> float:
    """Seconds per simulated step of ``num_seqs`` decoding sequences over ``context_tokens``.
    A simulated step advances every sequence one token; where the pod speculates, a
    verification forward yields ``E`` tokens per sequence, so a step costs ``forward / E``."""
    spec = pod.speculation
    if spec.applies(num_seqs):
        return (
            verify_step_seconds(
                pod.perf, batch_size=num_seqs, num_context_tokens=context_tokens, num_tokens=spec.num_tokens
            )
            / spec.tokens_per_forward
        )
    return pod.perf.step_seconds(
        num_tokens=num_seqs,
        num_seqs=num_seqs,
        num_attention_pairs=context_tokens + num_seqs,
        num_kv_tokens=context_tokens,
    )


class _Batch:
    """The step being assembled: the token budget left and the inputs of its cost."""

    __slots__ = (
        "budget",
        "num_tokens",
        "num_seqs",
        "pairs",
        "kv_tokens",
        "chunks",
        "decode_context",
        "prefill_tokens",
        "prefill_pairs",
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_tokens = 0
        self.num_seqs = 0
        self.pairs = 0
        self.kv_tokens = 0
        self.chunks: list[tuple[Job, int]] = []
        self.decode_context = 0
        self.prefill_tokens = 0
        self.prefill_pairs = 0

    def add_decodes(self, num_seqs: int, context_tokens: int) -> None:
        """``num_seqs`` sequences each decoding one token over ``context_tokens`` in total."""
        self.num_tokens += num_seqs
        self.num_seqs += num_seqs
        self.pairs += context_tokens + num_seqs
        self.kv_tokens += context_tokens
        self.budget -= num_seqs
        self.decode_context += context_tokens

    def add_chunk(self, job: Job, take: int, computed: int) -> None:
        """``take`` prompt tokens of ``job`` after ``computed`` already in the KV cache."""
        self.chunks.append((job, take))
        pairs = prefill_attention_pairs(num_new_tokens=take, num_computed_tokens=computed)
        self.pairs += pairs
        self.prefill_pairs += pairs
        self.prefill_tokens += take
        self.kv_tokens += computed
        self.num_tokens += take
        self.budget -= take


class EngineModel(SimState):
    """Engine steps of every pod: start, end, preemption, prefill completion, finishing."""

    # ------------------------------------------------------------------ starting a step
    def _start_step(self, pod: Pod) -> None:
        if self.fleet.exponential_service_rate is not None:
            self._start_exponential(pod)
            return
        if not pod.waiting and not pod.prefilling and self._start_decode_step(pod):
            return
        self._start_mixed_step(pod)

    def _start_decode_step(self, pod: Pod) -> bool:
        """Fast path, nothing to prefill: one decode step, or a macro step of ``k`` identical
        ones. False when the decodes' next KV slots do not fit (the mixed path preempts)."""
        n = pod.n_dec
        if n == 0:
            self._went_idle(pod)
            return True
        ctx = n * pod.step_index + pod.dec_offset
        if pod.prefill_kv + ctx + n > pod.capacity:
            return False
        dt = _decode_token_seconds(pod, n, ctx)
        k = 1
        pod.macro_dt0 = dt
        if self.macro_steps and pod.finish_heap:
            k = min(pod.finish_heap[0][0] - pod.step_index, (pod.capacity - pod.prefill_kv - ctx) // n, MAX_MACRO_STEPS)
            if k > 1:  # k identical-batch steps in one event; context grows n per step
                last = ctx + (k - 1) * n
                last_dt = _decode_token_seconds(pod, n, last)
                pod.macro_delta = (last_dt - dt) / (k - 1)
                dt = k * (dt + last_dt) / 2
            else:
                k = 1
        pod.busy = True
        pod.step_start_s = self.now
        pod.cur_prefill = NO_CHUNKS
        pod.cur_dt = dt
        pod.cur_tokens_per_forward = pod.speculation.tokens_per_forward if pod.speculation.applies(n) else 1.0
        pod.macro_k = k
        pod.cur_prefill_tokens = pod.cur_prefill_pairs = 0
        pod.cur_decode_rows, pod.cur_decode_context = n, ctx
        pod.step_end_s = self.now + dt
        self.seq += 1
        heapq.heappush(self.events, (pod.step_end_s, self.seq, STEP_END, pod))
        return True

    def _went_idle(self, pod: Pod) -> None:
        """No step to run; a removed pod with nothing left has drained and gives its GPU back."""
        pod.busy = False
        if not pod.accepting and pod.gone_s < 0 and pod.is_idle() and not pod.inbound:
            pod.gone_s = self.now

    def _start_mixed_step(self, pod: Pod) -> None:
        """Decodes, then continuing prefill chunks, then admission; the step's cost is its mix."""
        engine = pod.engine
        batch = _Batch(engine.max_batched_tokens)
        preempted = self._schedule_decodes(pod, batch)
        self._schedule_chunks(pod, batch)
        static = engine.batching == "static"
        if static and pod.n_dec == 0 and not pod.prefilling:
            pod.batch_open = True
        if not preempted and (not static or pod.batch_open):
            self._admit_waiting(pod, batch, static=static)
            if static:
                pod.batch_open = False
        if batch.num_tokens == 0:
            self._went_idle(pod)
            return
        chunks = batch.chunks
        pod.cur_tokens_per_forward = 1.0
        if not chunks and pod.speculation.applies(batch.num_seqs):  # decodes only: they may speculate
            dt = _decode_token_seconds(pod, batch.num_seqs, batch.kv_tokens)
            pod.cur_tokens_per_forward = pod.speculation.tokens_per_forward
        else:  # a step with prefill chunks is priced without speculation (see the module docstring)
            n_seqs = batch.num_seqs + sum(1 for job, take in chunks if job.num_computed + take == job.num_tokens)
            dt = pod.perf.step_seconds(
                num_tokens=batch.num_tokens,
                num_seqs=max(n_seqs, 1),
                num_attention_pairs=batch.pairs,
                num_kv_tokens=batch.kv_tokens,
            )
        pod.busy = True
        pod.step_start_s = self.now
        pod.cur_prefill = chunks
        pod.cur_dt = dt
        pod.macro_k = 1
        pod.cur_prefill_tokens, pod.cur_prefill_pairs = batch.prefill_tokens, batch.prefill_pairs
        pod.cur_decode_rows, pod.cur_decode_context = batch.num_seqs, batch.decode_context
        pod.step_end_s = self.now + dt
        self._push(pod.step_end_s, STEP_END, pod)

    def _schedule_decodes(self, pod: Pod, batch: _Batch) -> bool:
        """1. Every decoding sequence needs one more KV slot: preempt the newest until they fit.
        True when something was preempted (then nothing new is admitted this step)."""
        preempted = False
        while pod.n_dec and pod.kv_used + pod.n_dec > pod.capacity:
            if not self._preempt_newest(pod):
                break
            preempted = True
        n = pod.n_dec
        if n:
            batch.add_decodes(n, n * pod.step_index + pod.dec_offset)
        return preempted

    def _schedule_chunks(self, pod: Pod, batch: _Batch) -> None:
        """2. Continuing prefill chunks, oldest first."""
        chunked = pod.engine.chunked_prefill
        for job in pod.prefilling:
            if batch.budget <= 0:
                break
            take = min(job.num_tokens - job.num_computed, batch.budget)
            if not chunked and take < job.num_tokens - job.num_computed:
                continue
            if pod.kv_used + take > pod.capacity:
                break
            batch.add_chunk(job, take, job.num_computed)
            pod.prefill_kv += take

    def _admit_waiting(self, pod: Pod, batch: _Batch, *, static: bool) -> None:
        """3. Admission, FCFS, within the budget (static batching: regardless of it) and
        ``max_num_seqs``, until the head of the queue does not fit."""
        max_num_seqs = pod.engine.max_num_seqs
        while pod.waiting and (batch.budget > 0 or static) and pod.num_running < max_num_seqs:
            job = pod.waiting[0]
            if job.kv_ready:  # a transferred sequence joins the decode batch at once
                keep_going = self._admit_transferred(pod, job, batch)
            else:
                keep_going = self._admit_prompt(pod, job, batch)
            if not keep_going:
                break

    def _admit_transferred(self, pod: Pod, job: Job, batch: _Batch) -> bool:
        """The head of the queue arrived with its KV. False: it does not fit now (stop)."""
        if pod.kv_used + job.num_tokens + 1 > pod.capacity or batch.budget <= 0:
            if pod.num_running == 0 and job.num_tokens + 1 > pod.capacity:
                self._release_overflow(pod.waiting.popleft())  # can never fit: drop it (counted unfinished)
                return True
            return False
        pod.waiting.popleft()
        self._admit_decoded(pod, job)
        batch.add_decodes(1, job.num_tokens)
        return True

    def _admit_prompt(self, pod: Pod, job: Job, batch: _Batch) -> bool:
        """The head of the queue needs prefill: a prefix-cache lookup, then its first chunk.
        False: it does not fit now, or whole-prompt prefill does not fit the budget (stop)."""
        cached = self._prefix_hit(pod, job)
        take = min(job.num_tokens - cached, max(batch.budget, 0))
        if not pod.engine.chunked_prefill and take < job.num_tokens - cached:
            return False
        if pod.kv_used + cached + take > pod.capacity:
            if pod.num_running == 0 and cached + take > pod.capacity:
                self._release_overflow(pod.waiting.popleft())  # can never fit: drop it (counted unfinished)
                return True
            return False
        pod.waiting.popleft()
        if job.start_s < 0:
            job.start_s = self.now
            self.prefill_cached[pod.role] += cached
        job.num_computed = cached
        job.num_cached = cached
        pod.prefill_kv += cached
        pod.prefilling.append(job)
        if take:
            batch.add_chunk(job, take, cached)
            pod.prefill_kv += take
        return True

    def _prefix_hit(self, pod: Pod, job: Job) -> int:
        req = job.req
        if not pod.engine.prefix_caching or req.prefix_group < 0 or req.prefix_group not in pod.lru:
            return 0
        pod.lru.move_to_end(req.prefix_group)
        block = pod.engine.block_size
        return min((req.num_prefix_tokens // block) * block, ((job.num_tokens - 1) // block) * block)

    def _admit_decoded(self, pod: Pod, job: Job) -> None:
        """A transferred sequence (its first token already sampled) starts decoding."""
        job.pod = pod
        if job.first_token_s < 0:
            job.first_token_s = self.now
            if self.observing:
                self.window_ttft.append(self.now - job.req.arrival_seconds)
        if job.start_s < 0:
            job.start_s = self.now
        if job.remaining <= 0:
            self._finish(job)
            return
        self._join_decode(pod, job, ctx=job.num_tokens)

    def _join_decode(self, pod: Pod, job: Job, *, ctx: int) -> None:
        job.join_step = pod.step_index
        job.join_ctx = ctx
        pod.n_dec += 1
        pod.dec_offset += ctx - pod.step_index
        pod.counter += 1
        heapq.heappush(pod.finish_heap, (pod.step_index + job.remaining, pod.counter, job, job.epoch))
        pod.dec_stack.append((job, job.epoch))

    def _leave_decode(self, pod: Pod, job: Job) -> None:
        pod.n_dec -= 1
        pod.dec_offset -= job.join_ctx - job.join_step
        job.epoch += 1

    def _preempt_newest(self, pod: Pod) -> bool:
        """Free the newest running sequence's KV and re-queue it for recompute."""
        if pod.prefilling:
            job = pod.prefilling.pop()
            pod.prefill_kv -= job.num_computed
            job.num_computed = 0
        else:
            while pod.dec_stack:
                job, epoch = pod.dec_stack.pop()
                if epoch == job.epoch and job.finish_s < 0:
                    break
            else:
                return False
            generated = pod.step_index - job.join_step  # tokens decoded here since joining
            self._leave_decode(pod, job)
            job.num_tokens = job.join_ctx + generated + 1
            job.remaining -= generated
            job.kv_ready = False
            job.num_computed = 0
        self.preemptions[pod.role] += 1
        pod.waiting.appendleft(job)
        return True

    def _truncate_macro_step(self, pod: Pod) -> None:
        """New work arrived during a k-step event: end it at the next step boundary instead.

        Step j of the run lasts ``dt0 + j·delta`` (context grows by the batch each step), so
        the first j steps end at ``S(j) = j·dt0 + delta·j(j-1)/2``: find the smallest j with
        ``S(j) >= elapsed``."""
        elapsed = self.now - pod.step_start_s
        dt0, delta = pod.macro_dt0, pod.macro_delta
        if delta > 1e-15:  # solve delta/2 j^2 + (dt0 - delta/2) j - elapsed = 0
            b = dt0 - delta / 2
            done = math.ceil((-b + math.sqrt(b * b + 2 * delta * elapsed)) / delta - 1e-9)
        else:
            done = math.ceil(elapsed / dt0 - 1e-9)
        done = min(pod.macro_k, max(1, done))
        if done == pod.macro_k:
            return
        pod.macro_k = done
        pod.cur_dt = done * dt0 + delta * done * (done - 1) / 2
        pod.step_end_s = pod.step_start_s + pod.cur_dt
        self._push(pod.step_end_s, STEP_END, pod)

    def _step_end(self, pod: Pod) -> None:
        dt = pod.cur_dt
        if pod.exp_job is not None:
            pod.busy_seconds += dt
            job, pod.exp_job = pod.exp_job, None
            job.first_token_s = self.now
            if self.observing:
                self.window_ttft.append(self.now - job.req.arrival_seconds)
            self._finish(job)
            if self.central and not pod.waiting:
                self._pull_central(pod)
            self._start_exponential(pod)
            return
        pod.busy_seconds += dt
        n = pod.n_dec
        k = pod.macro_k
        self._count_step(pod, dt, k)
        if n:
            pod.dec_seq_seconds += n * dt
            pod.decode_tokens += n * k
            if pod.step_start_s >= self.measure_from:
                tokens_per_forward = pod.cur_tokens_per_forward
                if tokens_per_forward > 1.0:  # a forward's accepted tokens arrive together
                    self.itl_values.extend((dt / k * tokens_per_forward, 0.0))
                    self.itl_weights.extend((n * k / tokens_per_forward, n * k * (1.0 - 1.0 / tokens_per_forward)))
                else:
                    self.itl_values.append(dt / k)
                    self.itl_weights.append(n * k)
            if self.observing:
                self.window_itl.append((dt / k * pod.cur_tokens_per_forward, n * k))
        pod.kv_seconds += (pod.prefill_kv + n * (pod.step_index + k / 2) + pod.dec_offset) * dt
        pod.step_index += k
        heap = pod.finish_heap
        step = pod.step_index
        while heap and heap[0][0] <= step:
            _, _, job, epoch = heapq.heappop(heap)
            if epoch != job.epoch:
                continue
            self._leave_decode(pod, job)
            self._finish(job)
        if pod.cur_prefill:
            for job, take in pod.cur_prefill:
                job.num_computed += take
                self.prefill_computed[pod.role] += take
                if job.num_computed >= job.num_tokens:
                    self._prefill_done(pod, job)
            pod.cur_prefill = NO_CHUNKS
        if self.central and not pod.waiting:
            self._pull_central(pod)
        self._start_step(pod)

    @staticmethod
    def _count_step(pod: Pod, dt: float, k: int) -> None:
        """Add the ended event (``k`` steps) to the pod's engine-step counters; a macro step's
        context grows by its rows each step, so its context sum is ``k·ctx + rows·k(k−1)/2``."""
        counters = pod.counters
        rows = pod.cur_decode_rows
        context = k * pod.cur_decode_context + rows * k * (k - 1) // 2
        counters.steps += k
        counters.seconds += dt
        counters.prefill_tokens += pod.cur_prefill_tokens
        counters.prefill_attention_pairs += pod.cur_prefill_pairs
        counters.decode_rows += rows * k
        counters.decode_context_tokens += context
        if not pod.cur_prefill_tokens:
            counters.decode_only_steps += k
            counters.decode_only_seconds += dt
            counters.decode_only_rows += rows * k
            counters.decode_only_context_tokens += context

    def _prefill_done(self, pod: Pod, job: Job) -> None:
        pod.prefilling.remove(job)
        req = job.req
        if pod.engine.prefix_caching and req.prefix_group >= 0 and pod.engine.prefix_cache_groups:
            pod.lru[req.prefix_group] = None
            pod.lru.move_to_end(req.prefix_group)
            while len(pod.lru) > pod.engine.prefix_cache_groups:
                pod.lru.popitem(last=False)
        job.remaining -= 1  # the step that completed the prompt sampled a token
        if pod.role == "prefill":
            pod.prefill_kv -= job.num_tokens
            job.prefill_done_s = self.now
            job.kv_ready = True
            target = self._choose_decode()
            target.inbound += 1
            seconds = (
                self.fleet.kv_transfer_latency_seconds
                + job.num_tokens * self.perf.kv_bytes_per_token / self.fleet.kv_link_bytes_per_second
            )
            self._push(self.now + seconds, TRANSFER_DONE, (job, target))
            return
        pod.prefill_kv -= job.num_tokens
        if job.first_token_s < 0:
            job.first_token_s = self.now
            if self.observing:
                self.window_ttft.append(self.now - job.req.arrival_seconds)
        if job.remaining <= 0:
            self._finish(job)
            return
        self._join_decode(pod, job, ctx=job.num_tokens)

    @staticmethod
    def _release_overflow(job: Job) -> None:
        """An overflow request has ended: its prompt no longer counts on its decode pod."""
        if job.overflow_tokens and job.pod is not None:
            job.pod.overflow_tokens -= job.overflow_tokens
        job.overflow_tokens = 0

    def _finish(self, job: Job) -> None:
        job.finish_s = self.now
        self._release_overflow(job)
        req = job.req
        if req.arrival_seconds < self.measure_from:
            return
        self.num_measured += 1
        ttft = job.first_token_s - req.arrival_seconds
        e2e = self.now - req.arrival_seconds
        self.ttft.append(ttft)
        self.ttft_prefill.append(job.prefill_done_s - req.arrival_seconds if job.prefill_done_s >= 0 else ttft)
        self.e2e.append(e2e)
        outputs = req.num_output_tokens
        self.tpot.append((e2e - ttft) / (outputs - 1) if outputs > 1 else 0.0)
        self.arrivals.append(req.arrival_seconds)
        self.queue.append(job.start_s - req.arrival_seconds)
        self.output_tokens += outputs

    # ------------------------------------------------------------------ validation mode
    def _start_exponential(self, pod: Pod) -> None:
        if not pod.waiting:
            pod.busy = False
            return
        job = pod.waiting.popleft()
        job.start_s = self.now
        rate = self.fleet.exponential_service_rate
        assert rate is not None
        dt = float(self.rng.exponential(1.0 / rate))
        pod.busy = True
        pod.exp_job = job
        pod.cur_dt = dt
        pod.step_start_s = self.now
        pod.step_end_s = self.now + dt
        self._push(pod.step_end_s, STEP_END, pod)
