"""The data path: where samples come from (`sources`, `streaming`), aspect-ratio buckets and the batches
planned from them (`buckets`, `bucket_plan`, `bucketed_stream`), synthetic data (`synthetic_data`), the
precomputed-latents format (`precomputed`), convert.py's readers (`convert_inputs`).

May import: `core/`, `families/`. (Not named `data/`: the root's `data.py` is the module users import as `data`.)
"""
