"""The plan builders' tunable constants, in one frozen record.

The builders take a :class:`Tunables` (default :data:`TUNABLES`) instead of reading module
globals: a test or a user passes another one (``placement.build(shape, mask,
tunables=Tunables(burst_groups=1))``) rather than patching a module, and the plan check digests
the runtime's record as a whole (:func:`megatron_mesh.runtime.agreement.plan_code`), so a field
added here is covered without another edit. Ranks that built with different values would make op
lists that do not match.

The values, and why:

* ``own_call_tokens`` (128): a document with fewer query tokens than this in a block shares one
  masked kernel call with the block's other small documents (the runtime cuts that call into
  mask pieces); a larger one gets a call of its own, causal or full where it can -- a kernel call
  costs about as much as the causal block of a ~500-token document on an H100, so small
  documents are not worth a call each.
* ``burst_groups`` (8) and ``group_tokens`` (1,024): a burst plan (TASP) pulls a rank's remote
  K/V in up to ``burst_groups`` groups of about equal work, in shift order, each one round over
  all links, and returns each group's partials in a round of its own: a group's blocks start
  once its tokens are in, and its dK/dV partials travel while the next group computes. Each
  group costs a round's latency, a kernel call and a merge of its rows, so a rank makes one
  group per ``group_tokens`` pulled tokens (a rank reading little keeps one fused call).
  Planner, 256 GPUs (32 x 8), 1M tokens, GQA 32/8, a2a+tasp U 8 on the balanced layout:
  lognormal:16384 documents 15.44 ms with one pull and one return round -> 13.73 with 8 return
  groups -> 13.39 with 8 pull groups too (4 return groups: 14.27; 16: 13.79); one 512K document
  + lognormal:4096 98.3 -> 81.6 ms; lognormal:4096 3.31 -> 3.34 ms (its ranks pull little);
  TASP alone: lognormal:16384 55.9 -> 44.8 ms, lognormal:4096 12.8 -> 12.5 ms. The simulated
  times move by a few % either way with ``group_tokens`` (4,096: TASP on lognormal:4096
  13.9 ms; 16,384: a2a+tasp on lognormal:16384 14.1 ms). Those were measured with the host free;
  with the host priced (stop 62, seeds 0-2 of each mix) fewer groups suit a2a+tasp U 8 on
  lognormal:4096 (one group per 12,000 pulled tokens: 5 % faster) and not lognormal:16384 (up to 2 %
  slower), and a count by work (pairs x query heads, one group per 1.2e8) instead of tokens gave
  U 8 on lognormal:4096 5-7 % but U 4 up to 6 % and plain TASP on a balanced layout up to 7 %
  slower: kept as it is (docs/performance.md, "What did not work").
* (``keep_limit``, the budget of what ``backward_chunks="auto"`` keeps, was one until stop 63; it
  is the modes' ``backward_keep_limit`` now, a user's memory-for-time setting:
  :data:`~.sparse_needs.KEEP_LIMIT`.)
* ``portion_work`` (1.0) and ``node_portion_work`` (0.5): the balanced layout cuts a document
  whose work is above this fraction of the mean per-rank (per-node, in the nodes-first pass of a
  layout for the plain modes) work into zigzag portions of at most this much work each (smaller
  portions pack better; fewer move less). Measured with the planner at 256 GPUs (32 x 8, 1M
  tokens of lognormal:4096,1 documents, seeds 0-3), half a node's work per portion in the node
  pass: TASP 19.0 -> 12.8, 22.2 -> 15.5, 14.4 -> 14.1 and 18.7 -> 18.7 ms, ring 27.9 -> 16.7 ms
  (seed 0); lognormal:16384: TASP 58.7 -> 55.9 ms. The Ulysses groups keep ``portion_work``
  (their node pass moved a2a+tasp U 4 by -1 % to +4 %). :func:`~.balance.balanced_layout` takes
  both as arguments too.
* ``polish_ranks`` (16), ``polish_tokens`` (4,096) and ``polish_sims`` (12): a mask-aware plan of
  at most ``polish_ranks`` ranks with at least ``polish_tokens`` tokens per rank is polished by
  simulation (:mod:`.polish`: how many of its own block's calls each rank runs first), within
  ``polish_sims`` simulations of each direction (the first one included; 1 turns it off). A
  simulation of an 8-rank plan of 8K tokens per rank costs 2-18 ms here and a polished plan
  30-100 ms, one simulation of 256 ranks seconds: hence the rank limit. Below ~4K tokens per rank
  an attention layer takes a millisecond or two, and a search that costs as much as the micro-
  batch's attention -- on a thread that shares the GIL with the host issuing the step's kernels --
  is not worth its few percent (it also kept the test suite 40 s shorter than at 1,024). Planner, 8
  GPUs, 64K tokens of lognormal:4096,1.0, seeds 0-9 (docs/performance.md, "Polished by
  simulation"), Mesh on its owners layout / ring / TASP on the balanced layout, x the compute floor
  on average: 1.231 / 1.313 / 1.348 unpolished; 1.212 / 1.285 / 1.279 with 8 simulations, 1.211 /
  1.272 / 1.273 with 12, 1.210 / 1.270 / 1.273 with 16 (a fifth more build time than 12); an
  exhaustive search 1.210 / 1.269 / 1.282.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Tunables", "TUNABLES"]


@dataclass(frozen=True)
class Tunables:
    """The plan builders' tunable constants (see the module docstring for each one's why)."""

    own_call_tokens: int = 128
    burst_groups: int = 8
    group_tokens: int = 1024
    portion_work: float = 1.0
    node_portion_work: float = 0.5
    polish_ranks: int = 16
    polish_tokens: int = 4096
    polish_sims: int = 12


TUNABLES = Tunables()  # what the builders and the runtime use unless given another
