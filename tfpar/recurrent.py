"""Keras' recurrent layers (LSTM, GRU, SimpleRNN, ConvLSTM, Bidirectional,
any `keras.layers.RNN` cell) inside a tfpar step.

Keras' TensorFlow backend runs a recurrence as a `tf.while_loop` over a
`TensorArray`, and DTensor 2.21 lays out no TensorList op ("'tf.
EmptyTensorList' op does not implement layout propagation"): every
recurrent layer failed to compile, on a data-only mesh too
(tests/dtensor_tensor_list_repro.py). In a step the recurrence is
unrolled instead (`unrolled_rnn`): Keras' own `unroll=True` path, one copy
of the cell per time step — the same math, so the same values as one
device — which needs a sequence length known when the step is traced. A
step's graph then grows with the sequence length (its compile time does,
not its memory: a loop keeps every step's activations for the backward
pass too). The cuDNN kernels (`backend.lstm`, `backend.gru`) are declined
in a step, so Keras takes that generic path on a GPU as well.

Keras' `ops.map` and `ops.scan` loop over TensorArrays too; a step
writes their loops out as well (`spmd_ops.unrolled_map`,
`spmd_ops.unrolled_scan`). keras-hub's RWKV-7 runs its recurrence (the
generalized delta rule) as a Python loop writing each time step's output
to a `tf.TensorArray`, stacked at the end: a step stacks them from a list
instead (`delta_rule_stacked`, the same math).

Outside a step Keras' and keras-hub's functions run unchanged.

>>> import tfpar
>>> [patch.attribute for patch in PATCHES]
['rnn', 'lstm', 'gru', 'rnn_generalized_delta_rule']
"""

import functools
import warnings

import keras
import tensorflow as tf
from keras import ops

from tfpar import _compat
from tfpar.step_context import in_spmd_step


# Sequences longer than this warn that the unrolled step compiles slowly.
LONG_SEQUENCE = 256


def _keras_backend():
    return _compat.keras_module("backend")


def unrolled_rnn(rnn, step_function, inputs, initial_states,
                 go_backwards=False, mask=None, constants=None, unroll=False,
                 input_length=None, time_major=False,
                 zero_output_for_mask=False, return_all_outputs=True):
    """Keras' TF `rnn` (passed as `rnn`, same arguments) with
    `unroll=True`, or a ValueError naming the layer when the inputs' time
    dimension (axis 1; 0 when `time_major`) is unknown.

    A backwards recurrence reads its inputs and mask reversed along time
    here (`_reversed_in_time`) and runs forwards: Keras' unrolled path
    zeroes masked outputs (`zero_output_for_mask`, which Bidirectional sets
    when it returns sequences) with the mask in its original order beside
    outputs in reversed order, where its loop reverses both — a masked
    Bidirectional LSTM unrolled gave other outputs than its loop (0.46
    apart)."""
    time_axis = 0 if time_major else 1
    first = tf.nest.flatten(inputs)[0]
    if first.shape.rank is None or first.shape[time_axis] is None:
        raise ValueError(
            f"The recurrent layer at '{tf.get_current_name_scope()}' got "
            f"inputs of shape {first.shape}, with no fixed number of time "
            f"steps (axis {time_axis}). Under tfpar a recurrence is unrolled "
            "in the training step (DTensor 2.21 cannot lay out the "
            "TensorList ops of Keras' loop), so the step needs the sequence "
            "length: give keras.Input a fixed length, e.g. keras.Input("
            "(128, features)), and pad or cut every batch to it (e.g. "
            "dataset.padded_batch(batch, padded_shapes=...)).")
    steps = first.shape[time_axis]
    if steps > LONG_SEQUENCE:
        warnings.warn(
            f"tfpar unrolls the recurrent layer at "
            f"'{tf.get_current_name_scope()}' over {steps} time steps in the "
            f"step (DTensor 2.21 cannot run Keras' loop): the step's graph "
            f"holds {steps} copies of the cell, so compiling it takes long "
            "(about 10 s per 100 steps of an LSTM on a CPU host). Shorter "
            "sequences (e.g. a sequence split into chunks) compile faster.",
            stacklevel=2)
    if go_backwards:
        inputs = tf.nest.map_structure(
            lambda x: _reversed_in_time(x, time_axis), inputs)
        if mask is not None:
            mask = _reversed_in_time(mask, time_axis)
    return rnn(step_function, inputs, initial_states, go_backwards=False,
               mask=mask, constants=constants, unroll=True,
               input_length=input_length, time_major=time_major,
               zero_output_for_mask=zero_output_for_mask,
               return_all_outputs=return_all_outputs)


def _reversed_in_time(tensor, time_axis):
    """`tensor` with its time steps in reverse order, as the unrolled
    recurrence reads them: unstacked and stacked again (DTensor lays out
    both; it cannot lay out TF's ReverseV2)."""
    steps = tf.unstack(tensor, axis=time_axis)
    return tf.stack(steps[::-1], axis=time_axis)


