"""The training step and what it runs in: the Composer model (`model`), the run's settings (`settings`),
precisions (`precision`, `weight_casts`, `norms`, `fp8`, `cpu_convs`), the gradient's norm (`grad_norm`),
DDP or FSDP (`parallel`), `--compile` (`compiling`), the allocator and CPU threads (`allocator`,
`cpu_threads`), checkpoints and what decides the samples each step sees (`checkpoints`, `data_order`).

May import: `core/`, `families/`, `datasets/`, `eval/`.
"""
