"""tfpar's Keras layers (`tfpar.layers`).

>>> import tfpar
>>> moe = tfpar.layers.MixtureOfExperts(num_experts=8, top_k=2,
...                                     intermediate_dim=256)

`MixtureOfExperts`: a mixture-of-experts feed-forward layer whose expert
banks split over the mesh's expert axis (tfpar/layers/moe.py).
"""

from tfpar.layers.moe import MixtureOfExperts

__all__ = ["MixtureOfExperts"]
