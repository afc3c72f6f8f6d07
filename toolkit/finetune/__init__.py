"""Fine-tuning entry points: `finetune_full` and `finetune_lora` (QLoRA with --quantize)."""
