"""Where work goes: the router's entry policies, the central queue, the overflow of a full
prefill pool to the decode pods (the router's ``--prefill-overflow-tokens``), and the decode
target of a finished prefill (the decode pod with the most KV headroom)."""

from __future__ import annotations

from ..workload import Request
from .config import PREFIX_AFFINITY_LOAD_PENALTY_BLOCKS
from .state import Job, Pod, SimState


class Router(SimState):
    """Routing of arrivals (prefix affinity, least load, round robin, central queue)."""

    def _arrive(self, req: Request) -> None:
        job = Job(req)
        if self.observing:
            self.window_arrivals.append(req)
        if self.fleet.router_policy == "central-queue":
            for pod in self.pools[self.entry_role]:
                if pod.accepting and pod.is_idle():
                    self._enqueue(pod, job)
                    return
            self.central.append(job)
            return
        overflow = self._overflow_target()
        if overflow is not None:
            self.overflowed += 1
            job.overflow_tokens = job.num_tokens
            overflow.overflow_tokens += job.num_tokens
            self._enqueue(overflow, job)
            return
        self._enqueue(self._choose_entry(job), job)

    @staticmethod
    def _queued_prompt_tokens(pod: Pod) -> int:
        """Uncached prompt tokens waiting or being prefilled on ``pod`` (its
        ``splitserve_prompt_tokens_waiting``, not stale as a poll would be)."""
        waiting = sum(j.num_tokens - j.num_computed for j in pod.waiting if not j.kv_ready)
        return waiting + sum(j.num_tokens - j.num_computed for j in pod.prefilling)

    def _overflow_target(self) -> Pod | None:
        """The decode pod an arrival prefills on because every prefill pod is full, or None
        (as :meth:`splitserve_runtime.router.proxy.Router._overflow_exclusions`)."""
        limit = self.fleet.prefill_overflow_tokens
        if limit <= 0 or self.entry_role != "prefill":
            return None
        prefill = [p for p in self.pools["prefill"] if p.accepting]
        if not prefill or min(self._queued_prompt_tokens(p) for p in prefill) < limit:
            return None
        room = [
            p
            for p in self.pools["decode"]
            if p.accepting and max(self._queued_prompt_tokens(p), p.overflow_tokens) < limit
        ]
        return self._choose_decode(room) if room else None

    def _enqueue(self, pod: Pod, job: Job) -> None:
        job.pod = pod
        pod.waiting.append(job)
        if not pod.busy:
            self._start_step(pod)
        elif pod.macro_k > 1:
            self._truncate_macro_step(pod)

    def _pull_central(self, pod: Pod) -> None:
        if self.central and pod.accepting and not pod.waiting and pod.role == self.entry_role:
            self._enqueue(pod, self.central.popleft())

    def _load(self, pod: Pod) -> int:
        if pod.role == "aggregated":
            return len(pod.waiting) + len(pod.prefilling) + pod.n_dec
        return len(pod.waiting) + len(pod.prefilling)

    def _choose_entry(self, job: Job) -> Pod:
        pods = [p for p in self.pools[self.entry_role] if p.accepting]
        policy = self.fleet.router_policy
        if policy == "round-robin":
            self.rr += 1
            return pods[self.rr % len(pods)]
        group = job.req.prefix_group
        if policy == "least-load" or group < 0:
            return min(pods, key=lambda p: (self._load(p), p.num_running, p.index))
        blocks = job.req.num_prefix_tokens // self.engine.block_size

        def score(p: Pod) -> tuple[float, int]:
            matched = blocks if group in p.lru else 0
            return matched - PREFIX_AFFINITY_LOAD_PENALTY_BLOCKS * self._load(p), hash((p.index, group))

        return max(pods, key=score)

    def _choose_decode(self, pods: list[Pod] | None = None) -> Pod:
        if pods is None:
            pods = [p for p in self.pools["decode"] if p.accepting]
        return min(pods, key=lambda p: (p.kv_used / p.capacity + 0.1 * (len(p.waiting) + p.inbound), p.n_dec, p.index))
