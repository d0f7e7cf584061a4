"""The commands' own parts: benchmark.py's flags (`flags`, shared with latents.py), its checks before
anything is built (`checks`, `data_checks`), its phases (`runtime`, `gpu_setup`) and its summary
(`summary`); latents.py's output folder and encoding (`latent_store`, `latent_encoding`); the installed
stack (`stack`, `python -m t2ibench.commands.stack`).

May import: every other folder of `t2ibench/`; nothing in `t2ibench/` imports it.
"""
