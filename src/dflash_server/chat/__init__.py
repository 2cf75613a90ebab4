"""The Qwen chat format: template rendering and checkpoints, think markers, tool-call XML,
grammars for tools and structured output, the thinking budget, token names for logprobs."""
