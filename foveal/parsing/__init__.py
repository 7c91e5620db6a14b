"""Parsers that turn raw model output into OpenAI message fields (reasoning, tool calls)."""
