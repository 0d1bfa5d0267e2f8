"""Copies of a Keras optimizer that keep what its config does not carry.

tfpar copies an optimizer twice: one made outside `strategy.scope()` is
rebuilt under it (`strategy.adopt_optimizer`), and a pipeline gives each
stage but the last a copy for its part's weights (`PipelineModel.
stage_optimizers`). Keras' `from_config` rebuilds everything its config
holds, but `exclude_from_weight_decay(var_list=..., var_names=...)` is kept
on the instance only, so a plain `from_config` copy decays the weights the
user excluded (AdamW's norms and biases, typically) and trains differently
from one device without a word. `copy_optimizer` carries those exclusions
over, into a `LossScaleOptimizer`'s inner optimizer and a
`MultiOptimizer`'s sub-optimizers too; `stand_in_exclusions` extends them
to the variables an optimizer updates in a weight's place (offload's host
copies, `tfpar.offload.host.Offload.mirror`). A copy then follows its
original's learning rates and step counters, and those of every optimizer
they delegate to (`with_delegates`, `keep_in_step`: what a pipeline's stage
copies take after a callback or a checkpoint restore).

>>> import keras
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> adamw = keras.optimizers.AdamW(weight_decay=0.1)
>>> adamw.exclude_from_weight_decay(var_names=["bias"])
>>> copy = copy_optimizer(adamw)
>>> for weight in model.trainable_variables:
...     _ = weight.assign(keras.ops.ones(weight.shape))
>>> copy.apply([keras.ops.zeros((2, 1)), keras.ops.zeros((1,))],
...            model.trainable_variables)  # zero gradients: decay only
>>> [round(float(w.numpy().ravel()[0]), 6) for w in model.trainable_variables]
[0.9999, 1.0]
"""
import keras

from tfpar import _compat


def sub_optimizers(optimizer):
    """The optimizers `optimizer` delegates to: a `LossScaleOptimizer`'s
    inner optimizer, a `MultiOptimizer`'s sub-optimizers (in order), else
    none."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return [optimizer.inner_optimizer]
    if isinstance(optimizer, keras.optimizers.MultiOptimizer):
        return list(optimizer.optimizers)
    return []


def copy_optimizer(optimizer):
    """A new, unbuilt optimizer from `optimizer`'s config (made under the
    current strategy scope), excluding from weight decay what `optimizer`
    and each optimizer it delegates to exclude."""
    copy = type(optimizer).from_config(optimizer.get_config())
    _carry_exclusions(optimizer, copy)
    return copy


def _carry_exclusions(source, target):
    keys, pattern = _compat.weight_decay_exclusions(source)
    if keys or pattern is not None:
        _compat.set_weight_decay_exclusions(target, keys, pattern)
    # A MultiOptimizer whose map is a function makes sub-optimizers as it
    # builds: those of a copy are the function's, with its exclusions.
    for inner, inner_copy in zip(sub_optimizers(source),
                                 sub_optimizers(target)):
        _carry_exclusions(inner, inner_copy)


def stand_in_exclusions(optimizer, weights):
    """Reads which of `weights` `optimizer` (unbuilt; and each optimizer
    it delegates to) excludes from weight decay, and returns
    `exclude(stand_ins)`, which makes it exclude the stand-in of each of
    them (`stand_ins[i]` updated in the place of `weights[i]`). Call it
    before the stand-ins exist: offload's "+master" gives a weight new
    storage, and with it a new key. (Exclusions by name need nothing: a
    stand-in keeps its weight's name.)"""
    excluded = []
    for inner in with_delegates(optimizer):
        keys, _ = _compat.weight_decay_exclusions(inner)
        excluded.append((inner, [
            _compat.optimizer_variable_key(inner, weight) in keys
            for weight in weights]))

    def exclude(stand_ins):
        for inner, flags in excluded:
            keys, pattern = _compat.weight_decay_exclusions(inner)
            added = {_compat.optimizer_variable_key(inner, stand_in)
                     for stand_in, flag in zip(stand_ins, flags) if flag}
            if added:
                _compat.set_weight_decay_exclusions(inner, keys | added,
                                                    pattern)

    return exclude


def with_delegates(optimizer):
    """`optimizer` and every optimizer it delegates to (`sub_optimizers`),
    in order: an optimizer and its copy list theirs alike."""
    found = [optimizer]
    for inner in sub_optimizers(optimizer):
        found.extend(with_delegates(inner))
    return found


def keep_in_step(original, copies, rates_seen=None, iterations=False):
    """Gives `copies` of `original` (and each optimizer they delegate to)
    `original`'s learning rates, when they differ from `rates_seen` (the
    last call's), and with `iterations=True` its step counters. Returns the
    rates read: the next call's `rates_seen`."""
    sources = with_delegates(original)
    rates = tuple(None if rate is None else float(rate.numpy())
                  for rate in map(_compat.optimizer_learning_rate_variable,
                                  sources))
    for copy in copies:
        for source, target, rate in zip(sources, with_delegates(copy), rates):
            variable = _compat.optimizer_learning_rate_variable(target)
            if (rates != rates_seen and rate is not None
                    and variable is not None):
                variable.assign(rate)
            if iterations:
                target.iterations.assign(int(source.iterations.numpy()))
    return rates
