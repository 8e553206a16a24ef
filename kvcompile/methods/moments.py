"""What a latent page format calibrates on: per layer and KV head, second moments of the keys, values and queries
the model produces (``calibration.latent`` measures them; ``kernels.latent`` builds the basis its rows are stored in
from them; ``artifact`` ships them with an exported model)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Moments(NamedTuple):
    """One layer's calibration, per KV head: uncentered second moments [Hkv, D, D] of its keys (before RoPE), values
    and queries (before RoPE, its GQA group's pooled), and the keys' mean [Hkv, D]. A decorrelating basis reads the
    first two, a score-preserving one the keys, queries and mean."""

    keys: Tensor
    values: Tensor
    queries: Tensor
    key_mean: Tensor