def has_recurrent_layers(model):
    """Whether `model` (a Keras layer) holds a `keras.layers.RNN` (LSTM,
    GRU, SimpleRNN, ConvLSTM, a Bidirectional's copies, any RNN cell).
    tfpar's steps of such a model trace each input shape exactly, without
    relaxing a varying sequence length to None.

    >>> import keras
    >>> has_recurrent_layers(keras.Sequential([keras.layers.LSTM(2)]))
    True
    """
    return any(isinstance(layer, keras.layers.RNN)
               for layer in _compat.all_layers(model))


def _unrolled_in_step(original, hooks):
    """Keras' `backend.rnn` unrolled in a step (`unrolled_rnn`)."""
    @functools.wraps(original)
    def rnn(step_function, inputs, initial_states, *args, **kwargs):
        if not in_spmd_step():
            return original(step_function, inputs, initial_states, *args,
                            **kwargs)
        return unrolled_rnn(original, step_function, inputs,
                            initial_states, *args, **kwargs)

    return rnn


def _no_cudnn_in_step(original, hooks):
    """Keras' cuDNN `backend.lstm` / `backend.gru` declined in a step
    (NotImplementedError: the layer then runs its cell through
    `backend.rnn`, which a step unrolls); DTensor lays out no cuDNN RNN
    op."""
    @functools.wraps(original)
    def cudnn_recurrence(*args, **kwargs):
        if in_spmd_step():
            raise NotImplementedError
        return original(*args, **kwargs)

    return cudnn_recurrence


def delta_rule_stacked(r, w, k, v, a, b, initial_state=None,
                       output_final_state=True, head_first=False):
    """keras-hub RWKV-7's recurrence (`rwkv7_layer.
    rnn_generalized_delta_rule`, the same arguments and math), each time
    step's output stacked from a Python list where keras-hub writes a
    `tf.TensorArray` (its `TensorListStack` has no DTensor layout). Per
    head, with S the N × N state and r, w, k, v, a, b the step's vectors
    (w = exp(-exp(w)) the decay):

        S ← S · diag(w) + (S a) bᵀ + v kᵀ,   o = S r

    >>> import numpy as np
    >>> x = np.ones((1, 2, 1, 2), "float32")      # (batch, time, heads, N)
    >>> out, state = delta_rule_stacked(x, x, x, x, x * 0, x * 0)
    >>> out.shape, state.shape
    (TensorShape([1, 2, 1, 2]), TensorShape([1, 1, 2, 2]))
    """
    dtype = r.dtype
    batch, steps, heads, n = ops.shape(r)
    r, w, k, v, a, b = (ops.cast(ops.transpose(x, (0, 2, 1, 3))
                                 if head_first else x, "float32")
                        for x in (r, w, k, v, a, b))
    w = ops.exp(-ops.exp(w))
    state = (ops.zeros((batch, heads, n, n)) if initial_state is None
             else ops.broadcast_to(initial_state, (batch, heads, n, n)))
    state = ops.cast(state, "float32")
    outputs = []
    for t in range(steps):
        kk = ops.reshape(k[:, t, :], (batch, heads, 1, n))
        rr = ops.reshape(r[:, t, :], (batch, heads, n, 1))
        vv = ops.reshape(v[:, t, :], (batch, heads, n, 1))
        aa = ops.reshape(a[:, t, :], (batch, heads, n, 1))
        bb = ops.reshape(b[:, t, :], (batch, heads, 1, n))
        state = state * w[:, t, :, None, :] + state @ aa @ bb + vv @ kk
        outputs.append(ops.reshape(ops.cast(state @ rr, dtype),
                                   (batch, heads, n)))
    out = ops.stack(outputs, axis=1)
    return (out, state) if output_final_state else out


def _delta_rule_stacked_in_step(original, hooks):
    """keras-hub RWKV-7's recurrence stacked from a list in a step
    (`delta_rule_stacked`), its own elsewhere."""
    @functools.wraps(original)
    def delta_rule(*args, **kwargs):
        if in_spmd_step():
            return delta_rule_stacked(*args, **kwargs)
        return original(*args, **kwargs)

    return delta_rule


PATCHES = (
    _compat.Patch("rnn", _keras_backend, "rnn", _unrolled_in_step),
    _compat.Patch("lstm", _keras_backend, "lstm", _no_cudnn_in_step),
    _compat.Patch("gru", _keras_backend, "gru", _no_cudnn_in_step),
    # keras-hub binds it to each RWKV-7 time-mix layer as it is built (in
    # the strategy's scope, after the patch).
    _compat.Patch("rwkv7_delta_rule", _compat.optional_owner(
        "keras_hub.src.models.rwkv7.rwkv7_layer"),
        "rnn_generalized_delta_rule", _delta_rule_stacked_in_step),
)
