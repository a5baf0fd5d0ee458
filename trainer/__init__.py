"""The trainer: config, data, tokenizer, optimizer, lr schedule, metrics and the training entry point."""
