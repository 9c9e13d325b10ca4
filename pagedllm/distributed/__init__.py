"""Tensor parallelism over torch.distributed: gloo on the CPU, NCCL on CUDA.

`group.py`: what one rank is (`TPInfo`: rank, size, the compute group) and its collectives.
`executor.py`: rank 0's side: starting the workers, sending each step's plan, shutdown, faults.
`worker.py`: the other ranks' loop: receive a step, run the shard, join the collectives.
"""
