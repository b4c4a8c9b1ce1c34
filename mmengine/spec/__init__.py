"""Speculative decoding: drafts proposed beside the sampler, verified by the target model in one step.

    proposer.py  what the step loop asks of a proposer
    ngram.py     NgramProposer: prompt lookup over a request's own tokens (prompt and output)
    verify.py    the accept rule (the longest prefix of drafts the target's own samples repeat) and the counters
    backoff.py   DraftBackoff: a request whose drafts keep failing stops drafting for a while
    draft_head.py  start-up checks of a draft head (Qwen3.5's MTP head, an EAGLE-3 head) and its KV layers;
                 the heads are models/qwen3_5_mtp.py and models/eagle3.py, run by runner/head_drafter.py
    head_drafts.py  HeadDrafts: the drafts a head made within the step just read, handed out as prefixes

The scheduler gives a decoding request its drafts' KV slots and schedules them after its last token; the
runner samples every position; update_from_output keeps the accepted run and the first target token
after it, and rolls the recurrent states (hybrid models) back to the last accepted position.
"""

from mmengine.spec.ngram import NgramProposer, ngram_drafts
from mmengine.spec.proposer import Proposer
from mmengine.spec.verify import SpecCounters, accepted_prefix

__all__ = ["NgramProposer", "Proposer", "SpecCounters", "accepted_prefix", "ngram_drafts"]
