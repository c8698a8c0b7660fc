"""Text handling shared by the offline engine API and the gateway: tokenizer, chat template,
incremental detokenization and stop strings. Torch-free, so the gateway image stays slim."""
