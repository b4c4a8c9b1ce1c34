"""Tensor parallelism: ranks in worker processes, the layers split over them, the executor that drives them.

  process_group.py      torch.distributed for one rank (gloo on CPU, NCCL on CUDA), the TP group, its collectives
  sharding.py           sizes that must divide, the KV-head rule, reading one rank's slice of a checkpoint tensor
  checkpoint_slices.py  a checkpoint's tensors as safetensors slices (a rank reads its rows), loading a parameter
  parallel_linear.py    column-, row- and merged column-parallel linear layers (q/k/v, gate/up), their weight loaders
  vocab_parallel.py     the vocabulary split: VocabParallelEmbedding and ParallelLMHead
  parallel_experts.py   MoE experts split on their intermediate size, or whole per rank (enable_expert_parallel)
  parallel_lora.py      LoRA adapters sharded like their base layers (A or B split, the row-parallel shrink reduced)
  sharded_model.py      a family's model split over the ranks (its decoder swapped for the parallel layers), loaded slice by slice
  sharded_hybrid.py     Qwen3.5's Gated DeltaNet and gated attention split by heads
  sharded_gemma.py      Gemma 3's and Gemma 4's decoders split (per-layer KV heads, scaled and per-layer embeddings)
  sharded_llama4.py     Llama 4's decoder split (q/k rows into the rotary's layout per head, transposed experts)
  encoder_data_parallel.py  mm_encoder_tp_mode="data": a step's pictures split across the ranks, the outputs shared
  rank_budget.py        one rank's weights and KV cache from a checkpoint's headers (`mmengine budget --tensor-parallel-size`)
  worker_loop.py        a worker process: join the group, build the worker, serve the driver's messages
  worker_processes.py   the driver's handle on each worker process, and how they all stop (asked, released, killed)
  executor_base.py      what every executor does: one plan to all, one reply from rank 0, steps sent ahead, death -> EngineDeadError
  executor.py           the driver over worker processes: spawn them, a pipe each, their sentinels
  ray_placement.py      the Ray backend's cluster, placement group (a bundle a rank) and each rank's GPUs
  ray_worker.py         a rank as a Ray actor: the worker loop's pieces without the pipes
  ray_executor.py       the driver over Ray actors (distributed_executor_backend="ray")
"""
