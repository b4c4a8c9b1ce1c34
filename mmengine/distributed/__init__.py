"""Tensor parallelism: ranks in worker processes, the layers split over them, the executor that drives them.

  process_group.py      torch.distributed for one rank (gloo on CPU, NCCL on CUDA), the TP group, its collectives
  sharding.py           sizes that must divide, the KV-head rule, reading one rank's slice of a checkpoint tensor
  checkpoint_slices.py  a checkpoint's tensors as safetensors slices (a rank reads its rows), loading a parameter
  parallel_linear.py    column-, row- and merged column-parallel linear layers (q/k/v, gate/up), their weight loaders
  vocab_parallel.py     the vocabulary split: VocabParallelEmbedding and ParallelLMHead
  worker_loop.py        a worker process: join the group, build the worker, serve the driver's messages
  worker_processes.py   the driver's handle on each worker process, and how they all stop (asked, released, killed)
  executor.py           the driver: spawn the workers, one plan to all, one reply from rank 0, death -> EngineDeadError
"""
