"""One module per wire protocol, each a router that adapts its requests and replies to the engine's
(the OpenAI chat and completions routes still live in foveal/server/app.py)."""
