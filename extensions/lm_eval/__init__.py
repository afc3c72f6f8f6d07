"""Evaluation with lm-evaluation-harness, in process: see README.md.

Importing this package imports nothing heavy; `extensions.lm_eval.model` (which needs `lm_eval`)
holds `ToolkitLM`, registered with the harness as the model "toolkit".
"""
