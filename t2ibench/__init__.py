"""The parts the benchmark's commands are built from; the commands themselves stay at the root.

One concern per module, importing nothing from the root (docs/design.md draws the layout):
`families/` (a model family is one module: the interface, SD2, the registry), `model` (the training
step every family shares), `objectives`, `callbacks/` (one Composer callback per module), `checks`
and `flags` (benchmark.py's checks; the flags benchmark.py and latents.py share), `runtime`,
`sources`, `locations`, `streaming`, `errors`, `cli`, `sampling`, `images`, `mds`, `tokenizer`,
`flops`, `scale`, `stack` (the installed torch and stack, `python -m t2ibench.commands.stack`).
"""
