"""The LLM stage: a target model, decoding steps of verified tokens, chat prompts."""
