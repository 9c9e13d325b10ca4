"""Tensor and pipeline parallelism over torch.distributed: gloo on the CPU, NCCL on CUDA.

Rank 0's side, the engine's executor:
- `executor.py`: what every kind shares (`Executor`): where the ranks come from (spawned here, or
  torchrun's), waiting for them, their sizes, the cache operations they repeat, stopping them.
- `tensor_parallel.py`: `TPExecutor`, each step's plan to the shards. `pipeline.py`:
  `PipelineExecutor`, each step's plan to the stages and the first stage run.
The other ranks' side:
- `worker.py`: a rank's life (`rank_main`) and a tensor-parallel shard's loop; `stage.py`: a
  pipeline stage's loop; `group.py`: what one rank is (`TPInfo`) and its collectives;
  `messages.py`: the step plan on the wire; `p2p.py`: the stage-to-stage link; `stage_kv.py`:
  a stage's own KV cache.
"""
