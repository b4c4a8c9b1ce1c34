"""The core: what the scheduler decides and the per-request state it decides over (no tensors here).

  request.py         MMItem, ProcessedPrompt, Request and its status: plain data, no managers
  scheduler.py       Scheduler: the token budget, admission against both caches, preemption, SchedulerOutput
  prefix_sharing.py  holding back requests whose prefix another running request is about to cache
  prefix_groups.py   block identity without a Request, and the offline grouping of a batch by shared prefix
"""
