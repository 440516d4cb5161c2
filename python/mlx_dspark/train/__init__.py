"""`mlx-dspark distill`: train DSpark / DFlash drafters for any target, in MLX.

data.py        prompts (JSONL + a built-in set) -> the target's own answers (batched)
forward.py     the drafter's training forward: many blocks at once, the block attention mask
losses.py      CE + L1(TV) + BCE(confidence), position decay, masks
trainer.py     AdamW, warmup + cosine, clipping, progress, checkpoints, resume
checkpoint.py  DeepSpec-layout config/weights, training state
export.py      the compact export (no embed/lm_head copies) for shipping
evaluate.py    held-out mean acceptance length per domain through the real verify loop
pipeline.py    all of it, end to end (what the CLI runs)
"""
