"""`MixtureOfExperts`: a Keras mixture-of-experts feed-forward layer.

The math (routing, capacity, dispatch, combine, load-balancing loss) is
`tfpar.experts`'; this module owns the Keras face: arguments checked when
the layer is made, weights (the router kernel [hidden, experts] and the
expert banks [experts, in, out]) laid out when it is built, the auxiliary
loss added with `add_loss`, the dropped assignments of the last training
batch kept in a non-trainable weight, and the config.
"""

import numbers

import keras
import tensorflow as tf

from tfpar import experts
from tfpar import parallel_dims

def expert_split(dims):
    """(axis, size) of the expert axis of `dims`' mesh when it has more
    than one device, else (None, 1)."""
    if dims is None:
        return None, 1
    axis = experts.expert_axis_of(dims)
    if axis not in dims.mesh.axis_names or dims.mesh.axis_size(axis) < 2:
        return None, 1
    return axis, dims.mesh.axis_size(axis)


def _check_int(name, value, low, high=None, hint=""):
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or value < low or (high is not None and value > high)):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(
            f"MixtureOfExperts: {name} must be an integer {bound}. "
            f"Received: {name}={value!r}.{hint}")


def check_arguments(num_experts, top_k, intermediate_dim, capacity_factor,
                    aux_loss_coef, router, group_size):
    """Raises a ValueError naming the first bad argument."""
    _check_int("num_experts", num_experts, 1)
    _check_int("top_k", top_k, 1, num_experts,
               f" A token cannot choose more experts than the "
               f"{num_experts} there are: lower top_k or add experts.")
    _check_int("intermediate_dim", intermediate_dim, 1)
    if capacity_factor is not None and (
            isinstance(capacity_factor, bool)
            or not isinstance(capacity_factor, numbers.Real)
            or not capacity_factor > 0):
        raise ValueError(
            "MixtureOfExperts: capacity_factor must be None (dropless) or a "
            "number > 0 (e.g. 1.25: each expert takes 1.25 x its balanced "
            f"share of a group's tokens). Received: capacity_factor="
            f"{capacity_factor!r}.")
    if (isinstance(aux_loss_coef, bool)
            or not isinstance(aux_loss_coef, numbers.Real)
            or aux_loss_coef < 0):
        raise ValueError(
            "MixtureOfExperts: aux_loss_coef must be a number >= 0 (0: no "
            f"load-balancing loss). Received: aux_loss_coef={aux_loss_coef!r}.")
    if router not in experts.ROUTERS:
        raise ValueError(f"MixtureOfExperts: router must be one of "
                         f"{experts.ROUTERS}. Received: router={router!r}.")
    if group_size is not None:
        _check_int("group_size", group_size, 1)


