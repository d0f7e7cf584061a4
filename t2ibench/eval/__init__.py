"""Evaluation: MLPerf's validation loss (`validation`), FID and CLIP score (`image_metrics`), the
samplers and the sampling loop (`sampling`), the validation curve's picture (`eval_curve`).

May import: `core/`, `families/`, `datasets/`.
"""
