"""The OpenAI-compatible HTTP server (FastAPI). See app.py for routes, protocol.py for the models."""