@keras.saving.register_keras_serializable(package="tfpar")
class MixtureOfExperts(keras.layers.Layer):
    """A mixture-of-experts feed-forward layer: each token goes to the
    `top_k` of `num_experts` feed-forward networks its router picks, and
    gets their outputs summed, weighted by the router's probabilities
    (computed in float32). Input and output: [batch, seq, hidden]. Put it
    where a transformer has its MLP, inside the residual (a token whose
    assignments are dropped then passes through unchanged).

    Under a `tfpar.ParallelStrategy` whose mesh has an expert axis
    (`expert_axis`, default "expert") with more than one device, the
    expert banks are split over it along the experts (build the model in
    the strategy's scope) and each device computes only its experts'
    tokens; elsewhere (one device, data-only meshes) the same results.
    How tokens are dispatched and what it costs: `tfpar.experts`.

    Capacity: with `capacity_factor` None (the default) no token is
    dropped and each expert computes as many slots as a group has tokens:
    exactly the results, and the cost, of computing every expert on every
    token and masking. For speed set a factor (1.0-1.25 is usual): an
    expert then computes ceil(capacity_factor * top_k * group / experts)
    slots per dispatch group of `group_size` tokens of one sequence
    (default: the whole sequence), assignments past that are dropped
    (first choices are served before second ones, then in token order),
    and `dropped_tokens` holds the count of the last training batch.

    Aux loss: `aux_loss_coef` times Switch's load-balancing loss (as
    keras-hub's Mixtral) is added with `add_loss`, so `fit` minimises it.

    Saving: registered as "tfpar>MixtureOfExperts"; a `.keras` file
    holding it loads where `tfpar` is imported (without it, Keras'
    `load_model` raises a TypeError whose message says "Could not locate
    class 'MixtureOfExperts'"). Loaded or built outside a strategy's
    scope, the banks are whole on every device (as Keras made them).

    Example:

    >>> inputs = keras.Input((16, 64))
    >>> mixed = tfpar.layers.MixtureOfExperts(
    ...     num_experts=8, top_k=2, intermediate_dim=128,
    ...     capacity_factor=1.25)(inputs)
    >>> model = keras.Model(inputs, keras.layers.Add()([inputs, mixed]))

    Args:
        num_experts: experts per layer.
        top_k: experts per token (1 <= top_k <= num_experts).
        intermediate_dim: each expert's hidden width.
        capacity_factor: None (dropless) or a number > 0.
        activation: the expert FFN's activation (a Keras activation name).
        gated: down(activation(gate x) * up x) (SwiGLU with silu) when
            True, else down(activation(up x)).
        aux_loss_coef: weight of the load-balancing loss (0: none).
        router: "softmax" or "sigmoid".
        normalize_top_k: whether a token's top-k weights are divided by
            their sum (Mixtral) or kept as probabilities.
        group_size: tokens of one dispatch group (a divisor of the
            sequence length), or None: one group per sequence.
        kernel_initializer: initializer of the router and the banks.
    """

    def __init__(self, num_experts, top_k, intermediate_dim,
                 capacity_factor=None, activation="silu", gated=True,
                 aux_loss_coef=0.01, router="softmax", normalize_top_k=True,
                 group_size=None, kernel_initializer="glorot_uniform",
                 **kwargs):
        super().__init__(**kwargs)
        check_arguments(num_experts, top_k, intermediate_dim,
                        capacity_factor, aux_loss_coef, router, group_size)
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.intermediate_dim = int(intermediate_dim)
        self.capacity_factor = capacity_factor
        self.activation = keras.activations.get(activation)
        self.gated = bool(gated)
        self.aux_loss_coef = float(aux_loss_coef)
        self.router = router
        self.normalize_top_k = bool(normalize_top_k)
        self.group_size = group_size
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        self._check_input_shape(input_shape)
        hidden = input_shape[-1]
        axis, size = expert_split(parallel_dims.current())
        if self.num_experts % size:
            raise ValueError(
                f"MixtureOfExperts {self.name!r}: num_experts="
                f"{self.num_experts} does not divide over the expert axis "
                f"{axis!r} of size {size}. Use a multiple of {size} experts "
                "or a smaller expert axis.")
        bank = None if axis is None else (axis, None, None)
        self.router_kernel = self._weight("router_kernel",
                                          (hidden, self.num_experts),
                                          autocast=False)
        width = (self.num_experts, hidden, self.intermediate_dim)
        self.up_kernel = self._weight("up_kernel", width, bank)
        self.gate_kernel = (self._weight("gate_kernel", width, bank)
                            if self.gated else None)
        self.down_kernel = self._weight(
            "down_kernel", (self.num_experts, self.intermediate_dim, hidden),
            bank)
        self.dropped_tokens = self.add_weight(
            shape=(), initializer="zeros", dtype="float32", trainable=False,
            name="dropped_tokens")

    def _weight(self, name, shape, axes=None, autocast=True):
        """A trainable weight; `axes` (one mesh axis or None per dimension)
        is its layout under a tfpar strategy (Keras' `TensorLayout`)."""
        layout = (None if axes is None
                  else keras.distribution.TensorLayout(list(axes)))
        with keras.name_scope(self.name, caller=self):
            variable = keras.Variable(
                initializer=self.kernel_initializer, shape=shape,
                dtype=self.variable_dtype, trainable=True, autocast=autocast,
                name=name, layout=layout)
        self._track_variable(variable)
        return variable

    def _check_input_shape(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None:
            raise ValueError(
                f"MixtureOfExperts {self.name!r} takes [batch, seq, hidden] "
                f"inputs with a known hidden size. Received: input_shape="
                f"{tuple(input_shape)}.")
        seq = input_shape[1]
        if self.group_size is not None and seq is not None and (
                seq % self.group_size):
            raise ValueError(
                f"MixtureOfExperts {self.name!r}: group_size="
                f"{self.group_size} does not divide the sequence length "
                f"{seq}. Use a divisor of {seq}, or None (one group per "
                "sequence).")

    def call(self, inputs, training=None):
        dims = parallel_dims.current()
        result = experts.moe(
            inputs, self.router_kernel, self._experts, self.num_experts,
            self.top_k, capacity_factor=self.capacity_factor,
            group_size=self.group_size, router=self.router,
            normalize=self.normalize_top_k,
            expert_axis=experts.expert_axis_of(dims),
            batch_axis=getattr(dims, "data_axis", None))
        if self.aux_loss_coef:
            self.add_loss(self.aux_loss_coef * result.aux_loss)
        if training:
            self.dropped_tokens.assign(tf.cast(result.dropped, tf.float32))
        return result.outputs

    def _experts(self, slots):
        return experts.expert_ffn(slots, self.up_kernel, self.gate_kernel,
                                  self.down_kernel, self.activation)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            num_experts=self.num_experts, top_k=self.top_k,
            intermediate_dim=self.intermediate_dim,
            capacity_factor=self.capacity_factor,
            activation=keras.activations.serialize(self.activation),
            gated=self.gated, aux_loss_coef=self.aux_loss_coef,
            router=self.router, normalize_top_k=self.normalize_top_k,
            group_size=self.group_size,
            kernel_initializer=keras.initializers.serialize(
                self.kernel_initializer))
        return config
