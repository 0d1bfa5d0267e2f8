"""Whether tfpar's plans split a model's output head over the vocabulary:
the one answer `tfpar.plan`'s layouts (`search`) and `tfpar.estimate`'s
default (`vocab_parallel=None`) share.

A head is split when the model has one (`transformer.vocab_head`), the
model axis t divides its vocabulary without sequence parallelism
(`transformer.vocab_parallel`), and `tfpar.auto_rules(vocab_parallel=True)`
gives it a `VocabParallel` rule on a layer holding the vocabulary: a Dense
or EinsumDense head, keras-hub's `ReversibleEmbedding`, keras-hub's
`MaskedLMHead` (the table it holds). A head auto_rules does not split — a
tied projection written by hand in a layer of the user's — stays whole
(its table split by hidden, the partial logits all-reduced).

>>> import keras_hub, tfpar
>>> from tfpar.planner import head_rules, profile
>>> gpt2 = profile.build_without_weights(lambda: keras_hub.models.GPT2CausalLM(
...     keras_hub.models.GPT2Backbone(vocabulary_size=1024, num_layers=2,
...         num_heads=4, hidden_dim=64, intermediate_dim=128,
...         max_sequence_length=32), preprocessor=None))
>>> rules = head_rules.vocab_rules(profile.profile_model(gpt2, 32), gpt2, 4)
>>> dict(rules.items())["token_embedding"]
VocabParallel(axis='model')
"""

import warnings

from tfpar import auto_plan
from tfpar import styles
from tfpar.planner import cost as cost_lib
from tfpar.planner import transformer as transformer_lib


def vocab_rules(profile, model, t, sequence_parallel=False):
    """auto_rules(vocab_parallel=True) over t for a transformer with a
    vocabulary head (`transformer.vocab_head`: a classifier or a bare
    backbone has none, and no logits are costed) whose vocabulary t
    divides, without sequence parallelism (`transformer.vocab_parallel`),
    when it splits only the vocabulary's heads; else None (the head kept
    whole, and costed whole): a model without attention, a head
    auto_rules refuses or does not split (no `VocabParallel` rule), or a
    `VocabParallel` rule on a layer without the vocabulary (another
    output of a model with several)."""
    model_dims = transformer_lib.read(profile)
    if model_dims is None or not transformer_lib.vocab_parallel(
            model_dims, t, sequence_parallel):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rules = auto_plan.auto_rules(model, axis_size=t,
                                         vocab_parallel=True)
        except ValueError:
            return None
    heads = [cost_lib.layer_for(profile, pattern)
             for pattern, style in rules.items()
             if isinstance(style, styles.VocabParallel)]
    if not heads or not all(
            layer is not None and any(model_dims.vocab in tuple(w.shape)
                                      for w in layer.weights)
            for layer in heads):
        return None
    return rules
