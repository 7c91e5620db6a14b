"""The token embedding: `nn.Embedding` without its random init.

Models are built on the meta device and filled from the checkpoint (models/__init__.py build_model);
`nn.Embedding.__init__` would still draw normal_ values, and on a meta tensor torch runs that through
its Python references, importing torch._dynamo: ~0.9 s of every start-up on the 2-vCPU host, for
values nobody reads. Random weights (`--load-format dummy`) come from loader/dummy.py instead.
"""

from __future__ import annotations

from torch import nn


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass
