"""Training: the compiled step (plain and pipelined), the one update, AdamW and schedules,
evaluation, the loop, its logs, metrics and fault handling, and fine-tuning."""
