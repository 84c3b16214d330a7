"""A toy layer kind, "toy_dense_attention": plain causal softmax attention (attention.py) as a K3 decoder layer's token mixer.

Importing this package registers the kind (k3train.models.k3.mixers); a model then holds it where
K3ModelArgs.layer_kinds names it, e.g. get_preset("tiny", layer_kinds={2: "toy_dense_attention"}).
"""

from k3train.models.k3.mixers import register_mixer
from k3train.models.toy_dense_attention.attention import KIND, DenseAttention

register_mixer(KIND, DenseAttention)

__all__ = ["KIND", "DenseAttention"]
