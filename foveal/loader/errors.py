"""The one exception the loading layer raises.

Every failure to turn a `--model` value into config, tokenizer and weights (missing path, corrupt file,
unsupported architecture, hub unreachable) surfaces as ModelLoadError with a message that says what
failed and where; the underlying exception is chained (`raise ... from e`). Nothing else lives here.
"""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the path/repo and what went wrong."""
