"""One module per wire protocol, each a router that adapts its requests and replies to the engine's:
openai (chat completions, completions), embeddings, anthropic (Messages), responses (OpenAI
Responses). The chat protocols share one neutral request (server/chat_input.py) and one stream of
output events (parsing/output.py)."""
