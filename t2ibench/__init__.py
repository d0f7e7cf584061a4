"""The parts the benchmark's commands are built from; the commands themselves stay at the root.

One concern per module, in folders by concern, lowest first; a folder imports only the folders below it
(each folder's `__init__.py` says which; tests/test_layout.py checks the rule; docs/design.md draws it),
and nothing here imports from the root:

    core/        errors, cli, locations, files, images, tokenizer, mds: what every part shares
    families/    the model families (one module each, the registry), their objectives and FLOPs
    datasets/    sources, Streaming, buckets, synthetic data, the precomputed format, convert.py's readers
    eval/        the validation loss, FID and CLIP score, sampling, the validation curve
    train/       the Composer model, settings, precisions, DDP/FSDP, --compile, checkpoints
    memory/      counted on the meta device: the memory model and a step's kernels
    costs/       cost.py's measurements, arithmetic and table; the size of a full run
    callbacks/   one Composer callback per module
    commands/    the commands' own parts: benchmark.py's flags, checks, phases, summary; latents.py's; the stack
"""
