"""Named collectives: each relayout between meshes or layouts in one place.

(The `styles` branch writes the top of this module: fsdp gathers, sequence-
parallel gathers/scatters, hidden gathers. The pipeline's stage-to-stage
moves are the section at the end.)
"""

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import placement


# --- stage-to-stage moves (pipeline) ---
# A pipeline step runs each model part on its stage's sub-mesh; a DTensor op
# reads tensors of one mesh only, so what crosses from part k to part k' is
# moved: relaid out to replicated on the source mesh (an all-gather over the
# source's axes), copied to the target mesh whole (`copy_to_mesh`: the
# source's devices send, the target's receive), relaid out there to the
# layout the target reads (a local slice, no communication). Forward moves
# carry activations (and the losses added so far), backward moves their
# gradients; a tied weight (read on a later part) and its gradient move the
# same way, laid out as the weight is. Each move is one name scope
# ("send_k_to_k'", "tie_k_to_k'"), which tests and profiles read.


def move_to_mesh(tensor, source, target, spec, scope):
    """`tensor` from `tfpar.Mesh` `source` to `target`, laid out there by
    `spec`, in name scope `scope`; unchanged when the meshes are one (two
    parts on one stage)."""
    if source is target:
        return tensor
    rank = tensor.shape.rank
    with tf.name_scope(scope):
        whole = dtensor.relayout(tensor, dtensor.Layout.replicated(
            source.dtensor_mesh, rank))
        moved = dtensor.copy_to_mesh(whole, dtensor.Layout.replicated(
            target.dtensor_mesh, rank))
        return placement.relayout(moved, spec, target)


def batch_spec(rank, split, data_axis):
    """The layout spec of a micro-batch's activation (or its gradient): the
    batch dimension split over `data_axis` when `split`, the rest whole."""
    spec = [None] * rank
    if rank and split:
        spec[0] = data_axis
    return tuple(spec)


def send_activation(tensor, source_part, target_part, meshes, split,
                    data_axis):
    """An activation (or its gradient) of part `source_part` moved to part
    `target_part` (`meshes[k]`: part k's mesh), batch-split as every
    activation is (`batch_spec`)."""
    return move_to_mesh(
        tensor, meshes[source_part], meshes[target_part],
        batch_spec(tensor.shape.rank, split, data_axis),
        f"send_{source_part}_to_{target_part}")


def send_tied(tensor, source_part, target_part, meshes, spec):
    """A tied weight's value (or its gradient) moved between parts, laid
    out by the weight's own `spec` on the target."""
    return move_to_mesh(tensor, meshes[source_part], meshes[target_part],
                        spec, f"tie_{source_part}_to_{target_part}")
