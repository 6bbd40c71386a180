"""Tensor parallelism: one model served by several processes, one per device.

Rank 0 is the serving process: it schedules, samples and talks HTTP; ranks 1..N-1 are worker
processes it starts and supervises (:mod:`.launcher`, :mod:`.worker`). Every rank holds a
shard of every layer (:mod:`.shard`: Megatron-style column/row split, vocabulary-parallel
embedding and LM head, GQA KV heads split or replicated) and its own heads of the paged KV
cache; rank 0 broadcasts each step's batch (:mod:`.control`) and every rank runs the same
forward, meeting at one all-reduce per row-parallel layer (:mod:`.group`). The engine above
(scheduler, block manager, prefix cache, speculation) is unchanged: it sees one model.
"""
